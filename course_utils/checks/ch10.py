"""Checkers of chapter 10 (beyond DDP): bucketed DDP, a sharded optimizer, the α-β cost model.

- ``check_bucketed_ddp(DDPBucketed)`` (10.a) runs the learner's class of ``mini_ddp.py`` on 2 ranks
  beside torch DDP, three models, three AdamW steps each, and watches the communication itself: the
  size of every all-reduce, when it starts (which gradients were ready by then), whether anything
  waits during backward.
- ``check_sharded_optimizer(ShardedOptimizer)`` (10.b) steps the learner's ZeRO-1 optimizer and
  plain AdamW side by side on 2 ranks, and looks at where the optimizer state lives.
- ``check_comm_prediction(predict)`` (10.c) checks the learner's α-β prediction on made-up numbers,
  then against all-reduces timed on this machine.

Beside the checks, two measurements of the learner's classes (they judge speed and memory, not
correctness, and print their verdict instead of passing or failing):

- ``compare_bucketed_speed(DDPBucketed, DDPIndividualParameters)`` times both against torch DDP on
  the course model (steps per second over repeats, all-reduce calls per step);
- ``measure_sharded_memory(ShardedOptimizer)`` adds up the optimizer state on each rank, against
  plain AdamW and the ideal 1/N.

Each checker's docstring and the ``MISCONCEPTIONS`` table below list the mistakes it recognises;
``tests/checkers/test_ch10_*.py`` gives each one to the checker, written as a learner would write it.
"""

from __future__ import annotations

import copy
import gc
import inspect
import math
import statistics
import textwrap
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from ..checking import (
    CheckFailed,
    Outcome,
    checker,
    close,
    diff_table,
    first_problem,
    format_table,
    require_callable,
    run_workers,
)
from ..data import make_dataset, make_model
from ..devices import backend_and_device, process_group_kwargs

__all__ = ["check_bucketed_ddp", "check_sharded_optimizer", "check_comm_prediction", "measured_rounds",
           "MISCONCEPTIONS", "ring_factor", "fit_alpha_beta", "allreduce_seconds", "compare_bucketed_speed",
           "speed_verdict", "measure_sharded_memory"]

# What learners really get wrong, per exercise; each entry is recognised by the checker and has a test.
MISCONCEPTIONS = {
    "10.a bucketed DDP": [
        "all-reduce started in finish_gradient_synchronization() only (no overlap with backward)",
        "waiting on each handle inside the hook, or a blocking all_reduce (no overlap)",
        "a bucket all-reduced before all of its gradients were ready",
        "buckets built in forward order (the first bucket is then ready last)",
        "one all-reduce per parameter, or buckets larger than the cap",
        "ready-counters not reset between steps (no all-reduce from the second step on)",
        "gradients summed but not divided by the world size",
        "the averaged flat tensor never copied back into .grad",
        "no broadcast of rank 0's parameters and buffers at construction",
    ],
    "10.b sharded optimizer": [
        "every rank keeps the state of every parameter (nothing sharded)",
        "parameters not brought up to date after the step (no broadcast)",
        "every parameter broadcast from rank 0 instead of from its owner",
        "add_param_group() not sharded: a group added later is never stepped",
        "params given as a generator read twice (the second read is empty)",
        "optimizer keyword arguments (weight_decay, betas...) not passed to the inner optimizer",
    ],
    "10.c cost-model prediction": [
        "the ring factor 2(N-1)/N left out, or (N-1)/N used (that is one reduce-scatter only)",
        "the latency α counted once per step instead of once per bucket",
        "bits and bytes mixed (a factor of 8)",
        "milliseconds returned instead of seconds",
    ],
}

WORLD = 2
STEPS = 3
ATOL = 1e-5


# --------------------------------------------------------------------------------------------
# Models and data (they run in the workers)
# --------------------------------------------------------------------------------------------


