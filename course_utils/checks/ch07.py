"""Checkers of chapter 07: gradient accumulation with ``no_sync``, and the scaled learning rate.

07.a ``check_accumulation_step(fn)`` runs ``fn(model, optimizer, micro_batches)`` on 2 ranks with a
DDP model and SGD with momentum, for 2 optimizer steps.  It observes the behaviour, not only the
end state: a communication hook records every all-reduce and during which micro-step's backward it
ran; ``no_sync`` and the forward passes are recorded; the gradients are captured at the moment
``optimizer.step()`` runs; parameters and momentum buffers are compared with a single process that
trains on the whole global batch.

Misconceptions it recognises (tests/checkers/test_ch07_accumulation.py, test name in brackets):

- "DDP only averages, so the loss needs no division by k" -> gradients k times too large
  [acc_forgets_to_divide];
- "DDP sums over ranks, so I divide by the world size too" -> gradients world-size times too small
  [acc_divides_by_world_size_too];
- "no_sync on every micro-step, the step syncs by itself" -> nothing is ever all-reduced
  [acc_no_sync_everywhere];
- "no_sync is about backward": forward outside, ``backward()`` inside ``no_sync`` -> DDP decided
  at forward time and all-reduces every micro-step [acc_only_backward_in_no_sync];
- "synchronise once, at the start" (first micro-step synced, the others in ``no_sync``) -> the
  later micro-batches' gradients stay local [acc_syncs_the_first_micro_step];
- "no_sync is an optimisation, leave it out" -> correct numbers, k times the communication
  [acc_never_uses_no_sync];
- "zero_grad at the top of the loop, as in ordinary training" -> only the last micro-batch's
  gradient is left at the step [acc_zero_grad_inside_the_loop];
- "step after every micro-batch" [acc_steps_every_micro_batch]; no ``zero_grad`` at all, so the
  previous step's gradients stay in [acc_never_zeroes];
- "all-reduce the gradients by hand after accumulating, to be sure" -> a second all-reduce per
  step [acc_all_reduces_by_hand_as_well];
- the returned loss: k times the mean (sum of undivided losses) [acc_returns_the_sum], or none.

Correct answers written differently pass: ``zero_grad`` before the loop, micro-steps 1..k-1 run
through ``model.module`` (DDP is bypassed, the last backward all-reduces the accumulated sum),
``require_backward_grad_sync`` set by hand, a summed loss divided by the number of samples.

07.b ``check_scaled_lr(fn)``: the linear scaling rule with a warm-up from ``base_lr``.  Mistakes
recognised: the world size or the accumulation steps left out of the effective batch, a warm-up
from 0, no warm-up, a warm-up that keeps climbing, a warm-up that reaches the peak one step early,
the square-root rule, a division by zero when ``warmup_steps`` is 0.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import math
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..checking import (
    CheckFailed,
    Outcome,
    as_float,
    checker,
    close,
    compare_tensors,
    first_problem,
    learner_frames,
    require_callable,
    run_workers,
    state_to_cpu,
    wrap_ddp,
)
from ..data import make_dataset, make_model
from ..devices import backend_and_device, process_group_kwargs
from ..monitor import report

__all__ = ["check_accumulation_step", "check_scaled_lr", "accumulation_verdicts"]

# The set-up every run of 07.a uses: 2 ranks, 4 micro-batches of 8 per rank, 2 optimizer steps of
# SGD with momentum (its buffer carries each step's gradient into the next one).
WORLD, K, MICRO, STEPS, LR, MOMENTUM = 2, 4, 8, 2, 0.1, 0.9
ATOL = 1e-5


def _micro_batches(step: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s k micro-batches for optimizer step ``step`` (the same data everywhere)."""
    X, Y = make_dataset(256, seed=7).tensors
    B = MICRO * WORLD * K
    idx = torch.arange(step * B, (step + 1) * B).view(K, WORLD, MICRO)[:, rank]
    return [(X[i], Y[i]) for i in idx]


