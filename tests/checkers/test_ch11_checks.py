"""Chapter 11 checkers: correct answers written differently pass, each misconception is named."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from misconceptions import cases  # tests/checkers/misconceptions.py, beside this file
from torch import nn

from course_utils.checking import CheckFailed
from course_utils.checks import check_checkpoint_memory, check_tp_linears
from course_utils.checks.ch11 import a_tp_linears, b_checkpoint_memory
from course_utils.measure.ch11 import peak_activation_bytes

# The lesson's helper file holds Megatron's f and g (copy_to_tp, reduce_from_tp): the correct answer.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "notebooks"))
from ch11_tp import copy_to_tp, reduce_from_tp  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


# ------------------------------------------------------------------------------------------
# 11.a tensor-parallel linears
# ------------------------------------------------------------------------------------------


class NoComm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def tp_layers(*, f=copy_to_tp, g=reduce_from_tp, split_column_dim=0, bias="after_sum", chunk_batch=False):
    """A learner's pair of layers; each switch reproduces one usual mistake.

    ``bias``: where RowParallelLinear adds its bias: "after_sum" (right), "every_rank" (before the sum,
    on every rank), "rank0" (before the sum, on rank 0 only), "divided" (bias / world before the sum).
    """

    class Column(nn.Module):
        def __init__(self, linear):
            super().__init__()
            r, w = dist.get_rank(), dist.get_world_size()
            self.weight = nn.Parameter(linear.weight.detach().chunk(w, dim=split_column_dim)[r].clone())
            b = linear.bias.detach()
            self.bias = nn.Parameter((b.chunk(w)[r] if split_column_dim == 0 else b).clone())

        def forward(self, x):
            if chunk_batch:
                x = x.chunk(dist.get_world_size())[dist.get_rank()]
            return F.linear(f(x), self.weight, self.bias)

    class Row(nn.Module):
        def __init__(self, linear):
            super().__init__()
            r, w = dist.get_rank(), dist.get_world_size()
            self.weight = nn.Parameter(linear.weight.detach().chunk(w, dim=1)[r].clone())
            self.bias = nn.Parameter(linear.bias.detach().clone())

        def forward(self, x):
            if bias == "every_rank":
                return g(F.linear(x, self.weight, self.bias))
            if bias == "rank0":  # "count it once": only rank 0 adds it, before the sum
                y = F.linear(x, self.weight)
                if dist.get_rank() == 0:
                    y = y + self.bias
                return g(y)
            if bias == "divided":  # "count it once": 1/world of it on every rank
                return g(F.linear(x, self.weight, self.bias / dist.get_world_size()))
            return g(F.linear(x, self.weight)) + self.bias

    return Column, Row


class AveragingCopy(torch.autograd.Function):
    """f with a data-parallel habit: the gradient all-reduced, then divided by the world size."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad / dist.get_world_size()


class AveragingReduce(torch.autograd.Function):
    """g that averages the partial products."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.AVG)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def sum_under_no_grad(x):
    """g without an autograd function: the all-reduce under no_grad, autograd sees a constant."""
    with torch.no_grad():
        total = x.clone()
        dist.all_reduce(total)
    return total


def sum_of_detached(x):
    """g on a detached copy: the output no longer requires grad at all."""
    total = x.detach().clone()
    dist.all_reduce(total)
    return total


def hooks_and_detach():
    """No autograd.Function: a tensor hook sums the input's gradient, a detach trick the outputs."""

    class Column(nn.Module):
        def __init__(self, linear):
            super().__init__()
            out = linear.out_features // dist.get_world_size()
            rows = slice(dist.get_rank() * out, (dist.get_rank() + 1) * out)
            self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
            self.bias = nn.Parameter(linear.bias.detach()[rows].clone())

        def forward(self, x):
            if x.requires_grad:
                x = x.view_as(x)

                def summed(grad):
                    grad = grad.clone()
                    dist.all_reduce(grad)
                    return grad
                x.register_hook(summed)
            return x @ self.weight.T + self.bias

    class Row(nn.Module):
        def __init__(self, linear):
            super().__init__()
            cols = linear.in_features // dist.get_world_size()
            start = dist.get_rank() * cols
            self.weight = nn.Parameter(linear.weight.detach()[:, start:start + cols].clone())
            self.bias = nn.Parameter(linear.bias.detach().clone())

        def forward(self, x):
            partial = x @ self.weight.T
            with torch.no_grad():
                total = partial.clone()
                dist.all_reduce(total)
            # the value of the sum, the gradient of the identity
            return partial + (total - partial).detach() + self.bias

    return Column, Row


