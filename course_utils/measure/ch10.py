"""Chapter 10's measurements (beyond DDP): the α-β cost model, and the speed and memory of the
learner's classes.  They time, count and fit, and print their verdict; they do not pass or fail.

- ``ring_factor``, ``fit_alpha_beta``: the cost model t = α + 2(N-1)/N · S / β, and its fit;
- ``allreduce_seconds`` (a worker) and ``measured_rounds``: all-reduces timed on this machine, as
  chapter 03 times them (the lesson and exercise 10.c measure alike);
- ``compare_bucketed_speed`` and ``speed_verdict``: ``DDPBucketed`` (10.a) against torch DDP;
- ``measure_sharded_memory``: the optimizer state each rank holds with ``ShardedOptimizer`` (10.b).
"""

from __future__ import annotations

import copy
import inspect
import statistics
import textwrap
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from ..checking import CheckFailed, CollectiveSpy, Outcome, process_group, require_callable, run_workers
from ..data import make_dataset, make_model

__all__ = ["ring_factor", "fit_alpha_beta", "fit_alpha_beta_relative", "allreduce_seconds", "measured_rounds",
           "compare_bucketed_speed", "speed_verdict", "measure_sharded_memory", "optimizers_in",
           "note_sharded_verdict"]

WORLD = 2
# The memory measurement's own work (two models, one step each, on 2 ranks) takes about 2 s on a
# 2-core machine under a load of 5; a launch that runs far longer hangs.
MEMORY_TIMEOUT = 30.0


# --------------------------------------------------------------------------------------------
# The α-β cost model
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


def fit_alpha_beta_relative(sizes: list[int], seconds: list[float], world: int) -> tuple[float, float]:
    """α (s) and β (bytes/s) of t = α + 2(N-1)/N · S / β fitted on *relative* error: least squares
    weighted by 1/t², so that a small message's 0.3 ms counts as much as a large one's 10 ms.  The
    plain fit (``fit_alpha_beta``) lets the largest times set the line, and its intercept α can
    land far from what a small call costs."""
    xs = [ring_factor(world) * s for s in sizes]
    w = [1.0 / t**2 for t in seconds]
    sw, sx, st = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * t for wi, t in zip(w, seconds))
    sxx = sum(wi * x * x for wi, x in zip(w, xs))
    sxt = sum(wi * x * t for wi, x, t in zip(w, xs, seconds))
    slope = max((sw * sxt - sx * st) / (sw * sxx - sx * sx), 1e-15)
    return max((st - slope * sx) / sw, 0.0), 1.0 / slope


