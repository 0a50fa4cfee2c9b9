"""04.b: mini DDP, the class ``DDPIndividualParameters`` of ``mini_ddp.py``.

``check_mini_ddp(DDPIndividualParameters)``: the wrapper must broadcast rank 0's state at
construction, start an asynchronous all-reduce per gradient from a hook *during* backward, and
average in ``finish_gradient_synchronization()``.  It runs on 3 ranks beside torch DDP, on the
course model and on a model with a frozen and a shared parameter, over several steps of SGD with
momentum (gradients, parameters, buffers and momentum compared after every step), and a
``CollectiveSpy`` watches the communication itself: which parameter's gradient each all-reduce
carries (each trainable one once per step, a shared one once, a frozen one never), whether it
starts during backward and asynchronously, and whether ``finish_gradient_synchronization()``
waits for every handle.

The misconceptions it recognises are ``CATALOGUE`` below (each key names the wrong class in
tests/checkers/test_ch04_mini_ddp.py).  Right answers written differently pass: the solution,
handles in a dict, post-hooks on the AccumulateGrad nodes with the gradient divided before it is
summed, and a copy of each gradient all-reduced and copied back after the wait.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import cloudpickle
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...checking import (
    Call,
    Catalogue,
    CheckFailed,
    CollectiveSpy,
    Group,
    Misconception,
    Outcome,
    checker,
    close,
    compare_tensors,
    diff_table,
    judge,
    process_group,
    require_callable,
    run_workers,
    state_to_cpu,
)
from ...checking.fixtures import FrozenAndShared, ddp_keeping_own_buffers
from ...data import make_model
from .common import ATOL, MISMATCH_HINT, describe_error, rank_batches

__all__ = ["CATALOGUE", "check_mini_ddp"]

_TENSOR_HOOK = (
    "Tensor.register_hook(hook) calls hook(grad) *before* that gradient is accumulated into "
    "param.grad (param.grad is then still None, or still holds its old value), and torch's "
    "documentation says the hook must not modify its argument. Register "
    "param.register_post_accumulate_grad_hook(hook) instead: it runs once param.grad holds the "
    "complete gradient, and hook(param) can all-reduce param.grad in place.")
_SHARED_TWICE = (
    "a parameter shared by two layers got two hooks (module.named_parameters(remove_duplicate=False), "
    "or a loop over the modules that each own it); module.parameters() lists a shared parameter "
    "once: hook it, and all-reduce it, once.")
_NO_OVERLAP = (
    ", so backward stalls at every gradient until its all-reduce is done: no overlap. Use "
    "dist.all_reduce(grad, async_op=True), keep the handle, and wait for it in "
    "finish_gradient_synchronization() after backward ends.")

CATALOGUE = Catalogue(
    "04.b mini DDP",
    Misconception(
        "StoresModelElsewhere", "the wrapper may keep the model under any name",
        "the wrapper's .module is not the model it was given",
        "not the module it wraps; store it as self.module = module, as torch DDP does"),
    Misconception(
        "HooksOnEveryParameter", "every parameter gets a hook",
        "the constructor raises on the frozen parameter's hook",
        "registering a hook on a parameter with requires_grad=False (a frozen parameter has no "
        "gradient and accepts no hook): skip those."),
    Misconception(
        "DividesEveryParameter", "after the wait, divide every parameter's gradient",
        "finish_gradient_synchronization() raises on the frozen parameter's .grad (None)",
        "reading the .grad of a parameter that has none: a frozen parameter (requires_grad=False) "
        "never gets a gradient, so loop over the trainable parameters only, or over the gradients "
        "your hooks collected; or handles kept from an earlier step."),
    Misconception(
        "TensorRegisterHookReadsGrad", "Tensor.register_hook is the gradient hook; read p.grad there",
        "the hook raises: p.grad is None when a Tensor.register_hook hook runs",
        "p.grad read in a Tensor.register_hook hook, where it is not there yet."),
    Misconception(
        "NoBroadcast", "the ranks build the same model anyway",
        "right after construction the parameters differ from rank 0's",
        "not broadcasting the initial parameters from rank 0 in __init__ (dist.broadcast(t, src=0) "
        "for every parameter and every buffer). Seeding every rank alike is not enough: nothing "
        "guarantees it, and the buffers are still the rank's own."),
    Misconception(
        "BroadcastsParametersOnly", "the parameters are the model's state",
        "right after construction only buffers differ from rank 0's",
        "not broadcasting the initial buffers from rank 0 in __init__ (dist.broadcast(t, src=0) "
        "for every buffer too): BatchNorm's running statistics are state that each rank built "
        "itself."),
    Misconception(
        "TensorRegisterHook", "Tensor.register_hook is the gradient hook; all-reduce its argument",
        "an all-reduce carries the argument of a Tensor.register_hook hook",
        "your hook all-reduced the gradient passed to a Tensor.register_hook hook."),
    Misconception(
        "AllReduceLoopAfterBackward", "hooks are an optimisation, a loop after backward does the same",
        "no all-reduce starts during backward",
        "no all-reduce started during backward; they all start in finish_gradient_synchronization(), "
        "after backward has ended, so communication cannot overlap backward (the numbers can be "
        "right, the point of the exercise is missed). Start each gradient's all-reduce from a hook "
        "as soon as it is ready (param.register_post_accumulate_grad_hook) and only wait in "
        "finish_gradient_synchronization()."),
    Misconception(
        "BlockingAllReduceInHook", "the hook is where the gradient is ready, so reduce it there",
        "a synchronous all-reduce during backward",
        "during backward your hook waited for communication (a blocking dist.all_reduce "
        "(async_op=False))"),
    Misconception(
        "AsyncButWaitsInHook", "async_op=True makes it overlap, whatever follows",
        "a handle waited for during backward",
        "during backward your hook waited for communication (work.wait())"),
    Misconception(
        "HooksInForward", "forward() is where a wrapper sets things up",
        "every gradient is all-reduced once more at every step",
        "the hooks were registered again (in forward(), or in each step), and every registration "
        "adds one more hook. Register them once, in __init__."),
    Misconception(
        "HookPerModule", "each module's parameters get their hooks",
        "a shared parameter's gradient is all-reduced twice in one backward",
        _SHARED_TWICE),
    Misconception(
        "NeverWaits", "async_op=True returns when it is done",
        "handles not waited for when finish_gradient_synchronization() returns",
        "An async_op=True all-reduce may still be writing into the gradient: call work.wait() on "
        "every handle before dividing, so that optimizer.step() sees the finished sum."),
    Misconception(
        "NeverClearsHandles", "the list of handles is rebuilt each step anyway",
        "handles of an earlier step waited for again",
        "the list of handles is never cleared, so it grows every step and the gradients of earlier "
        "steps are divided again (when .grad is zeroed in place, these are this step's gradient "
        "tensors). Empty the list at the end of finish_gradient_synchronization()."),
    Misconception(
        "AveragesWithOtherCollectives", "any collectives that average the gradients will do",
        "the gradients are DDP's, but no dist.all_reduce was called",
        "the gradients were averaged without dist.all_reduce (a reduce then a broadcast, an "
        "all_gather, ...): the values are right, but that is two collectives where one does it, and "
        "the exercise is the one DDP uses. In each gradient's hook start "
        "dist.all_reduce(p.grad, async_op=True), and wait for the handles in "
        "finish_gradient_synchronization()."),
    Misconception(
        "SumsWithoutDividing", "DDP all-reduces the gradients, and all_reduce sums",
        "the gradients are world-size times torch DDP's",
        "you summed them over the ranks but did not divide by the world size. DDP averages."),
)
_hint = CATALOGUE.hint

_STEPS, _BATCH, _LR, _MOMENTUM, _WORLD = 4, 48, 0.1, 0.9, 3


def _models(rank: int) -> dict[str, torch.nn.Module]:
    """Each rank builds a *different* model (seed and buffers depend on the rank)."""
    course = make_model(seed=200 + rank, norm=True)
    with torch.no_grad():
        course.net[1].running_mean.fill_(0.1 * rank)  # a buffer rank 0 must broadcast
    awkward = FrozenAndShared(seed=300 + rank)
    with torch.no_grad():
        awkward.scale.fill_(1.0 + 0.1 * rank)
    return {"course model (BatchNorm)": course, "frozen + shared parameters": awkward}


class _Watch:
    """What the spy notes about each all-reduce of the case being run.

    ``named`` maps the learner's parameter names to the parameters (a tied parameter once); an
    all-reduced tensor is attributed to the parameter whose ``.grad`` it is (or a fresh copy of).
    Hooks registered with ``Tensor.register_hook`` while ``watching()`` are wrapped, so that an
    all-reduce of such a hook's argument (the gradient before it reaches ``.grad``) is recognised.
    """

    def __init__(self) -> None:
        self.named: dict[str, torch.Tensor] = {}
        self.hook_args: list[torch.Tensor] = []
        self.tensor_hooks = 0
        self.on = False

    def annotate(self, op: str, tensor: torch.Tensor | None) -> dict:
        return {
            "owner": self._owner(tensor),
            "missing": sum(p.grad is None for p in self.named.values() if p.requires_grad),
            "hook_arg": tensor is not None and any(a.data_ptr() == tensor.data_ptr()
                                                   for a in self.hook_args),
        }

    def _owner(self, tensor: torch.Tensor | None) -> str | None:
        if tensor is None:
            return None
        grads = [(n, p.grad) for n, p in self.named.items() if p.grad is not None]
        for n, g in grads:
            if g.shape == tensor.shape and g.data_ptr() == tensor.data_ptr():
                return n
        for n, g in grads:  # a copy made just before the all-reduce
            if g.shape == tensor.shape and g.dtype == tensor.dtype and torch.equal(g, tensor):
                return n
        return None

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        self.on = True
        try:
            yield
        finally:
            self.on = False

    @contextlib.contextmanager
    def tensor_hooks_wrapped(self) -> Iterator[None]:
        """``torch.Tensor.register_hook`` wrapped while inside; restored on the way out."""
        real, watch = torch.Tensor.register_hook, self

        def register_hook(tensor: torch.Tensor, hook: Callable) -> Any:
            if not (watch.on and tensor.is_leaf):
                return real(tensor, hook)
            watch.tensor_hooks += 1

            def watched(grad: torch.Tensor) -> Any:
                watch.hook_args.append(grad)
                try:
                    return hook(grad)
                finally:
                    watch.hook_args.pop()

            return real(tensor, watched)

        with mock.patch.object(torch.Tensor, "register_hook", register_hook):
            yield


def _optimizer(params: Any) -> torch.optim.Optimizer:
    """SGD with momentum: its state carries every step's gradient into the following steps."""
    return torch.optim.SGD(params, lr=_LR, momentum=_MOMENTUM)


