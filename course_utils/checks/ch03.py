"""Checkers of chapter 03 (process groups and collectives).

Both checkers run the learner's function in real worker processes (``launch``, gloo on CPU, NCCL
when there is a GPU per rank), on several world sizes, shapes and dtypes, and compare each rank's
tensor with what ``dist.all_reduce`` gives on the same inputs.  While the learner's code runs, the
collectives it may not use are replaced by functions that raise, and point-to-point calls are
counted (calls and bytes sent).

- ``check_all_reduce_mean(all_reduce_mean)``: ``all_reduce_mean(tensor)`` averages ``tensor`` in
  place across ranks without ``dist.all_reduce``.
- ``check_ring_all_reduce(ring_all_reduce)``: ``ring_all_reduce(tensor)`` sums ``tensor`` in place
  across ranks with ``dist.send`` / ``recv`` / ``isend`` / ``irecv`` only, as a ring: a
  reduce-scatter phase then an all-gather phase, sending about ``2(N-1)/N`` times the tensor's size.
"""

from __future__ import annotations

import ast
import inspect
import math
import re
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ..checking import CheckFailed, checker, learner_frames, require_callable, run_workers
from ..devices import backend_and_device, process_group_kwargs
from ..workers.errors import RankFailure

__all__ = ["check_all_reduce_mean", "check_ring_all_reduce", "ForbiddenCollective"]

_ALL_REDUCES = ("all_reduce", "all_reduce_coalesced")
_COLLECTIVES = _ALL_REDUCES + (
    "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "all_gather_object", "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_single", "all_to_all", "all_to_all_single", "gather", "scatter",
    "gather_object", "scatter_object_list", "broadcast_object_list",
)
_P2P_SEND = ("send", "isend")
_P2P_RECV = ("recv", "irecv")


class ForbiddenCollective(RuntimeError):
    """Raised inside a worker when the learner's code calls a collective the exercise excludes."""


class _CaseError(RuntimeError):
    """The learner's function raised on one case; the message names the case."""


class _Guard:
    """Replace forbidden collectives by functions that raise; count point-to-point traffic."""

    def __init__(self, forbidden: Sequence[str]):
        self.forbidden = tuple(forbidden)
        self.sent_bytes = 0
        self.sends = 0
        self.recvs = 0
        self.largest_send = 0  # bytes of the largest single message
        self.send_peers: set[int] = set()
        self.recv_peers: set[int | None] = set()
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> _Guard:
        def forbid(name: str) -> Callable:
            def f(*args: Any, **kwargs: Any) -> Any:
                raise ForbiddenCollective(f"dist.{name} is not allowed in this exercise")
            return f

        def counted(name: str, fn: Callable) -> Callable:
            def f(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                peer = args[0] if args else kwargs.get("dst" if name in _P2P_SEND else "src")
                if name in _P2P_SEND:
                    nbytes = tensor.numel() * tensor.element_size()
                    self.sends += 1
                    self.sent_bytes += nbytes
                    self.largest_send = max(self.largest_send, nbytes)
                    self.send_peers.add(peer)
                else:
                    self.recvs += 1
                    self.recv_peers.add(peer)
                return fn(tensor, *args, **kwargs)
            return f

        originals = {n: getattr(c10d, n) for n in _P2P_SEND + _P2P_RECV}
        wrapped = {n: counted(n, fn) for n, fn in originals.items()}
        for mod in (dist, c10d):
            for name in self.forbidden:
                if hasattr(mod, name):
                    self._saved.append((mod, name, getattr(mod, name)))
                    setattr(mod, name, forbid(name))
            for name, fn in wrapped.items():
                self._saved.append((mod, name, getattr(mod, name)))
                setattr(mod, name, fn)
        return self

    def __exit__(self, *exc: Any) -> None:
        for mod, name, value in reversed(self._saved):
            setattr(mod, name, value)
        self._saved.clear()


def _make_input(shape: tuple, dtype_name: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, dtype_name)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=dtype)
    return torch.randint(-50, 50, shape, generator=g, dtype=dtype)