class TiedAndFrozen(torch.nn.Module):
    """A frozen layer, a layer applied twice, and a weight tied between two layers."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            self.embed = torch.nn.Linear(32, 64)
            self.frozen = torch.nn.Linear(64, 64).requires_grad_(False)
            self.block = torch.nn.Linear(64, 64)
            self.tied = torch.nn.Linear(64, 64)
            self.tied.weight = self.block.weight  # one Parameter in two layers
            self.head = torch.nn.Linear(64, 10)
        finally:
            torch.random.set_rng_state(g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gelu = torch.nn.functional.gelu
        h = gelu(self.frozen(gelu(self.embed(x))))
        h = gelu(self.block(gelu(self.block(h))))  # the same layer twice
        return self.head(gelu(self.tied(h)))


def _equal_layers(seed: int) -> torch.nn.Module:
    """Three equal hidden layers: grouping them front to back or back to front differs."""
    g = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        gelu = torch.nn.GELU
        return torch.nn.Sequential(torch.nn.Linear(32, 64), gelu(), torch.nn.Linear(64, 64), gelu(),
                                   torch.nn.Linear(64, 64), gelu(), torch.nn.Linear(64, 64))
    finally:
        torch.random.set_rng_state(g)


def _a_cases(rank: int) -> list[tuple[str, torch.nn.Module, float]]:
    """(name, this rank's model (different on each rank), bucket cap in MiB)."""

    course = make_model(seed=500 + rank, norm=True)
    with torch.no_grad():
        course.net[1].running_mean.fill_(0.1 * rank)  # a buffer rank 0 must broadcast
    return [("course model (BatchNorm), 0.05 MiB buckets", course, 0.05),
            ("three equal layers, 0.035 MiB buckets", _equal_layers(510 + rank), 0.035),
            ("frozen + tied parameters, 0.02 MiB buckets", TiedAndFrozen(520 + rank), 0.02)]


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


# --------------------------------------------------------------------------------------------
# Watching the learner's communication
# --------------------------------------------------------------------------------------------


class _Spy:
    """Records every dist.all_reduce during a step: its size, async or not, what was ready then."""

    def __init__(self) -> None:
        self.phase: str | None = None
        self.events: list[dict] = []
        self.ready: list[int] = []  # indices of parameters whose gradient is ready, in order
        self.numel: list[int] = []

    def watch(self, params: list[torch.Tensor]) -> None:
        """Hooks on ``params`` that run before the learner's (they are registered first)."""
        self.numel = [p.numel() for p in params]
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(lambda _p, i=i: self.ready.append(i))

    def install(self) -> None:

        real, spy = c10d.all_reduce, self

        class WatchedWork:
            def __init__(self, work: Any):
                self._work = work

            def wait(self, *args: Any, **kwargs: Any) -> Any:
                if spy.phase is not None:
                    spy.events.append({"kind": "wait", "phase": spy.phase})
                return self._work.wait(*args, **kwargs)

            def __getattr__(self, name: str) -> Any:
                return getattr(self._work, name)

        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            if spy.phase is not None:
                spy.events.append({"kind": "all_reduce", "phase": spy.phase, "async": bool(async_op),
                                   "numel": tensor.numel(),
                                   "ready": sum(spy.numel[i] for i in spy.ready)})
            work = real(tensor, op=op, group=group, async_op=async_op)
            return WatchedWork(work) if async_op and work is not None else work

        dist.all_reduce = all_reduce
        c10d.all_reduce = all_reduce


# --------------------------------------------------------------------------------------------
# 10.a  DDPBucketed
# --------------------------------------------------------------------------------------------


def _ddp_reference(init: torch.nn.Module, batches: list) -> tuple[list[dict], dict]:
    """Torch DDP with AdamW: the gradients of each step and the final parameters."""

    flag = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters
            else "broadcast_buffers")
    ddp = DDP(copy.deepcopy(init), **{flag: False})
    if flag == "broadcast_buffers":  # older torch: False also skips the broadcast at construction
        for b in ddp.module.buffers():
            dist.broadcast(b, src=0)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)
    grads = []
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        grads.append({n: p.grad.clone() for n, p in ddp.module.named_parameters() if p.grad is not None})
        opt.step()
    final = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    del ddp, opt
    gc.collect()  # no DDP reducer may outlive the process group
    return grads, final


def _bucketed_worker(cls: Any) -> Outcome:

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    spy = _Spy()
    spy.install()
    cases = []
    try:
        for name, init, cap in _a_cases(rank):
            batches = _batches(STEPS, 16, rank, WORLD)
            ref_grads, ref_final = _ddp_reference(init, batches)
            mine = copy.deepcopy(init)
            trainable = [p for p in mine.parameters() if p.requires_grad]
            spy.watch(trainable)
            wrapped = cls(mine, cap)
            if getattr(wrapped, "module", None) is not mine:
                return Outcome(rank, f"{name}: the wrapper's .module is not the module it wraps; "
                                     "store it as self.module = module, as torch DDP does.")
            rank0 = {n: t.detach().clone() for n, t in mine.state_dict().items()}
            dist.broadcast_object_list(box := [rank0], src=0)
            construct = diff_table(box[0], mine.state_dict())
            opt = torch.optim.AdamW(mine.parameters(), lr=1e-2, weight_decay=0.1)
            steps = []
            for s, (x, y) in enumerate(batches):
                opt.zero_grad(set_to_none=s % 2 == 0)  # odd steps zero .grad in place
                spy.events, spy.ready = [], []
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
                steps.append({"events": spy.events, "ready": list(spy.ready),
                              "grads": diff_table(ref_grads[s], grads),
                              "unchanged": close(local, grads, atol=0.0) and not close(local, ref_grads[s]),
                              "ratio": _ratio(ref_grads[s], grads)})
                opt.step()
            names = [n for n, p in mine.named_parameters() if p.requires_grad]
            numel = [p.numel() for p in trainable]
            cap_bytes = cap * 2**20
            rev = [len(trainable) - 1 - i for i in range(len(trainable))]
            back = [[rev[i] for i in b] for b in _buckets([trainable[i] for i in rev], cap_bytes)]
            forward = _buckets(trainable, cap_bytes)
            ready = steps[0]["ready"]
            cases.append({"name": name, "construct": construct, "steps": steps, "names": names,
                          "n_params": len(trainable), "cap": cap_bytes,
                          "expected": _issue_order(back, ready, numel),
                          "forward": _issue_order(forward, ready, numel),
                          "final": diff_table(ref_final, dict(mine.named_parameters()))})
            del wrapped, opt
            dist.barrier()
    finally:
        gc.collect()
        dist.destroy_process_group()
    return Outcome(rank, data={"cases": cases})


def _ratio(ref: dict, got: dict) -> float:
    num = sum(float(got[n].double().norm() ** 2) for n in ref if n in got)
    den = sum(float(ref[n].double().norm() ** 2) for n in ref if n in got)
    return math.sqrt(num / den) if den else float("nan")


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
        _bucketed_worker, WORLD, args=(DDPBucketed,), timeout=timeout,
        hang_hint=("a bucket that never completes (a frozen parameter counted in a bucket, or a "
                   "counter never reset), so some rank waits for an all-reduce the other never starts."),
        error_hint=("a hook on a parameter with requires_grad=False (skip those), .grad read on a "
                    "parameter whose gradient is not ready yet (None), or handles kept from an "
                    "earlier step."))
    first_problem(outcomes)
    for o in outcomes:  # every rank's start first: a rank that skipped the broadcast is the cause
        for case in o.data["cases"]:
            _judge_construction(o.rank, case)
    for o in outcomes:
        for case in o.data["cases"]:
            _judge_bucketed(o.rank, case)
    print(f"DDPBucketed matches torch DDP on {WORLD} ranks over {STEPS} AdamW steps on three models, "
          "with one all-reduce per bucket, started during backward once the bucket is complete")


