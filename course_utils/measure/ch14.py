"""Chapter 14's measurements (context parallelism): attention's activation bytes against sequence
length, and the bytes ring attention and Ulysses move, for the α-β model of chapter 10.

- ``AttentionBlock``: one attention layer (fused q/k/v projection, ``heads`` heads, causal,
  output projection), with the scores written out (``explicit=True``: softmax(QKᵀ/√d)·V, the s × s
  matrix materialised) or through ``F.scaled_dot_product_attention`` (on CPU its flash kernel keeps
  only the output and one log-sum-exp per row).
- ``attention_bytes(seq, explicit)``: ``ActivationMeter``'s peak over one forward of that block.
- ``ring_bytes`` / ``ulysses_bytes``: bytes one rank sends per attention forward; ``ring_calls`` /
  ``ulysses_calls``: how many messages or collectives that takes; ``predicted_seconds`` puts them in
  t = calls · α + bytes / β (chapter 10's ``fit_alpha_beta`` gives α and β).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .ch11 import ActivationMeter

__all__ = ["AttentionBlock", "attention_bytes", "ring_bytes", "ulysses_bytes", "ring_calls",
           "ulysses_calls", "predicted_seconds"]


class AttentionBlock(nn.Module):
    def __init__(self, width: int = 256, heads: int = 4, explicit: bool = False, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.qkv = nn.Linear(width, 3 * width)
            self.out = nn.Linear(width, width)
        self.heads, self.explicit = heads, explicit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        if self.explicit:
            scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
            future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            att = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ v
        else:
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(att.transpose(1, 2).reshape(b, s, w))


def attention_bytes(seq: int, explicit: bool, *, width: int = 256, heads: int = 4, batch: int = 1) -> int:
    """Peak bytes of the tensors one forward of ``AttentionBlock`` creates with autograd recording."""
    block = AttentionBlock(width, heads, explicit)
    x = torch.randn(batch, seq, width, requires_grad=True)
    meter = ActivationMeter(ignore=[*block.parameters(), x])
    with meter:
        y = block(x)
    del y
    return meter.peak


def ring_bytes(batch: int, heads: int, seq: int, dim: int, world: int, elt: int = 4) -> int:
    """Bytes one rank sends in ring attention's forward: N - 1 blocks of K and V, each S/N long."""
    return (world - 1) * 2 * batch * heads * (seq // world) * dim * elt


def ring_calls(world: int) -> int:
    return world - 1


def ulysses_bytes(batch: int, heads: int, seq: int, dim: int, world: int, elt: int = 4) -> int:
    """Bytes one rank sends in Ulysses' forward: four all-to-alls (q, k, v in; the output back),
    each sending (N - 1)/N of the rank's S/N-long slice of every head."""
    local = batch * heads * (seq // world) * dim * elt
    return round(4 * (world - 1) / world * local)


def ulysses_calls(world: int) -> int:
    return 4


def predicted_seconds(calls: int, nbytes: float, alpha: float, beta: float) -> float:
    """The α-β model for a sequence of messages: each call pays α, each byte 1/β."""
    return calls * alpha + nbytes / beta