def _run_cases(fn: Callable, cases: list, forbidden: Sequence[str], mean: bool) -> list[dict]:
    """Worker: run ``fn`` on every case; return what each rank had before and after."""
    backend, device = backend_and_device()
    dist.init_process_group(**process_group_kwargs(backend, device))
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    try:
        for i, (shape, dtype_name) in enumerate(cases):
            x = _make_input(shape, dtype_name, 1000 * i + rank).to(device)
            expected = x.clone()
            dist.all_reduce(expected)  # the real thing, on the same inputs
            if mean:
                expected /= world
            t = x.clone()
            guard = _Guard(forbidden)
            try:
                with guard:
                    ret = fn(t)
            except (NotImplementedError, ForbiddenCollective):
                raise
            except Exception as e:
                raise _CaseError(f"case {i}: tensor of shape {tuple(shape)} ({t.numel()} elements), "
                                 f"dtype {dtype_name}: {type(e).__name__}: {e}") from e
            out.append({
                "rank": rank, "shape": tuple(shape), "dtype": dtype_name, "input": x.cpu(),
                "expected": expected.cpu(), "got": t.detach().cpu(),
                "returned": ret.detach().cpu() if isinstance(ret, torch.Tensor) else None,
                "sent_bytes": guard.sent_bytes, "sends": guard.sends, "recvs": guard.recvs,
                "largest_send": guard.largest_send, "send_peers": sorted(guard.send_peers),
                "recv_peers": sorted(guard.recv_peers, key=lambda p: -1 if p is None else p),
            })
            dist.barrier()  # every rank finishes a case before the next one starts
    finally:
        dist.destroy_process_group()
    return out


def _close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return False
    if not expected.dtype.is_floating_point:
        return torch.equal(got, expected)
    tol = 1e-12 if expected.dtype == torch.float64 else 1e-5
    return torch.allclose(got, expected, rtol=tol, atol=tol)


def _first_diff(got: torch.Tensor, expected: torch.Tensor) -> str:
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
            why = ("every rank is blocked in dist.send: with gloo (and NCCL) a blocking send "
                   "waits until the peer posts the matching recv, so when all ranks send "
                   "first, all of them wait forever. Start the send with dist.isend, then "
                   "recv, then wait() on the send (or alternate the order on even/odd ranks).")
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


def _error_explainer(what: str, world: int, forbidden: Sequence[str]) -> Callable[[RankFailure], str | None]:
    def explain(f: RankFailure) -> str | None:
        if f.exc_type == "ForbiddenCollective":
            allowed = ("only dist.send / dist.recv / dist.isend / dist.irecv"
                       if "broadcast" in forbidden else
                       "other collectives (reduce, broadcast, all_gather, ...)")
            return (f"rank {f.rank} called a collective this exercise excludes ({f.message}). "
                    f"Build {what} from {allowed}.")
        if f.exc_type == "_CaseError":
            m = re.search(r"\((\d+) elements\)", f.message)
            hint = ""
            if re.search(r"allgather: invalid tensor size", f.message):
                hint = ("\nUsual mistake: pieces of different sizes in all_gather. torch.tensor_split "
                        "cuts a size that does not divide by the world size into pieces that differ "
                        "by one, and gloo's all_gather needs every rank's piece to have the same size. "
                        "Pad the flattened tensor with zeros to a multiple of the world size, use "
                        "equal pieces, and drop the padding when you copy the result back.")
            elif m and int(m.group(1)) % world:
                hint = (f"\nUsual mistake: assuming the size divides by the world size "
                        f"({m.group(1)} elements on {world} ranks). Split the flattened tensor "
                        "with torch.tensor_split(flat, world): pieces may differ in size by "
                        "one, or be empty when there are fewer elements than ranks.")
            return f"{what} raised on rank {f.rank} with world size {world}, {f.message}{hint}"
        return None
    return explain


def _run(fn: Callable, worlds: Sequence[int], cases: list, forbidden: Sequence[str], mean: bool,
         timeout: float, what: str) -> list[list[dict]]:
    """Run the cases on each world size; worker failures become CheckFailed messages."""
    return [
        run_workers(_run_cases, world, args=(fn, cases, forbidden, mean), timeout=timeout,
                    explain_error=_error_explainer(what, world, forbidden),
                    explain_hang=_hang_explainer(what, world, timeout))
        for world in worlds
    ]


