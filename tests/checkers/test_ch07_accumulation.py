"""Chapter 07 checkers: each accepts right answers written in several ways and names the
misconception behind each wrong one: the wrong-answer tests are parametrized over each exercise's
catalogue (course_utils/checks/ch07/), one wrong answer per misconception."""

from __future__ import annotations

import contextlib
import functools
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from misconceptions import cases  # tests/checkers/misconceptions.py, beside this file

from course_utils.checking import CheckFailed
from course_utils.checks import check_accumulation_step, check_scaled_lr
from course_utils.checks.ch07.a_accumulation import CATALOGUE as ACCUMULATION
from course_utils.checks.ch07.a_accumulation import accumulation_verdicts
from course_utils.checks.ch07.b_scaled_lr import CATALOGUE as SCALED_LR

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

# --------------------------------------------------------------------------------------------
# 07.a: right answers, written in different ways
# --------------------------------------------------------------------------------------------


def acc_solution(model, optimizer, micro_batches):
    k = len(micro_batches)
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        with contextlib.nullcontext() if i == k - 1 else model.no_sync():
            loss = F.cross_entropy(model(x), y) / k
            loss.backward()
        total += loss.item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def acc_zero_grad_first_and_module_for_early_steps(model, optimizer, micro_batches):
    # model.module bypasses DDP; the last backward through DDP all-reduces the accumulated .grad.
    optimizer.zero_grad()
    losses = []
    *early, last = micro_batches
    for x, y in early:
        loss = F.cross_entropy(model.module(x), y) / len(micro_batches)
        loss.backward()
        losses.append(loss.item())
    x, y = last
    loss = F.cross_entropy(model(x), y) / len(micro_batches)
    loss.backward()
    losses.append(loss.item())
    optimizer.step()
    return sum(losses)


def acc_sets_the_flag_and_sums_the_loss(model, optimizer, micro_batches):
    n = sum(len(y) for _, y in micro_batches)
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        model.require_backward_grad_sync = i == len(micro_batches) - 1
        loss = F.cross_entropy(model(x), y, reduction="sum") / n
        loss.backward()
        total += loss.detach()
    model.require_backward_grad_sync = True
    optimizer.step()
    optimizer.zero_grad()
    return total


def test_accumulation_accepts_the_solution(capsys):
    check_accumulation_step(acc_solution)
    out = capsys.readouterr().out
    assert "[PASS] 07.a" in out and "gradients at the step" in out


@pytest.mark.parametrize("right", [acc_zero_grad_first_and_module_for_early_steps,
                                   acc_sets_the_flag_and_sums_the_loss], ids=lambda f: f.__name__)
def test_accumulation_accepts_other_right_answers(right):
    assert verdict(right) == ""


# --------------------------------------------------------------------------------------------
# 07.a: what learners write when they hold a misconception
# --------------------------------------------------------------------------------------------


def acc_forgets_to_divide(model, optimizer, micro_batches):
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        ctx = model.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext()
        with ctx:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
        total += loss.item()
    optimizer.step()
    optimizer.zero_grad()
    return total / len(micro_batches)


def acc_divides_by_world_size_too(model, optimizer, micro_batches):
    scale = len(micro_batches) * dist.get_world_size()  # "DDP sums the ranks' gradients"
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        ctx = model.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext()
        with ctx:
            loss = F.cross_entropy(model(x), y)
            (loss / scale).backward()
        total += loss.item() / len(micro_batches)
    optimizer.step()
    optimizer.zero_grad()
    return total


def acc_no_sync_everywhere(model, optimizer, micro_batches):
    total = 0.0
    with model.no_sync():  # "the optimizer step synchronises"
        for x, y in micro_batches:
            loss = F.cross_entropy(model(x), y) / len(micro_batches)
            loss.backward()
            total += loss.item()
    optimizer.step()
    optimizer.zero_grad()
    return total


