"""Chapter 16: training that talks less. DDP, local SGD and DiLoCo, from scratch, on the course model.

Every replica (a rank here; on a real cluster a whole multi-GPU job) trains on its own batches.

* ``LocalSGD``: plain steps on each replica; every ``H`` steps the replicas' *parameters* are averaged
  (one all-reduce of the whole model), so they start the next round equal.  With ``H = 1`` and SGD
  this is DDP: the average of ``p - lr g_r`` is ``p - lr mean(g_r)``.
* ``DiLoCo``: ``H`` inner AdamW steps on each replica; then the *pseudo-gradient*, the global copy
  minus the local parameters (how far the replica moved, as a gradient would point), is averaged
  over the replicas, an outer SGD with Nesterov momentum steps the global copy with it, and every
  replica starts the next round from the new global copy.
* Streaming (``fragments=K``): the model is cut into K fragments of equal size (the parameters'
  elements in order; the paper cuts by layers, which this 3-layer model has too few of); fragment f is
  synchronised at its own steps, ``H/K`` apart from the next, so one sync sends about 1/K of the
  model. With ``overlap=T`` a fragment's all-reduce runs in the background while the replica takes
  ``T`` more inner steps; the outer step is applied when it arrives, and the fragment's local
  parameters are then mixed half and half with the new global ones (the local ones moved on
  meanwhile).
* ``comm="bf16"`` or ``"int8"``: the pseudo-gradients travel in bfloat16 (an all-reduce of half the
  bytes) or as int8 with one float32 scale per fragment (an all-gather: a sum of int8 values would
  overflow, so every replica receives all of them and averages in float32).

Run from the notebook with ``course_utils.launch(train_many, args=([config, ...],))``, or by hand:

    torchrun --nproc_per_node=2 ch16_diloco.py --algo diloco --H 16 --steps 256
"""

from __future__ import annotations

import argparse
import gc
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from course_utils import backend_and_device
from course_utils.data import make_dataset, make_model
from course_utils.devices import process_group_kwargs
from course_utils.workarounds import apply_all

DEFAULTS = dict(algo="diloco", H=16, steps=256, batch=32, inner="adamw", inner_lr=3e-3, outer_lr=0.7,
                momentum=0.9, comm="fp32", fragments=1, overlap=0, divergence=False, hidden=192,
                data_seed=0, eval_every=16)


