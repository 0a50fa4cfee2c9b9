"""Chapter 10: ``torch.compile`` on a DDP model, and how it splits the graph at DDP's buckets.

Workers import this file (``from ch10_compile import compile_with_ddp``).  With
``torch._dynamo.config.optimize_ddp`` at its default (``"ddp_optimizer"``), compiling a model
wrapped in DDP hands the captured graph to ``DDPOptimizer`` (``torch/_dynamo/backends/
distributed.py``), which cuts it where a gradient bucket of ``bucket_cap_mb`` would end and gives
each piece to the backend separately; backward then runs piece by piece, and DDP's hooks can start
a bucket's all-reduce while the earlier pieces' backward still runs.  The backend here records
every piece it is given, so the number of pieces can be counted.
"""

import logging
import time

import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from course_utils import backend_and_device
from course_utils.data import CLASSES, DIM, make_dataset


class TallModel(nn.Module):
    """The course MLP with ``depth`` hidden layers instead of one, so that there are several
    bucket-sized weights (a ``hidden x hidden`` float32 weight is hidden² × 4 bytes: 1 MiB at 512).

    A model class of your own, not a bare ``nn.Sequential``: ``torch.compile`` starts compiling at
    the first Python frame outside torch's own files, and DDP calls the wrapped module from inside
    them; a bare ``nn.Sequential`` would only ever run eagerly."""

    def __init__(self, hidden=512, depth=6, seed=0):
        super().__init__()
        g_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        layers = [nn.Linear(DIM, hidden), nn.GELU()]
        for _ in range(depth):
            layers += [nn.Linear(hidden, hidden), nn.GELU()]
        self.net = nn.Sequential(*layers, nn.Linear(hidden, CLASSES))
        torch.random.set_rng_state(g_state)

    def forward(self, x):
        return self.net(x)


def counting_backend(name, pieces):
    """A ``torch.compile`` backend that appends each graph it receives (its number of parameter
    inputs, in bytes) to ``pieces`` and then compiles it with the named backend (``"aot_eager"``: AOT
    autograd traces forward and backward, and runs them with the usual kernels)."""
    inner = torch._dynamo.lookup_backend(name)

    def backend(gm, example_inputs, **kwargs):
        pieces.append(sum(t.numel() * t.element_size() for t in example_inputs
                          if isinstance(t, nn.Parameter)))
        return inner(gm, example_inputs, **kwargs)

    return backend


def _batches(steps, batch, rank, world):
    x, y = make_dataset(steps * batch * world, seed=5).tensors
    n = batch * world
    return [(x[s * n:(s + 1) * n][rank::world], y[s * n:(s + 1) * n][rank::world]) for s in range(steps)]


def _train(model, batches, device, sync, calls=()):
    """Plain SGD steps; seconds of each step (the first includes compilation when compiled), and
    how many entries ``calls`` had gained by the end of each step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    times, counts = [], []
    for x, y in batches:
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x.to(device)), y.to(device)).backward()
        opt.step()
        sync()
        times.append(time.perf_counter() - t0)
        counts.append(len(calls))
    return times, counts


def compile_with_ddp(caps_mb, backend="aot_eager", steps=3, batch=32, hidden=512, depth=6,
                     failing_cap_mb=None):
    """Worker: train ``TallModel`` under DDP eagerly, then compiled with each bucket cap; return
    the pieces the backend received (bytes of parameters in each), DDP's buckets in the last step
    (bytes; the first step uses one bucket, then DDP rebuilds them), the step times and the
    largest weight difference from eager DDP.  ``failing_cap_mb``: a cap to try as well; its
    error, if any, is returned."""
    # DDP's forward opens a profiler range, which dynamo leaves out of the graph with a warning on
    # every rank; that is expected here, so only errors are shown
    torch._logging.set_logs(dynamo=logging.ERROR)
    backend_name, device = backend_and_device()
    dist.init_process_group(backend_name, device_id=device if device.type == "cuda" else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ids = [device.index] if device.type == "cuda" else None
    batches = _batches(steps, batch, rank, world)

    eager = DDP(TallModel(hidden, depth).to(device), bucket_cap_mb=caps_mb[0], device_ids=ids)
    eager_times, _ = _train(eager, batches, device, sync)
    reference = [p.detach().clone() for p in eager.module.parameters()]
    del eager

    out = {"backend": backend_name, "compiler": backend, "eager_s": eager_times, "runs": []}
    for cap in caps_mb:
        torch._dynamo.reset()  # forget earlier compilations: each cap compiles afresh
        ddp = DDP(TallModel(hidden, depth).to(device), bucket_cap_mb=cap, device_ids=ids)
        calls = []

        def counting(state, bucket, calls=calls):  # no annotations: DDP compares them as strings
            calls.append(bucket.buffer().numel())  # float32: 4 bytes each
            return allreduce_hook(None, bucket)

        ddp.register_comm_hook(None, counting)
        pieces = []
        compiled = torch.compile(ddp, backend=counting_backend(backend, pieces))
        times, counts = _train(compiled, batches, device, sync, calls)
        diff = max((p.detach() - r).abs().max().item()
                   for p, r in zip(ddp.module.parameters(), reference))
        last = calls[counts[-2]:] if len(counts) > 1 else calls  # after DDP rebuilt its buckets
        out["runs"].append({"cap_mb": cap, "pieces": list(pieces), "buckets": [4 * n for n in last],
                            "step_s": times, "max_diff": diff})
        del compiled, ddp
    if failing_cap_mb is not None:
        torch._dynamo.reset()
        ddp = DDP(TallModel(hidden, depth).to(device), bucket_cap_mb=failing_cap_mb, device_ids=ids)
        try:
            _train(torch.compile(ddp, backend=counting_backend(backend, [])), batches[:1], device, sync)
            out["failing"] = (failing_cap_mb, None)
        except Exception as e:  # dynamo wraps the backend's error; keep its first line
            msg = str(e).strip().splitlines()
            out["failing"] = (failing_cap_mb, f"{type(e).__name__}: {msg[0] if msg else ''}")
        del ddp
    torch._dynamo.reset()
    dist.destroy_process_group()
    return out
