"""Chapter 14 checkers: correct answers written differently pass, each misconception is named."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from misconceptions import cases  # tests/checkers/misconceptions.py, beside this file
from torch.distributed._functional_collectives import all_to_all_single_autograd

from course_utils.checking import CheckFailed
from course_utils.checks import check_ring_attention, check_ulysses, check_zigzag
from course_utils.checks.ch14 import a_ring_attention, b_zigzag, c_ulysses

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

# ------------------------------------------------------------------------------------------
# 14.a ring attention
# ------------------------------------------------------------------------------------------


def _scores(q, k, rank, src):
    """Scaled scores of this rank's queries against rank src's keys, with the global causal mask."""
    n = q.shape[2]
    qpos = rank * n + torch.arange(n)
    kpos = src * n + torch.arange(n)
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    return s.masked_fill(qpos[:, None] < kpos[None, :], float("-inf"))


def ring_batched_lse(q, k, v):
    """batch_isend_irecv of K and V stacked; blocks merged with log-sum-exp."""
    rank, world = dist.get_rank(), dist.get_world_size()
    kv = torch.stack([k, v])
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"))
    for step in range(world):
        src = (rank - step) % world
        if step < world - 1:
            nxt = torch.empty_like(kv)
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (rank + 1) % world),
                                           dist.P2POp(dist.irecv, nxt, (rank - 1) % world)])
        if src <= rank:
            s = _scores(q, kv[0], rank, src)
            blk = torch.logsumexp(s, -1)
            new = torch.logaddexp(lse, blk)
            out = out * torch.exp(lse - new)[..., None] + torch.exp(s - new[..., None]) @ kv[1]
            lse = new
        if step < world - 1:
            for r in reqs:
                r.wait()
            kv = nxt
    return out


def ring_isend_running_max(q, k, v):
    """isend/irecv, K and V as two messages each step; a running maximum and sum."""
    rank, world = dist.get_rank(), dist.get_world_size()
    m = torch.full(q.shape[:-1] + (1,), float("-inf"))
    l_sum = torch.zeros_like(m)
    acc = torch.zeros_like(q)
    for step in range(world):
        src = (rank - step) % world
        if src <= rank:
            s = _scores(q, k, rank, src)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            p = torch.exp(s - m_new)
            fix = torch.exp(m - m_new)
            acc = acc * fix + p @ v
            l_sum = l_sum * fix + p.sum(-1, keepdim=True)
            m = m_new
        if step < world - 1:
            k2, v2 = torch.empty_like(k), torch.empty_like(v)
            work = [dist.isend(k, (rank + 1) % world), dist.isend(v, (rank + 1) % world),
                    dist.irecv(k2, (rank - 1) % world), dist.irecv(v2, (rank - 1) % world)]
            for w in work:
                w.wait()
            k, v = k2, v2
    return acc / l_sum


def ring_parity_other_way(q, k, v):
    """Blocking send/recv ordered by parity, blocks travelling to rank - 1; all scores kept, one softmax."""
    rank, world = dist.get_rank(), dist.get_world_size()
    kv = torch.cat([k, v], dim=-1).contiguous()
    scores, values = [], []
    for step in range(world):
        src = (rank + step) % world  # blocks come from rank + 1 here
        if src <= rank:
            scores.append(_scores(q, kv[..., :k.shape[-1]], rank, src))
            values.append(kv[..., k.shape[-1]:])
        if step < world - 1:
            got = torch.empty_like(kv)
            if rank % 2 == 0:
                dist.send(kv, (rank - 1) % world)
                dist.recv(got, (rank + 1) % world)
            else:
                dist.recv(got, (rank + 1) % world)
                dist.send(kv, (rank - 1) % world)
            kv = got
    return torch.softmax(torch.cat(scores, -1), -1) @ torch.cat(values, -2)


def _ring_p2p(kv, rank, world):
    nxt = torch.empty_like(kv)
    for r in dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (rank + 1) % world),
                                     dist.P2POp(dist.irecv, nxt, (rank - 1) % world)]):
        r.wait()
    return nxt


def no_rescale(q, k, v):
    """A running maximum, but the accumulated output and sum are not rescaled when it grows."""
    rank, world = dist.get_rank(), dist.get_world_size()
    kv = torch.stack([k, v])
    m = torch.full(q.shape[:-1] + (1,), float("-inf"))
    acc, l_sum = torch.zeros_like(q), torch.zeros_like(m)
    for step in range(world):
        src = (rank - step) % world
        if src <= rank:
            s = _scores(q, kv[0], rank, src)
            m = torch.maximum(m, s.amax(-1, keepdim=True))
            acc = acc + torch.exp(s - m) @ kv[1]
            l_sum = l_sum + torch.exp(s - m).sum(-1, keepdim=True)
        if step < world - 1:
            kv = _ring_p2p(kv, rank, world)
    return acc / l_sum


def _lse_ring(q, k, v, scores_fn, skip_future=True, label=lambda rank, step, world: (rank - step) % world):
    rank, world = dist.get_rank(), dist.get_world_size()
    kv = torch.stack([k, v])
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"))
    for step in range(world):
        src = label(rank, step, world)
        if src <= rank or not skip_future:
            s = scores_fn(q, kv[0], rank, src)
            new = torch.logaddexp(lse, torch.logsumexp(s, -1))
            out = out * torch.exp(lse - new)[..., None] + torch.exp(s - new[..., None]) @ kv[1]
            lse = new
        if step < world - 1:
            kv = _ring_p2p(kv, rank, world)
    return out


def _triangle(q, k, rank, src):
    n = q.shape[2]
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    return s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))


def local_positions(q, k, v):
    """The mask from local positions: the same triangle on every block, no block skipped."""
    return _lse_ring(q, k, v, _triangle, skip_future=False)


def diagonal_every_block(q, k, v):
    """Future blocks skipped, but the triangle applied to every block kept."""
    return _lse_ring(q, k, v, _triangle)


def missing_scale(q, k, v):
    """Scores without 1/sqrt(d)."""
    def unscaled(q, k, rank, src):
        return _scores(q, k, rank, src) * q.shape[-1] ** 0.5
    return _lse_ring(q, k, v, unscaled)


def wrong_direction(q, k, v):
    """Sends to rank + 1, but takes the block held at step i for rank + i's."""
    return _lse_ring(q, k, v, _scores, label=lambda rank, step, world: (rank + step) % world)


