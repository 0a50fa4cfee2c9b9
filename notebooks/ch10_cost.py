"""Chapter 10 helpers: DDP's communication per step, measured, for the α-β cost model.

Workers import this file (``from ch10_cost import ddp_comm_per_step``), as ``torchrun`` workers
would import a file beside the training script.  The all-reduce timing itself is chapter 03's, kept
in ``course_utils.measure.ch10.allreduce_seconds`` so that the lesson and exercise 10.c measure alike.
"""

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from course_utils import backend_and_device
from course_utils.data import make_dataset, make_model


def _timed_steps(model, x, y, steps, sync):
    """Seconds per training step (forward, backward, all-reduces), the fastest of ``steps``."""
    best = float("inf")
    for _ in range(steps):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def ddp_comm_per_step(caps_mb, hidden=512, batch=64, steps=8):
    """Worker: for each bucket cap, torch DDP's buckets (bytes) and its step time with and without
    communication (``no_sync``).  The difference is the communication DDP did not hide."""
    backend, device = backend_and_device()
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    x, y = make_dataset(batch * 4, seed=3).tensors
    x, y = x[dist.get_rank()::4][:batch].to(device), y[dist.get_rank()::4][:batch].to(device)
    out = []
    for cap in caps_mb:
        ddp = DDP(make_model(0, hidden=hidden).to(device), bucket_cap_mb=cap,
                  device_ids=[device.index] if device.type == "cuda" else None)
        sizes = []

        def recording(state, bucket, sizes=sizes):  # no annotations: DDP compares them as strings
            sizes.append(bucket.buffer().numel() * bucket.buffer().element_size())
            return allreduce_hook(None, bucket)

        ddp.register_comm_hook(None, recording)
        _timed_steps(ddp, x, y, 2, sync)  # warm-up; the first step also rebuilds the buckets
        sizes.clear()
        with_comm = _timed_steps(ddp, x, y, steps, sync)
        buckets = sizes[: len(sizes) // steps]
        with ddp.no_sync():
            compute = _timed_steps(ddp, x, y, steps, sync)
        out.append({"cap_mb": cap, "buckets": buckets, "step_s": with_comm, "compute_s": compute})
        del ddp
    dist.destroy_process_group()
    return backend, out