def _momentum(opt: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: opt.state[p]["momentum_buffer"].detach().cpu().clone()
            for n, p in model.named_parameters() if opt.state[p].get("momentum_buffer") is not None}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters() if p.grad is not None}


def _communication(calls: list[Call], start: int, step: int) -> dict:
    """This step's all-reduces (those from ``start`` on) and the waits noted during it."""
    now = [c for c in calls[start:] if c.phase is not None]
    earlier = [c for c in calls[:start] if c.phase is not None]
    return {
        "reduces": [{"phase": c.phase, "async": c.async_op, **c.extra} for c in now],
        "waits_in_backward": sum(c.waited_during(step, "backward") for c in calls),
        "old_waits": sum(c.waited_during(step) for c in earlier),
        "unwaited": sum(c.async_op and not c.waited for c in now),
        "started": sum(c.async_op for c in now),
    }


def _error_problem(where: str, stage: str, text: str, tensor_hooks: int) -> str:
    if stage == "construct":
        hint = ""
        if "require" in text and "grad" in text:
            hint = " Usual mistake: " + _hint("HooksOnEveryParameter")
        return f"{where}: DDPIndividualParameters(model) raised {text}.{hint}"
    hint = ""
    if "NoneType" in text and tensor_hooks:
        hint = f" Usual mistake: {_hint('TensorRegisterHookReadsGrad')} {_TENSOR_HOOK}"
    elif "NoneType" in text:
        hint = " Usual mistake: " + _hint("DividesEveryParameter")
    return f"{where}: training {stage} raised {text}.{hint}"