def acc_only_backward_in_no_sync(model, optimizer, micro_batches):
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        loss = F.cross_entropy(model(x), y) / len(micro_batches)
        if i < len(micro_batches) - 1:
            with model.no_sync():
                loss.backward()
        else:
            loss.backward()
        total += loss.item()
    optimizer.step()
    optimizer.zero_grad()
    return total


def acc_syncs_the_first_micro_step(model, optimizer, micro_batches):
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        with contextlib.nullcontext() if i == 0 else model.no_sync():
            loss = F.cross_entropy(model(x), y) / len(micro_batches)
            loss.backward()
        total += loss.item()
    optimizer.step()
    optimizer.zero_grad()
    return total


def acc_never_uses_no_sync(model, optimizer, micro_batches):
    total = 0.0
    for x, y in micro_batches:
        loss = F.cross_entropy(model(x), y) / len(micro_batches)
        loss.backward()
        total += loss.item()
    optimizer.step()
    optimizer.zero_grad()
    return total


def acc_zero_grad_inside_the_loop(model, optimizer, micro_batches):
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        optimizer.zero_grad()  # as in an ordinary training loop
        with contextlib.nullcontext() if i == len(micro_batches) - 1 else model.no_sync():
            loss = F.cross_entropy(model(x), y) / len(micro_batches)
            loss.backward()
        total += loss.item()
    optimizer.step()
    return total


def acc_steps_every_micro_batch(model, optimizer, micro_batches):
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        with contextlib.nullcontext() if i == len(micro_batches) - 1 else model.no_sync():
            loss = F.cross_entropy(model(x), y) / len(micro_batches)
            loss.backward()
        optimizer.step()
        total += loss.item()
    optimizer.zero_grad()
    return total


def acc_never_zeroes(model, optimizer, micro_batches):
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        with contextlib.nullcontext() if i == len(micro_batches) - 1 else model.no_sync():
            loss = F.cross_entropy(model(x), y) / len(micro_batches)
            loss.backward()
        total += loss.item()
    optimizer.step()
    return total


def acc_all_reduces_by_hand_as_well(model, optimizer, micro_batches):
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        with contextlib.nullcontext() if i == len(micro_batches) - 1 else model.no_sync():
            loss = F.cross_entropy(model(x), y) / len(micro_batches)
            loss.backward()
        total += loss.item()
    for p in model.parameters():  # "to be sure the ranks agree"
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    optimizer.step()
    optimizer.zero_grad()
    return total


def acc_returns_the_sum(model, optimizer, micro_batches):
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        with contextlib.nullcontext() if i == len(micro_batches) - 1 else model.no_sync():
            loss = F.cross_entropy(model(x), y)
            (loss / len(micro_batches)).backward()
        total += loss.item()
    optimizer.step()
    optimizer.zero_grad()
    return total


def acc_returns_nothing(model, optimizer, micro_batches):
    acc_solution(model, optimizer, micro_batches)


_ANSWERS = [acc_zero_grad_first_and_module_for_early_steps, acc_sets_the_flag_and_sums_the_loss,
            acc_forgets_to_divide, acc_divides_by_world_size_too, acc_no_sync_everywhere,
            acc_only_backward_in_no_sync, acc_syncs_the_first_micro_step, acc_never_uses_no_sync,
            acc_zero_grad_inside_the_loop, acc_steps_every_micro_batch, acc_never_zeroes,
            acc_all_reduces_by_hand_as_well, acc_returns_the_sum, acc_returns_nothing]


@functools.cache
def _all_verdicts() -> tuple[str, ...]:
    # One launch judges every answer of this module (a launch per answer would take minutes).
    return tuple(accumulation_verdicts(_ANSWERS))


def verdict(fn) -> str:
    return _all_verdicts()[_ANSWERS.index(fn)]


