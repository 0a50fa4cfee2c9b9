"""Checkers of chapter 07: gradient accumulation with ``no_sync``, and the scaled learning rate."""

from __future__ import annotations

import gc
import math
import traceback
from typing import Any

import torch

from ..checking import CheckFailed, checker, diff_table, format_table, require_callable

__all__ = ["check_accumulation_step", "check_scaled_lr"]

# The set-up every run of 07.a uses: 2 ranks, 4 micro-batches of 8 per rank, 2 optimizer steps.
WORLD, K, MICRO, STEPS, LR = 2, 4, 8, 2, 0.1
ATOL = 1e-5


def _micro_batches(step: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s k micro-batches for optimizer step ``step`` (the same data everywhere)."""
    from ..data import make_dataset

    X, Y = make_dataset(256, seed=7).tensors
    B = MICRO * WORLD * K
    idx = torch.arange(step * B, (step + 1) * B).view(K, WORLD, MICRO)[:, rank]
    return [(X[i], Y[i]) for i in idx]


def _full_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    from ..data import make_dataset

    X, Y = make_dataset(256, seed=7).tensors
    B = MICRO * WORLD * K
    return X[step * B:(step + 1) * B], Y[step * B:(step + 1) * B]


def _as_float(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach().cpu())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return ("not a number", type(value).__name__)


def _accumulation_worker(fn) -> dict:
    """Runs on every rank: the learner's step on a DDP model, with all-reduces counted."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ..data import make_model
    from ..devices import backend_and_device

    backend, device = backend_and_device(announce=False)
    dist.init_process_group(backend)
    rank = dist.get_rank()
    ids = [device.index] if device.type == "cuda" else None
    calls = [0]

    def counting(_state, bucket):  # no annotations: DDP would compare them as strings here
        calls[0] += 1
        return allreduce_hook(None, bucket)

    out: dict = {"rank": rank, "steps": []}
    model = probe = None
    try:
        # How many all-reduces one synchronised backward pass makes (one per bucket).
        probe = DDP(make_model(0).to(device), device_ids=ids)
        probe.register_comm_hook(None, counting)
        x, y = _micro_batches(0, rank)[0]
        torch.nn.functional.cross_entropy(probe(x.to(device)), y.to(device)).backward()
        out["buckets"], calls[0] = calls[0], 0

        model = DDP(make_model(0).to(device), device_ids=ids)
        model.register_comm_hook(None, counting)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        opt_steps = [0]
        real_step = opt.step

        def counted_step(*args, **kwargs):
            opt_steps[0] += 1
            return real_step(*args, **kwargs)

        opt.step = counted_step
        for s in range(STEPS):
            batches = [(x.to(device), y.to(device)) for x, y in _micro_batches(s, rank)]
            c0, o0 = calls[0], opt_steps[0]
            try:
                ret = fn(model, opt, batches)
            except NotImplementedError as e:  # the stub: reported as "not done" by the checker
                out["not_done"] = str(e)
                break
            except Exception as e:  # report it with the step and rank, without killing the others
                out["error"] = (s, type(e).__name__, str(e), traceback.format_exc(limit=-3))
                break
            out["steps"].append({
                "calls": calls[0] - c0,
                "opt_steps": opt_steps[0] - o0,
                "returned": _as_float(ret),
                "params": {n: p.detach().cpu().clone() for n, p in model.module.named_parameters()},
            })
    finally:
        # Free every DDP model before its process group: a DDP model that outlives the group
        # can hang or abort the worker when it is freed (torch 2.13, gloo).
        model = probe = opt = None
        gc.collect()  # in case a reference cycle still holds one
        dist.destroy_process_group()
    return out


def _reference(variant: str = "correct") -> tuple[list[dict], list[list[float]]]:
    """Parameters after each step of plain SGD on the full batch, and each rank's mean loss.

    ``variant`` reproduces a typical mistake, to recognise it: ``undivided`` (gradients k times
    too large), ``no_zero_grad`` (gradients of earlier steps kept).
    """
    from ..data import make_model

    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    states, losses = [], []
    for s in range(STEPS):
        with torch.no_grad():
            losses.append([
                sum(torch.nn.functional.cross_entropy(model(x), y).item()
                    for x, y in _micro_batches(s, r)) / K
                for r in range(WORLD)
            ])
        x, y = _full_batch(s)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        (loss * K if variant == "undivided" else loss).backward()
        opt.step()
        if variant != "no_zero_grad":
            opt.zero_grad()
        states.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return states, losses


def _close(a: dict, b: dict, atol: float = ATOL) -> bool:
    return max((d for _, d, _ in diff_table(a, b)), default=0.0) <= atol


@checker("07.a accumulation with no_sync")
def check_accumulation_step(fn, *, timeout: float = 90) -> None:
    """Run ``fn(model, optimizer, micro_batches)`` on 2 ranks for 2 optimizer steps.

    ``model`` is a DDP model, ``optimizer`` plain SGD (lr 0.1), ``micro_batches`` 4 pairs
    ``(x, y)`` of 8 samples per rank.  The parameters after each step must equal one SGD step of a
    single process on all 64 samples, with one all-reduce per bucket per optimizer step.
    """
    require_callable(fn, "a function accumulate_and_step(model, optimizer, micro_batches)")
    from ..workers.supervisor import launch

    results = launch(_accumulation_worker, nprocs=WORLD, args=(fn,), timeout=timeout,
                     display=None)
    for r in results:
        if "not_done" in r:
            raise NotImplementedError(r["not_done"])
    for r in results:
        if "error" in r:
            s, etype, msg, tb = r["error"]
            hint = ""
            if "unexpected keyword" in msg or "positional argument" in msg:
                hint = ("\nThe checker calls fn(model, optimizer, micro_batches) with a DDP model, "
                        "an SGD optimizer and a list of (x, y) pairs.")
            raise CheckFailed(f"on rank {r['rank']}, optimizer step {s + 1}: your function raised "
                              f"{etype}: {msg}{hint}\n{tb}")
    buckets = results[0]["buckets"]
    for r in results:
        for s, st in enumerate(r["steps"]):
            if st["opt_steps"] != 1:
                raise CheckFailed(
                    f"on rank {r['rank']}, call {s + 1}: optimizer.step() ran {st['opt_steps']} "
                    f"time(s) for {K} micro-batches; expected exactly 1.\nUsual mistake: "
                    + ("stepping inside the micro-batch loop; step once, after the last backward."
                       if st["opt_steps"] > 1 else "forgetting optimizer.step() after the loop."))
    for r in results:
        for s, st in enumerate(r["steps"]):
            got, want = st["calls"], buckets
            if got == want:
                continue
            if got == 0:
                why = ("no gradient was ever all-reduced: the last micro-step ran inside "
                       "model.no_sync() too, so every rank stepped with its own gradients. Run the "
                       "last backward outside no_sync.")
            elif got == K * want:
                why = ("DDP all-reduced after every micro-batch: wrap every backward but the "
                       "last in `with model.no_sync():`.")
            else:
                why = ("use no_sync for micro-steps 1..k-1 and a normal backward for the last one.")
            raise CheckFailed(
                f"on rank {r['rank']}, optimizer step {s + 1}: expected {want} all-reduce call(s) "
                f"(one per gradient bucket, once per optimizer step), got {got} for {K} "
                f"micro-batches.\nUsual mistake: {why}")
    correct, losses = _reference()
    for s in range(STEPS):
        p0, p1 = results[0]["steps"][s]["params"], results[1]["steps"][s]["params"]
        if not _close(p0, p1, 0.0):
            raise CheckFailed(
                f"after optimizer step {s + 1} rank 1's parameters differ from rank 0's:\n"
                f"{format_table(diff_table(p0, p1), 0.0)}\nUsual mistake: the gradients were not "
                "averaged across ranks before the step.")
    for s in range(STEPS):
        got = results[0]["steps"][s]["params"]
        if _close(correct[s], got):
            continue
        table = format_table(diff_table(correct[s], got), ATOL)
        head = (f"parameters after optimizer step {s + 1} (rank 0) differ from one SGD step on "
                f"the full batch of {MICRO * WORLD * K} samples:\n{table}\n")
        if s == 0 and _close(_reference("undivided")[0][0], got):
            raise CheckFailed(head + f"They match gradients {K} times too large. Usual mistake: "
                              "not dividing each micro-batch loss by the number of micro-batches "
                              "(loss / len(micro_batches)) before backward().")
        if s > 0 and _close(_reference("no_zero_grad")[0][s], got):
            raise CheckFailed(head + "They match an update that still contains the previous "
                              "step's gradients. Usual mistake: no optimizer.zero_grad() (after "
                              "the step, or before the first micro-batch).")
        raise CheckFailed(head + "Usual mistake: a micro-batch skipped or used twice, or the loss "
                          "scaled by something other than 1 / number of micro-batches.")
    for r in results:
        for s, st in enumerate(r["steps"]):
            got, want = st["returned"], losses[s][r["rank"]]
            if isinstance(got, tuple):
                raise CheckFailed(
                    f"on rank {r['rank']}, step {s + 1}: expected the mean loss over the "
                    f"micro-batches as a float, got {got[1]}"
                    + (" (a missing `return`?)" if got[1] == "NoneType" else ""))
            if not math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-6):
                ratio = got / want if want else float("nan")
                hint = (f"that is {K} times the mean: return the sum of the divided losses"
                        if math.isclose(ratio, K, rel_tol=1e-3) else
                        "return the mean of the micro-batch losses (the sum of loss / k), "
                        "as a Python float (loss.item())")
                raise CheckFailed(f"on rank {r['rank']}, step {s + 1}: returned loss {got:.6g}, "
                                  f"expected the mean over the micro-batches {want:.6g}; {hint}.")


