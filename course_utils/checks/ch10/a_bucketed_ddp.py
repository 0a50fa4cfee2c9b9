"""10.a: bucketed DDP, the class ``DDPBucketed`` of ``mini_ddp.py``.

``check_bucketed_ddp(DDPBucketed)`` runs the learner's class on 2 ranks beside torch DDP, three
models, three AdamW steps each, and a ``CollectiveSpy`` watches the communication itself: the size
of every all-reduce, when it starts (which gradients were ready by then), whether anything waits
during backward.

The misconceptions it recognises are ``CATALOGUE`` below (each key names the wrong class in
tests/checkers/test_ch10_checks.py).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...checking import (
    Catalogue,
    CheckFailed,
    CollectiveSpy,
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
from ...checking.fixtures import ddp_keeping_own_buffers
from ...data import make_dataset, make_model
from .common import ATOL, STEPS, WORLD, frozen_and_tied

__all__ = ["CATALOGUE", "check_bucketed_ddp"]

CATALOGUE = Catalogue(
    "10.a bucketed DDP",
    Misconception(
        "no_broadcast", "the ranks build the same model anyway",
        "right after construction a rank's parameters or buffers differ from rank 0's",
        "no broadcast of rank 0's parameters and buffers in __init__ (dist.broadcast(t, src=0) "
        "for each)."),
    Misconception(
        "no_reset", "a bucket's count of ready gradients starts at zero",
        "from the second step on, fewer all-reduce calls than in the first",
        "the count of ready gradients per bucket is not reset after a step, so from the second "
        "backward on no bucket looks complete. Reset it in finish_gradient_synchronization() (or in "
        "on_train_batch_start())."),
    Misconception(
        "start_in_finish", "the buckets are what matters, not when they start",
        "every all-reduce starts in finish_gradient_synchronization()",
        "no all-reduce started during backward; they all start in finish_gradient_synchronization(), "
        "so communication cannot overlap backward. Start each bucket's all-reduce from the hook of "
        "its last ready gradient."),
    Misconception(
        "wait_in_hook", "the hook is where a bucket is complete, so finish it there",
        "a wait, or a blocking all-reduce, during backward",
        "during backward your hook waited for communication (work.wait() or a blocking all_reduce), "
        "so backward stalls at every bucket: no overlap. Use dist.all_reduce(flat, async_op=True), "
        "keep the handle, and wait in finish_gradient_synchronization()."),
    Misconception(
        "no_wait", "an asynchronous all-reduce is done once it has started",
        "a handle of an asynchronous all-reduce was never waited for by the end of "
        "finish_gradient_synchronization()",
        "finish_gradient_synchronization() did not wait for the handles of the asynchronous "
        "all-reduces, so it read the flat tensors while the all-reduce may still have been writing "
        "them (an async call returns before its work is done). Call work.wait() on every handle "
        "before you divide and copy back."),
    Misconception(
        "start_at_first", "a bucket can start when its first gradient is ready",
        "an all-reduce starts with more elements sent than gradient elements ready",
        "a bucket was all-reduced before all of its gradients were ready (its other gradients are "
        "missing or stale). Start a bucket only when its count of ready gradients equals its number "
        "of parameters."),
    Misconception(
        "forward_order", "buckets follow the order of module.parameters()",
        "the all-reduce sizes are those of buckets filled front to back",
        "the buckets were filled in forward order (first layer first). Backward produces the last "
        "layer's gradients first, so walk module.parameters() in reverse: then the first bucket is "
        "complete first and its all-reduce starts early."),
    Misconception(
        "per_param", "one all-reduce per gradient is as good as buckets",
        "as many all-reduces as trainable parameters",
        "one all-reduce per parameter: group the gradients into buckets of up to bucket_size_mb "
        "and all-reduce each bucket as one flat tensor."),
    Misconception(
        "no_average", "all-reduce averages",
        "the gradients are world-size times torch DDP's",
        "summed over the ranks but not divided by the world size. DDP averages."),
    Misconception(
        "no_copy_back", "the flat tensor is the gradients",
        "every .grad is still this rank's own gradient after finish_gradient_synchronization()",
        "the flat tensor was all-reduced and averaged, but never copied back into the parameters' "
        ".grad (torch.cat makes a copy)."),
)
_hint = CATALOGUE.hint


def _equal_layers(seed: int) -> torch.nn.Module:
    """Three equal hidden layers: grouping them front to back or back to front differs."""
    with torch.random.fork_rng(devices=[]):  # built on CPU: no GPU's generator is touched
        torch.manual_seed(seed)
        gelu = torch.nn.GELU
        return torch.nn.Sequential(torch.nn.Linear(32, 64), gelu(), torch.nn.Linear(64, 64), gelu(),
                                   torch.nn.Linear(64, 64), gelu(), torch.nn.Linear(64, 64))


def _cases(rank: int) -> list[tuple[str, torch.nn.Module, float]]:
    """(name, this rank's model (different on each rank), bucket cap in MiB)."""
    course = make_model(seed=500 + rank, norm=True)
    with torch.no_grad():
        course.net[1].running_mean.fill_(0.1 * rank)  # a buffer rank 0 must broadcast
    return [("course model (BatchNorm), 0.05 MiB buckets", course, 0.05),
            ("three equal layers, 0.035 MiB buckets", _equal_layers(510 + rank), 0.035),
            ("frozen + tied parameters, 0.02 MiB buckets", frozen_and_tied(520 + rank), 0.02)]


def _batches(steps: int, per_rank: int, rank: int, world: int) -> list:
    x, y = make_dataset(per_rank * world * steps, seed=10).tensors
    return [(x[s * per_rank * world:(s + 1) * per_rank * world][rank::world],
             y[s * per_rank * world:(s + 1) * per_rank * world][rank::world]) for s in range(steps)]


def _buckets(params: list[torch.Tensor], cap_bytes: float) -> list[list[int]]:
    """Indices of ``params`` grouped greedily, in the given order, into buckets of at most the cap."""
    out: list[list[int]] = []
    size = math.inf
    for i, p in enumerate(params):
        nbytes = p.numel() * p.element_size()
        if size + nbytes > cap_bytes:
            out.append([])
            size = 0
        out[-1].append(i)
        size += nbytes
    return out


def _issue_order(buckets: list[list[int]], ready: list[int], numel: list[int]) -> list[int]:
    """The sizes (elements) of ``buckets`` in the order their last gradient became ready."""
    done_at = {tuple(b): max(ready.index(i) for i in b) for b in buckets}
    return [sum(numel[i] for i in b) for b in sorted(buckets, key=lambda b: done_at[tuple(b)])]


class _Ready:
    """The trainable gradients that are ready, in order, from hooks that run before the learner's
    (they are registered first); ``annotate`` notes how many elements were ready at each all-reduce."""

    def __init__(self) -> None:
        self.order: list[int] = []
        self.numel: list[int] = []

    def watch(self, params: list[torch.Tensor]) -> None:
        self.numel = [p.numel() for p in params]
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(lambda _p, i=i: self.order.append(i))

    def annotate(self, op: str, tensor: torch.Tensor | None) -> dict:
        return {"ready": sum(self.numel[i] for i in self.order)}


def _ddp_reference(init: torch.nn.Module, batches: list) -> tuple[list[dict], dict]:
    """Torch DDP with AdamW: the gradients of each step and the final parameters."""
    ddp = ddp_keeping_own_buffers(copy.deepcopy(init), torch.device("cpu"))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)
    grads = []
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        grads.append({n: p.grad.clone() for n, p in ddp.module.named_parameters() if p.grad is not None})
        opt.step()
    return grads, {n: p.detach().clone() for n, p in ddp.module.named_parameters()}


