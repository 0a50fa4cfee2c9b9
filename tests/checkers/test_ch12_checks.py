"""Chapter 12 checkers: correct answers written differently pass, each misconception is named."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from catalogue import cases  # tests/checkers/catalogue.py, beside this file

from course_utils.checking import CheckFailed
from course_utils.checks import check_gpipe
from course_utils.checks.ch12 import a_gpipe

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


# ------------------------------------------------------------------------------------------
# 12.a GPipe schedule
# ------------------------------------------------------------------------------------------


def _ends(stage, n_micro, inputs, targets):
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = next(stage.parameters()).device
    xs = inputs.chunk(n_micro) if rank == 0 else [None] * n_micro
    ys = targets.chunk(n_micro) if rank == world - 1 else [None] * n_micro
    return rank, world, dev, xs, ys


def gpipe_send_recv(stage, inputs, targets, loss_fn, n_micro, act_shape):
    """Blocking send/recv; backwards in reverse micro-batch order."""
    rank, world, dev, xs, ys = _ends(stage, n_micro, inputs, targets)
    saved, total = [], 0.0
    for i in range(n_micro):
        x = xs[i]
        if rank > 0:
            x = torch.empty(act_shape, device=dev)
            dist.recv(x, src=rank - 1)
            x.requires_grad_()
        out = stage(x)
        if rank == world - 1:
            out = loss_fn(out, ys[i]) / n_micro
            total += out.item()
        else:
            dist.send(out.detach(), dst=rank + 1)
        saved.append((x, out))
    for x, out in reversed(saved):
        if rank == world - 1:
            out.backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, src=rank + 1)
            out.backward(grad)
        if rank > 0:
            dist.send(x.grad, dst=rank - 1)
    return total if rank == world - 1 else None


def gpipe_isend_irecv(stage, inputs, targets, loss_fn, n_micro, act_shape):
    """isend/irecv with waits; backwards in forward micro-batch order; losses summed as tensors."""
    rank, world, dev, xs, ys = _ends(stage, n_micro, inputs, targets)
    inputs_, outputs, pending = [], [], []
    for i in range(n_micro):
        if rank == 0:
            x = xs[i]
        else:
            x = torch.empty(act_shape, device=dev)
            dist.irecv(x, src=rank - 1).wait()
            x.requires_grad_()
        y = stage(x)
        if rank == world - 1:
            y = loss_fn(y, ys[i]) / n_micro
        else:
            pending.append(dist.isend(y.detach(), dst=rank + 1))
        inputs_.append(x)
        outputs.append(y)
    for x, y in zip(inputs_, outputs):
        if rank == world - 1:
            y.backward()
        else:
            g = torch.empty_like(y)
            dist.irecv(g, src=rank + 1).wait()
            y.backward(g)
        if rank > 0:
            pending.append(dist.isend(x.grad, dst=rank - 1))
    for w in pending:
        w.wait()
    return sum(o.detach() for o in outputs) if rank == world - 1 else None


def gpipe_batched(stage, inputs, targets, loss_fn, n_micro, act_shape):
    """batch_isend_irecv for every message."""
    rank, world, dev, xs, ys = _ends(stage, n_micro, inputs, targets)

    def exchange(op, tensor, peer):
        for w in dist.batch_isend_irecv([dist.P2POp(op, tensor, peer)]):
            w.wait()

    saved, total = [], 0.0
    for i in range(n_micro):
        x = xs[i]
        if rank > 0:
            x = torch.empty(act_shape, device=dev, requires_grad=False)
            exchange(dist.irecv, x, rank - 1)
            x.requires_grad_()
        out = stage(x)
        if rank == world - 1:
            out = loss_fn(out, ys[i]) / n_micro
            total += out.item()
        else:
            exchange(dist.isend, out.detach(), rank + 1)
        saved.append((x, out))
    for x, out in reversed(saved):
        if rank == world - 1:
            out.backward()
        else:
            grad = torch.empty_like(out)
            exchange(dist.irecv, grad, rank + 1)
            out.backward(grad)
        if rank > 0:
            exchange(dist.isend, x.grad, rank - 1)
    return total if rank == world - 1 else None


def one_f_one_b_style(stage, inputs, targets, loss_fn, n_micro, act_shape):
    """Forward and backward of each micro-batch before the next one (correct gradients, not GPipe)."""
    rank, world, dev, xs, ys = _ends(stage, n_micro, inputs, targets)
    total = 0.0
    for i in range(n_micro):
        x = xs[i]
        if rank > 0:
            x = torch.empty(act_shape, device=dev)
            dist.recv(x, src=rank - 1)
            x.requires_grad_()
        out = stage(x)
        if rank == world - 1:
            loss = loss_fn(out, ys[i]) / n_micro
            total += loss.item()
            loss.backward()
        else:
            dist.send(out.detach(), dst=rank + 1)
            grad = torch.empty_like(out)
            dist.recv(grad, src=rank + 1)
            out.backward(grad)
        if rank > 0:
            dist.send(x.grad, dst=rank - 1)
    return total if rank == world - 1 else None


def unscaled_losses(stage, inputs, targets, loss_fn, n_micro, act_shape):
    """Each micro-batch's mean loss backpropagated as it is."""
    rank, world, dev, xs, ys = _ends(stage, n_micro, inputs, targets)
    saved, total = [], 0.0
    for i in range(n_micro):
        x = xs[i]
        if rank > 0:
            x = torch.empty(act_shape, device=dev)
            dist.recv(x, src=rank - 1)
            x.requires_grad_()
        out = stage(x)
        if rank == world - 1:
            out = loss_fn(out, ys[i])
            total += out.item() / n_micro
        else:
            dist.send(out.detach(), dst=rank + 1)
        saved.append((x, out))
    for x, out in reversed(saved):
        if rank == world - 1:
            out.backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, src=rank + 1)
            out.backward(grad)
        if rank > 0:
            dist.send(x.grad, dst=rank - 1)
    return total if rank == world - 1 else None


