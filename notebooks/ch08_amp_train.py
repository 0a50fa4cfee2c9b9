"""Mixed-precision DDP training with ``torch.amp``: autocast, GradScaler, clipping (chapter 08).

The same file runs three ways:

    torchrun --nproc_per_node=2 ch08_amp_train.py --amp-dtype float16 --steps 20
    course_utils.launch(ch08_amp_train.train, nprocs=2, kwargs={...})   # from a notebook cell
    python ch08_amp_train.py --amp-dtype bfloat16                        # one process
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import course_utils
from course_utils.data import make_dataset, make_model
from course_utils.workarounds import apply_all


def train(*, amp_dtype="float16", steps=8, batch=64, lr=0.1, max_norm=1.0, init_scale=2.0**16,
          growth_interval=2000, inject_inf_at=None, inject_rank=1, sync=True, seed=0):
    """Train the course model with DDP under autocast; return one row per step.

    ``amp_dtype``: "float32" (no autocast), "bfloat16" or "float16".  The GradScaler is enabled
    only for float16: with ``enabled=False`` its calls pass straight through, so the loop is the
    same for every dtype.  ``inject_inf_at``: at that step, rank ``inject_rank`` puts an inf in
    its input, which makes its loss and gradients NaN.  ``sync=False`` runs every backward in
    ``no_sync()`` (no all-reduce), to show what the all-reduce contributes to the skip decision.
    """
    backend, device = course_utils.backend_and_device()
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = None if amp_dtype == "float32" else getattr(torch, amp_dtype)
    X, Y = (t.to(device) for t in make_dataset(steps * batch * world, seed=seed + 1).tensors)
    model = DDP(make_model(seed).to(device),
                device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scaler = torch.amp.GradScaler(device.type, init_scale=init_scale,
                                  growth_interval=growth_interval,
                                  enabled=dtype == torch.float16)
    rows = []
    for step in range(steps):
        start = (step * world + rank) * batch
        x, y = X[start:start + batch], Y[start:start + batch]
        if step == inject_inf_at and rank == inject_rank:
            x = x.clone()
            x[0, 0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        scale = scaler.get_scale()
        with contextlib.nullcontext() if sync else model.no_sync():
            with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
        scaler.unscale_(opt)  # gradients back to their true size, inf/NaN recorded
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(opt)      # skipped if unscale_ found inf/NaN
        scaler.update()       # halve the scale after a skip, double it after growth_interval good steps
        opt.zero_grad(set_to_none=True)
        skipped = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        rows.append({"step": step + 1, "scale": scale, "next_scale": scaler.get_scale(),
                     "skipped": skipped, "loss": loss.item(), "grad_norm": grad_norm.item()})
        course_utils.report(step=step + 1, total=steps, loss=loss.item(), scale=scaler.get_scale())
    params = torch.cat([p.detach().flatten().cpu() for p in model.parameters()])
    if own_group:
        del model, opt  # free DDP before its process group (see ch07_comm)
        dist.destroy_process_group()
    return {"rows": rows, "params": params}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--amp-dtype", default="float16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--inject-inf-at", type=int, default=None)
    a = ap.parse_args()
    apply_all()  # WORKAROUND: torch 2.13 gloo shutdown bug; before init_process_group (ch. 09, sec. 11)
    if "RANK" not in os.environ:  # plain `python ch08_amp_train.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(course_utils.free_port()))
    r = train(amp_dtype=a.amp_dtype, steps=a.steps, inject_inf_at=a.inject_inf_at)
    if os.environ["RANK"] == "0":
        for row in r["rows"]:
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in row.items()))


if __name__ == "__main__":
    main()