def _ratio(ref: dict, got: dict) -> float:
    num = sum(float(got[n].double().norm() ** 2) for n in ref if n in got)
    den = sum(float(ref[n].double().norm() ** 2) for n in ref if n in got)
    return math.sqrt(num / den) if den else float("nan")


def _run_case(cls: Any, name: str, init: torch.nn.Module, cap: float, rank: int,
              spy: CollectiveSpy, ready: _Ready) -> tuple[dict, str]:
    batches = _batches(STEPS, 16, rank, WORLD)
    with spy.paused():
        ref_grads, ref_final = _ddp_reference(init, batches)
    mine = copy.deepcopy(init)
    trainable = [p for p in mine.parameters() if p.requires_grad]
    ready.watch(trainable)
    wrapped = cls(mine, cap)
    if getattr(wrapped, "module", None) is not mine:
        return {}, (f"{name}: the wrapper's .module is not the module it wraps; store it as "
                    "self.module = module, as torch DDP does.")
    rank0 = {n: t.detach().clone() for n, t in mine.state_dict().items()}
    with spy.paused():
        dist.broadcast_object_list(box := [rank0], src=0)
    construct = diff_table(box[0], mine.state_dict())
    opt = torch.optim.AdamW(mine.parameters(), lr=1e-2, weight_decay=0.1)
    steps = []
    for s, (x, y) in enumerate(batches):
        opt.zero_grad(set_to_none=s % 2 == 0)  # odd steps zero .grad in place
        spy.clear()
        spy.step = s
        ready.order = []
        if hasattr(wrapped, "on_train_batch_start"):
            wrapped.on_train_batch_start()
        loss = F.cross_entropy(wrapped(x), y)
        spy.phase = "backward"
        try:
            loss.backward()
            local = {n: p.grad.clone() for n, p in mine.named_parameters() if p.grad is not None}
            spy.phase = "finish"
            wrapped.finish_gradient_synchronization()
        finally:
            spy.phase = None
        grads = {n: p.grad.clone() for n, p in mine.named_parameters() if p.grad is not None}
        watched = [c for c in spy.calls if c.phase is not None]
        steps.append({
            "reduces": [{"phase": c.phase, "async": c.async_op, "numel": c.tensor.numel(),
                         "ready": c.extra["ready"]} for c in watched],
            "waited_in_backward": any(c.waited_in_phase == "backward" for c in watched),
            "unwaited": sum(c.async_op and not c.waited_during(s) for c in watched),
            "ready": list(ready.order), "grads": diff_table(ref_grads[s], grads),
            "unchanged": close(local, grads, atol=0.0) and not close(local, ref_grads[s]),
            "ratio": _ratio(ref_grads[s], grads)})
        opt.step()
    numel = [p.numel() for p in trainable]
    cap_bytes = cap * 2**20
    rev = [len(trainable) - 1 - i for i in range(len(trainable))]
    back = [[rev[i] for i in b] for b in _buckets([trainable[i] for i in rev], cap_bytes)]
    first_ready = steps[0]["ready"]
    return {"name": name, "construct": construct, "steps": steps, "n_params": len(trainable),
            "cap": cap_bytes, "expected": _issue_order(back, first_ready, numel),
            "forward": _issue_order(_buckets(trainable, cap_bytes), first_ready, numel),
            "final": diff_table(ref_final, dict(mine.named_parameters()))}, ""


