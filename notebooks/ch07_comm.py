"""Count what DDP all-reduces, with a DDP communication hook (chapters 07 and 08).

DDP hands every bucket of gradients to a *communication hook* when the bucket is ready; without a
hook it all-reduces the bucket itself.  ``count_allreduces(ddp_model)`` registers a hook that
counts each call and its bytes, then does the real work through another hook (by default
``allreduce_hook``, which behaves exactly like DDP without a hook)::

    stats = count_allreduces(ddp_model)                        # plain all-reduce
    stats = count_allreduces(ddp_model, fp16_compress_hook)    # gradient compression

``stats.calls`` counts bucket all-reduces, ``stats.bucket_bytes`` the gradient bytes DDP handed
over, ``stats.sent_bytes`` and ``stats.dtypes`` what the inner hook really passed to
``dist.all_reduce`` (wrapped once per process for this) until its result was ready.
A hook must be registered before the first backward pass, and only once per model.

Free a DDP model (``del model``) *before* calling ``dist.destroy_process_group()``: a DDP model
that outlives its process group can hang the worker, or abort it ("terminate called without an
active exception"), when it is finally freed.  Seen with torch 2.13 and gloo, with or without a
hook, in roughly one exit in four when this was written; chapter 09, section 11 explains the race.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

__all__ = ["CommStats", "counting_hook", "count_allreduces"]


@dataclasses.dataclass
class CommStats:
    calls: int = 0          # how many buckets were all-reduced
    bucket_bytes: int = 0   # gradient bytes DDP handed to the hook
    sent_bytes: int = 0     # bytes of the tensors the hook passed to dist.all_reduce
    dtypes: set = dataclasses.field(default_factory=set)  # dtypes of the tensors sent

    def reset(self) -> None:
        self.calls = self.bucket_bytes = self.sent_bytes = 0
        self.dtypes = set()

    def as_dict(self) -> dict:
        return {"calls": self.calls, "bucket_bytes": self.bucket_bytes,
                "sent_bytes": self.sent_bytes, "dtypes": sorted(self.dtypes)}


# CommStats of the buckets being all-reduced right now (from the hook's call until its future
# completes), and dist.all_reduce wrapped once per process to add each tensor sent to them.
# The window must last until the future completes: some hooks (PowerSGD) start further
# all-reduces from callbacks, after the hook itself has returned.
_in_flight: list = []


def _watch_all_reduce() -> None:
    if getattr(dist.all_reduce, "_counts_bytes", False):
        return
    real_all_reduce = dist.all_reduce

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any):
        for stats in {id(s): s for s in _in_flight}.values():
            stats.sent_bytes += tensor.numel() * tensor.element_size()
            stats.dtypes.add(str(tensor.dtype).replace("torch.", ""))
        return real_all_reduce(tensor, *args, **kwargs)

    all_reduce._counts_bytes = True
    dist.all_reduce = all_reduce


def counting_hook(stats: CommStats, inner: Callable = allreduce_hook, inner_state: Any = None):
    """A DDP communication hook that records each bucket, then lets ``inner`` all-reduce it."""
    _watch_all_reduce()

    # DDP checks these two annotations, so they must be real types (no postponed annotations).
    def hook(_state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        stats.calls += 1
        stats.bucket_bytes += buf.numel() * buf.element_size()
        _in_flight.append(stats)

        def done(fut: torch.futures.Future) -> torch.Tensor:
            try:
                return fut.value()
            finally:
                _in_flight.remove(stats)

        try:
            return inner(inner_state, bucket).then(done)
        except BaseException:
            _in_flight.remove(stats)
            raise

    return hook


def count_allreduces(ddp_model: torch.nn.Module, inner: Callable = allreduce_hook,
                     inner_state: Any = None) -> CommStats:
    """Register a counting hook on ``ddp_model``; return the ``CommStats`` it fills in."""
    stats = CommStats()
    ddp_model.register_comm_hook(None, counting_hook(stats, inner, inner_state))
    return stats
