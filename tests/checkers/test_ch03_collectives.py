"""Chapter 03 checkers: all-reduce mean from other primitives, and a ring all-reduce from send/recv.

Each checker runs the function in real gloo workers; it must accept a right answer and reject the
usual mistakes, each with a message that names it: the wrong-answer tests are parametrized over the
exercise's catalogue (course_utils/checks/ch03/), one wrong answer per misconception.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from misconceptions import cases  # tests/checkers/misconceptions.py, beside this file

from course_utils.checking import CheckFailed
from course_utils.checks import check_all_reduce_mean, check_ring_all_reduce
from course_utils.checks.ch03.a_all_reduce_mean import CATALOGUE as MEAN
from course_utils.checks.ch03.b_ring_all_reduce import CATALOGUE as RING

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


def mean_all_gather_then_average(tensor):
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor)
    tensor.copy_(torch.stack(parts).mean(0))


def mean_reduce_scatter_all_gather_padded(tensor):
    world = dist.get_world_size()
    flat = tensor.reshape(-1)
    size = -(-flat.numel() // world)  # ceil: equal pieces, the last one padded with zeros
    padded = torch.cat([flat, flat.new_zeros(size * world - flat.numel())])
    pieces = list(padded.chunk(world))
    mine = torch.empty(size, dtype=tensor.dtype)
    dist.reduce_scatter(mine, pieces)
    mine /= world
    dist.all_gather(pieces, mine)
    tensor.copy_(torch.cat(pieces)[: flat.numel()].view_as(tensor))


def mean_rebinds_the_name(tensor):
    dist.reduce(tensor, dst=0)
    dist.broadcast(tensor, src=0)
    tensor = tensor / dist.get_world_size()  # a new tensor: the caller's keeps the sum


def mean_all_gather_unequal_pieces(tensor):
    world, rank = dist.get_world_size(), dist.get_rank()
    pieces = list(tensor.reshape(-1).tensor_split(world))
    mine = torch.empty_like(pieces[rank])
    dist.reduce_scatter(mine, [p.clone() for p in pieces])
    mine /= world
    dist.all_gather(pieces, mine)  # gloo: pieces must all have the same size


@pytest.mark.parametrize("right", [mean_right, mean_all_gather_then_average,
                                   mean_reduce_scatter_all_gather_padded],
                         ids=lambda f: f.__name__)
def test_mean_accepts_several_right_answers(right, capsys):
    check_all_reduce_mean(right)
    assert "[PASS] 03.a all-reduce mean" in capsys.readouterr().out


# Each misconception of the catalogue: the wrong answer of the same name, and what the failure says.
WRONG_MEAN = {f.__name__: (f, message) for f, message in [
    (mean_forgets_divide, r"got the SUM over the 2 ranks"),
    (mean_uses_all_reduce, r"called a collective this exercise excludes \(dist\.all_reduce"),
    (mean_returns_new_tensor, r"unchanged on every rank.*You returned the mean"),
    (mean_of_elements, r"mean of this rank's own elements"),
    (mean_rebinds_the_name, r"Your line `tensor = tensor / dist.get_world_size\(\)` rebinds the local name.*"
                            r"tensor /= n"),
    (mean_all_gather_unequal_pieces, r"(?s)allgather: invalid tensor size.*gloo's all_gather needs every "
                                     r"rank's piece to have the same size.*Pad the flattened tensor"),
    # After a gloo reduce the other ranks' tensors hold scratch values, not their inputs.
    (mean_no_broadcast, r"while rank\(s\) \[0\] hold the mean.*follow it with dist\.broadcast"),
]}


@pytest.mark.parametrize("mistake, wrong", cases(MEAN, WRONG_MEAN))
def test_mean_rejects_typical_mistakes(mistake, wrong):
    answer, message = wrong
    with pytest.raises(CheckFailed, match=message) as info:
        check_all_reduce_mean(answer)
    assert mistake.message in info.value.args[0]


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


def ring_other_direction(tensor):
    """A ring the other way round, with irecv and one flat receive buffer."""
    world, rank = dist.get_world_size(), dist.get_rank()
    pieces = tensor.view(-1).tensor_split(world)
    to, frm = (rank - 1) % world, (rank + 1) % world
    buf = torch.empty(pieces[0].numel(), dtype=tensor.dtype)
    for s in range(world - 1):
        send_i, recv_i = (rank + s) % world, (rank + s + 1) % world
        incoming = buf[: pieces[recv_i].numel()]
        reqs = [dist.isend(pieces[send_i], to), dist.irecv(incoming, frm)]
        for r in reqs:
            r.wait()
        pieces[recv_i].add_(incoming)
    for s in range(world - 1):
        send_i, recv_i = (rank - 1 + s) % world, (rank + s) % world
        reqs = [dist.isend(pieces[send_i], to), dist.irecv(pieces[recv_i], frm)]
        for r in reqs:
            r.wait()


def ring_overwrites_in_reduce_scatter(tensor):
    world, rank = dist.get_world_size(), dist.get_rank()
    pieces = tensor.view(-1).tensor_split(world)
    right, left = (rank + 1) % world, (rank - 1) % world
    for _phase in range(2):
        for s in range(world - 1):
            send_i, recv_i = (rank - s + _phase) % world, (rank - s - 1 + _phase) % world
            req = dist.isend(pieces[send_i].clone(), right)
            dist.recv(pieces[recv_i], left)  # both phases copy: the partial sums are lost
            req.wait()


def ring_direct_exchange(tensor):
    """Right answer, right byte count, no ring: piece k goes straight to rank k, and back to all."""
    world, rank = dist.get_world_size(), dist.get_rank()
    pieces = tensor.view(-1).tensor_split(world)
    sends = [dist.isend(pieces[p].clone(), p) for p in range(world) if p != rank]
    for p in range(world):
        if p != rank:
            buf = torch.empty_like(pieces[rank])
            dist.recv(buf, p)
            pieces[rank].add_(buf)
    for r in sends:
        r.wait()
    sends = [dist.isend(pieces[rank], p) for p in range(world) if p != rank]
    for p in range(world):
        if p != rank:
            dist.recv(pieces[p], p)
    for r in sends:
        r.wait()


def ring_swaps_whole_tensor(tensor):
    """Right at N = 2, with the ring's byte count: one swap of the whole tensor with the neighbour."""
    world, rank = dist.get_world_size(), dist.get_rank()
    buf = torch.empty_like(tensor)
    req = dist.isend(tensor.clone(), (rank + 1) % world)
    dist.recv(buf, (rank - 1) % world)
    req.wait()
    tensor += buf


