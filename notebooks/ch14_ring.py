"""Chapter 14: causal attention over a sequence split across ranks (context parallelism).

Workers import this file (``from ch14_ring import ring_attention, ulysses_attention``).  Every
tensor is ``(batch, heads, local sequence, head dim)``: the rank's own slice of the sequence.

- ``chunks_of(rank, world, layout)``: which chunks of the sequence a rank holds.  ``"contiguous"``
  cuts it into ``world`` chunks, rank r holds chunk r; ``"zigzag"`` cuts it into ``2 * world``
  chunks, rank r holds chunks r and 2 * world - 1 - r (one early, one late: equal causal work).
- ``ring_attention(q, k, v, layout, overlap, log)``: K and V travel around the ring (rank r sends
  to r + 1 and receives from r - 1), N - 1 exchanges; each rank merges the partial attention over
  each block it sees with the log-sum-exp of the online softmax.  The mask compares *global* chunk
  indices.  Its backward is a second ring pass in which dK and dV travel with their K and V blocks
  and come home after N exchanges (nothing is recomputed but the scores of each block).
- ``seq_to_heads`` / ``heads_to_seq``: Ulysses' two all-to-alls; ``ulysses_attention`` between them.
"""

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single_autograd


def chunks_of(rank, world, layout="contiguous"):
    if layout == "contiguous":
        return [rank]
    if layout == "zigzag":
        return [rank, 2 * world - 1 - rank]
    raise ValueError(f"layout {layout!r}: 'contiguous' or 'zigzag'")


def pair_kind(q_chunk, k_chunk):
    """Causal attention of query chunk over key chunk: "full", "diagonal" (lower triangle) or "skip"."""
    if k_chunk < q_chunk:
        return "full"
    return "diagonal" if k_chunk == q_chunk else "skip"


def block_scores(q, k, kind):
    s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if kind == "diagonal":
        n = s.shape[-1]
        future = torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


def merge(out, lse, block_out, block_lse):
    """Online softmax in log-sum-exp form: lse = max + log(sum), both rescaled in one step."""
    new = torch.logaddexp(lse, block_lse)
    out = out * torch.exp(lse - new).unsqueeze(-1) + block_out * torch.exp(block_lse - new).unsqueeze(-1)
    return out, new


def _exchange(send, recv, rank, world, group=None):
    """Post one ring step: send ``send`` to rank + 1, receive into ``recv`` from rank - 1 (of ``group``)."""
    ops = [dist.P2POp(dist.isend, send, group=group, group_peer=(rank + 1) % world),
           dist.P2POp(dist.irecv, recv, group=group, group_peer=(rank - 1) % world)]
    return dist.batch_isend_irecv(ops)


