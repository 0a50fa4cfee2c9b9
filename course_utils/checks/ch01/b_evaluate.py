"""01.b evaluation: accuracy and mean loss per sample, in eval mode, without a graph.

``check_evaluate(evaluate)``: ``evaluate(model, loader) -> (accuracy, mean loss)`` over a loader
whose last batch is smaller, for a model in training mode and one in eval mode, each left as it
was.  ``CATALOGUE`` holds the misconceptions it names: an entry's key is the wrong answer written
with it in tests/checkers/test_ch01_checks.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ...checking import (
    Catalogue,
    CheckFailed,
    Misconception,
    as_float,
    checker,
    require_callable,
)
from ...data import make_dataset, make_model, split

__all__ = ["CATALOGUE", "check_evaluate"]

CATALOGUE = Catalogue(
    "01.b evaluation",
    Misconception(
        "eval_no_restore",
        "evaluation may end in eval mode",
        "a model handed over in training mode is in eval mode afterwards",
        "`was_training = model.training` before `model.eval()`, `model.train(was_training)` before "
        "returning. A training loop that evaluates every epoch must go on training"),
    Misconception(
        "eval_back_to_train",
        "evaluation ends in training mode",
        "a model handed over in eval mode is in training mode afterwards",
        "a model that was already in eval mode must stay there"),
    Misconception(
        "eval_with_grad",
        "no_grad is only about speed",
        "the forward hook saw grad mode on, or a returned value requires grad",
        "the model ran with autograd on: wrap evaluation in `torch.no_grad()` (or "
        "`torch.inference_mode()`), or every batch builds a graph that keeps its activations alive "
        "for a backward pass that never comes."),
    Misconception(
        "eval_train_mode",
        "eval mode is only for dropout",
        "the forward hook saw training mode, or BatchNorm's running statistics moved",
        "the model ran in training mode: call `model.eval()` before evaluating, or BatchNorm "
        "normalises with each batch's own statistics and overwrites its running ones (and Dropout "
        "drops activations)."),
    Misconception(
        "eval_mean_of_batch_losses",
        "the mean of the batch means is the mean",
        "the loss equals the mean of per-batch mean losses (the last batch is smaller)",
        "mean of per-batch mean loss values"),
    Misconception(
        "eval_mean_of_batch_accuracies",
        "the mean of the batch accuracies is the accuracy",
        "the accuracy equals the mean of per-batch accuracies (the last batch is smaller)",
        "mean of per-batch accuracy values"),
    Misconception(
        "eval_full_batches",
        "every batch is full",
        "a value equals the sum divided by len(loader) * batch_size",
        "Count len(y) of each batch (or use len(loader.dataset))"),
    Misconception(
        "eval_percent",
        "accuracy is a percentage",
        "the accuracy is 100 times the right fraction",
        "return a fraction between 0 and 1, not a percentage"),
    Misconception(
        "eval_swapped",
        "the order of the two values does not matter",
        "the accuracy is the mean loss and the other way round",
        "accuracy and loss are swapped: return (accuracy, mean loss)"),
)
_hint = CATALOGUE.hint


def _eval_model() -> nn.Module:
    """The course model with BatchNorm, its running statistics away from their initial values."""
    model = make_model(0, norm=True)
    x = make_dataset(512, seed=7).tensors[0]
    model.train()
    with torch.no_grad():
        for i in range(0, len(x), 128):
            model(x[i:i + 128])
    return model


def _eval_candidates(model: nn.Module, loader: DataLoader) -> dict:
    """The right answer and the usual wrong ones, from the same model in eval mode."""
    model.eval()
    correct, loss_sum, n, accs, losses = 0, 0.0, 0, [], []
    with torch.no_grad():
        for x, y in loader:
            out = model(x)
            c = (out.argmax(1) == y).sum().item()
            l_sum = nn.functional.cross_entropy(out, y, reduction="sum").item()
            correct, loss_sum, n = correct + c, loss_sum + l_sum, n + len(y)
            accs.append(c / len(y))
            losses.append(l_sum / len(y))
    padded = len(loader) * loader.batch_size
    return {"acc": correct / n, "loss": loss_sum / n, "n": n, "padded": padded,
            "acc_mean": sum(accs) / len(accs), "loss_mean": sum(losses) / len(losses),
            "acc_padded": correct / padded, "loss_padded": loss_sum / padded}


def _agree(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(1.0, abs(b))


@checker("01.b evaluation", in_process=True)
def check_evaluate(evaluate: Callable) -> None:
    """``evaluate(model, loader) -> (accuracy, mean loss)`` over every sample, the last batch smaller, in
    eval mode, without a graph, and the model left in the mode it was in."""
    require_callable(evaluate, "evaluate(model, loader)")
    _, val = split(make_dataset())
    x, y = val.tensors
    data = TensorDataset(x[:1000], y[:1000])  # 1000 rows: the last batch is smaller
    for mode, bs in (("training", 64), ("eval", 128)):
        model = _eval_model()
        loader = DataLoader(data, batch_size=bs, shuffle=False)
        want = _eval_candidates(model, loader)
        model.train(mode == "training")
        buffers = {k: v.clone() for k, v in model.named_buffers()}
        seen = {"grad": [], "training": []}

        def spy(mod, inp, out, seen=seen):
            seen["grad"].append(torch.is_grad_enabled())
            seen["training"].append(mod.training)

        handle = model.register_forward_hook(spy)
        try:
            got = evaluate(model, loader)
        finally:
            handle.remove()
        where = (f"a model in {mode} mode, {want['n']} samples in batches of {bs} (the last one "
                 f"{want['n'] - (len(loader) - 1) * bs})")
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise CheckFailed(f"evaluate should return two numbers, (accuracy, mean loss); got "
                              f"{type(got).__name__}")
        if any(isinstance(v, torch.Tensor) and v.requires_grad for v in got) or any(seen["grad"]):
            raise CheckFailed(_hint("eval_with_grad"))
        acc, loss = (as_float(v) for v in got)
        if isinstance(acc, tuple) or isinstance(loss, tuple):
            raise CheckFailed("evaluate should return two numbers (floats or one-element tensors)")
        if not seen["training"]:
            raise CheckFailed("evaluate never called the model")
        if any(seen["training"]) or any(not torch.equal(v, buffers[k]) for k, v in model.named_buffers()
                                        if "num_batches" not in k):
            raise CheckFailed(_hint("eval_train_mode"))
        if model.training != (mode == "training"):
            raise CheckFailed(
                f"{where}: after evaluate() the model was in "
                f"{'training' if model.training else 'eval'} mode. Restore the mode the model was in: "
                f"{_hint('eval_no_restore')}, and {_hint('eval_back_to_train')}.")
        if _agree(acc, want["loss"]) and _agree(loss, want["acc"]):
            raise CheckFailed(_hint("eval_swapped"))
        if 1.0 < acc <= 100.0 and _agree(acc / 100, want["acc"]):
            raise CheckFailed(f"accuracy {acc:.2f}: " + _hint("eval_percent"))
        for name, value in (("accuracy", acc), ("mean loss", loss)):
            key = "acc" if name == "accuracy" else "loss"
            if _agree(value, want[key]):
                continue
            if _agree(value, want[f"{key}_mean"]):
                mistake = "eval_mean_of_batch_accuracies" if key == "acc" else "eval_mean_of_batch_losses"
                why = (f"that is the {_hint(mistake)}, which gives each sample of the "
                       "smaller last batch more weight than the others. Weigh each batch by its size: "
                       "add up per-sample sums (correct predictions; "
                       "`cross_entropy(..., reduction=\"sum\")`) and divide by the number of samples")
            elif _agree(value, want[f"{key}_padded"]):
                why = (f"that divides by len(loader) * batch_size = {want['padded']} samples, but the "
                       f"last batch is smaller and the loader holds {want['n']}. "
                       + _hint("eval_full_batches"))
            else:
                why = ("expected the sum over every sample divided by the number of samples, with the "
                       "model in eval mode")
            raise CheckFailed(f"{where}: {name} {value:.6f}, expected {want[key]:.6f}; {why}.")
    print("evaluate: accuracy and mean loss per sample over a loader whose last batch is smaller, in eval "
          "mode without autograd, for a model in training mode and one in eval mode, each left as it was")
