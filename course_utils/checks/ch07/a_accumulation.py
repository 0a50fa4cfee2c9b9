"""07.a ``check_accumulation_step(fn)``: gradient accumulation with ``no_sync`` under DDP.

The checker runs ``fn(model, optimizer, micro_batches)`` on 2 ranks with a DDP model and SGD with
momentum, for 2 optimizer steps.  It observes the behaviour, not only the end state: a
communication hook records every all-reduce and during which micro-step's backward it ran;
``no_sync`` and the forward passes are recorded, and a ``CollectiveSpy`` counts the learner's own
``dist.all_reduce`` calls; the gradients are captured at the moment ``optimizer.step()`` runs;
parameters and momentum buffers are compared with a single process that trains on the whole
global batch.

What learners get wrong is ``CATALOGUE`` below: each entry's key names the answer written with that
misconception in tests/checkers/test_ch07_accumulation.py, its message is what the failure says.

Correct answers written differently pass: ``zero_grad`` before the loop, micro-steps 1..k-1 run
through ``model.module`` (DDP is bypassed, the last backward all-reduces the accumulated sum),
``require_backward_grad_sync`` set by hand, a summed loss divided by the number of samples.

``accumulation_verdicts(fns)`` judges several answers in one launch (the tests, an instructor's
collection of answers).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import traceback
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...checking import (
    Catalogue,
    CheckFailed,
    CollectiveSpy,
    Misconception,
    Outcome,
    as_float,
    checker,
    close,
    compare_tensors,
    first_problem,
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

__all__ = ["CATALOGUE", "check_accumulation_step", "accumulation_verdicts"]

# The set-up every run of 07.a uses: 2 ranks, 4 micro-batches of 8 per rank, 2 optimizer steps of
# SGD with momentum (its buffer carries each step's gradient into the next one).
WORLD, K, MICRO, STEPS, LR, MOMENTUM = 2, 4, 8, 2, 0.1, 0.9
ATOL = 1e-5

CATALOGUE = Catalogue(
    "07.a accumulation with no_sync",
    Misconception(
        "acc_forgets_to_divide", "DDP only averages, so the loss needs no division by k",
        f"the gradients at the step are {K} times the reference's",
        f"they are {K} times too large: each micro-batch loss must be divided by the number of "
        "micro-batches (loss / len(micro_batches)) before backward(). DDP averages over ranks, but "
        "the micro-batches add up in .grad."),
    Misconception(
        "acc_divides_by_world_size_too", "DDP sums over ranks, so I divide by the world size too",
        f"the gradients at the step are 1/{WORLD} of the reference's",
        f"they are {WORLD} (the world size) times too small: DDP already averages the gradients "
        "over the ranks, so divide the loss by the number of micro-batches only, not by the world "
        "size as well."),
    Misconception(
        "acc_no_sync_everywhere", "no_sync on every micro-step, the step syncs by itself",
        "no all-reduce at all during the optimizer step",
        "no gradient was ever all-reduced: the last micro-step ran inside model.no_sync() too (DDP "
        "decides at the forward pass whether the next backward all-reduces), so every rank stepped "
        "with its own gradients. Run the last micro-batch's forward and backward outside no_sync."),
    Misconception(
        "acc_only_backward_in_no_sync", "no_sync is about backward",
        "no_sync was entered, every forward ran outside it, and every micro-step all-reduced",
        "you entered model.no_sync() but ran the forward passes outside it. DDP decides during "
        "forward whether the following backward all-reduces, so a backward alone inside no_sync "
        "still synchronises. Put the forward *and* the backward of micro-steps 1..k-1 inside "
        "`with model.no_sync():`."),
    Misconception(
        "acc_syncs_the_first_micro_step", "synchronise once, at the start",
        "one all-reduce per bucket, during an early micro-step's backward",
        "the gradients of the micro-batches after it were added locally and never averaged, so the "
        "ranks stepped with different gradients. Run micro-steps 1..k-1 inside no_sync and the last "
        "one outside it."),
    Misconception(
        "acc_never_uses_no_sync", "no_sync is an optimisation, leave it out",
        "right numbers, but an all-reduce per bucket in every micro-step",
        "DDP all-reduced after every micro-batch: put the forward and backward of every "
        "micro-batch but the last inside `with model.no_sync():`."),
    Misconception(
        "acc_zero_grad_inside_the_loop", "zero_grad at the top of the loop, as in ordinary training",
        "the gradients at the step are the last micro-batch's only",
        "they hold the last micro-batch's gradient only: optimizer.zero_grad() ran inside the "
        "micro-batch loop and erased the gradients being accumulated. Zero the gradients once per "
        "optimizer step (after the step, or before the first micro-batch)."),
    Misconception(
        "acc_steps_every_micro_batch", "step after every micro-batch",
        "optimizer.step() ran more than once per call",
        "stepping inside the micro-batch loop; step once, after the last backward."),
    Misconception(
        "acc_never_zeroes", "the optimizer clears the gradients",
        "the gradients at the second step include the first step's",
        "they still contain the previous step's gradients: nothing zeroed them. Call "
        "optimizer.zero_grad() once per optimizer step (after the step, or before the first "
        "micro-batch)."),
    Misconception(
        "acc_all_reduces_by_hand_as_well", "all-reduce the gradients by hand after accumulating, to be sure",
        "the learner's own dist.all_reduce calls, on top of DDP's",
        "The backward outside no_sync already averages the accumulated gradients over the ranks; "
        "a second all-reduce only adds traffic (or, without a division, multiplies them by the "
        "world size). Remove it."),
    Misconception(
        "acc_returns_the_sum", "the loss of the step is the sum of the micro-batch losses",
        f"the returned loss is {K} times the mean",
        f"that is {K} times the mean: return the sum of the divided losses"),
    Misconception(
        "acc_returns_nothing", "the step's work is done once the optimizer stepped",
        "the function returned None",
        "got NoneType (a missing `return`?)"),
)


def _micro_batches(step: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s k micro-batches for optimizer step ``step`` (the same data everywhere)."""
    X, Y = make_dataset(256, seed=7).tensors
    B = MICRO * WORLD * K
    idx = torch.arange(step * B, (step + 1) * B).view(K, WORLD, MICRO)[:, rank]
    return [(X[i], Y[i]) for i in idx]


