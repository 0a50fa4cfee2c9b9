"""10.c: the α-β cost model's prediction of one step's all-reduces.

``check_comm_prediction(predict)`` checks the learner's ``predict(bucket_bytes, world, alpha, beta)``
on made-up numbers (exactly, and each usual mistake is recognised by the number it gives), then
against all-reduces timed on this machine (``course_utils.measure.ch10``).

The misconceptions it recognises are ``CATALOGUE`` below (each key names the wrong function in
tests/checkers/test_ch10_checks.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ...checking import Catalogue, CheckFailed, Misconception, checker, require_callable, time_limit
from ...measure.ch10 import fit_alpha_beta, measured_rounds, ring_factor
from .common import WORLD

__all__ = ["CATALOGUE", "check_comm_prediction"]

CATALOGUE = Catalogue(
    "10.c cost-model prediction",
    Misconception(
        "forgets_return", "printing the prediction is enough",
        "predict(...) returns no number",
        "expected a number of seconds (a float)"),
    Misconception(
        "no_ring_factor", "an all-reduce sends the message once",
        "the prediction equals the sum of α + bytes / β",
        "the ring factor 2(N-1)/N is missing: a ring all-reduce sends each byte 2(N-1)/N times "
        "(a reduce-scatter, then an all-gather)"),
    Misconception(
        "one_reduce_scatter", "the factor of a ring all-reduce is (N-1)/N",
        "the prediction equals the sum of α + (N-1)/N · bytes / β",
        "the factor is (N-1)/N: that is one reduce-scatter (or one all-gather) only; an all-reduce "
        "is both, 2(N-1)/N"),
    Misconception(
        "alpha_once_per_step", "the latency is paid once per step",
        "the prediction equals α + the sum of the bandwidth terms",
        "α counted once per step: every bucket is its own all-reduce and pays the latency"),
    Misconception(
        "bits_for_bytes", "a link's speed is in bits per second, so convert",
        "the prediction is 8 times too large in its bandwidth terms",
        "bits and bytes mixed (a factor of 8): bucket sizes and β are both in bytes"),
    Misconception(
        "milliseconds", "milliseconds are the unit of a step",
        "the prediction is 1000 times the right one",
        "milliseconds returned: return seconds"),
)
_hint = CATALOGUE.hint

_SIZES = [2**12, 2**15, 2**17, 2**19, 2**20]
_GROUP = [2**19, 2**17, 2**15, 2**12, 2**12]  # the bucket sizes of one step (bytes)


PREDICT_LIMIT = 10.0  # seconds for one call of predict(...), which is a few lines of arithmetic
ATTEMPTS = 3  # measurements at most; the rounds of all of them are pooled before the median is taken


@checker("10.c cost-model prediction")
def check_comm_prediction(predict: Callable, *, timeout: float = 90.0, tolerance: float = 2.0) -> None:
    """``predict(bucket_bytes, world, alpha, beta)`` -> seconds of one step's all-reduces.

    First on made-up numbers (exact), then against gloo all-reduces timed here: α and β are fitted
    from single all-reduces, the prediction for a sequence of buckets must be within a factor
    ``tolerance`` of the measured time (the median round; on a shared CPU single rounds range over a
    factor 10, so when the median falls outside, more rounds are measured, up to ``ATTEMPTS`` times).
    """
    require_callable(predict, "a function predict(bucket_bytes, world, alpha, beta)")
    alpha, beta = 50e-6, 2e9
    buckets = [25 * 2**20, 4 * 2**20, 1000]
    for world in (2, 8):
        right = sum(alpha + ring_factor(world) * b / beta for b in buckets)
        with time_limit(PREDICT_LIMIT, "predict(...)"):
            got = predict(list(buckets), world, alpha, beta)
        if not isinstance(got, (int, float)) or isinstance(got, bool) or got != got:
            raise CheckFailed(f"predict(...) returned {got!r}; {_hint('forgets_return')}")
        if math.isclose(got, right, rel_tol=1e-6):
            continue
        variants = {
            "no_ring_factor": sum(alpha + b / beta for b in buckets),
            "one_reduce_scatter": sum(alpha + (world - 1) / world * b / beta for b in buckets),
            "alpha_once_per_step": alpha + sum(ring_factor(world) * b / beta for b in buckets),
            "bits_for_bytes": sum(alpha + ring_factor(world) * 8 * b / beta for b in buckets),
            "milliseconds": right * 1e3,
        }
        given = f"with α={alpha:g} s, β={beta:g} B/s, N={world}, buckets {buckets} B: expected"
        for key, value in variants.items():
            if math.isclose(got, value, rel_tol=1e-6):
                raise CheckFailed(f"{given} {right:.6g} s, got {got:.6g} s.\nUsual mistake: {_hint(key)}.")
        raise CheckFailed(f"{given} {right:.6g} s (sum over buckets of α + 2(N-1)/N · bytes / β), "
                          f"got {got:.6g} s")
    ratios, fits, times = [], [], []  # per round; rounds are pooled over the attempts
    for attempt in range(1, ATTEMPTS + 1):
        single, multi = measured_rounds(_SIZES, [_GROUP], timeout=timeout)
        for one, group_time in zip(single, multi):  # fit and predict within each round
            a, b = fit_alpha_beta(_SIZES, one, WORLD)
            fits.append((a, b))
            times.append(group_time[0])
            with time_limit(PREDICT_LIMIT, "predict(...)"):
                ratios.append(predict(list(_GROUP), WORLD, a, b) / group_time[0])
        k = sorted(range(len(ratios)), key=ratios.__getitem__)[len(ratios) // 2]  # the median round
        if 1 / tolerance <= ratios[k] <= tolerance:
            break
        if attempt < ATTEMPTS:
            print(f"ratio {ratios[k]:.2f} over {len(ratios)} rounds, outside [{1 / tolerance:.2f}, "
                  f"{tolerance:.2f}]: measuring {len(single)} more rounds (a busy machine is noisy)")
    (a, b), ratio = fits[k], ratios[k]
    print(f"fitted here (median of {len(ratios)} rounds): α = {a * 1e6:.1f} µs, β = {b / 1e9:.3f} GB/s; "
          f"{len(_GROUP)} all-reduces of one step: predicted {ratio * times[k] * 1e3:.3f} ms, measured "
          f"{times[k] * 1e3:.3f} ms (ratio {ratio:.2f}; {min(ratios):.2f} to {max(ratios):.2f} "
          "over the rounds)")
    if not 1 / tolerance <= ratio <= tolerance:
        raise CheckFailed(f"the prediction is {ratio:.2f} times the measured time, outside "
                          f"[{1 / tolerance:.2f}, {tolerance:.2f}], after {len(ratios)} rounds. If the "
                          "formula passed the exact check above, the machine was probably busy while "
                          "measuring: rerun.")
