"""08.a ``check_amp_step(fn)``: an AMP training step with GradScaler and gradient clipping under DDP.

The checker runs ``fn(model, optimizer, scaler, x, y, *, max_norm, amp_dtype)`` on 2 DDP ranks, 3
steps with float16 and 3 with bfloat16 (SGD with momentum).  At the second step rank 1's input
holds an inf: the step must be skipped on both ranks and the scale halved once.  Besides
parameters, momentum buffers and the scale (compared with the same step written with torch's own
calls), the checker records what the step did, in order (``recorder.py``): which autocast was
entered (device, dtype, and the deprecated ``torch.cuda.amp`` API), ``scaler.scale``, ``unscale_``,
``clip_grad_norm_``, ``scaler.step`` / ``optimizer.step``, ``scaler.update``, and whether this
rank's backward reached DDP's all-reduce.

What learners get wrong is ``CATALOGUE`` below: each entry's key names the answer written with that
misconception in tests/checkers/test_ch08_amp.py, its message is what the failure says.

Correct answers written differently pass: ``torch.amp.autocast(device_type=...)``, gradients zeroed
before the forward, clipping with ``get_total_norm`` + ``clip_grads_with_norm_``, a 0-dim loss tensor
returned.  ``amp_verdicts(fns)`` judges several answers in one launch (the tests, an instructor's
collection of answers).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import traceback

import torch
import torch.nn.functional as F

from ...checking import (
    Catalogue,
    CheckFailed,
    Misconception,
    Outcome,
    as_float,
    checker,
    close,
    compare_tensors,
    judge,
    learner_frames,
    process_group,
    require_callable,
    run_workers,
    state_to_cpu,
    wrap_ddp,
)
from ...data import make_dataset, make_model
from ...monitor import report
from .recorder import Recorder

__all__ = ["CATALOGUE", "check_amp_step", "amp_verdicts"]

WORLD, BATCH, STEPS = 2, 16, 3
OVERFLOW_STEP, OVERFLOW_RANK = 1, 1  # rank 1 gets an inf in its input at the second step
INIT_SCALE, MAX_NORM, LR, MOMENTUM = 2.0**12, 0.05, 0.2, 0.9
DTYPES = ("float16", "bfloat16")
ATOL = 1e-5

# A step that ends without scaler.update() shows at the next one, as one of GradScaler's errors.
_NO_UPDATE = ("GradScaler's 'unscale_() is being called after step()' or 'unscale_() has already "
              "been called on this optimizer since the last update()' means a step that ended "
              "without scaler.update(): update() closes every step, skipped or not.")
_TORCH_CALLS = ("scaler.scale(loss).backward(), scaler.unscale_(optimizer), clip, "
                "scaler.step(optimizer), scaler.update()")

CATALOGUE = Catalogue(
    "08.a AMP step under DDP",
    Misconception(
        "amp_clips_before_unscaling", "clip first, then unscale",
        "clip_grad_norm_ ran before scaler.unscale_",
        "clipping before scaler.unscale_(optimizer): clip_grad_norm_ then sees gradients "
        "multiplied by the scale and shrinks them far too much. Call scaler.unscale_(optimizer) "
        "first, then clip, then scaler.step(optimizer)."),
    Misconception(
        "amp_unscales_by_hand", "dividing the gradients by scaler.get_scale() is unscaling",
        "scaler.get_scale() was read, unscale_ never called, and scaler.step ran",
        "the gradients were divided by scaler.get_scale() by hand and then unscaled a second time: "
        "scaler.step(optimizer) calls unscale_ itself when you have not, so the step is the scale "
        "times too small. Call scaler.unscale_(optimizer) instead of dividing (it also finds the "
        "inf/NaN that scaler.step needs), then clip, then scaler.step(optimizer)."),
    Misconception(
        "amp_never_clips", "GradScaler replaces clipping",
        "no clip_grad_norm_ in the step",
        "the gradients were not clipped: call torch.nn.utils.clip_grad_norm_(model.parameters(), "
        "max_norm) after scaler.unscale_(optimizer). GradScaler only skips steps with inf/NaN; it "
        "does not bound the gradients."),
    Misconception(
        "amp_steps_the_optimizer_itself", "optimizer.step() is still the step",
        "optimizer.step() without scaler.step(): the NaN step is applied",
        "optimizer.step() instead of scaler.step(optimizer): only scaler.step skips a step whose "
        "gradients contain inf or NaN."),
    Misconception(
        "amp_steps_on_scaled_gradients", "optimizer.step() is still the step, unscale_ is optional",
        "optimizer.step() without unscale_: scaled gradients are applied",
        "optimizer.step() on gradients still multiplied by the scale: use scaler.unscale_(optimizer) "
        "and scaler.step(optimizer), not optimizer.step()."),
    Misconception(
        "amp_without_the_scaler", "autocast is all AMP needs",
        "no scaler.scale in the step",
        "the loss was never scaled: backward ran on the plain loss, and without scaler.step no step "
        f"is ever skipped. autocast alone is not AMP's whole recipe: {_TORCH_CALLS}."),
    Misconception(
        "amp_never_updates", "update() only matters after an overflow",
        "GradScaler raises 'unscale_() is being called after step()' at the next step",
        _NO_UPDATE),
    Misconception(
        "amp_manual_backoff", "the scale must be halved by hand (the source article's "
        "scaler.update(0.5 * scale))",
        "the scale after the overflow step is a quarter of the one before",
        "the scale was halved twice: do not call scaler.update(new_scale) or adjust the scale "
        "yourself; GradScaler already halves it on inf/NaN."),
    Misconception(
        "amp_skips_nan_steps_by_hand", "skip NaN steps by hand, returning before scaler.update()",
        "GradScaler raises 'unscale_() has already been called ... since the last update()'",
        _NO_UPDATE),
    Misconception(
        "amp_skips_locally_on_a_nan_loss", "skip the step on the rank whose loss is not finite",
        "rank 1 returns while rank 0 waits in DDP's all-reduce (named within finish_within)",
        "a step skipped on one rank only (`if not torch.isfinite(loss): return` on the rank whose "
        "loss overflowed) leaves the other rank waiting in DDP's all-reduce; let scaler.step decide "
        "the skip, it sees the all-reduced gradients on every rank."),
    Misconception(
        "amp_forward_without_autocast", "casting the input is mixed precision",
        "the first Linear layer produced float32, and no autocast was entered",
        "the forward pass is not inside torch.autocast(x.device.type, dtype=amp_dtype)."),
    Misconception(
        "amp_autocast_for_cuda_on_cpu", "autocast is for 'cuda'",
        "autocast was entered for another device than x's",
        "it changes nothing there. Use torch.autocast(x.device.type, dtype=amp_dtype)."),
    Misconception(
        "amp_hardcodes_float16", "AMP means float16",
        "autocast ran with another dtype than amp_dtype",
        "pass dtype=amp_dtype instead of a fixed type."),
    Misconception(
        "amp_uses_torch_cuda_amp", "torch.cuda.amp is the AMP API (the source article's)",
        "torch.cuda.amp.autocast or GradScaler was called",
        "deprecated (torch warns so) and, for autocast, CUDA-only: it does nothing for a CPU "
        "tensor. Use torch.autocast(x.device.type, dtype=amp_dtype) and the torch.amp.GradScaler "
        "you were given."),
    Misconception(
        "amp_never_zeroes", "the scaler clears the gradients",
        "the parameters differ and no zero_grad ran in two steps",
        "gradients left over from the previous step: call optimizer.zero_grad() every step, "
        "skipped or not."),
    Misconception(
        "amp_returns_the_scaled_loss", "the loss that went into backward is the loss",
        "the returned loss is the scale times the reference's",
        "that is the scaled loss; return the unscaled loss.item()."),
    Misconception(
        "amp_returns_nothing", "the step's work is done once the optimizer stepped",
        "the function returned None",
        "got NoneType (a missing `return`?)"),
)

_HINT = ("if a rank returned early: " + CATALOGUE.hint("amp_skips_locally_on_a_nan_loss") + " "
         + _NO_UPDATE)


def _previous_step(message: str) -> str:
    """What GradScaler's error ``message`` says the previous step did without scaler.update(), or
    '' for any other error."""
    if "since the last update()" in message:
        return ("the previous step called scaler.unscale_(optimizer) and returned before "
                "scaler.update() (a step skipped by hand)")
    if "after step()" in message:
        return "the previous step called scaler.step(optimizer) but not scaler.update()"
    return ""


def _raised(exc_type: str, message: str, frames: str) -> str:
    """An exception of the learner's step, with the usual mistake when GradScaler names one."""
    previous = _previous_step(message)
    return (f"your code raised {exc_type}: {message}" + (f" This means {previous}." if previous else "")
            + ("\n" + frames if frames else "") + (f"\nUsual mistake: {_NO_UPDATE}" if previous else ""))


