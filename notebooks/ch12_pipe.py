"""Chapter 12: a pipeline by hand (naive and GPipe, with a timeline) and torch's pipelining schedules.

Workers import this file (``from ch12_pipe import hand_pipeline, torch_schedules``).

- ``hand_pipeline(n_micros, compute)`` runs one GPipe step per entry of ``n_micros`` (1 micro-batch is
  the naive schedule) on every rank of the group, and returns each stage's events
  ``(kind, micro-batch, start, end)`` in seconds from a common start.  ``compute="fixed"`` replaces
  each stage's arithmetic by a fixed time (a sleep of ``T_FWD / n_micro`` per micro-batch forward,
  twice that backward), so that stages do not compete for the CPU; ``compute="real"`` runs the layers.
- ``torch_schedules(n_micro)`` runs the same model through ``torch.distributed.pipelining``'s
  schedules and returns, per schedule, the step time and the peak bytes of activations each stage's
  autograd graph held (counted by ``saved_tensors_hooks``; the weights that ``addmm`` saves for the
  gradient of its input are the parameters themselves, not activations, and are not counted).
"""

import contextlib
import copy
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from course_utils import backend_and_device

WIDTH, LAYERS, BATCH = 256, 8, 64
T_FWD = 0.040  # seconds of "compute" of one stage's forward over the whole batch, in the fixed mode


@contextlib.contextmanager
def group():
    backend, device = backend_and_device()
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    try:
        yield dist.get_rank(), dist.get_world_size(), device
    finally:
        dist.destroy_process_group()


def make_model(seed=0):
    """LAYERS blocks of Linear + Tanh; stage r of p gets blocks r*LAYERS/p ... (r+1)*LAYERS/p - 1."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)])


def data(device):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        return torch.randn(BATCH, WIDTH, device=device), torch.randn(BATCH, WIDTH, device=device)


class FixedCompute(nn.Module):
    """The stage's layers, plus a fixed time per forward and per backward (a sleep does not use the CPU)."""

    def __init__(self, layers, t_fwd):
        super().__init__()
        self.layers, self.t_fwd = layers, t_fwd

    def forward(self, x):
        time.sleep(self.t_fwd)
        out = self.layers(x)
        if out.requires_grad:
            out.register_hook(lambda g: time.sleep(2 * self.t_fwd))  # backward costs about 2x forward
        return out


