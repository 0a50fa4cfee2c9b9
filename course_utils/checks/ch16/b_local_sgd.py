"""16.b: local SGD's synchronisation, ``local_sgd_sync(model, step, H)``.

Called after every optimizer step (``step`` counts them from 1), it averages the replicas'
parameters over the default group when ``step`` is a multiple of ``H`` and does nothing otherwise.

``check_local_sgd_sync(local_sgd_sync)`` trains a small model of the course on 2 ranks with SGD, each
rank on its own batches, for ``STEPS`` steps with ``H = 3``, and watches every collective the
function starts with ``CollectiveSpy`` (which, at which step, on which tensor: a parameter, a
gradient or a buffer of the learner's). After each call it compares each rank's parameters with
what they must be: unchanged between syncs, the average of the ranks' parameters at a sync.

The misconceptions it recognises are ``CATALOGUE`` below (each key names the wrong function in
tests/checkers/test_ch16_checks.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ...checking import (
    Catalogue,
    CheckFailed,
    CollectiveSpy,
    Misconception,
    Outcome,
    checker,
    judge,
    process_group,
    require_callable,
    run_workers,
)
from ...checking.spy import COLLECTIVES
from ...data import make_dataset, make_model

__all__ = ["CATALOGUE", "check_local_sgd_sync"]

WORLD, H, STEPS, LR, ATOL = 2, 3, 7, 0.2, 1e-6
SYNC_STEPS = [s for s in range(1, STEPS + 1) if s % H == 0]

CATALOGUE = Catalogue(
    "16.b local SGD sync",
    Misconception(
        "averages_gradients", "local SGD all-reduces the gradients, as DDP does, only less often",
        "the all-reduced tensors are the parameters' .grad, and the parameters stay apart",
        "the gradients were all-reduced, not the parameters: after optimizer.step() the gradients "
        "have been used already, so averaging them changes nothing. Local SGD averages the "
        "parameters themselves (p.data), every H steps"),
    Misconception(
        "sums_parameters", "all_reduce averages",
        "the parameters after a sync are the sum over the ranks",
        "the parameters were summed, not averaged: dist.all_reduce sums by default (op=ReduceOp.SUM); "
        "divide by dist.get_world_size(), or pass op=ReduceOp.AVG"),
    Misconception(
        "every_step", "syncing more often cannot hurt",
        "a collective at every step",
        "the parameters were averaged at every step: that is DDP's traffic; local SGD talks only "
        "when step % H == 0"),
    Misconception(
        "wrong_steps", "the first step is a sync step, or the count starts at 0",
        "collectives at steps other than the multiples of H",
        "synchronised at the wrong steps: with step counted from 1, sync when step % H == 0 "
        "(after the H-th, 2H-th, ... step)"),
    Misconception(
        "not_copied_back", "averaging a flat copy is enough",
        "a collective ran at the right steps, but the parameters did not change",
        "an all-reduce ran at the sync step, but the parameters did not change: the average was "
        "taken of a copy (torch.cat, parameters_to_vector) and never copied back into the parameters"),
    Misconception(
        "broadcast_rank0", "the replicas only need to agree, so take rank 0's weights",
        "after a sync every rank holds rank 0's parameters",
        "every rank took rank 0's parameters (a broadcast): the replicas agree, but the other "
        "replicas' training is thrown away. Average them (all_reduce, then divide by the world size)"),
)
_hint = CATALOGUE.hint


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()]).clone()


def _worker(fn: Any) -> Outcome:
    with process_group() as pg:
        model = make_model(0, hidden=16).to(pg.device)
        x, y = make_dataset(64 * STEPS * WORLD, seed=16).tensors
        x, y = x[pg.rank::WORLD].to(pg.device), y[pg.rank::WORLD].to(pg.device)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        params = {p.data_ptr() for p in model.parameters()}
        before, after, calls = [], [], []
        with CollectiveSpy(COLLECTIVES) as spy:
            for step in range(1, STEPS + 1):
                spy.recording = False  # the training step itself is not the learner's
                opt.zero_grad()
                F.cross_entropy(model(x[64 * (step - 1):64 * step]), y[64 * (step - 1):64 * step]).backward()
                opt.step()
                grads = {p.grad.data_ptr() for p in model.parameters()}
                before.append(_flat(model))
                spy.recording, spy.step = True, step
                n = len(spy.calls)
                fn(model, step, H)
                for c in spy.calls[n:]:
                    ptr = c.tensor.data_ptr() if c.tensor is not None else None
                    what = "parameter" if ptr in params else "gradient" if ptr in grads else "other"
                    calls.append({"op": c.op, "step": step, "what": what, "bytes": c.nbytes})
                after.append(_flat(model))
        return Outcome(pg.rank, data={"before": before, "after": after, "calls": calls})


def _judge(outcomes: list[Outcome]) -> dict:
    calls = outcomes[0].data["calls"]
    steps = sorted({c["step"] for c in calls})
    before = [o.data["before"] for o in outcomes]
    after = [o.data["after"] for o in outcomes]
    for k in range(STEPS):
        step, mean = k + 1, torch.stack([b[k] for b in before]).mean(0)
        synced = step in SYNC_STEPS
        for r in range(WORLD):
            got = after[r][k]
            want = mean if synced else before[r][k]
            if torch.allclose(got, want, atol=ATOL, rtol=0):
                continue
            lead = (f"rank {r}, after the call at step {step} (H = {H}, syncs due at steps {SYNC_STEPS}; "
                    f"collectives seen at steps {steps}): the parameters differ from "
                    f"{'the average of the ranks' if synced else 'the ones before the call'} by up to "
                    f"{(got - want).abs().max().item():.3g}")
            if synced and any(c["step"] == step and c["what"] == "gradient" for c in calls):
                raise CheckFailed(f"{lead}. {_hint('averages_gradients')}.")
            if synced and torch.allclose(got, mean * WORLD, atol=1e-5, rtol=0):
                raise CheckFailed(f"{lead}. {_hint('sums_parameters')}.")
            if synced and all(torch.allclose(a[k], before[0][k], atol=ATOL, rtol=0) for a in after):
                raise CheckFailed(f"{lead}. {_hint('broadcast_rank0')}.")
            if not synced and torch.allclose(got, mean, atol=ATOL, rtol=0):
                key = "every_step" if steps == list(range(1, STEPS + 1)) else "wrong_steps"
                raise CheckFailed(f"{lead}. {_hint(key)}.")
            if synced and torch.allclose(got, before[r][k], atol=ATOL, rtol=0):
                if any(c["step"] == step for c in calls):
                    raise CheckFailed(f"{lead}. {_hint('not_copied_back')}.")
                raise CheckFailed(f"{lead}: no collective ran at step {step}. {_hint('wrong_steps')}.")
            raise CheckFailed(f"{lead}.")
    if steps != SYNC_STEPS:  # right values, yet talking at other steps (a collective that changed nothing)
        key = "every_step" if steps == list(range(1, STEPS + 1)) else "wrong_steps"
        raise CheckFailed(f"collectives at steps {steps}, expected only at {SYNC_STEPS}: {_hint(key)}.")
    return {"calls": calls}


@checker("16.b local SGD sync")
def check_local_sgd_sync(local_sgd_sync: Callable, *, timeout: float = 60.0) -> None:
    """``local_sgd_sync(model, step, H)`` after every optimizer step, on 2 ranks."""
    require_callable(local_sgd_sync, "a function local_sgd_sync(model, step, H)")
    outcomes = judge(run_workers(_worker, WORLD, args=(local_sgd_sync,), timeout=timeout,
                                 hang_hint="the ranks made different collectives: every rank must sync at "
                                           "the same steps"), world=WORLD)
    calls = _judge(outcomes)["calls"]
    per = {s: [c for c in calls if c["step"] == s] for s in SYNC_STEPS}
    sent = sum(c["bytes"] for c in per[SYNC_STEPS[0]])
    print(f"{STEPS} SGD steps on {WORLD} ranks, H = {H}: parameters averaged at steps {SYNC_STEPS} only, "
          f"{len(per[SYNC_STEPS[0]])} collective(s) of {sent:,} bytes in all per sync "
          f"({', '.join(sorted({c['op'] for c in calls}))})")
