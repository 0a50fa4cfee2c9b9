"""09.d NaN or Inf on one rank: skip the step on every rank.

``train_step(model, optimizer, x, y) -> bool`` runs five DDP steps on two ranks; rank 1's second
batch holds one NaN, and rank 1's fourth step overflows as fp16 does (its loss is +inf and one
gradient holds +inf, with no NaN anywhere).  Every rank must skip those two steps (and only those),
together, and end with the weights of a reference that skips them.
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

_NAN_STEPS = 5
_NAN_AT = 1
_INF_AT = 3  # rank 1's loss and one gradient are +inf there: an overflow, no NaN

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
        "step_nan_only",
        "non-finite means NaN",
        "the step whose loss and gradient are +inf (no NaN) was taken",
        "was taken: its loss and one gradient are +inf, and torch.isnan(inf) is False, so a guard "
        "that tests torch.isnan alone lets an overflow through. Test torch.isfinite, which is False "
        "for NaN, +inf and -inf"),
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


def _overflow(model: torch.nn.Module, rank: int, now: dict) -> None:
    """On rank 1 at step ``_INF_AT``: the target logit of sample 2 becomes -inf (so the loss is +inf
    while every gradient through the logits stays finite) and the last bias's gradient gets +inf in
    its first element, before DDP all-reduces it (+inf on every rank then).  No NaN anywhere."""
    if rank != 1:
        return
    last = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]

    def logits(_module, _inputs, out):
        if now["step"] != _INF_AT:
            return out
        where = torch.zeros_like(out, dtype=torch.bool)
        where[2, now["target"]] = True
        return out.masked_fill(where, float("-inf"))

    def bias_grad(grad):
        return grad.index_fill(0, torch.tensor([0]), float("inf")) if now["step"] == _INF_AT else grad

    last.register_forward_hook(logits)
    last.bias.register_hook(bias_grad)


def _run(fn: Callable, model, opt, batches: list, now: dict) -> list:
    out = []
    for s, (x, y) in enumerate(batches):
        now.update(step=s, target=int(y[2]))
        out.append(fn(model, opt, x, y))
    return out


def _reference_step(ref, ref_opt, x, y) -> bool:
    F.cross_entropy(ref(x), y).backward()
    ok = all(torch.isfinite(p.grad).all() for p in ref.parameters() if p.grad is not None)
    if ok:
        ref_opt.step()
    ref_opt.zero_grad()
    return ok


def _worker(fn: Callable) -> Outcome:
    with process_group("gloo") as pg:
        batches = _nan_batches(pg.rank)

        # the reference first, so that a learner's hang cannot spoil it
        ref, ref_opt = ddp_sgd()
        now = {"step": -1}
        _overflow(ref.module, pg.rank, now)
        ref_flags = _run(_reference_step, ref, ref_opt, batches, now)
        reference = state_to_cpu(ref)
        del ref, ref_opt

        model, opt = ddp_sgd()
        _overflow(model.module, pg.rank, now)
        flags = _run(fn, model, opt, batches, now)
        state = state_to_cpu(model)
        del model, opt
    return Outcome(pg.rank, data={"flags": flags, "state": state, "reference": reference,
                                  "ref_flags": ref_flags})


@checker("09.d NaN skip")
def check_nan_skip_step(train_step: Callable, *, timeout: float = 20.0) -> None:
    """Five DDP steps on two ranks; rank 1's second batch holds a NaN, its fourth step overflows
    (loss and one gradient +inf, no NaN)."""
    require_callable(train_step, "train_step(model, optimizer, x, y)")
    hang = _hint("step_local_skip")
    outcomes = run_workers(_worker, WORLD, args=(train_step,), timeout=timeout, hang_hint=hang,
                           error_hint=hang)
    out = [o.data for o in judge(outcomes, world=WORLD)]
    expected = [s not in (_NAN_AT, _INF_AT) for s in range(_NAN_STEPS)]
    if out[0]["ref_flags"] != expected:  # the injection itself, not the learner's answer
        raise RuntimeError(f"09.d's reference stepped at {out[0]['ref_flags']}, expected {expected}")
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
            elif flags[_INF_AT]:
                why = f"step {_INF_AT} " + _hint("step_nan_only")
            else:
                why = f"expected only steps {_NAN_AT} (NaN) and {_INF_AT} (+inf) to be skipped"
            raise CheckFailed(f"rank {r} stepped at steps {taken} of 0..{_NAN_STEPS - 1}, "
                              f"expected all but steps {_NAN_AT} and {_INF_AT}: {why}")
    for r, o in enumerate(out):
        bad = [k for k, v in o["state"].items() if not torch.isfinite(v).all()]
        if bad:
            raise CheckFailed(f"rank {r}: parameters {bad} hold NaN/Inf after training: the "
                              "NaN or Inf step was applied")
    states_equal([o["state"] for o in out], "parameters",
                 "the ranks skipped different steps: the decision must be the same on all ranks")
    compare_tensors(out[0]["reference"], out[0]["state"], atol=1e-6,
                    what=f"parameters after {_NAN_STEPS} steps", where="rank 0",
                    hint="forward, backward, then step only when every gradient is finite; "
                    "always zero_grad()")