def ring_rank1_fails(tensor):
    if dist.get_rank() == 1:
        raise ValueError("piece index out of range on rank 1")
    ring_right(tensor)


@pytest.mark.parametrize("right", [ring_right, ring_other_direction], ids=lambda f: f.__name__)
def test_ring_accepts_several_rings(right, capsys):
    check_ring_all_reduce(right)
    assert "[PASS] 03.b ring all-reduce" in capsys.readouterr().out


# Each misconception of the catalogue: the wrong answer of the same name, the checker's arguments,
# and what the failure says.
WRONG_RING = {f.__name__: (f, kwargs, message) for f, kwargs, message in [
    (ring_reduce_scatter_only, {}, r"partial sums: that is the state after the reduce-scatter phase"
                                   r".*all-gather phase is missing"),
    (ring_assumes_divisible, {},
     r"(?s)7 elements\), dtype float32: RuntimeError.*assuming the size divides"),
    (ring_adds_in_all_gather, {}, r"full sum PLUS a partial sum.*the all-gather phase adds"),
    (ring_overwrites_in_reduce_scatter, {},
     r"every piece holds ONE rank's input.*overwrites what it receives"),
    (ring_direct_exchange, {}, r"rank \d of 3 sent to rank\(s\) \[\d, \d\].*that is not a ring"),
    (ring_uses_all_reduce, {}, r"called a collective this exercise excludes \(dist\.all_reduce"),
    (ring_returns_new_tensor, {}, r"the tensor is unchanged.*You returned the sum"),
    # A deadlock of blocking sends.
    (ring_blocking_sends, {"timeout": 8}, r"hung with world size 2.*every rank is blocked in dist\.send"),
    # The bytes of whole tensors sent to every rank are counted.
    (ring_send_everything, {"worlds": (3,)}, r"rank \d of 3 sent \d+ bytes.*is not a ring all-reduce"),
    # At N = 2 the swap sends exactly the ring's 2(N-1)/N x size: only the message size tells.
    (ring_swaps_whole_tensor, {"worlds": (2,)},
     r"rank \d of 2 sent a message of \d+ bytes.*more than one piece.*when N = 2"),
]}


@pytest.mark.parametrize("mistake, wrong", cases(RING, WRONG_RING))
def test_ring_rejects_typical_mistakes(mistake, wrong):
    answer, kwargs, message = wrong
    with pytest.raises(CheckFailed, match=message) as info:
        check_ring_all_reduce(answer, **kwargs)
    assert mistake.message in info.value.args[0]


def test_ring_rejects_whole_tensors_sent_to_every_rank_on_every_world_size():
    with pytest.raises(CheckFailed, match=r"rank \d of 2 sent a message of \d+ bytes.*more than one piece"):
        check_ring_all_reduce(ring_send_everything)


def test_ring_stub_is_not_done():
    def stub(tensor):
        raise NotImplementedError("Exercise 03.b ring all-reduce: replace this line with your code")

    with pytest.raises(CheckFailed, match=r"not done yet.*Exercise 03\.b ring all-reduce"):
        check_ring_all_reduce(stub)


def test_ring_quotes_the_root_cause_not_the_peer_reset():
    with pytest.raises(CheckFailed) as info:
        check_ring_all_reduce(ring_rank1_fails, worlds=(2,), timeout=20)
    message = str(info.value)
    assert "rank 1" in message and "ValueError: piece index out of range on rank 1" in message
    assert not re.search(r"Connection (closed|reset)", message), message
