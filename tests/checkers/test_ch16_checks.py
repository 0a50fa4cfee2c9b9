"""Chapter 16 checkers: each accepts right answers written differently and names every misconception
of its catalogue (``CATALOGUE`` in each module of course_utils/checks/ch16/), with a wrong answer
written as a learner would write it."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from misconceptions import cases  # tests/checkers/misconceptions.py, beside this file

from course_utils.checking import CheckFailed
from course_utils.checks import check_diloco_outer, check_local_sgd_sync
from course_utils.checks.ch16 import a_diloco_outer, b_local_sgd

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def _names_the_mistake(check, answer, mistake):
    with pytest.raises(CheckFailed, match=rf"\[{re.escape(check.exercise)}\]") as info:
        check(answer)
    assert mistake.message in info.value.args[0]


# ------------------------------------------------------------------------------------------
# 16.a DiLoCo's outer step
# ------------------------------------------------------------------------------------------


def outer_class(*, sign=1.0, average_params=False, fresh_optimizer=False, nesterov=True, one_rank=False,
                restart=True, ignore_group=False, divide_by_world=False):
    """A learner's DiLoCoOuter built on torch's SGD, with switches for the usual mistakes."""

    class DiLoCoOuter:
        def __init__(self, params, outer_lr, momentum, group=None):
            self.params = list(params)
            self.group = None if ignore_group else group
            self.lr, self.momentum = outer_lr, momentum
            self.glob = [p.detach().clone() for p in self.params]
            self.opt = torch.optim.SGD(self.glob, lr=outer_lr, momentum=momentum, nesterov=nesterov)

        @torch.no_grad()
        def sync(self):
            n = dist.get_world_size() if divide_by_world else dist.get_world_size(self.group)
            if average_params:
                for g, p in zip(self.glob, self.params):
                    avg = p.detach().clone()
                    dist.all_reduce(avg, group=self.group)
                    g.copy_(avg / n)
            else:
                for g, p in zip(self.glob, self.params):
                    d = sign * (g - p)
                    dist.all_reduce(d, group=self.group)
                    g.grad = d / n
                if fresh_optimizer:
                    self.opt = torch.optim.SGD(self.glob, lr=self.lr, momentum=self.momentum,
                                               nesterov=nesterov)
                if not one_rank or dist.get_rank() == 0:
                    self.opt.step()
            if restart:
                for g, p in zip(self.glob, self.params):
                    p.copy_(g)

    return DiLoCoOuter


class OuterByHand:
    """Right: Nesterov written out, one flat all-reduce of all pseudo-gradients."""

    def __init__(self, params, outer_lr, momentum, group=None):
        self.params, self.group, self.lr, self.m = list(params), group, outer_lr, momentum
        self.glob = [p.detach().clone() for p in self.params]
        self.buf = None

    @torch.no_grad()
    def sync(self):
        flat = torch.cat([(g - p).reshape(-1) for g, p in zip(self.glob, self.params)])
        dist.all_reduce(flat, group=self.group)
        flat /= dist.get_world_size(group=self.group)
        self.buf = flat.clone() if self.buf is None else self.buf.mul_(self.m).add_(flat)
        step = flat + self.m * self.buf
        i = 0
        for g, p in zip(self.glob, self.params):
            g -= self.lr * step[i:i + g.numel()].view_as(g)
            p.copy_(g)
            i += g.numel()


class OuterAsyncLoop:
    """Right: torch's SGD over a list of clones, asynchronous all-reduces, then one wait each."""

    def __init__(self, params, outer_lr, momentum, group=None):
        self.params, self.group = list(params), group
        self.glob = [torch.zeros_like(p).copy_(p.detach()) for p in self.params]
        self.opt = torch.optim.SGD(self.glob, lr=outer_lr, momentum=momentum, nesterov=True)

    def sync(self):
        with torch.no_grad():
            works = []
            for g, p in zip(self.glob, self.params):
                g.grad = g.detach() - p.detach()
                works.append(dist.all_reduce(g.grad, group=self.group, async_op=True))
            for w in works:
                w.wait()
            for g in self.glob:
                g.grad.div_(dist.get_world_size(self.group))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for g, p in zip(self.glob, self.params):
                p.data.copy_(g)


def outer_rank0_broadcast():
    """Right: rank 0 of the group steps, then broadcasts the new global copy to the group."""

    class DiLoCoOuter:
        def __init__(self, params, outer_lr, momentum, group=None):
            self.params, self.group = list(params), group
            self.glob = [p.detach().clone() for p in self.params]
            self.opt = torch.optim.SGD(self.glob, lr=outer_lr, momentum=momentum, nesterov=True)
            self.src = dist.get_global_rank(group, 0) if group is not None else 0

        @torch.no_grad()
        def sync(self):
            for g, p in zip(self.glob, self.params):
                g.grad = g - p
                dist.all_reduce(g.grad, group=self.group)
                g.grad /= dist.get_world_size(self.group)
            if dist.get_rank() == self.src:
                self.opt.step()
            for g, p in zip(self.glob, self.params):
                dist.broadcast(g, src=self.src, group=self.group)
                p.copy_(g)

    return DiLoCoOuter


