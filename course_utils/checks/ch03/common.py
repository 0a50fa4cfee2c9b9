"""What both checkers of chapter 03 share: the worker that runs the learner's function on every case,
the comparison with ``dist.all_reduce``, and the messages for a hang or an exception in a case.

While the learner's function runs, a ``CollectiveSpy`` refuses the collectives the exercise
excludes (the call raises ``ForbiddenCollective`` where the learner wrote it) and records every
point-to-point call: its peer and its size.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ...checking import CollectiveSpy, Outcome, judge, learner_frames, process_group, run_workers
from ...workers.errors import RankFailure

__all__ = ["ForbiddenCollective", "ALL_REDUCES", "COLLECTIVES", "NOT_DIVISIBLE", "BLOCKING_SENDS",
           "run", "same", "first_diff"]

ALL_REDUCES = ("all_reduce", "all_reduce_coalesced")
COLLECTIVES = ALL_REDUCES + (
    "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "all_gather_object", "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_single", "all_to_all", "all_to_all_single", "gather", "scatter",
    "gather_object", "scatter_object_list", "broadcast_object_list",
)
_SENDS = ("send", "isend")
_RECVS = ("recv", "irecv")

# Both exercises cut the flattened tensor into one piece per rank; a size that does not divide by
# the world size is the usual way to get that wrong.
NOT_DIVISIBLE = ("assuming the size divides by the world size. Split the flattened tensor with "
                 "torch.tensor_split(flat, world): pieces may differ in size by one, or be empty "
                 "when there are fewer elements than ranks.")
# A ring (or any exchange) where every rank sends first, with the blocking dist.send.
BLOCKING_SENDS = ("every rank is blocked in dist.send: with gloo (and NCCL) a blocking send waits "
                  "until the peer posts the matching recv, so when all ranks send first, all of "
                  "them wait forever. Start the send with dist.isend, then recv, then wait() on the "
                  "send (or alternate the order on even/odd ranks).")


class ForbiddenCollective(RuntimeError):
    """Raised inside a worker when the learner's code calls a collective the exercise excludes."""


class _CaseError(RuntimeError):
    """The learner's function raised on one case; the message names the case."""


def _make_input(shape: tuple, dtype_name: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, dtype_name)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=dtype)
    return torch.randint(-50, 50, shape, generator=g, dtype=dtype)


def _peers(calls: list) -> list:
    return sorted({c.peer for c in calls}, key=lambda p: -1 if p is None else p)


def _run_cases(fn: Callable, cases: list, forbidden: Sequence[str], mean: bool) -> Outcome:
    """Worker: run ``fn`` on every case; the outcome holds what this rank had before and after."""
    with process_group() as pg:
        out = []
        for i, (shape, dtype_name) in enumerate(cases):
            x = _make_input(shape, dtype_name, 1000 * i + pg.rank).to(pg.device)
            expected = x.clone()
            dist.all_reduce(expected)  # the real thing, on the same inputs
            if mean:
                expected /= pg.world
            t = x.clone()
            try:
                with CollectiveSpy(_SENDS + _RECVS, forbid=forbidden, refuse=ForbiddenCollective) as spy:
                    ret = fn(t)
            except (NotImplementedError, ForbiddenCollective):
                raise
            except Exception as e:
                raise _CaseError(f"case {i}: tensor of shape {tuple(shape)} ({t.numel()} elements), "
                                 f"dtype {dtype_name}: {type(e).__name__}: {e}") from e
            sends = [c for c in spy.calls if c.op in _SENDS]
            recvs = [c for c in spy.calls if c.op in _RECVS]
            out.append({
                "rank": pg.rank, "shape": tuple(shape), "dtype": dtype_name, "input": x.cpu(),
                "expected": expected.cpu(), "got": t.detach().cpu(),
                "returned": ret.detach().cpu() if isinstance(ret, torch.Tensor) else None,
                "sent_bytes": sum(c.nbytes for c in sends), "sends": len(sends), "recvs": len(recvs),
                "largest_send": max((c.nbytes for c in sends), default=0),
                "send_peers": _peers(sends), "recv_peers": _peers(recvs),
            })
            dist.barrier()  # every rank finishes a case before the next one starts
        return Outcome(pg.rank, data={"cases": out})