def _attend_block(qs, ks, vs, mine, theirs, out, lse, work):
    """Merge the attention of this rank's query chunks over one K/V block into ``out`` / ``lse``."""
    for i, qc in enumerate(mine):
        for j, kc in enumerate(theirs):
            kind = pair_kind(qc, kc)
            if kind == "skip":
                continue
            s = block_scores(qs[i], ks[j], kind)
            block_lse = torch.logsumexp(s, dim=-1)
            block_out = torch.exp(s - block_lse.unsqueeze(-1)) @ vs[j]
            out[i], lse[i] = merge(out[i], lse[i], block_out, block_lse)
            work[0] += s.shape[-1] * s.shape[-2]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout, overlap, log, group):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        t0 = log.get("t0", time.perf_counter()) if log is not None else 0.0
        mine = chunks_of(rank, world, layout)
        n = len(mine)
        qs = list(q.chunk(n, dim=2))
        out = [torch.zeros_like(c) for c in qs]
        lse = [torch.full(c.shape[:-1], float("-inf"), dtype=c.dtype, device=c.device) for c in qs]
        kv = torch.stack([k, v]).contiguous()  # one message per step: K and V together
        spare = torch.empty_like(kv)  # the next block arrives here while kv is being sent
        work = [0]
        for step in range(world):
            src = (rank - step) % world  # whose K/V block this rank holds now
            last = step == world - 1
            if not last and overlap:
                reqs = _exchange(kv, spare, rank, world, group)  # posted before computing: it overlaps
            start = time.perf_counter()
            theirs = chunks_of(src, world, layout)
            _attend_block(qs, kv[0].chunk(n, dim=2), kv[1].chunk(n, dim=2), mine, theirs, out, lse, work)
            if log is not None:
                log.setdefault("events", []).append(("compute", start - t0, time.perf_counter() - t0))
            if not last:
                start = time.perf_counter()
                if not overlap:
                    reqs = _exchange(kv, spare, rank, world, group)
                for r in reqs:
                    r.wait()
                if log is not None:
                    log["events"].append(("wait", start - t0, time.perf_counter() - t0))
                kv, spare = spare, kv
        if log is not None:
            log["work"] = work[0]
        out, lse = torch.cat(out, dim=2), torch.cat(lse, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.group = layout, group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        rank, world = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        mine = chunks_of(rank, world, ctx.layout)
        n = len(mine)
        scale = q.shape[-1] ** -0.5
        dout = dout.contiguous()
        delta = (dout * out).sum(-1)  # the softmax's backward needs sum(dO * O) per row
        qs, dos, lses, deltas = (t.chunk(n, dim=2) for t in (q, dout, lse, delta))
        dq = [torch.zeros_like(c) for c in qs]
        # K, V and their gradients travel together: [k, v, dk, dv]
        block = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)]).contiguous()
        for step in range(world):
            theirs = chunks_of((rank - step) % world, world, ctx.layout)
            kb, vb, dkb, dvb = (t.chunk(n, dim=2) for t in block)
            for i, qc in enumerate(mine):
                for j, kc in enumerate(theirs):
                    kind = pair_kind(qc, kc)
                    if kind == "skip":
                        continue
                    p = torch.exp(block_scores(qs[i], kb[j], kind) - lses[i].unsqueeze(-1))
                    dvb[j].add_(p.transpose(-2, -1) @ dos[i])
                    ds = p * (dos[i] @ vb[j].transpose(-2, -1) - deltas[i].unsqueeze(-1))
                    dq[i].add_(ds @ kb[j] * scale)
                    dkb[j].add_(ds.transpose(-2, -1) @ qs[i] * scale)
            # N - 1 exchanges carry K, V and the gradients; the last one only brings dK, dV home
            send = block if step < world - 1 else block[2:].contiguous()
            recv = torch.empty_like(send)
            for r in _exchange(send, recv, rank, world, ctx.group):
                r.wait()
            if step < world - 1:
                block = recv
            else:
                dk, dv = recv[0], recv[1]
        return torch.cat(dq, dim=2), dk, dv, None, None, None, None


def ring_attention(q, k, v, layout="contiguous", overlap=True, log=None, group=None):
    """Causal attention of this rank's queries over the whole sequence's keys, K/V passed in a ring.

    ``group``: the ranks that share the sequence (default: all of them).  ``log`` (a dict, optional)
    receives ``events``: ("compute" or "wait", start, end) in seconds since ``log["t0"]``, and
    ``work``: the query-key pairs this rank scored.
    """
    return _RingAttention.apply(q, k, v, layout, overlap, log, group)


def seq_to_heads(x):
    """(B, H, S/N, D) sequence-sharded -> (B, H/N, S, D) head-sharded, by one all-to-all."""
    world = dist.get_world_size()
    b, h, s, d = x.shape
    pieces = x.reshape(b, world, h // world, s, d).transpose(0, 1).contiguous()  # piece j: rank j's heads
    got = all_to_all_single_autograd(pieces, None, None, dist.group.WORLD)  # got[j]: rank j's sequence
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // world, world * s, d)


def heads_to_seq(x):
    """(B, H/N, S, D) head-sharded -> (B, H, S/N, D) sequence-sharded: the inverse all-to-all."""
    world = dist.get_world_size()
    b, h, s, d = x.shape
    pieces = x.reshape(b, h, world, s // world, d).permute(2, 0, 1, 3, 4).contiguous()  # j: rank j's part
    got = all_to_all_single_autograd(pieces, None, None, dist.group.WORLD)  # got[j]: rank j's heads
    return got.transpose(0, 1).reshape(b, world * h, s // world, d)


def ulysses_attention(q, k, v):
    """Causal attention with the sequence split: whole sequences for H/N heads, then back."""
    out = F.scaled_dot_product_attention(seq_to_heads(q), seq_to_heads(k), seq_to_heads(v), is_causal=True)
    return heads_to_seq(out)