class _Probe:
    """What the learner's step did: forwards, ``no_sync`` use, all-reduces, optimizer steps.

    A context manager: on entry it hooks the model and replaces ``model.no_sync`` and
    ``optimizer.step`` by recording versions, and installs a spy on ``dist.all_reduce``; on exit,
    also after an error, all of them are put back.
    """

    def __init__(self, model, opt):
        self.model, self.opt = model, opt
        self.forwards = 0            # forward passes in this call (through DDP or model.module)
        self.forwards_unsynced = 0   # ... of which DDP was told not to all-reduce (no_sync)
        self.no_sync_entered = 0
        self.reduces: list[int] = []  # per all-reduce of a bucket: the micro-step it ran in
        self.steps = 0
        self.grads_at_step: dict[str, torch.Tensor | None] = {}
        self.spy = CollectiveSpy(("all_reduce",))  # the learner's own dist.all_reduce calls
        self._stack = contextlib.ExitStack()

    @property
    def by_hand(self) -> int:
        return len(self.spy.calls)

    def __enter__(self) -> _Probe:
        model, opt, stack = self.model, self.opt, self._stack
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

        stack.callback(model.module.register_forward_pre_hook(self._on_forward).remove)
        model.register_comm_hook(None, self._hook)  # the model is this probe's alone
        stack.enter_context(mock.patch.object(model, "no_sync", no_sync))
        stack.enter_context(mock.patch.object(opt, "step", step))
        stack.enter_context(self.spy)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.__exit__(*exc)

    def reset(self) -> None:
        self.forwards = self.forwards_unsynced = self.no_sync_entered = self.steps = 0
        self.reduces, self.grads_at_step = [], {}
        self.spy.clear()

    def _on_forward(self, module, inputs):
        self.forwards += 1
        if torch.is_grad_enabled() and not self.model.require_backward_grad_sync:
            self.forwards_unsynced += 1

    def _hook(self, state, bucket):  # no annotations: DDP would compare them as strings here
        self.reduces.append(self.forwards)
        buf = bucket.buffer().div_(dist.get_world_size())
        with self.spy.paused():  # DDP's all-reduce, not the learner's
            fut = dist.all_reduce(buf, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])


def _run_answer(fn, rank: int, device: torch.device) -> Outcome:
    """The learner's step for ``STEPS`` optimizer steps on a fresh DDP model, observed."""
    model = opt = probe = None
    steps: list[dict] = []
    try:
        model = wrap_ddp(make_model(0), device)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        with _Probe(model, opt) as probe:
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
                    "reduces": list(probe.reduces), "by_hand": probe.by_hand,
                    "opt_steps": probe.steps, "no_sync": probe.no_sync_entered,
                    "unsynced": probe.forwards_unsynced, "forwards": probe.forwards,
                    "returned": as_float(ret), "grads": probe.grads_at_step,
                    "params": state_to_cpu(model),
                    "momentum": {n: opt.state[p]["momentum_buffer"].detach().cpu().clone()
                                 for n, p in model.module.named_parameters()
                                 if opt.state[p].get("momentum_buffer") is not None},
                })
    finally:
        # Free the DDP model before its process group, also when the learner's code raised (the
        # traceback keeps this frame): a DDP model that outlives the group can hang or abort the
        # worker when it is freed (torch 2.13, gloo).  process_group collects it.
        model = opt = probe = None
    return Outcome(rank, data={"steps": steps, "buckets": buckets})