# Each misconception of the catalogue: the wrong answer of the same name, and what the failure says.
WRONG_ACC = {f.__name__: (f, message) for f, message in [
    (acc_forgets_to_divide, r"(?s)gradients at optimizer\.step\(\).*4 times too large.*divided by "
                            r"the number of micro-batches"),
    (acc_divides_by_world_size_too, r"(?s)2 \(the world size\) times too small.*already averages"),
    (acc_no_sync_everywhere, r"(?s)got 0 for 4 micro-batches.*last micro-step ran inside "
                             r"model\.no_sync\(\)"),
    (acc_only_backward_in_no_sync, r"(?s)got 4 for 4.*ran the forward passes outside it.*forward "
                                   r"\*and\* the backward"),
    (acc_syncs_the_first_micro_step, r"(?s)all-reduced during micro-step 1 of 4, not during the "
                                     r"last one.*never averaged"),
    (acc_never_uses_no_sync, r"(?s)expected 1 all-reduce call.*got 4.*all-reduced after every "
                             r"micro-batch.*forward and backward"),
    (acc_zero_grad_inside_the_loop, r"(?s)last micro-batch's gradient only.*zero_grad\(\) ran "
                                    r"inside the micro-batch loop"),
    (acc_steps_every_micro_batch, r"(?s)optimizer\.step\(\) ran 4 time\(s\).*stepping inside the "
                                  r"micro-batch loop"),
    (acc_never_zeroes, r"(?s)optimizer step 2.*previous step's gradients: nothing zeroed them.*zero_grad"),
    (acc_all_reduces_by_hand_as_well, r"(?s)called dist\.all_reduce 6 time\(s\) on top of"),
    (acc_returns_the_sum, r"(?s)returned loss .* that is 4 times the mean"),
    (acc_returns_nothing, r"(?s)expected the mean loss .* got NoneType \(a missing `return`\?\)"),
]}


@pytest.mark.parametrize("mistake, wrong", cases(ACCUMULATION, WRONG_ACC))
def test_accumulation_rejects_misconceptions(mistake, wrong):
    answer, message = wrong
    assert re.search(message, verdict(answer)), verdict(answer)
    assert mistake.message in verdict(answer)


def test_the_checker_gives_the_verdict_of_the_batch(capsys):
    # The batch seam and the checker judge alike: one misconception through the checker itself.
    with pytest.raises(CheckFailed) as e:
        check_accumulation_step(acc_syncs_the_first_micro_step)
    assert verdict(acc_syncs_the_first_micro_step) in str(e.value)


def test_accumulation_rejects_none_a_wrong_signature_and_reports_exceptions():
    with pytest.raises(CheckFailed, match=r"(?s)got None\. Did the cell that defines it run\?"):
        check_accumulation_step(None)
    with pytest.raises(CheckFailed, match=r"calls fn\(model, optimizer, micro_batches\)"):
        check_accumulation_step(lambda model, micro_batches: 0.0)

    def crashes(model, optimizer, micro_batches):
        raise ValueError("boom")

    with pytest.raises(CheckFailed, match=r"(?s)rank \d at step 1/2: your code raised ValueError: "
                                          r"boom.*in crashes"):
        check_accumulation_step(crashes)


def test_stub_is_reported_as_not_done():
    def stub(model, optimizer, micro_batches):
        raise NotImplementedError("Exercise 07.a accumulation with no_sync: replace this line")

    with pytest.raises(CheckFailed, match=r"(?s)not done yet.*07\.a accumulation with no_sync"):
        check_accumulation_step(stub)


# ------------------------------------------------------------------------------------------
# 07.b scaled learning rate
# ------------------------------------------------------------------------------------------


def lr_solution(step, *, base_lr, base_batch, per_rank_batch, world_size, accum_steps, warmup_steps):
    peak = base_lr * per_rank_batch * world_size * accum_steps / base_batch
    if warmup_steps and step < warmup_steps:
        return base_lr + (peak - base_lr) * step / warmup_steps
    return peak


def lr_with_a_fraction(step, *, base_lr, base_batch, per_rank_batch, world_size, accum_steps,
                       warmup_steps):
    effective = per_rank_batch * world_size * accum_steps
    peak = base_lr * effective / base_batch
    frac = min(1.0, step / warmup_steps) if warmup_steps > 0 else 1.0
    return (1 - frac) * base_lr + frac * peak


