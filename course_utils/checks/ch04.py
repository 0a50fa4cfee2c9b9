"""Checkers of chapter 04 (DistributedDataParallel).

Both run the learner's code in real worker processes (``run_workers``; gloo on CPU, NCCL with a GPU per
rank) next to torch's own ``DistributedDataParallel`` on the same data, and compare, rank by rank.

- ``check_hand_allreduce(train_data_parallel)``: ``train_data_parallel(model, batches, lr)`` trains
  ``model`` (a different initialisation on each rank) with SGD on this rank's ``batches``, averaging
  gradients across ranks by hand; it must end where torch DDP ends.
- ``check_mini_ddp(DDPIndividualParameters)``: the class of ``mini_ddp.py`` must broadcast rank 0's
  state at construction, start an asynchronous all-reduce per gradient from a hook *during*
  backward, and average in ``finish_gradient_synchronization()``; checked against torch DDP on the
  course model and on a model with a frozen and a shared parameter.

Misconceptions 04.a recognises (tests/test_ch04_hand_allreduce.py, the wrong answer in brackets):

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

04.b's mistakes (tests/test_ch04_mini_ddp.py): no broadcast at all [NoBroadcast] or of the
parameters only, not the buffers [ParametersOnlyBroadcast]; summed gradients [Sums]; hooks on
frozen parameters [HooksOnFrozen]; waiting inside the hook, so nothing overlaps backward
[WaitsInHook]; every all-reduce started after backward [AllReduceAfterBackward]; a shared
parameter all-reduced twice [SharedTwice]; handles of the previous step reused [KeepsOldHandles];
no ``.module`` [NoModuleAttribute].  Accepted: the solution and a compact variant.
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
    diff_table,
    format_table,
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


def _close(rows: list, atol: float = ATOL) -> bool:
    return all(d <= atol for _, d, _ in rows)


def _worst(rows: list) -> float:
    return max((d for _, d, _ in rows), default=0.0)


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
            "variants": {k: diff_table(s, got_state) for k, s in variant_states.items()},
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
        rows = diff_table(r["expected"], r["got"])
        if _close(rows):
            continue
        v = r["variants"]
        where = f"rank {r['rank']} of {world}"
        if _close(v["sum"]):
            raise CheckFailed(
                f"on {where} the parameters are what training with the SUM of the gradients gives "
                f"(as if the learning rate were {world} times larger). Usual mistake: you summed "
                f"the gradients with dist.all_reduce but did not divide by the world size "
                f"({world}); DDP averages them.")
        if _close(v["no broadcast"]):
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
        if _close(v["no sync"]) or _close(v["nothing"]):
            raise CheckFailed(
                f"on {where} the model trained only on its own shard: its gradients were never "
                "all-reduced. Usual mistakes: all-reducing before backward (the .grad is then "
                "overwritten or still None) or after optimizer.step(), or all-reducing a copy "
                "(`g = p.grad.clone()`) instead of p.grad itself.")
        raise CheckFailed(
            f"parameters on {where} differ from torch DDP's after {_A_STEPS} SGD steps:\n"
            f"{format_table(rows, ATOL)}\nUsual mistakes: all-reducing only some parameters "
            "(every .grad must be averaged), dividing by the wrong number, or an optimizer "
            "other than SGD(model.parameters(), lr=lr).")
    first = results[0]["got"]
    for r in results[1:]:
        rows = diff_table(first, r["got"])
        if not _close(rows):
            raise CheckFailed(f"rank {r['rank']} ended with different parameters from rank 0:\n"
                              f"{format_table(rows, ATOL)}")


# --------------------------------------------------------------------------------------------
# 04.b  mini DDP: DDPIndividualParameters
# --------------------------------------------------------------------------------------------

_B_STEPS, _B_BATCH, _B_LR, _B_WORLD = 4, 48, 0.2, 3


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
    """Watch the learner's all_reduce calls: when, async or not, and when they are waited for."""

    def __init__(self) -> None:
        self.phase: str | None = None
        self.params: list[torch.Tensor] = []
        self.events: list[tuple] = []
        self.calls = 0

    def install(self) -> None:
        
        real = c10d.all_reduce
        spy = self

        class WorkSpy:
            def __init__(self, work: Any):
                self._work = work

            def wait(self, *args: Any, **kwargs: Any) -> Any:
                if spy.phase is not None:
                    spy.events.append(("wait", spy.phase))
                return self._work.wait(*args, **kwargs)

            def __getattr__(self, name: str) -> Any:
                return getattr(self._work, name)

        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            if spy.phase is not None:
                spy.calls += 1
                missing = sum(p.grad is None for p in spy.params)
                spy.events.append(("all_reduce", spy.phase, bool(async_op), missing))
            work = real(tensor, op=op, group=group, async_op=async_op)
            if async_op and work is not None:
                return WorkSpy(work)
            return work

        dist.all_reduce = all_reduce
        c10d.all_reduce = all_reduce


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
    ref_opt = torch.optim.SGD(ddp.parameters(), lr=_B_LR)
    mine = copy.deepcopy(init)
    try:
        wrapped = cls(mine)
    except NotImplementedError as e:
        res["not_implemented"] = str(e)
        return res
    except Exception as e:  # noqa: BLE001
        res["error"] = ("construct", _describe_error(e))
        return res
    if not isinstance(wrapped, torch.nn.Module):
        res["error"] = ("type", type(wrapped).__name__)
        return res
    if getattr(wrapped, "module", None) is not mine:
        res["error"] = ("module", type(getattr(wrapped, "module", None)).__name__)
        return res
    res["construct"] = diff_table(state_to_cpu(ddp.module), state_to_cpu(mine))
    spy.params = [p for p in mine.parameters() if p.requires_grad]
    opt = torch.optim.SGD(mine.parameters(), lr=_B_LR)
    res["steps"] = []
    for step, (x, y) in enumerate(batches):
        set_to_none = step % 2 == 0  # odd steps zero .grad in place: stale handles show up
        ref_opt.zero_grad(set_to_none=set_to_none)
        F.cross_entropy(ddp(x), y).backward()
        ref_grads = {n: p.grad.detach().cpu().clone() for n, p in ddp.module.named_parameters()
                     if p.grad is not None}
        opt.zero_grad(set_to_none=set_to_none)
        spy.events = []
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
            res["error"] = (f"step {step}", _describe_error(e))
            return res
        finally:
            spy.phase = None
        grads = {n: p.grad.detach().cpu().clone() for n, p in mine.named_parameters()
                 if p.grad is not None}
        ratios = {}
        for n, g in ref_grads.items():
            if n in grads and g.norm() > 0:
                ratios[n] = (grads[n].double().norm() / g.double().norm()).item()
        res["steps"].append({
            "set_to_none": set_to_none, "events": list(spy.events),
            "missing": sorted(set(ref_grads) - set(grads)), "extra": sorted(set(grads) - set(ref_grads)),
            "grads": diff_table(ref_grads, grads), "ratios": ratios, "n_params": len(spy.params),
        })
        ref_opt.step()
        opt.step()
    res["final"] = diff_table(state_to_cpu(ddp.module), state_to_cpu(mine))
    res["final_state"] = {n: p.detach().cpu().clone() for n, p in mine.named_parameters()}
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
    print(f"DDPIndividualParameters matches torch DDP on {_B_WORLD} ranks after {_B_STEPS} SGD steps "
          "(course model with BatchNorm; a model with a frozen layer and shared parameters), and "
          "overlaps its all-reduces with backward")


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
        first = results[0][i].get("final_state")
        for per_rank in results[1:]:
            if i < len(per_rank) and first is not None and "final_state" in per_rank[i]:
                rows = diff_table(first, per_rank[i]["final_state"])
                if not _close(rows):
                    raise CheckFailed(f"{per_rank[i]['case']}: rank {per_rank[i]['rank']} ended "
                                      f"different from rank 0:\n{format_table(rows, ATOL)}")