def kv_all_gathered(q, k, v):
    """All of K and V gathered on every rank, then causal attention for this rank's rows."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ks, vs = [torch.empty_like(k) for _ in range(world)], [torch.empty_like(v) for _ in range(world)]
    dist.all_gather(ks, k)
    dist.all_gather(vs, v)
    s = torch.cat([_scores(q, kb, rank, src) for src, kb in enumerate(ks)], -1)
    return torch.softmax(s, -1) @ torch.cat(vs, -2)


def deadlock(q, k, v):
    """Blocking recv from rank - 1 first, then send: every rank waits for a send nobody makes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    kv = torch.stack([k, v])
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"))
    for step in range(world):
        src = (rank - step) % world
        if src <= rank:
            s = _scores(q, kv[0], rank, src)
            new = torch.logaddexp(lse, torch.logsumexp(s, -1))
            out = out * torch.exp(lse - new)[..., None] + torch.exp(s - new[..., None]) @ kv[1]
            lse = new
        if step < world - 1:
            got = torch.empty_like(kv)
            dist.recv(got, (rank - 1) % world)
            dist.send(kv, (rank + 1) % world)
            kv = got
    return out


RING_WRONG = {"no_rescale": no_rescale, "local_positions": local_positions,
              "diagonal_every_block": diagonal_every_block, "missing_scale": missing_scale,
              "wrong_direction": wrong_direction, "kv_all_gathered": kv_all_gathered, "deadlock": deadlock}


@pytest.mark.parametrize("right", [ring_batched_lse, ring_isend_running_max, ring_parity_other_way],
                         ids=lambda f: f.__name__)
def test_ring_right_answers_pass(right, capsys):
    check_ring_attention(right)
    assert "[PASS] 14.a ring attention" in capsys.readouterr().out


@pytest.mark.parametrize("entry, wrong", cases(a_ring_attention.CATALOGUE, RING_WRONG))
def test_ring_names_the_mistake(entry, wrong):
    timeout = 5.0 if entry.key == "deadlock" else a_ring_attention.TIMEOUT  # it hangs: any limit names it
    with pytest.raises(CheckFailed) as e:
        check_ring_attention(wrong, timeout=timeout)
    assert entry.message in str(e.value)


def test_ring_sum_of_normalised_blocks_is_named_too():
    def sums_softmaxes(q, k, v):
        rank, world = dist.get_rank(), dist.get_world_size()
        kv, out = torch.stack([k, v]), 0
        for step in range(world):
            src = (rank - step) % world
            if src <= rank:
                out = out + torch.softmax(_scores(q, kv[0], rank, src), -1) @ kv[1]
            if step < world - 1:
                kv = _ring_p2p(kv, rank, world)
        return out

    with pytest.raises(CheckFailed) as e:
        check_ring_attention(sums_softmaxes, worlds=(2,))
    assert a_ring_attention.CATALOGUE.hint("no_rescale") in str(e.value)


