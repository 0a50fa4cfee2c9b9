"""Chapter 15 checkers: each accepts right answers written differently and names every misconception
of its catalogue (``CATALOGUE`` in each module of course_utils/checks/ch15/), with a wrong answer
written as a learner would write it."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dnn
import torch.nn.functional as F
from misconceptions import cases  # tests/checkers/misconceptions.py, beside this file

from course_utils.checking import CheckFailed
from course_utils.checks import check_dispatch_combine, check_load_balancing_loss
from course_utils.checks.ch15 import a_dispatch, b_balance_loss

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def _names_the_mistake(check, answer, mistake):
    with pytest.raises(CheckFailed, match=rf"\[{re.escape(check.exercise)}\]") as info:
        check(answer)
    assert mistake.message in info.value.args[0]


# ------------------------------------------------------------------------------------------
# 15.a dispatch and combine
# ------------------------------------------------------------------------------------------


class AllToAll(torch.autograd.Function):
    """Uneven all-to-all; its backward sends the gradients back along the same routes."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


def dispatch_answer(*, gates=True, unpermute=True, keep=True, slots=None, counts=True, reduce_experts=False):
    """A learner's dispatch (argsort, a hand-written autograd all-to-all), with switches for the mistakes."""

    def dispatch_combine(x, routing, experts, group=None):
        world, L = dist.get_world_size(group), len(experts)
        mask = routing.keep if keep else torch.ones_like(routing.keep)
        if slots is not None:
            mask = mask.clone()
            mask[:, slots:] = False
        token, slot = mask.nonzero(as_tuple=True)
        expert = routing.idx[token, slot]
        order = torch.argsort(expert, stable=True)
        token, slot, expert = token[order], slot[order], expert[order]
        counts_e = torch.bincount(expert, minlength=L * world)
        send = counts_e.view(world, L).sum(1).tolist()
        if counts:
            got = torch.empty_like(counts_e)
            dist.all_to_all_single(got, counts_e, group=group)
            per = got.view(world, L)
        else:  # "I receive what I send"
            per = counts_e.view(world, L)
        recv = per.sum(1).tolist()
        inbox = AllToAll.apply(x[token], send, recv, group)
        chunks = inbox.split(per.reshape(-1).tolist())
        done = torch.cat([experts[i % L](c) for i, c in enumerate(chunks)])
        back = AllToAll.apply(done, recv, send, group)
        if reduce_experts:
            for p in experts.parameters():
                p.register_hook(lambda g: (dist.all_reduce(g, group=group), g)[1])
        w = routing.gates[token, slot, None] if gates else 1.0
        if not unpermute:
            return back * w  # the outputs in the sorted order
        return torch.zeros_like(x).index_add(0, token, w * back)

    return dispatch_combine


def dispatch_by_counting(x, routing, experts, group=None):
    """Right: no argsort, one mask per expert (a counting sort); torch's autograd all-to-all."""
    world, L = dist.get_world_size(group), len(experts)
    tokens, slots, sizes = [], [], []
    for e in range(L * world):
        t, s = ((routing.idx == e) & routing.keep).nonzero(as_tuple=True)
        tokens.append(t)
        slots.append(s)
        sizes.append(len(t))
    token, slot = torch.cat(tokens), torch.cat(slots)
    counts = torch.tensor(sizes, device=x.device)
    got = torch.zeros_like(counts)
    dist.all_to_all_single(got, counts, group=group)
    send = counts.view(world, L).sum(1).tolist()
    recv = got.view(world, L).sum(1).tolist()
    inbox = dnn.all_to_all_single(x.new_zeros(sum(recv), x.shape[1]), x[token], recv, send, group=group)
    pieces, start = [], 0
    for n in got.tolist():
        pieces.append(inbox[start:start + n])
        start += n
    done = torch.cat([experts[i % L](p) for i, p in enumerate(pieces)])
    back = dnn.all_to_all_single(x.new_zeros(len(token), x.shape[1]), done, send, recv, group=group)
    y = torch.zeros_like(x)
    return y.index_add(0, token, back * routing.gates[token, slot].unsqueeze(1))


