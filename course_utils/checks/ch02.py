"""Checkers of chapter 02 (DataParallel): one DataParallel step written by hand on CPU.

``check_dp_step(dp_step)`` runs the learner's ``dp_step(model, x, y, n_devices)`` on several batch
sizes and device counts (some that do not split evenly) and compares the outputs, the loss and the
gradients left in ``model``'s parameters with one plain single-process step on the whole batch.
It also watches *how* the step ran: into how many pieces the batch was cut, on which module objects
and in which threads the forward passes ran, and whether the replicas were running at the same time
(each replica's forward waits, for a bounded time, until every replica has started its own).

What learners get wrong is ``CATALOGUE`` below: each entry's key names the answer written with that
misconception in tests/checkers/test_ch02_dp_step.py, its message is what the failure says.
"""

from __future__ import annotations

import copy
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..checking import (
    Catalogue,
    CheckFailed,
    Misconception,
    checker,
    close,
    compare_tensors,
    require_callable,
)
from ..data import make_dataset, make_model

__all__ = ["CATALOGUE", "check_dp_step"]

# (batch size, devices).  Even splits first, so that a mistake that only shows on uneven splits is
# named as such.  10 on 4 devices gives chunks 3,3,3,1; 5 on 4 gives 2,2,1 (three replicas only).
_CASES = [(8, 2), (12, 3), (6, 1), (10, 4), (5, 4)]

_USAGE = "dp_step(model, x, y, n_devices) returning (outputs, loss)"

# How long a replica's forward waits for the other replicas to start theirs.  Replicas in their own
# started threads all arrive within milliseconds; replicas run one after another never do, and the
# wait then costs this once per case.
_TOGETHER_S = 2.0


CATALOGUE = Catalogue(
    "02.a data parallel step",
    Misconception(
        "dp_step_tensor_split",
        "any even-ish split will do (tensor_split, a hand-made split)",
        "the replicas saw chunks of other sizes than x.chunk(n_devices) gives",
        "cuts the batch like torch.chunk"),
    Misconception(
        "dp_step_no_replicas",
        "the threads can share the model",
        "the forward hook saw the original model's own forward on a chunk",
        "the original `model` ran on a chunk: DataParallel replicates the module every step, one "
        "copy per device, and runs the copies (replicate(), then parallel_apply()). Running one "
        "module object from several threads is not what DataParallel does."),
    Misconception(
        "dp_step_detached_replicas",
        "copy.deepcopy(model) is a replica",
        "the model's parameters have no gradient after the step",
        "the replicas are detached copies (copy.deepcopy(model) copies the parameters as new "
        "leaves, so their gradients never reach `model`)"),
    Misconception(
        "dp_step_sequential",
        "a loop is parallel enough",
        "every replica's forward ran in the calling thread",
        "every replica ran in the calling thread, one after another: DataParallel's parallel_apply "
        "runs each replica in its own thread (threading.Thread, start them all, then join them all)."),
    Misconception(
        "dp_step_one_worker_thread",
        "one worker thread is a parallel_apply",
        "the replicas ran in fewer threads than there are replicas",
        "one thread per replica, not one thread running them all. A single worker thread that "
        "loops over the replicas is as sequential as a plain loop"),
    Misconception(
        "dp_step_small_pool",
        "a thread pool of any size runs the replicas together",
        "the replicas ran in fewer threads than there are replicas",
        "parallel_apply starts a thread for every replica (a pool needs at least as many workers as "
        "replicas)"),
    Misconception(
        "dp_step_join_each",
        "start, join, start, join",
        "each replica had its own thread, but they never all waited at once in their forwards",
        "the replicas did not run at the same time: a thread was joined before the next one was "
        "started (start, join, start, join runs them one after another). Start every thread "
        "first, then join them all."),
    Misconception(
        "dp_step_gather_as_finished",
        "outputs come back as the threads finish",
        "the outputs hold the right rows in another order",
        "hold the right rows in the wrong order: gather must concatenate the replicas' outputs in "
        "chunk order (output i from chunk i), not in the order the threads finish."),
    Misconception(
        "dp_step_sum_of_losses",
        "each replica has its loss, and they add up",
        "the loss is the sum of the per-chunk mean losses",
        "Compute one loss on the gathered outputs: F.cross_entropy(torch.cat(outputs), y)."),
    Misconception(
        "dp_step_mean_of_means",
        "the mean of the replicas' losses is the batch's loss",
        "on uneven chunks, the loss is the mean of the per-chunk mean losses",
        "the average of the per-replica mean losses"),
    Misconception(
        "dp_step_with_optimizer_step",
        "dp_step is a training step",
        "the parameters changed",
        "it should compute gradients only; the optimizer step comes after it, in the training loop."),
    Misconception(
        "dp_step_no_backward",
        "the loss is computed, so gradients exist",
        "the model's parameters have no gradient after the step",
        "loss.backward() was not called"),
)
_hint = CATALOGUE.hint