def _worker(cls: Any) -> Outcome:
    ready = _Ready()
    with process_group("gloo") as pg, CollectiveSpy(("all_reduce",), annotate=ready.annotate) as spy:
        cases = []
        for name, init, cap in _cases(pg.rank):
            case, problem = _run_case(cls, name, init, cap, pg.rank, spy, ready)
            if problem:
                return Outcome(pg.rank, problem)
            cases.append(case)
            dist.barrier()
        return Outcome(pg.rank, data={"cases": cases})


def _ok(rows: list, atol: float = ATOL) -> bool:
    return all(d <= atol for _, d, _ in rows)


@checker("10.a bucketed DDP")
def check_bucketed_ddp(DDPBucketed: Any, *, timeout: float = 120.0) -> None:
    """Run ``DDPBucketed(module, bucket_size_mb)`` on 2 ranks beside torch DDP.

    Three models (the course model with BatchNorm; three equal layers, where front-to-back and
    back-to-front buckets differ; a frozen layer, a layer used twice and a tied weight), three AdamW
    steps each, ``zero_grad`` alternately to None and in place.  Every all-reduce is watched: its
    size, whether it starts during backward, what was ready by then, and whether anything waits.
    """
    require_callable(DDPBucketed, "the class DDPBucketed(module, bucket_size_mb)")
    outcomes = run_workers(
        _worker, WORLD, args=(DDPBucketed,), timeout=timeout,
        hang_hint=("a bucket that never completes (a frozen parameter counted in a bucket, or a "
                   "counter never reset), so some rank waits for an all-reduce the other never starts."),
        error_hint=("a hook on a parameter with requires_grad=False (skip those), .grad read on a "
                    "parameter whose gradient is not ready yet (None), or handles kept from an "
                    "earlier step."))
    outcomes = judge(outcomes, world=WORLD)
    for o in outcomes:  # every rank's start first: a rank that skipped the broadcast is the cause
        for case in o.data["cases"]:
            _judge_construction(o.rank, case)
    for o in outcomes:
        for case in o.data["cases"]:
            _judge_case(o.rank, case)
    print(f"DDPBucketed matches torch DDP on {WORLD} ranks over {STEPS} AdamW steps on three models, "
          "with one all-reduce per bucket, started during backward once the bucket is complete")