def dispatch_gathered_counts(x, routing, experts, group=None):
    """Right: counts shared with all_gather (the whole matrix), assignments flattened slot by slot,
    the order undone with out[order] = ... ."""
    world, L = dist.get_world_size(group), len(experts)
    rank = dist.get_rank(group)
    flat_tok = torch.arange(x.shape[0], device=x.device).repeat_interleave(routing.idx.shape[1])
    flat_slot = torch.arange(routing.idx.shape[1], device=x.device).repeat(x.shape[0])
    kept = routing.keep.reshape(-1)
    tok, slot = flat_tok[kept], flat_slot[kept]
    exp = routing.idx.reshape(-1)[kept]
    order = exp.argsort(stable=True)
    counts = torch.bincount(exp, minlength=L * world)
    table = [torch.empty_like(counts) for _ in range(world)]
    dist.all_gather(table, counts, group=group)
    mine = torch.stack([t[rank * L:(rank + 1) * L] for t in table])  # (source, local expert)
    send = counts.view(world, L).sum(1).tolist()
    recv = mine.sum(1).tolist()
    inbox = AllToAll.apply(x[tok[order]], send, recv, group)
    done = torch.cat([experts[i % L](c) for i, c in enumerate(inbox.split(mine.reshape(-1).tolist()))])
    back = AllToAll.apply(done, recv, send, group)
    unsorted = torch.empty_like(back)
    unsorted[order] = back
    return torch.zeros_like(x).index_add(0, tok, routing.gates[tok, slot].unsqueeze(1) * unsorted)


def dispatch_padded(x, routing, experts, group=None):
    """Right (GShard's way): every expert's slots padded to a fixed size, so no counts are exchanged;
    even all-to-alls of an (E, C, d) buffer, the padding's outputs thrown away."""
    world, L = dist.get_world_size(group), len(experts)
    E, T, k = L * world, x.shape[0], routing.idx.shape[1]
    C = T * k  # enough for any routing
    token, slot = routing.keep.nonzero(as_tuple=True)
    expert = routing.idx[token, slot]
    pos = torch.zeros_like(expert)
    for e in range(E):
        sel = expert == e
        pos[sel] = torch.arange(int(sel.sum()), device=x.device)
    buf = x.new_zeros(E * C, x.shape[1]).index_add(0, expert * C + pos, x[token])
    inbox = dnn.all_to_all_single(torch.empty_like(buf), buf, group=group)  # (source, local expert, C)
    inbox = inbox.view(world, L, C, -1)
    done = torch.stack([experts[j](inbox[:, j].reshape(-1, x.shape[1])).view(world, C, -1)
                        for j in range(L)], 1)
    back = dnn.all_to_all_single(torch.empty_like(buf), done.reshape(E * C, -1).contiguous(), group=group)
    out = back[expert * C + pos]
    return torch.zeros_like(x).index_add(0, token, routing.gates[token, slot, None] * out)


@pytest.mark.parametrize("right", [dispatch_answer(), dispatch_by_counting, dispatch_gathered_counts,
                                   dispatch_padded],
                         ids=["argsort_function", "counting_torch_autograd", "all_gather_counts",
                              "padded_gshard"])
def test_dispatch_accepts_right_answers(right, capsys):
    check_dispatch_combine(right)
    out = capsys.readouterr().out
    assert "[PASS] 15.a dispatch and combine" in out


WRONG_DISPATCH = {
    "fixed_buffers": dispatch_answer(counts=False),
    "no_gates": dispatch_answer(gates=False),
    "not_unpermuted": dispatch_answer(unpermute=False),
    "reduces_expert_grads": dispatch_answer(reduce_experts=True),
    "sends_dropped": dispatch_answer(keep=False),
    "first_choice_only": dispatch_answer(slots=1),
}


@pytest.mark.parametrize("mistake, wrong", cases(a_dispatch.CATALOGUE, WRONG_DISPATCH))
def test_dispatch_names_the_mistake(mistake, wrong):
    _names_the_mistake(check_dispatch_combine, wrong, mistake)


