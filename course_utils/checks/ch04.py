"""Checkers of chapter 04 (DistributedDataParallel).

Both run the learner's code in real worker processes (``run_workers``; gloo on CPU, NCCL with a GPU per
rank) next to torch's own ``DistributedDataParallel`` on the same data, and compare, rank by rank.

- ``check_hand_allreduce(train_data_parallel)``: ``train_data_parallel(model, batches, lr)`` trains
  ``model`` (a different initialisation on each rank) with SGD on this rank's ``batches``, averaging
  gradients across ranks by hand; it must end where torch DDP ends.
- ``check_mini_ddp(DDPIndividualParameters)``: the class of ``mini_ddp.py`` must broadcast rank 0's
  state at construction, start an asynchronous all-reduce per gradient from a hook *during*
  backward, and average in ``finish_gradient_synchronization()``.  Checked against torch DDP on the
  course model and on a model with a frozen and a shared parameter, over several steps of SGD with
  momentum (gradients, parameters, buffers and momentum compared after every step), and by watching
  the communication itself: which parameter's gradient each all-reduce carries (each trainable one
  once per step, a shared one once, a frozen one never), whether it starts during backward and
  asynchronously, and whether ``finish_gradient_synchronization()`` waits for every handle.

Misconceptions 04.a recognises (tests/checkers/test_ch04_hand_allreduce.py, the wrong answer in brackets):

- "all-reduce sums, and that is what DDP does" -> no division by the world size
  [sums_instead_of_averaging];
- "the ranks start from the same weights anyway" -> no broadcast at the start [no_initial_broadcast];
- "averaging the loss over the ranks averages the gradients" -> the loss all-reduced before
  backward; autograd does not differentiate through dist.all_reduce, so each rank keeps its own
  gradient [averages_the_loss];
- gradients all-reduced before backward (zero_grad set them to None) [all_reduce_before_backward];
- only the weights averaged, not the biases [weights_only]; a collective under ``if rank == 0:``
  [rank0_only]; the model not returned [forgets_return].
Right answers written differently pass: one flat buffer per step [right_with_a_flat_buffer], the
loss divided by the world size before backward and the gradients summed [right_dividing_first].

04.b's misconceptions (tests/checkers/test_ch04_mini_ddp.py, the wrong class in brackets):

- "hooks are an optimisation, a loop after backward does the same": right numbers, nothing
  overlaps backward [AllReduceLoopAfterBackward];
- "the hook is where the gradient is ready, so reduce it there": a blocking all-reduce in the hook
  [BlockingAllReduceInHook], or ``async_op=True`` followed at once by ``wait()`` [AsyncButWaitsInHook];
- "DDP all-reduces, all_reduce sums": no division by the world size [SumsWithoutDividing];
- "every parameter gets a hook": a hook on a frozen parameter [HooksOnEveryParameter], or the
  division looping over frozen parameters too [DividesEveryParameter];
- one hook per module that owns a parameter: a shared parameter all-reduced twice [HookPerModule];
- "the ranks build the same model anyway": no broadcast [NoBroadcast], or of the parameters but
  not the buffers [BroadcastsParametersOnly];
- the list of handles never cleared: earlier steps' handles waited for and divided again
  [NeverClearsHandles]; "async_op=True returns when it is done": handles never waited for
  [NeverWaits];
- ``Tensor.register_hook`` instead of ``register_post_accumulate_grad_hook``: its hook runs before
  the gradient reaches ``.grad`` and, per torch's documentation, must not modify its argument; an
  in-place all-reduce of that argument is rejected [TensorRegisterHook], and ``p.grad`` read there
  is still None [TensorRegisterHookReadsGrad];
- hooks registered in ``forward()``: one more hook per parameter every step [HooksInForward];
- the module stored under another name than ``.module`` [StoresModelElsewhere].
Right answers written differently pass: the solution, handles in a dict [HandlesInADict],
post-hooks on the AccumulateGrad nodes with the gradient divided before it is summed
[AccumulateGradNodeHooks], and a copy of each gradient all-reduced and copied back after the wait
[ReducesACopy].
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn.functional as F

from ..checking import (
    CheckFailed,
    checker,
    close,
    compare_tensors,
    diff_table,
    require_callable,
    run_workers,
    state_to_cpu,
    wrap_ddp,
)
from ..data import make_dataset, make_model, split
from ..devices import backend_and_device, process_group_kwargs

__all__ = ["check_hand_allreduce", "check_mini_ddp"]

ATOL = 1e-5


# --------------------------------------------------------------------------------------------
# Shared helpers (they run in the workers)
# --------------------------------------------------------------------------------------------


def _rank_batches(steps: int, global_batch: int, device: torch.device) -> list:
    """This rank's rows r::N of each of ``steps`` global batches of the course training split."""


    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = split(make_dataset(4096), n_val=1024)[0].tensors
    out = []
    for s in range(steps):
        rows = (torch.arange(s * global_batch, (s + 1) * global_batch) % len(x))[rank::world]
        out.append((x[rows].to(device), y[rows].to(device)))
    return out


