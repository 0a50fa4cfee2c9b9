"""09.f evaluation without graphs.

``evaluate(model, batches) -> float`` runs on two ranks with uneven batches: the global mean loss
per sample, computed in eval mode without autograd saving anything (counted with
``saved_tensors_hooks``), and the model left in training mode.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...checking import (
    Catalogue,
    CheckFailed,
    Misconception,
    Outcome,
    checker,
    judge,
    process_group,
    require_callable,
    run_workers,
)
from ...data import make_dataset, make_model
from .common import GRAPH_HINT, WORLD, agree, number

__all__ = ["CATALOGUE", "check_eval_no_leak"]

CATALOGUE = Catalogue(
    "09.f evaluation leak",
    Misconception(
        "evaluate_tensor_total",
        "a running total is just a number",
        "the returned value is a tensor that requires grad",
        GRAPH_HINT),
    Misconception(
        "evaluate_with_grad",
        "evaluation without backward builds no graph",
        "autograd saved tensors during evaluate() (saved_tensors_hooks count them)",
        "for a backward pass that never comes: every batch's activations stay alive as long as "
        "anything references the loss. Wrap the evaluation in torch.no_grad() (or "
        "torch.inference_mode())"),
    Misconception(
        "evaluate_in_training_mode",
        "eval mode is only for dropout",
        "BatchNorm's running statistics moved",
        "changed during evaluation: call model.eval() first"),
    Misconception(
        "evaluate_leaves_eval_mode",
        "the caller switches back to training",
        "the model is in eval mode after evaluate()",
        "the model is still in eval mode after evaluate(); call model.train() before returning, or "
        "training continues with frozen BatchNorm statistics and no dropout"),
    Misconception(
        "evaluate_local_mean",
        "this rank's mean is the validation loss",
        "the value is this rank's own mean",
        "that is this rank's own mean: all-reduce the sum of losses and the number of samples, then "
        "divide"),
    Misconception(
        "evaluate_mean_of_batch_means",
        "the mean of the batch means is the mean",
        "the value is the mean of per-batch means (the batches are uneven)",
        "that is the mean of per-batch means: weight each batch by its size"),
    Misconception(
        "evaluate_mean_of_rank_means",
        "the average of the ranks' averages is the average",
        "the value is the mean of the ranks' means (the ranks hold different numbers of samples)",
        "that is the mean of the ranks' means, but the ranks hold different numbers of samples: "
        "all-reduce the sum and the count instead"),
)
_hint = CATALOGUE.hint


def _eval_batches(rank: int) -> list:
    X, Y = make_dataset(64, seed=30 + rank).tensors
    sizes = [16, 16, 16] if rank == 0 else [16, 5]  # uneven: a plain mean of means is wrong
    out, start = [], 0
    for s in sizes:
        out.append((X[start:start + s], Y[start:start + s]))
        start += s
    return out


def _worker(fn: Callable) -> Outcome:
    with process_group("gloo") as pg:
        batches = _eval_batches(pg.rank)
        model = make_model(0, hidden=32, norm=True)
        with torch.no_grad():  # non-trivial BatchNorm statistics, identical on both ranks
            model(torch.linspace(-2, 2, 32 * 8).reshape(8, 32))
        model.train()

        ref_model = copy.deepcopy(model).eval()
        with torch.no_grad():
            total = torch.tensor([sum(F.cross_entropy(ref_model(x), y, reduction="sum").item()
                                      for x, y in batches),
                                  float(sum(len(y) for _, y in batches))], dtype=torch.float64)
            batch_means = torch.tensor([sum(F.cross_entropy(ref_model(x), y).item()
                                            for x, y in batches),
                                        float(len(batches))], dtype=torch.float64)
        local_mean = (total[0] / total[1]).item()
        rank_means = torch.tensor([local_mean], dtype=torch.float64)
        for t in (total, batch_means, rank_means):
            dist.all_reduce(t)
        reference = (total[0] / total[1]).item()

        buffers = {k: v.clone() for k, v in model.named_buffers()}
        saved = [0]

        def pack(t):
            saved[0] += 1
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            value = fn(model, batches)
        changed = [k for k, v in model.named_buffers() if "num_batches" not in k
                   and not torch.equal(v, buffers[k])]
        info = {"value": value, "saved": saved[0], "changed": changed, "training": model.training,
                "reference": reference, "local_mean": local_mean,
                "mean_of_batch_means": (batch_means[0] / batch_means[1]).item(),
                "mean_of_rank_means": rank_means.item() / pg.world}
    if isinstance(value, torch.Tensor):  # sent back as a description, not a graph
        info["value"] = torch.tensor(0.0, requires_grad=value.requires_grad) \
            if value.requires_grad or value.grad_fn is not None else value.detach()
    return Outcome(pg.rank, data=info)


@checker("09.f evaluation leak")
def check_eval_no_leak(evaluate: Callable, *, timeout: float = 20.0) -> None:
    """Two ranks with uneven batches; the global mean loss, without graphs, in eval mode."""
    require_callable(evaluate, "evaluate(model, batches)")
    outcomes = run_workers(_worker, WORLD, args=(evaluate,), timeout=timeout,
                           hang_hint="every rank must take part in the same all-reduces (sum and count)")
    out = [o.data for o in judge(outcomes, world=WORLD)]
    for r, o in enumerate(out):
        value = o["value"]
        if isinstance(value, torch.Tensor) and value.requires_grad:
            number(value, "evaluate", r)  # raises, naming the graph
        if o["saved"]:
            raise CheckFailed(f"rank {r}: evaluate() made autograd save {o['saved']} tensors "
                              + _hint("evaluate_with_grad"))
        if o["changed"]:
            raise CheckFailed(f"rank {r}: BatchNorm statistics {o['changed']} "
                              + _hint("evaluate_in_training_mode"))
        if not o["training"]:
            raise CheckFailed(f"rank {r}: " + _hint("evaluate_leaves_eval_mode"))
        got = number(value.item() if isinstance(value, torch.Tensor) and value.numel() == 1
                     else value, "evaluate", r)
        if isinstance(value, torch.Tensor):
            number(value, "evaluate", r)
        if not agree(got, o["reference"]):
            if agree(got, o["local_mean"]):
                why = _hint("evaluate_local_mean")
            elif agree(got, o["mean_of_batch_means"]):
                why = _hint("evaluate_mean_of_batch_means")
            elif agree(got, o["mean_of_rank_means"]):
                why = _hint("evaluate_mean_of_rank_means")
            else:
                why = "expected sum of per-sample losses over all ranks / number of samples"
            raise CheckFailed(f"rank {r} returned {got:.6g}, expected the mean loss over every "
                              f"rank's samples {o['reference']:.6g}; {why}")