def _reference(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
    ref = copy.deepcopy(model)
    out = ref(x)
    loss = F.cross_entropy(out, y)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    return out.detach(), loss.detach(), grads


def _is_row_permutation(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """True when ``got`` holds the rows of ``ref`` in another order."""
    if got.shape != ref.shape:
        return False
    used = set()
    for row in got:
        d = (ref - row).abs().amax(dim=1)
        hits = [i for i in torch.nonzero(d < 1e-5).flatten().tolist() if i not in used]
        if not hits:
            return False
        used.add(hits[0])
    return True


@checker("02.a data parallel step", in_process=True)
def check_dp_step(dp_step: Callable[..., Any]) -> None:
    """Check ``dp_step(model, x, y, n_devices) -> (outputs, loss)``: one DataParallel step on CPU.

    The step must scatter ``x`` with ``torch.chunk`` semantics, run one replica per chunk in its
    own thread, gather the outputs in order, compute the mean cross-entropy over the whole batch and
    call ``backward`` so that the gradients land in ``model``'s own parameters.
    """
    require_callable(dp_step, _USAGE)

    data = make_dataset(64, seed=2)
    for case, (batch, n_devices) in enumerate(_CASES):
        model = make_model(seed=case)
        x, y = data.tensors[0][:batch].clone(), data.tensors[1][:batch].clone()
        out_ref, loss_ref, grads_ref = _reference(model, x, y)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        chunks = x.chunk(n_devices)
        n_chunks = len(chunks)
        where = f"a batch of {batch} on {n_devices} device(s)"
        uneven = len({c.shape[0] for c in chunks}) > 1

        # (thread, module id, rows).  The Thread objects stay referenced, so two threads that ran
        # one after the other are told apart even when the system reuses the first one's ident.
        calls: list[tuple[threading.Thread, int, int]] = []
        together: list[bool] = []  # per forward: did every replica reach its forward at once?
        lock = threading.Lock()
        barrier = threading.Barrier(n_chunks) if n_chunks > 1 else None

        # Copied into every replica made with copy.deepcopy / copy.copy (functions are copied by
        # reference); the defaults bind this case's lists, lock and barrier.
        def seen(module, args, calls=calls, together=together, lock=lock, barrier=barrier):
            rows = args[0].shape[0] if args and isinstance(args[0], torch.Tensor) else -1
            with lock:
                calls.append((threading.current_thread(), id(module), rows))
            if barrier is not None:
                try:
                    barrier.wait(timeout=_TOGETHER_S)
                    met = True
                except threading.BrokenBarrierError:
                    met = False
                with lock:
                    together.append(met)

        handle = model.register_forward_pre_hook(seen)
        try:
            result = dp_step(model, x, y, n_devices)
        except NotImplementedError:
            raise
        except Exception as e:
            raise CheckFailed(
                f"dp_step raised {type(e).__name__}: {e} (for {where}"
                + (f"; the chunks have sizes {[c.shape[0] for c in chunks]}" if uneven else "")
                + ")"
            ) from e
        finally:
            handle.remove()

        # What came back.
        if result is None:
            raise CheckFailed(f"dp_step returned None for {where}: return (outputs, loss), the "
                              "gathered outputs and the loss you called backward() on.")
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            raise CheckFailed(f"dp_step must return a pair (outputs, loss); got a "
                              f"{type(result).__name__}" + (f" of length {len(result)}"
                                                           if isinstance(result, (tuple, list)) else ""))
        out, loss = result
        if not isinstance(out, torch.Tensor):
            raise CheckFailed(f"outputs: expected a torch.Tensor, got {type(out).__name__}")
        if out.shape != out_ref.shape:
            raise CheckFailed(
                f"outputs for {where}: expected shape {tuple(out_ref.shape)} (the whole batch), got "
                f"{tuple(out.shape)}. Usual mistake: returning one replica's output, or stacking "
                "instead of concatenating along dim 0 (gather is torch.cat(outputs, dim=0)).")
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else ""
            raise CheckFailed(f"loss: expected a 0-dim tensor, got {type(loss).__name__}{shape}")

        # How it ran.
        rows = [r for _, _, r in calls]
        if not calls:
            raise CheckFailed(
                "no forward pass of the model (or of a copy of it) was seen. Make the replicas "
                "from `model` itself, with copy.deepcopy(model, memo=...) as in the lesson, and "
                "call them on the chunks.")
        if len(calls) == 1 and n_chunks > 1:
            raise CheckFailed(
                f"for {where} the model ran once, on {rows[0]} rows: DataParallel first scatters "
                f"the batch into {n_chunks} chunks (x.chunk({n_devices})) and runs one replica "
                "on each.")
        if sorted(rows) != sorted(c.shape[0] for c in chunks):
            raise CheckFailed(
                f"for {where} the replicas saw chunks of sizes {rows}; DataParallel's scatter "
                f"{_hint('dp_step_tensor_split')}: {[c.shape[0] for c in chunks]}. Usual "
                "mistake: torch.tensor_split or a hand-made split (chunk gives pieces of "
                "ceil(batch / n_devices) rows, and fewer pieces than devices for small batches).")
        if n_chunks > 1:
            modules = {m for _, m, _ in calls}
            if id(model) in modules:
                raise CheckFailed(_hint("dp_step_no_replicas"))
            if len(modules) != n_chunks:
                raise CheckFailed(
                    f"for {where} {n_chunks} chunks ran on {len(modules)} distinct replica(s): "
                    "make one replica per chunk.")
            per_thread = Counter(t for t, _, _ in calls)
            if set(per_thread) == {threading.current_thread()}:
                raise CheckFailed(_hint("dp_step_sequential"))
            if len(per_thread) < n_chunks:
                busiest = max(per_thread.values())
                raise CheckFailed(
                    f"for {where} the {n_chunks} replicas ran in {len(per_thread)} thread(s), one of "
                    f"them running {busiest} replicas one after another: "
                    f"{_hint('dp_step_one_worker_thread')}; {_hint('dp_step_small_pool')}.")
            if not all(together):
                raise CheckFailed(
                    f"for {where} each replica had its own thread, but {_hint('dp_step_join_each')}")

        # Values.
        if not close(out, out_ref, atol=1e-5, rtol=1e-5):
            if _is_row_permutation(out.detach(), out_ref):
                raise CheckFailed(
                    f"outputs for {where} {_hint('dp_step_gather_as_finished')}")
            d = (out.detach() - out_ref).abs().max().item()
            raise CheckFailed(
                f"outputs for {where} differ from model(x) by up to {d:.3g}. Usual mistake: a "
                "replica whose parameters are not the model's (a fresh model, or a copy made "
                "before the parameters were set).")
        if not close(loss, loss_ref, atol=1e-6, rtol=1e-5):
            got, exp = loss.item(), loss_ref.item()
            per_chunk = [F.cross_entropy(o, t).item()
                         for o, t in zip(out_ref.chunk(n_devices), y.chunk(n_devices))]
            mean_of_means = sum(per_chunk) / len(per_chunk)
            if abs(got - sum(per_chunk)) < 1e-5 * max(1.0, abs(got)) and n_chunks > 1:
                raise CheckFailed(
                    f"loss for {where}: expected {exp:.6f} (the mean over the whole batch), got "
                    f"{got:.6f}, the SUM of the {n_chunks} replicas' mean losses. Summing makes "
                    f"the gradients {n_chunks}x too large. {_hint('dp_step_sum_of_losses')}")
            if uneven and abs(got - mean_of_means) < 1e-5 * max(1.0, abs(got)):
                raise CheckFailed(
                    f"loss for {where}: expected {exp:.6f}, got {got:.6f}, "
                    f"{_hint('dp_step_mean_of_means')}. With chunks of sizes {[c.shape[0] for c in chunks]} "
                    "that weighs the small chunk's samples more than the others: compute the loss "
                    "on the gathered outputs, as DataParallel does (it only returns outputs).")
            raise CheckFailed(f"loss for {where}: expected {exp:.6f} (F.cross_entropy over the "
                              f"gathered outputs), got {got:.6f}")

        # Gradients in the model's own parameters, and no update.
        missing = [n for n, p in model.named_parameters() if p.grad is None]
        if missing:
            raise CheckFailed(
                f"after dp_step, {len(missing)} parameter(s) of `model` have no gradient "
                f"({', '.join(missing[:3])}{'...' if len(missing) > 3 else ''}). Either "
                f"{_hint('dp_step_no_backward')}, or {_hint('dp_step_detached_replicas')}. "
                "Make each replica's parameters differentiable copies: "
                "copy.deepcopy(model, memo={id(p): p.clone() for p in model.parameters()}).")
        got_grads = {n: p.grad for n, p in model.named_parameters()}
        ratios = [(got_grads[n].norm() / grads_ref[n].norm()).item()
                  for n in grads_ref if grads_ref[n].norm() > 0]
        hint = ("replicas' gradients must be summed into the model (DataParallel's backward of "
                "Broadcast is a reduce-add) from ONE loss over the gathered outputs")
        if n_chunks > 1 and ratios and all(abs(r - n_chunks) < 0.02 * n_chunks for r in ratios):
            hint = (f"the gradients are {n_chunks}x too large: one backward per replica loss, or "
                    "the sum of the replicas' losses")
        compare_tensors(grads_ref, got_grads, atol=1e-5, what="gradients", where=where, hint=hint)
        changed = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
        if changed:
            raise CheckFailed(
                f"dp_step changed the parameters ({', '.join(changed[:3])}): "
                + _hint("dp_step_with_optimizer_step"))
    print(f"dp_step matches a single-process step (outputs, loss and gradients) on {len(_CASES)} "
          "batch/device combinations, uneven splits included")
