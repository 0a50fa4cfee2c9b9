"""Chapter 11 checkers: correct answers written differently pass, each misconception is named."""

from __future__ import annotations

import sys
from pathlib import Path

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


def tp_layers(*, f=copy_to_tp, g=reduce_from_tp, split_column_dim=0,
              bias_every_rank=False, chunk_batch=False):
    """A learner's pair of layers; each switch reproduces one usual mistake."""

    class Column(nn.Module):
        def __init__(self, linear):
            super().__init__()
            r, w = dist.get_rank(), dist.get_world_size()
            self.weight = nn.Parameter(linear.weight.detach().chunk(w, dim=split_column_dim)[r].clone())
            bias = linear.bias.detach()
            self.bias = nn.Parameter((bias.chunk(w)[r] if split_column_dim == 0 else bias).clone())

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
            if bias_every_rank:
                return g(F.linear(x, self.weight, self.bias))
            return g(F.linear(x, self.weight)) + self.bias

    return Column, Row


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
    "row_bias_on_every_rank": lambda: tp_layers(bias_every_rank=True),
    "input_not_replicated": lambda: tp_layers(chunk_batch=True),
    "input_grad_not_all_reduced": lambda: tp_layers(f=NoComm.apply),
}


@pytest.mark.parametrize(("entry", "answer"), cases(a_tp_linears.CATALOGUE, WRONG_A))
def test_tp_linears_names_each_misconception(entry, answer):
    with pytest.raises(CheckFailed) as e:
        check_tp_linears(*answer())
    assert entry.message in str(e.value), str(e.value)


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


@pytest.mark.parametrize("answer", [textbook, exact], ids=["textbook_formula", "exact_count"])
def test_checkpoint_memory_accepts_correct_answers(answer, capsys):
    check_checkpoint_memory(answer)
    assert "[PASS] 11.b" in capsys.readouterr().out


def _bsh(b, s, h):
    return b * s * h * 4


WRONG_B = {
    "ignores_recomputation": lambda b, s, h, L, k: (L // k if k else 9 * L) * _bsh(b, s, h),
    "recomputes_one_block": lambda b, s, h, L, k: (L // k + 9 if k else 9 * L) * _bsh(b, s, h),
    "no_checkpoint_formula": lambda b, s, h, L, k: 9 * L * _bsh(b, s, h),
    "elements_not_bytes": lambda b, s, h, L, k: (L // k + 9 * k if k else 9 * L) * b * s * h,
    "forgets_expansion": lambda b, s, h, L, k: (L // k + 3 * k if k else 3 * L) * _bsh(b, s, h),
}


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
