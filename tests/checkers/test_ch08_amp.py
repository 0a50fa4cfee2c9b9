"""Chapter 08 checker: accepts right AMP steps written in several ways and names the misconception
behind each wrong one: the wrong-answer tests are parametrized over the exercise's catalogue
(course_utils/checks/ch08/a_amp_step.py), one wrong answer per misconception."""

from __future__ import annotations

import functools
import re
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from misconceptions import cases  # tests/checkers/misconceptions.py, beside this file

from course_utils.checking import CheckFailed
from course_utils.checks import check_amp_step
from course_utils.checks.ch08.a_amp_step import CATALOGUE, amp_verdicts
from course_utils.checks.ch08.recorder import deprecated_amp_calls

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def amp_solution(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
    with torch.autocast(x.device.type, dtype=amp_dtype):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def amp_zeroes_first_and_clips_in_two_calls(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
    optimizer.zero_grad()
    with torch.amp.autocast(device_type=x.device.type, dtype=amp_dtype):
        logits = model(x)
        loss = F.cross_entropy(logits, y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)
    scaler.step(optimizer)
    scaler.update()
    return loss.detach()


def amp_model_zero_grad_and_float_loss(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
    with torch.autocast(device_type=x.device.type, dtype=amp_dtype):
        loss = F.cross_entropy(model(x), y)
    value = float(loss)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_norm)
    scaler.step(optimizer)
    scaler.update()
    model.zero_grad(set_to_none=True)
    return value


def amp_clips_before_unscaling(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
    with torch.autocast(x.device.type, dtype=amp_dtype):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return loss.item()


def amp_unscales_by_hand(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
    with torch.autocast(x.device.type, dtype=amp_dtype):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    inv = 1.0 / scaler.get_scale()  # "unscaling is dividing by the scale"
    for p in model.parameters():
        p.grad.mul_(inv)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return loss.item()


def amp_never_clips(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
    with torch.autocast(x.device.type, dtype=amp_dtype):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()  # "GradScaler keeps the gradients in range"
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return loss.item()


def amp_steps_the_optimizer_itself(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
    with torch.autocast(x.device.type, dtype=amp_dtype):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    scaler.update()
    optimizer.zero_grad()
    return loss.item()


def amp_steps_on_scaled_gradients(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
    with torch.autocast(x.device.type, dtype=amp_dtype):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def amp_without_the_scaler(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
    with torch.autocast(x.device.type, dtype=amp_dtype):  # "autocast is AMP"
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def amp_never_updates(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
    with torch.autocast(x.device.type, dtype=amp_dtype):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    optimizer.zero_grad()
    return loss.item()


def amp_manual_backoff(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
    with torch.autocast(x.device.type, dtype=amp_dtype):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    for _name, param in model.named_parameters():  # the source article's overflow check
        if param.grad is not None and torch.isnan(param.grad).any():
            scaler.update(0.5 * scaler.get_scale())
            break
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return loss.item()


def amp_skips_nan_steps_by_hand(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
    with torch.autocast(x.device.type, dtype=amp_dtype):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    if any(not torch.isfinite(p.grad).all() for p in model.parameters()):
        optimizer.zero_grad()
        return loss.item()  # "skip the bad step"
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return loss.item()


def amp_forward_without_autocast(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
    loss = F.cross_entropy(model(x.to(amp_dtype).float()), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return loss.item()


def amp_autocast_for_cuda_on_cpu(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available": the learner does not read it
        with torch.autocast("cuda", dtype=amp_dtype):
            loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return loss.item()


def amp_hardcodes_float16(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
    return amp_solution(model, optimizer, scaler, x, y, max_norm=max_norm, amp_dtype=torch.float16)


def amp_uses_torch_cuda_amp(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.cuda.amp.autocast(dtype=amp_dtype):  # the source article's API
            loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return loss.item()


def amp_never_zeroes(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
    with torch.autocast(x.device.type, dtype=amp_dtype):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    return loss.item()


def amp_returns_the_scaled_loss(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
    with torch.autocast(x.device.type, dtype=amp_dtype):
        loss = scaler.scale(F.cross_entropy(model(x), y))
    loss.backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return loss.item()


def amp_returns_nothing(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
    amp_solution(model, optimizer, scaler, x, y, max_norm=max_norm, amp_dtype=amp_dtype)


def amp_skips_locally_on_a_nan_loss(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
    with torch.autocast(x.device.type, dtype=amp_dtype):
        loss = F.cross_entropy(model(x), y)
    if not torch.isfinite(loss):  # "no point in a backward on a NaN loss"
        return loss.item()
    return _finish(model, optimizer, scaler, loss, max_norm)


def _finish(model, optimizer, scaler, loss, max_norm):
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return loss.item()


_RIGHT = [amp_zeroes_first_and_clips_in_two_calls, amp_model_zero_grad_and_float_loss]

_WRONG = [
    (amp_clips_before_unscaling, r"(?s)differ from the reference.*clipping before scaler\.unscale_"),
    (amp_unscales_by_hand, r"(?s)parameters after step 1.*differ from the reference.*divided by "
                           r"scaler\.get_scale\(\) by hand and then unscaled a second time"),
    (amp_never_clips, r"(?s)the gradients were not clipped.*does not bound the gradients"),
    (amp_steps_the_optimizer_itself, r"(?s)parameters are now NaN on every rank.*optimizer\.step\(\) "
                                     r"instead of scaler\.step"),
    (amp_steps_on_scaled_gradients, r"(?s)gradients still multiplied by the scale"),
    (amp_without_the_scaler, r"(?s)the loss was never scaled"),
    (amp_never_updates, r"(?s)float16\).*your code raised RuntimeError: unscale_\(\) is being called "
                        r"after step\(\).*update\(\) closes every step, skipped or not"),
    (amp_manual_backoff, r"(?s)expected 2048 \(half of 4096\).*halved twice"),
    (amp_skips_nan_steps_by_hand, r"(?s)since the last update\(\).*in amp_skips_nan_steps_by_hand.*"
                                  r"update\(\) closes every step, skipped or not"),
    (amp_forward_without_autocast, r"produced float32, expected float16.*not inside torch\.autocast"),
    (amp_autocast_for_cuda_on_cpu, r"autocast was entered for device 'cuda' while x is on 'cpu'"),
    (amp_hardcodes_float16, r"\(bfloat16\).*produced float16, expected bfloat16.*pass "
                            r"dtype=amp_dtype"),
    (amp_uses_torch_cuda_amp, r"uses torch\.cuda\.amp\.autocast, deprecated"),
    (amp_never_zeroes, r"(?s)after step \d.*gradients left over from the previous step"),
    (amp_returns_the_scaled_loss, r"that is the scaled loss"),
    (amp_returns_nothing, r"got NoneType \(a missing `return`\?\)"),
]


@functools.cache
def _all_verdicts() -> tuple[str, ...]:
    # One launch judges every answer of this module (a launch per answer would take minutes).
    return tuple(amp_verdicts(_RIGHT + [w for w, _ in _WRONG]))


def verdict(fn) -> str:
    return _all_verdicts()[(_RIGHT + [w for w, _ in _WRONG]).index(fn)]


@functools.cache
def _local_skip() -> tuple[str, float]:
    """The checker's message for a step skipped on one rank only (it cannot run in the batch: the
    other rank waits), and how long the checker took to give it."""
    start = time.monotonic()
    with pytest.raises(CheckFailed) as e:
        check_amp_step(amp_skips_locally_on_a_nan_loss, amp_dtype=torch.float16)
    return str(e.value), time.monotonic() - start


# Each misconception of the catalogue: the failure message for the wrong answer of the same name,
# and what it says.
WRONG = {w.__name__: (functools.partial(verdict, w), message) for w, message in _WRONG}
WRONG["amp_skips_locally_on_a_nan_loss"] = (lambda: _local_skip()[0],
                                          r"(?s)rank\(?s?\)? ?1.*returned.*rank\(?s?\)? ?0")


def test_accepts_the_solution_in_float16_and_bfloat16(capsys):
    check_amp_step(amp_solution)
    out = capsys.readouterr().out
    assert "[PASS] 08.a" in out and "float16 and bfloat16" in out


@pytest.mark.parametrize("right", _RIGHT, ids=lambda f: f.__name__)
def test_accepts_other_right_answers(right):
    assert verdict(right) == ""


@pytest.mark.parametrize("mistake, wrong", cases(CATALOGUE, WRONG))
def test_rejects_misconceptions(mistake, wrong):
    failure, message = wrong
    assert re.search(message, failure()), failure()
    assert mistake.message in failure()


def test_the_checker_gives_the_verdict_of_the_batch():
    with pytest.raises(CheckFailed) as e:
        check_amp_step(amp_manual_backoff)
    assert verdict(amp_manual_backoff) in str(e.value)


def test_local_skip_is_named_fast():
    # Rank 1's loss is NaN at step 2: it returns, rank 0 waits in DDP's all-reduce.
    msg, took = _local_skip()
    assert re.search(r"(?s)rank\(?s?\)? ?1.*returned.*rank\(?s?\)? ?0", msg), msg
    assert "step 2/3" in msg and "isfinite(loss)" in msg, msg
    assert "course_utils/checks" not in msg and "torch/nn/parallel" not in msg, msg
    assert took < 90, took


@pytest.mark.parametrize("wrong, previous", [
    (amp_never_updates, r"the previous step called scaler\.step\(optimizer\) but not scaler\.update\(\)"),
    (amp_skips_nan_steps_by_hand, r"the previous step called scaler\.unscale_\(optimizer\) and returned "
                                  r"before scaler\.update\(\) \(a step skipped by hand\)"),
], ids=lambda w: getattr(w, "__name__", ""))
def test_a_missing_update_is_named_in_a_real_launch(wrong, previous):
    """check_amp_step lets the learner's exception end the launch: its message names the missing
    update(), not a rank that returned early."""
    with pytest.raises(CheckFailed) as e:
        check_amp_step(wrong, amp_dtype=torch.float16)
    msg = str(e.value)
    assert re.search(r"(?s)your code raised RuntimeError: unscale_\(\).*This means " + previous + r".*in "
                     + wrong.__name__ + r".*Usual mistake: .*update\(\) closes every step", msg), msg
    assert CATALOGUE.hint(wrong.__name__) in msg
    assert "returned early" not in msg and "waiting in DDP's all-reduce" not in msg, msg


def test_detects_the_deprecated_api_where_it_is_called():
    log: list[str] = []
    with deprecated_amp_calls(log), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.cuda.amp.GradScaler(enabled=False)
        with torch.cuda.amp.autocast(enabled=False):
            pass
    assert log == ["torch.cuda.amp.GradScaler", "torch.cuda.amp.autocast"]
    assert torch.cuda.amp.autocast.__module__ == "torch.cuda.amp.autocast_mode"  # restored


def test_rejects_none_a_wrong_signature_and_reports_the_stub():
    with pytest.raises(CheckFailed, match=r"got None\. Did the cell that defines it run\?"):
        check_amp_step(None)
    with pytest.raises(CheckFailed, match=r"calls fn\(model, optimizer, scaler, x, y"):
        check_amp_step(lambda model, optimizer, x, y: 0.0)

    def stub(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
        raise NotImplementedError("Exercise 08.a AMP step under DDP: replace this line")

    with pytest.raises(CheckFailed, match=r"not done yet.*08\.a AMP step under DDP"):
        check_amp_step(stub)