def same(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal for integers; for floats, equal up to rounding (1e-12 in float64, 1e-5 otherwise)."""
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return False
    if not expected.dtype.is_floating_point:
        return torch.equal(got, expected)
    tol = 1e-12 if expected.dtype == torch.float64 else 1e-5
    return torch.allclose(got, expected, rtol=tol, atol=tol)


def first_diff(got: torch.Tensor, expected: torch.Tensor) -> str:
    g, e = got.reshape(-1), expected.reshape(-1)
    if g.shape != e.shape:
        return f"expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
    bad = torch.nonzero(~torch.isclose(g.double(), e.double(), rtol=1e-5, atol=1e-5)).flatten()
    i = int(bad[0]) if bad.numel() else 0
    return (f"{bad.numel()} of {e.numel()} elements differ; first at flat index {i}: expected "
            f"{e[i].item():.6g}, got {g[i].item():.6g}")


def _hang_explainer(what: str, world: int, timeout: float) -> Callable[[dict[int, str]], str]:
    def explain(stacks: dict[int, str]) -> str:
        in_send = [r for r, s in stacks.items() if re.search(r"\bin (send|_send)\b", s)]
        in_recv = [r for r, s in stacks.items() if re.search(r"\bin (recv|_recv)\b", s)]
        if stacks and len(in_send) == len(stacks):
            why = BLOCKING_SENDS
        elif in_recv:
            why = (f"rank(s) {in_recv} wait in recv for a message no rank sends: check the "
                   "peer ranks ((rank + 1) % world to send, (rank - 1) % world to receive), "
                   "that every rank does the same number of steps, and that a wait() on an "
                   "isend/irecv is not missing.")
        else:
            why = "a rank never returned; see its stack below."
        first = min(stacks) if stacks else 0
        return (f"{what} hung with world size {world} (no result after {timeout:g} s): {why}\n"
                f"rank {first} was stuck here:\n{learner_frames(stacks.get(first, '')) or '(no stack)'}")
    return explain


def _error_explainer(what: str, world: int, hints: dict[str, str]) -> Callable[[RankFailure], str | None]:
    def explain(f: RankFailure) -> str | None:
        if f.exc_type == "ForbiddenCollective":
            return (f"rank {f.rank} called a collective this exercise excludes ({f.message}). "
                    f"{hints['forbidden']}")
        if f.exc_type == "_CaseError":
            m = re.search(r"\((\d+) elements\)", f.message)
            hint = ""
            if "unequal_pieces" in hints and re.search(r"allgather: invalid tensor size", f.message):
                hint = f"\nUsual mistake: {hints['unequal_pieces']}"
            elif m and int(m.group(1)) % world:
                hint = f"\nUsual mistake ({m.group(1)} elements on {world} ranks): {NOT_DIVISIBLE}"
            return f"{what} raised on rank {f.rank} with world size {world}, {f.message}{hint}"
        return None
    return explain


def run(fn: Callable, worlds: Sequence[int], cases: list, forbidden: Sequence[str], mean: bool,
        timeout: float, what: str, hints: dict[str, str]) -> list[list[list[dict[str, Any]]]]:
    """Run the cases on each world size: per world, per rank, per case what the rank had.

    Worker failures become CheckFailed messages: ``hints["forbidden"]`` follows a refused
    collective, ``hints["unequal_pieces"]`` (optional) explains a gloo all_gather of pieces of
    different sizes.
    """
    runs = []
    for world in worlds:
        outcomes = run_workers(_run_cases, world, args=(fn, cases, tuple(forbidden), mean),
                               timeout=timeout, explain_error=_error_explainer(what, world, hints),
                               explain_hang=_hang_explainer(what, world, timeout))
        runs.append([o.data["cases"] for o in judge(outcomes, world=world)])
    return runs
