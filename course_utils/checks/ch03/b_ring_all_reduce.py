"""03.b ``check_ring_all_reduce(ring_all_reduce)``: ``ring_all_reduce(tensor)`` sums ``tensor`` in
place across ranks with ``dist.send`` / ``recv`` / ``isend`` / ``irecv`` only, as a ring: a
reduce-scatter phase then an all-gather phase, sending about ``2(N-1)/N`` times the tensor's size,
one piece per message, to ring neighbours only.  World sizes 2 to 4, sizes that divide by the world
size and sizes that do not.

What learners get wrong is ``CATALOGUE`` below: each entry's key names the answer written with that
misconception in tests/checkers/test_ch03_collectives.py, its message is what the failure says.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...checking import Catalogue, CheckFailed, Misconception, checker, require_callable
from .common import BLOCKING_SENDS, COLLECTIVES, NOT_DIVISIBLE, first_diff, run, same

__all__ = ["CATALOGUE", "check_ring_all_reduce"]

CATALOGUE = Catalogue(
    "03.b ring all-reduce",
    Misconception(
        "ring_reduce_scatter_only", "the reduce-scatter is the all-reduce",
        "one piece holds the full sum, the others partial sums",
        "The all-gather phase is missing: N-1 more steps in which each rank passes on the last fully "
        "reduced piece it holds, and the receiver copies it."),
    Misconception(
        "ring_adds_in_all_gather", "received pieces are always added",
        "some pieces hold the full sum plus a partial sum",
        "the all-gather phase adds what it receives. In that phase the received piece is already "
        "the complete sum: copy it into place (copy_ or recv straight into the piece), do not add."),
    Misconception(
        "ring_overwrites_in_reduce_scatter", "received pieces are always copied",
        "every piece holds one rank's input",
        "the reduce-scatter phase overwrites what it receives (recv straight into the piece, or "
        "copy_). In that phase the received piece is a partial sum that must be ADDED to this rank's "
        "own copy: recv into a buffer, then add_. Only the all-gather phase copies."),
    Misconception(
        "ring_assumes_divisible", "the sizes divide by N (view(N, -1))",
        "the function raises on a size that does not divide by the world size",
        NOT_DIVISIBLE),
    Misconception(
        "ring_blocking_sends", "send then recv is fine",
        "the run hangs with every rank's stack in dist.send",
        BLOCKING_SENDS),
    Misconception(
        "ring_direct_exchange", "any exchange is a ring (piece k straight to rank k)",
        "a rank sends to or receives from ranks other than its two neighbours",
        "that is not a ring: in a ring every rank talks to its two neighbours only"),
    Misconception(
        "ring_send_everything", "any exchange is a ring (whole tensors to every rank)",
        "a rank sends more than 2(N-1)/N times the tensor's size",
        "The result is right, but sending whole tensors (to every rank, or around the ring N-1 "
        "times) is not a ring all-reduce: send one piece (1/N of the tensor) per step."),
    Misconception(
        "ring_swaps_whole_tensor", "swapping whole tensors with the neighbour is a ring",
        "a message is larger than one piece (at N = 2 the byte count alone cannot tell)",
        "The result is right, but a ring sends one piece (1/N of the tensor) per message: swapping "
        "whole tensors only happens to send as many bytes when N = 2, and sends N/2 times more with "
        "more ranks (and takes no advantage of every link working at once)."),
    Misconception(
        "ring_uses_all_reduce", "all_reduce is just another collective",
        "the spy refuses the dist.all_reduce call",
        "Build ring_all_reduce from only dist.send / dist.recv / dist.isend / dist.irecv."),
    Misconception(
        "ring_returns_new_tensor", "returning the result is the same as all_reduce",
        "the tensor is unchanged and the returned tensor holds the sum",
        "You returned the sum instead of writing it into `tensor`."),
)

# Sizes that divide by 2, 3 and 4 and sizes that do not; 3 elements on 4 ranks leaves a piece empty.
_RING_CASES = [((12,), "float32"), ((7,), "float32"), ((5, 3), "float64"), ((1001,), "int64"),
               ((3,), "float32"), ((4096,), "float32")]


def _pieces(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    return list(t.reshape(-1).tensor_split(world))


def _explain_piece(k: int, got: torch.Tensor, exp: torch.Tensor, rows: list[dict],
                   world: int) -> str:
    """Name what a wrong piece holds: a partial sum of some ranks' inputs, or the full sum plus one.

    "single": one rank's input (a received piece overwrote the rank's own copy);
    "partial": the sum over a proper subset of the ranks' inputs (a reduce-scatter in progress);
    "added": the full sum plus such a partial sum (received complete pieces were added, not copied).
    """
    inputs = [_pieces(rows[r]["input"], world)[k] for r in range(world)]
    for mask in range(1, 2 ** world):
        subset = [inputs[r] for r in range(world) if mask >> r & 1]
        part = torch.stack(subset).sum(0) if len(subset) > 1 else subset[0]
        if mask != 2 ** world - 1 and same(got, part):
            return "single" if len(subset) == 1 else "partial"
        if same(got, exp + part):
            return "added"
    return "other"


@checker("03.b ring all-reduce")
def check_ring_all_reduce(ring_all_reduce: Callable[[torch.Tensor], Any], *,
                          worlds: Sequence[int] = (2, 3, 4), timeout: float = 30.0) -> None:
    """``ring_all_reduce(tensor)``: in-place sum across ranks from point-to-point calls only,
    compared with ``dist.all_reduce`` for world sizes 2 to 4 and several sizes and dtypes."""
    require_callable(ring_all_reduce, "ring_all_reduce(tensor), summing in place across ranks")
    runs = run(ring_all_reduce, worlds, _RING_CASES, COLLECTIVES, False, timeout,
               "ring_all_reduce", {"forbidden": CATALOGUE.hint("ring_uses_all_reduce")})
    for world, ranks in zip(worlds, runs):
        for ci in range(len(_RING_CASES)):
            rows = [ranks[r][ci] for r in range(world)]
            for row in rows:
                _check_ring_sum(row, rows, world)
            for row in rows:
                _check_ring_traffic(row, world)
    print(f"ring_all_reduce matches dist.all_reduce on world sizes {list(worlds)} for "
          f"{len(_RING_CASES)} shapes/dtypes (sizes not divisible by the world size included), "
          "sending 2(N-1)/N x size per rank, one piece per message, to ring neighbours only")


def _check_ring_sum(row: dict, rows: list[dict], world: int) -> None:
    """What one rank's tensor holds: the sum, or a state that names the mistake."""
    got, exp, inp = row["got"], row["expected"], row["input"]
    where = (f"rank {row['rank']} of {world}, tensor of shape {row['shape']} "
             f"({got.numel()} elements, {row['dtype']})")
    if same(got, exp):
        return
    if got.dtype != exp.dtype or got.shape != exp.shape:
        raise CheckFailed(f"on {where}: the tensor changed to shape "
                          f"{tuple(got.shape)} / dtype {got.dtype}.")
    if torch.equal(got, inp):
        ret = row["returned"]
        extra = (" " + CATALOGUE.hint("ring_returns_new_tensor")
                 if ret is not None and same(ret, exp) else "")
        raise CheckFailed(
            f"on {where}: the tensor is unchanged. ring_all_reduce must work in "
            "place, like dist.all_reduce: receive into buffers and add_/copy_ into "
            f"the pieces of `tensor` (views of it), not into new tensors.{extra}")
    pg, pe = _pieces(got, world), _pieces(exp, world)
    good = [k for k, (a, b) in enumerate(zip(pg, pe)) if b.numel() and same(a, b)]
    nonempty = [k for k, b in enumerate(pe) if b.numel()]
    kinds = {_explain_piece(k, pg[k], pe[k], rows, world) for k in nonempty if k not in good}
    if len(nonempty) > 1 and len(good) == 1 and kinds <= {"partial", "single"}:
        raise CheckFailed(
            f"on {where}: only piece {good[0]} of {world} holds the full sum, the others "
            "hold partial sums: that is the state after the reduce-scatter phase. "
            + CATALOGUE.hint("ring_reduce_scatter_only"))
    if not good and kinds == {"single"}:
        raise CheckFailed(f"on {where}: every piece holds ONE rank's input, not a sum "
                          f"({first_diff(got, exp)}): "
                          + CATALOGUE.hint("ring_overwrites_in_reduce_scatter"))
    if "added" in kinds:
        raise CheckFailed(f"on {where}: some pieces hold the full sum PLUS a partial sum "
                          f"({first_diff(got, exp)}): " + CATALOGUE.hint("ring_adds_in_all_gather"))
    hint = ""
    if got.numel() % world:
        hint = (f" The size ({got.numel()}) does not divide by the world size: do all "
                "ranks cut the tensor into the same pieces (torch.tensor_split)?")
    raise CheckFailed(
        f"on {where}: {first_diff(got, exp)}; pieces with the right sum: "
        f"{good or 'none'} of {list(range(world))}. Usual mistake: off-by-one piece "
        "indices, or pieces cut differently on different ranks. Check your formulas "
        "on paper for N = 3: the piece a rank receives at step s must be the piece its "
        "left neighbour sends at step s; after the reduce-scatter the piece a rank "
        "received last must have passed through every rank; in the all-gather a rank "
        f"first sends the piece it completed.{hint}")