def autograd_across_send(stage, inputs, targets, loss_fn, n_micro, act_shape):
    """Activations sent forward; the last stage's backward is trusted to reach the others."""
    rank, world, dev, xs, ys = _ends(stage, n_micro, inputs, targets)
    losses = []
    for i in range(n_micro):
        x = xs[i]
        if rank > 0:
            x = torch.empty(act_shape, device=dev)
            dist.recv(x, src=rank - 1)
            x.requires_grad_()
        out = stage(x)
        if rank == world - 1:
            losses.append(loss_fn(out, ys[i]) / n_micro)
        else:
            dist.send(out, dst=rank + 1)
    if rank == world - 1:
        loss = sum(losses)
        loss.backward()
        return loss.item()
    return None


def keeps_last_only(stage, inputs, targets, loss_fn, n_micro, act_shape):
    """One variable per stage, overwritten by each micro-batch."""
    rank, world, dev, xs, ys = _ends(stage, n_micro, inputs, targets)
    total = 0.0
    for i in range(n_micro):
        x = xs[i]
        if rank > 0:
            x = torch.empty(act_shape, device=dev)
            dist.recv(x, src=rank - 1)
            x.requires_grad_()
        out = stage(x)
        if rank == world - 1:
            out = loss_fn(out, ys[i]) / n_micro
            total += out.item()
        else:
            dist.send(out.detach(), dst=rank + 1)
    for _ in range(n_micro):
        if rank == world - 1:
            out.backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, src=rank + 1)
            out.backward(grad)
        if rank > 0:
            dist.send(x.grad, dst=rank - 1)
    return total if rank == world - 1 else None


def receives_first(stage, inputs, targets, loss_fn, n_micro, act_shape):
    """Every receive a micro-batch needs (activation and gradient) posted first, then the sends."""
    rank, world, dev, xs, ys = _ends(stage, n_micro, inputs, targets)
    total = 0.0
    for i in range(n_micro):
        x, grad = xs[i], None
        if rank > 0:
            x = torch.empty(act_shape, device=dev)
            dist.recv(x, src=rank - 1)
            x.requires_grad_()
        if rank < world - 1:
            grad = torch.empty(act_shape, device=dev)
            dist.recv(grad, src=rank + 1)
        out = stage(x)
        if rank == world - 1:
            loss = loss_fn(out, ys[i]) / n_micro
            total += loss.item()
            loss.backward()
        else:
            dist.send(out.detach(), dst=rank + 1)
            out.backward(grad)
        if rank > 0:
            dist.send(x.grad, dst=rank - 1)
    return total if rank == world - 1 else None


def stub(stage, inputs, targets, loss_fn, n_micro, act_shape):
    raise NotImplementedError("Exercise 12.a GPipe schedule: fill in gpipe_step")


@pytest.mark.parametrize("answer", [gpipe_send_recv, gpipe_isend_irecv, gpipe_batched])
def test_gpipe_correct_answers_pass(answer, capsys):
    check_gpipe(answer)
    assert "[PASS] 12.a" in capsys.readouterr().out


WRONG_A = {
    "backward_before_all_forwards": one_f_one_b_style,
    "loss_not_scaled": unscaled_losses,
    "no_gradients_returned": autograd_across_send,
    "no_saved_activations": keeps_last_only,
    "receive_order_deadlock": receives_first,
}


@pytest.mark.parametrize(("entry", "answer"), cases(a_gpipe.CATALOGUE, WRONG_A))
def test_gpipe_names_each_misconception(entry, answer):
    timeout = 8.0 if entry.key == "receive_order_deadlock" else a_gpipe.TIMEOUT
    with pytest.raises(CheckFailed) as e:
        check_gpipe(answer, timeout=timeout)
    assert entry.message in str(e.value), str(e.value)


def test_gpipe_stub_is_not_done_yet():
    with pytest.raises(CheckFailed, match="not done yet"):
        check_gpipe(stub)