def _scaled_lr_reference(step, *, base_lr, base_batch, per_rank_batch, world_size, accum_steps,
                         warmup_steps, ranks=True, accum=True, warm_from=None, warm=True,
                         stop=True):
    """The right schedule; the switches reproduce the usual mistakes, to recognise them."""
    B = per_rank_batch * (world_size if ranks else 1) * (accum_steps if accum else 1)
    peak = base_lr * B / base_batch
    if warm and warmup_steps and (step < warmup_steps or not stop):
        start = base_lr if warm_from is None else warm_from
        return start + (peak - start) * step / warmup_steps
    return peak


# (switches, usual mistake): checked in this order when the answer is wrong.
_LR_MISTAKES = [
    (dict(ranks=False), "the effective batch leaves out the number of ranks "
                        "(B = per_rank_batch x world_size x accum_steps)."),
    (dict(accum=False), "the effective batch leaves out the accumulation steps "
                        "(B = per_rank_batch x world_size x accum_steps)."),
    (dict(warm_from=0.0), "a warm-up that starts from 0, so the first step does nothing; "
                          "start at base_lr and climb to the peak."),
    (dict(warm=False), "no warm-up: during the first warmup_steps steps the rate climbs "
                       "linearly from base_lr to the peak."),
    (dict(stop=False), "the warm-up keeps climbing after warmup_steps; from then on the rate "
                       "stays at the peak."),
]


