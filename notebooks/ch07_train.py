"""Data-parallel training with gradient accumulation and ``no_sync`` (chapter 07).

The same file runs three ways:

    torchrun --nproc_per_node=2 ch07_train.py --accum-steps 4 --micro-batch 16 --base-lr 0.05
    course_utils.launch(ch07_train.train, nprocs=2, kwargs={...})      # from a notebook cell
    python ch07_train.py --accum-steps 4                                 # one process, world size 1
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ch07_comm import count_allreduces
from torch.nn.parallel import DistributedDataParallel as DDP

import course_utils
from course_utils.data import make_dataset, make_model
from course_utils.workarounds import apply_all


def accumulation_step(model, optimizer, micro_batches, *, use_no_sync=True):
    """One optimizer step from k micro-batches; returns the mean loss over them.

    The loss of each micro-batch is divided by k so that the summed gradients equal the gradient
    of the mean loss over the whole batch.  All backward passes but the last run inside
    ``no_sync()``: DDP accumulates them locally and all-reduces once, on the last one.
    """
    k = len(micro_batches)
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        last = i == k - 1
        sync_ctx = model.no_sync() if (use_no_sync and not last) else contextlib.nullcontext()
        with sync_ctx:
            loss = F.cross_entropy(model(x), y) / k
            loss.backward()
        total += loss.item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def scaled_lr(step, *, base_lr, base_batch, effective_batch, warmup_steps=0):
    """Linear scaling rule with gradual warm-up (Goyal et al., 2017), for SGD.

    The peak rate is ``base_lr * effective_batch / base_batch``; during the first ``warmup_steps``
    steps the rate climbs linearly from ``base_lr`` (known to be safe) to the peak.  The rule is an
    SGD result; for Adam or AdamW start nearer ``sqrt(effective_batch / base_batch)`` times the rate
    (the square-root rule), and tune either way.
    """
    peak = base_lr * effective_batch / base_batch
    if warmup_steps and step < warmup_steps:
        return base_lr + (peak - base_lr) * step / warmup_steps
    return peak


def train(*, accum_steps=4, micro_batch=16, base_lr=0.05, base_batch=32, scale_lr=True,
          warmup_steps=0, epochs=2, n=8192, seed=0, eval_every=1024, use_no_sync=True):
    """Train the course model with SGD (momentum 0.9); return the loss curve and counters.

    Every rank draws the same permutation of the data set each epoch and takes its own slice of
    every global batch, so the global batch (``micro_batch x world x accum_steps`` samples) is the
    same whatever the split.  The loss on the whole data set is recorded every ``eval_every``
    samples.  Joins the process group if one exists, else creates (and later destroys) it.
    """
    backend, device = course_utils.backend_and_device()
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    X, Y = (t.to(device) for t in make_dataset(n).tensors)
    model = DDP(make_model(seed).to(device),
                device_ids=[device.index] if device.type == "cuda" else None)
    stats = count_allreduces(model)
    global_batch = micro_batch * world * accum_steps
    peak = base_lr * global_batch / base_batch if scale_lr else base_lr
    opt = torch.optim.SGD(model.parameters(), lr=peak, momentum=0.9)
    order = torch.Generator().manual_seed(seed + 1)  # the same permutation on every rank
    curve, step, seen = [], 0, 0
    for _ in range(epochs):
        perm = torch.randperm(n, generator=order).to(device)
        for start in range(0, n - global_batch + 1, global_batch):
            idx = perm[start:start + global_batch].view(accum_steps, world, micro_batch)[:, rank]
            lr = scaled_lr(step, base_lr=base_lr, base_batch=base_batch,
                           effective_batch=global_batch if scale_lr else base_batch,
                           warmup_steps=warmup_steps)
            for group in opt.param_groups:
                group["lr"] = lr
            loss = accumulation_step(model, opt, [(X[i], Y[i]) for i in idx],
                                     use_no_sync=use_no_sync)
            step += 1
            seen += global_batch
            course_utils.report(step=step, loss=loss, lr=lr)
            if seen % eval_every < global_batch:
                with torch.no_grad():
                    curve.append((seen, F.cross_entropy(model.module(X), Y).item()))
    result = {"curve": curve, "steps": step, "global_batch": global_batch, "peak_lr": peak,
              "allreduce_calls": stats.calls, "allreduce_bytes": stats.sent_bytes}
    if own_group:
        del model, opt  # free DDP before its process group (see ch07_comm)
        dist.destroy_process_group()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--accum-steps", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--base-lr", type=float, default=0.05, help="learning rate for --base-batch")
    ap.add_argument("--base-batch", type=int, default=32)
    ap.add_argument("--warmup-steps", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--no-sync-off", action="store_true", help="all-reduce on every micro-step")
    a = ap.parse_args()
    apply_all()  # WORKAROUND: torch 2.13 gloo shutdown bug; before init_process_group (ch. 09, sec. 11)
    if "RANK" not in os.environ:  # plain `python ch07_train.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(course_utils.free_port()))
    r = train(accum_steps=a.accum_steps, micro_batch=a.micro_batch, base_lr=a.base_lr,
              base_batch=a.base_batch, warmup_steps=a.warmup_steps, epochs=a.epochs,
              use_no_sync=not a.no_sync_off)
    if os.environ["RANK"] == "0":
        print(f"global batch {r['global_batch']}, {r['steps']} optimizer steps, peak lr "
              f"{r['peak_lr']:.3g}, {r['allreduce_calls']} all-reduces "
              f"({r['allreduce_bytes'] / 1e6:.2f} MB), final loss {r['curve'][-1][1]:.4f}")


if __name__ == "__main__":
    main()