def _judge_construction(rank: int, case: dict) -> None:
    where = f"{case['name']}, rank {rank}"
    if not _ok(case["construct"]):
        bad = [n for n, d, _ in case["construct"] if d > ATOL]
        raise CheckFailed(f"{where}: right after construction {', '.join(bad[:4])} differ from "
                          f"rank 0's:\n{format_table(case['construct'], ATOL)}\nUsual mistake: no "
                          "broadcast of rank 0's parameters and buffers in __init__ "
                          "(dist.broadcast(t, src=0) for each).")


def _judge_bucketed(rank: int, case: dict) -> None:
    where = f"{case['name']}, rank {rank}"
    calls0 = None
    for s, step in enumerate(case["steps"]):
        reduces = [e for e in step["events"] if e["kind"] == "all_reduce"]
        in_bw = [e for e in reduces if e["phase"] == "backward"]
        if calls0 is None:
            calls0 = len(reduces)
        if s and len(reduces) < calls0:
            raise CheckFailed(
                f"{where}: step {s + 1} made {len(reduces)} all-reduce call(s), step 1 made {calls0}. "
                "Usual mistake: the count of ready gradients per bucket is not reset after a step, "
                "so from the second backward on no bucket looks complete. Reset it in "
                "finish_gradient_synchronization() (or in on_train_batch_start()).")
        if not reduces:
            raise CheckFailed(f"{where}: step {s + 1} made no all-reduce at all: the gradients were "
                              "never averaged across ranks.")
        if not in_bw:
            raise CheckFailed(
                f"{where}: no all-reduce started during backward; they all start in "
                "finish_gradient_synchronization(), so communication cannot overlap backward. "
                "Start each bucket's all-reduce from the hook of its last ready gradient.")
        waits = [e for e in step["events"] if e["phase"] == "backward"
                 and (e["kind"] == "wait" or (e["kind"] == "all_reduce" and not e["async"]))]
        if waits:
            raise CheckFailed(
                f"{where}: during backward your hook waited for communication (work.wait() or a "
                "blocking all_reduce), so backward stalls at every bucket: no overlap. Use "
                "dist.all_reduce(flat, async_op=True), keep the handle, and wait in "
                "finish_gradient_synchronization().")
        sent = 0
        for e in in_bw:
            sent += e["numel"]
            if sent > e["ready"]:
                raise CheckFailed(
                    f"{where}, step {s + 1}: an all-reduce of {e['numel']} elements started when "
                    f"only {e['ready']} gradient elements were ready and {sent} had been sent in all: "
                    "a bucket was all-reduced before all of its gradients were ready (its other "
                    "gradients are missing or stale). Start a bucket only when its count of ready "
                    "gradients equals its number of parameters.")
        sizes = [e["numel"] for e in reduces]
        if sizes != case["expected"]:
            if sizes == case["forward"] and case["forward"] != case["expected"]:
                why = ("the buckets were filled in forward order (first layer first). Backward "
                       "produces the last layer's gradients first, so walk module.parameters() in "
                       "reverse: then the first bucket is complete first and its all-reduce starts early.")
            elif len(sizes) == case["n_params"]:
                why = ("one all-reduce per parameter: group the gradients into buckets of up to "
                       "bucket_size_mb and all-reduce each bucket as one flat tensor.")
            else:
                why = ("buckets of at most bucket_size_mb * 2**20 bytes (numel() * element_size() "
                       "per parameter), filled in reverse order of module.parameters(); a parameter "
                       "larger than the cap gets its own bucket; frozen parameters in none.")
            raise CheckFailed(
                f"{where}, step {s + 1}: all-reduce sizes (elements, in the order they started) "
                f"{sizes}; expected {case['expected']} for a cap of {case['cap'] / 2**20:g} MiB.\n"
                f"Usual mistake: {why}")
        if not _ok(step["grads"]):
            table = format_table(step["grads"], ATOL)
            if abs(step["ratio"] - WORLD) < 1e-3 * WORLD:
                raise CheckFailed(f"{where}, step {s + 1}: the gradients are {WORLD} times torch "
                                  f"DDP's:\n{table}\nUsual mistake: summed over the ranks but not "
                                  "divided by the world size. DDP averages.")
            if step["unchanged"]:
                raise CheckFailed(
                    f"{where}, step {s + 1}: finish_gradient_synchronization() left every .grad as "
                    f"this rank's own gradient:\n{table}\nUsual mistake: the flat tensor was "
                    "all-reduced and averaged, but never copied back into the parameters' .grad "
                    "(torch.cat makes a copy).")
            raise CheckFailed(f"{where}, step {s + 1}: the gradients after "
                              f"finish_gradient_synchronization() differ from torch DDP's:\n{table}")
    if not _ok(case["final"]):
        raise CheckFailed(f"{where}: after {STEPS} AdamW steps the parameters differ from torch DDP's:\n"
                          f"{format_table(case['final'], ATOL)}")


# --------------------------------------------------------------------------------------------
# 10.b  ShardedOptimizer
# --------------------------------------------------------------------------------------------

_B_KW = {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.8, 0.95)}
_B_LR2 = 5e-3


