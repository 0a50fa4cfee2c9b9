"""Chapter 08 checker: accepts the right AMP step and names the usual mistakes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from course_utils.checking import CheckFailed
from course_utils.checks import check_amp_step


def _step(model, optimizer, scaler, x, y, *, max_norm, amp_dtype, autocast=True, unscale=True,
          clip_first=False, clip=True, use_scaler_step=True, update=True, manual_backoff=False,
          zero_grad=True, scaled_return=False):
    """The AMP step, with switches that reproduce the typical mistakes."""
    with torch.autocast(x.device.type, dtype=amp_dtype, enabled=autocast):
        loss = F.cross_entropy(model(x), y)
    scaled = scaler.scale(loss)
    scaled.backward()
    if clip and clip_first:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if unscale:
        scaler.unscale_(optimizer)
        if manual_backoff and any(torch.isnan(p.grad).any() for p in model.parameters()):
            scaler.update(0.5 * scaler.get_scale())  # the article's snippet
    if clip and not clip_first:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if use_scaler_step:
        scaler.step(optimizer)
    else:
        optimizer.step()
    if update:
        scaler.update()
    if zero_grad:
        optimizer.zero_grad()
    return scaled.item() if scaled_return else loss.item()


def test_accepts_the_right_answer(capsys):
    def right(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
        return _step(model, optimizer, scaler, x, y, max_norm=max_norm, amp_dtype=amp_dtype)

    check_amp_step(right)
    assert "[PASS] 08.a" in capsys.readouterr().out


def test_rejects_clipping_before_unscale():
    def wrong(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
        return _step(model, optimizer, scaler, x, y, max_norm=max_norm, amp_dtype=amp_dtype,
                     clip_first=True)

    with pytest.raises(CheckFailed, match=r"(?s)differ from the reference AMP step.*clipping before scaler\.unscale_"):
        check_amp_step(wrong)


def test_rejects_scaler_step_without_update():
    def wrong(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
        return _step(model, optimizer, scaler, x, y, max_norm=max_norm, amp_dtype=amp_dtype,
                     update=False)

    with pytest.raises(CheckFailed, match=r"(?s)step 2: your function raised RuntimeError.*scaler\.step\(optimizer\) without scaler\.update\(\)"):
        check_amp_step(wrong)


def test_rejects_optimizer_step_that_applies_the_overflow():
    def wrong(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
        return _step(model, optimizer, scaler, x, y, max_norm=max_norm, amp_dtype=amp_dtype,
                     use_scaler_step=False)

    with pytest.raises(CheckFailed, match=r"(?s)parameters are now NaN on every rank.*optimizer\.step\(\) instead of scaler\.step"):
        check_amp_step(wrong)


def test_rejects_optimizer_step_on_scaled_gradients():
    def wrong(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
        return _step(model, optimizer, scaler, x, y, max_norm=max_norm, amp_dtype=amp_dtype,
                     unscale=False, clip=False, use_scaler_step=False, update=False)

    with pytest.raises(CheckFailed, match=r"(?s)gradients still multiplied by the scale"):
        check_amp_step(wrong)


def test_rejects_the_articles_manual_backoff():
    def wrong(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
        return _step(model, optimizer, scaler, x, y, max_norm=max_norm, amp_dtype=amp_dtype,
                     manual_backoff=True)

    with pytest.raises(CheckFailed, match=r"(?s)expected 2048 \(half of 4096\).*halved twice"):
        check_amp_step(wrong)


def test_rejects_a_forward_without_autocast():
    def wrong(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
        return _step(model, optimizer, scaler, x, y, max_norm=max_norm, amp_dtype=amp_dtype,
                     autocast=False)

    with pytest.raises(CheckFailed, match=r"produced float32, expected float16.*not inside torch\.autocast"):
        check_amp_step(wrong)


def test_rejects_missing_clipping_and_missing_zero_grad():
    def no_clip(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
        return _step(model, optimizer, scaler, x, y, max_norm=max_norm, amp_dtype=amp_dtype,
                     clip=False)

    with pytest.raises(CheckFailed, match=r"(?s)the gradients were not clipped"):
        check_amp_step(no_clip)

    def no_zero(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
        return _step(model, optimizer, scaler, x, y, max_norm=max_norm, amp_dtype=amp_dtype,
                     zero_grad=False)

    with pytest.raises(CheckFailed, match=r"(?s)after step 3 .*gradients left over.*zero_grad"):
        check_amp_step(no_zero)


def test_rejects_scaled_or_missing_return_value():
    def scaled(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
        return _step(model, optimizer, scaler, x, y, max_norm=max_norm, amp_dtype=amp_dtype,
                     scaled_return=True)

    with pytest.raises(CheckFailed, match=r"that is the scaled loss"):
        check_amp_step(scaled)

    def nothing(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
        _step(model, optimizer, scaler, x, y, max_norm=max_norm, amp_dtype=amp_dtype)

    with pytest.raises(CheckFailed, match=r"got NoneType \(a missing `return`\?\)"):
        check_amp_step(nothing)


def test_rejects_none_and_reports_the_stub():
    with pytest.raises(CheckFailed, match=r"got None\. Did the cell that defines it run\?"):
        check_amp_step(None)

    def stub(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
        raise NotImplementedError("Exercise 08.a AMP step under DDP: replace this line")

    with pytest.raises(CheckFailed, match=r"not done yet.*08\.a AMP step under DDP"):
        check_amp_step(stub)
