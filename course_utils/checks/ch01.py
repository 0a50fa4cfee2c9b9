"""Checkers for chapter 01 (one device): a training step with gradient clipping, an evaluation loop
that weighs every sample equally, and the gradient of a batch rebuilt from the gradients of its shards
(data parallelism on one process).

What learners get wrong is each exercise's catalogue below (``CATALOGUE_A``, ``_B``, ``_C``): an
entry's key names the answer written with that misconception in tests/checkers/test_ch01_checks.py,
its message is what the failure says.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ..checking import (
    Catalogue,
    CheckFailed,
    Misconception,
    as_float,
    checker,
    close,
    compare_tensors,
    require_callable,
)
from ..data import make_dataset, make_model, split

__all__ = ["CATALOGUE_A", "CATALOGUE_B", "CATALOGUE_C", "check_train_step", "check_evaluate",
           "check_shard_gradients"]


# --------------------------------------------------------------------------------------------
# 01.a training step with gradient clipping
# --------------------------------------------------------------------------------------------

# max_norm of each step as a fraction of that step's true gradient norm: the first step clips hard
# (clamping elements at this bound changes some of them), the second does not clip at all (an answer
# that rescales every gradient to max_norm, or measures the norm as a sum, shows there), the third
# clips again, with momentum from the first two steps in the update.
_CLIP_FACTORS = (0.1, 1.5, 0.4)

CATALOGUE_A = Catalogue(
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
    hint = CATALOGUE_A.hint
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
            raise CheckFailed(f"train_step returned {name} as " + CATALOGUE_A.hint("returns_graph"))
    values = tuple(as_float(v) for v in got)
    for name, v in zip(("the loss", "the norm"), values):
        if isinstance(v, tuple):
            raise CheckFailed(f"train_step returned {name} as a {v[1]}; expected a number or a "
                              "one-element tensor")
    return values


@checker("01.a training step")
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
                raise CheckFailed(f"{where}: " + CATALOGUE_A.hint("no_step"))
            if abs(loss - len(y) * want_loss.item()) < 1e-3 * len(y):
                raise CheckFailed(f"{where}: loss {loss:.4f}, {len(y)}x the expected {want_loss.item():.4f}: "
                                  + CATALOGUE_A.hint("summed_loss"))
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
                    why = CATALOGUE_A.hint("norm_after_clipping")
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


# --------------------------------------------------------------------------------------------
# 01.b evaluation
# --------------------------------------------------------------------------------------------


CATALOGUE_B = Catalogue(
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
_hint_b = CATALOGUE_B.hint


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


@checker("01.b evaluation")
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
            raise CheckFailed(_hint_b("eval_with_grad"))
        acc, loss = (as_float(v) for v in got)
        if isinstance(acc, tuple) or isinstance(loss, tuple):
            raise CheckFailed("evaluate should return two numbers (floats or one-element tensors)")
        if not seen["training"]:
            raise CheckFailed("evaluate never called the model")
        if any(seen["training"]) or any(not torch.equal(v, buffers[k]) for k, v in model.named_buffers()
                                        if "num_batches" not in k):
            raise CheckFailed(_hint_b("eval_train_mode"))
        if model.training != (mode == "training"):
            raise CheckFailed(
                f"{where}: after evaluate() the model was in "
                f"{'training' if model.training else 'eval'} mode. Restore the mode the model was in: "
                f"{_hint_b('eval_no_restore')}, and {_hint_b('eval_back_to_train')}.")
        if _agree(acc, want["loss"]) and _agree(loss, want["acc"]):
            raise CheckFailed(_hint_b("eval_swapped"))
        if 1.0 < acc <= 100.0 and _agree(acc / 100, want["acc"]):
            raise CheckFailed(f"accuracy {acc:.2f}: " + _hint_b("eval_percent"))
        for name, value in (("accuracy", acc), ("mean loss", loss)):
            key = "acc" if name == "accuracy" else "loss"
            if _agree(value, want[key]):
                continue
            if _agree(value, want[f"{key}_mean"]):
                mistake = "eval_mean_of_batch_accuracies" if key == "acc" else "eval_mean_of_batch_losses"
                why = (f"that is the {_hint_b(mistake)}, which gives each sample of the "
                       "smaller last batch more weight than the others. Weigh each batch by its size: "
                       "add up per-sample sums (correct predictions; "
                       "`cross_entropy(..., reduction=\"sum\")`) and divide by the number of samples")
            elif _agree(value, want[f"{key}_padded"]):
                why = (f"that divides by len(loader) * batch_size = {want['padded']} samples, but the "
                       f"last batch is smaller and the loader holds {want['n']}. "
                       + _hint_b("eval_full_batches"))
            else:
                why = ("expected the sum over every sample divided by the number of samples, with the "
                       "model in eval mode")
            raise CheckFailed(f"{where}: {name} {value:.6f}, expected {want[key]:.6f}; {why}.")
    print("evaluate: accuracy and mean loss per sample over a loader whose last batch is smaller, in eval "
          "mode without autograd, for a model in training mode and one in eval mode, each left as it was")


# --------------------------------------------------------------------------------------------
# 01.c gradient from shards
# --------------------------------------------------------------------------------------------

# (batch, shards): an even split first, so that a mistake that only shows on uneven shards is named
# as such; 5 rows on 4 shards is where x.chunk(4) gives only 3 pieces.
_SHARD_CASES = [(12, 3), (10, 4), (5, 4), (7, 1)]

CATALOGUE_C = Catalogue(
    "01.c gradient from shards",
    Misconception(
        "shards_mean_of_means",
        "the mean of the shards' gradients is the batch's gradient",
        "on uneven shards, .grad holds the plain mean of the shards' gradients",
        "which weighs every shard equally: the rows of a small shard then count more than the "
        "others. The mean of means is the batch's mean only for equal shards; weigh shard k's "
        "gradient by its share of the batch, rows_k / batch."),
    Misconception(
        "shards_summed",
        "the ranks' gradients add up",
        ".grad holds the sum of the shards' gradients",
        "each shard's loss is already a mean over its rows, so the ranks' gradients must be "
        "averaged (weighted by shard size), not added."),
    Misconception(
        "shards_no_zero",
        "the gradient starts from zero",
        ".grad holds the right gradient plus what was in .grad before",
        "your gradient was added to the gradients already in .grad (a previous step left them "
        "there): set .grad (or zero it first, like optimizer.zero_grad()) instead of accumulating "
        "onto it."),
    Misconception(
        "shards_chunk",
        "x.chunk(n) gives n shards",
        "the model ran on fewer shards than asked, which together hold the batch",
        "so it can give fewer pieces than asked; torch.tensor_split gives exactly n."),
    Misconception(
        "shards_whole_batch",
        "it is enough to get the right numbers",
        "the model ran once, on the whole batch",
        "that is one device, not N ranks. Run it on each shard separately (each rank only sees its "
        "shard), then combine the shards' gradients."),
    Misconception(
        "shards_with_step",
        "a gradient is not done until the optimizer steps",
        "the parameters changed",
        "compute gradients only, the optimizer step is not part of this exercise."),
)
_hint_c = CATALOGUE_C.hint


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
                f"for {where} the model ran once, on the whole batch: " + _hint_c("shards_whole_batch"))
        if len(rows) != n or sum(rows) != batch:
            hint = ""
            if len(rows) < n and sum(rows) == batch:
                hint = (f" x.chunk({n}) cuts {batch} rows into pieces of ceil({batch}/{n}) rows, so it "
                        + _hint_c("shards_chunk"))
            raise CheckFailed(
                f"for {where} the model ran on {len(rows)} shard(s) of sizes {rows}; expected "
                f"{n} shards that together hold the {batch} rows.{hint}")
        changed = [k for k, p in model.named_parameters() if not torch.equal(p.detach(), before[k])]
        if changed:
            raise CheckFailed(f"the parameters changed ({changed[0]}, ...): " + _hint_c("shards_with_step"))
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
                f"for {where} " + _hint_c("shards_no_zero"))
        if len(set(rows)) > 1 and all(close(got[k], mean_of_means[k], atol=1e-5) for k in want):
            raise CheckFailed(
                f"for {where} (shards of {rows} rows) you averaged the shards' gradients, "
                + _hint_c("shards_mean_of_means"))
        if n > 1 and all(close(got[k], summed[k], atol=1e-5) for k in want):
            raise CheckFailed(
                f"for {where} .grad holds the SUM of the shards' gradients, {n}x too large on "
                "equal shards: " + _hint_c("shards_summed"))
        compare_tensors(want, got, atol=1e-5, what="gradients", where=where,
                        hint="the gradient of the mean loss over the whole batch is the sum over "
                             "shards of (rows_k / batch) x shard k's gradient")
    print(f"shard_gradients rebuilds the whole batch's gradient on {len(_SHARD_CASES)} batch/shard "
          "combinations, uneven shards included")