# --------------------------------------------------------------------------------------------
# 03.a all-reduce mean from other primitives
# --------------------------------------------------------------------------------------------
#
# What learners get wrong, and the message each one gets (tests/checkers/test_ch03_collectives.py holds
# an answer written with each misconception):
# - "the sum is enough": no division by the world size -> "got the SUM ... Divide by";
# - "dist.reduce gives everybody the result": it leaves it on dst only -> "follow it with
#   dist.broadcast";
# - "the mean is over the tensor's elements" -> "mean of this rank's own elements";
# - "returning the result is the same as all_reduce" -> "must work in place ... You returned";
# - "`tensor = tensor / n` changes the caller's tensor": it rebinds a local name -> "rebinds";
# - "torch.tensor_split makes any size work with all_gather": gloo's all_gather needs pieces of
#   equal size -> "Pad the flattened tensor";
# - "all_reduce is just another collective" -> "called a collective this exercise excludes".


# Methods that return a view of the tensor: rebinding the name to one of them is harmless.
_VIEWS = {"view", "view_as", "reshape", "flatten", "squeeze", "unsqueeze", "narrow", "select",
          "transpose", "t", "permute", "expand", "as_strided", "unflatten"}


def _rebinding(fn: Callable) -> str:
    """The source line where ``fn`` assigns to its first parameter (``tensor = tensor / n``), or ''."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
        tree = ast.parse(source)
        params = list(inspect.signature(fn).parameters)
    except (OSError, TypeError, SyntaxError, ValueError):
        return ""
    if not params:
        return ""
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else [])
        value = getattr(node, "value", None)
        if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
                and value.func.attr in _VIEWS):
            continue  # `tensor = tensor.view(-1)` still writes into the caller's storage
        for t in targets:
            if isinstance(t, ast.Name) and t.id == params[0]:
                return ast.get_source_segment(source, node) or f"{params[0]} = ..."
    return ""

_MEAN_CASES = [((6,), "float32"), ((3, 5), "float64"), ((4,), "float32")]


@checker("03.a all-reduce mean")
def check_all_reduce_mean(all_reduce_mean: Callable[[torch.Tensor], Any], *,
                          timeout: float = 30.0) -> None:
    """``all_reduce_mean(tensor)``: every rank ends with the mean over ranks, in place,
    built without ``dist.all_reduce``."""
    require_callable(all_reduce_mean, "all_reduce_mean(tensor), averaging in place across ranks")
    worlds = (2, 3)
    runs = _run(all_reduce_mean, worlds, _MEAN_CASES, _ALL_REDUCES, True, timeout,
                "all_reduce_mean")
    for world, ranks in zip(worlds, runs):
        for ci in range(len(_MEAN_CASES)):
            rows = [ranks[r][ci] for r in range(world)]
            bad = [row for row in rows if not _close(row["got"], row["expected"])]
            if not bad:
                continue
            row = bad[0]
            where = (f"rank {row['rank']} of {world}, tensor of shape {row['shape']} "
                     f"({row['dtype']})")
            got, exp, inp = row["got"], row["expected"], row["input"]
            if got.dtype != exp.dtype or got.shape != exp.shape:
                raise CheckFailed(f"on {where}: the tensor changed to shape {tuple(got.shape)} / "
                                  f"dtype {got.dtype}; it must keep its shape and dtype.")
            rebind = _rebinding(all_reduce_mean)
            if rebind and (_close(got, exp * world) or torch.equal(got, inp)):
                raise CheckFailed(
                    f"on {where}: the caller's tensor does not hold the mean. Your line `{rebind}` "
                    "rebinds the local name to a NEW tensor: the caller's tensor keeps what it held "
                    "before that line. Write into the tensor instead: `tensor /= n`, "
                    "`tensor.div_(n)` or `tensor.copy_(result)`.")
            ok = sorted(set(range(world)) - {b["rank"] for b in bad})
            if ok:
                raise CheckFailed(
                    f"on {where}: {_first_diff(got, exp)}, while rank(s) {ok} hold the mean. "
                    "Usual mistake: dist.reduce(tensor, dst=0) leaves the result on rank 0 only "
                    "(the other ranks' tensors are scratch space afterwards); follow it with "
                    "dist.broadcast(tensor, src=0).")
            if torch.equal(got, inp):
                ret = row["returned"]
                extra = (" You returned the mean instead of writing it into `tensor`."
                         if ret is not None and _close(ret, exp) else "")
                raise CheckFailed(
                    f"on {where}: the tensor is unchanged on every rank. all_reduce_mean must work "
                    "in place, as dist.all_reduce does (write into `tensor` with copy_, div_, or "
                    f"a collective that fills it).{extra}")
            if _close(got, exp * world):
                raise CheckFailed(
                    f"on {where}: expected the mean, got the SUM over the {world} ranks "
                    f"({_first_diff(got, exp)}). Divide by dist.get_world_size().")
            if _close(got, torch.full_like(inp, inp.mean().item())):
                raise CheckFailed(
                    f"on {where}: every element equals the mean of this rank's own elements: "
                    "the average is across ranks (element by element), not across the elements "
                    "of one tensor.")
            raise CheckFailed(f"on {where}: {_first_diff(got, exp)}")
    print(f"all_reduce_mean matches dist.all_reduce / world size on world sizes {list(worlds)}, "
          f"{len(_MEAN_CASES)} shapes/dtypes, without dist.all_reduce")


# --------------------------------------------------------------------------------------------
# 03.b ring all-reduce from send/recv
# --------------------------------------------------------------------------------------------

# What learners get wrong, and the message each one gets (tests/checkers/test_ch03_collectives.py holds
# an answer written with each misconception):
# - "the reduce-scatter is the all-reduce": all-gather phase missing -> "all-gather phase is missing";
# - "received pieces are always added": adding in the all-gather -> "full sum PLUS a partial sum";
# - "received pieces are always copied": recv straight into the piece in the reduce-scatter ->
#   "holds ONE rank's input ... overwrites";
# - "the sizes divide by N" (view(N, -1)) -> "assuming the size divides";
# - "send then recv is fine": every rank blocks in dist.send -> "every rank is blocked in dist.send";
# - "any exchange is a ring": every rank sends to every rank -> "sends to ranks ... not a ring";
#   sending whole tensors -> "sent ... bytes ... is not a ring all-reduce"; at N = 2 one swap of the
#   whole tensor has the ring's byte count, so the size of each message is checked too -> "one piece";
# - "return the result" -> "You returned the sum".

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
        if mask != 2 ** world - 1 and _close(got, part):
            return "single" if len(subset) == 1 else "partial"
        if _close(got, exp + part):
            return "added"
    return "other"


@checker("03.b ring all-reduce")
def check_ring_all_reduce(ring_all_reduce: Callable[[torch.Tensor], Any], *,
                          worlds: Sequence[int] = (2, 3, 4), timeout: float = 30.0) -> None:
    """``ring_all_reduce(tensor)``: in-place sum across ranks from point-to-point calls only,
    compared with ``dist.all_reduce`` for world sizes 2 to 4 and several sizes and dtypes."""
    require_callable(ring_all_reduce, "ring_all_reduce(tensor), summing in place across ranks")
    runs = _run(ring_all_reduce, worlds, _RING_CASES, _COLLECTIVES, False, timeout,
                "ring_all_reduce")
    for world, ranks in zip(worlds, runs):
        for ci in range(len(_RING_CASES)):
            rows = [ranks[r][ci] for r in range(world)]
            for row in rows:
                got, exp, inp = row["got"], row["expected"], row["input"]
                where = (f"rank {row['rank']} of {world}, tensor of shape {row['shape']} "
                         f"({got.numel()} elements, {row['dtype']})")
                if _close(got, exp):
                    continue
                if got.dtype != exp.dtype or got.shape != exp.shape:
                    raise CheckFailed(f"on {where}: the tensor changed to shape "
                                      f"{tuple(got.shape)} / dtype {got.dtype}.")
                if torch.equal(got, inp):
                    ret = row["returned"]
                    extra = (" You returned the sum instead of writing it into `tensor`."
                             if ret is not None and _close(ret, exp) else "")
                    raise CheckFailed(
                        f"on {where}: the tensor is unchanged. ring_all_reduce must work in "
                        "place, like dist.all_reduce: receive into buffers and add_/copy_ into "
                        f"the pieces of `tensor` (views of it), not into new tensors.{extra}")
                pg, pe = _pieces(got, world), _pieces(exp, world)
                good = [k for k, (a, b) in enumerate(zip(pg, pe)) if b.numel() and _close(a, b)]
                nonempty = [k for k, b in enumerate(pe) if b.numel()]
                kinds = {_explain_piece(k, pg[k], pe[k], rows, world)
                         for k in nonempty if k not in good}
                if len(nonempty) > 1 and len(good) == 1 and kinds <= {"partial", "single"}:
                    raise CheckFailed(
                        f"on {where}: only piece {good[0]} of {world} holds the full sum, the others "
                        "hold partial sums: that is the state after the reduce-scatter phase. The "
                        "all-gather phase is missing: N-1 more steps in which each rank passes on "
                        "the last fully reduced piece it holds, and the receiver copies it.")
                if not good and kinds == {"single"}:
                    raise CheckFailed(
                        f"on {where}: every piece holds ONE rank's input, not a sum "
                        f"({_first_diff(got, exp)}): the reduce-scatter phase overwrites what it "
                        "receives (recv straight into the piece, or copy_). In that phase the "
                        "received piece is a partial sum that must be ADDED to this rank's own copy: "
                        "recv into a buffer, then add_. Only the all-gather phase copies.")
                if "added" in kinds:
                    raise CheckFailed(
                        f"on {where}: some pieces hold the full sum PLUS a partial sum "
                        f"({_first_diff(got, exp)}): the all-gather phase adds what it receives. "
                        "In that phase the received piece is already the complete sum: copy it "
                        "into place (copy_ or recv straight into the piece), do not add.")
                hint = ""
                if got.numel() % world:
                    hint = (f" The size ({got.numel()}) does not divide by the world size: do all "
                            "ranks cut the tensor into the same pieces (torch.tensor_split)?")
                raise CheckFailed(
                    f"on {where}: {_first_diff(got, exp)}; pieces with the right sum: "
                    f"{good or 'none'} of {list(range(world))}. Usual mistake: off-by-one piece "
                    "indices, or pieces cut differently on different ranks. Check your formulas "
                    "on paper for N = 3: the piece a rank receives at step s must be the piece its "
                    "left neighbour sends at step s; after the reduce-scatter the piece a rank "
                    "received last must have passed through every rank; in the all-gather a rank "
                    f"first sends the piece it completed.{hint}")
            for row in rows:
                _check_ring_traffic(row, world)
    print(f"ring_all_reduce matches dist.all_reduce on world sizes {list(worlds)} for "
          f"{len(_RING_CASES)} shapes/dtypes (sizes not divisible by the world size included), "
          "sending 2(N-1)/N x size per rank, one piece per message, to ring neighbours only")


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
            f"{ring:.0f} bytes per rank. The result is right, but sending whole "
            "tensors (to every rank, or around the ring N-1 times) is not a ring "
            "all-reduce: send one piece (1/N of the tensor) per step.")
    if row["largest_send"] > piece:
        raise CheckFailed(
            f"rank {rank} of {world} sent a message of {row['largest_send']} bytes for a tensor of "
            f"{numel * elsize} bytes, more than one piece ({piece} bytes at most). The result is "
            "right, but a ring sends one piece (1/N of the tensor) per message: swapping whole "
            "tensors only happens to send as many bytes when N = 2, and sends N/2 times more with "
            "more ranks (and takes no advantage of every link working at once).")
    right, left = (rank + 1) % world, (rank - 1) % world
    sends, recvs = set(row["send_peers"]), set(row["recv_peers"]) - {None}
    ring = (sends <= {right} and recvs <= {left}) or (sends <= {left} and recvs <= {right})
    if world > 1 and not ring:
        raise CheckFailed(
            f"rank {rank} of {world} sent to rank(s) {sorted(sends)} and received from rank(s) "
            f"{sorted(recvs)}. The result is right, but that is not a ring: in a ring every rank "
            f"talks to its two neighbours only, sending to its right neighbour (rank + 1) % N "
            f"= {right} and receiving from its left neighbour (rank - 1) % N = {left} (or all "
            "ranks the other way round). Exchanging with every rank needs a link to every rank; "
            "the ring needs only N links, each busy at every step.")