def _run_case(cls: Any, case: str, init: torch.nn.Module, batches: list, pg: Group,
              spy: CollectiveSpy, watch: _Watch) -> tuple[dict, str]:
    """One model: torch DDP and the learner's wrapper side by side, step by step.

    Returns what each step produced, or a problem: what the learner's code raised, with the usual
    cause.  The torch DDP reference lives only in this function, so it is gone before the worker
    closes the process group (a DDP model that outlives its process group can hang gloo).
    """
    where = f"{case}, rank {pg.rank} of {pg.world}"
    with spy.paused():
        ddp = ddp_keeping_own_buffers(copy.deepcopy(init), pg.device)
    ref_opt = _optimizer(ddp.parameters())
    mine = copy.deepcopy(init)
    watch.named, watch.tensor_hooks = dict(mine.named_parameters()), 0
    spy.clear()
    try:
        with watch.watching():
            wrapped = cls(mine)
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - reported to the learner with the rank
        return {}, _error_problem(where, "construct", describe_error(e), watch.tensor_hooks)
    if not isinstance(wrapped, torch.nn.Module):
        return {}, (f"{where}: DDPIndividualParameters(model) gave a {type(wrapped).__name__}, not "
                    "an nn.Module; subclass nn.Module and call super().__init__() first")
    if getattr(wrapped, "module", None) is not mine:
        return {}, (f"{where}: the wrapper's `.module` is {type(getattr(wrapped, 'module', None)).__name__}, "
                    + _hint("StoresModelElsewhere"))
    res: dict[str, Any] = {"case": case, "rank": pg.rank, "steps": [],
                           "construct": (state_to_cpu(ddp.module), state_to_cpu(mine)),
                           "trainable": [n for n, p in watch.named.items() if p.requires_grad]}
    opt = _optimizer(mine.parameters())
    for step, (x, y) in enumerate(batches):
        set_to_none = step % 2 == 0  # odd steps zero .grad in place: stale handles show up
        with spy.paused():
            ref_opt.zero_grad(set_to_none=set_to_none)
            F.cross_entropy(ddp(x), y).backward()
        ref_grads = _grads(ddp.module)
        opt.zero_grad(set_to_none=set_to_none)
        start, spy.step = len(spy.calls), step
        try:
            with watch.watching():
                loss = F.cross_entropy(wrapped(x), y)
                spy.phase = "backward"
                loss.backward()
                spy.phase = "finish"
                wrapped.finish_gradient_synchronization()
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001
            return {}, _error_problem(where, f"step {step}", describe_error(e), watch.tensor_hooks)
        finally:
            spy.phase = None
        comm = _communication(spy.calls, start, step)
        grads = _grads(mine)
        ref_opt.step()
        opt.step()
        res["steps"].append({
            "set_to_none": set_to_none, **comm, "ref_grads": ref_grads, "grads": grads,
            "ref_params": state_to_cpu(ddp.module), "params": state_to_cpu(mine),
            "ref_momentum": _momentum(ref_opt, ddp.module), "momentum": _momentum(opt, mine),
        })
    return res, ""