class _Probe:
    """What the learner's step did: forwards, ``no_sync`` use, all-reduces, optimizer steps."""

    def __init__(self, model, opt):
        self.model = model
        self.forwards = 0            # forward passes in this call (through DDP or model.module)
        self.forwards_unsynced = 0   # ... of which DDP was told not to all-reduce (no_sync)
        self.no_sync_entered = 0
        self.reduces: list[int] = []  # per all-reduce of a bucket: the micro-step it ran in
        self.by_hand = 0             # dist.all_reduce calls from the learner's own code
        self.steps = 0
        self.grads_at_step: dict[str, torch.Tensor | None] = {}
        self._all_reduce = dist.all_reduce
        model.module.register_forward_pre_hook(self._on_forward)
        model.register_comm_hook(None, self._hook)
        real_no_sync, real_step = model.no_sync, opt.step

        @contextlib.contextmanager
        def no_sync():
            self.no_sync_entered += 1
            with real_no_sync():
                yield

        def step(*args, **kwargs):
            self.steps += 1
            if self.steps == 1:
                self.grads_at_step = {n: None if p.grad is None else p.grad.detach().cpu().clone()
                                      for n, p in model.module.named_parameters()}
            return real_step(*args, **kwargs)

        def all_reduce(tensor, *args, **kwargs):
            self.by_hand += 1
            return self._all_reduce(tensor, *args, **kwargs)

        model.no_sync, opt.step = no_sync, step
        dist.all_reduce = all_reduce

    def restore(self) -> None:
        dist.all_reduce = self._all_reduce

    def reset(self) -> None:
        self.forwards = self.forwards_unsynced = self.no_sync_entered = self.by_hand = self.steps = 0
        self.reduces, self.grads_at_step = [], {}

    def _on_forward(self, module, inputs):
        self.forwards += 1
        if torch.is_grad_enabled() and not self.model.require_backward_grad_sync:
            self.forwards_unsynced += 1

    def _hook(self, state, bucket):  # no annotations: DDP would compare them as strings here
        self.reduces.append(self.forwards)
        buf = bucket.buffer().div_(dist.get_world_size())
        fut = self._all_reduce(buf, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])


def _run_answer(fn, rank: int, device: torch.device) -> dict:
    """The learner's step for ``STEPS`` optimizer steps on a fresh DDP model, observed."""
    model = opt = probe = None
    steps: list[dict] = []
    try:
        model = wrap_ddp(make_model(0), device)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        probe = _Probe(model, opt)
        # How many all-reduces one synchronised backward makes (one per bucket); then back to
        # no gradients, as a fresh model has.
        x, y = _micro_batches(0, rank)[0]
        F.cross_entropy(model(x.to(device)), y.to(device)).backward()
        buckets = len(probe.reduces)
        model.zero_grad(set_to_none=True)
        for s in range(STEPS):
            batches = [(x.to(device), y.to(device)) for x, y in _micro_batches(s, rank)]
            probe.reset()
            report(step=s + 1, total=STEPS)
            ret = fn(model, opt, batches)
            steps.append({
                "reduces": list(probe.reduces), "by_hand": probe.by_hand, "opt_steps": probe.steps,
                "no_sync": probe.no_sync_entered, "unsynced": probe.forwards_unsynced,
                "forwards": probe.forwards, "returned": as_float(ret),
                "grads": probe.grads_at_step, "params": state_to_cpu(model),
                "momentum": {n: opt.state[p]["momentum_buffer"].detach().cpu().clone()
                             for n, p in model.module.named_parameters()
                             if opt.state[p].get("momentum_buffer") is not None},
            })
    finally:
        if probe is not None:
            probe.restore()
        # Free every DDP model before its process group: a DDP model that outlives the group
        # can hang or abort the worker when it is freed (torch 2.13, gloo).
        model = opt = probe = None
        gc.collect()
    return {"steps": steps, "buckets": buckets}


def _accumulation_worker(fns: list, catch: bool) -> Outcome:
    """Runs on every rank: each answer in ``fns`` on its own DDP model.

    With ``catch`` an answer's exception is recorded and the next answer runs (for
    ``accumulation_verdicts``); without it, the exception reaches ``run_workers``.
    """
    backend, device = backend_and_device()
    dist.init_process_group(**process_group_kwargs(backend, device))
    rank = dist.get_rank()
    answers = []
    try:
        for fn in fns:
            if not catch:
                answers.append(_run_answer(fn, rank, device))
                continue
            try:
                answers.append(_run_answer(fn, rank, device))
            except Exception as e:
                answers.append({"error": f"your code raised {type(e).__name__}: {e}\n"
                                         + learner_frames(traceback.format_exc())})
    finally:
        gc.collect()
        dist.destroy_process_group()
    return Outcome(rank, data={"answers": answers})


