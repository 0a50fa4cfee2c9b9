"""Chapter 11: a small transformer block, and tensor parallelism for it, from scratch and with torch.

Workers import this file (``from ch11_tp import ...``); chapter 12 can build on the same block.

- ``TransformerBlock(hidden, heads)``: pre-norm attention and MLP, the attention written out so
  that its scores and softmax are tensors one can see (and measure);
- ``copy_to_tp`` / ``reduce_from_tp``: Megatron's ``f`` (identity forward, all-reduce backward) and
  ``g`` (all-reduce forward, identity backward);
- ``TPBlock(block)``: the same block split over the ranks of the default group, from scratch:
  q, k, v and fc1 column-parallel (attention split by heads), o and fc2 row-parallel;
- ``torch_tp_plan(sequence_parallel)``: the same split for ``parallelize_module``.
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)


def attention(q, k, v, head_dim):
    """Scaled dot-product attention over (batch, seq, heads*head_dim) tensors, any number of heads."""
    b, s, _ = q.shape
    q, k, v = (t.view(b, s, -1, head_dim).transpose(1, 2) for t in (q, k, v))  # (b, heads, s, d)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
    out = scores.softmax(dim=-1) @ v
    return out.transpose(1, 2).reshape(b, s, -1)


class Attention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.head_dim = hidden // heads
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x):
        return self.o(attention(self.q(x), self.k(x), self.v(x), self.head_dim))


class MLP(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class TransformerBlock(nn.Module):
    def __init__(self, hidden=128, heads=4):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(hidden), Attention(hidden, heads)
        self.norm2, self.mlp = nn.LayerNorm(hidden), MLP(hidden)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def make_stack(layers=4, hidden=128, heads=4, seed=0):
    """``layers`` blocks with weights that depend only on ``seed`` (the same on every rank)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(*(TransformerBlock(hidden, heads) for _ in range(layers)))


# ---------------------------------------------------------------------------------------------
# Tensor parallelism from scratch
# ---------------------------------------------------------------------------------------------


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)  # every rank's part of the replicated input's gradient, summed
        return grad


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)  # the partial products of all ranks, summed
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


copy_to_tp, reduce_from_tp = _CopyToTP.apply, _ReduceFromTP.apply


def _shard(t, dim):
    return nn.Parameter(t.detach().chunk(dist.get_world_size(), dim=dim)[dist.get_rank()].clone())


class TPBlock(nn.Module):
    """``block`` split over the default group: heads and the MLP's 4h features divided by the ranks."""

    def __init__(self, block):
        super().__init__()
        self.norm1, self.norm2 = block.norm1, block.norm2  # small, replicated
        self.head_dim = block.attn.head_dim
        for name in ("q", "k", "v"):  # column-parallel: this rank's heads
            lin = getattr(block.attn, name)
            setattr(self, f"{name}_w", _shard(lin.weight, 0))
            setattr(self, f"{name}_b", _shard(lin.bias, 0))
        self.o_w, self.o_b = _shard(block.attn.o.weight, 1), nn.Parameter(block.attn.o.bias.detach().clone())
        self.fc1_w, self.fc1_b = _shard(block.mlp.fc1.weight, 0), _shard(block.mlp.fc1.bias, 0)
        self.fc2_w = _shard(block.mlp.fc2.weight, 1)
        self.fc2_b = nn.Parameter(block.mlp.fc2.bias.detach().clone())

    def forward(self, x):
        h = copy_to_tp(self.norm1(x))
        q, k, v = (F.linear(h, getattr(self, f"{n}_w"), getattr(self, f"{n}_b")) for n in "qkv")
        x = x + reduce_from_tp(F.linear(attention(q, k, v, self.head_dim), self.o_w)) + self.o_b
        h = copy_to_tp(self.norm2(x))
        h = F.gelu(F.linear(h, self.fc1_w, self.fc1_b))
        return x + reduce_from_tp(F.linear(h, self.fc2_w)) + self.fc2_b


def scratch_grads(tp_block, block):
    """Each of ``tp_block``'s gradients beside the matching slice of ``block``'s (reference) gradients."""
    r, n = dist.get_rank(), dist.get_world_size()

    def rows(t):
        return t.chunk(n, 0)[r]

    def cols(t):
        return t.chunk(n, 1)[r]

    a, m = block.attn, block.mlp
    pairs = {}
    for x in "qkv":
        lin = getattr(a, x)
        pairs[f"attn.{x}.weight"] = (getattr(tp_block, f"{x}_w").grad, rows(lin.weight.grad))
        pairs[f"attn.{x}.bias"] = (getattr(tp_block, f"{x}_b").grad, rows(lin.bias.grad))
    pairs["attn.o.weight"] = (tp_block.o_w.grad, cols(a.o.weight.grad))
    pairs["attn.o.bias"] = (tp_block.o_b.grad, a.o.bias.grad)
    pairs["mlp.fc1.weight"] = (tp_block.fc1_w.grad, rows(m.fc1.weight.grad))
    pairs["mlp.fc1.bias"] = (tp_block.fc1_b.grad, rows(m.fc1.bias.grad))
    pairs["mlp.fc2.weight"] = (tp_block.fc2_w.grad, cols(m.fc2.weight.grad))
    pairs["mlp.fc2.bias"] = (tp_block.fc2_b.grad, m.fc2.bias.grad)
    return pairs


# ---------------------------------------------------------------------------------------------
# The same split with torch: a plan for parallelize_module
# ---------------------------------------------------------------------------------------------


def torch_tp_plan(sequence_parallel=False):
    """q, k, v, fc1 ``ColwiseParallel``; o, fc2 ``RowwiseParallel``; with sequence parallelism the
    norms (and the residual stream) hold this rank's slice of the sequence (``Shard(1)``)."""
    plan = {f"attn.{n}": ColwiseParallel() for n in "qkv"}
    plan["mlp.fc1"] = ColwiseParallel()
    if not sequence_parallel:
        plan["attn.o"], plan["mlp.fc2"] = RowwiseParallel(), RowwiseParallel()
        return plan
    def gather():  # the norm's output, sharded by sequence, all-gathered before the linears
        return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))

    plan.update({"norm1": SequenceParallel(), "norm2": SequenceParallel(), "attn": gather(), "mlp": gather(),
                 "attn.o": RowwiseParallel(output_layouts=Shard(1)),
                 "mlp.fc2": RowwiseParallel(output_layouts=Shard(1))})
    return plan