def _judge_construction(rank: int, case: dict) -> None:
    if not _ok(case["construct"]):
        bad = [n for n, d, _ in case["construct"] if d > ATOL]
        raise CheckFailed(f"{case['name']}, rank {rank}: right after construction {', '.join(bad[:4])} "
                          f"differ from rank 0's:\n{format_table(case['construct'], ATOL)}\nUsual "
                          f"mistake: {_hint('no_broadcast')}")


def _judge_case(rank: int, case: dict) -> None:
    where = f"{case['name']}, rank {rank}"
    calls0 = None
    for s, step in enumerate(case["steps"]):
        at = f"{where}, step {s + 1}"
        reduces = step["reduces"]
        in_bw = [e for e in reduces if e["phase"] == "backward"]
        if calls0 is None:
            calls0 = len(reduces)
        if s and len(reduces) < calls0:
            raise CheckFailed(f"{where}: step {s + 1} made {len(reduces)} all-reduce call(s), step 1 "
                              f"made {calls0}. Usual mistake: {_hint('no_reset')}")
        if not reduces:
            raise CheckFailed(f"{where}: step {s + 1} made no all-reduce at all: the gradients were "
                              "never averaged across ranks.")
        if not in_bw:
            raise CheckFailed(f"{where}: {_hint('start_in_finish')}")
        if step["waited_in_backward"] or any(not e["async"] for e in in_bw):
            raise CheckFailed(f"{where}: {_hint('wait_in_hook')}")
        if step["unwaited"]:
            raise CheckFailed(f"{at}: {step['unwaited']} of {sum(e['async'] for e in reduces)} "
                              f"asynchronous all-reduces were never waited for: {_hint('no_wait')}")
        sent = 0
        for e in in_bw:
            sent += e["numel"]
            if sent > e["ready"]:
                raise CheckFailed(
                    f"{at}: an all-reduce of {e['numel']} elements started when only {e['ready']} "
                    f"gradient elements were ready and {sent} had been sent in all: "
                    + _hint("start_at_first"))
        sizes = [e["numel"] for e in reduces]
        if sizes != case["expected"]:
            if sizes == case["forward"] and case["forward"] != case["expected"]:
                why = _hint("forward_order")
            elif len(sizes) == case["n_params"]:
                why = _hint("per_param")
            else:
                why = ("buckets of at most bucket_size_mb * 2**20 bytes (numel() * element_size() "
                       "per parameter), filled in reverse order of module.parameters(); a parameter "
                       "larger than the cap gets its own bucket; frozen parameters in none.")
            raise CheckFailed(
                f"{at}: all-reduce sizes (elements, in the order they started) {sizes}; expected "
                f"{case['expected']} for a cap of {case['cap'] / 2**20:g} MiB.\nUsual mistake: {why}")
        if not _ok(step["grads"]):
            table = format_table(step["grads"], ATOL)
            if abs(step["ratio"] - WORLD) < 1e-3 * WORLD:
                raise CheckFailed(f"{at}: the gradients are {WORLD} times torch DDP's:\n{table}\n"
                                  f"Usual mistake: {_hint('no_average')}")
            if step["unchanged"]:
                raise CheckFailed(f"{at}: finish_gradient_synchronization() left every .grad as this "
                                  f"rank's own gradient:\n{table}\nUsual mistake: {_hint('no_copy_back')}")
            raise CheckFailed(f"{at}: the gradients after finish_gradient_synchronization() differ "
                              f"from torch DDP's:\n{table}")
    if not _ok(case["final"]):
        raise CheckFailed(f"{where}: after {STEPS} AdamW steps the parameters differ from torch DDP's:\n"
                          f"{format_table(case['final'], ATOL)}")