def _describe_error(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:400]}"


_MISMATCH_HINT = ("the ranks did not call the same collectives: a collective inside "
                  "`if rank == 0:`, or a different number of all_reduce calls on different ranks "
                  "(for instance skipping parameters whose .grad is None on one rank only).")



def _peer_gone(error: str) -> bool:
    return "closed by peer" in error or "Connection reset" in error


# --------------------------------------------------------------------------------------------
# 04.a  data-parallel training with a hand-written gradient all-reduce
# --------------------------------------------------------------------------------------------

_A_STEPS, _A_BATCH, _A_LR = 4, 48, 0.2


def _sgd_variant(model, batches, lr, *, broadcast: bool, sync: str):
    """Reference implementations of right and wrong answers, to name the learner's mistake."""

    world = dist.get_world_size()
    if broadcast:
        with torch.no_grad():
            for p in model.parameters():
                dist.broadcast(p, src=0)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if sync != "none":
            for p in model.parameters():
                dist.all_reduce(p.grad)
                if sync == "mean":
                    p.grad /= world
        opt.step()
    return model


def _hand_allreduce_worker(train_fn: Callable) -> dict:


    backend, device = backend_and_device()
    dist.init_process_group(**process_group_kwargs(backend, device))
    try:
        rank = dist.get_rank()
        batches = _rank_batches(_A_STEPS, _A_BATCH, device)
        init = make_model(seed=100 + rank).to(device)  # a different start on every rank

        # torch DDP: the answer.
        ddp = wrap_ddp(copy.deepcopy(init), device)
        opt = torch.optim.SGD(ddp.parameters(), lr=_A_LR)
        for x, y in batches:
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
        expected = state_to_cpu(ddp.module)
        del ddp

        variants = {
            "sum": _sgd_variant(copy.deepcopy(init), batches, _A_LR, broadcast=True, sync="sum"),
            "no broadcast": _sgd_variant(copy.deepcopy(init), batches, _A_LR, broadcast=False, sync="mean"),
            "no sync": _sgd_variant(copy.deepcopy(init), batches, _A_LR, broadcast=True, sync="none"),
            "nothing": _sgd_variant(copy.deepcopy(init), batches, _A_LR, broadcast=False, sync="none"),
        }
        variant_states = {k: state_to_cpu(m) for k, m in variants.items()}
        dist.barrier()

        # The learner's function, on its own copy of the same start and data.
        mine = copy.deepcopy(init)
        # Record all-reduces of tensors inside the autograd graph (a loss): autograd does not
        # differentiate through dist.all_reduce, so they never reach the gradients.
        in_graph = [0]
        real_all_reduce = dist.all_reduce

        def all_reduce(tensor, *args, **kwargs):
            if isinstance(tensor, torch.Tensor) and tensor.grad_fn is not None:
                in_graph[0] += 1
            return real_all_reduce(tensor, *args, **kwargs)

        dist.all_reduce = all_reduce
        try:
            got = train_fn(mine, [(x.clone(), y.clone()) for x, y in batches], _A_LR)
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001 - reported to the learner with the rank
            return {"rank": rank, "error": _describe_error(e)}
        finally:
            dist.all_reduce = real_all_reduce
        if got is None:
            return {"rank": rank, "error": None, "returned": "None"}
        if not isinstance(got, torch.nn.Module):
            return {"rank": rank, "error": None, "returned": type(got).__name__}
        try:
            got_state = state_to_cpu(got)
        except Exception as e:  # noqa: BLE001
            return {"rank": rank, "error": _describe_error(e)}
        return {
            "rank": rank, "error": None, "returned": "module", "loss_all_reduces": in_graph[0],
            "expected": expected, "got": got_state,
            "variants": variant_states,
        }
    finally:
        dist.destroy_process_group()