class FuncolCopy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return funcol.all_reduce(grad, "sum", dist.group.WORLD)


class FuncolReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return funcol.all_reduce(x, "sum", dist.group.WORLD)

    @staticmethod
    def backward(ctx, grad):
        return grad


@pytest.mark.parametrize("answer", [
    pytest.param(lambda: tp_layers(), id="autograd_functions_with_dist_all_reduce"),
    pytest.param(hooks_and_detach, id="tensor_hook_and_detach_trick"),
    pytest.param(lambda: tp_layers(f=FuncolCopy.apply, g=FuncolReduce.apply), id="functional_collectives"),
])
def test_tp_linears_accepts_correct_answers(answer, capsys):
    check_tp_linears(*answer())
    assert "[PASS] 11.a" in capsys.readouterr().out


WRONG_A = {
    "all_reduce_in_wrong_pass": lambda: tp_layers(f=reduce_from_tp, g=copy_to_tp),
    "all_reduce_in_both_passes": lambda: tp_layers(g=dist_nn.all_reduce),
    "split_wrong_dimension": lambda: tp_layers(split_column_dim=1),
    "row_bias_on_every_rank": lambda: tp_layers(bias="every_rank"),
    "row_bias_on_one_rank": lambda: tp_layers(bias="rank0"),
    "row_bias_divided_by_world": lambda: tp_layers(bias="divided"),
    "input_not_replicated": lambda: tp_layers(chunk_batch=True),
    "input_grad_not_all_reduced": lambda: tp_layers(f=NoComm.apply),
    "input_grad_averaged": lambda: tp_layers(f=AveragingCopy.apply),
    "output_averaged": lambda: tp_layers(g=AveragingReduce.apply),
    "sum_outside_autograd": lambda: tp_layers(g=sum_under_no_grad),
}

@pytest.mark.parametrize(("entry", "answer"), cases(a_tp_linears.CATALOGUE, WRONG_A))
def test_tp_linears_names_each_misconception(entry, answer):
    with pytest.raises(CheckFailed) as e:
        check_tp_linears(*answer())
    assert entry.message in str(e.value), str(e.value)


class RowUnderNoGrad(nn.Module):
    """The whole forward under no_grad, "because all_reduce is not differentiable"."""

    def __init__(self, linear):
        super().__init__()
        r, w = dist.get_rank(), dist.get_world_size()
        self.weight = nn.Parameter(linear.weight.detach().chunk(w, dim=1)[r].clone())
        self.bias = nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):
        with torch.no_grad():
            y = F.linear(x, self.weight)
            dist.all_reduce(y)
            return y + self.bias


def column_under_no_grad():
    """The whole column layer under no_grad, "since its forward needs no communication"."""

    class Column(tp_layers()[0]):
        def forward(self, x):
            with torch.no_grad():
                return super().forward(x)

    return Column


