"""01.c gradient from shards: data parallelism in one process.

``check_shard_gradients(shard_gradients)``: ``shard_gradients(model, x, y, n_shards)`` runs the
model on each shard separately, as N ranks would, and leaves in ``.grad`` the gradient of the mean
loss over the whole batch.  ``CATALOGUE`` holds the misconceptions it names: an entry's key is the
wrong answer written with it in tests/checkers/test_ch01_checks.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ...checking import (
    Catalogue,
    CheckFailed,
    Misconception,
    checker,
    close,
    compare_tensors,
    require_callable,
)
from ...data import make_dataset, make_model

__all__ = ["CATALOGUE", "check_shard_gradients"]

# (batch, shards): an even split first, so that a mistake that only shows on uneven shards is named
# as such; 5 rows on 4 shards is where x.chunk(4) gives only 3 pieces.
_SHARD_CASES = [(12, 3), (10, 4), (5, 4), (7, 1)]

CATALOGUE = Catalogue(
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
_hint = CATALOGUE.hint


@checker("01.c gradient from shards", in_process=True)
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
                f"for {where} the model ran once, on the whole batch: " + _hint("shards_whole_batch"))
        if len(rows) != n or sum(rows) != batch:
            hint = ""
            if len(rows) < n and sum(rows) == batch:
                hint = (f" x.chunk({n}) cuts {batch} rows into pieces of ceil({batch}/{n}) rows, so it "
                        + _hint("shards_chunk"))
            raise CheckFailed(
                f"for {where} the model ran on {len(rows)} shard(s) of sizes {rows}; expected "
                f"{n} shards that together hold the {batch} rows.{hint}")
        changed = [k for k, p in model.named_parameters() if not torch.equal(p.detach(), before[k])]
        if changed:
            raise CheckFailed(f"the parameters changed ({changed[0]}, ...): " + _hint("shards_with_step"))
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
                f"for {where} " + _hint("shards_no_zero"))
        if len(set(rows)) > 1 and all(close(got[k], mean_of_means[k], atol=1e-5) for k in want):
            raise CheckFailed(
                f"for {where} (shards of {rows} rows) you averaged the shards' gradients, "
                + _hint("shards_mean_of_means"))
        if n > 1 and all(close(got[k], summed[k], atol=1e-5) for k in want):
            raise CheckFailed(
                f"for {where} .grad holds the SUM of the shards' gradients, {n}x too large on "
                "equal shards: " + _hint("shards_summed"))
        compare_tensors(want, got, atol=1e-5, what="gradients", where=where,
                        hint="the gradient of the mean loss over the whole batch is the sum over "
                             "shards of (rows_k / batch) x shard k's gradient")
    print(f"shard_gradients rebuilds the whole batch's gradient on {len(_SHARD_CASES)} batch/shard "
          "combinations, uneven shards included")
