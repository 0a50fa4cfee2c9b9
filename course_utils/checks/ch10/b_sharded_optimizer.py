"""10.b: a sharded optimizer (ZeRO stage 1), the class ``ShardedOptimizer`` of ``mini_ddp.py``.

``check_sharded_optimizer(ShardedOptimizer)`` steps the learner's optimizer and plain AdamW side by
side on 2 ranks (the params given as a generator, a second group added with ``add_param_group``),
compares the parameters after every step, and looks at where the optimizer state lives.

The misconceptions it recognises are ``CATALOGUE`` below (each key names the wrong class in
tests/checkers/test_ch10_checks.py).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

from ...checking import (
    Catalogue,
    CheckFailed,
    Misconception,
    Outcome,
    checker,
    close,
    diff_table,
    format_table,
    judge,
    process_group,
    require_callable,
    run_workers,
)
from ...data import make_dataset, make_model
from ...measure.ch10 import note_sharded_verdict, optimizers_in
from .common import ATOL, STEPS, WORLD, frozen_and_tied

__all__ = ["CATALOGUE", "check_sharded_optimizer"]

CATALOGUE = Catalogue(
    "10.b sharded optimizer",
    Misconception(
        "generator_read_twice", "params can be handed on to the inner optimizer as they came",
        "the inner optimizer gets an empty parameter list and raises",
        "`params` is a generator: it can be read once only. Read it once (torch.optim.Optimizer."
        "__init__ does, and calls add_param_group for each group); an inner optimizer made from the "
        "same generator gets an empty list."),
    Misconception(
        "no_sync", "each rank steps its parameters, that is the whole step",
        "after a step the ranks' parameters differ",
        "after the inner step each rank has updated only the parameters it owns; broadcast every "
        "parameter from its owner (dist.broadcast(p, src=owner)) so that all ranks are up to date."),
    Misconception(
        "no_add_param_group", "the constructor is where the parameters are sharded",
        "the parameters of the group added later keep their initial values",
        "add_param_group() not overridden, so a group added after construction is never sharded "
        "into the inner optimizer."),
    Misconception(
        "no_kwargs", "the inner optimizer needs only the parameters and the learning rate",
        "the parameters equal AdamW's with default hyperparameters",
        "the keyword arguments (weight_decay, betas) not passed on to the inner "
        "optimizer_cls(..., **kwargs)."),
    Misconception(
        "broadcast_from_rank0", "rank 0 holds the model: broadcast from it",
        "the parameters differ from AdamW's, and equal on both ranks",
        "a parameter broadcast from rank 0 instead of from the rank that owns (and stepped) it, or "
        "a group's lr not used."),
    Misconception(
        "owner_skips_broadcast", "the owner already holds the new values, so only the others call "
        "broadcast",
        "the launch hangs: every rank waits in a broadcast whose source never calls it",
        "dist.broadcast is a collective: the source rank calls it too (it sends, the others "
        "receive). Every rank must call dist.broadcast(p, src=owner) for every parameter, in the "
        "same order, the owner included."),
    Misconception(
        "no_sharding", "every rank needs the whole optimizer",
        "parameters with optimizer state on both ranks",
        "every rank steps an optimizer over all parameters; give the inner optimizer only the "
        "parameters this rank owns."),
)
_hint = CATALOGUE.hint

_KW = {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.8, 0.95)}
# The workers' work (two models, three steps, beside AdamW) takes about 2 s on a 2-core machine
# under a load of 5; a launch still running after this long hangs.
TIMEOUT = 30.0
_LR2 = 5e-3


def _cases() -> list[tuple[str, torch.nn.Module]]:
    return [("course model", make_model(seed=600)), ("tied weights", frozen_and_tied(610))]


def _state_of(opt: Any, params: list[torch.Tensor]) -> tuple[list[int], int]:
    """Indices of ``params`` with optimizer state on this rank, and the bytes of that state."""
    index = {id(p): i for i, p in enumerate(params)}
    held, nbytes = set(), 0
    for o in optimizers_in(opt):
        for p, st in o.state.items():
            # Every state tensor but the step counter (a scalar tensor in AdamW): a parameter of
            # one element has state of one element, and it counts.
            tensors = [t for k, t in st.items() if k != "step" and isinstance(t, torch.Tensor)]
            if tensors and id(p) in index:
                held.add(index[id(p)])
                nbytes += sum(t.numel() * t.element_size() for t in tensors)
    return sorted(held), nbytes


def _adamw_variant(init: torch.nn.Module, x, y, k: int, **kw) -> list[dict]:
    model = copy.deepcopy(init)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params[:k], **kw)
    opt.add_param_group({"params": params[k:], "lr": _LR2})
    out = []
    for _ in range(STEPS):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def _worker(cls: Any) -> Outcome:
    with process_group("gloo") as pg:
        x, y = make_dataset(64, seed=11).tensors  # the same batch on every rank: equal gradients
        cases = []
        for name, init in _cases():
            model = copy.deepcopy(init)
            params = list(model.parameters())
            k = len(params) // 2
            opt = cls((p for p in params[:k]), torch.optim.AdamW, **_KW)  # a generator, as usual
            if not isinstance(opt, torch.optim.Optimizer):
                return Outcome(pg.rank, f"ShardedOptimizer(...) gave a {type(opt).__name__}; subclass "
                                        "torch.optim.Optimizer and call super().__init__(params, defaults).")
            opt.add_param_group({"params": params[k:], "lr": _LR2})
            states = []
            for _ in range(STEPS):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
                states.append({n: p.detach().clone() for n, p in model.named_parameters()})
            opt.zero_grad()
            leftover = [n for n, p in model.named_parameters()
                        if p.grad is not None and p.grad.abs().sum() > 0]
            held, nbytes = _state_of(opt, params)
            trainable = [i for i, p in enumerate(params) if p.requires_grad]
            cases.append({
                "name": name, "states": states, "held": held, "bytes": nbytes, "leftover": leftover,
                "trainable": trainable, "groups": [n for n, _ in model.named_parameters()][k:],
                "full_bytes": 2 * sum(params[i].numel() * params[i].element_size() for i in trainable),
                "ref": _adamw_variant(init, x, y, k, **_KW),
                "no_kwargs": _adamw_variant(init, x, y, k, lr=_KW["lr"]),
                "init": {n: p.detach().clone() for n, p in init.named_parameters()},
            })
            del opt
        return Outcome(pg.rank, data={"cases": cases})


@checker("10.b sharded optimizer")
def check_sharded_optimizer(ShardedOptimizer: Any, *, timeout: float = TIMEOUT) -> None:
    """Step ``ShardedOptimizer(params, torch.optim.AdamW, lr=..., weight_decay=0.1, betas=...)``
    on 2 ranks, the params given as a generator, a second group added with ``add_param_group``,
    beside plain AdamW; compare after every step and look at where the state lives.  The verdict
    is noted for ``measure_sharded_memory``, which refuses a class rejected here."""
    require_callable(ShardedOptimizer, "the class ShardedOptimizer(params, optimizer_cls, **kwargs)")
    try:
        _check(ShardedOptimizer, timeout)
    except CheckFailed as e:
        note_sharded_verdict(ShardedOptimizer, str(e) or "failed")
        raise
    note_sharded_verdict(ShardedOptimizer, "")


def _check(ShardedOptimizer: Any, timeout: float) -> None:
    outcomes = run_workers(
        _worker, WORLD, args=(ShardedOptimizer,), timeout=timeout,
        hang_hint=("the ranks disagree on who owns a parameter, or a rank skips a broadcast. Usual "
                   "mistake: " + _hint("owner_skips_broadcast")),
        error_hint=_hint("generator_read_twice"))
    per_rank = [o.data["cases"] for o in judge(outcomes, world=WORLD)]
    for i in range(len(per_rank[0])):
        _judge_case([r[i] for r in per_rank])
    c = per_rank[0][0]
    print(f"ShardedOptimizer equals AdamW over {STEPS} steps on {WORLD} ranks (course model, tied "
          f"weights, two parameter groups); on the course model rank 0 holds "
          f"{c['bytes'] / 2**10:.0f} KiB of the {c['full_bytes'] / 2**10:.0f} KiB of AdamW state")


def _judge_case(ranks: list[dict]) -> None:
    name = ranks[0]["name"]
    for s in range(STEPS):
        a, b = ranks[0]["states"][s], ranks[1]["states"][s]
        if not close(a, b, atol=0.0):
            raise CheckFailed(f"{name}: after step {s + 1} rank 1's parameters differ from rank 0's:\n"
                              f"{format_table(diff_table(a, b), 0.0)}\nUsual mistake: {_hint('no_sync')}")
    for r in ranks:
        got, ref = r["states"], r["ref"]
        for s in range(STEPS):
            if close(ref[s], got[s], atol=ATOL):
                continue
            table = format_table(diff_table(ref[s], got[s]), ATOL)
            head = f"{name}, rank 0: after step {s + 1} the parameters differ from AdamW's:\n{table}\n"
            stale = [n for n in r["groups"] if close(got[s][n], r["init"][n], atol=0.0)]
            if stale and len(stale) == len(r["groups"]):
                raise CheckFailed(head + "The parameters of the group added with add_param_group() "
                                  f"were never updated. Usual mistake: {_hint('no_add_param_group')}")
            if close(r["no_kwargs"][s], got[s], atol=ATOL):
                raise CheckFailed(head + "They equal AdamW with default hyperparameters. Usual "
                                  f"mistake: {_hint('no_kwargs')}")
            raise CheckFailed(head + f"Usual mistake: {_hint('broadcast_from_rank0')}")
    held = [set(r["held"]) for r in ranks]
    n = len(ranks[0]["trainable"])
    both = held[0] & held[1]
    if both:
        raise CheckFailed(
            f"{name}: {len(both)} of {n} parameters have optimizer state on both ranks "
            f"({ranks[0]['bytes'] / 2**10:.0f} KiB on rank 0, as much as unsharded AdamW's "
            f"{ranks[0]['full_bytes'] / 2**10:.0f} KiB). The state is not sharded. Usual mistake: "
            + _hint("no_sharding"))
    missing = set(ranks[0]["trainable"]) - held[0] - held[1]
    if missing:
        raise CheckFailed(f"{name}: {len(missing)} of {n} parameters have optimizer state on no rank; "
                          "every parameter must be owned (and stepped) by exactly one rank.")
    for r in ranks:
        if r["leftover"]:
            raise CheckFailed(f"{name}: after zero_grad() {', '.join(r['leftover'][:3])} still hold "
                              "a gradient; zero_grad() must clear every parameter's, owned or not.")
