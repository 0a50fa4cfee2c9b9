"""09.d NaN on one rank: skip the step on every rank.

``train_step(model, optimizer, x, y) -> bool`` runs four DDP steps on two ranks; rank 1's second
batch holds one NaN.  Every rank must skip that step (and only that one), together, and end with
the weights of a reference that skips it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ...checking import (
    Catalogue,
    CheckFailed,
    Misconception,
    Outcome,
    checker,
    compare_tensors,
    judge,
    process_group,
    require_callable,
    run_workers,
    state_to_cpu,
)
from ...data import make_dataset
from .common import WORLD, ddp_sgd, states_equal

__all__ = ["CATALOGUE", "check_nan_skip_step"]

_NAN_STEPS = 4
_NAN_AT = 1

CATALOGUE = Catalogue(
    "09.d NaN skip",
    Misconception(
        "step_local_skip",
        "a rank whose loss is NaN can skip its step alone",
        "a hang: the other rank waits in backward()",
        "one rank decided alone to skip: it returned before backward() (a local "
        "`if not torch.isfinite(loss): return False`), so its DDP all-reduce never happened and the "
        "other rank waits in backward(). Decide on all ranks together: check the gradients after "
        "backward() (DDP has made them identical), or all-reduce a flag"),
    Misconception(
        "step_own_loss_after_backward",
        "after backward every rank can decide from its own loss",
        "the ranks returned different decisions for one step",
        "deciding from this rank's own loss. Decide from the gradients after backward() (DDP has "
        "made them identical on every rank), or all-reduce a flag"),
    Misconception(
        "step_no_guard",
        "one NaN sample does no harm",
        "the NaN step was taken",
        "was taken: after DDP's all-reduce every rank's gradients are NaN, and so would the weights "
        "be"),
    Misconception(
        "step_keeps_nan_gradients",
        "a skipped step needs no zero_grad",
        "every step after the NaN was skipped too",
        "every step after the NaN was skipped too: the NaN gradients stayed in .grad. Call "
        "optimizer.zero_grad() also when you skip"),
    Misconception(
        "step_without_return",
        "the caller does not need to know",
        "train_step returned something other than a bool",
        "return True when the optimizer stepped, False when the step was skipped"),
)
_hint = CATALOGUE.hint


def _nan_batches(rank: int) -> list:
    X, Y = make_dataset(16 * _NAN_STEPS, seed=10 + rank).tensors
    batches = []
    for s in range(_NAN_STEPS):
        x, y = X[s * 16:(s + 1) * 16].clone(), Y[s * 16:(s + 1) * 16].clone()
        if rank == 1 and s == _NAN_AT:
            x[2, 3] = float("nan")  # one bad value in one sample of one rank
        batches.append((x, y))
    return batches


def _worker(fn: Callable) -> Outcome:
    with process_group("gloo") as pg:
        batches = _nan_batches(pg.rank)

        # the reference first, so that a learner's hang cannot spoil it
        ref, ref_opt = ddp_sgd()
        for x, y in batches:
            F.cross_entropy(ref(x), y).backward()
            if all(torch.isfinite(p.grad).all() for p in ref.parameters() if p.grad is not None):
                ref_opt.step()
            ref_opt.zero_grad()
        reference = state_to_cpu(ref)
        del ref, ref_opt

        model, opt = ddp_sgd()
        flags = [fn(model, opt, x, y) for x, y in batches]
        state = state_to_cpu(model)
        del model, opt
    return Outcome(pg.rank, data={"flags": flags, "state": state, "reference": reference})


@checker("09.d NaN skip")
def check_nan_skip_step(train_step: Callable, *, timeout: float = 20.0) -> None:
    """Four DDP steps on two ranks; rank 1's second batch holds a NaN."""
    require_callable(train_step, "train_step(model, optimizer, x, y)")
    hang = _hint("step_local_skip")
    outcomes = run_workers(_worker, WORLD, args=(train_step,), timeout=timeout, hang_hint=hang,
                           error_hint=hang)
    out = [o.data for o in judge(outcomes, world=WORLD)]
    expected = [s != _NAN_AT for s in range(_NAN_STEPS)]
    for r, o in enumerate(out):
        flags = o["flags"]
        if any(not isinstance(f, bool) for f in flags):
            raise CheckFailed(f"rank {r}: train_step returned {flags}; "
                              + _hint("step_without_return"))
    for s in range(_NAN_STEPS):
        decided = [o["flags"][s] for o in out]
        if len(set(decided)) > 1:
            who = ", ".join(f"rank {r} {'stepped' if d else 'skipped'}" for r, d in enumerate(decided))
            raise CheckFailed(
                f"at step {s} the ranks decided differently: {who}. The loss is each rank's own "
                "(only rank 1's holds the NaN), so a decision made from it differs between ranks, "
                "and the rank that steps applies the NaN gradients DDP gave it: the replicas "
                "diverge.\nUsual mistake: " + _hint("step_own_loss_after_backward"))
    for r, o in enumerate(out):
        flags = o["flags"]
        if flags != expected:
            taken = [s for s, f in enumerate(flags) if f]
            if flags[_NAN_AT]:
                why = f"step {_NAN_AT} (rank 1's batch holds a NaN) " + _hint("step_no_guard")
            elif not any(flags[_NAN_AT + 1:]):
                why = _hint("step_keeps_nan_gradients")
            else:
                why = "expected only the NaN step to be skipped"
            raise CheckFailed(f"rank {r} stepped at steps {taken} of 0..{_NAN_STEPS - 1}, "
                              f"expected all but step {_NAN_AT}: {why}")
    for r, o in enumerate(out):
        bad = [k for k, v in o["state"].items() if not torch.isfinite(v).all()]
        if bad:
            raise CheckFailed(f"rank {r}: parameters {bad} hold NaN/Inf after training: the "
                              "NaN step was applied")
    states_equal([o["state"] for o in out], "parameters",
                 "the ranks skipped different steps: the decision must be the same on all ranks")
    compare_tensors(out[0]["reference"], out[0]["state"], atol=1e-6,
                    what="parameters after 4 steps", where="rank 0",
                    hint="forward, backward, then step only when every gradient is finite; "
                    "always zero_grad()")
