"""Chapter 05's measurements (distributed data loading): how much of a padded batch is padding."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["padding_waste"]


def padding_waste(batches: Sequence[Sequence[int]], lengths: Sequence[int]) -> float:
    """Share of the padded batch tensors that is padding: 1 - real tokens / (batch x longest)."""
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches if len(b))
    real = sum(lengths[i] for b in batches for i in b)
    return 1.0 - real / padded if padded else 0.0