def test_the_spy_sees_two_token_all_to_alls_forward_and_two_in_backward(capsys):
    check_dispatch_combine(dispatch_answer(), worlds=(2,))
    out = capsys.readouterr().out
    assert re.search(r"2 ranks: rank 0 ran 3 all-to-all\(s\) forward \(1 of counts, 2 of tokens, "
                     r"rows received \[\d+, \d+\]\) and 2 in backward", out), out


def test_the_dense_reference_equals_the_lessons_route_on_drops():
    """The checker's loop-written drops agree with a vectorised cumulative count (the lesson's way)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(40, 8, generator=g)
    r = a_dispatch.route(logits, 2, 0.75)
    order = r.idx.t().reshape(-1)
    pos = F.one_hot(order, 8).cumsum(0)[torch.arange(80), order] - 1
    assert torch.equal(r.keep, (pos < r.capacity).view(2, 40).t())
    assert 0 < int((~r.keep).sum()) < 80


# ------------------------------------------------------------------------------------------
# 15.b load-balancing loss
# ------------------------------------------------------------------------------------------


def lb_bincount(logits, idx, num_experts):
    f = torch.bincount(idx.flatten(), minlength=num_experts).float() / idx.numel()
    return num_experts * torch.dot(f, logits.softmax(dim=-1).mean(dim=0))


def lb_one_hot(logits, idx, num_experts):
    mask = F.one_hot(idx, num_experts).float()  # (T, k, E)
    f = mask.sum(dim=(0, 1)) / mask.sum()
    return num_experts * (f * F.softmax(logits, dim=1).mean(0)).sum()


def lb_scatter(logits, idx, num_experts):
    counts = torch.zeros(num_experts).scatter_add_(0, idx.reshape(-1), torch.ones(idx.numel()))
    probs = torch.exp(logits - logits.logsumexp(-1, keepdim=True))
    return (counts / counts.sum() * probs.sum(0) / logits.shape[0]).sum() * num_experts


@pytest.mark.parametrize("right", [lb_bincount, lb_one_hot, lb_scatter])
def test_balance_loss_accepts_right_answers(right, capsys):
    check_load_balancing_loss(right)
    assert "[PASS] 15.b load-balancing loss" in capsys.readouterr().out


def lb_no_e(logits, idx, num_experts):
    f = torch.bincount(idx.flatten(), minlength=num_experts).float() / idx.numel()
    return (f * logits.softmax(-1).mean(0)).sum()


def lb_softmax_dim0(logits, idx, num_experts):
    f = torch.bincount(idx.flatten(), minlength=num_experts).float() / idx.numel()
    return num_experts * (f * logits.softmax(0).mean(0)).sum()


def lb_per_token(logits, idx, num_experts):
    f = torch.bincount(idx.flatten(), minlength=num_experts).float() / len(logits)
    return num_experts * (f * logits.softmax(-1).mean(0)).sum()


def lb_probs_twice(logits, idx, num_experts):
    p = logits.softmax(-1).mean(0)
    return num_experts * (p * p).sum()


def lb_detached(logits, idx, num_experts):
    with torch.no_grad():
        f = torch.bincount(idx.flatten(), minlength=num_experts).float() / idx.numel()
        return num_experts * (f * logits.softmax(-1).mean(0)).sum()


def lb_logits(logits, idx, num_experts):
    f = torch.bincount(idx.flatten(), minlength=num_experts).float() / idx.numel()
    return num_experts * (f * logits.mean(0)).sum()


WRONG_LB = {
    "no_factor_e": lb_no_e,
    "softmax_over_tokens": lb_softmax_dim0,
    "per_token_fraction": lb_per_token,
    "probabilities_for_both": lb_probs_twice,
    "no_gradient": lb_detached,
    "uses_logits": lb_logits,
}


@pytest.mark.parametrize("mistake, wrong", cases(b_balance_loss.CATALOGUE, WRONG_LB))
def test_balance_loss_names_the_mistake(mistake, wrong):
    _names_the_mistake(check_load_balancing_loss, wrong, mistake)