def _b_cases() -> list[tuple[str, torch.nn.Module]]:

    return [("course model", make_model(seed=600)), ("tied weights", TiedAndFrozen(610))]


def _optimizers_in(obj: Any) -> list[torch.optim.Optimizer]:
    """``obj`` and every optimizer one attribute (or one list or dict) away from it."""
    found = [obj]
    for value in vars(obj).values():
        items = (value.values() if isinstance(value, dict)
                 else value if isinstance(value, (list, tuple)) else [value])
        found += [v for v in items if isinstance(v, torch.optim.Optimizer) and v is not obj]
    return found


def _state_of(opt: Any, params: list[torch.Tensor]) -> tuple[list[int], int]:
    """Indices of ``params`` with optimizer state on this rank, and the bytes of that state."""
    index = {id(p): i for i, p in enumerate(params)}
    held, nbytes = set(), 0
    for o in _optimizers_in(opt):
        for p, st in o.state.items():
            tensors = [t for t in st.values() if isinstance(t, torch.Tensor) and t.numel() > 1]
            if tensors and id(p) in index:
                held.add(index[id(p)])
                nbytes += sum(t.numel() * t.element_size() for t in tensors)
    return sorted(held), nbytes


def _adamw_variant(init: torch.nn.Module, x, y, k: int, **kw) -> list[dict]:
    model = copy.deepcopy(init)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params[:k], **kw)
    opt.add_param_group({"params": params[k:], "lr": _B_LR2})
    out = []
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def _sharded_worker(cls: Any) -> Outcome:


    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x, y = make_dataset(64, seed=11).tensors  # the same batch on every rank: equal gradients
    cases = []
    try:
        for name, init in _b_cases():
            model = copy.deepcopy(init)
            params = list(model.parameters())
            k = len(params) // 2
            opt = cls((p for p in params[:k]), torch.optim.AdamW, **_B_KW)  # a generator, as usual
            if not isinstance(opt, torch.optim.Optimizer):
                return Outcome(rank, f"ShardedOptimizer(...) gave a {type(opt).__name__}; subclass "
                                     "torch.optim.Optimizer and call super().__init__(params, defaults).")
            opt.add_param_group({"params": params[k:], "lr": _B_LR2})
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
                "ref": _adamw_variant(init, x, y, k, **_B_KW),
                "no_kwargs": _adamw_variant(init, x, y, k, lr=_B_KW["lr"]),
                "init": {n: p.detach().clone() for n, p in init.named_parameters()},
            })
            del opt
    finally:
        dist.destroy_process_group()
    return Outcome(rank, data={"cases": cases})


@checker("10.b sharded optimizer")
def check_sharded_optimizer(ShardedOptimizer: Any, *, timeout: float = 120.0) -> None:
    """Step ``ShardedOptimizer(params, torch.optim.AdamW, lr=..., weight_decay=0.1, betas=...)``
    on 2 ranks, the params given as a generator, a second group added with ``add_param_group``,
    beside plain AdamW; compare after every step and look at where the state lives."""
    require_callable(ShardedOptimizer, "the class ShardedOptimizer(params, optimizer_cls, **kwargs)")
    outcomes = run_workers(
        _sharded_worker, WORLD, args=(ShardedOptimizer,), timeout=timeout,
        hang_hint=("the ranks disagree on who owns a parameter, or one rank skips a broadcast: each "
                   "rank must broadcast every parameter, in the same order, from its owner."),
        error_hint=("`params` is a generator: it can be read once only. Read it once "
                    "(torch.optim.Optimizer.__init__ does, and calls add_param_group for each group); "
                    "an inner optimizer made from the same generator gets an empty list."))
    first_problem(outcomes)
    per_rank = [o.data["cases"] for o in sorted(outcomes, key=lambda o: o.rank)]
    for i in range(len(per_rank[0])):
        _judge_sharded([r[i] for r in per_rank])
    c = per_rank[0][0]
    print(f"ShardedOptimizer equals AdamW over {STEPS} steps on {WORLD} ranks (course model, tied "
          f"weights, two parameter groups); on the course model rank 0 holds "
          f"{c['bytes'] / 2**10:.0f} KiB of the {c['full_bytes'] / 2**10:.0f} KiB of AdamW state")


def _judge_sharded(ranks: list[dict]) -> None:
    name = ranks[0]["name"]
    for s in range(STEPS):
        a, b = ranks[0]["states"][s], ranks[1]["states"][s]
        if not close(a, b, atol=0.0):
            raise CheckFailed(
                f"{name}: after step {s + 1} rank 1's parameters differ from rank 0's:\n"
                f"{format_table(diff_table(a, b), 0.0)}\nUsual mistake: after the inner step each "
                "rank has updated only the parameters it owns; broadcast every parameter from its "
                "owner (dist.broadcast(p, src=owner)) so that all ranks are up to date.")
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
                                  "were never updated. Usual mistake: add_param_group() not "
                                  "overridden, so a group added after construction is never "
                                  "sharded into the inner optimizer.")
            if close(r["no_kwargs"][s], got[s], atol=ATOL):
                raise CheckFailed(head + "They equal AdamW with default hyperparameters. Usual "
                                  "mistake: the keyword arguments (weight_decay, betas) not passed "
                                  "on to the inner optimizer_cls(..., **kwargs).")
            raise CheckFailed(head + "Usual mistake: a parameter broadcast from rank 0 instead of "
                              "from the rank that owns (and stepped) it, or a group's lr not used.")
    held = [set(r["held"]) for r in ranks]
    n = len(ranks[0]["trainable"])
    both = held[0] & held[1]
    if both:
        raise CheckFailed(
            f"{name}: {len(both)} of {n} parameters have optimizer state on both ranks "
            f"({ranks[0]['bytes'] / 2**10:.0f} KiB on rank 0, as much as unsharded AdamW's "
            f"{ranks[0]['full_bytes'] / 2**10:.0f} KiB). The state is not sharded. Usual mistake: "
            "every rank steps an optimizer over all parameters; give the inner optimizer only the "
            "parameters this rank owns.")
    missing = set(ranks[0]["trainable"]) - held[0] - held[1]
    if missing:
        raise CheckFailed(f"{name}: {len(missing)} of {n} parameters have optimizer state on no rank; "
                          "every parameter must be owned (and stepped) by exactly one rank.")
    for r in ranks:
        if r["leftover"]:
            raise CheckFailed(f"{name}: after zero_grad() {', '.join(r['leftover'][:3])} still hold "
                              "a gradient; zero_grad() must clear every parameter's, owned or not.")