_LR_CASES = [
    dict(base_lr=0.1, base_batch=256, per_rank_batch=32, world_size=8, accum_steps=4, warmup_steps=10),
    dict(base_lr=0.05, base_batch=32, per_rank_batch=16, world_size=2, accum_steps=8, warmup_steps=8),
    dict(base_lr=0.2, base_batch=64, per_rank_batch=64, world_size=3, accum_steps=1, warmup_steps=0),
]


@checker("07.b scaled learning rate")
def check_scaled_lr(fn) -> None:
    """``fn(step, *, base_lr, base_batch, per_rank_batch, world_size, accum_steps, warmup_steps)``
    must follow the linear scaling rule with a warm-up that starts at ``base_lr``."""
    require_callable(fn, "a function scaled_lr(step, *, base_lr, base_batch, per_rank_batch, "
                         "world_size, accum_steps, warmup_steps)")
    for case in _LR_CASES:
        last = case["warmup_steps"] + 3
        for step in sorted({0, 1, case["warmup_steps"] // 2, case["warmup_steps"], last}):
            want = _scaled_lr_reference(step, **case)
            try:
                got = fn(step, **case)
            except ZeroDivisionError:
                raise CheckFailed(f"scaled_lr({step}, {case}) divided by zero. Usual mistake: "
                                  "warmup_steps=0 must mean no warm-up (the peak rate at once)."
                                  ) from None
            if got is None:
                raise CheckFailed(f"scaled_lr({step}, ...) returned None (a missing `return`?)")
            if isinstance(got, torch.Tensor) and got.numel() == 1:
                got = float(got)
            if not isinstance(got, (int, float)) or isinstance(got, bool):
                raise CheckFailed(f"scaled_lr({step}, ...) should return a number, got "
                                  f"{type(got).__name__}")
            if math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12):
                continue
            peak = _scaled_lr_reference(10**9, **case)
            msg = f"scaled_lr({step}, {case}) = {got:.6g}, expected {want:.6g} (peak {peak:.6g})."
            for switches, mistake in _LR_MISTAKES:
                wrong = _scaled_lr_reference(step, **case, **switches)
                if not math.isclose(wrong, want, rel_tol=1e-9) and math.isclose(got, wrong, rel_tol=1e-9):
                    raise CheckFailed(f"{msg} Usual mistake: {mistake}")
            raise CheckFailed(msg + " Peak = base_lr x B / base_batch; during warm-up "
                              "base_lr + (peak - base_lr) x step / warmup_steps.")