def _explain_error(failure) -> str | None:
    """In a real launch, a GradScaler error about a missing update() names that cause (the
    default hint would first suggest a rank that returned early)."""
    if not _previous_step(failure.message):
        return None
    return f"rank {failure.rank}: " + _raised(failure.exc_type, failure.message,
                                              learner_frames(failure.traceback))


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    X, Y = make_dataset(STEPS * WORLD * BATCH, seed=11).tensors
    start = (step * WORLD + rank) * BATCH
    x, y = X[start:start + BATCH].clone(), Y[start:start + BATCH]
    if step == OVERFLOW_STEP and rank == OVERFLOW_RANK:
        x[0, 0] = float("inf")  # its loss and gradients become NaN; the all-reduce spreads them
    return x, y


def _reference_step(model, optimizer, scaler, x, y, *, max_norm, amp_dtype):
    """The step written with torch's own calls."""
    with torch.autocast(x.device.type, dtype=amp_dtype):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def _setup(device: torch.device):
    model = wrap_ddp(make_model(0), device)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    scaler = torch.amp.GradScaler(device.type, init_scale=INIT_SCALE, growth_interval=2000)
    return model, opt, scaler


def _momentum(opt, model) -> dict:
    return {n: opt.state[p]["momentum_buffer"].detach().cpu().clone()
            for n, p in model.module.named_parameters() if "momentum_buffer" in opt.state[p]}


