"""Chapter 16's arithmetic on measured runs (training over slow links): steps to a target loss, the
α-β model's step time for an algorithm that communicates every ``H`` steps, and the link rate at
which two algorithms reach a target loss in the same time.  They compute; they judge nothing.

- ``steps_to``: the first evaluated step at which a run's held-out loss reached a target;
- ``step_seconds``: compute + (α + 2(N-1)/N · S / β) / H, one sync of S bytes every H steps;
- ``crossover_bps``: the link rate where two algorithms' times to the target are equal.
"""

from __future__ import annotations

from .ch10 import ring_factor

__all__ = ["steps_to", "step_seconds", "crossover_bps"]


def steps_to(evals: list[tuple[int, float, float]], target: float) -> int | None:
    """The first step whose held-out loss is at most ``target`` (``evals``: (step, bytes, loss)),
    or None when the run never got there."""
    return next((step for step, _, loss in evals if loss <= target), None)


def step_seconds(compute_s: float, payload_bytes: float, every: int, rate_bps: float, alpha: float,
                 world: int = 2) -> float:
    """Predicted seconds per step: the compute, plus one all-reduce of ``payload_bytes`` every
    ``every`` steps on a link of ``rate_bps`` bits/s (α + 2(N-1)/N · S / β, β = rate / 8), with no
    overlap."""
    return compute_s + (alpha + ring_factor(world) * payload_bytes / (rate_bps / 8)) / every


def crossover_bps(compute_s: float, a: tuple[int, float, int], b: tuple[int, float, int], alpha: float,
                  world: int = 2) -> float | None:
    """The link rate (bits/s) at which algorithms ``a`` and ``b`` reach the target in the same time,
    each given as (steps to the target, bytes per sync, steps per sync); None when one is faster
    at every rate.  Time = steps · (compute + (α + f·S·8/rate) / H) is linear in 1/rate."""
    def parts(steps: int, payload: float, every: int) -> tuple[float, float]:
        return steps * (compute_s + alpha / every), steps * ring_factor(world) * payload * 8 / every
    (ka, la), (kb, lb) = parts(*a), parts(*b)
    if la == lb:
        return None
    inv_rate = (kb - ka) / (la - lb)
    return 1 / inv_rate if inv_rate > 0 else None