@checker("04.a hand-written all-reduce")
def check_hand_allreduce(train_data_parallel: Callable, *, world_sizes=(2, 3),
                         timeout: float = 120.0) -> None:
    """Run ``train_data_parallel(model, batches, lr)`` on 2 and 3 ranks; compare with torch DDP."""
    require_callable(train_data_parallel, "train_data_parallel(model, batches, lr)")
    for world in world_sizes:
        results = run_workers(_hand_allreduce_worker, world, args=(train_data_parallel,),
                              timeout=timeout, hang_hint=_MISMATCH_HINT, error_hint=_MISMATCH_HINT)
        _judge_hand_allreduce(results, world)
    print(f"train_data_parallel matches torch DDP after {_A_STEPS} SGD steps on "
          f"{' and '.join(str(w) for w in world_sizes)} ranks, starting from a different "
          "initialisation on every rank")


def _judge_hand_allreduce(results: list[dict], world: int) -> None:
    for r in results:  # a rank waiting for a peer that had already left
        if r.get("error") and _peer_gone(r["error"]):
            raise CheckFailed(
                f"rank {r['rank']} of {world} was still waiting in a collective when another rank "
                f"had finished and left. Usual mistake: {_MISMATCH_HINT}")
    for r in results:
        if r.get("error"):
            raise CheckFailed(f"on rank {r['rank']} of {world}, train_data_parallel raised {r['error']}")
        if r["returned"] != "module":
            raise CheckFailed(f"train_data_parallel returned {r['returned']} on rank {r['rank']}; "
                              "expected the trained model (`return model`)")
    # Ranks that disagree with each other: name the cause from the reference variants.
    for r in results:
        got = r["got"]
        if close(r["expected"], got, atol=ATOL):
            continue
        v = r["variants"]
        where = f"rank {r['rank']} of {world}"
        if close(v["sum"], got, atol=ATOL):
            raise CheckFailed(
                f"on {where} the parameters are what training with the SUM of the gradients gives "
                f"(as if the learning rate were {world} times larger). Usual mistake: you summed "
                f"the gradients with dist.all_reduce but did not divide by the world size "
                f"({world}); DDP averages them.")
        if close(v["no broadcast"], got, atol=ATOL):
            raise CheckFailed(
                f"on {where} the gradients were averaged correctly, but the ranks started from "
                "different weights and so never agree. Usual mistake: not broadcasting the initial "
                "weights: before training, copy rank 0's parameters to every rank with "
                "dist.broadcast(p.data, src=0) (torch DDP does this in its constructor).")
        if r.get("loss_all_reduces"):
            raise CheckFailed(
                f"on {where} the gradients were never averaged: your code all-reduced a tensor of "
                f"the autograd graph (the loss) {r['loss_all_reduces']} time(s). Averaging the loss "
                "does not average the gradients: autograd does not differentiate through "
                "dist.all_reduce (torch warns 'c10d::allreduce_: an autograd kernel was not "
                "registered'), so backward still gives each rank the gradient of its own loss. "
                "After loss.backward(), all-reduce every p.grad and divide it by the world size.")
        if close(v["no sync"], got, atol=ATOL) or close(v["nothing"], got, atol=ATOL):
            raise CheckFailed(
                f"on {where} the model trained only on its own shard: its gradients were never "
                "all-reduced. Usual mistakes: all-reducing before backward (the .grad is then "
                "overwritten or still None) or after optimizer.step(), or all-reducing a copy "
                "(`g = p.grad.clone()`) instead of p.grad itself.")
        compare_tensors(
            r["expected"], got, atol=ATOL, what=f"parameters after {_A_STEPS} SGD steps", where=where,
            hint="all-reducing only some parameters (every .grad must be averaged), dividing by the "
                 "wrong number, or an optimizer other than SGD(model.parameters(), lr=lr).")
    first = results[0]["got"]
    for r in results[1:]:
        compare_tensors(first, r["got"], atol=ATOL, what="the parameters at the end",
                        where=f"rank {r['rank']} (compared with rank 0)")