def _where(res: dict, world: int) -> str:
    return f"{res['case']}, rank {res['rank']} of {world}"


def _judge_error(res: dict, world: int) -> None:
    where = _where(res, world)
    err = res.get("error")
    if err:
        stage, text = err
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
        if "NoneType" in text:
            hint = (" Usual mistake: a hook that reads the .grad of a parameter that has none (a frozen "
                    "parameter), or handles kept from an earlier step.")
        raise CheckFailed(f"{where}: training {stage} raised {text}.{hint}")


def _judge_construction(res: dict, world: int) -> None:
    where = _where(res, world)
    construct = res["construct"]
    if not _close(construct):
        bad = [n for n, d, _ in construct if d > ATOL]
        buffers_only = all(("running" in n or "num_batches" in n or n == "scale") for n in bad)
        what = "buffers" if buffers_only else "parameters"
        raise CheckFailed(
            f"{where}: right after construction the {what} {', '.join(bad[:4])} differ from rank 0's:\n"
            f"{format_table(construct, ATOL)}\nUsual mistake: not broadcasting the initial "
            f"{what} from rank 0 in __init__ (dist.broadcast(t, src=0) for every parameter "
            "and every buffer).")


def _judge_training(res: dict, world: int) -> None:
    where = _where(res, world)
    for step, s in enumerate(res["steps"]):
        _judge_step(where, step, s, world)

    final = res["final"]
    if not _close(final):
        raise CheckFailed(f"{where}: after {_B_STEPS} SGD steps the module differs from torch DDP's:\n"
                          f"{format_table(final, ATOL)}")