def _run(fn, dtype_name: str, rank: int, device: torch.device) -> list[dict]:
    """``STEPS`` steps of ``fn`` (None: the reference) on a fresh DDP model, observed."""
    amp_dtype = getattr(torch, dtype_name)
    model, opt, scaler = _setup(device)
    seen: list = []
    model.module.net[0].register_forward_hook(lambda m, i, o: seen.append(str(o.dtype)[6:]))
    steps: list[dict] = []
    try:
        with contextlib.nullcontext() if fn is None else Recorder(model, opt, scaler) as rec:
            for s in range(STEPS):
                x, y = (t.to(device) for t in _data(s, rank))
                seen.clear()
                if rec is not None:
                    rec.events.clear()
                    report(step=s + 1, total=STEPS)
                ret = (fn or _reference_step)(model, opt, scaler, x, y, max_norm=MAX_NORM,
                                              amp_dtype=amp_dtype)
                events = [] if rec is None else list(rec.events)  # before the checker's get_scale
                steps.append({"params": state_to_cpu(model), "momentum": _momentum(opt, model),
                              "scale": scaler.get_scale(), "returned": as_float(ret),
                              "dtypes": list(seen), "events": events,
                              "deprecated": [] if rec is None else list(rec.deprecated)})
                if rec is not None and "allreduce" not in rec.events and seen:
                    # This rank ran no backward through DDP: its peer now waits for it in the
                    # all-reduce. Return, so that run_workers names the rank and the step.
                    steps[-1]["left"] = True
                    break
    finally:
        # Free the DDP model before its process group, also when the learner's code raised (the
        # traceback keeps this frame); process_group collects it.
        model = opt = scaler = rec = None
    return steps


def _amp_worker(fns: list, dtype_names: list[str], catch: bool) -> Outcome:
    """Runs on every rank: per dtype, the reference and each answer on fresh DDP models.

    Each answer's run of each dtype is an ``Outcome``: with ``catch`` an exception of the learner's
    code is its problem (for ``amp_verdicts``); without it, the exception reaches ``run_workers``.
    """
    with process_group() as pg:
        data: dict = {"ref": {}, "answers": [{} for _ in fns], "device": pg.device.type}
        for name in dtype_names:
            data["ref"][name] = _run(None, name, pg.rank, pg.device)
            for i, fn in enumerate(fns):
                try:
                    steps = _run(fn, name, pg.rank, pg.device)
                except Exception as e:
                    if not catch:
                        raise
                    data["answers"][i][name] = Outcome(pg.rank, problem=_raised(
                        type(e).__name__, str(e), learner_frames(traceback.format_exc())))
                    continue
                data["answers"][i][name] = Outcome(pg.rank, data={"steps": steps})
                if steps and steps[-1].get("left"):
                    return Outcome(pg.rank, data=data)  # the other rank waits: stop here
        return Outcome(pg.rank, data=data)


