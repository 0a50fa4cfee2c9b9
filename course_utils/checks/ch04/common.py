"""What both exercises of chapter 04 use: the data each rank trains on, the tolerance, the words
for a mismatch of collectives, and how a learner's exception is quoted."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...data import make_dataset, split

__all__ = ["ATOL", "MISMATCH_HINT", "describe_error", "rank_batches"]

ATOL = 1e-5

MISMATCH_HINT = ("the ranks did not call the same collectives: a collective inside "
                 "`if rank == 0:`, or a different number of all_reduce calls on different ranks "
                 "(for instance skipping parameters whose .grad is None on one rank only).")


def rank_batches(steps: int, global_batch: int, device: torch.device) -> list:
    """This rank's rows r::N of each of ``steps`` global batches of the course training split."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = split(make_dataset(4096), n_val=1024)[0].tensors
    out = []
    for s in range(steps):
        rows = (torch.arange(s * global_batch, (s + 1) * global_batch) % len(x))[rank::world]
        out.append((x[rows].to(device), y[rows].to(device)))
    return out


def describe_error(e: BaseException) -> str:
    """``TypeError: what it said`` on one line, at most 400 characters of the message."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:400]}"