def _check_ring_traffic(row: dict, world: int) -> None:
    """What one rank sent: at most 2(N-1)/N x size in all, one piece per message, to one neighbour."""
    rank = row["rank"]
    numel, elsize = row["got"].numel(), row["got"].element_size()
    if world > 1 and numel and row["sends"] == 0:
        raise CheckFailed(
            f"rank {rank} of {world} sent nothing with dist.send/isend, yet "
            "its tensor holds the sum: build the ring from point-to-point messages.")
    piece = math.ceil(numel / world) * elsize
    if row["sent_bytes"] > 2 * (world - 1) * piece:
        ring = 2 * (world - 1) / world * numel * elsize
        raise CheckFailed(
            f"rank {rank} of {world} sent {row['sent_bytes']} bytes for a tensor "
            f"of {numel * elsize} bytes; a ring all-reduce sends 2(N-1)/N x size = "
            f"{ring:.0f} bytes per rank. " + CATALOGUE.hint("ring_send_everything"))
    if row["largest_send"] > piece:
        raise CheckFailed(
            f"rank {rank} of {world} sent a message of {row['largest_send']} bytes for a tensor of "
            f"{numel * elsize} bytes, more than one piece ({piece} bytes at most). "
            + CATALOGUE.hint("ring_swaps_whole_tensor"))
    right, left = (rank + 1) % world, (rank - 1) % world
    sends, recvs = set(row["send_peers"]) - {None}, set(row["recv_peers"]) - {None}
    ring = (sends <= {right} and recvs <= {left}) or (sends <= {left} and recvs <= {right})
    if world > 1 and not ring:
        raise CheckFailed(
            f"rank {rank} of {world} sent to rank(s) {sorted(sends)} and received from rank(s) "
            f"{sorted(recvs)}. The result is right, but {CATALOGUE.hint('ring_direct_exchange')}, "
            f"sending to its right neighbour (rank + 1) % N = {right} and receiving from its left "
            f"neighbour (rank - 1) % N = {left} (or all ranks the other way round). Exchanging with "
            "every rank needs a link to every rank; the ring needs only N links, each busy at every "
            "step.")