def _reference() -> list[dict]:
    """Per step, on a single process that sees the global batch: the micro-batch gradients of each
    rank, the correct gradient, and the parameters, momentum and per-rank mean loss after the step."""
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    names = [n for n, _ in model.named_parameters()]
    out = []
    for s in range(STEPS):
        micro, losses = [], []  # micro[r][i]: gradient of rank r's micro-batch i
        for r in range(WORLD):
            micro.append([])
            rank_loss = 0.0
            for x, y in _micro_batches(s, r):
                model.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                rank_loss += loss.item() / K
                micro[r].append({n: p.grad.clone() for n, p in model.named_parameters()})
            losses.append(rank_loss)
        grad = {n: sum(micro[r][i][n] for r in range(WORLD) for i in range(K)) / (WORLD * K)
                for n in names}
        for n, p in model.named_parameters():
            p.grad = grad[n].clone()
        opt.step()
        out.append({"micro": micro, "grad": grad, "losses": losses, "params": state_to_cpu(model),
                    "momentum": {n: opt.state[p]["momentum_buffer"].clone()
                                 for n, p in model.named_parameters()}})
    return out


def _scaled(g: dict, factor: float) -> dict:
    return {n: t * factor for n, t in g.items()}


def _why_gradients_differ(s: int, ref: list[dict], got: dict) -> str:
    """Name the mistake whose gradient at the step equals what the learner's step used."""
    r = ref[s]
    candidates = [
        (_scaled(r["grad"], K), f"they are {K} times too large: each micro-batch loss must be divided "
         f"by the number of micro-batches (loss / len(micro_batches)) before backward(). DDP averages "
         "over ranks, but the micro-batches add up in .grad."),
        (_scaled(r["grad"], 1 / WORLD), f"they are {WORLD} (the world size) times too small: DDP "
         "already averages the gradients over the ranks, so divide the loss by the number of "
         "micro-batches only, not by the world size as well."),
        ({n: sum(r["micro"][q][K - 1][n] for q in range(WORLD)) / (WORLD * K) for n in r["grad"]},
         "they hold the last micro-batch's gradient only: optimizer.zero_grad() ran inside the "
         "micro-batch loop and erased the gradients being accumulated. Zero the gradients once per "
         "optimizer step (after the step, or before the first micro-batch)."),
    ]
    if s > 0:
        candidates.append((
            {n: r["grad"][n] + sum(ref[q]["grad"][n] for q in range(s)) for n in r["grad"]},
            "they still contain the previous step's gradients: nothing zeroed them. Call "
            "optimizer.zero_grad() once per optimizer step (after the step, or before the first "
            "micro-batch)."))
    for want, why in candidates:
        if close(want, got, atol=ATOL):
            return why
    return ("usual mistake: a micro-batch skipped or used twice, or the loss scaled by something "
            "other than 1 / number of micro-batches.")


def _check_communication(rank: int, s: int, st: dict, buckets: int) -> None:
    """The all-reduces of one optimizer step: how many, during which micro-step, from whom."""
    red = st["reduces"]
    where = f"rank {rank}, optimizer step {s + 1}"
    if len(red) == buckets and all(m == K for m in red) and not st["by_hand"]:
        return
    head = (f"on {where}: expected {buckets} all-reduce call(s) (one per gradient bucket, during "
            f"the last micro-batch's backward), got {len(red)} for {K} micro-batches")
    if st["by_hand"]:
        raise CheckFailed(
            f"on {where}: your code called dist.all_reduce {st['by_hand']} time(s) on top of the "
            f"{len(red)} all-reduce(s) DDP made. The backward outside no_sync already averages the "
            "accumulated gradients over the ranks; a second all-reduce only adds traffic (or, "
            "without a division, multiplies them by the world size). Remove it.")
    if not red:
        why = ("no gradient was ever all-reduced: the last micro-step ran inside model.no_sync() "
               "too (DDP decides at the forward pass whether the next backward all-reduces), so "
               "every rank stepped with its own gradients. Run the last micro-batch's forward and "
               "backward outside no_sync.")
    elif len(red) == K * buckets and st["no_sync"] and not st["unsynced"]:
        why = ("you entered model.no_sync() but ran the forward passes outside it. DDP decides "
               "during forward whether the following backward all-reduces, so a backward alone "
               "inside no_sync still synchronises. Put the forward *and* the backward of micro-steps "
               "1..k-1 inside `with model.no_sync():`.")
    elif len(red) == K * buckets:
        why = ("DDP all-reduced after every micro-batch: put the forward and backward of every "
               "micro-batch but the last inside `with model.no_sync():`.")
    elif len(red) == buckets:
        micro = sorted(set(red))
        why = (f"DDP all-reduced during micro-step {', '.join(map(str, micro))} of {K}, not during "
               f"the last one: the gradients of the micro-batches after it were added locally and "
               "never averaged, so the ranks stepped with different gradients. Run micro-steps "
               "1..k-1 inside no_sync and the last one outside it.")
    else:
        why = ("use no_sync (around forward and backward) for micro-steps 1..k-1 and a normal "
               "forward and backward for the last one.")
    raise CheckFailed(f"{head}.\nUsual mistake: {why}")