# --------------------------------------------------------------------------------------------
# 04.b  mini DDP: DDPIndividualParameters
# --------------------------------------------------------------------------------------------

_B_STEPS, _B_BATCH, _B_LR, _B_MOMENTUM, _B_WORLD = 4, 48, 0.1, 0.9, 3


class FrozenAndShared(torch.nn.Module):
    """A model torch DDP accepts, with the two awkward cases: a frozen layer and shared parameters.

    ``frozen`` has ``requires_grad=False``; ``block`` is applied twice (one module, two uses) and
    ``tied.weight`` *is* ``block.weight`` (one Parameter in two modules); ``scale`` is a buffer.
    """

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            self.embed = torch.nn.Linear(32, 48)
            self.frozen = torch.nn.Linear(48, 48)
            self.frozen.requires_grad_(False)
            self.block = torch.nn.Linear(48, 48)
            self.tied = torch.nn.Linear(48, 48)
            self.tied.weight = self.block.weight  # shared between two layers
            self.head = torch.nn.Linear(48, 10)
            self.register_buffer("scale", torch.ones(48))
        finally:
            torch.random.set_rng_state(g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gelu = torch.nn.functional.gelu
        h = gelu(self.embed(x))
        h = gelu(self.frozen(h)) * self.scale
        h = gelu(self.block(h))
        h = gelu(self.block(h))  # the same layer again
        h = gelu(self.tied(h))
        return self.head(h)


def _b_models(rank: int) -> dict[str, torch.nn.Module]:
    """Each rank builds a *different* model (seed and buffers depend on the rank)."""

    course = make_model(seed=200 + rank, norm=True)
    with torch.no_grad():
        course.net[1].running_mean.fill_(0.1 * rank)  # a buffer rank 0 must broadcast
    awkward = FrozenAndShared(seed=300 + rank)
    with torch.no_grad():
        awkward.scale.fill_(1.0 + 0.1 * rank)
    return {"course model (BatchNorm)": course, "frozen + shared parameters": awkward}


class _Spy:
    """Watch the learner's communication: which gradient each all-reduce carries, when it starts
    (during backward or after it), whether it is asynchronous, and whether its handle is waited for.

    ``named`` maps the learner's parameter names to the parameters (a tied parameter once); an
    all-reduced tensor is attributed to the parameter whose ``.grad`` it is (or a fresh copy of).
    Hooks registered with ``Tensor.register_hook`` while ``watching`` are wrapped, so that an
    all-reduce of such a hook's argument (the gradient before it reaches ``.grad``) is recognised.
    """

    def __init__(self) -> None:
        self.phase: str | None = None
        self.watching = False
        self.named: dict[str, torch.Tensor] = {}
        self.events: list[dict] = []
        self.works: list[Any] = []
        self.hook_args: list[torch.Tensor] = []
        self.tensor_hooks = 0
        self.step = 0

    def owner(self, tensor: Any) -> str | None:
        if not isinstance(tensor, torch.Tensor):
            return None
        grads = [(n, p.grad) for n, p in self.named.items() if p.grad is not None]
        for n, g in grads:
            if g.shape == tensor.shape and g.data_ptr() == tensor.data_ptr():
                return n
        for n, g in grads:  # a copy made just before the all-reduce
            if g.shape == tensor.shape and g.dtype == tensor.dtype and torch.equal(g, tensor):
                return n
        return None

    def install(self) -> None:
        real = c10d.all_reduce
        real_register_hook = torch.Tensor.register_hook
        spy = self

        class WorkSpy:
            def __init__(self, work: Any):
                self._work = work
                self.waited = False
                self.step = spy.step
                spy.works.append(self)

            def wait(self, *args: Any, **kwargs: Any) -> Any:
                self.waited = True
                if spy.phase is not None:
                    spy.events.append({"kind": "wait", "phase": spy.phase, "old": self.step != spy.step})
                return self._work.wait(*args, **kwargs)

            def get_future(self) -> Any:
                self.waited = True  # torch.futures.wait_all(...) and friends
                return self._work.get_future()

            def is_completed(self) -> bool:
                done = self._work.is_completed()
                self.waited = self.waited or done
                return done

            def __getattr__(self, name: str) -> Any:
                return getattr(self._work, name)

        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            if spy.phase is not None:
                spy.events.append({
                    "kind": "all_reduce", "phase": spy.phase, "async": bool(async_op),
                    "missing": sum(p.grad is None for p in spy.named.values() if p.requires_grad),
                    "owner": spy.owner(tensor),
                    "hook_arg": isinstance(tensor, torch.Tensor) and any(
                        a.data_ptr() == tensor.data_ptr() for a in spy.hook_args),
                })
            work = real(tensor, op=op, group=group, async_op=async_op)
            if async_op and work is not None and spy.phase is not None:
                return WorkSpy(work)
            return work

        def register_hook(tensor: torch.Tensor, hook: Callable) -> Any:
            if not (spy.watching and tensor.is_leaf):
                return real_register_hook(tensor, hook)
            spy.tensor_hooks += 1

            def watched(grad: torch.Tensor) -> Any:
                spy.hook_args.append(grad)
                try:
                    return hook(grad)
                finally:
                    spy.hook_args.pop()

            return real_register_hook(tensor, watched)

        dist.all_reduce = all_reduce
        c10d.all_reduce = all_reduce
        torch.Tensor.register_hook = register_hook


def _b_optimizer(params: Any) -> torch.optim.Optimizer:
    """SGD with momentum: its state carries every step's gradient into the following steps."""
    return torch.optim.SGD(params, lr=_B_LR, momentum=_B_MOMENTUM)


def _momentum(opt: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: opt.state[p]["momentum_buffer"].detach().cpu().clone()
            for n, p in model.named_parameters() if opt.state[p].get("momentum_buffer") is not None}


def _mini_ddp_case(cls: Any, case: str, init: torch.nn.Module, batches: list, device, spy: _Spy) -> dict:
    """One model: torch DDP and the learner's wrapper side by side, step by step.

    Everything the learner's code raises is caught and recorded; the torch DDP reference lives
    only in this function, so it is gone before the caller destroys the process group (a DDP
    model that outlives its process group can hang the process on gloo).
    """

    res: dict[str, Any] = {"case": case, "rank": dist.get_rank()}
    sync_flag = ("forward_sync_buffers" if "forward_sync_buffers" in
                 inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
                 else "broadcast_buffers")
    ddp = wrap_ddp(copy.deepcopy(init), device, **{sync_flag: False})
    if sync_flag == "broadcast_buffers":  # old PyTorch: False also skipped the broadcast at init
        for b in ddp.module.buffers():
            dist.broadcast(b, src=0)
    ref_opt = _b_optimizer(ddp.parameters())
    mine = copy.deepcopy(init)
    spy.named, spy.tensor_hooks = dict(mine.named_parameters()), 0
    spy.watching = True
    try:
        wrapped = cls(mine)
    except NotImplementedError as e:
        res["not_implemented"] = str(e)
        return res
    except Exception as e:  # noqa: BLE001
        res["error"] = ("construct", _describe_error(e), spy.tensor_hooks)
        return res
    finally:
        spy.watching = False
    if not isinstance(wrapped, torch.nn.Module):
        res["error"] = ("type", type(wrapped).__name__, 0)
        return res
    if getattr(wrapped, "module", None) is not mine:
        res["error"] = ("module", type(getattr(wrapped, "module", None)).__name__, 0)
        return res
    res["construct"] = (state_to_cpu(ddp.module), state_to_cpu(mine))
    res["trainable"] = [n for n, p in spy.named.items() if p.requires_grad]
    opt = _b_optimizer(mine.parameters())
    res["steps"] = []
    for step, (x, y) in enumerate(batches):
        set_to_none = step % 2 == 0  # odd steps zero .grad in place: stale handles show up
        ref_opt.zero_grad(set_to_none=set_to_none)
        F.cross_entropy(ddp(x), y).backward()
        ref_grads = {n: p.grad.detach().cpu().clone() for n, p in ddp.module.named_parameters()
                     if p.grad is not None}
        opt.zero_grad(set_to_none=set_to_none)
        spy.events, spy.works, spy.step = [], [], step
        spy.watching = True
        try:
            loss = F.cross_entropy(wrapped(x), y)
            spy.phase = "backward"
            loss.backward()
            spy.phase = "finish"
            wrapped.finish_gradient_synchronization()
        except NotImplementedError as e:
            res["not_implemented"] = str(e)
            return res
        except Exception as e:  # noqa: BLE001
            res["error"] = (f"step {step}", _describe_error(e), spy.tensor_hooks)
            return res
        finally:
            spy.phase = None
            spy.watching = False
        grads = {n: p.grad.detach().cpu().clone() for n, p in mine.named_parameters()
                 if p.grad is not None}
        ref_opt.step()
        opt.step()
        res["steps"].append({
            "set_to_none": set_to_none, "events": list(spy.events),
            "unwaited": sum(not w.waited for w in spy.works), "started": len(spy.works),
            "ref_grads": ref_grads, "grads": grads,
            "ref_params": state_to_cpu(ddp.module), "params": state_to_cpu(mine),
            "ref_momentum": _momentum(ref_opt, ddp.module), "momentum": _momentum(opt, mine),
        })
    return res


def _mini_ddp_worker(cls_bytes: bytes) -> list[dict]:

    backend, device = backend_and_device()
    dist.init_process_group(**process_group_kwargs(backend, device))
    spy = _Spy()
    spy.install()  # before the learner's module is imported, so that every call is seen
    out: list[dict] = []
    try:
        cls = cloudpickle.loads(cls_bytes)
        batches = _rank_batches(_B_STEPS, _B_BATCH, device)
        for case, init in _b_models(dist.get_rank()).items():
            res = _mini_ddp_case(cls, case, init.to(device), batches, device, spy)
            out.append(res)
            if "error" in res or "not_implemented" in res:
                break
            dist.barrier()
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    for res in out:
        if "not_implemented" in res:
            raise NotImplementedError(res["not_implemented"])
    return out


@checker("04.b mini DDP")
def check_mini_ddp(DDPIndividualParameters: Any, *, timeout: float = 120.0) -> None:
    """Run the learner's wrapper on 3 ranks beside torch DDP; compare states and gradients."""

    require_callable(DDPIndividualParameters, "the class DDPIndividualParameters(module)")
    try:
        payload = cloudpickle.dumps(DDPIndividualParameters)
    except Exception as e:
        raise CheckFailed(f"DDPIndividualParameters cannot be sent to the worker processes: {e}") from None
    results = run_workers(_mini_ddp_worker, _B_WORLD, args=(payload,), timeout=timeout,
                          hang_hint=_MISMATCH_HINT, error_hint=_MISMATCH_HINT)
    _judge_mini_ddp(results)
    print(f"DDPIndividualParameters matches torch DDP on {_B_WORLD} ranks over {_B_STEPS} steps of SGD "
          "with momentum (gradients, parameters and momentum after every step; course model with "
          "BatchNorm, and a model with a frozen layer and a shared parameter): every trainable "
          "gradient all-reduced once per step, asynchronously, from its hook during backward, and "
          "waited for in finish_gradient_synchronization()")


def _judge_mini_ddp(results: list[list[dict]]) -> None:
    world = len(results)
    n_cases = max(len(r) for r in results)
    for i in range(n_cases):
        case = [per_rank[i] for per_rank in results if i < len(per_rank)]
        for res in case:  # errors first, then the state after construction, on every rank ...
            _judge_error(res, world)
        for res in case:
            _judge_construction(res, world)
        for res in case:  # ... and only then the training steps
            _judge_training(res, world)
    # All ranks must hold the same parameters at the end (buffers may differ: each rank's
    # BatchNorm statistics follow its own data, as with torch DDP(forward_sync_buffers=False)).
    for i in range(n_cases):
        first = results[0][i]["steps"][-1]
        params0 = {n: first["params"][n] for n in first["grads"]}
        for per_rank in results[1:]:
            last = per_rank[i]["steps"][-1]
            compare_tensors(params0, {n: last["params"][n] for n in last["grads"]}, atol=ATOL,
                            what=f"{per_rank[i]['case']}: parameters at the end",
                            where=f"rank {per_rank[i]['rank']} (compared with rank 0)")


def _where(res: dict, world: int) -> str:
    return f"{res['case']}, rank {res['rank']} of {world}"


_TENSOR_HOOK = (
    "Tensor.register_hook(hook) calls hook(grad) *before* that gradient is accumulated into "
    "param.grad (param.grad is then still None, or still holds its old value), and torch's "
    "documentation says the hook must not modify its argument. Register "
    "param.register_post_accumulate_grad_hook(hook) instead: it runs once param.grad holds the "
    "complete gradient, and hook(param) can all-reduce param.grad in place.")


def _judge_error(res: dict, world: int) -> None:
    where = _where(res, world)
    err = res.get("error")
    if err:
        stage, text, tensor_hooks = err
        if stage == "construct":
            hint = ""
            if "require" in text and "grad" in text:
                hint = (" Usual mistake: registering a hook on a parameter with requires_grad=False "
                        "(a frozen parameter has no gradient and accepts no hook): skip those.")
            raise CheckFailed(f"{where}: DDPIndividualParameters(model) raised {text}.{hint}")
        if stage == "type":
            raise CheckFailed(f"{where}: DDPIndividualParameters(model) gave a {text}, not an "
                              "nn.Module; subclass nn.Module and call super().__init__() first")
        if stage == "module":
            raise CheckFailed(f"{where}: the wrapper's `.module` is {text}, not the module it "
                              "wraps; store it as self.module = module, as torch DDP does")
        hint = ""
        if "NoneType" in text and tensor_hooks:
            hint = " Usual mistake: " + _TENSOR_HOOK
        elif "NoneType" in text:
            hint = (" Usual mistake: reading the .grad of a parameter that has none: a frozen "
                    "parameter (requires_grad=False) never gets a gradient, so loop over the "
                    "trainable parameters only, or over the gradients your hooks collected; or "
                    "handles kept from an earlier step.")
        raise CheckFailed(f"{where}: training {stage} raised {text}.{hint}")


def _judge_construction(res: dict, world: int) -> None:
    where = _where(res, world)
    expected, got = res["construct"]
    if close(expected, got, atol=ATOL):
        return
    bad = [n for n, d, _ in diff_table(expected, got) if d > ATOL]
    buffers_only = all(("running" in n or "num_batches" in n or n == "scale") for n in bad)
    what = "buffers" if buffers_only else "parameters"
    compare_tensors(
        expected, got, atol=ATOL, what=f"right after construction the {what}",
        where=where + " (the reference is rank 0's state)",
        hint=f"not broadcasting the initial {what} from rank 0 in __init__ "
             "(dist.broadcast(t, src=0) for every parameter and every buffer). Seeding every rank "
             "alike is not enough: nothing guarantees it, and the buffers are still the rank's own.")


def _judge_training(res: dict, world: int) -> None:
    where = _where(res, world)
    for step, s in enumerate(res["steps"]):
        _judge_communication(where, step, s, res["trainable"])
        _judge_values(where, step, s, world)


def _judge_communication(where: str, step: int, s: dict, trainable: list[str]) -> None:
    """Which gradients were all-reduced, when, asynchronously or not, and whether anything waited."""
    events = s["events"]
    reduces = [e for e in events if e["kind"] == "all_reduce"]
    in_backward = [e for e in events if e["phase"] == "backward"]
    reduces_bw = [e for e in in_backward if e["kind"] == "all_reduce"]
    at = f"{where}, step {step}"
    if not reduces:
        return  # nothing seen (another collective, or none): the values below say what is wrong
    if any(e["hook_arg"] for e in reduces):
        raise CheckFailed(f"{at}: your hook all-reduced the gradient passed to a "
                          f"Tensor.register_hook hook. {_TENSOR_HOOK}")
    if not reduces_bw:
        raise CheckFailed(
            f"{at}: no all-reduce started during backward; they all start in "
            "finish_gradient_synchronization(), after backward has ended, so communication cannot "
            "overlap backward (the numbers can be right, the point of the exercise is missed). "
            "Start each gradient's all-reduce from a hook as soon as it is ready "
            "(param.register_post_accumulate_grad_hook) and only wait in "
            "finish_gradient_synchronization().")
    sync = [e for e in reduces_bw if not e["async"]]
    waits = [e for e in in_backward if e["kind"] == "wait"]
    if sync or waits:
        how = "a blocking dist.all_reduce (async_op=False)" if sync else "work.wait()"
        raise CheckFailed(
            f"{at}: during backward your hook waited for communication ({how}), so "
            "backward stalls at every gradient until its all-reduce is done: no overlap. "
            "Use dist.all_reduce(grad, async_op=True), keep the handle, and wait for it in "
            "finish_gradient_synchronization() after backward ends.")
    owners = [e["owner"] for e in reduces]
    counts = {n: owners.count(n) for n in trainable}
    twice = sorted(n for n, c in counts.items() if c > 1)
    if twice and all(c == counts[trainable[0]] for c in counts.values()):
        raise CheckFailed(
            f"{at}: every gradient was all-reduced {counts[trainable[0]]} times in one step: the "
            "hooks were registered again (in forward(), or in each step), and every registration "
            "adds one more hook. Register them once, in __init__.")
    if twice:
        raise CheckFailed(
            f"{at}: the gradient of {', '.join(twice)} was all-reduced "
            f"{max(counts[n] for n in twice)} times in one backward. Usual mistake: a parameter "
            "shared by two layers got two hooks (module.named_parameters(remove_duplicate=False), "
            "or a loop over the modules that each own it); module.parameters() lists a shared "
            "parameter once: hook it, and all-reduce it, once.")
    if len(reduces) > len(trainable):
        raise CheckFailed(
            f"{at}: one backward made {len(reduces)} all-reduce calls for {len(trainable)} trainable "
            "parameters, so some gradient was all-reduced twice. Usual mistake: a parameter shared "
            "by two layers got two hooks (module.named_parameters(remove_duplicate=False), or one "
            "hook per module that owns it); module.parameters() lists each shared parameter once.")
    never = [n for n, c in counts.items() if c == 0]
    if never and None not in owners:
        raise CheckFailed(
            f"{at}: the gradients of {', '.join(never[:4])} were never all-reduced; every "
            "parameter with requires_grad=True needs a hook (and frozen ones none).")
    if s["set_to_none"] and reduces_bw[0]["missing"] == 0:
        raise CheckFailed(
            f"{at}: the first all-reduce started only after backward had computed every "
            "gradient, so nothing overlaps. Start each parameter's all-reduce from its own "
            "hook, as soon as its gradient is ready.")
    if s["unwaited"]:
        raise CheckFailed(
            f"{at}: finish_gradient_synchronization() returned without waiting for "
            f"{s['unwaited']} of the {s['started']} asynchronous all-reduces started during this "
            "step. An async_op=True all-reduce may still be writing into the gradient: call "
            "work.wait() on every handle before dividing, so that optimizer.step() sees the "
            "finished sum.")
    old = [e for e in events if e["kind"] == "wait" and e["old"]]
    if old:
        raise CheckFailed(
            f"{at}: finish_gradient_synchronization() waited again for {len(old)} handle(s) of an "
            "earlier step: the list of handles is never cleared, so it grows every step and the "
            "gradients of earlier steps are divided again (when .grad is zeroed in place, these "
            "are this step's gradient tensors). Empty the list at the end of "
            "finish_gradient_synchronization().")


def _judge_values(where: str, step: int, s: dict, world: int) -> None:
    at = f"{where}, step {step}"
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
            raise CheckFailed(
                f"{at}: the gradients are {world} times torch DDP's: you summed them "
                f"over the {world} ranks but did not divide by the world size. DDP averages.")
        shared = {"block.weight", "block.bias", "tied.weight", "tied.bias"}
        if set(bad) <= shared:
            hint = ("a parameter used by two layers got two hooks or two all-reduces "
                    "(module.named_parameters(remove_duplicate=False), or one hook per module that "
                    "owns it). module.parameters() lists it once: all-reduce it once.")
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