def test_ring_an_extra_exchange_is_refused():
    def n_exchanges(q, k, v):
        rank, world = dist.get_rank(), dist.get_world_size()
        kv = torch.stack([k, v])
        scores, values = [], []
        for step in range(world):
            src = (rank - step) % world
            if src <= rank:
                scores.append(_scores(q, kv[0], rank, src))
                values.append(kv[1])
            kv = _ring_p2p(kv, rank, world)  # also after the last block
        return torch.softmax(torch.cat(scores, -1), -1) @ torch.cat(values, -2)

    # on 4 ranks: on 2, two exchanges of K and V stacked are as many messages as one of K and V apart
    with pytest.raises(CheckFailed, match="expected 3 exchanges"):
        check_ring_attention(n_exchanges, worlds=(4,))


def test_ring_simulated_mistakes_differ_from_the_right_answer():
    """Each simulated mistake changes some rank's output on 4 ranks (or the checker could not name it)."""
    q, k, v = a_ring_attention._tensors(4)
    for name in ("no_rescale", "no_rescale_running", "no_rescale_normalised", "local_positions",
                 "diagonal_every_block", "missing_scale", "wrong_direction"):
        assert any(not torch.allclose(a_ring_attention.simulate(q, k, v, r, 4, name),
                                      a_ring_attention.simulate(q, k, v, r, 4), atol=1e-4)
                   for r in range(4)), name


# ------------------------------------------------------------------------------------------
# 14.b zigzag
# ------------------------------------------------------------------------------------------


def zigzag_mirror(rank, world):
    return rank, 2 * world - 1 - rank


def zigzag_inner_pairs(rank, world):
    """Another balanced split: chunks N - 1 - r and N + r."""
    return [world - 1 - rank, world + rank]


def zigzag_tensor(rank, world):
    return torch.tensor([rank, 2 * world - 1 - rank])


def mask_from_positions(q_chunk, k_chunk, chunk_len):
    qpos = q_chunk * chunk_len + torch.arange(chunk_len)
    kpos = k_chunk * chunk_len + torch.arange(chunk_len)
    return qpos[:, None] >= kpos[None, :]


def mask_by_cases(q_chunk, k_chunk, chunk_len):
    if k_chunk < q_chunk:
        return torch.ones(chunk_len, chunk_len, dtype=torch.bool)
    if k_chunk > q_chunk:
        return torch.zeros(chunk_len, chunk_len, dtype=torch.bool)
    return torch.ones(chunk_len, chunk_len).tril().bool()


def mask_float(q_chunk, k_chunk, chunk_len):
    """0/1 floats: accepted, read as booleans."""
    i = torch.arange(chunk_len).float()
    return ((q_chunk - k_chunk) * chunk_len + i[:, None] - i[None, :] >= 0).float()


def contiguous_pairs(rank, world):
    return 2 * rank, 2 * rank + 1


def mirror_off_by_one(rank, world):
    return rank, 2 * world - rank


def local_mask(q_chunk, k_chunk, chunk_len):
    return torch.ones(chunk_len, chunk_len, dtype=torch.bool).tril()


def diagonal_full(q_chunk, k_chunk, chunk_len):
    return torch.full((chunk_len, chunk_len), k_chunk <= q_chunk)


def future_visible(q_chunk, k_chunk, chunk_len):
    qpos = q_chunk * chunk_len + torch.arange(chunk_len)
    kpos = k_chunk * chunk_len + torch.arange(chunk_len)
    return kpos[None, :] >= qpos[:, None]


ZIGZAG_WRONG = {"contiguous_pairs": (contiguous_pairs, mask_by_cases),
                "mirror_off_by_one": (mirror_off_by_one, mask_by_cases),
                "local_mask": (zigzag_mirror, local_mask),
                "diagonal_full": (zigzag_mirror, diagonal_full),
                "future_visible": (zigzag_mirror, future_visible)}


@pytest.mark.parametrize("chunks, mask", [(zigzag_mirror, mask_from_positions),
                                          (zigzag_inner_pairs, mask_by_cases),
                                          (zigzag_tensor, mask_float)],
                         ids=["mirror-positions", "inner-pairs-cases", "tensor-float"])
def test_zigzag_right_answers_pass(chunks, mask, capsys):
    check_zigzag(chunks, mask)
    assert "[PASS] 14.b zigzag" in capsys.readouterr().out