def _order_problem(events: list) -> str:
    """What is wrong with the order of one step's calls, or ''."""
    names = [e if isinstance(e, str) else e[0] for e in events]
    if "scale" not in names:
        return CATALOGUE.hint("amp_without_the_scaler")
    if "optimizer.step" in names and "scaler.step" not in names:
        if "unscale_" not in names and "get_scale" not in names:
            return CATALOGUE.hint("amp_steps_on_scaled_gradients")
        return CATALOGUE.hint("amp_steps_the_optimizer_itself")
    if ("unscale_" not in names and "get_scale" in names and "scaler.step" in names
            and names.index("get_scale") < names.index("scaler.step")):
        return CATALOGUE.hint("amp_unscales_by_hand")
    if "clip" not in names:
        return CATALOGUE.hint("amp_never_clips")
    if "unscale_" not in names or names.index("clip") < names.index("unscale_"):
        return CATALOGUE.hint("amp_clips_before_unscaling")
    return ""


def _judge(answer: list[dict[str, Outcome]], ref: list[dict[str, list]], device_type: str) -> None:
    """Raise CheckFailed naming the first mistake in one answer (``answer[rank][dtype]``, with the
    reference's steps in ``ref[rank][dtype]``)."""
    for name in ref[0]:
        for a in answer:
            if name in a and a[name].problem:
                raise CheckFailed(f"rank {a[name].rank} ({name}): {a[name].problem}")
        runs = [a[name].data["steps"] for a in answer]
        refs = [r[name] for r in ref]
        for rank, steps in enumerate(runs):
            for s, st in enumerate(steps):
                if st["deprecated"]:
                    raise CheckFailed(
                        f"on rank {rank}: your step uses {', '.join(sorted(set(st['deprecated'])))}, "
                        + CATALOGUE.hint("amp_uses_torch_cuda_amp"))
                if not st["dtypes"]:
                    raise CheckFailed(f"on rank {rank}: the model was never called; run the "
                                      "forward pass through the model you were given")
                ac = [e for e in st["events"] if isinstance(e, tuple)]
                if st["dtypes"][0] != name:
                    if any(e[1] != device_type for e in ac):
                        why = (f"autocast was entered for device '{ac[0][1]}' while x is on "
                               f"'{device_type}': " + CATALOGUE.hint("amp_autocast_for_cuda_on_cpu"))
                    elif ac:
                        why = (f"autocast ran with dtype {ac[0][2]}, not the amp_dtype given "
                               f"({name}): " + CATALOGUE.hint("amp_hardcodes_float16"))
                    else:
                        why = CATALOGUE.hint("amp_forward_without_autocast")
                    raise CheckFailed(
                        f"on rank {rank} ({name}), step {s + 1}: the first Linear layer produced "
                        f"{st['dtypes'][0]}, expected {name}. Usual mistake: {why}")
                if st.get("left"):
                    raise CheckFailed(
                        f"on rank {rank} ({name}), step {s + 1}: your step returned without a "
                        "backward pass through DDP, so the other rank waited for it in the "
                        "all-reduce. Usual mistake: skipping a step locally on a NaN loss; "
                        "scaler.step decides the skip after the all-reduce, on every rank alike.")
        for rank, steps in enumerate(runs):
            got, want = steps[0]["returned"], refs[rank][0]["returned"]
            if isinstance(got, tuple):
                raise CheckFailed(f"on rank {rank}, step 1: expected the loss as a float, "
                                  + (CATALOGUE.hint("amp_returns_nothing") if got[1] == "NoneType"
                                     else f"got {got[1]}"))
            if not math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-6):
                scaled = math.isclose(got, want * INIT_SCALE, rel_tol=1e-3)
                raise CheckFailed(
                    f"on rank {rank}, step 1: returned loss {got:.6g}, expected {want:.6g}"
                    + (": " + CATALOGUE.hint("amp_returns_the_scaled_loss") if scaled else "."))
        for s in range(STEPS):
            st = runs[0][s]
            if not close(refs[0][s]["params"], st["params"], atol=ATOL):
                flat = torch.cat([p.flatten() for p in st["params"].values()])
                if s == OVERFLOW_STEP and not torch.isfinite(flat).all():
                    raise CheckFailed(
                        f"({name}) step {s + 1} had NaN gradients (rank {OVERFLOW_RANK}'s input held "
                        "an inf) and your step applied them: the parameters are now NaN on every "
                        "rank. Usual mistake: " + (_order_problem(st["events"]) or
                                                   "optimizer.step() instead of scaler.step."))
                why = _order_problem(st["events"])
                if not why and s > 0 and not any(e == "zero_grad" for e in runs[0][s - 1]["events"]
                                                  + st["events"]):
                    why = CATALOGUE.hint("amp_never_zeroes")
                compare_tensors(refs[0][s]["params"], st["params"], atol=ATOL,
                                what=f"parameters after step {s + 1} ({name}, rank 0)",
                                where="", hint=why or "clipping with a max_norm other than the one "
                                "given, a different loss, or gradients left from a previous step.")
            for rank in range(1, WORLD):
                a, b = runs[0][s]["params"], runs[rank][s]["params"]
                if not close(a, b, atol=0.0):
                    compare_tensors(a, b, atol=0.0, what=f"parameters after step {s + 1} ({name})",
                                    where=f"rank {rank} vs rank 0",
                                    hint="ranks stepping differently (a skip decided by something "
                                         "other than scaler.step on the all-reduced gradients).")
            for rank in range(WORLD):
                compare_tensors(refs[rank][s]["momentum"], runs[rank][s]["momentum"], atol=ATOL,
                                what=f"momentum buffers after step {s + 1} ({name})",
                                where=f"rank {rank}", hint="the skipped step changed the optimizer "
                                "state: only scaler.step(optimizer) leaves it untouched.")
            for rank in range(WORLD):
                got, want = runs[rank][s]["scale"], refs[rank][s]["scale"]
                if got == want:
                    continue
                before = runs[rank][s - 1]["scale"] if s else INIT_SCALE
                events = runs[rank][s]["events"]
                if got == before and "update" not in events:
                    why = (f"scaler.update() did not run at step {s + 1}: call it every step, "
                           "the skipped ones too (returning early after finding NaN leaves the scale "
                           "where it was, so the next step overflows again).")
                elif got == before:
                    why = "the scale did not change: let scaler.update() see the skipped step."
                elif got == before * 0.25:
                    why = CATALOGUE.hint("amp_manual_backoff")
                else:
                    why = "let GradScaler manage the scale: one scaler.update() per step, no argument."
                raise CheckFailed(f"({name}) on rank {rank}, after step {s + 1} the scale is {got:g}, "
                                  f"expected {want:g} (half of {before:g}). Usual mistake: {why}")


