"""09.a end of epoch: a collective inside ``if rank == 0``.

``end_of_epoch(model, local_val_loss, path) -> float`` runs on two ranks (losses 1.0 and 3.0): every
rank returns the mean, rank 0 alone saves ``{"model": ..., "val_loss": ...}`` to ``path``, and no
rank returns before the file exists.  ``torch.save`` is slowed down while the learner's code runs
(``_slow_disk``), so that a missing barrier shows.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from ...checking import (
    Catalogue,
    CheckFailed,
    Misconception,
    Outcome,
    checker,
    compare_tensors,
    judge,
    process_group,
    require_callable,
    run_workers,
    state_to_cpu,
)
from ...data import make_model
from .common import FLOAT_HINT, WORLD, agree, number

__all__ = ["CATALOGUE", "check_checkpoint_collective"]

CATALOGUE = Catalogue(
    "09.a checkpoint collective",
    Misconception(
        "end_of_epoch_collective_on_rank_0_only",
        "only rank 0 saves, so only rank 0 needs the mean (all_reduce under `if rank == 0:`)",
        "a hang: rank 0 waits in all_reduce, rank 1 in the barrier",
        "the other ranks never join it (in a real loop their next collective would pair with it: a "
        "hang or a mismatched collective)"),
    Misconception(
        "end_of_epoch_barrier_inside_if",
        "the barrier under `if rank == 0:` makes the others wait for the save",
        "a hang: rank 0 waits alone in its barrier (the checker's own barrier is on a group of its "
        "own, so it cannot pair with that one)",
        "Compute the mean on every rank, save on rank 0 only, and put the barrier after the `if`."),
    Misconception(
        "end_of_epoch_local_loss",
        "this rank's loss is the validation loss",
        "a rank returned its own loss",
        "that is this rank's own loss: average it over all ranks with an all-reduce"),
    Misconception(
        "end_of_epoch_sum",
        "all_reduce gives the mean",
        "a rank returned the sum over ranks",
        "that is the sum over ranks: divide by the world size"),
    Misconception(
        "end_of_epoch_reduce_to_rank_0",
        "only rank 0 saves, so dist.reduce to rank 0 is enough",
        "rank 0 returned the mean, another rank did not",
        "rank 0 has the mean, this rank does not. Usual mistake: dist.reduce(t, dst=0) \"because "
        "only rank 0 saves\": reduce delivers the total to dst only, the other ranks' tensors do "
        "not hold it; every rank returns the mean, so all_reduce"),
    Misconception(
        "end_of_epoch_everyone_saves",
        "every rank may save the checkpoint",
        "torch.save ran on a rank other than 0",
        "only rank 0 should write the checkpoint (several ranks writing one file race each other)"),
    Misconception(
        "end_of_epoch_saves_only_the_loss",
        "the checkpoint is the loss",
        "the saved object is not a dict with 'model' and 'val_loss'",
        "the checkpoint must be a dict with keys 'model' (the state_dict) and 'val_loss'"),
    Misconception(
        "end_of_epoch_no_barrier",
        "rank 0's save is done when the other ranks return",
        "a rank returned while the checkpoint did not exist yet",
        "returned before the checkpoint existed (rank 0 was still writing it): end with "
        "dist.barrier() on every rank, after the `if rank == 0:` block, so nobody reads a "
        "half-written file"),
    Misconception(
        "end_of_epoch_tensor_mean",
        "a loss is a tensor",
        "a rank returned a torch.Tensor",
        FLOAT_HINT),
)
_hint = CATALOGUE.hint

_HANG = ("a collective (all_reduce inside a helper, or the barrier itself) is called only under "
         f"`if rank == 0:`; {_hint('end_of_epoch_collective_on_rank_0_only')}. "
         + _hint("end_of_epoch_barrier_inside_if"))


@contextlib.contextmanager
def _slow_disk(rank: int, saves: list[int]) -> Iterator[None]:
    """``torch.save`` notes the rank and takes 0.3 s more; the real one is back on the way out."""
    real_save = torch.save

    def slow_save(obj, f, *args, **kwargs):  # a slow disk makes a missing barrier visible
        saves.append(rank)
        time.sleep(0.3)
        return real_save(obj, f, *args, **kwargs)

    torch.save = slow_save
    try:
        yield
    finally:
        torch.save = real_save


def _worker(fn: Callable, path: str) -> Outcome:
    with process_group("gloo") as pg:
        saves: list[int] = []
        model = make_model(0, hidden=16)
        # The checker waits on a group of its own: a barrier on the default group would pair with a
        # barrier the learner's code called on one rank only, and hide that mistake.
        checker_group = dist.new_group(backend="gloo")
        with _slow_disk(pg.rank, saves):
            value = fn(model, 1.0 + 2.0 * pg.rank, path)
            exists_at_return = os.path.exists(path)
        dist.barrier(group=checker_group)
    return Outcome(pg.rank, data={"value": value, "saves": saves, "exists_at_return": exists_at_return,
                                  "state": state_to_cpu(model)})


@checker("09.a checkpoint collective")
def check_checkpoint_collective(end_of_epoch: Callable, *, timeout: float = 20.0) -> None:
    """Run ``end_of_epoch(model, local_val_loss, path)`` on two ranks (losses 1.0 and 3.0)."""
    require_callable(end_of_epoch, "end_of_epoch(model, local_val_loss, path)")
    with tempfile.TemporaryDirectory(prefix="ch09a-") as folder:
        _judge_run(end_of_epoch, os.path.join(folder, "checkpoint.pt"), timeout)


def _judge_run(end_of_epoch: Callable, path: str, timeout: float) -> None:
    """Run the two ranks with the checkpoint at ``path`` and judge what they did."""
    out = [o.data for o in judge(run_workers(_worker, WORLD, args=(end_of_epoch, path),
                                             timeout=timeout, hang_hint=_HANG), world=WORLD)]
    expected = sum(1.0 + 2.0 * r for r in range(WORLD)) / WORLD
    for r, o in enumerate(out):
        got = number(o["value"], "end_of_epoch", r)
        if not agree(got, expected):
            rank0_right = r > 0 and agree(number(out[0]["value"], "end_of_epoch", 0), expected)
            why = (_hint("end_of_epoch_local_loss") if agree(got, 1.0 + 2.0 * r) else
                   _hint("end_of_epoch_reduce_to_rank_0") if rank0_right else
                   _hint("end_of_epoch_sum") if agree(got, expected * WORLD) else
                   "expected the mean over all ranks")
            raise CheckFailed(f"rank {r} returned {got:g}, expected the mean validation loss "
                              f"{expected:g}; {why}")
    writers = sorted({r for o in out for r in o["saves"]})
    if any(r != 0 for r in writers):
        raise CheckFailed(f"rank(s) {[r for r in writers if r != 0]} also called torch.save: "
                          + _hint("end_of_epoch_everyone_saves"))
    if not os.path.exists(path):
        raise CheckFailed("no checkpoint at the path end_of_epoch was given: rank 0 must torch.save it there")
    ckpt = torch.load(path, map_location="cpu")
    if not isinstance(ckpt, dict) or "model" not in ckpt or "val_loss" not in ckpt:
        raise CheckFailed(_hint("end_of_epoch_saves_only_the_loss") + f"; got {type(ckpt).__name__} "
                          f"{sorted(ckpt) if isinstance(ckpt, dict) else ''}")
    if not agree(float(ckpt["val_loss"]), expected):
        raise CheckFailed(f"the checkpoint's val_loss is {float(ckpt['val_loss']):g}, expected "
                          f"the mean over ranks {expected:g}")
    compare_tensors(out[0]["state"], ckpt["model"], atol=0.0, what="the checkpoint's weights",
                    hint="save model.state_dict()")
    late = [r for r, o in enumerate(out) if not o["exists_at_return"]]
    if late:
        raise CheckFailed(f"rank(s) {late} " + _hint("end_of_epoch_no_barrier"))
