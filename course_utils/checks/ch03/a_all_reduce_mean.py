"""03.a ``check_all_reduce_mean(all_reduce_mean)``: ``all_reduce_mean(tensor)`` averages ``tensor``
in place across ranks without ``dist.all_reduce``, on world sizes 2 and 3.

What learners get wrong is ``CATALOGUE`` below: each entry's key names the answer written with that
misconception in tests/checkers/test_ch03_collectives.py, its message is what the failure says.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable
from typing import Any

import torch

from ...checking import Catalogue, CheckFailed, Misconception, checker, require_callable
from .common import ALL_REDUCES, first_diff, run, same

__all__ = ["CATALOGUE", "check_all_reduce_mean"]

CATALOGUE = Catalogue(
    "03.a all-reduce mean",
    Misconception(
        "mean_forgets_divide", "the sum is enough",
        "every rank holds world size times the mean",
        "Divide the sum by dist.get_world_size()."),
    Misconception(
        "mean_no_broadcast", "dist.reduce gives everybody the result",
        "only some ranks hold the mean",
        "dist.reduce(tensor, dst=0) leaves the result on rank 0 only (the other ranks' tensors are "
        "scratch space afterwards); follow it with dist.broadcast(tensor, src=0)."),
    Misconception(
        "mean_of_elements", "the mean is over the tensor's elements",
        "every element equals the mean of the rank's own input",
        "every element equals the mean of this rank's own elements: the average is across ranks "
        "(element by element), not across the elements of one tensor."),
    Misconception(
        "mean_returns_new_tensor", "returning the result is the same as all_reduce",
        "the tensor is unchanged and the returned tensor holds the mean",
        "You returned the mean instead of writing it into `tensor`: all_reduce_mean must work in "
        "place, as dist.all_reduce does (write into `tensor` with copy_, div_, or a collective that "
        "fills it)."),
    Misconception(
        "mean_rebinds_the_name", "`tensor = tensor / n` changes the caller's tensor",
        "the function assigns to its parameter, and the caller's tensor holds the sum or the input",
        "rebinds the local name to a NEW tensor: the caller's tensor keeps what it held before that "
        "line. Write into the tensor instead: `tensor /= n`, `tensor.div_(n)` or "
        "`tensor.copy_(result)`."),
    Misconception(
        "mean_all_gather_unequal_pieces", "torch.tensor_split makes any size work with all_gather",
        "gloo's all_gather raises 'invalid tensor size'",
        "pieces of different sizes in all_gather. torch.tensor_split cuts a size that does not "
        "divide by the world size into pieces that differ by one, and gloo's all_gather needs every "
        "rank's piece to have the same size. Pad the flattened tensor with zeros to a multiple of "
        "the world size, use equal pieces, and drop the padding when you copy the result back."),
    Misconception(
        "mean_uses_all_reduce", "all_reduce is just another collective",
        "the spy refuses the dist.all_reduce call",
        "Build all_reduce_mean from other collectives (reduce, broadcast, all_gather, ...)."),
)

_MEAN_CASES = [((6,), "float32"), ((3, 5), "float64"), ((4,), "float32")]

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


@checker("03.a all-reduce mean")
def check_all_reduce_mean(all_reduce_mean: Callable[[torch.Tensor], Any], *,
                          timeout: float = 30.0) -> None:
    """``all_reduce_mean(tensor)``: every rank ends with the mean over ranks, in place,
    built without ``dist.all_reduce``."""
    require_callable(all_reduce_mean, "all_reduce_mean(tensor), averaging in place across ranks")
    worlds = (2, 3)
    hints = {"forbidden": CATALOGUE.hint("mean_uses_all_reduce"),
             "unequal_pieces": CATALOGUE.hint("mean_all_gather_unequal_pieces")}
    runs = run(all_reduce_mean, worlds, _MEAN_CASES, ALL_REDUCES, True, timeout,
               "all_reduce_mean", hints)
    for world, ranks in zip(worlds, runs):
        for ci in range(len(_MEAN_CASES)):
            _judge_case(all_reduce_mean, world, [ranks[r][ci] for r in range(world)])
    print(f"all_reduce_mean matches dist.all_reduce / world size on world sizes {list(worlds)}, "
          f"{len(_MEAN_CASES)} shapes/dtypes, without dist.all_reduce")


def _judge_case(fn: Callable, world: int, rows: list[dict]) -> None:
    """Raise CheckFailed naming the mistake when some rank does not hold the mean of one case."""
    bad = [row for row in rows if not same(row["got"], row["expected"])]
    if not bad:
        return
    row = bad[0]
    where = f"rank {row['rank']} of {world}, tensor of shape {row['shape']} ({row['dtype']})"
    got, exp, inp = row["got"], row["expected"], row["input"]
    if got.dtype != exp.dtype or got.shape != exp.shape:
        raise CheckFailed(f"on {where}: the tensor changed to shape {tuple(got.shape)} / "
                          f"dtype {got.dtype}; it must keep its shape and dtype.")
    rebind = _rebinding(fn)
    if rebind and (same(got, exp * world) or torch.equal(got, inp)):
        raise CheckFailed(f"on {where}: the caller's tensor does not hold the mean. Your line "
                          f"`{rebind}` {CATALOGUE.hint('mean_rebinds_the_name')}")
    ok = sorted(set(range(world)) - {b["rank"] for b in bad})
    if ok:
        raise CheckFailed(f"on {where}: {first_diff(got, exp)}, while rank(s) {ok} hold the mean. "
                          f"Usual mistake: {CATALOGUE.hint('mean_no_broadcast')}")
    if torch.equal(got, inp):
        ret = row["returned"]
        if ret is not None and same(ret, exp):
            raise CheckFailed(f"on {where}: the tensor is unchanged on every rank. "
                              + CATALOGUE.hint("mean_returns_new_tensor"))
        raise CheckFailed(
            f"on {where}: the tensor is unchanged on every rank. all_reduce_mean must work in "
            "place, as dist.all_reduce does (write into `tensor` with copy_, div_, or a collective "
            "that fills it).")
    if same(got, exp * world):
        raise CheckFailed(f"on {where}: expected the mean, got the SUM over the {world} ranks "
                          f"({first_diff(got, exp)}). {CATALOGUE.hint('mean_forgets_divide')}")
    if same(got, torch.full_like(inp, inp.mean().item())):
        raise CheckFailed(f"on {where}: {CATALOGUE.hint('mean_of_elements')}")
    raise CheckFailed(f"on {where}: {first_diff(got, exp)}")
