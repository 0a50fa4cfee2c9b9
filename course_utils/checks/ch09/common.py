"""What chapter 09's checkers share: two ranks on gloo, and numbers and weights compared alike."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ...checking import CheckFailed, close, compare_tensors
from ...data import make_model

__all__ = ["WORLD", "FLOAT_HINT", "GRAPH_HINT", "agree", "ddp_sgd", "number", "states_equal"]

WORLD = 2

# What a learner who returned a tensor reads (09.a, 09.f): the fix, and why a graph matters.
FLOAT_HINT = "return a Python float (`.item()`)"
GRAPH_HINT = ("that still carries an autograd graph (grad_fn set): keeping it keeps every batch's "
              "graph alive")


def agree(a: float, b: float) -> bool:
    """Two losses or metrics agree to 1e-5 (relative), by the harness's ``close``."""
    return close(a, b, atol=1e-7, rtol=1e-5)


def number(value: Any, what: str, rank: int) -> float:
    """The learner's returned value as a float, or a CheckFailed that says what it was instead."""
    if value is None:
        raise CheckFailed(f"rank {rank}: {what} returned None (a missing `return`?)")
    if isinstance(value, torch.Tensor):
        extra = f" {GRAPH_HINT}" if value.grad_fn is not None or value.requires_grad else ""
        raise CheckFailed(f"rank {rank}: {what} returned a torch.Tensor{extra}; {FLOAT_HINT}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckFailed(f"rank {rank}: {what} returned a {type(value).__name__}; expected a "
                          "Python float")
    return float(value)


def states_equal(states: list[dict], what: str, hint: str) -> None:
    """Every rank's weights equal rank 0's, exactly (DDP keeps replicas bit-identical)."""
    for r in range(1, len(states)):
        compare_tensors(states[0], states[r], atol=0.0, what=f"{what} of rank {r} vs rank 0",
                        hint=hint)


def ddp_sgd() -> tuple[DDP, torch.optim.SGD]:
    """The small model of 09.d and 09.e, the same on every rank, in DDP, with plain SGD."""
    model = DDP(make_model(0, hidden=32))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)