@checker("07.a accumulation with no_sync")
def check_accumulation_step(fn, *, timeout: float = 90) -> None:
    """Run ``fn(model, optimizer, micro_batches)`` on 2 ranks for 2 optimizer steps.

    ``model`` is a DDP model, ``optimizer`` SGD (lr 0.1, momentum 0.9), ``micro_batches`` 4 pairs
    ``(x, y)`` of 8 samples per rank.  At each ``optimizer.step()`` the gradients must equal a
    single process's gradient on all 64 samples, all-reduced once per bucket during the last
    micro-batch's backward; parameters and momentum after each step must match that process's.
    """
    require_callable(fn, "a function accumulate_and_step(model, optimizer, micro_batches)")
    try:
        inspect.signature(fn).bind(None, None, None)
    except (TypeError, ValueError):
        raise CheckFailed("the checker calls fn(model, optimizer, micro_batches) with a DDP model, "
                          "an SGD optimizer and a list of (x, y) pairs; your function's signature "
                          f"is {fn.__name__}{inspect.signature(fn)}.") from None
    outcomes = run_workers(
        _accumulation_worker, WORLD, args=([fn], False), timeout=timeout,
        hang_hint="a collective (dist.all_reduce, or a backward outside no_sync) that only some "
                  "ranks reach.")
    first_problem(outcomes)
    _judge([o.data["answers"][0] for o in outcomes], _reference())
    print(f"accumulate_and_step: on {WORLD} ranks, {STEPS} SGD-momentum steps of {K} micro-batches "
          f"each; one all-reduce per bucket, in the last micro-batch's backward; gradients at the "
          "step, parameters, momentum and returned loss match a single process on the global batch")