def _check_signature(fn) -> None:
    try:
        inspect.signature(fn).bind(None, None, None, None, None, max_norm=1.0, amp_dtype=None)
    except (TypeError, ValueError):
        raise CheckFailed("the checker calls fn(model, optimizer, scaler, x, y, max_norm=..., "
                          f"amp_dtype=...); your function's signature is {fn.__name__}"
                          f"{inspect.signature(fn)}.") from None


@checker("08.a AMP step under DDP")
def check_amp_step(fn, *, amp_dtype: torch.dtype | None = None, timeout: float = 120) -> None:
    """Run ``fn(model, optimizer, scaler, x, y, max_norm=..., amp_dtype=...)`` on 2 DDP ranks.

    Three steps with float16, three with bfloat16 (or only ``amp_dtype`` when given); at the
    second, rank 1's input holds an inf.  Expected: the forward under ``torch.autocast`` in
    ``amp_dtype``; parameters, momentum and scale equal to the step written with torch's own calls
    on every rank; the overflow step skipped on *both* ranks and the scale halved once.
    """
    require_callable(fn, "a function amp_step(model, optimizer, scaler, x, y, *, max_norm, amp_dtype)")
    _check_signature(fn)
    names = [str(amp_dtype).replace("torch.", "")] if amp_dtype is not None else list(DTYPES)
    outcomes = judge(run_workers(_amp_worker, WORLD, args=([fn], names, False), timeout=timeout,
                                 hang_hint=_HINT, error_hint=_HINT, explain_error=_explain_error),
                     world=WORLD)
    _judge([o.data["answers"][0] for o in outcomes], [o.data["ref"] for o in outcomes],
           outcomes[0].data["device"])
    print(f"amp_step: on {WORLD} ranks, {STEPS} steps each in {' and '.join(names)}; autocast, "
          "scale, unscale_, clip, scaler.step and update in order; the overflow step skipped on both "
          "ranks and the scale halved once; parameters, momentum and scale match torch's own step")


def amp_verdicts(fns: list, *, timeout: float = 240) -> list[str]:
    """08.a's verdict on several answers in one launch: ``""`` for a pass, else the message.

    For answers that neither hang nor fail on one rank only (an instructor's collection, the
    tests); a learner's own answer goes through ``check_amp_step``.
    """
    outcomes = judge(run_workers(_amp_worker, WORLD, args=(list(fns), list(DTYPES), True),
                                 timeout=timeout), world=WORLD)
    verdicts = []
    for i in range(len(fns)):
        try:
            _judge([o.data["answers"][i] for o in outcomes], [o.data["ref"] for o in outcomes],
                   outcomes[0].data["device"])
            verdicts.append("")
        except CheckFailed as e:
            verdicts.append(str(e))
    return verdicts
