"""Chapter 07 checkers: each accepts the right answer and names the usual mistakes."""

from __future__ import annotations

import contextlib

import pytest
import torch.nn.functional as F

from course_utils.checking import CheckFailed
from course_utils.checks import check_accumulation_step, check_scaled_lr


def _accumulate(model, optimizer, micro_batches, *, divide=True, sync_last=True, sync_all=False,
                step_each=False, zero_grad=True, give_back=True):
    """The accumulation step, with switches that reproduce the typical mistakes."""
    k = len(micro_batches)
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        last = i == k - 1
        synced = sync_all or (last and sync_last)
        with contextlib.nullcontext() if synced else model.no_sync():
            loss = F.cross_entropy(model(x), y)
            if divide:
                loss = loss / k
            loss.backward()
        total += loss.item()
        if step_each:
            optimizer.step()
    if not step_each:
        optimizer.step()
    if zero_grad:
        optimizer.zero_grad()
    return total if give_back else None


def test_accepts_the_right_answer(capsys):
    def right(model, optimizer, micro_batches):
        return _accumulate(model, optimizer, micro_batches)

    check_accumulation_step(right)
    assert "[PASS] 07.a" in capsys.readouterr().out


def test_rejects_missing_loss_division():
    def wrong(model, optimizer, micro_batches):
        return _accumulate(model, optimizer, micro_batches, divide=False)

    with pytest.raises(CheckFailed, match=r"(?s)gradients 4 times too large.*not dividing each micro-batch loss"):
        check_accumulation_step(wrong)


def test_rejects_no_sync_on_the_last_micro_step_too():
    def wrong(model, optimizer, micro_batches):
        return _accumulate(model, optimizer, micro_batches, sync_last=False)

    with pytest.raises(CheckFailed, match=r"(?s)got 0 for 4 micro-batches.*last micro-step ran inside model\.no_sync\(\)"):
        check_accumulation_step(wrong)


def test_rejects_an_all_reduce_on_every_micro_step():
    def wrong(model, optimizer, micro_batches):
        return _accumulate(model, optimizer, micro_batches, sync_all=True)

    with pytest.raises(CheckFailed, match=r"(?s)expected 1 all-reduce call.*got 4.*all-reduced after every micro-batch"):
        check_accumulation_step(wrong)


def test_rejects_a_step_per_micro_batch():
    def wrong(model, optimizer, micro_batches):
        return _accumulate(model, optimizer, micro_batches, step_each=True)

    with pytest.raises(CheckFailed, match=r"(?s)optimizer\.step\(\) ran 4 time\(s\).*stepping inside the micro-batch loop"):
        check_accumulation_step(wrong)


def test_rejects_missing_zero_grad():
    def wrong(model, optimizer, micro_batches):
        return _accumulate(model, optimizer, micro_batches, zero_grad=False)

    with pytest.raises(CheckFailed, match=r"(?s)optimizer step 2 .*previous step's gradients.*zero_grad"):
        check_accumulation_step(wrong)


def test_rejects_a_missing_return():
    def wrong(model, optimizer, micro_batches):
        return _accumulate(model, optimizer, micro_batches, give_back=False)

    with pytest.raises(CheckFailed, match=r"(?s)expected the mean loss .* got NoneType \(a missing `return`\?\)"):
        check_accumulation_step(wrong)


def test_rejects_none_and_reports_exceptions_with_rank_and_step():
    with pytest.raises(CheckFailed, match=r"(?s)got None\. Did the cell that defines it run\?"):
        check_accumulation_step(None)

    def crashes(model, optimizer, micro_batches):
        raise ValueError("boom")

    with pytest.raises(CheckFailed, match=r"(?s)on rank \d, optimizer step 1: your function raised ValueError: boom"):
        check_accumulation_step(crashes)


def test_stub_is_reported_as_not_done():
    def stub(model, optimizer, micro_batches):
        raise NotImplementedError("Exercise 07.a accumulation with no_sync: replace this line")

    with pytest.raises(CheckFailed, match=r"(?s)not done yet.*07\.a accumulation with no_sync"):
        check_accumulation_step(stub)


# ------------------------------------------------------------------------------------------
# 07.b scaled learning rate
# ------------------------------------------------------------------------------------------


def _lr(step, *, base_lr, base_batch, per_rank_batch, world_size, accum_steps, warmup_steps,
        ranks=True, accum=True, from_zero=False, warm=True):
    B = per_rank_batch * (world_size if ranks else 1) * (accum_steps if accum else 1)
    peak = base_lr * B / base_batch
    if warm and warmup_steps and step < warmup_steps:
        start = 0.0 if from_zero else base_lr
        return start + (peak - start) * step / warmup_steps
    return peak


def test_scaled_lr_accepts_the_right_answer(capsys):
    check_scaled_lr(lambda step, **kw: _lr(step, **kw))
    assert "[PASS] 07.b" in capsys.readouterr().out


def test_scaled_lr_rejects_missing_world_size():
    with pytest.raises(CheckFailed, match=r"(?s)leaves out the number of ranks"):
        check_scaled_lr(lambda step, **kw: _lr(step, ranks=False, **kw))


def test_scaled_lr_rejects_missing_accumulation_steps():
    with pytest.raises(CheckFailed, match=r"(?s)leaves out the accumulation steps"):
        check_scaled_lr(lambda step, **kw: _lr(step, accum=False, **kw))


def test_scaled_lr_rejects_a_warm_up_from_zero():
    with pytest.raises(CheckFailed, match=r"(?s)warm-up that starts from 0"):
        check_scaled_lr(lambda step, **kw: _lr(step, from_zero=True, **kw))


def test_scaled_lr_rejects_no_warm_up():
    with pytest.raises(CheckFailed, match=r"(?s)no warm-up: during the first warmup_steps"):
        check_scaled_lr(lambda step, **kw: _lr(step, warm=False, **kw))


def test_scaled_lr_rejects_division_by_zero_without_warm_up():
    def wrong(step, *, base_lr, base_batch, per_rank_batch, world_size, accum_steps, warmup_steps):
        peak = base_lr * per_rank_batch * world_size * accum_steps / base_batch
        return base_lr + (peak - base_lr) * min(1.0, step / warmup_steps)

    with pytest.raises(CheckFailed, match=r"(?s)warmup_steps=0 must mean no warm-up"):
        check_scaled_lr(wrong)
