"""Chapter 03 checkers: all-reduce mean from other primitives, and a ring all-reduce from send/recv.

Each checker runs the function in real gloo workers; it must accept a right answer and reject the
usual mistakes, each with a message that names it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from course_utils.checking import CheckFailed
from course_utils.checks import check_all_reduce_mean, check_ring_all_reduce

# --------------------------------------------------------------------------------------------
# 03.a all-reduce mean
# --------------------------------------------------------------------------------------------


def mean_right(tensor):
    dist.reduce(tensor, dst=0)
    dist.broadcast(tensor, src=0)
    tensor /= dist.get_world_size()


def mean_forgets_divide(tensor):
    dist.reduce(tensor, dst=0)
    dist.broadcast(tensor, src=0)


def mean_no_broadcast(tensor):
    dist.reduce(tensor, dst=0)
    if dist.get_rank() == 0:
        tensor /= dist.get_world_size()


def mean_uses_all_reduce(tensor):
    dist.all_reduce(tensor)
    tensor /= dist.get_world_size()


def mean_returns_new_tensor(tensor):
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor)
    return torch.stack(parts).mean(0)


def mean_of_elements(tensor):
    tensor.fill_(tensor.mean().item())


def test_mean_accepts_reduce_then_broadcast(capsys):
    check_all_reduce_mean(mean_right)
    assert "[PASS] 03.a all-reduce mean" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (mean_forgets_divide, r"got the SUM over the 2 ranks"),
    (mean_uses_all_reduce, r"called a collective this exercise excludes \(dist\.all_reduce"),
    (mean_returns_new_tensor, r"unchanged on every rank.*You returned the mean"),
    (mean_of_elements, r"mean of this rank's own elements"),
], ids=lambda v: getattr(v, "__name__", "msg"))
def test_mean_rejects_typical_mistakes(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        check_all_reduce_mean(wrong)


def test_mean_rejects_reduce_without_broadcast():
    # After a gloo reduce the other ranks' tensors hold scratch values, not their inputs.
    with pytest.raises(CheckFailed, match=r"while rank\(s\) \[0\] hold the mean.*follow it "
                                          r"with dist\.broadcast"):
        check_all_reduce_mean(mean_no_broadcast)


# --------------------------------------------------------------------------------------------
# 03.b ring all-reduce
# --------------------------------------------------------------------------------------------


def ring_right(tensor):
    world, rank = dist.get_world_size(), dist.get_rank()
    pieces = tensor.view(-1).tensor_split(world)
    right, left = (rank + 1) % world, (rank - 1) % world
    for s in range(world - 1):
        send_i, recv_i = (rank - s) % world, (rank - s - 1) % world
        buf = torch.empty_like(pieces[recv_i])
        req = dist.isend(pieces[send_i], right)
        dist.recv(buf, left)
        req.wait()
        pieces[recv_i].add_(buf)
    for s in range(world - 1):
        send_i, recv_i = (rank + 1 - s) % world, (rank - s) % world
        req = dist.isend(pieces[send_i], right)
        dist.recv(pieces[recv_i], left)
        req.wait()


def ring_reduce_scatter_only(tensor):
    world, rank = dist.get_world_size(), dist.get_rank()
    pieces = tensor.view(-1).tensor_split(world)
    right, left = (rank + 1) % world, (rank - 1) % world
    for s in range(world - 1):
        send_i, recv_i = (rank - s) % world, (rank - s - 1) % world
        buf = torch.empty_like(pieces[recv_i])
        req = dist.isend(pieces[send_i], right)
        dist.recv(buf, left)
        req.wait()
        pieces[recv_i].add_(buf)


def ring_assumes_divisible(tensor):
    world, rank = dist.get_world_size(), dist.get_rank()
    pieces = tensor.view(world, -1)  # fails when the size does not divide by world
    right, left = (rank + 1) % world, (rank - 1) % world
    for s in range(world - 1):
        send_i, recv_i = (rank - s) % world, (rank - s - 1) % world
        buf = torch.empty_like(pieces[recv_i])
        req = dist.isend(pieces[send_i].contiguous(), right)
        dist.recv(buf, left)
        req.wait()
        pieces[recv_i].add_(buf)
    for s in range(world - 1):
        send_i, recv_i = (rank + 1 - s) % world, (rank - s) % world
        buf = torch.empty_like(pieces[recv_i])
        req = dist.isend(pieces[send_i].contiguous(), right)
        dist.recv(buf, left)
        req.wait()
        pieces[recv_i].copy_(buf)


def ring_blocking_sends(tensor):
    world, rank = dist.get_world_size(), dist.get_rank()
    pieces = tensor.view(-1).tensor_split(world)
    right, left = (rank + 1) % world, (rank - 1) % world
    for s in range(world - 1):
        send_i, recv_i = (rank - s) % world, (rank - s - 1) % world
        buf = torch.empty_like(pieces[recv_i])
        dist.send(pieces[send_i], right)  # every rank sends first: nobody is receiving
        dist.recv(buf, left)
        pieces[recv_i].add_(buf)


def ring_adds_in_all_gather(tensor):
    world, rank = dist.get_world_size(), dist.get_rank()
    pieces = tensor.view(-1).tensor_split(world)
    right, left = (rank + 1) % world, (rank - 1) % world
    for phase in range(2):
        for s in range(world - 1):
            send_i = (rank - s + phase) % world
            recv_i = (rank - s - 1 + phase) % world
            buf = torch.empty_like(pieces[recv_i])
            req = dist.isend(pieces[send_i], right)
            dist.recv(buf, left)
            req.wait()
            pieces[recv_i].add_(buf)


def ring_send_everything(tensor):
    """Right answer, wrong algorithm: every rank sends its whole tensor to every other rank."""
    world, rank = dist.get_world_size(), dist.get_rank()
    original = tensor.clone()
    reqs = [dist.isend(original, p) for p in range(world) if p != rank]
    for p in range(world):
        if p != rank:
            buf = torch.empty_like(tensor)
            dist.recv(buf, p)
            tensor += buf
    for r in reqs:
        r.wait()


def ring_uses_all_reduce(tensor):
    dist.all_reduce(tensor)


def ring_returns_new_tensor(tensor):
    out = tensor.clone()
    ring_right(out)
    return out


def test_ring_accepts_a_ring(capsys):
    check_ring_all_reduce(ring_right)
    assert "[PASS] 03.b ring all-reduce" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (ring_reduce_scatter_only, r"partial sums: that is the state after the reduce-scatter phase.*all-gather phase is missing"),
    (ring_assumes_divisible, r"(?s)7 elements\), dtype float32: RuntimeError.*assuming the size divides"),
    (ring_adds_in_all_gather, r"full sum PLUS a partial sum.*the all-gather phase adds"),
    (ring_send_everything, r"rank \d of 3 sent \d+ bytes.*is not a ring all-reduce"),
    (ring_uses_all_reduce, r"called a collective this exercise excludes \(dist\.all_reduce"),
    (ring_returns_new_tensor, r"the tensor is unchanged.*You returned the sum"),
], ids=lambda v: getattr(v, "__name__", "msg"))
def test_ring_rejects_typical_mistakes(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        check_ring_all_reduce(wrong)


def test_ring_reports_a_deadlock_of_blocking_sends():
    with pytest.raises(CheckFailed, match=r"hung with world size 2.*every rank is blocked in "
                                          r"dist\.send"):
        check_ring_all_reduce(ring_blocking_sends, timeout=8)


def test_ring_stub_is_not_done():
    def stub(tensor):
        raise NotImplementedError("Exercise 03.b ring all-reduce: replace this line with your code")

    with pytest.raises(CheckFailed, match=r"not done yet.*Exercise 03\.b ring all-reduce"):
        check_ring_all_reduce(stub)