def _worker(cls_bytes: bytes) -> Outcome:
    watch = _Watch()
    # The spy is in place before the learner's module is unpickled, so that every call is seen.
    with (process_group() as pg,
          CollectiveSpy(("all_reduce",), annotate=watch.annotate) as spy,
          watch.tensor_hooks_wrapped()):
        cls = cloudpickle.loads(cls_bytes)
        batches = rank_batches(_STEPS, _BATCH, pg.device)
        cases: list[dict] = []
        for i, (case, init) in enumerate(_models(pg.rank).items()):
            res, problem = _run_case(cls, case, init.to(pg.device), batches, pg, spy, watch)
            if problem:
                return Outcome(pg.rank, problem, {"cases": cases, "failed_case": i})
            cases.append(res)
            dist.barrier()
        return Outcome(pg.rank, data={"cases": cases})


@checker("04.b mini DDP")
def check_mini_ddp(DDPIndividualParameters: Any, *, timeout: float = 120.0) -> None:
    """Run the learner's wrapper on 3 ranks beside torch DDP; compare states and gradients."""
    require_callable(DDPIndividualParameters, "the class DDPIndividualParameters(module)")
    try:
        payload = cloudpickle.dumps(DDPIndividualParameters)
    except Exception as e:
        raise CheckFailed(f"DDPIndividualParameters cannot be sent to the worker processes: {e}") from None
    outcomes = run_workers(_worker, _WORLD, args=(payload,), timeout=timeout,
                           hang_hint=MISMATCH_HINT, error_hint=MISMATCH_HINT)
    _judge(outcomes)
    print(f"DDPIndividualParameters matches torch DDP on {_WORLD} ranks over {_STEPS} steps of SGD "
          "with momentum (gradients, parameters and momentum after every step; course model with "
          "BatchNorm, and a model with a frozen layer and a shared parameter): every trainable "
          "gradient all-reduced once per step, asynchronously, from its hook during backward, and "
          "waited for in finish_gradient_synchronization()")