@pytest.mark.parametrize("entry, wrong", cases(b_zigzag.CATALOGUE, ZIGZAG_WRONG))
def test_zigzag_names_the_mistake(entry, wrong):
    with pytest.raises(CheckFailed) as e:
        check_zigzag(*wrong)
    assert entry.message in str(e.value)


# ------------------------------------------------------------------------------------------
# 14.c Ulysses
# ------------------------------------------------------------------------------------------


def s2h_functional(x):
    n = dist.get_world_size()
    b, h, s, d = x.shape
    y = all_to_all_single_autograd(x.reshape(b, n, h // n, s, d).transpose(0, 1).contiguous(),
                                   None, None, dist.group.WORLD)
    return y.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def h2s_functional(y):
    n = dist.get_world_size()
    b, h, s, d = y.shape
    x = all_to_all_single_autograd(y.reshape(b, h, n, s // n, d).permute(2, 0, 1, 3, 4).contiguous(),
                                   None, None, dist.group.WORLD)
    return x.transpose(0, 1).reshape(b, n * h, s // n, d)


def s2h_dist_nn(x):
    """torch.distributed.nn's autograd all-to-all (deprecated in favour of the functional one)."""
    import warnings

    from torch.distributed.nn.functional import all_to_all_single
    n = dist.get_world_size()
    b, h, s, d = x.shape
    pieces = x.reshape(b, n, h // n, s, d).permute(1, 0, 2, 3, 4).contiguous()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        y = all_to_all_single(torch.empty_like(pieces), pieces)
    return torch.cat(list(y.unbind(0)), dim=2).reshape(b, h // n, n * s, d)


def h2s_strided_heads(y):
    """With s2h_strided_heads: rank r holds heads r, r + N, r + 2N ... (any partition of the heads works)."""
    n = dist.get_world_size()
    b, h, s, d = y.shape
    x = all_to_all_single_autograd(y.reshape(b, h, n, s // n, d).permute(2, 0, 1, 3, 4).contiguous(),
                                   None, None, dist.group.WORLD)  # x[j]: rank j's heads
    return x.permute(1, 2, 0, 3, 4).reshape(b, h * n, s // n, d)


def s2h_strided_heads(x):
    n = dist.get_world_size()
    b, h, s, d = x.shape
    pieces = x.reshape(b, h // n, n, s, d).permute(2, 0, 1, 3, 4).contiguous()  # piece j: heads j::n
    y = all_to_all_single_autograd(pieces, None, None, dist.group.WORLD)
    return y.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def s2h_reshape_only(x):
    n = dist.get_world_size()
    b, h, s, d = x.shape
    y = all_to_all_single_autograd(x.reshape(n, b, h // n, s, d).contiguous(), None, None, dist.group.WORLD)
    return y.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def s2h_interleaved(x):
    n = dist.get_world_size()
    b, h, s, d = x.shape
    y = all_to_all_single_autograd(x.reshape(b, n, h // n, s, d).transpose(0, 1).contiguous(),
                                   None, None, dist.group.WORLD)
    return y.permute(1, 2, 3, 0, 4).reshape(b, h // n, n * s, d)  # positions interleaved


def s2h_no_autograd(x):
    n = dist.get_world_size()
    b, h, s, d = x.shape
    pieces = x.reshape(b, n, h // n, s, d).transpose(0, 1).contiguous()
    y = torch.empty_like(pieces)
    dist.all_to_all_single(y, pieces)
    return y.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def s2h_all_gather(x):
    n, rank = dist.get_world_size(), dist.get_rank()
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x)
    h = x.shape[1] // n
    return torch.cat(parts, dim=2)[:, rank * h:(rank + 1) * h]


ULYSSES_WRONG = {"reshape_without_permute": (s2h_reshape_only, h2s_functional),
                 "sequence_order": (s2h_interleaved, h2s_functional),
                 "no_autograd": (s2h_no_autograd, h2s_functional),
                 "all_gathered": (s2h_all_gather, h2s_functional)}


@pytest.mark.parametrize("pair", [(s2h_functional, h2s_functional), (s2h_dist_nn, h2s_functional),
                                  (s2h_strided_heads, h2s_strided_heads)],
                         ids=["functional", "dist-nn", "strided-heads"])
def test_ulysses_right_answers_pass(pair, capsys):
    check_ulysses(*pair)
    assert "[PASS] 14.c Ulysses" in capsys.readouterr().out


@pytest.mark.parametrize("entry, wrong", cases(c_ulysses.CATALOGUE, ULYSSES_WRONG))
def test_ulysses_names_the_mistake(entry, wrong):
    with pytest.raises(CheckFailed) as e:
        check_ulysses(*wrong, worlds=(2,))
    assert entry.message in str(e.value)