def _judge_step(where: str, step: int, s: dict, world: int) -> None:
    events = s["events"]
    in_backward = [e for e in events if e[1] == "backward"]
    reduces_bw = [e for e in in_backward if e[0] == "all_reduce"]
    reduces_all = [e for e in events if e[0] == "all_reduce"]
    if reduces_all:  # the spy saw the learner's calls: judge the timing
        if not reduces_bw:
            raise CheckFailed(
                f"{where}: no all-reduce started during backward; they all start in "
                "finish_gradient_synchronization(), so communication cannot overlap backward. "
                "Start each gradient's all-reduce from a hook as soon as it is ready "
                "(param.register_post_accumulate_grad_hook) and only wait in "
                "finish_gradient_synchronization().")
        sync = [e for e in reduces_bw if not e[2]]
        waits = [e for e in in_backward if e[0] == "wait"]
        if sync or waits:
            how = "a blocking dist.all_reduce (async_op=False)" if sync else "work.wait()"
            raise CheckFailed(
                f"{where}: during backward your hook waited for communication ({how}), so "
                "backward stalls at every gradient until its all-reduce is done: no overlap. "
                "Use dist.all_reduce(grad, async_op=True), keep the handle, and wait for it in "
                "finish_gradient_synchronization() after backward ends.")
        if len(reduces_all) > s["n_params"]:
            raise CheckFailed(
                f"{where}: one backward made {len(reduces_all)} all-reduce calls for "
                f"{s['n_params']} trainable parameters, so some gradient was all-reduced twice. "
                "Usual mistake: a parameter shared by two layers got two hooks "
                "(module.named_parameters(remove_duplicate=False), or one hook per module that "
                "owns it); module.parameters() lists each shared parameter once.")
        if s["set_to_none"] and reduces_bw[0][3] == 0:
            raise CheckFailed(
                f"{where}: the first all-reduce started only after backward had computed every "
                "gradient, so nothing overlaps. Start each parameter's all-reduce from its own "
                "hook, as soon as its gradient is ready.")
    if s["missing"]:
        raise CheckFailed(f"{where}: after finish_gradient_synchronization() (step {step}) these "
                          f"parameters have no gradient: {', '.join(s['missing'][:4])}")
    if s["extra"]:
        raise CheckFailed(f"{where}: these parameters got a gradient though torch DDP's did not: "
                          f"{', '.join(s['extra'][:4])} (a frozen parameter must keep .grad None)")
    rows = s["grads"]
    if _close(rows):
        return
    bad = [n for n, d, _ in rows if d > ATOL]
    ratios = [s["ratios"][n] for n in bad if n in s["ratios"]]
    shared = [n for n in bad if n.startswith(("block.", "tied."))]
    if ratios and all(abs(r - world) < 1e-3 * world for r in ratios):
        raise CheckFailed(
            f"{where}: at step {step} the gradients are {world} times torch DDP's: you summed them "
            f"over the {world} ranks but did not divide by the world size. DDP averages.")
    if shared and set(bad) <= {"block.weight", "block.bias", "tied.weight", "tied.bias"}:
        raise CheckFailed(
            f"{where}: at step {step} only the shared parameters ({', '.join(bad)}) have wrong "
            f"gradients:\n{format_table(rows, ATOL)}\nUsual mistake: a parameter used by two layers "
            "got two hooks or two all-reduces (module.named_parameters(remove_duplicate=False), or "
            "one hook per module that owns it). module.parameters() lists it once: all-reduce it once.")
    stale = "" if s["set_to_none"] else (
        " This step zeroed .grad in place (optimizer.zero_grad(set_to_none=False)): if the earlier "
        "steps passed, the handles of the previous step were probably waited for and divided "
        "again; clear them in finish_gradient_synchronization().")
    raise CheckFailed(
        f"{where}: at step {step} the gradients after finish_gradient_synchronization() differ from "
        f"torch DDP's:\n{format_table(rows, ATOL)}\nUsual mistakes: dividing before the all-reduce "
        "has finished (wait first), not waiting for every handle, or all-reducing a copy of the "
        f"gradient instead of param.grad itself.{stale}")