def _judge(outcomes: list[Outcome]) -> None:
    """Case by case: a rank's error first, then every rank's state after construction, and only
    then the training steps; at the end all ranks must hold the same parameters."""
    world = len(outcomes)
    for i in range(max(len(o.data["cases"]) + bool(o.problem) for o in outcomes)):
        for o in outcomes:
            if o.problem and o.data["failed_case"] == i:
                raise CheckFailed(o.problem)
        case = [o.data["cases"][i] for o in outcomes]
        for res in case:
            _judge_construction(res, world)
        for res in case:
            for step, s in enumerate(res["steps"]):
                at = f"{res['case']}, rank {res['rank']} of {world}, step {step}"
                _judge_communication(at, s, res["trainable"])
                _judge_values(at, s, world)
                if not s["reduces"]:  # the right values, but not from an all-reduce
                    raise CheckFailed(f"{at}: {_hint('AveragesWithOtherCollectives')}")
    # Buffers may differ: each rank's BatchNorm statistics follow its own data, as with torch
    # DDP(forward_sync_buffers=False).
    outcomes = judge(outcomes, world=world)
    for i, first in enumerate(outcomes[0].data["cases"]):
        last0 = first["steps"][-1]
        for o in outcomes[1:]:
            last = o.data["cases"][i]["steps"][-1]
            compare_tensors({n: last0["params"][n] for n in last0["grads"]},
                            {n: last["params"][n] for n in last["grads"]}, atol=ATOL,
                            what=f"{first['case']}: parameters at the end",
                            where=f"rank {o.rank} (compared with rank 0)")


def _judge_construction(res: dict, world: int) -> None:
    expected, got = res["construct"]
    if close(expected, got, atol=ATOL):
        return
    bad = [n for n, d, _ in diff_table(expected, got) if d > ATOL]
    buffers_only = all(("running" in n or "num_batches" in n or n == "scale") for n in bad)
    what = "buffers" if buffers_only else "parameters"
    compare_tensors(expected, got, atol=ATOL, what=f"right after construction the {what}",
                    where=f"{res['case']}, rank {res['rank']} of {world} (the reference is rank 0's state)",
                    hint=_hint("BroadcastsParametersOnly" if buffers_only else "NoBroadcast"))