@pytest.mark.parametrize(("answer", "observed"), [
    (lambda: tp_layers(f=AveragingCopy.apply), r"input.grad is exactly 1/2 of nn.Linear's"),
    (lambda: tp_layers(g=AveragingReduce.apply), r"the output is exactly 1/2 of the summed partial"),
    (lambda: tp_layers(bias="rank0"), r"bias got no gradient on rank 1, while rank 0's got the right one"),
    (lambda: tp_layers(bias="divided"), r"bias.grad is exactly 1/2 of nn.Linear's"),
    (lambda: tp_layers(bias="every_rank"), r"plus exactly 1 x bias"),
    (lambda: tp_layers(g=dist_nn.all_reduce), r"weight.grad is exactly 2x nn.Linear's"),
    (lambda: tp_layers(f=NoComm.apply), r"through this rank's own 8 output features"),
    (lambda: tp_layers(g=sum_of_detached), r"RowParallelLinear.weight got no gradient"),
    (lambda: (tp_layers()[0], RowUnderNoGrad), r"RowParallelLinear's output does not require grad"),
    (lambda: (column_under_no_grad(), tp_layers()[1]), r"ColumnParallelLinear.s output does not require"),
], ids=["avg_input_grad", "avg_output", "bias_rank0", "bias_divided", "bias_every_rank", "both_passes",
        "no_input_all_reduce", "detached_sum", "row_under_no_grad", "column_under_no_grad"])
def test_tp_linears_says_what_it_observed(answer, observed):
    """Each verdict quotes what the checker saw: a factor of exactly 1/N or N, which rank's bias has no
    gradient, an output that is not attached to autograd."""
    with pytest.raises(CheckFailed, match=observed):
        check_tp_linears(*answer())


def test_tp_linears_lists_its_mistakes_in_its_docstring():
    """Exercise 11.a sends the learner to help(check_tp_linears) for the list of mistakes."""
    for entry in a_tp_linears.CATALOGUE:
        assert entry.belief in check_tp_linears.__doc__, entry.key


def test_tp_linears_stub_is_not_done_yet():
    class Stub(nn.Module):
        def __init__(self, linear):
            super().__init__()
            raise NotImplementedError("Exercise 11.a tensor-parallel linears: replace this line")

    with pytest.raises(CheckFailed, match="not done yet"):
        check_tp_linears(Stub, Stub)


def test_tp_linears_names_a_gradient_all_reduce_on_the_wrong_tensor():
    """A data-parallel habit: the weight's gradient all-reduced instead of the input's."""

    class Column(tp_layers(f=NoComm.apply)[0]):
        def __init__(self, linear):
            super().__init__(linear)

            def summed(grad):
                grad = grad.clone()
                dist.all_reduce(grad)
                return grad
            self.weight.register_hook(summed)

    with pytest.raises(CheckFailed, match=r"backward all-reduce ran on \(8, 8\)"):
        check_tp_linears(Column, tp_layers()[1])


# ------------------------------------------------------------------------------------------
# 11.b checkpoint memory
# ------------------------------------------------------------------------------------------


