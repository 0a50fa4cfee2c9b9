"""01.a training step with gradient clipping.

``check_train_step(train_step)``: ``train_step(model, optimizer, x, y, max_norm) -> (loss, norm)``,
compared with the reference for 3 steps of SGD with momentum, on the gradients the optimizer used,
the parameters and the momentum buffers.  ``CATALOGUE`` holds the misconceptions it names: an
entry's key is the wrong answer written with it in tests/checkers/test_ch01_checks.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ...checking import (
    Catalogue,
    CheckFailed,
    Misconception,
    as_float,
    checker,
    close,
    compare_tensors,
    require_callable,
)
from ...data import make_dataset, make_model

__all__ = ["CATALOGUE", "check_train_step"]

# max_norm of each step as a fraction of that step's true gradient norm: the first step clips hard
# (clamping elements at this bound changes some of them), the second does not clip at all (an answer
# that rescales every gradient to max_norm, or measures the norm as a sum, shows there), the third
# clips again, with momentum from the first two steps in the update.
_CLIP_FACTORS = (0.1, 1.5, 0.4)

CATALOGUE = Catalogue(
    "01.a training step",
    Misconception(
        "clip_before_backward",
        "clip anywhere in the step: before backward()",
        "the optimizer stepped with the unclipped gradients",
        "before it, this batch has no gradients yet: clipping then acts on zeros, or on what the "
        "previous step left"),
    Misconception(
        "never_clips",
        "clipping is optional",
        "the optimizer stepped with the unclipped gradients",
        "the optimizer stepped with the unclipped gradients"),
    Misconception(
        "clip_after_step",
        "clip anywhere in the step: after optimizer.step()",
        "the optimizer stepped with the unclipped gradients, and .grad holds the clipped ones after",
        "you clipped after optimizer.step(): the update was already made with the unclipped "
        "gradients, and the clipped ones are thrown away by the next zero_grad(). Clip between "
        "loss.backward() and optimizer.step()."),
    Misconception(
        "clip_each_parameter",
        "max_norm is per parameter",
        "each gradient was scaled by min(1, max_norm / its own norm)",
        "each parameter's gradient was clipped by its own norm. max_norm bounds one norm over all "
        "the gradients together (as if they were one long vector), and every gradient is scaled by "
        "the same factor: pass all parameters to one `clip_grad_norm_(model.parameters(), "
        "max_norm)` call."),
    Misconception(
        "clip_values",
        "clipping limits the values",
        "the gradients were clamped to [-max_norm, max_norm] element by element",
        "the gradients were clipped element by element (clip_grad_value_ or clamp), which changes "
        "the gradient's direction and does not keep its norm within max_norm. Clip by the global "
        "norm: `torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)` scales all gradients "
        "by one factor."),
    Misconception(
        "norm_as_sum",
        "the total norm is the sum of the parameters' norms",
        "the gradients were scaled by max_norm / (sum of the per-parameter norms)",
        "the total norm was taken as the sum of the parameters' norms. The global norm is the norm "
        "of all gradients as one vector: the square root of the sum of the squared per-parameter "
        "norms (torch.nn.utils.get_total_norm). In sharded training each rank holds some of the "
        "gradients: the ranks add up their sums of squares, then take the root."),
    Misconception(
        "rescale_always",
        "clipping rescales to max_norm",
        "a gradient below max_norm was scaled up to it",
        "the gradients were scaled up to max_norm. Clipping only shrinks: the factor is min(1, "
        "max_norm / total_norm), so a gradient whose norm is already below max_norm stays as it is."),
    Misconception(
        "zero_grad_before_step",
        "zero_grad anywhere in the step: between backward and step",
        "every gradient was zero or None when optimizer.step() ran",
        "when optimizer.step() ran, every gradient was zero or None: zero_grad() between "
        "loss.backward() and optimizer.step() erased them. Zero the gradients at the start of the "
        "step (or after step()), never between backward() and step()."),
    Misconception(
        "no_zero_grad",
        "gradients start from zero by themselves",
        "the gradients at optimizer.step() hold the previous step's as well",
        "the gradients the optimizer used hold this batch's gradients plus those left from the "
        "previous step. Call `optimizer.zero_grad()` in every step, before `loss.backward()`."),
    Misconception(
        "no_step",
        "backward updates the weights",
        "optimizer.step() never ran",
        "optimizer.step() was never called, so the parameters did not change: call "
        "`optimizer.step()` after clipping the gradients."),
    Misconception(
        "norm_after_clipping",
        "the norm to log is the clipped one",
        "the returned norm is min(norm, max_norm)",
        "that is the norm after clipping, which is never above max_norm, so a log of it cannot show "
        "how often clipping acts. Return the norm before clipping: the value clip_grad_norm_ "
        "returns"),
    Misconception(
        "returns_graph",
        "returning the loss tensor is harmless",
        "a returned value requires grad",
        "a tensor that still holds the autograd graph of the step. Return `loss.item()` or "
        "`loss.detach()`: a caller that keeps graphs alive (`total += loss`) leaks the memory of "
        "every step, the classic leak of chapter 09."),
    Misconception(
        "summed_loss",
        "the summed loss is the loss",
        "the returned loss is batch size times the mean",
        "the loss was summed over the batch. Use the mean over the batch, "
        "`nn.functional.cross_entropy(model(x), y)`, as the reference does."),
)


def _grads(model: nn.Module) -> dict:
    return {k: None if p.grad is None else p.grad.detach().clone() for k, p in model.named_parameters()}


def _total_norm(grads: dict) -> torch.Tensor:
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))


def _scaled(grads: dict, coef) -> dict:
    return {k: g * coef for k, g in grads.items()}


def _same(a: dict, b: dict) -> bool:
    return all(a[k] is not None and close(a[k], b[k], atol=1e-7, rtol=1e-4) for k in b)


def _clip_mistake(seen: dict, g: dict, norm: float, max_norm: float, left: dict | None,
                  after: dict, step: int) -> str:
    """What a learner did to the gradients the optimizer stepped with (``seen``), or ``""``."""
    where = f"step {step} (max_norm {max_norm:.4g}, true gradient norm {norm:.4g})"
    hint = CATALOGUE.hint
    if all(v is None or not v.any() for v in seen.values()):
        return f"{where}: " + hint("zero_grad_before_step")
    if left is not None:
        stale = {k: g[k] + (left[k] if left[k] is not None else 0) for k in g}
        coef = min(1.0, max_norm / (_total_norm(stale).item() + 1e-6))
        if _same(seen, _scaled(stale, coef)):
            return f"{where}: " + hint("no_zero_grad")
    if norm > max_norm and _same(seen, g):
        if all(after[k] is not None for k in g) and _same(after, _scaled(g, max_norm / (norm + 1e-6))):
            return f"{where}: " + hint("clip_after_step")
        return (f"{where}: {hint('never_clips')}. Clip after loss.backward() "
                f"({hint('clip_before_backward')}) and before optimizer.step(), with "
                "`torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`.")
    if norm < max_norm and _same(seen, _scaled(g, max_norm / norm)):
        return f"{where}: " + hint("rescale_always")
    per_param = {k: v * min(1.0, max_norm / (torch.linalg.vector_norm(v).item() + 1e-6))
                 for k, v in g.items()}
    if _same(seen, per_param):
        return f"{where}: " + hint("clip_each_parameter")
    if _same(seen, {k: v.clamp(-max_norm, max_norm) for k, v in g.items()}):
        return f"{where}: " + hint("clip_values")
    summed = sum(torch.linalg.vector_norm(v).item() for v in g.values())
    if _same(seen, _scaled(g, min(1.0, max_norm / summed))):
        return f"{where}: " + hint("norm_as_sum")
    return ""


def _two_numbers(got) -> tuple:
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise CheckFailed(f"train_step should return two numbers, (loss, norm before clipping); got "
                          f"{type(got).__name__}" + (f" of length {len(got)}" if
                                                      isinstance(got, (tuple, list)) else ""))
    for name, v in zip(("the loss", "the norm"), got):
        if isinstance(v, torch.Tensor) and v.requires_grad:
            raise CheckFailed(f"train_step returned {name} as " + CATALOGUE.hint("returns_graph"))
    values = tuple(as_float(v) for v in got)
    for name, v in zip(("the loss", "the norm"), values):
        if isinstance(v, tuple):
            raise CheckFailed(f"train_step returned {name} as a {v[1]}; expected a number or a "
                              "one-element tensor")
    return values


@checker("01.a training step", in_process=True)
def check_train_step(train_step: Callable) -> None:
    """``train_step(model, optimizer, x, y, max_norm) -> (loss, norm)``: one step with the gradients
    clipped to a global norm of at most ``max_norm``; compared with the reference for 3 steps of SGD
    with momentum, on the gradients the optimizer used, the parameters and the momentum buffers."""
    require_callable(train_step, "train_step(model, optimizer, x, y, max_norm)")
    x_all, y_all = make_dataset(1024, seed=1).tensors
    ref, mine = make_model(0), make_model(0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    my_opt = torch.optim.SGD(mine.parameters(), lr=0.05, momentum=0.9)
    seen: list[dict] = []
    hook = my_opt.register_step_pre_hook(lambda opt, args, kwargs: seen.append(_grads(mine)))
    left = None
    try:
        for step, factor in enumerate(_CLIP_FACTORS):
            x, y = x_all[step * 32:(step + 1) * 32], y_all[step * 32:(step + 1) * 32]
            ref_opt.zero_grad()
            want_loss = nn.functional.cross_entropy(ref(x), y)
            want_loss.backward()
            g = _grads(ref)
            norm = _total_norm(g).item()
            max_norm = factor * norm
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
            ref_opt.step()
            seen.clear()
            loss, got_norm = _two_numbers(train_step(mine, my_opt, x, y, max_norm))
            after = _grads(mine)
            where = f"step {step}"
            if not seen:
                raise CheckFailed(f"{where}: " + CATALOGUE.hint("no_step"))
            if abs(loss - len(y) * want_loss.item()) < 1e-3 * len(y):
                raise CheckFailed(f"{where}: loss {loss:.4f}, {len(y)}x the expected {want_loss.item():.4f}: "
                                  + CATALOGUE.hint("summed_loss"))
            want = _scaled(g, min(1.0, max_norm / (norm + 1e-6)))
            if not _same(seen[0], want):
                mistake = _clip_mistake(seen[0], g, norm, max_norm, left, after, step)
                if mistake:
                    raise CheckFailed(mistake)
                compare_tensors(want, {k: v for k, v in seen[0].items() if v is not None},
                                atol=1e-6, what="gradients at optimizer.step()",
                                where=where, hint="zero_grad, forward, loss (the mean), backward, "
                                "clip_grad_norm_(model.parameters(), max_norm), step")
            if abs(loss - want_loss.item()) > 1e-4:
                raise CheckFailed(f"{where}: loss {loss:.6f}, expected {want_loss.item():.6f}: return "
                                  "the cross-entropy of this batch, computed before the update.")
            if abs(got_norm - norm) > 1e-4 * norm:
                if abs(got_norm - min(norm, max_norm)) < 1e-4 * norm:
                    why = CATALOGUE.hint("norm_after_clipping")
                else:
                    why = ("return the total norm of the gradients before clipping (clip_grad_norm_ "
                           "returns it)")
                raise CheckFailed(f"{where}: returned norm {got_norm:.6g}, expected {norm:.6g}: {why}.")
            compare_tensors(dict(ref.named_parameters()), dict(mine.named_parameters()), atol=1e-6,
                            where=f"{where}, after the update", hint="one optimizer.step() per call")
            bufs = {k: ref_opt.state[p]["momentum_buffer"] for k, p in ref.named_parameters()}
            compare_tensors(bufs, {k: my_opt.state[p].get("momentum_buffer", torch.zeros(0))
                                   for k, p in mine.named_parameters()}, atol=1e-6,
                            what="momentum buffers", where=where, hint="one optimizer.step() per call")
            left = after
    finally:
        hook.remove()
    print(f"train_step: {len(_CLIP_FACTORS)} steps of SGD with momentum, max_norm below and above the "
          "gradient's norm; the gradients at optimizer.step(), the returned loss and norm, the "
          "parameters and the momentum match the reference")