def _judge_communication(at: str, s: dict, trainable: list[str]) -> None:
    """Which gradients were all-reduced, when, asynchronously or not, and whether anything waited."""
    reduces = s["reduces"]
    reduces_bw = [e for e in reduces if e["phase"] == "backward"]
    if not reduces:
        return  # nothing seen (another collective, or none): the values below say what is wrong
    if any(e["hook_arg"] for e in reduces):
        raise CheckFailed(f"{at}: {_hint('TensorRegisterHook')} {_TENSOR_HOOK}")
    if not reduces_bw:
        raise CheckFailed(f"{at}: {_hint('AllReduceLoopAfterBackward')}")
    if any(not e["async"] for e in reduces_bw):
        raise CheckFailed(f"{at}: {_hint('BlockingAllReduceInHook')}{_NO_OVERLAP}")
    if s["waits_in_backward"]:
        raise CheckFailed(f"{at}: {_hint('AsyncButWaitsInHook')}{_NO_OVERLAP}")
    owners = [e["owner"] for e in reduces]
    counts = {n: owners.count(n) for n in trainable}
    twice = sorted(n for n, c in counts.items() if c > 1)
    if twice and all(c == counts[trainable[0]] for c in counts.values()):
        raise CheckFailed(f"{at}: every gradient was all-reduced {counts[trainable[0]]} times in one "
                          f"step: {_hint('HooksInForward')}")
    if twice:
        raise CheckFailed(f"{at}: the gradient of {', '.join(twice)} was all-reduced "
                          f"{max(counts[n] for n in twice)} times in one backward. Usual mistake: "
                          + _hint("HookPerModule"))
    if len(reduces) > len(trainable):
        raise CheckFailed(f"{at}: one backward made {len(reduces)} all-reduce calls for "
                          f"{len(trainable)} trainable parameters, so some gradient was all-reduced "
                          f"twice. Usual mistake: {_SHARED_TWICE}")
    never = [n for n, c in counts.items() if c == 0]
    if never and None not in owners:
        raise CheckFailed(f"{at}: the gradients of {', '.join(never[:4])} were never all-reduced; "
                          "every parameter with requires_grad=True needs a hook (and frozen ones none).")
    if s["set_to_none"] and reduces_bw[0]["missing"] == 0:
        raise CheckFailed(f"{at}: the first all-reduce started only after backward had computed "
                          "every gradient, so nothing overlaps. Start each parameter's all-reduce "
                          "from its own hook, as soon as its gradient is ready.")
    if s["unwaited"]:
        raise CheckFailed(f"{at}: finish_gradient_synchronization() returned without waiting for "
                          f"{s['unwaited']} of the {s['started']} asynchronous all-reduces started "
                          f"during this step. {_hint('NeverWaits')}")
    if s["old_waits"]:
        raise CheckFailed(f"{at}: finish_gradient_synchronization() waited again for "
                          f"{s['old_waits']} handle(s) of an earlier step: {_hint('NeverClearsHandles')}")


def _judge_values(at: str, s: dict, world: int) -> None:
    ref, got = s["ref_grads"], s["grads"]
    missing, extra = sorted(set(ref) - set(got)), sorted(set(got) - set(ref))
    if missing:
        raise CheckFailed(f"{at}: after finish_gradient_synchronization() these parameters have no "
                          f"gradient: {', '.join(missing[:4])}")
    if extra:
        raise CheckFailed(f"{at}: these parameters got a gradient though torch DDP's did not: "
                          f"{', '.join(extra[:4])} (a frozen parameter must keep .grad None)")
    if not close(ref, got, atol=ATOL):
        bad = [n for n, d, _ in diff_table(ref, got) if d > ATOL]
        if close({n: ref[n] * world for n in bad}, {n: got[n] for n in bad}, atol=ATOL, rtol=1e-4):
            raise CheckFailed(f"{at}: the gradients are {world} times torch DDP's: "
                              + _hint("SumsWithoutDividing"))
        if set(bad) <= {"block.weight", "block.bias", "tied.weight", "tied.bias"}:
            hint = _SHARED_TWICE
        else:
            hint = ("dividing before the all-reduce has finished (wait first), not waiting for "
                    "every handle, or all-reducing a copy of the gradient and never copying it back.")
            if not s["set_to_none"]:
                hint += (" This step zeroed .grad in place (optimizer.zero_grad(set_to_none=False)): "
                         "if the earlier steps passed, the handles of the previous step were "
                         "probably waited for and divided again; clear them in "
                         "finish_gradient_synchronization().")
        compare_tensors(ref, got, atol=ATOL, what="the gradients after finish_gradient_synchronization()",
                        where=at + " (torch DDP's are the reference)", hint=hint)
    hint = ("the gradients were right: something other than optimizer.step() changed the "
            "parameters or the optimizer's state (for instance a second all-reduce or broadcast "
            "of the parameters).")
    compare_tensors(s["ref_params"], s["params"], atol=ATOL, what="the module's state after "
                    "optimizer.step()", where=at, hint=hint)
    compare_tensors(s["ref_momentum"], s["momentum"], atol=ATOL, what="the momentum buffers after "
                    "optimizer.step()", where=at, hint=hint)