def textbook(batch, seq, hidden, layers, segment):
    """layers/k segment inputs, plus k blocks recomputed, 9 numbers per block."""
    per_tensor = batch * seq * hidden * 4
    if segment is None:
        return 9 * layers * per_tensor
    return (layers // segment + 9 * segment) * per_tensor


def exact(batch, seq, hidden, layers, segment):
    """Counting tensor by tensor: no input, the last block of a segment not recomputed, the loss."""
    bsh = batch * seq * hidden * 4
    if not segment:
        return 9 * layers * bsh + bsh
    return (layers // segment - 1) * bsh + (9 * segment - 1) * bsh


def in_numpy(batch, seq, hidden, layers, segment):
    """The same count with numpy integers, and the segment's own input counted once, not twice."""
    bsh = np.int64(batch) * seq * hidden
    kept = np.int64(layers) // segment if segment else np.int64(0)
    per_block = 1 + 4 + 4  # input, fc1's output, GELU's output
    recomputed = per_block * (segment or layers) - (1 if segment else 0)
    return (kept + recomputed) * bsh * np.int64(4)


@pytest.mark.parametrize("answer", [textbook, exact, in_numpy],
                         ids=["textbook_formula", "exact_count", "numpy_integers"])
def test_checkpoint_memory_accepts_correct_answers(answer, capsys):
    check_checkpoint_memory(answer)
    assert "[PASS] 11.b" in capsys.readouterr().out


def _bsh(b, s, h):
    return b * s * h * 4


def _count(per_block, b, s, h, L, k):
    """The textbook formula with ``per_block`` tensors per block, in units of ``_bsh``."""
    return (L // k + per_block * k if k else per_block * L) * _bsh(b, s, h)


WRONG_B = {
    "ignores_recomputation": lambda b, s, h, L, k: (L // k if k else 9 * L) * _bsh(b, s, h),
    "recomputes_one_block": lambda b, s, h, L, k: (L // k + 9 if k else 9 * L) * _bsh(b, s, h),
    "no_checkpoint_formula": lambda b, s, h, L, k: 9 * L * _bsh(b, s, h),
    "elements_not_bytes": lambda b, s, h, L, k: _count(9, b, s, h, L, k) / 4,
    "two_bytes_per_number": lambda b, s, h, L, k: _count(9, b, s, h, L, k) // 2,  # bf16's 2 bytes
    "forgets_expansion": lambda b, s, h, L, k: _count(3, b, s, h, L, k),
    "forgets_block_input": lambda b, s, h, L, k: _count(8, b, s, h, L, k),  # fc1 out + GELU out only
}


def test_forgetting_the_block_input_would_pass_on_value_alone():
    """The 8-per-block formula is within 15% of most configurations: only the growth per block catches it."""
    within = [abs(_count(8, b, s, h, L, k) / peak_activation_bytes(L, k, batch=b, seq=s, hidden=h) - 1)
              <= b_checkpoint_memory.TOLERANCE for b, s, h, L, k in b_checkpoint_memory.CONFIGS]
    assert sum(within) >= len(within) - 2, within


@pytest.mark.parametrize(("answer", "observed"), [
    (WRONG_B["two_bytes_per_number"], r"of the measured peaks \(about 1/2\), and exactly 2 times them"),
    (WRONG_B["elements_not_bytes"], r"of the measured peaks \(about 1/4\), and exactly 4 times them"),
    (WRONG_B["forgets_block_input"], r"grows by 8\.00 tensors .* per block without checkpointing; the "
                                     r"measurement by 9"),
    (lambda b, s, h, L, k: _count(10, b, s, h, L, k), r"grows by 10\.00 tensors .* per block without"),
    (lambda b, s, h, L, k: _count(9, b, s, h, L, k) if k else 9 * L * _bsh(b, s, h) * 1.3,
     r"OFF \(\+29%\)"),
], ids=["bf16", "elements", "eight_per_block", "ten_per_block", "no_checkpoint_30_percent_over"])
def test_checkpoint_memory_says_what_it_observed(answer, observed):
    with pytest.raises(CheckFailed, match=observed):
        check_checkpoint_memory(answer)


@pytest.mark.parametrize(("entry", "answer"), cases(b_checkpoint_memory.CATALOGUE, WRONG_B))
def test_checkpoint_memory_names_each_misconception(entry, answer):
    with pytest.raises(CheckFailed) as e:
        check_checkpoint_memory(answer)
    assert entry.message in str(e.value), str(e.value)


def test_checkpoint_memory_stub_is_not_done_yet():
    def stub(*args):
        raise NotImplementedError("Exercise 11.b checkpoint memory: replace this line")

    with pytest.raises(CheckFailed, match="not done yet"):
        check_checkpoint_memory(stub)


def test_checkpointing_lowers_the_peak_of_a_deep_stack():
    """The measurement itself: the peak falls with checkpointing and is smallest near k = sqrt(L/9)."""
    plain = peak_activation_bytes(16, None)
    peaks = {k: peak_activation_bytes(16, k) for k in (1, 2, 4, 8)}
    assert all(p < 0.6 * plain for p in peaks.values()), (plain, peaks)
    assert min(peaks, key=peaks.get) == 1 and peaks[8] > peaks[2]