def ring_bytes(payload: int, world: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``payload`` bytes: 2(N-1)/N of it."""
    return 2 * (world - 1) / world * payload


# ---- sending a list of tensors ----------------------------------------------------------------

def average_(tensors, group=None, comm="fp32", async_op=False):
    """Average ``tensors`` (in place) over ``group`` as one flat message.  Returns (bytes this rank
    sent, a function that finishes the average: with ``async_op`` the message may still be on its
    way until it is called).  fp32/bf16: an all-reduce; int8: an all-gather of int8 values with one
    float32 scale per rank (a sum of int8 values would overflow)."""
    world = dist.get_world_size(group)
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    if comm == "int8":
        scale = flat.abs().max().clamp_min(1e-12) / 127
        q = torch.cat([torch.round(flat / scale).to(torch.int8),
                       scale.reshape(1).view(torch.int8)])  # the scale's 4 bytes ride along
        gathered = torch.empty(world * q.numel(), dtype=torch.int8, device=q.device)
        work = dist.all_gather_single(gathered, q, group=group, async_op=async_op)
        sent = (world - 1) * q.numel()  # a ring all-gather forwards every other rank's part once

        def finish():
            if work is not None:
                work.wait()
            rows = gathered.view(world, -1)
            scales = rows[:, -4:].contiguous().view(torch.float32)
            mean = (rows[:, :-4].float() * scales).mean(0)
            _unflatten_into(tensors, mean)
        return sent, finish
    buf = flat.to(torch.bfloat16) if comm == "bf16" else flat
    work = dist.all_reduce(buf, group=group, async_op=async_op)
    sent = ring_bytes(buf.numel() * buf.element_size(), world)

    def finish():
        if work is not None:
            work.wait()
        _unflatten_into(tensors, buf.float() / world)
    return sent, finish


def _unflatten_into(tensors, flat):
    i = 0
    for t in tensors:
        t.copy_(flat[i:i + t.numel()].view_as(t))
        i += t.numel()


# ---- the algorithms ---------------------------------------------------------------------------

class LocalSGD:
    """Average the replicas' parameters every ``H`` steps: call ``after_step(step)`` after each
    optimizer step (``step`` counts them from 1).  Returns the bytes this rank sent (0 between syncs)."""

    def __init__(self, model, H, group=None, comm="fp32"):
        self.params = [p for p in model.parameters()]
        self.H, self.group, self.comm = H, group, comm

    @torch.no_grad()
    def after_step(self, step):
        if step % self.H:
            return 0
        sent, finish = average_(self.params, self.group, self.comm)
        finish()
        return sent


def _fragments(params, k):
    """The parameters cut into ``k`` fragments of (nearly) equal numbers of elements, in order: each
    fragment is a list of 1-D views into the parameters (writing to a view writes the parameter)."""
    flat = [p.detach().view(-1) for p in params]
    total = sum(v.numel() for v in flat)
    bounds = [round(total * f / k) for f in range(k + 1)]
    out = []
    for lo, hi in zip(bounds, bounds[1:]):
        frag, pos = [], 0
        for v in flat:
            a, b = max(lo, pos), min(hi, pos + v.numel())
            if a < b:
                frag.append(v[a - pos:b - pos])
            pos += v.numel()
        out.append(frag)
    return out


class DiLoCo:
    """The outer loop of DiLoCo around any inner optimizer: call ``after_step(step)`` after each
    inner step.  ``fragments``, ``overlap``: streaming (see the module's docstring)."""

    def __init__(self, model, H, outer_lr=0.7, momentum=0.9, group=None, comm="fp32", fragments=1,
                 overlap=0):
        self.fragments = _fragments([p for p in model.parameters()], fragments)
        # the global copy: what every replica agreed on at the fragment's last sync
        self.globals = [[p.detach().clone() for p in frag] for frag in self.fragments]
        # one outer optimizer over all global copies: its momentum lives as long as training does
        self.outer = torch.optim.SGD([g for frag in self.globals for g in frag], lr=outer_lr,
                                     momentum=momentum, nesterov=momentum > 0)
        if not 0 <= overlap < H:
            raise ValueError(f"overlap={overlap}: a fragment's exchange must arrive before its next "
                             f"one, so overlap < H={H}")
        self.H, self.group, self.comm, self.overlap = H, group, comm, overlap
        k = len(self.fragments)
        self.offsets = [((f + 1) * H // k) % H for f in range(k)]  # fragment f syncs at step % H == offset
        self.pending = []  # (due step, fragment, pseudo-gradients, finish)

    @torch.no_grad()
    def after_step(self, step):
        sent = 0
        for f, offset in enumerate(self.offsets):
            if step % self.H == offset and step >= self.H // len(self.fragments):
                pseudo = [g - p for g, p in zip(self.globals[f], self.fragments[f])]  # global - local
                nbytes, finish = average_(pseudo, self.group, self.comm, async_op=self.overlap > 0)
                sent += nbytes
                self.pending.append((step + self.overlap, f, pseudo, finish))
        for item in [x for x in self.pending if x[0] <= step]:
            self.pending.remove(item)
            _, f, pseudo, finish = item
            finish()
            self._outer_step(f, pseudo)
        return sent

    @torch.no_grad()
    def flush(self):
        """Finish the exchanges still under way (with ``overlap``, at the end of training)."""
        for _, f, pseudo, finish in self.pending:
            finish()
            self._outer_step(f, pseudo)
        self.pending.clear()

    def _outer_step(self, f, pseudo):
        for g, d in zip(self.globals[f], pseudo):
            g.grad = d
        # only this fragment's globals have a gradient: SGD skips parameters whose grad is None
        self.outer.step()
        for g in self.globals[f]:
            g.grad = None
        mix = 0.5 if self.overlap else 0.0  # the local copy moved on during the overlap: keep half
        for p, g in zip(self.fragments[f], self.globals[f]):
            p.mul_(mix).add_(g, alpha=1 - mix)


# ---- one training run -------------------------------------------------------------------------

def _batches(x, y, batch, seed):
    g = torch.Generator().manual_seed(seed)
    while True:
        for idx in torch.randperm(len(x), generator=g).split(batch):
            if len(idx) == batch:
                yield x[idx], y[idx]


@torch.no_grad()
def _eval_loss(model, xe, ye):
    return F.cross_entropy(model(xe), ye).item()


@torch.no_grad()
def _divergence(params, group=None):
    """sqrt(mean over replicas of |θ_r - θ̄|²) / |θ̄|: how far apart the replicas are (bookkeeping,
    its all-reduce is not counted as training traffic)."""
    flat = torch.cat([p.reshape(-1) for p in params])
    mean = flat.clone()
    dist.all_reduce(mean, group=group)
    mean /= dist.get_world_size(group)
    sq = (flat - mean).pow(2).sum().reshape(1)
    dist.all_reduce(sq, group=group)
    return math.sqrt(sq.item() / dist.get_world_size(group)) / mean.norm().item()


def run(cfg, device):
    """One configuration on this rank; the group is up.  Returns what it measured."""
    c = dict(DEFAULTS, **cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    data = make_dataset(8192 + 1024, seed=c["data_seed"]).tensors
    xt, yt = data[0][:8192][rank::world].to(device), data[1][:8192][rank::world].to(device)
    xe, ye = data[0][8192:].to(device), data[1][8192:].to(device)  # held out, the same on every rank
    model = make_model(0, hidden=c["hidden"]).to(device)
    algo = c["algo"]
    if algo.startswith("ddp"):
        net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        if algo == "ddp_fp16":
            net.register_comm_hook(None, fp16_compress_hook)
        elem = 2 if algo == "ddp_fp16" else 4
        grad_bytes = ring_bytes(sum(p.numel() for p in model.parameters()) * elem, world)
        outer, every = None, 1
    else:
        net = model
        grad_bytes = 0
        outer = (LocalSGD(model, c["H"], comm=c["comm"]) if algo == "local_sgd" else
                 DiLoCo(model, c["H"], c["outer_lr"], c["momentum"], comm=c["comm"],
                        fragments=c["fragments"], overlap=c["overlap"]))
        every = c["H"]
    opt = (torch.optim.AdamW(model.parameters(), lr=c["inner_lr"], weight_decay=0.0) if c["inner"] == "adamw"
           else torch.optim.SGD(model.parameters(), lr=c["inner_lr"]))
    batches = _batches(xt, yt, c["batch"], seed=1000 + rank)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    losses, evals, sent_log, div = [], [(0, 0.0, _eval_loss(model, xe, ye))], [], []
    sent = 0.0
    compute_s = 0.0
    for step in range(1, c["steps"] + 1):
        x, y = next(batches)
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        sync()
        compute_s += time.perf_counter() - t0
        sent += grad_bytes
        if outer is not None:
            b = outer.after_step(step)
            sent += b
            if b:
                sent_log.append((step, b))
        losses.append(loss.item())
        if c["divergence"]:
            div.append(_divergence(list(model.parameters())))
        if step % max(every, c["eval_every"]) == 0:
            evals.append((step, sent, _eval_loss(model, xe, ye)))
    if hasattr(outer, "flush"):
        outer.flush()  # no exchange may still be in flight when the next run starts
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    del net, opt, outer
    return {"cfg": c, "losses": losses, "evals": evals, "bytes": sent, "syncs": sent_log,
            "divergence": div, "compute_s": compute_s / c["steps"], "state": state}


def train_many(configs):
    """Worker: every configuration in turn in one process group.  Rank 0 returns its results
    (each with every rank's training losses averaged); the other ranks return None."""
    apply_all()  # WORKAROUND for a torch bug at exit (pytorch/pytorch#56297), not part of the algorithm
    backend, device = backend_and_device()
    dist.init_process_group(**process_group_kwargs(backend, device))
    out = []
    for cfg in configs:
        r = run(cfg, device)
        losses = torch.tensor(r["losses"], device=device)
        dist.all_reduce(losses)  # every replica's training loss, averaged, for the plot
        r["losses"] = (losses / dist.get_world_size()).tolist()
        r["backend"] = backend
        out.append(r)
    rank = dist.get_rank()
    dist.barrier()
    gc.collect()  # the DDP models of the runs are gone before their group is
    dist.destroy_process_group()
    return out if rank == 0 else None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for k, v in DEFAULTS.items():
        p.add_argument(f"--{k}", type=type(v) if not isinstance(v, bool) else int, default=v)
    cfg = vars(p.parse_args())
    cfg["divergence"] = bool(cfg["divergence"])
    out = train_many([cfg])
    if out:
        r = out[0]
        print(f"{r['cfg']['algo']}: loss {r['evals'][0][2]:.3f} -> {r['evals'][-1][2]:.3f} (held out) after "
              f"{r['cfg']['steps']} steps, {r['bytes'] / 2**20:.2f} MiB sent per rank")


if __name__ == "__main__":
    main()