def lr_as_a_tensor(step, **kw):
    return torch.tensor(lr_solution(step, **kw), dtype=torch.float64)


@pytest.mark.parametrize("right", [lr_solution, lr_with_a_fraction, lr_as_a_tensor],
                         ids=lambda f: f.__name__)
def test_scaled_lr_accepts_right_answers(right, capsys):
    check_scaled_lr(right)
    out = capsys.readouterr().out
    assert "[PASS] 07.b" in out and "linear rule" in out


def lr_without_world_size(step, *, base_lr, base_batch, per_rank_batch, world_size, accum_steps,
                          warmup_steps):
    peak = base_lr * per_rank_batch * accum_steps / base_batch
    return base_lr + (peak - base_lr) * step / warmup_steps if step < warmup_steps else peak


def lr_without_accumulation(step, *, base_lr, base_batch, per_rank_batch, world_size, accum_steps,
                            warmup_steps):
    peak = base_lr * per_rank_batch * world_size / base_batch
    return base_lr + (peak - base_lr) * step / warmup_steps if step < warmup_steps else peak


def lr_warm_from_zero(step, *, base_lr, base_batch, per_rank_batch, world_size, accum_steps,
                      warmup_steps):
    peak = base_lr * per_rank_batch * world_size * accum_steps / base_batch
    return peak * step / warmup_steps if step < warmup_steps else peak


def lr_no_warm_up(step, *, base_lr, base_batch, per_rank_batch, world_size, accum_steps,
                  warmup_steps):
    return base_lr * per_rank_batch * world_size * accum_steps / base_batch


def lr_keeps_climbing(step, *, base_lr, base_batch, per_rank_batch, world_size, accum_steps,
                      warmup_steps):
    peak = base_lr * per_rank_batch * world_size * accum_steps / base_batch
    return base_lr + (peak - base_lr) * step / warmup_steps if warmup_steps else peak


def lr_peak_one_step_early(step, *, base_lr, base_batch, per_rank_batch, world_size, accum_steps,
                           warmup_steps):
    peak = base_lr * per_rank_batch * world_size * accum_steps / base_batch
    if warmup_steps > 1 and step < warmup_steps - 1:
        return base_lr + (peak - base_lr) * step / (warmup_steps - 1)
    return peak


def lr_square_root_rule(step, *, base_lr, base_batch, per_rank_batch, world_size, accum_steps,
                        warmup_steps):
    peak = base_lr * ((per_rank_batch * world_size * accum_steps) / base_batch) ** 0.5
    if warmup_steps and step < warmup_steps:
        return base_lr + (peak - base_lr) * step / warmup_steps
    return peak


def lr_divides_by_zero(step, *, base_lr, base_batch, per_rank_batch, world_size, accum_steps,
                       warmup_steps):
    peak = base_lr * per_rank_batch * world_size * accum_steps / base_batch
    return base_lr + (peak - base_lr) * min(1.0, step / warmup_steps)


# Each misconception of the catalogue: the wrong answer of the same name, and what the failure says.
WRONG_LR = {f.__name__: (f, message) for f, message in [
    (lr_without_world_size, r"leaves out the number of ranks"),
    (lr_without_accumulation, r"leaves out the accumulation steps"),
    (lr_warm_from_zero, r"warm-up that starts from 0"),
    (lr_no_warm_up, r"no warm-up: during the first warmup_steps"),
    (lr_keeps_climbing, r"keeps climbing after warmup_steps"),
    (lr_peak_one_step_early, r"reaches the peak at step warmup_steps - 1"),
    (lr_square_root_rule, r"square-root scaling rule.*linear rule"),
    (lr_divides_by_zero, r"warmup_steps=0 must mean no warm-up"),
]}


@pytest.mark.parametrize("mistake, wrong", cases(SCALED_LR, WRONG_LR))
def test_scaled_lr_rejects_misconceptions(mistake, wrong):
    answer, message = wrong
    with pytest.raises(CheckFailed, match=message) as info:
        check_scaled_lr(answer)
    assert mistake.message in info.value.args[0]
