"""Checkers for chapter 01 (one device): the training step, the evaluation loop, and the gradient of a
batch rebuilt from the gradients of its shards (data parallelism on one process).

What learners get wrong, and the message each one gets (tests/test_ch01_checks.py holds an answer
written with each misconception):

01.a training step
- "gradients start from zero by themselves" (no zero_grad) -> "call `optimizer.zero_grad()`";
- "backward updates the weights" (no optimizer.step) -> "call `optimizer.step()`";
- "returning the loss is harmless" (the tensor, with its graph) -> "Return `loss.item()`";
- "the summed loss is the loss" (reduction="sum") -> "the mean over the batch".

01.b evaluation
- "no_grad is only about speed" (forgotten) -> "torch.no_grad";
- "eval mode is only for dropout" (forgotten) -> "model.eval";
- "the mean of the batch accuracies is the accuracy" (smaller last batch) -> "averaging per-batch
  accuracies"; a percentage instead of a fraction -> "not a percentage".

01.c gradient from shards
- "the mean of the shards' gradients is the batch's gradient" (true only for equal shards) ->
  "weighs every shard equally";
- "the ranks' gradients add up" (sum without weights) -> "the SUM of the shards' gradients";
- "the gradient starts from zero" (a previous step's .grad left in place) -> "added to the
  gradients already in .grad";
- "x.chunk(n) gives n shards" (5 rows on 4 shards gives 3) -> "ran on 3 shard(s)";
- "it is enough to get the right numbers" (one backward over the whole batch) -> "each shard
  separately".
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ..checking import CheckFailed, checker, close, compare_tensors, require_callable
from ..data import make_dataset, make_model, split

__all__ = ["check_train_step", "check_evaluate", "check_shard_gradients"]


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
                     if p.grad is not None and not close(p.grad, q.grad, atol=1e-6)]
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


# --------------------------------------------------------------------------------------------
# 01.c gradient from shards
# --------------------------------------------------------------------------------------------

# (batch, shards): an even split first, so that a mistake that only shows on uneven shards is named
# as such; 5 rows on 4 shards is where x.chunk(4) gives only 3 pieces.
_SHARD_CASES = [(12, 3), (10, 4), (5, 4), (7, 1)]


@checker("01.c gradient from shards")
def check_shard_gradients(shard_gradients: Callable) -> None:
    """``shard_gradients(model, x, y, n_shards)``: as N ranks would, run the model on each of ``n_shards``
    shards of the batch separately, then leave in ``model``'s ``.grad`` the gradient of the mean
    cross-entropy over the WHOLE batch (replacing whatever ``.grad`` held), without changing the
    parameters."""
    require_callable(shard_gradients, "shard_gradients(model, x, y, n_shards)")
    data_x, data_y = make_dataset(64, seed=3).tensors
    for case, (batch, n) in enumerate(_SHARD_CASES):
        model = make_model(seed=case)
        x, y = data_x[:batch].clone(), data_y[:batch].clone()
        ref = make_model(seed=case)
        nn.functional.cross_entropy(ref(x), y).backward()
        want = {k: p.grad.clone() for k, p in ref.named_parameters()}
        for p in model.parameters():  # what the previous step left behind
            p.grad = torch.full_like(p, 0.5)
        before = {k: p.detach().clone() for k, p in model.named_parameters()}
        rows: list[int] = []
        handle = model.register_forward_pre_hook(lambda mod, args, rows=rows: rows.append(len(args[0])))
        try:
            shard_gradients(model, x, y, n)
        finally:
            handle.remove()
        where = f"a batch of {batch} on {n} shard(s)"
        if not rows:
            raise CheckFailed(f"for {where} the model never ran: run it on each shard.")
        if n > 1 and rows == [batch]:
            raise CheckFailed(
                f"for {where} the model ran once, on the whole batch: that is one device, not N "
                "ranks. Run it on each shard separately (each rank only sees its shard), then "
                "combine the shards' gradients.")
        if len(rows) != n or sum(rows) != batch:
            hint = ""
            if len(rows) < n and sum(rows) == batch:
                hint = (f" x.chunk({n}) cuts {batch} rows into pieces of ceil({batch}/{n}) rows, so it "
                        "can give fewer pieces than asked; torch.tensor_split gives exactly n.")
            raise CheckFailed(
                f"for {where} the model ran on {len(rows)} shard(s) of sizes {rows}; expected "
                f"{n} shards that together hold the {batch} rows.{hint}")
        changed = [k for k, p in model.named_parameters() if not torch.equal(p.detach(), before[k])]
        if changed:
            raise CheckFailed(f"the parameters changed ({changed[0]}, ...): compute gradients only, "
                              "the optimizer step is not part of this exercise.")
        got = {k: p.grad for k, p in model.named_parameters()}
        if any(g is None for g in got.values()):
            raise CheckFailed("some parameters have no .grad afterwards: leave the combined "
                              "gradient in each parameter's .grad.")
        if all(close(got[k], want[k], atol=1e-5) for k in want):
            continue
        # Name the mistake from what each shard's gradient alone would be.
        shard_grads, start = [], 0
        for r in rows:
            m = make_model(seed=case)
            nn.functional.cross_entropy(m(x[start:start + r]), y[start:start + r]).backward()
            shard_grads.append({k: p.grad for k, p in m.named_parameters()})
            start += r
        mean_of_means = {k: sum(g[k] for g in shard_grads) / n for k in want}
        summed = {k: sum(g[k] for g in shard_grads) for k in want}
        stale = {k: want[k] + 0.5 for k in want}
        if all(close(got[k], stale[k], atol=1e-5) for k in want):
            raise CheckFailed(
                f"for {where} your gradient was added to the gradients already in .grad (a "
                "previous step left them there): set .grad (or zero it first, like "
                "optimizer.zero_grad()) instead of accumulating onto it.")
        if len(set(rows)) > 1 and all(close(got[k], mean_of_means[k], atol=1e-5) for k in want):
            raise CheckFailed(
                f"for {where} (shards of {rows} rows) you averaged the shards' gradients, which "
                "weighs every shard equally: the rows of a small shard then count more than the "
                "others. The mean of means is the batch's mean only for equal shards; weigh shard "
                "k's gradient by its share of the batch, rows_k / batch.")
        if n > 1 and all(close(got[k], summed[k], atol=1e-5) for k in want):
            raise CheckFailed(
                f"for {where} .grad holds the SUM of the shards' gradients, {n}x too large on "
                "equal shards: each shard's loss is already a mean over its rows, so the ranks' "
                "gradients must be averaged (weighted by shard size), not added.")
        compare_tensors(want, got, atol=1e-5, what="gradients", where=where,
                        hint="the gradient of the mean loss over the whole batch is the sum over "
                             "shards of (rows_k / batch) x shard k's gradient")
    print(f"shard_gradients rebuilds the whole batch's gradient on {len(_SHARD_CASES)} batch/shard "
          "combinations, uneven shards included")