def allreduce_seconds(sizes: list[int], groups: list[list[int]] = (), rounds: int = 7,
                      calls: int = 4) -> Outcome:
    """Worker: seconds per all-reduce of a float32 tensor of each of ``sizes`` bytes (chapter 03's
    measurement: ``calls`` back-to-back calls, averaged), and per sequence of all-reduces of the sizes
    in each of ``groups`` (as DDP issues its buckets, one after the other).

    The sizes and the groups are timed in turn within each of ``rounds`` rounds, so that a change
    of load on a shared machine touches both alike; ``data`` holds each round's times (``single``,
    ``multi``; the slowest rank's is what a caller should use) and the ``backend``."""
    with process_group() as pg:
        cuda = pg.device.type == "cuda"
        sync = (lambda: torch.cuda.synchronize(pg.device)) if cuda else (lambda: None)
        tensors = {s: torch.zeros(max(s // 4, 1), device=pg.device) for g in [sizes, *groups] for s in g}

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
        return Outcome(pg.rank, data={"backend": pg.backend, "single": single, "multi": multi})


def measured_rounds(sizes: list[int], groups: list[list[int]], world: int = WORLD, *,
                    timeout: float = 90.0, **kwargs: Any) -> tuple[list[list[float]], list[list[float]]]:
    """Run ``allreduce_seconds`` on ``world`` ranks; per round, the slowest rank's times."""
    out = [o.data for o in run_workers(allreduce_seconds, world, args=(sizes, groups), timeout=timeout,
                                       hang_hint="(the measurement itself hung; rerun)")]
    rounds = range(len(out[0]["single"]))
    single = [[max(r["single"][k][i] for r in out) for i in range(len(sizes))] for k in rounds]
    multi = [[max(r["multi"][k][i] for r in out) for i in range(len(groups))] for k in rounds]
    return single, multi


# --------------------------------------------------------------------------------------------
# Speed of DDPBucketed (10.a) against torch DDP
# --------------------------------------------------------------------------------------------


def _count_all_reduces(step: Callable[[], None]) -> int:
    """Calls to ``dist.all_reduce`` made by ``step()`` (the mini DDPs call it through ``dist``)."""
    with CollectiveSpy(("all_reduce",)) as spy:
        step()
    return len(spy.calls)


def _speed_worker(classes: dict[str, Any], cap_mb: float, batch: int, steps: int,
                  repeats: int) -> Outcome:
    """Worker: the seconds of each of ``steps`` training steps of each wrapper, the wrappers taking
    turns within each repeat (in alternating order); all-reduce calls per step.  A wrapper whose
    constructor is still a stub is left out (its calls are None)."""
    with process_group() as pg:
        device = pg.device
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        x, y = make_dataset(batch * pg.world, seed=12).tensors
        x, y = x[pg.rank::pg.world].to(device), y[pg.rank::pg.world].to(device)
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
                        return Outcome(pg.rank, data={"backend": pg.backend, "seconds": {}, "calls": calls})
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
            return Outcome(pg.rank, data={"backend": pg.backend, "seconds": seconds, "calls": calls})
        finally:  # no DDP reducer may outlive the process group (it collects what is dropped)
            runs.clear()
            wrapped = opt = None


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
    out = [o.data for o in run_workers(
        _speed_worker, WORLD, args=(classes, bucket_size_mb, batch, steps, repeats), timeout=timeout,
        hang_hint="the ranks made different all-reduces: rerun the check of exercise 10.a (or 04.b) first.")]
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


# --------------------------------------------------------------------------------------------
# Memory of ShardedOptimizer (10.b)
# --------------------------------------------------------------------------------------------


def optimizers_in(obj: Any) -> list[torch.optim.Optimizer]:
    """``obj`` and every optimizer one attribute (or one list or dict) away from it: where a
    ShardedOptimizer keeps its inner one."""
    found = [obj]
    for value in vars(obj).values():
        items = (value.values() if isinstance(value, dict)
                 else value if isinstance(value, (list, tuple)) else [value])
        found += [v for v in items if isinstance(v, torch.optim.Optimizer) and v is not obj]
    return found


def _state_tensors(opt: Any) -> dict[int, list[torch.Tensor]]:
    """Per parameter (by id), the tensors of its optimizer state in ``opt`` and in any optimizer
    one attribute away from it, each counted once."""
    seen, out = set(), {}
    for o in optimizers_in(opt):
        for p, st in o.state.items():
            for t in st.values():
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    out.setdefault(id(p), []).append(t)
    return out


def _largest_first(sizes: list[int]) -> int:
    """The fullest rank's bytes when tensors of ``sizes`` are dealt out largest first, each to the
    rank holding the least so far: an assignment of whole tensors within 4/3 of the best."""
    held = [0] * WORLD
    for b in sorted(sizes, reverse=True):
        held[held.index(min(held))] += b
    return max(held)


def _memory_cases() -> list[tuple[str, torch.nn.Module]]:
    with torch.random.fork_rng(devices=[]):  # built on CPU: no GPU's generator is touched
        torch.manual_seed(0)
        equal = torch.nn.Sequential(torch.nn.Linear(32, 128), *[torch.nn.Linear(128, 128) for _ in range(6)],
                                    torch.nn.Linear(128, 10))
    return [("course model", make_model(seed=0)), ("8 layers, 6 of them 128x128", equal)]


def _memory_worker(cls: Any) -> Outcome:
    """Worker: bytes of optimizer state on this rank after one step, sharded and plain AdamW."""
    with process_group() as pg:
        x, y = make_dataset(64, seed=13).tensors  # the same batch on every rank: equal gradients
        x, y = x.to(pg.device), y.to(pg.device)
        cases = []
        for name, init in _memory_cases():
            per_param = []
            for make in (lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                         lambda ps: cls(ps, torch.optim.AdamW, lr=1e-3)):
                model = copy.deepcopy(init).to(pg.device)
                opt = make(model.parameters())
                F.cross_entropy(model(x), y).backward()
                opt.step()
                state = _state_tensors(opt)
                per_param.append([sum(t.numel() * t.element_size() for t in state.get(id(p), []))
                                  for p in model.parameters()])
                del opt
            cases.append({"name": name, "plain": per_param[0], "sharded": per_param[1],
                          "names": [n for n, _ in init.named_parameters()],
                          "numel": [p.numel() for p in init.parameters()]})
        return Outcome(pg.rank, data={"cases": cases})


# What 10.b's checker said of each ShardedOptimizer it ran ("" when it passed), so that the
# measurement refuses at once a class the checker rejected (or saw hang) instead of repeating it.
# A class of a module is known by its source (a reloaded, unchanged mini_ddp.py is the same answer);
# one made inside a function may differ by what it captured, so only that very class counts.
_BY_SOURCE: dict[str, str] = {}
_BY_CLASS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _source_key(cls: Any) -> str | None:
    if "<locals>" in getattr(cls, "__qualname__", "<locals>"):
        return None
    try:
        return f"{cls.__module__}.{cls.__qualname__}\n{inspect.getsource(cls)}"
    except (OSError, TypeError):  # defined where no source can be read
        return None


def note_sharded_verdict(cls: Any, problem: str) -> None:
    """10.b's checker notes its verdict on ``cls``: ``""`` when it passed, else its message."""
    key = _source_key(cls)
    if key is not None:
        _BY_SOURCE[key] = problem
    try:
        _BY_CLASS[cls] = problem
    except TypeError:  # not a class (the checker has already said so)
        pass


def _rejected(cls: Any) -> str:
    """The checker's message on ``cls`` (or on the same source) if it rejected it, else ''."""
    try:
        if cls in _BY_CLASS:
            return _BY_CLASS[cls]
    except TypeError:
        return ""
    key = _source_key(cls)
    return _BY_SOURCE.get(key, "") if key is not None else ""


def measure_sharded_memory(ShardedOptimizer: Any, *, timeout: float = MEMORY_TIMEOUT) -> list[dict]:
    """Bytes of AdamW state each of 2 ranks holds after one step, with ``ShardedOptimizer`` and with
    plain AdamW, on the course model and on a model of equal layers; printed next to the ideal 1/N,
    with a verdict computed from them.  The state is every tensor in the optimizers' ``state``
    (AdamW: ``exp_avg`` and ``exp_avg_sq`` the size of the parameter, and a one-element ``step``);
    the ShardedOptimizer's inner optimizer is found one attribute away from it.  Returns the numbers.

    A class that ``check_sharded_optimizer`` rejected (or saw hang) is refused at once, with the
    checker's first line; any other is measured within ``timeout`` seconds.
    """
    require_callable(ShardedOptimizer, "the class ShardedOptimizer(params, optimizer_cls, **kwargs)")
    problem = _rejected(ShardedOptimizer)
    if problem:
        raise CheckFailed("not measured: check_sharded_optimizer rejected this ShardedOptimizer ("
                          + textwrap.shorten(problem.splitlines()[0], 240) + "). Fix it until the check "
                          "passes, then measure it.")
    try:
        outcomes = run_workers(
            _memory_worker, WORLD, args=(ShardedOptimizer,), timeout=timeout,
            hang_hint="the ranks disagree on who owns a parameter, or a rank skips a broadcast: "
                      "run check_sharded_optimizer first.")
    except CheckFailed as e:
        if "not done yet" in str(e) or "NotImplementedError" in str(e):
            raise CheckFailed("ShardedOptimizer is not done yet (exercise 10.b): complete it, then "
                              "measure it.") from None
        raise
    out = [o.data["cases"] for o in outcomes]
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
        dealt = _largest_first(case["plain"])
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
            elif max(held) > dealt * 1.05:
                verdict += (f", because of how the parameters were assigned to ranks, not because whole "
                            f"tensors are: dealing them out largest first, each to the rank that holds "
                            f"the least so far, leaves the fullest rank {dealt / plain:.0%} here (no "
                            f"assignment of whole tensors goes below {best / plain:.0%}). Give each "
                            "parameter to the rank that owns the fewest elements so far.")
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
                        "lower_bound": best, "largest_first": dealt})
    return results
