"""Checkers for chapter 01 (one device): the training step and the evaluation loop."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ..checking import CheckFailed, checker, compare_tensors, require_callable
from ..data import make_dataset, make_model, split

__all__ = ["check_train_step", "check_evaluate"]


def _reference_step(model: nn.Module, opt: torch.optim.Optimizer, x, y) -> float:
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def _batches(k: int, bs: int = 32):
    x, y = make_dataset(1024, seed=1).tensors
    return [(x[i * bs:(i + 1) * bs], y[i * bs:(i + 1) * bs]) for i in range(k)]


@checker("01.a training step")
def check_train_step(train_step: Callable) -> None:
    """``train_step(model, optimizer, x, y) -> float`` must match the reference for 3 steps."""
    require_callable(train_step, "train_step(model, optimizer, x, y)")
    ref, mine = make_model(0), make_model(0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    my_opt = torch.optim.SGD(mine.parameters(), lr=0.05, momentum=0.9)
    before = {k: v.clone() for k, v in mine.state_dict().items()}
    for step, (x, y) in enumerate(_batches(3)):
        want = _reference_step(ref, ref_opt, x, y)
        got = train_step(mine, my_opt, x, y)
        if isinstance(got, torch.Tensor):
            if got.requires_grad:
                raise CheckFailed(
                    "train_step returned the loss tensor itself, which still holds the whole "
                    "autograd graph. Return `loss.item()`: keeping graphs alive (e.g. `total += "
                    "loss`) is the classic memory leak of chapter 09.")
            got = got.item()
        if not isinstance(got, (float, int)):
            raise CheckFailed(f"train_step should return the loss as a float, got "
                              f"{type(got).__name__}")
        if step == 0 and all(torch.equal(before[k], v) for k, v in mine.state_dict().items()):
            raise CheckFailed("the parameters did not change after one step: call "
                              "`optimizer.step()` after `loss.backward()`.")
        if step > 0:
            stale = [n for (n, p), q in zip(mine.named_parameters(), ref.parameters())
                     if p.grad is not None and not torch.allclose(p.grad, q.grad, atol=1e-6)]
            if stale:
                raise CheckFailed(
                    f"step {step}: the gradients of {stale[0]} are not this batch's gradients; "
                    "those of the previous steps were added to them. Usual mistake: call "
                    "`optimizer.zero_grad()` in every step, before `loss.backward()`.")
        if abs(got - want) > 1e-4:
            hint = ("the gradients of the previous step were added to this one: call "
                    "`optimizer.zero_grad()` before `loss.backward()`") if step > 0 else (
                    "use `nn.functional.cross_entropy(model(x), y)` (the mean over the batch)")
            raise CheckFailed(f"step {step}: loss {got:.6f}, expected {want:.6f}. Usual mistake: {hint}.")
        compare_tensors(dict(ref.named_parameters()), dict(mine.named_parameters()), atol=1e-5,
                        where=f"step {step}", hint="zero the gradients every step, and step the "
                        "optimizer once per batch, after backward()")


@checker("01.b evaluation")
def check_evaluate(evaluate: Callable) -> None:
    """``evaluate(model, loader) -> accuracy`` over the whole set, in eval mode, without a graph."""
    require_callable(evaluate, "evaluate(model, loader)")
    model = make_model(0, norm=True)
    _, val = split(make_dataset())
    x, y = val.tensors
    n = 1000  # 1000 is not a multiple of the batch size: the last batch is smaller
    data = TensorDataset(x[:n], y[:n])
    with torch.no_grad():  # warm the BatchNorm statistics so train and eval mode differ
        model.train()
        for i in range(0, n, 100):
            model(x[i:i + 100])
    seen = {"grad": [], "training": []}

    def spy(mod, inp, out):
        seen["grad"].append(torch.is_grad_enabled())
        seen["training"].append(mod.training)

    handle = model.register_forward_hook(spy)
    model.eval()
    with torch.no_grad():
        want = (model(x[:n]).argmax(1) == y[:n]).float().mean().item()
    model.train()
    seen["grad"].clear()
    seen["training"].clear()
    try:
        got = evaluate(model, DataLoader(data, batch_size=64, shuffle=False))
    finally:
        handle.remove()
    if isinstance(got, torch.Tensor):
        got = got.item()
    if not isinstance(got, (float, int)):
        raise CheckFailed(f"evaluate should return the accuracy as a float, got {type(got).__name__}")
    if not seen["grad"]:
        raise CheckFailed("evaluate never called the model")
    if any(seen["grad"]):
        raise CheckFailed("the model ran with autograd on: wrap evaluation in `torch.no_grad()` "
                          "(or `torch.inference_mode()`), or every batch builds a graph for nothing.")
    if any(seen["training"]):
        raise CheckFailed("the model was in training mode: call `model.eval()` before evaluating, "
                          "or BatchNorm uses the batch's statistics and updates its running ones.")
    if 1.0 < got <= 100.0:
        raise CheckFailed(f"got {got:.2f}: return a fraction between 0 and 1, not a percentage")
    if abs(got - want) > 1e-6:
        raise CheckFailed(
            f"accuracy {got:.6f}, expected {want:.6f}. Usual mistake: averaging per-batch accuracies "
            "gives the smaller last batch too much weight; count correct predictions and divide by "
            "the number of samples.")