def gpipe_step(stage, x_all, y_all, n_micro, log, t0):
    """One GPipe step by hand (the solution of exercise 12.a), noting each forward and backward."""
    rank, world = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == world - 1
    device = next(stage.parameters()).device
    shape = (BATCH // n_micro, WIDTH)
    saved = []
    for i in range(n_micro):
        if first:
            x = x_all.chunk(n_micro)[i]
        else:
            x = torch.empty(shape, device=device)
            dist.recv(x, src=rank - 1)
            x.requires_grad_()
        start = time.perf_counter() - t0
        out = stage(x)
        if last:
            out = F.mse_loss(out, y_all.chunk(n_micro)[i]) / n_micro
        log.append(("F", i, start, time.perf_counter() - t0))
        if not last:
            dist.send(out.detach(), dst=rank + 1)
        saved.append((x, out))
    for i in reversed(range(n_micro)):
        x, out = saved[i]
        grad = None
        if not last:
            grad = torch.empty_like(out)
            dist.recv(grad, src=rank + 1)
        start = time.perf_counter() - t0
        out.backward(grad)
        log.append(("B", i, start, time.perf_counter() - t0))
        if not first:
            dist.send(x.grad, dst=rank - 1)


def hand_pipeline(n_micros, compute="fixed", repeats=1):
    torch.set_num_threads(1)  # one core's worth per stage: the ranks share the machine's cores
    with group() as (rank, world, device):
        per = LAYERS // world
        x, y = data(device)
        runs = []
        for n_micro in n_micros:
            best = None
            for _ in range(repeats):
                layers = make_model()[rank * per:(rank + 1) * per].to(device)
                stage = FixedCompute(layers, T_FWD / n_micro) if compute == "fixed" else layers
                log = []
                dist.barrier()
                t0 = time.perf_counter()
                gpipe_step(stage, x, y, n_micro, log, t0)
                dist.barrier()
                step = time.perf_counter() - t0
                if best is None or step < best[1]:
                    grads = [p.grad.clone() for p in layers.parameters()]
                    best = (log, step, grads)
            runs.append({"n_micro": n_micro, "events": best[0], "step_s": best[1], "grads": best[2]})
        full = make_model().to(device)  # the single-process reference
        F.mse_loss(full(x), y).backward()
        ref = [p.grad for p in full[rank * per:(rank + 1) * per].parameters()]
        for r in runs:
            r["grad_diff"] = max(float((g - e).abs().max()) for g, e in zip(r.pop("grads"), ref))
        return runs


class ActivationMeter:
    """Bytes of tensors autograd saves for backward, live and at the peak, parameters left out.

    A Linear saves its weight for the gradient of its input (``addmm`` keeps ``mat2``): that tensor is
    the parameter itself (a view of its storage), held whatever the schedule, so it is not counted.
    """

    def __init__(self, params=()):
        self.live = self.peak = 0
        self.params = {p.untyped_storage().data_ptr() for p in params}

    def reset(self):
        self.live = self.peak = 0

    def pack(self, t):
        return _Saved(t, self)

    @staticmethod
    def unpack(saved):
        return saved.t


class _Saved:
    def __init__(self, t, meter):
        weight = t.untyped_storage().data_ptr() in meter.params
        self.t, self.meter, self.n = t, meter, 0 if weight else t.numel() * t.element_size()
        meter.live += self.n
        meter.peak = max(meter.peak, meter.live)

    def __del__(self):  # the graph that held this tensor is gone: its backward ran
        self.meter.live -= self.n


class Metered(nn.Module):
    def __init__(self, inner, meter):
        super().__init__()
        self.inner, self.meter = inner, meter

    def forward(self, x):
        with torch.autograd.graph.saved_tensors_hooks(self.meter.pack, self.meter.unpack):
            return self.inner(x)


SCHEDULES = {"GPipe": (ScheduleGPipe, 1), "1F1B": (Schedule1F1B, 1),
             "Interleaved1F1B": (ScheduleInterleaved1F1B, 2),
             "InterleavedZeroBubble": (ScheduleInterleavedZeroBubble, 2)}


def torch_schedules(n_micro, repeats=3):
    torch.set_num_threads(1)
    with group() as (rank, world, device):
        full = make_model().to(device)
        x, y = data(device)
        F.mse_loss(full(x), y).backward()
        out = {}
        for name, (cls, per_rank) in SCHEDULES.items():
            n_stages = world * per_rank
            per = LAYERS // n_stages
            indices = list(range(rank, n_stages, world))  # rank r holds stages r, r + world, ...
            parts = [copy.deepcopy(full[s * per:(s + 1) * per]) for s in indices]
            meter = ActivationMeter(p for part in parts for p in part.parameters())
            mods = [Metered(part, meter) for part in parts]
            stages = [PipelineStage(m, s, n_stages, device) for m, s in zip(mods, indices)]
            sched = cls(stages if per_rank > 1 else stages[0], n_microbatches=n_micro, loss_fn=F.mse_loss)
            times = []
            for _ in range(repeats):
                for m in mods:
                    m.zero_grad(set_to_none=True)
                meter.reset()
                dist.barrier()
                t0 = time.perf_counter()
                args = (x,) if rank == 0 else ()
                sched.step(*args, target=y if rank == world - 1 else None)
                times.append(time.perf_counter() - t0)
            diff = max(float((p.grad - q.grad).abs().max())
                       for m, s in zip(mods, indices)
                       for p, q in zip(m.inner.parameters(), full[s * per:(s + 1) * per].parameters()))
            out[name] = {"step_s": min(times), "peak_bytes": meter.peak, "grad_diff": diff,
                         "stages": indices}
        return {"rank": rank, "micro_bytes": (BATCH // n_micro) * WIDTH * 4, "schedules": out}