# --------------------------------------------------------------------------------------------
# 10.c  the α-β cost model
# --------------------------------------------------------------------------------------------


def ring_factor(world: int) -> float:
    """Bytes each rank sends in a ring all-reduce, per byte of the message: 2(N-1)/N."""
    return 2 * (world - 1) / world


def fit_alpha_beta(sizes: list[int], seconds: list[float], world: int) -> tuple[float, float]:
    """Least-squares α (s) and β (bytes/s) of t = α + 2(N-1)/N · S / β over measured (S, t)."""
    xs = [ring_factor(world) * s for s in sizes]
    mx, mt = statistics.fmean(xs), statistics.fmean(seconds)
    slope = sum((a - mx) * (t - mt) for a, t in zip(xs, seconds)) / sum((a - mx) ** 2 for a in xs)
    slope = max(slope, 1e-15)
    return max(mt - slope * mx, 0.0), 1.0 / slope


def allreduce_seconds(sizes: list[int], groups: list[list[int]] = (), rounds: int = 7,
                      calls: int = 4) -> tuple[str, list[list[float]], list[list[float]]]:
    """Worker: seconds per all-reduce of a float32 tensor of each of ``sizes`` bytes (chapter 03's
    measurement: ``calls`` back-to-back calls, averaged), and per sequence of all-reduces of the sizes
    in each of ``groups`` (as DDP issues its buckets, one after the other).

    The sizes and the groups are timed in turn within each of ``rounds`` rounds, so that a change
    of load on a shared machine touches both alike; returns each round's times (the slowest rank's
    is what a caller should use)."""


    backend, device = backend_and_device()
    if not dist.is_initialized():
        dist.init_process_group(**process_group_kwargs(backend, device))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    tensors = {s: torch.zeros(max(s // 4, 1), device=device) for g in [sizes, *groups] for s in g}

    def timed(group: list[int]) -> float:
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            for s in group:
                dist.all_reduce(tensors[s])
        sync()
        return (time.perf_counter() - t0) / calls

    for s in tensors:
        dist.all_reduce(tensors[s])  # warm-up: connections, buffers
    single, multi = [], []
    for _ in range(rounds):
        single.append([timed([s]) for s in sizes])
        multi.append([timed(g) for g in groups])
    dist.destroy_process_group()
    return backend, single, multi


_C_SIZES = [2**12, 2**15, 2**17, 2**19, 2**20]
_C_GROUP = [2**19, 2**17, 2**15, 2**12, 2**12]  # the bucket sizes of one step (bytes)


def measured_rounds(sizes: list[int], groups: list[list[int]], world: int = WORLD, *,
                    timeout: float = 90.0, **kwargs: Any) -> tuple[list[list[float]], list[list[float]]]:
    """Run ``allreduce_seconds`` on ``world`` ranks; per round, the slowest rank's times."""
    out = run_workers(allreduce_seconds, world, args=(sizes, groups), timeout=timeout,
                      hang_hint="(the measurement itself hung; rerun)")
    rounds = range(len(out[0][1]))
    single = [[max(r[1][k][i] for r in out) for i in range(len(sizes))] for k in rounds]
    multi = [[max(r[2][k][i] for r in out) for i in range(len(groups))] for k in rounds]
    return single, multi


@checker("10.c cost-model prediction")
def check_comm_prediction(predict: Callable, *, timeout: float = 90.0, tolerance: float = 2.0) -> None:
    """``predict(bucket_bytes, world, alpha, beta)`` -> seconds of one step's all-reduces.

    First on made-up numbers (exact), then against gloo all-reduces timed here: α and β are fitted
    from single all-reduces, the prediction for a sequence of buckets must be within a factor
    ``tolerance`` of the measured time (the measurement on a shared CPU is noisy).
    """
    require_callable(predict, "a function predict(bucket_bytes, world, alpha, beta)")
    alpha, beta = 50e-6, 2e9
    buckets = [25 * 2**20, 4 * 2**20, 1000]
    for world in (2, 8):
        right = sum(alpha + ring_factor(world) * b / beta for b in buckets)
        got = predict(list(buckets), world, alpha, beta)
        if not isinstance(got, (int, float)) or isinstance(got, bool) or got != got:
            raise CheckFailed(f"predict(...) returned {got!r}; expected a number of seconds (a float)")
        if math.isclose(got, right, rel_tol=1e-6):
            continue
        variants = {
            "the ring factor 2(N-1)/N is missing: a ring all-reduce sends each byte 2(N-1)/N times "
            "(a reduce-scatter, then an all-gather)": sum(alpha + b / beta for b in buckets),
            "the factor is (N-1)/N: that is one reduce-scatter (or one all-gather) only; an "
            "all-reduce is both, 2(N-1)/N": sum(alpha + (world - 1) / world * b / beta for b in buckets),
            "α counted once per step: every bucket is its own all-reduce and pays the latency":
                alpha + sum(ring_factor(world) * b / beta for b in buckets),
            "bits and bytes mixed (a factor of 8): bucket sizes and β are both in bytes":
                sum(alpha + ring_factor(world) * 8 * b / beta for b in buckets),
            "milliseconds returned: return seconds": right * 1e3,
        }
        for why, value in variants.items():
            if math.isclose(got, value, rel_tol=1e-6):
                raise CheckFailed(f"with α={alpha:g} s, β={beta:g} B/s, N={world}, buckets {buckets} B: "
                                  f"expected {right:.6g} s, got {got:.6g} s.\nUsual mistake: {why}.")
        raise CheckFailed(f"with α={alpha:g} s, β={beta:g} B/s, N={world}, buckets {buckets} B: expected "
                          f"{right:.6g} s (sum over buckets of α + 2(N-1)/N · bytes / β), got {got:.6g} s")
    single, multi = measured_rounds(_C_SIZES, [_C_GROUP], timeout=timeout)
    ratios, fits = [], []
    for times, group_time in zip(single, multi):  # fit and predict within each round
        a, b = fit_alpha_beta(_C_SIZES, times, WORLD)
        fits.append((a, b))
        ratios.append(predict(list(_C_GROUP), WORLD, a, b) / group_time[0])
    k = sorted(range(len(ratios)), key=ratios.__getitem__)[len(ratios) // 2]  # the median round
    (a, b), ratio = fits[k], ratios[k]
    print(f"fitted here (median of {len(ratios)} rounds): α = {a * 1e6:.1f} µs, β = {b / 1e9:.3f} GB/s; "
          f"{len(_C_GROUP)} all-reduces of one step: predicted {ratio * multi[k][0] * 1e3:.3f} ms, measured "
          f"{multi[k][0] * 1e3:.3f} ms (ratio {ratio:.2f}; {min(ratios):.2f} to {max(ratios):.2f} "
          "over the rounds)")
    if not 1 / tolerance <= ratio <= tolerance:
        raise CheckFailed(f"the prediction is {ratio:.2f} times the measured time, outside "
                          f"[{1 / tolerance:.2f}, {tolerance:.2f}]. If the formula passed the exact "
                          "check above, the machine was probably busy while measuring: rerun.")


# --------------------------------------------------------------------------------------------
# Measurements printed beside exercises 10.a and 10.b (not checks: they judge speed and memory)
# --------------------------------------------------------------------------------------------

def _count_all_reduces(step: Callable[[], None]) -> int:
    """Calls to ``dist.all_reduce`` made by ``step()`` (the mini DDPs call it through ``dist``)."""
    real, calls = dist.all_reduce, []

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_reduce = counting
    try:
        step()
    finally:
        dist.all_reduce = real
    return len(calls)


def _speed_worker(classes: dict[str, Any], cap_mb: float, batch: int, steps: int,
                  repeats: int) -> dict:
    """Worker: the seconds of each of ``steps`` training steps of each wrapper, the wrappers taking
    turns within each repeat (in alternating order); all-reduce calls per step.  A wrapper whose
    constructor is still a stub is left out (its calls are None)."""
    backend, device = backend_and_device()
    dist.init_process_group(**process_group_kwargs(backend, device))
    rank, world = dist.get_rank(), dist.get_world_size()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    x, y = make_dataset(batch * world, seed=12).tensors
    x, y = x[rank::world].to(device), y[rank::world].to(device)
    ids = [device.index] if device.type == "cuda" else None

    def wrap(name: str) -> Any:
        model = make_model(seed=0).to(device)
        if name == "torch DDP":
            return DDP(model, bucket_cap_mb=cap_mb, device_ids=ids)
        try:
            return classes[name](model, cap_mb) if name == "DDPBucketed" else classes[name](model)
        except NotImplementedError:
            return None

    def train_step(wrapped: Any, opt: torch.optim.Optimizer) -> None:
        if hasattr(wrapped, "on_train_batch_start"):
            wrapped.on_train_batch_start()
        opt.zero_grad()
        F.cross_entropy(wrapped(x), y).backward()
        if hasattr(wrapped, "finish_gradient_synchronization"):
            wrapped.finish_gradient_synchronization()
        opt.step()

    runs, calls = {}, {}
    try:
        for name in [*classes, "torch DDP"]:  # the learner's first: a stub ends the measurement
            wrapped = wrap(name)
            if wrapped is None:
                calls[name] = None
                if name == "DDPBucketed":
                    return {"backend": backend, "seconds": {}, "calls": calls}
                continue
            opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
            for _ in range(3):  # warm-up; torch DDP rebuilds its buckets after the first step
                train_step(wrapped, opt)
            runs[name] = (wrapped, opt)
            if name == "torch DDP":  # a second DDP, with a comm hook that counts the buckets
                counted = DDP(make_model(seed=0).to(device), bucket_cap_mb=cap_mb, device_ids=ids)
                buckets = []

                def counting_hook(state, bucket, buckets=buckets):  # no annotations: DDP checks them
                    buckets.append(bucket.buffer().numel())
                    return allreduce_hook(None, bucket)

                counted.register_comm_hook(None, counting_hook)
                c_opt = torch.optim.AdamW(counted.parameters(), lr=1e-3)
                for _ in range(2):  # the second step, after the buckets are rebuilt, counts
                    buckets.clear()
                    train_step(counted, c_opt)
                calls[name] = len(buckets)
                del counted, c_opt
            else:
                calls[name] = _count_all_reduces(lambda w=wrapped, o=opt: train_step(w, o))

        seconds: dict[str, list[list[float]]] = {name: [] for name in runs}  # per repeat, per step
        order = sorted(runs, key=["torch DDP", "DDPBucketed", "DDPIndividualParameters"].index)
        for k in range(repeats):  # torch DDP and DDPBucketed side by side, in alternating order
            for name in order[::1 if k % 2 == 0 else -1]:
                wrapped, opt = runs[name]
                dist.barrier()
                times = []
                for _ in range(steps):
                    sync()
                    t0 = time.perf_counter()
                    train_step(wrapped, opt)
                    sync()
                    times.append(time.perf_counter() - t0)
                seconds[name].append(times)
        return {"backend": backend, "seconds": seconds, "calls": calls}
    finally:
        runs.clear()
        wrapped = opt = None
        gc.collect()  # no DDP reducer may outlive the process group
        dist.destroy_process_group()


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    """First quartile, median, third quartile."""
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def speed_verdict(ratios: list[float], margin: float = 0.10) -> tuple[str, bool, bool]:
    """Is ``DDPBucketed`` within ``margin`` of torch DDP, given its ratio of steps per second to torch
    DDP's in each repeat?  The median decides; the verdict is firm when the middle half of the
    repeats (the quartiles) lies on the same side of ``1 - margin``.  Returns (text, within, firm)."""
    lo, med, hi = _quartiles(ratios)
    within = med >= 1 - margin
    firm = lo >= 1 - margin if within else hi < 1 - margin
    text = (f"DDPBucketed runs at {med:.0%} of torch DDP's steps per second (median over {len(ratios)} "
            f"repeats; the middle half of them {lo:.0%} to {hi:.0%}): "
            f"{'within' if within else 'not within'} {margin:.0%} of torch DDP on this machine"
            + ("." if firm else f"; but the middle half of the repeats straddles {1 - margin:.0%}, "
               "so the repeats disagree by more than the difference: this run cannot settle it (more "
               "repeats, or a quieter machine, can)."))
    return text, within, firm


def compare_bucketed_speed(DDPBucketed: Any, DDPIndividualParameters: Any = None, *,
                           bucket_size_mb: float = 25.0, batch: int = 64, steps: int = 15,
                           repeats: int = 15, margin: float = 0.10, timeout: float = 120.0) -> dict:
    """Time training steps of the course model on 2 ranks with torch DDP, ``DDPBucketed`` and
    ``DDPIndividualParameters``; print steps per second and all-reduce calls per step, and whether
    ``DDPBucketed`` is within ``margin`` of torch DDP's steps per second here.

    Each repeat times ``steps`` AdamW steps of each wrapper in turn (the same model and data, a
    bucket cap of ``bucket_size_mb`` for both bucketed ones), so that a change of load on a shared
    machine touches all of them alike.  A repeat's steps per second come from its median step (a
    step's time is the slower rank's).  ``DDPBucketed`` is compared with torch DDP repeat by repeat:
    the median of those ratios decides, and their quartiles say how much the repeats disagree.
    ``DDPIndividualParameters`` may be None or a stub: it is then left out.  Returns the numbers.
    """
    require_callable(DDPBucketed, "the class DDPBucketed(module, bucket_size_mb)")
    classes = {"DDPBucketed": DDPBucketed}
    if DDPIndividualParameters is not None:
        classes["DDPIndividualParameters"] = DDPIndividualParameters
    out = run_workers(_speed_worker, WORLD, args=(classes, bucket_size_mb, batch, steps, repeats),
                      timeout=timeout, hang_hint="the ranks made different all-reduces: rerun the check "
                      "of exercise 10.a (or 04.b) first.")
    calls = {n: out[0]["calls"][n] for n in ["torch DDP", *classes] if n in out[0]["calls"]}
    if calls["DDPBucketed"] is None:
        raise CheckFailed("DDPBucketed is not done yet (exercise 10.a): its constructor still raises "
                          "NotImplementedError. Complete it, then measure it.")
    rates = {n: [1 / statistics.median(max(ts) for ts in zip(*(r["seconds"][n][k] for r in out)))
                 for k in range(repeats)]
             for n, c in calls.items() if c is not None}
    rel = {n: [a / b for a, b in zip(r, rates["torch DDP"])] for n, r in rates.items()}
    print(f"{out[0]['backend']}, {WORLD} ranks, course model, batch {batch} per rank, AdamW; "
          f"{repeats} repeats of {steps} steps, the wrappers taking turns")
    print(f"{'':<31}{'steps/s: median':>16}{'(quartiles)':>16}{'vs torch DDP*':>14}{'all-reduces/step':>18}")
    for n, c in calls.items():
        label = n if n == "DDPIndividualParameters" else f"{n} ({bucket_size_mb:g} MiB)"
        if c is None:
            print(f"{label:<31}  left out: its constructor is still a stub (exercise 04.b)")
            continue
        q1, q2, q3 = _quartiles(rates[n])
        print(f"{label:<31}{q2:>16.0f}{f'({q1:.0f} to {q3:.0f})':>16}{statistics.median(rel[n]):>14.0%}"
              f"{c:>18d}")
    print("* per repeat, steps/s divided by torch DDP's in the same repeat (the load of the machine then "
          "cancels out); the median over the repeats")
    text, within, firm = speed_verdict(rel["DDPBucketed"], margin)
    print(text)
    return {"steps_per_s": rates, "vs_ddp": rel, "calls": calls, "within": within, "firm": firm}


def _state_tensors(opt: Any) -> dict[int, list[torch.Tensor]]:
    """Per parameter (by id), the tensors of its optimizer state in ``opt`` and in any optimizer
    one attribute away from it (where a ShardedOptimizer keeps its inner one), each counted once."""
    seen, out = set(), {}
    for o in _optimizers_in(opt):
        for p, st in o.state.items():
            for t in st.values():
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    out.setdefault(id(p), []).append(t)
    return out


def _memory_cases() -> list[tuple[str, torch.nn.Module]]:
    g = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        equal = torch.nn.Sequential(torch.nn.Linear(32, 128), *[torch.nn.Linear(128, 128) for _ in range(6)],
                                    torch.nn.Linear(128, 10))
    finally:
        torch.random.set_rng_state(g)
    return [("course model", make_model(seed=0)), ("8 layers, 6 of them 128x128", equal)]


def _memory_worker(cls: Any) -> list[dict]:
    """Worker: bytes of optimizer state on this rank after one step, sharded and plain AdamW."""
    backend, device = backend_and_device()
    dist.init_process_group(**process_group_kwargs(backend, device))
    x, y = make_dataset(64, seed=13).tensors  # the same batch on every rank: equal gradients
    x, y = x.to(device), y.to(device)
    out = []
    try:
        for name, init in _memory_cases():
            per_param = []
            for make in (lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                         lambda ps: cls(ps, torch.optim.AdamW, lr=1e-3)):
                model = copy.deepcopy(init).to(device)
                opt = make(model.parameters())
                F.cross_entropy(model(x), y).backward()
                opt.step()
                state = _state_tensors(opt)
                per_param.append([sum(t.numel() * t.element_size() for t in state.get(id(p), []))
                                  for p in model.parameters()])
                del opt
            out.append({"name": name, "plain": per_param[0], "sharded": per_param[1],
                        "names": [n for n, _ in init.named_parameters()],
                        "numel": [p.numel() for p in init.parameters()]})
    finally:
        dist.destroy_process_group()
    return out


def measure_sharded_memory(ShardedOptimizer: Any, *, timeout: float = 90.0) -> list[dict]:
    """Bytes of AdamW state each of 2 ranks holds after one step, with ``ShardedOptimizer`` and with
    plain AdamW, on the course model and on a model of equal layers; printed next to the ideal 1/N,
    with a verdict computed from them.  The state is every tensor in the optimizers' ``state``
    (AdamW: ``exp_avg`` and ``exp_avg_sq`` the size of the parameter, and a one-element ``step``);
    the ShardedOptimizer's inner optimizer is found one attribute away from it.  Returns the numbers.
    """
    require_callable(ShardedOptimizer, "the class ShardedOptimizer(params, optimizer_cls, **kwargs)")
    try:
        out = run_workers(_memory_worker, WORLD, args=(ShardedOptimizer,), timeout=timeout,
                          hang_hint="the ranks disagree on who owns a parameter: rerun the check of 10.b.")
    except CheckFailed as e:
        if "not done yet" in str(e) or "NotImplementedError" in str(e):
            raise CheckFailed("ShardedOptimizer is not done yet (exercise 10.b): complete it, then "
                              "measure it.") from None
        raise
    kib = 2**10
    results = []
    for c in range(len(out[0])):
        case = out[0][c]
        plain = sum(case["plain"])
        held = [sum(o[c]["sharded"]) for o in out]
        owners = [[i for i, b in enumerate(o[c]["sharded"]) if b] for o in out]
        n = len(case["plain"])
        print(f"{case['name']} ({sum(case['numel']):,} parameters in {n} tensors), AdamW, {WORLD} ranks: "
              "optimizer state per rank after one step")
        rows = [("unsharded AdamW", plain, f"all {n} tensors")]
        rows += [(f"ShardedOptimizer, rank {r}", b, f"{len(owners[r])} of {n} tensors")
                 for r, b in enumerate(held)]
        rows.append((f"ideal 1/{WORLD}", plain / WORLD, ""))
        for label, b, what in rows:
            print(f"    {label:<27}{b / kib:>8.1f} KiB {b / plain:>5.0%}   {what}".rstrip())
        twice = set(owners[0]).intersection(*owners[1:])
        biggest = max(range(n), key=lambda i: case["plain"][i])
        best = max(case["plain"][biggest], plain / WORLD)  # no split of whole tensors does better
        if twice:
            verdict = (f"not sharded: {len(twice)} of {n} tensors have state on every rank, so a rank "
                       f"holds {max(held) / plain:.0%} of the unsharded state.")
        elif sum(held) != plain:
            verdict = (f"the ranks together hold {sum(held) / plain:.0%} of the unsharded state: some "
                       "parameters' state is missing or counted differently.")
        else:
            verdict = (f"sharded: each tensor's state is on one rank and the ranks together hold exactly "
                       f"the unsharded {plain / kib:.1f} KiB. The fullest rank holds {max(held) / plain:.0%}"
                       f", against the ideal {1 / WORLD:.0%}")
            if max(held) <= plain / WORLD * 1.05:
                verdict += ": close to it, because many tensors of similar size can be dealt out evenly."
            else:
                verdict += (f", because whole tensors are given to ranks: the largest, "
                            f"{case['names'][biggest]} ({case['numel'][biggest]:,} elements), carries "
                            f"{case['plain'][biggest] / plain:.0%} of the state alone, so no assignment of "
                            f"whole tensors can bring the fullest rank below {best / plain:.0%} here. "
                            "FSDP2 splits every parameter along dim 0 across the ranks, which reaches 1/N "
                            "up to padding; torch's ZeroRedundancyOptimizer, like this exercise, gives "
                            "whole parameters to ranks.")
        print(textwrap.fill(verdict, 104, initial_indent="    ", subsequent_indent="    "))
        results.append({"name": case["name"], "unsharded": plain, "per_rank": held, "owners": owners,
                        "lower_bound": best})
    return results
