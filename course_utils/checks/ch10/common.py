"""What the exercises of chapter 10 share: the world size, the steps, the tolerance, and the
frozen-and-tied model that 10.a and 10.b train."""

from __future__ import annotations

from ...checking.fixtures import FrozenAndShared

__all__ = ["ATOL", "STEPS", "WORLD", "frozen_and_tied"]

WORLD = 2
STEPS = 3
ATOL = 1e-5


def frozen_and_tied(seed: int) -> FrozenAndShared:
    """A frozen layer, a layer applied twice and a weight tied between two layers, 64 wide (the
    bucket caps of 10.a are sized for these layers), without chapter 04's buffer."""
    return FrozenAndShared(seed, width=64, scale=False)