def _judge(answers: list[dict], ref: list[dict]) -> None:
    """Raise CheckFailed naming the first mistake in one answer's observations (one per rank)."""
    errors = [(r, a["error"]) for r, a in enumerate(answers) if "error" in a]
    if errors:
        raise CheckFailed(f"rank {errors[0][0]}: {errors[0][1]}")
    outcomes = [Outcome(r, data=a) for r, a in enumerate(answers)]
    buckets = answers[0]["buckets"]
    for s in range(STEPS):
        for o in outcomes:
            st = o.data["steps"][s]
            if st["opt_steps"] != 1:
                raise CheckFailed(
                    f"on rank {o.rank}, call {s + 1}: optimizer.step() ran {st['opt_steps']} "
                    f"time(s) for {K} micro-batches; expected exactly 1.\nUsual mistake: "
                    + ("stepping inside the micro-batch loop; step once, after the last backward."
                       if st["opt_steps"] > 1 else "forgetting optimizer.step() after the loop."))
            missing = [n for n, g in st["grads"].items() if g is None]
            if missing:
                raise CheckFailed(
                    f"on rank {o.rank}, optimizer step {s + 1}: when optimizer.step() ran, "
                    f"{', '.join(missing)} had no gradient (None). Usual mistake: "
                    "optimizer.zero_grad() between the last backward and the step.")
        for o in outcomes:
            _check_communication(o.rank, s, o.data["steps"][s], buckets)
        g0, g1 = (o.data["steps"][s]["grads"] for o in outcomes[:2])
        if not close(g0, g1, atol=0.0):
            compare_tensors(g0, g1, atol=0.0, what="gradients at optimizer.step()",
                            where=f"rank 1 vs rank 0, optimizer step {s + 1}",
                            hint="the gradients were not averaged across ranks before the step.")
        got = g0
        if not close(ref[s]["grad"], got, atol=ATOL):
            compare_tensors(ref[s]["grad"], got, atol=ATOL, what="gradients at optimizer.step()",
                            where=f"rank 0, optimizer step {s + 1}",
                            hint=_why_gradients_differ(s, ref, got))
        for o in outcomes:
            st = o.data["steps"][s]
            compare_tensors(ref[s]["params"], st["params"], atol=ATOL,
                            what=f"parameters after optimizer step {s + 1}", where=f"rank {o.rank}",
                            hint="the gradients were right at the step: something changed the "
                                 "parameters or the learning rate around optimizer.step().")
            compare_tensors(ref[s]["momentum"], st["momentum"], atol=ATOL,
                            what=f"momentum buffers after optimizer step {s + 1}",
                            where=f"rank {o.rank}", hint="the optimizer's state was changed or reset.")
    for o in outcomes:
        for s, st in enumerate(o.data["steps"]):
            got, want = st["returned"], ref[s]["losses"][o.rank]
            if isinstance(got, tuple):
                raise CheckFailed(
                    f"on rank {o.rank}, step {s + 1}: expected the mean loss over the "
                    f"micro-batches as a float, got {got[1]}"
                    + (" (a missing `return`?)" if got[1] == "NoneType" else ""))
            if not math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-6):
                ratio = got / want if want else float("nan")
                hint = (f"that is {K} times the mean: return the sum of the divided losses"
                        if math.isclose(ratio, K, rel_tol=1e-3) else
                        "return the mean of the micro-batch losses (the sum of loss / k), "
                        "as a Python float (loss.item())")
                raise CheckFailed(f"on rank {o.rank}, step {s + 1}: returned loss {got:.6g}, "
                                  f"expected the mean over the micro-batches {want:.6g}; {hint}.")


def accumulation_verdicts(fns: list, *, timeout: float = 180) -> list[str]:
    """07.a's verdict on several answers, all run in one launch: ``""`` for an answer that passes,
    else the message ``check_accumulation_step`` would give.

    For comparing answers that neither hang nor fail on one rank only (an instructor's collection
    of answers, the tests); a learner's own answer goes through ``check_accumulation_step``.
    """
    outcomes = run_workers(_accumulation_worker, WORLD, args=(list(fns), True), timeout=timeout)
    ref = _reference()
    verdicts = []
    for i in range(len(fns)):
        try:
            _judge([o.data["answers"][i] for o in sorted(outcomes, key=lambda o: o.rank)], ref)
            verdicts.append("")
        except CheckFailed as e:
            verdicts.append(str(e))
    return verdicts


def _scaled_lr_reference(step, *, base_lr, base_batch, per_rank_batch, world_size, accum_steps,
                         warmup_steps, ranks=True, accum=True, warm_from=None, warm=True,
                         stop=True, sqrt=False, early=False):
    """The right schedule; the switches reproduce the usual mistakes, to recognise them."""
    B = per_rank_batch * (world_size if ranks else 1) * (accum_steps if accum else 1)
    peak = base_lr * (math.sqrt(B / base_batch) if sqrt else B / base_batch)
    span = warmup_steps - 1 if early else warmup_steps
    if warm and span > 0 and (step < span or not stop):
        start = base_lr if warm_from is None else warm_from
        return start + (peak - start) * step / span
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
    (dict(early=True), "the warm-up reaches the peak at step warmup_steps - 1 (dividing by "
                       "warmup_steps - 1); it climbs by (peak - base_lr) / warmup_steps per step and "
                       "reaches the peak at step warmup_steps."),
    (dict(sqrt=True), "the square-root scaling rule (peak = base_lr x sqrt(B / base_batch)); this "
                      "exercise uses the linear rule, peak = base_lr x B / base_batch: one step on a "
                      "batch n times larger then moves the weights about as far as n steps on the "
                      "base batch (Goyal et al., 2017)."),
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
    print(f"scaled_lr: the linear rule with a warm-up from base_lr, on {len(_LR_CASES)} settings "
          "(steps 0, 1, mid-warm-up, the end of the warm-up and after it; one without warm-up)")
