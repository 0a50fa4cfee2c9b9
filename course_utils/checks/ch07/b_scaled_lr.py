"""07.b ``check_scaled_lr(fn)``: the linear scaling rule (SGD) with a warm-up from ``base_lr``.

The learner's schedule is compared with the right one on three settings (one without warm-up), at
step 0, 1, mid-warm-up, the end of the warm-up and after it.  A wrong value is compared with the
schedule each misconception gives (the switches of ``_scaled_lr_reference``).

What learners get wrong is ``CATALOGUE`` below: each entry's key names the answer written with that
misconception in tests/checkers/test_ch07_accumulation.py, its message is what the failure says.
"""

from __future__ import annotations

import math

import torch

from ...checking import Catalogue, CheckFailed, Misconception, checker, require_callable

__all__ = ["CATALOGUE", "check_scaled_lr"]

CATALOGUE = Catalogue(
    "07.b scaled learning rate",
    Misconception(
        "lr_without_world_size", "the batch that counts is the one each rank sees",
        "the values equal the schedule of an effective batch without the world size",
        "the effective batch leaves out the number of ranks "
        "(B = per_rank_batch x world_size x accum_steps)."),
    Misconception(
        "lr_without_accumulation", "accumulation does not change the batch",
        "the values equal the schedule of an effective batch without the accumulation steps",
        "the effective batch leaves out the accumulation steps "
        "(B = per_rank_batch x world_size x accum_steps)."),
    Misconception(
        "lr_warm_from_zero", "a warm-up starts from zero",
        "the warm-up values climb from 0 instead of base_lr",
        "a warm-up that starts from 0, so the first step does nothing; start at base_lr and climb "
        "to the peak."),
    Misconception(
        "lr_no_warm_up", "the scaled rate can be used from the first step",
        "the rate is the peak during the warm-up",
        "no warm-up: during the first warmup_steps steps the rate climbs linearly from base_lr to "
        "the peak."),
    Misconception(
        "lr_keeps_climbing", "the warm-up line goes on",
        "after warmup_steps the rate grows past the peak",
        "the warm-up keeps climbing after warmup_steps; from then on the rate stays at the peak."),
    Misconception(
        "lr_peak_one_step_early", "the warm-up spans warmup_steps - 1 intervals",
        "the values equal a warm-up that divides by warmup_steps - 1",
        "the warm-up reaches the peak at step warmup_steps - 1 (dividing by warmup_steps - 1); it "
        "climbs by (peak - base_lr) / warmup_steps per step and reaches the peak at step "
        "warmup_steps."),
    Misconception(
        "lr_square_root_rule", "the rate scales with the square root of the batch",
        "the peak is base_lr x sqrt(B / base_batch)",
        "the square-root scaling rule (peak = base_lr x sqrt(B / base_batch)), the usual starting "
        "point for Adam-type optimizers; this exercise's rate is for SGD with momentum, where the "
        "linear rule holds, peak = base_lr x B / base_batch: one SGD step on a batch n times larger "
        "then moves the weights about as far as n steps on the base batch (Goyal et al., 2017)."),
    Misconception(
        "lr_divides_by_zero", "every schedule has a warm-up",
        "ZeroDivisionError when warmup_steps is 0",
        "warmup_steps=0 must mean no warm-up (the peak rate at once)."),
)


def _scaled_lr_reference(step, *, base_lr, base_batch, per_rank_batch, world_size, accum_steps,
                         warmup_steps, ranks=True, accum=True, warm_from=None, warm=True,
                         stop=True, sqrt=False, early=False):
    """The right schedule; the switches reproduce the usual mistakes, to recognise them."""
    B = per_rank_batch * (world_size if ranks else 1) * (accum_steps if accum else 1)
    peak = base_lr * (math.sqrt(B / base_batch) if sqrt else B / base_batch)
    span = warmup_steps - 1 if early else warmup_steps
    if warm and span > 0 and (step < span or not stop):
        start = base_lr if warm_from is None else warm_from
        return start + (peak - start) * step / span
    return peak


# The switches that reproduce each misconception, checked in this order when the answer is wrong.
_SWITCHES = [
    ("lr_without_world_size", dict(ranks=False)),
    ("lr_without_accumulation", dict(accum=False)),
    ("lr_warm_from_zero", dict(warm_from=0.0)),
    ("lr_no_warm_up", dict(warm=False)),
    ("lr_keeps_climbing", dict(stop=False)),
    ("lr_peak_one_step_early", dict(early=True)),
    ("lr_square_root_rule", dict(sqrt=True)),
]

_LR_CASES = [
    dict(base_lr=0.1, base_batch=256, per_rank_batch=32, world_size=8, accum_steps=4, warmup_steps=10),
    dict(base_lr=0.05, base_batch=32, per_rank_batch=16, world_size=2, accum_steps=8, warmup_steps=8),
    dict(base_lr=0.2, base_batch=64, per_rank_batch=64, world_size=3, accum_steps=1, warmup_steps=0),
]


@checker("07.b scaled learning rate")
def check_scaled_lr(fn) -> None:
    """``fn(step, *, base_lr, base_batch, per_rank_batch, world_size, accum_steps, warmup_steps)``
    must follow the linear scaling rule with a warm-up that starts at ``base_lr``."""
    require_callable(fn, "a function scaled_lr(step, *, base_lr, base_batch, per_rank_batch, "
                         "world_size, accum_steps, warmup_steps)")
    for case in _LR_CASES:
        last = case["warmup_steps"] + 3
        for step in sorted({0, 1, case["warmup_steps"] // 2, case["warmup_steps"], last}):
            want = _scaled_lr_reference(step, **case)
            try:
                got = fn(step, **case)
            except ZeroDivisionError:
                raise CheckFailed(f"scaled_lr({step}, {case}) divided by zero. Usual mistake: "
                                  + CATALOGUE.hint("lr_divides_by_zero")) from None
            if got is None:
                raise CheckFailed(f"scaled_lr({step}, ...) returned None (a missing `return`?)")
            if isinstance(got, torch.Tensor) and got.numel() == 1:
                got = float(got)
            if not isinstance(got, (int, float)) or isinstance(got, bool):
                raise CheckFailed(f"scaled_lr({step}, ...) should return a number, got "
                                  f"{type(got).__name__}")
            if math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12):
                continue
            peak = _scaled_lr_reference(10**9, **case)
            msg = f"scaled_lr({step}, {case}) = {got:.6g}, expected {want:.6g} (peak {peak:.6g})."
            for key, switches in _SWITCHES:
                wrong = _scaled_lr_reference(step, **case, **switches)
                if not math.isclose(wrong, want, rel_tol=1e-9) and math.isclose(got, wrong, rel_tol=1e-9):
                    raise CheckFailed(f"{msg} Usual mistake: {CATALOGUE.hint(key)}")
            raise CheckFailed(msg + " Peak = base_lr x B / base_batch; during warm-up "
                              "base_lr + (peak - base_lr) x step / warmup_steps.")
    print(f"scaled_lr: the linear rule with a warm-up from base_lr, on {len(_LR_CASES)} settings "
          "(steps 0, 1, mid-warm-up, the end of the warm-up and after it; one without warm-up)")
