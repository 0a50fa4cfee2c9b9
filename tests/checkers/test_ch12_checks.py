"""Chapter 12 checkers: correct answers written differently pass, each misconception is named."""

from __future__ import annotations

import math
import os
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from misconceptions import cases  # tests/checkers/misconceptions.py, beside this file
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from course_utils.checking import CheckFailed
from course_utils.checks import check_gpipe, check_rank_memory, check_resharding
from course_utils.checks.ch12 import a_gpipe, b_resharding, c_memory

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


def _gpipe(stage, inputs, targets, loss_fn, n_micro, act_shape, *, cut="chunk", mark=True, reuse=False,
           orders=("reversed", "reversed"), zero_grad=False, grad_op="recv"):
    """The right answer with one habit changed at a time (the keywords), as a learner might write it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == world - 1
    dev = next(stage.parameters()).device
    xs = getattr(inputs, cut)(n_micro) if first else None
    ys = targets.chunk(n_micro) if last else None
    saved, total, buf = [], 0.0, torch.empty(act_shape, device=dev)
    for i in range(n_micro):
        if first:
            x = xs[i]
        else:
            x = buf if reuse else torch.empty(act_shape, device=dev)
            dist.recv(x, src=rank - 1)
            if mark:
                x.requires_grad_()
        out = stage(x)
        if last:
            out = loss_fn(out, ys[i]) / n_micro
            total += out.item()
        else:
            dist.send(out.detach(), dst=rank + 1)
        saved.append((x, out))
    order = orders[1] if last else orders[0]
    for x, out in (reversed(saved) if order == "reversed" else saved):
        if zero_grad:
            stage.zero_grad()
        if last:
            out.backward()
        else:
            grad = torch.empty_like(out)
            getattr(dist, grad_op)(grad, rank + 1)
            out.backward(grad)
        if not first:
            dist.send(x.grad, dst=rank - 1)
    return total if last else None


def split_instead_of_chunk(*args):
    return _gpipe(*args, cut="split")


def received_without_requires_grad(*args):
    return _gpipe(*args, mark=False)


def one_receive_buffer(*args):
    return _gpipe(*args, reuse=True)


def last_stage_in_forward_order(*args):
    return _gpipe(*args, orders=("reversed", "forward"))


def zero_grad_per_micro_batch(*args):
    return _gpipe(*args, zero_grad=True)


def sends_where_it_should_receive(*args):
    return _gpipe(*args, grad_op="send")


def exits_the_process(stage, inputs, targets, loss_fn, n_micro, act_shape):
    os._exit(0)


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
    "split_not_chunk": split_instead_of_chunk,
    "input_not_requiring_grad": received_without_requires_grad,
    "reused_receive_buffer": one_receive_buffer,
    "backward_order_mismatch": last_stage_in_forward_order,
    "zero_grad_between_micro_batches": zero_grad_per_micro_batch,
    "both_ranks_send": sends_where_it_should_receive,
}


@pytest.mark.parametrize(("entry", "answer"), cases(a_gpipe.CATALOGUE, WRONG_A))
def test_gpipe_names_each_misconception(entry, answer):
    # a deadlock's stacks are read when the time is up: long enough for every rank to reach it on a
    # loaded machine (a start and the first forwards take a few seconds there)
    timeout = 15.0 if entry.key in ("receive_order_deadlock", "both_ranks_send") else a_gpipe.TIMEOUT
    with pytest.raises(CheckFailed) as e:
        check_gpipe(answer, timeout=timeout)
    assert entry.message in str(e.value), str(e.value)


def test_gpipe_names_a_process_that_exits_instead_of_a_checker_bug():
    with pytest.raises(CheckFailed) as e:
        check_gpipe(exits_the_process)
    assert "ended the process without returning from gpipe_step" in str(e.value), str(e.value)
    assert "checker bug" not in str(e.value)


def test_gpipe_stub_is_not_done_yet():
    with pytest.raises(CheckFailed, match="not done yet"):
        check_gpipe(stub)


# ------------------------------------------------------------------------------------------
# 12.c per-rank memory
# ------------------------------------------------------------------------------------------


def _shard_numel(shape, shards):
    """FSDP2's shard of one parameter on rank 0: dim 0 cut like torch.chunk (ceil), the rest whole."""
    rest = math.prod(shape[1:])
    return -(-shape[0] // shards) * rest


def rank_bytes_exact(shapes, mesh_shape):
    """Rank 0's shard with the padding of the first dimension."""
    shards = mesh_shape[-1]
    n = sum(_shard_numel(s, shards) for s in shapes)
    return {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n}


def rank_bytes_mean(shapes, mesh_shape):
    """The mean share: total / shards (no padding)."""
    total = sum(math.prod(s) for s in shapes) * 4
    shard = total / mesh_shape[-1]
    return {"params": shard, "grads": shard, "optimizer": 2 * shard}


def params_whole(shapes, mesh_shape):
    total = sum(math.prod(s) for s in shapes) * 4
    return {"params": total, "grads": total / mesh_shape[-1], "optimizer": 2 * total / mesh_shape[-1]}


def grads_whole(shapes, mesh_shape):
    total = sum(math.prod(s) for s in shapes) * 4
    return {"params": total / mesh_shape[-1], "grads": total, "optimizer": 2 * total / mesh_shape[-1]}


def one_state(shapes, mesh_shape):
    shard = sum(math.prod(s) for s in shapes) * 4 / mesh_shape[-1]
    return {"params": shard, "grads": shard, "optimizer": shard}


def divide_by_world(shapes, mesh_shape):
    shard = sum(math.prod(s) for s in shapes) * 4 / math.prod(mesh_shape)
    return {"params": shard, "grads": shard, "optimizer": 2 * shard}


def rank_bytes_numpy(shapes, mesh_shape):
    """numpy arithmetic: the numbers are numpy.int64."""
    shards = np.int64(mesh_shape[-1])
    n = sum(-(-np.int64(s[0]) // shards) * np.prod(s[1:], dtype=np.int64) for s in shapes)
    return {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n}


def bf16_bytes(shapes, mesh_shape):
    n = sum(_shard_numel(s, mesh_shape[-1]) for s in shapes)
    return {"params": 2 * n, "grads": 2 * n, "optimizer": 4 * n}


def divide_by_first_dim(shapes, mesh_shape):
    n = sum(_shard_numel(s, mesh_shape[0]) for s in shapes)
    return {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n}


def memory_stub(shapes, mesh_shape):
    raise NotImplementedError("Exercise 12.c per-rank memory: fill in predict_rank_bytes")


@pytest.mark.parametrize("answer", [rank_bytes_exact, rank_bytes_mean, rank_bytes_numpy])
def test_memory_correct_answers_pass(answer, capsys):
    check_rank_memory(answer)
    assert "[PASS] 12.c" in capsys.readouterr().out


WRONG_C = {
    "params_unsharded": params_whole,
    "grads_unsharded": grads_whole,
    "one_optimizer_state": one_state,
    "replicas_also_shard": divide_by_world,
    "two_bytes_per_number": bf16_bytes,
    "shards_over_replicas": divide_by_first_dim,
}


@pytest.mark.parametrize(("entry", "answer"), cases(c_memory.CATALOGUE, WRONG_C))
def test_memory_names_each_misconception(entry, answer):
    with pytest.raises(CheckFailed) as e:
        check_rank_memory(answer)
    assert entry.message in str(e.value), str(e.value)


def test_memory_stub_is_not_done_yet():
    with pytest.raises(CheckFailed, match="not done yet"):
        check_rank_memory(memory_stub)


# ------------------------------------------------------------------------------------------
# 12.b resharding
# ------------------------------------------------------------------------------------------


def shard_layers(model):
    """fully_shard each Linear, then the root, over every rank of the job."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def shard_root(model):
    """One fully_shard on the whole model (the default mesh: every rank)."""
    return fully_shard(model)


def save_dcp(model, optimizer, path):
    """Written over the previous checkpoint's files, in place (not atomic)."""
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def load_dcp(model, optimizer, path):
    msd, osd = get_state_dict(model, optimizer)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)


def save_latest_link(model, optimizer, path):
    """A new folder per save; after a barrier rank 0 switches path/latest to it with os.replace."""
    name = [f"v{time.time_ns()}" if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(path, name[0]))
    dist.barrier()
    if dist.get_rank() == 0:
        os.symlink(name[0], os.path.join(path, "latest.tmp"))
        os.replace(os.path.join(path, "latest.tmp"), os.path.join(path, "latest"))
    dist.barrier()


def load_latest_link(model, optimizer, path):
    load_dcp(model, optimizer, os.path.join(path, os.readlink(os.path.join(path, "latest"))))


def save_commit_marker(model, optimizer, path):
    """A numbered folder per save, and a COMMITTED file that rank 0 writes last."""
    n = 0
    while os.path.exists(os.path.join(path, f"step{n}")):
        n += 1
    dist.barrier()  # every rank counted before any created the next folder
    folder = os.path.join(path, f"step{n}")
    save_dcp(model, optimizer, folder)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(folder, "COMMITTED"), "w") as f:
            f.write("ok")
    dist.barrier()


def load_commit_marker(model, optimizer, path):
    done = [d for d in os.listdir(path) if os.path.exists(os.path.join(path, d, "COMMITTED"))]
    if not done:
        raise FileNotFoundError(f"no complete checkpoint in {path}")
    load_dcp(model, optimizer, os.path.join(path, max(done, key=lambda d: int(d[4:]))))


def save_async_separately(model, optimizer, path):
    state = {"weights": get_model_state_dict(model), "adamw": get_optimizer_state_dict(model, optimizer)}
    name = [f"v{time.time_ns()}" if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    dcp.async_save(state, checkpoint_id=os.path.join(path, name[0])).result()
    dist.barrier()
    if dist.get_rank() == 0:
        os.symlink(name[0], os.path.join(path, ".next"))
        os.replace(os.path.join(path, ".next"), os.path.join(path, "latest"))
    dist.barrier()


def load_separately(model, optimizer, path):
    state = {"weights": get_model_state_dict(model), "adamw": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=os.path.realpath(os.path.join(path, "latest")))
    set_model_state_dict(model, state["weights"])
    set_optimizer_state_dict(model, optimizer, state["adamw"])


def save_optimizer_by_position(model, optimizer, path):
    """The optimizer's own state_dict (keys 0, 1, ...), saved atomically."""
    name = [f"v{time.time_ns()}" if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    dcp.save({"model": get_model_state_dict(model), "optim": optimizer.state_dict()},
             checkpoint_id=os.path.join(path, name[0]))
    dist.barrier()
    if dist.get_rank() == 0:
        os.symlink(name[0], os.path.join(path, "latest.tmp"))
        os.replace(os.path.join(path, "latest.tmp"), os.path.join(path, "latest"))
    dist.barrier()


def save_rank0_torch(model, optimizer, path):
    """Chapter 06's checkpoint: rank 0 writes one file."""
    if dist.get_rank() == 0:
        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, path)


def load_rank0_torch(model, optimizer, path):
    ckpt = torch.load(path, weights_only=False)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optim"])


def load_model_only(model, optimizer, path):
    msd = get_model_state_dict(model)
    dcp.load({"model": msd}, checkpoint_id=os.path.join(path, os.readlink(os.path.join(path, "latest"))))
    set_model_state_dict(model, msd)


def shard_for_two(model):
    """The mesh of the job that saved the checkpoint."""
    mesh = init_device_mesh("cpu", (2,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def resharding_stub(model, optimizer=None, path=None):
    raise NotImplementedError("Exercise 12.b resharding: fill in shard")


@pytest.mark.parametrize("answer", [(shard_layers, save_latest_link, load_latest_link),
                                    (shard_layers, save_commit_marker, load_commit_marker),
                                    (shard_root, save_async_separately, load_separately)],
                         ids=["latest-link", "commit-marker", "separate+async_save"])
def test_resharding_correct_answers_pass(answer, capsys):
    check_resharding(*answer)
    assert "[PASS] 12.b" in capsys.readouterr().out


WRONG_B = {
    "saves_on_rank_zero_only": (shard_layers, save_rank0_torch, load_rank0_torch),
    "loads_without_optimizer": (shard_layers, save_latest_link, load_model_only),
    "saves_in_place": (shard_layers, save_dcp, load_dcp),
    "optimizer_by_position": (shard_layers, save_optimizer_by_position, load_latest_link),
    "model_for_old_world": (shard_for_two, save_latest_link, load_latest_link),
}


@pytest.mark.parametrize(("entry", "answer"), cases(b_resharding.CATALOGUE, WRONG_B))
def test_resharding_names_each_misconception(entry, answer):
    with pytest.raises(CheckFailed) as e:
        check_resharding(*answer)
    assert entry.message in str(e.value), str(e.value)


def test_resharding_stub_is_not_done_yet():
    with pytest.raises(CheckFailed, match="not done yet"):
        check_resharding(resharding_stub, save_latest_link, load_latest_link)


def save_dcp_on_rank0(model, optimizer, path):
    """DCP, but only rank 0 saves (without the others: no_dist)."""
    msd, osd = get_state_dict(model, optimizer)
    if dist.get_rank() == 0:
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path, no_dist=True)


def test_resharding_sees_a_dcp_checkpoint_of_rank_zero_alone():
    with pytest.raises(CheckFailed) as e:
        check_resharding(shard_layers, save_dcp_on_rank0, load_dcp)
    assert b_resharding.CATALOGUE.hint("saves_on_rank_zero_only") in str(e.value), str(e.value)
    assert "elements of" in str(e.value), str(e.value)


def save_dcp_rank0_collective(model, optimizer, path):
    """dcp.save on rank 0 only, with the group (it waits for ranks that never join)."""
    msd, osd = get_state_dict(model, optimizer)
    if dist.get_rank() == 0:
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def test_resharding_names_a_rank_zero_only_dcp_save_that_hangs():
    with pytest.raises(CheckFailed) as e:
        check_resharding(shard_layers, save_dcp_rank0_collective, load_dcp, timeout=30)
    message = str(e.value)
    assert b_resharding.CATALOGUE.hint("saves_on_rank_zero_only") in message, message
    assert "course_utils" not in message, message