@pytest.mark.parametrize("right", [OuterByHand, OuterAsyncLoop, outer_class(), outer_rank0_broadcast()],
                         ids=["by_hand", "async_loop", "torch_sgd", "rank0_broadcast"])
def test_outer_step_accepts_right_answers(right, capsys):
    check_diloco_outer(right)
    assert "[PASS] 16.a DiLoCo outer step" in capsys.readouterr().out


WRONG_OUTER = {
    "one_rank_only": outer_class(one_rank=True),
    "no_restart": outer_class(restart=False),
    "sign_flipped": outer_class(sign=-1.0),
    "averages_parameters": outer_class(average_params=True),
    "momentum_recreated": outer_class(fresh_optimizer=True),
    "no_nesterov": outer_class(nesterov=False),
    "wrong_group": outer_class(ignore_group=True),
}


@pytest.mark.parametrize("mistake, wrong", cases(a_diloco_outer.CATALOGUE, WRONG_OUTER))
def test_outer_step_names_the_mistake(mistake, wrong):
    _names_the_mistake(check_diloco_outer, wrong, mistake)


def test_outer_step_dividing_by_the_world_is_the_wrong_group():
    _names_the_mistake(check_diloco_outer, outer_class(divide_by_world=True),
                       a_diloco_outer.CATALOGUE["wrong_group"])


def test_the_outer_settings_tell_averaging_from_the_outer_step():
    """Averaging parameters equals the outer step only for plain SGD at lr 1: not with these settings."""
    right = a_diloco_outer.reference_rounds(2, 0)
    averaged = a_diloco_outer.reference_rounds(2, 0, "averages_parameters")
    assert max((a - b).abs().max().item() for a, b in zip(right[0], averaged[0])) > 100 * a_diloco_outer.ATOL


def test_outer_step_stub_is_not_done_yet():
    class Stub:
        def __init__(self, params, outer_lr, momentum, group=None):
            raise NotImplementedError("Exercise 16.a DiLoCo outer step: replace this line with your code")

    with pytest.raises(CheckFailed, match=r"16\.a DiLoCo outer step.*not done yet"):
        check_diloco_outer(Stub)


# ------------------------------------------------------------------------------------------
# 16.b local SGD's sync
# ------------------------------------------------------------------------------------------


@torch.no_grad()
def sync_per_parameter(model, step, H):
    if step % H == 0:
        for p in model.parameters():
            dist.all_reduce(p.data)
            p.data /= dist.get_world_size()


@torch.no_grad()
def sync_flat_vector(model, step, H):
    if step % H != 0:
        return
    flat = torch.nn.utils.parameters_to_vector(model.parameters())
    dist.all_reduce(flat)
    torch.nn.utils.vector_to_parameters(flat / dist.get_world_size(), model.parameters())


def sync_async_state_dict(model, step, H):
    if step % H:
        return
    tensors = [t for t in model.state_dict().values() if t.is_floating_point()]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    for w, t in zip(works, tensors):
        w.wait()
        t.div_(dist.get_world_size())


@torch.no_grad()
def sync_with_avg_op(model, step, H):
    if step % H == 0:
        for p in model.parameters():
            dist.all_reduce(p, op=dist.ReduceOp.AVG)


@pytest.mark.parametrize("right", [sync_per_parameter, sync_flat_vector, sync_async_state_dict,
                                   sync_with_avg_op])
def test_local_sgd_accepts_right_answers(right, capsys):
    check_local_sgd_sync(right)
    assert "[PASS] 16.b local SGD sync" in capsys.readouterr().out


@torch.no_grad()
def averages_gradients(model, step, H):
    if step % H == 0:
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


@torch.no_grad()
def sums_parameters(model, step, H):
    if step % H == 0:
        for p in model.parameters():
            dist.all_reduce(p.data)


@torch.no_grad()
def every_step(model, step, H):
    for p in model.parameters():
        dist.all_reduce(p.data)
        p.data /= dist.get_world_size()


@torch.no_grad()
def wrong_steps(model, step, H):
    if (step - 1) % H == 0:  # counts from 0 in its head: syncs after steps 1, 4, 7
        for p in model.parameters():
            dist.all_reduce(p.data)
            p.data /= dist.get_world_size()


@torch.no_grad()
def not_copied_back(model, step, H):
    if step % H == 0:
        flat = torch.cat([p.reshape(-1) for p in model.parameters()])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()


@torch.no_grad()
def broadcast_rank0(model, step, H):
    if step % H == 0:
        for p in model.parameters():
            dist.broadcast(p.data, src=0)


WRONG_SYNC = {"averages_gradients": averages_gradients, "sums_parameters": sums_parameters,
              "every_step": every_step, "wrong_steps": wrong_steps, "not_copied_back": not_copied_back,
              "broadcast_rank0": broadcast_rank0}


@pytest.mark.parametrize("mistake, wrong", cases(b_local_sgd.CATALOGUE, WRONG_SYNC))
def test_local_sgd_names_the_mistake(mistake, wrong):
    _names_the_mistake(check_local_sgd_sync, wrong, mistake)


def test_local_sgd_stub_is_not_done_yet():
    def stub(model, step, H):
        raise NotImplementedError("Exercise 16.b local SGD sync: replace this line with your code")

    with pytest.raises(CheckFailed, match=r"16\.b local SGD sync.*not done yet"):
        check_local_sgd_sync(stub)