def _accumulation_worker(fns: list, catch: bool) -> Outcome:
    """Runs on every rank: each answer in ``fns`` on its own DDP model, one ``Outcome`` each.

    With ``catch`` an answer's exception becomes its outcome's problem and the next answer runs
    (for ``accumulation_verdicts``); without it, the exception reaches ``run_workers``.
    """
    with process_group() as pg:
        answers = []
        for fn in fns:
            if not catch:
                answers.append(_run_answer(fn, pg.rank, pg.device))
                continue
            try:
                answers.append(_run_answer(fn, pg.rank, pg.device))
            except Exception as e:
                answers.append(Outcome(pg.rank, problem=f"your code raised {type(e).__name__}: {e}\n"
                                       + learner_frames(traceback.format_exc())))
        return Outcome(pg.rank, data={"answers": answers})


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
        (_scaled(r["grad"], K), "acc_forgets_to_divide"),
        (_scaled(r["grad"], 1 / WORLD), "acc_divides_by_world_size_too"),
        ({n: sum(r["micro"][q][K - 1][n] for q in range(WORLD)) / (WORLD * K) for n in r["grad"]},
         "acc_zero_grad_inside_the_loop"),
    ]
    if s > 0:
        candidates.append((
            {n: r["grad"][n] + sum(ref[q]["grad"][n] for q in range(s)) for n in r["grad"]},
            "acc_never_zeroes"))
    for want, key in candidates:
        if close(want, got, atol=ATOL):
            return CATALOGUE.hint(key)
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
            f"{len(red)} all-reduce(s) DDP made. " + CATALOGUE.hint("acc_all_reduces_by_hand_as_well"))
    if not red:
        why = CATALOGUE.hint("acc_no_sync_everywhere")
    elif len(red) == K * buckets and st["no_sync"] and not st["unsynced"]:
        why = CATALOGUE.hint("acc_only_backward_in_no_sync")
    elif len(red) == K * buckets:
        why = CATALOGUE.hint("acc_never_uses_no_sync")
    elif len(red) == buckets:
        micro = sorted(set(red))
        why = (f"DDP all-reduced during micro-step {', '.join(map(str, micro))} of {K}, not during "
               "the last one: " + CATALOGUE.hint("acc_syncs_the_first_micro_step"))
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
    outcomes = judge(run_workers(
        _accumulation_worker, WORLD, args=([fn], False), timeout=timeout,
        hang_hint="a collective (dist.all_reduce, or a backward outside no_sync) that only some "
                  "ranks reach."), world=WORLD)
    _judge([o.data["answers"][0] for o in outcomes], _reference())
    print(f"accumulate_and_step: on {WORLD} ranks, {STEPS} SGD-momentum steps of {K} micro-batches "
          f"each; one all-reduce per bucket, in the last micro-batch's backward; gradients at the "
          "step, parameters, momentum and returned loss match a single process on the global batch")


def _judge(outcomes: list[Outcome], ref: list[dict]) -> None:
    """Raise CheckFailed naming the first mistake in one answer's outcomes (one per rank)."""
    first_problem(outcomes)
    outcomes = sorted(outcomes, key=lambda o: o.rank)
    buckets = outcomes[0].data["buckets"]
    for s in range(STEPS):
        for o in outcomes:
            st = o.data["steps"][s]
            if st["opt_steps"] != 1:
                raise CheckFailed(
                    f"on rank {o.rank}, call {s + 1}: optimizer.step() ran {st['opt_steps']} "
                    f"time(s) for {K} micro-batches; expected exactly 1.\nUsual mistake: "
                    + (CATALOGUE.hint("acc_steps_every_micro_batch")
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
                    f"on rank {o.rank}, step {s + 1}: expected the mean loss over the micro-batches "
                    "as a float, " + (CATALOGUE.hint("acc_returns_nothing") if got[1] == "NoneType"
                                      else f"got {got[1]}"))
            if not math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-6):
                ratio = got / want if want else float("nan")
                hint = (CATALOGUE.hint("acc_returns_the_sum")
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
    outcomes = judge(run_workers(_accumulation_worker, WORLD, args=(list(fns), True),
                                 timeout=timeout), world=WORLD)
    ref = _reference()
    verdicts = []
    for i in range(len(fns)):
        try:
            _judge([o.data["answers"][i] for o in outcomes], ref)
            verdicts.append("")
        except CheckFailed as e:
            verdicts.append(str(e))
    return verdicts
