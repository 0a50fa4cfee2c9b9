"""11.a Megatron's two linears: ``check_tp_linears(ColumnParallelLinear, RowParallelLinear)``.

The learner writes two modules, each built from the whole ``nn.Linear`` (the same on every rank),
keeping this rank's shard as its own parameters ``weight`` and ``bias``:

- ``ColumnParallelLinear(linear)``: ``weight`` is this rank's block of the output features
  (rows of ``linear.weight``), ``bias`` its slice of the bias; ``forward(x)`` takes the whole input
  (the same on every rank) and returns this rank's slice of the output features.  Its input passes
  through an autograd function that is the identity in forward and all-reduces the gradient in
  backward (Megatron's ``f``).
- ``RowParallelLinear(linear)``: ``weight`` is this rank's block of the input features (columns),
  ``bias`` the whole bias; ``forward(x_shard)`` takes this rank's slice of the input features and
  returns the whole output: the partial products are summed by an autograd function that
  all-reduces in forward and is the identity in backward (Megatron's ``g``), then the bias is added once.

The checker runs both on 2 and on 4 ranks against the single-process ``nn.Linear``: outputs, the
gradients of the weight, the bias and the input, and, with ``CollectiveSpy``, every collective each
layer runs, in forward or in backward, and on a tensor of which shape.  Correct values pass whatever
primitive produced them (``dist.all_reduce`` in a ``torch.autograd.Function``, a tensor hook,
functional collectives that the spy does not see); when a value is wrong, the communication it saw
names the mistake.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ...checking import (
    Catalogue,
    CheckFailed,
    CollectiveSpy,
    Misconception,
    Outcome,
    checker,
    diff_table,
    format_table,
    judge,
    process_group,
    run_workers,
)

__all__ = ["CATALOGUE", "check_tp_linears", "WORLDS"]

CATALOGUE = Catalogue(
    "11.a tensor-parallel linears",
    Misconception(
        "all_reduce_in_wrong_pass",
        "the column-parallel layer sums in forward and the row-parallel one in backward",
        "an all-reduce in ColumnParallelLinear's forward or in RowParallelLinear's backward, "
        "none where it belongs",
        "the all-reduce is in the wrong pass: ColumnParallelLinear's input is already whole on every "
        "rank, so its forward needs no communication and its backward sums the input's gradient "
        "over ranks (identity forward / all-reduce backward); RowParallelLinear's forward sums the "
        "partial outputs (all-reduce forward / identity backward)",
    ),
    Misconception(
        "all_reduce_in_both_passes",
        "the differentiable all_reduce of torch.distributed.nn does what RowParallelLinear needs",
        "one layer all-reduces in forward and in backward: its gradients are world-size times too large",
        "all-reduce in one pass only: torch.distributed.nn.functional.all_reduce also sums the "
        "gradient in backward, but every rank already holds the whole gradient of the replicated "
        "output; write a torch.autograd.Function whose backward returns grad_output unchanged",
    ),
    Misconception(
        "split_wrong_dimension",
        "column-parallel means splitting the columns of nn.Linear's weight",
        "ColumnParallelLinear's weight has shape (out, in/world) or RowParallelLinear's (out/world, in)",
        "nn.Linear stores weight as (out_features, in_features): column parallelism splits the output "
        "features, dim 0 of the weight (Megatron's columns of A in Y = XA); row parallelism splits "
        "the input features, dim 1",
    ),
    Misconception(
        "row_bias_on_every_rank",
        "each rank adds its bias, as every linear layer does",
        "RowParallelLinear's output is off by exactly (world-1) x bias",
        "add the whole bias after the all-reduce, on every rank: added on every rank before the sum, "
        "it is counted world times",
    ),
    Misconception(
        "row_bias_on_one_rank",
        "the bias must be counted once, so one rank adds it before the sum",
        "the output is right, but RowParallelLinear.bias has no gradient on the ranks that skip it",
        "add the whole bias after the all-reduce, on every rank. Added on one rank before the sum, the "
        "output is right, but the other ranks' copies of the bias never take part, get no gradient "
        "and are never trained: after one optimizer step the ranks hold different biases, and a "
        "checkpoint written by any other rank keeps a stale one",
    ),
    Misconception(
        "row_bias_divided_by_world",
        "dividing the bias by the world size before the sum adds it once in total",
        "the output is right, but RowParallelLinear.bias.grad is exactly 1/world of nn.Linear's",
        "the bias divided by the world size on every rank sums to the right output, but its gradient "
        "is divided too (d(b/N)/db = 1/N): add the whole bias once, after the all-reduce",
    ),
    Misconception(
        "input_not_replicated",
        "each rank works on its own slice of the batch, as in data parallelism",
        "ColumnParallelLinear's output has batch/world rows",
        "in tensor parallelism every rank sees the whole batch (the input is replicated) and the "
        "weight is what is split: do not cut the input of ColumnParallelLinear",
    ),
    Misconception(
        "input_grad_not_all_reduced",
        "the input of ColumnParallelLinear needs no communication: it is the same on every rank",
        "no collective in ColumnParallelLinear, and the input's gradient is this rank's part only",
        "the input is replicated in forward, so its gradient must be summed over ranks in backward: "
        "pass the input through an autograd function that is the identity in forward and "
        "all-reduces grad_output in backward",
    ),
    Misconception(
        "input_grad_averaged",
        "the ranks' gradients are averaged, as in data parallelism",
        "ColumnParallelLinear's input.grad is exactly 1/world of nn.Linear's",
        "sum the input's gradient over ranks, do not average it (no division by the world size, no "
        "ReduceOp.AVG): each rank holds a different part of it, the part that flows through its own "
        "output features, not a copy of the same gradient as in data parallelism",
    ),
    Misconception(
        "output_averaged",
        "the partial products are averaged over ranks, as gradients are in data parallelism",
        "RowParallelLinear's output is the mean of the ranks' partial products plus the bias",
        "sum the partial products over ranks, do not average them: each rank multiplies a different "
        "slice of the input features, and the whole product is their sum",
    ),
    Misconception(
        "sum_outside_autograd",
        "dist.all_reduce can be run on a detached tensor, or under torch.no_grad, and autograd follows",
        "RowParallelLinear's output does not require grad, or its weight gets no gradient",
        "the sum ran outside autograd (on a detached tensor or under torch.no_grad), so autograd "
        "sees the result as a constant and no gradient reaches the weight: do the all-reduce inside "
        "a torch.autograd.Function (forward: all-reduce a clone; backward: return grad_output)",
    ),
)

WORLDS = (2, 4)
BATCH, SEQ, IN, HID, OUT = 4, 3, 8, 16, 8
ATOL = 1e-5
_WATCHED = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")


def _reference(seed: int, fan_in: int, fan_out: int) -> nn.Linear:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Linear(fan_in, fan_out)


def _data(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _comm(spy: CollectiveSpy) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    out: dict[str, list[tuple[str, tuple[int, ...]]]] = {"forward": [], "backward": []}
    for c in spy.calls:
        out["backward" if c.in_backward else "forward"].append((c.op, c.shape))
    return out


def _describe(comm: dict[str, list]) -> str:
    def one(calls: list) -> str:
        return ", ".join(f"{op} on {tuple(shape)}" for op, shape in calls) or "nothing"
    return f"forward ran {one(comm['forward'])}; backward ran {one(comm['backward'])}"


def _run(layer_cls: type, full: nn.Linear, x: torch.Tensor, out_weight: torch.Tensor,
         device: torch.device) -> tuple[nn.Module, torch.Tensor, torch.Tensor, dict]:
    """Build the learner's layer, run forward and backward under the spy.

    Backward runs only when the output has the expected shape and is attached to autograd; the
    callers say what is wrong otherwise.
    """
    layer = layer_cls(copy.deepcopy(full).to(device))
    x = x.to(device).requires_grad_()
    with CollectiveSpy(_WATCHED) as spy:
        y = layer(x)
        if isinstance(y, torch.Tensor) and y.shape == out_weight.shape and y.requires_grad:
            (y * out_weight.to(device)).sum().backward()
    return layer, x, y, _comm(spy)


def _factor(got: torch.Tensor | None, want: torch.Tensor) -> float | None:
    """The c with ``got == c * want`` (to rounding), or None when ``got`` is no multiple of ``want``."""
    if got is None or got.shape != want.shape:
        return None
    g, w = got.detach().double().cpu().flatten(), want.detach().double().cpu().flatten()
    if float(w @ w) == 0.0:
        return None
    c = float(g @ w) / float(w @ w)
    return c if float((g - c * w).abs().max()) <= 1e-4 * (1 + float(w.abs().max())) else None


def _is(c: float | None, value: float) -> bool:
    return c is not None and abs(c - value) <= 1e-3 * max(1.0, abs(value))


def _times(c: float, world: int) -> str:
    """A factor in words: 'exactly 1/4 of', 'exactly 2x'."""
    return f"exactly 1/{world} of" if _is(c, 1 / world) else f"exactly {c:g}x"


def _shard_problem(name: str, layer: nn.Module, want: dict[str, tuple], wrong: tuple) -> str:
    for attr in want:
        if not isinstance(getattr(layer, attr, None), nn.Parameter):
            return (f"{name} has no parameter `{attr}`: keep this rank's shard as "
                    f"self.{attr} = nn.Parameter(...)")
    got = tuple(layer.weight.shape)
    if got == wrong:
        return (f"{name}.weight has shape {got}, expected {want['weight']}: "
                + CATALOGUE.hint("split_wrong_dimension"))
    for attr, shape in want.items():
        if tuple(getattr(layer, attr).shape) != shape:
            return f"{name}.{attr} has shape {tuple(getattr(layer, attr).shape)}, expected {shape}"
    return ""


def _values_problem(name: str, expected: dict, got: dict, comm: dict, seen: str, hint: str) -> str:
    """The table of differences, what the checker observed (``seen``) and the cause it names."""
    rows = diff_table(expected, got)
    if max(d for _, d, _ in rows) <= ATOL:
        return ""
    return (f"{name} differs from the single-process nn.Linear ({_describe(comm)}):\n"
            f"{format_table(rows, ATOL)}\n{seen}: {hint}")


def _unattached(name: str, y: torch.Tensor, comm: dict) -> str:
    return (f"{name}'s output does not require grad (it has no grad_fn; {_describe(comm)}), so "
            "backward cannot reach its weight: " + CATALOGUE.hint("sum_outside_autograd"))


def _column(Column: type, rank: int, world: int, device: torch.device) -> str:
    full = _reference(11, IN, HID)
    x, w = _data(1, BATCH, SEQ, IN), _data(2, BATCH, SEQ, HID)
    rows = slice(rank * HID // world, (rank + 1) * HID // world)
    problem = _shard_problem("ColumnParallelLinear", Column(copy.deepcopy(full).to(device)),
                             {"weight": (HID // world, IN), "bias": (HID // world,)}, (HID, IN // world))
    if problem:
        return problem
    ref_x = x.clone().requires_grad_()
    ref = copy.deepcopy(full)
    (ref(ref_x) * w).sum().backward()
    layer, lx, y, comm = _run(Column, full, x, w[..., rows], device)
    if not isinstance(y, torch.Tensor):
        return f"ColumnParallelLinear.forward returned {type(y).__name__}, expected a tensor"
    want_shape = (BATCH, SEQ, HID // world)
    if tuple(y.shape) != want_shape:
        if y.shape[0] == BATCH // world:
            return (f"ColumnParallelLinear's output has shape {tuple(y.shape)}, expected {want_shape}: "
                    + CATALOGUE.hint("input_not_replicated"))
        if tuple(y.shape) == (BATCH, SEQ, HID):
            return (f"ColumnParallelLinear's output has shape {tuple(y.shape)}, expected {want_shape}: "
                    "return this rank's slice of the output features (no all-gather); the "
                    "row-parallel layer that follows takes exactly that slice")
        return f"ColumnParallelLinear's output has shape {tuple(y.shape)}, expected {want_shape}"
    if not y.requires_grad:
        return (f"ColumnParallelLinear's output does not require grad (it has no grad_fn; "
                f"{_describe(comm)}): its forward ran under torch.no_grad or on detached tensors, so "
                "backward cannot reach its weight, its bias or its input; only the communication "
                "belongs in an autograd function, the F.linear on this rank's parameters stays in "
                "autograd's sight")
    fwd, bwd = comm["forward"], comm["backward"]
    own_part = w[..., rows] @ full.weight.detach()[rows]  # the input's gradient through this rank's rows
    expected = {"output": ref(x)[..., rows], "weight.grad": ref.weight.grad[rows],
                "bias.grad": ref.bias.grad[rows], "input.grad": ref_x.grad}
    got = {"output": y, "weight.grad": layer.weight.grad, "bias.grad": layer.bias.grad, "input.grad": lx.grad}
    got = {k: v for k, v in got.items() if v is not None}
    c = _factor(lx.grad, ref_x.grad)
    if fwd and bwd:
        seen, hint = ("it all-reduced in forward and in backward",
                      CATALOGUE.hint("all_reduce_in_both_passes"))
    elif fwd:
        seen, hint = ("it all-reduced in forward and not in backward",
                      CATALOGUE.hint("all_reduce_in_wrong_pass"))
    elif _is(c, 1 / world):
        seen, hint = (f"input.grad is {_times(c, world)} nn.Linear's input gradient, the rest is right",
                      CATALOGUE.hint("input_grad_averaged"))
    elif bwd and all(shape != (BATCH, SEQ, IN) for _, shape in bwd):
        seen, hint = (f"the backward all-reduce ran on {bwd[0][1]}, not on the input's gradient "
                      f"{(BATCH, SEQ, IN)}",
                      "the weight's gradient is this rank's own (its shard): it is the replicated "
                      "input's gradient that is summed over ranks")
    elif _is(_factor(lx.grad, own_part), 1.0) and not _is(c, 1.0):
        seen = (f"input.grad is exactly the gradient through this rank's own {HID // world} output "
                "features, not the sum over ranks"
                + ("" if bwd else ", and no collective ran in backward"))
        hint = CATALOGUE.hint("input_grad_not_all_reduced")
    elif c is not None and not _is(c, 1.0):
        seen, hint = (f"input.grad is {_times(c, world)} nn.Linear's input gradient",
                      "the backward must sum the ranks' parts of the input's gradient exactly once, "
                      "with nothing else done to it")
    else:
        seen, hint = ("what differs", "compare with the lesson's f (section 3): the identity in forward, "
                      "an all-reduce (sum) of grad_output in backward, in front of F.linear with this "
                      "rank's rows of the weight and its slice of the bias")
    return _values_problem("ColumnParallelLinear", expected, got, comm, seen, hint)


def _row(Row: type, rank: int, world: int, device: torch.device) -> tuple[str, dict]:
    """RowParallelLinear on this rank: the problem ("" if none) and what the checker saw."""
    full = _reference(12, HID, OUT)
    x, w = _data(3, BATCH, SEQ, HID), _data(4, BATCH, SEQ, OUT)
    cols = slice(rank * HID // world, (rank + 1) * HID // world)
    problem = _shard_problem("RowParallelLinear", Row(copy.deepcopy(full).to(device)),
                             {"weight": (OUT, HID // world), "bias": (OUT,)}, (OUT // world, HID))
    if problem:
        return problem, {}
    ref_x = x.clone().requires_grad_()
    ref = copy.deepcopy(full)
    ref_y = ref(ref_x)
    (ref_y * w).sum().backward()
    layer, lx, y, comm = _run(Row, full, x[..., cols].contiguous(), w, device)
    if not isinstance(y, torch.Tensor) or tuple(y.shape) != (BATCH, SEQ, OUT):
        shape = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
        return (f"RowParallelLinear's output is {shape}, expected the whole output {(BATCH, SEQ, OUT)} "
                "on every rank (sum the partial products over ranks)"), {}
    if not y.requires_grad:
        return _unattached("RowParallelLinear", y, comm), {}
    fwd, bwd = comm["forward"], comm["backward"]
    expected = {"output": ref_y, "weight.grad": ref.weight.grad[:, cols], "bias.grad": ref.bias.grad,
                "input.grad": ref_x.grad[..., cols]}
    got = {"output": y, "weight.grad": layer.weight.grad, "bias.grad": layer.bias.grad, "input.grad": lx.grad}
    got = {k: v for k, v in got.items() if v is not None}
    bias = full.bias.detach()
    y_cpu = y.detach().cpu()
    partial = x[..., cols] @ full.weight.detach()[:, cols].T  # this rank's partial product
    output_right = torch.allclose(y_cpu, ref_y.detach(), atol=1e-4)
    cw = _factor(layer.weight.grad, ref.weight.grad[:, cols])
    seen_by = {}
    if fwd and bwd:
        scaled = f", and weight.grad is {_times(cw, world)} nn.Linear's" if cw and not _is(cw, 1) else ""
        seen, hint = ("it all-reduced in forward and in backward" + scaled,
                      CATALOGUE.hint("all_reduce_in_both_passes"))
    elif bwd and not fwd:
        seen, hint = ("it all-reduced in backward and not in forward",
                      CATALOGUE.hint("all_reduce_in_wrong_pass"))
    elif torch.allclose(y_cpu, ref_y.detach() + (world - 1) * bias, atol=1e-4):
        seen, hint = (f"the output is nn.Linear's plus exactly {world - 1} x bias",
                      CATALOGUE.hint("row_bias_on_every_rank"))
    elif torch.allclose(y_cpu, (ref_y.detach() - bias) / world + bias, atol=1e-4):
        seen, hint = (f"the output is exactly 1/{world} of the summed partial products, plus the bias",
                      CATALOGUE.hint("output_averaged"))
    elif torch.allclose(y_cpu, partial + bias, atol=1e-4):
        seen, hint = ("the output is this rank's own partial product plus the bias"
                      + ("" if fwd else ", and no collective ran in forward"),
                      "RowParallelLinear must sum the partial products of all ranks in forward "
                      "(all-reduce), then add the bias once")
    elif output_right and layer.weight.grad is None:
        seen, hint = ("the output is right, but RowParallelLinear.weight got no gradient",
                      CATALOGUE.hint("sum_outside_autograd"))
    elif output_right and layer.bias.grad is None:
        seen_by = {"bias_without_grad": True}
        seen, hint = ("the output is right, but RowParallelLinear.bias got no gradient on this rank",
                      CATALOGUE.hint("row_bias_on_one_rank"))
    elif output_right and _is(_factor(layer.bias.grad, ref.bias.grad), 1 / world):
        seen, hint = (f"the output is right, but bias.grad is exactly 1/{world} of nn.Linear's",
                      CATALOGUE.hint("row_bias_divided_by_world"))
    elif cw is not None and not _is(cw, 1.0):
        seen, hint = (f"weight.grad is {_times(cw, world)} nn.Linear's",
                      "the backward of the sum is the identity: every rank already holds the whole "
                      "gradient of the replicated output, nothing is summed or scaled in backward")
    else:
        seen, hint = ("what differs", "compare with the lesson's g (section 3): an all-reduce (sum) of "
                      "the partial product in forward, the identity in backward, then the whole bias "
                      "added once")
    return _values_problem("RowParallelLinear", expected, got, comm, seen, hint), seen_by


def _worker(Column: type, Row: type) -> Outcome:
    with process_group() as pg:
        problem, seen = _column(Column, pg.rank, pg.world, pg.device), {}
        if not problem:
            problem, seen = _row(Row, pg.rank, pg.world, pg.device)
        return Outcome(pg.rank, problem=f"on {pg.world} ranks, {problem}" if problem else "", data=seen)


def _bias_on_some_ranks(outcomes: list, world: int) -> None:
    """A bias added on one rank only: name the ranks whose copy got no gradient."""
    outcomes = [o for o in outcomes if isinstance(o, Outcome)]
    without = sorted(o.rank for o in outcomes if o.data.get("bias_without_grad"))
    if not without:
        return
    rest = sorted(o.rank for o in outcomes if o.rank not in without)
    others = (f", while rank {', '.join(map(str, rest))}'s got the right one" if rest else "")
    raise CheckFailed(
        f"on {world} ranks, the output of RowParallelLinear is right, but its bias got no gradient on "
        f"rank {', '.join(map(str, without))}{others}: " + CATALOGUE.hint("row_bias_on_one_rank"))


@checker("11.a tensor-parallel linears")
def check_tp_linears(ColumnParallelLinear: type, RowParallelLinear: type) -> None:
    """Both layers on 2 and 4 ranks against ``nn.Linear``: outputs, every gradient, communication."""
    for cls, name in ((ColumnParallelLinear, "ColumnParallelLinear"),
                      (RowParallelLinear, "RowParallelLinear")):
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise CheckFailed(f"expected {name} to be an nn.Module subclass, got {cls!r}")
    for world in WORLDS:
        outcomes = run_workers(_worker, world, args=(ColumnParallelLinear, RowParallelLinear), timeout=60,
                               hang_hint="every rank must run the same all-reduces: a rank that skips "
                               "one (an `if rank == 0:` around it) leaves the others waiting")
        _bias_on_some_ranks(outcomes, world)
        judge(outcomes, world=world)


check_tp_linears.__doc__ += (
    "\n\n    The mistakes it recognises (what a learner believes, what the checker observes):\n\n"
    + "\n".join("    " + line for line in CATALOGUE.markdown().splitlines()))
