"""04.a: data-parallel training with a hand-written gradient all-reduce.

``check_hand_allreduce(train_data_parallel)``: ``train_data_parallel(model, batches, lr)`` trains
``model`` (a different initialisation on each rank) with SGD on this rank's ``batches``, averaging
gradients across ranks by hand; on 2 and 3 ranks it must end where torch DDP ends.  Each rank
also trains reference versions of the usual mistakes (summing, no broadcast, no all-reduce), so
that a wrong result is named by the mistake it equals.

The misconceptions it recognises are ``CATALOGUE`` below (each key names the wrong answer in
tests/checkers/test_ch04_hand_allreduce.py).  Right answers written differently pass: one flat
buffer per step, the loss divided by the world size before backward and the gradients summed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

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
    compare_tensors,
    judge,
    process_group,
    require_callable,
    run_workers,
    state_to_cpu,
    wrap_ddp,
)
from ...data import make_model
from ...workers.errors import ECHO
from .common import ATOL, MISMATCH_HINT, describe_error, rank_batches

__all__ = ["CATALOGUE", "check_hand_allreduce"]

CATALOGUE = Catalogue(
    "04.a hand-written all-reduce",
    Misconception(
        "sums_instead_of_averaging",
        "all-reduce sums, and that is what DDP does",
        "the parameters equal training with the sum of the ranks' gradients",
        "you summed the gradients with dist.all_reduce but did not divide by the world size"),
    Misconception(
        "no_initial_broadcast",
        "the ranks start from the same weights anyway",
        "the parameters equal averaged training from each rank's own initialisation",
        "not broadcasting the initial weights: before training, copy rank 0's parameters to every "
        "rank with dist.broadcast(p.data, src=0) (torch DDP does this in its constructor)."),
    Misconception(
        "averages_the_loss",
        "averaging the loss over the ranks averages the gradients",
        "dist.all_reduce was given a tensor of the autograd graph, and the gradients were never averaged",
        "Averaging the loss does not average the gradients: autograd does not differentiate "
        "through dist.all_reduce (torch warns 'c10d::allreduce_: an autograd kernel was not "
        "registered'), so backward still gives each rank the gradient of its own loss. After "
        "loss.backward(), all-reduce every p.grad and divide it by the world size."),
    Misconception(
        "averages_parameters",
        "averaging the weights after each step is the same as averaging the gradients",
        "dist.all_reduce was given the parameters (their memory, or a copy of their values), not their .grad",
        "Averaging the parameters after optimizer.step() lands on DDP's numbers here only because "
        "SGD's update is linear in the gradient (with momentum or weight decay too); with Adam, "
        "whose update is not, the ranks would end elsewhere, and every rank's optimizer state "
        "would follow its own gradient. DDP averages the gradients: after loss.backward() and "
        "before optimizer.step(), all-reduce every p.grad and divide it by the world size."),
    Misconception(
        "averages_initial_weights",
        "averaging the initial weights makes the ranks agree, like the broadcast",
        "dist.all_reduce was given the parameters before the first backward, and the end differs from DDP's",
        "Averaging the initial weights makes the ranks agree, but on the mean of their starts, which "
        "is not where DDP starts: its constructor copies rank 0's parameters to every rank. Before "
        "training, dist.broadcast(p.data, src=0) for every parameter."),
    Misconception(
        "all_reduce_before_backward",
        "all-reduce the gradients, then backward (zero_grad set them to None: nothing is sent)",
        "the parameters equal training on the rank's own shard only",
        "its gradients were never all-reduced. Usual mistakes: all-reducing before backward (the "
        ".grad is then overwritten or still None) or after optimizer.step(), or all-reducing a "
        "copy (`g = p.grad.clone()`) instead of p.grad itself."),
    Misconception(
        "weights_only",
        "the weights are what matters: the biases can stay local",
        "some parameters (the biases) differ from torch DDP's",
        "all-reducing only some parameters (every .grad must be averaged), dividing by the wrong "
        "number, or an optimizer other than SGD(model.parameters(), lr=lr)."),
    Misconception(
        "rank0_only",
        "rank 0 does the communication",
        "the ranks hang, or a rank finds its peer gone, in a collective",
        MISMATCH_HINT),
    Misconception(
        "forgets_return",
        "the model is trained in place, nothing to return",
        "train_data_parallel returned something other than a module",
        "expected the trained model (`return model`)"),
)
_hint = CATALOGUE.hint

_STEPS, _BATCH, _LR = 4, 48, 0.2


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


def _observer(model: torch.nn.Module) -> Callable[[str, torch.Tensor | None], dict]:
    """What each all-reduce was given: a tensor of the autograd graph (a loss: autograd does not
    differentiate through dist.all_reduce, so it never reaches the gradients), or a parameter of
    ``model`` rather than its ``.grad``: its memory (``p``, ``p.data``) or, at the moment of the
    call, its values (``p.detach().clone()``, or every parameter in one flat buffer); and whether
    a backward had accumulated a gradient into ``model`` yet (before it: the initial weights)."""
    parameters = list(model.parameters())
    total = sum(p.numel() for p in parameters)
    backward_seen = [False]
    for p in parameters:  # set once autograd has written a gradient (zero_grad cannot undo it)
        p.register_post_accumulate_grad_hook(lambda _p: backward_seen.__setitem__(0, True))

    def is_parameter(t: torch.Tensor) -> bool:
        with torch.no_grad():
            if t.numel() == total and t.dim() == 1:  # every parameter in one flat buffer
                return torch.equal(t, torch.cat([p.reshape(-1) for p in parameters]))
            return any(t.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
                       or (t.shape == p.shape and torch.equal(t, p)) for p in parameters)

    def annotate(op: str, tensor: torch.Tensor | None) -> dict:
        return {"in_graph": tensor is not None and tensor.grad_fn is not None,
                "on_parameter": tensor is not None and is_parameter(tensor),
                "before_training": not backward_seen[0]}
    return annotate


def _worker(train_fn: Callable) -> Outcome:
    with process_group() as pg:
        batches = rank_batches(_STEPS, _BATCH, pg.device)
        init = make_model(seed=100 + pg.rank).to(pg.device)  # a different start on every rank

        # torch DDP: the answer.
        ddp = wrap_ddp(copy.deepcopy(init), pg.device)
        opt = torch.optim.SGD(ddp.parameters(), lr=_LR)
        for x, y in batches:
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
        expected = state_to_cpu(ddp.module)
        del ddp

        variants = {
            "sum": dict(broadcast=True, sync="sum"),
            "no broadcast": dict(broadcast=False, sync="mean"),
            "no sync": dict(broadcast=True, sync="none"),
            "nothing": dict(broadcast=False, sync="none"),
        }
        variant_states = {k: state_to_cpu(_sgd_variant(copy.deepcopy(init), batches, _LR, **kw))
                          for k, kw in variants.items()}
        dist.barrier()

        # The learner's function, on its own copy of the same start and data.
        where = f"rank {pg.rank} of {pg.world}"
        model = copy.deepcopy(init)
        try:
            with CollectiveSpy(("all_reduce",), annotate=_observer(model)) as spy:
                got = train_fn(model, [(x.clone(), y.clone()) for x, y in batches], _LR)
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001 - reported to the learner with the rank
            text = describe_error(e)
            if ECHO.search(text):  # a peer had finished and left while this rank still waited
                return Outcome(pg.rank, f"{where} was still waiting in a collective when another "
                               f"rank had finished and left. Usual mistake: {_hint('rank0_only')}",
                               {"echo": True})
            return Outcome(pg.rank, f"on {where}, train_data_parallel raised {text}")
        if not isinstance(got, torch.nn.Module):
            returned = "None" if got is None else type(got).__name__
            return Outcome(pg.rank, f"train_data_parallel returned {returned} on rank {pg.rank}; "
                           f"{_hint('forgets_return')}")
        try:
            got_state = state_to_cpu(got)
        except Exception as e:  # noqa: BLE001
            return Outcome(pg.rank, f"on {where}, reading the returned model's state raised "
                           f"{describe_error(e)}")
        return Outcome(pg.rank, data={
            "expected": expected, "got": got_state, "variants": variant_states,
            "loss_all_reduces": sum(c.extra["in_graph"] for c in spy.calls),
            "parameter_all_reduces": sum(c.extra["on_parameter"] and not c.extra["before_training"]
                                         for c in spy.calls),
            "initial_parameter_all_reduces": sum(c.extra["on_parameter"] and c.extra["before_training"]
                                                 for c in spy.calls),
        })


@checker("04.a hand-written all-reduce")
def check_hand_allreduce(train_data_parallel: Callable, *, world_sizes=(2, 3),
                         timeout: float = 120.0) -> None:
    """Run ``train_data_parallel(model, batches, lr)`` on 2 and 3 ranks; compare with torch DDP."""
    require_callable(train_data_parallel, "train_data_parallel(model, batches, lr)")
    for world in world_sizes:
        outcomes = run_workers(_worker, world, args=(train_data_parallel,), timeout=timeout,
                               hang_hint=_hint("rank0_only"), error_hint=_hint("rank0_only"))
        _judge(outcomes, world)
    print(f"train_data_parallel matches torch DDP after {_STEPS} SGD steps on "
          f"{' and '.join(str(w) for w in world_sizes)} ranks, starting from a different "
          "initialisation on every rank")


def _judge(outcomes: list[Outcome], world: int) -> None:
    # A rank's own problem first; a peer that found it gone only when none has one.
    for o in sorted(outcomes, key=lambda o: (o.data.get("echo", False), o.rank)):
        if o.problem:
            raise CheckFailed(o.problem)
    outcomes = judge(outcomes, world=world)
    for o in outcomes:
        _judge_rank(o, world)
    first = outcomes[0].data["got"]
    for o in outcomes[1:]:
        compare_tensors(first, o.data["got"], atol=ATOL, what="the parameters at the end",
                        where=f"rank {o.rank} (compared with rank 0)")


def _judge_rank(o: Outcome, world: int) -> None:
    """Name the cause from the reference variants when this rank's parameters are not DDP's."""
    got, v = o.data["got"], o.data["variants"]
    where = f"rank {o.rank} of {world}"
    if o.data["parameter_all_reduces"]:  # checked first: with SGD the numbers can still be right
        raise CheckFailed(
            f"on {where} your code all-reduced the parameters, not their gradients "
            f"({o.data['parameter_all_reduces']} call(s) given a parameter or a copy of its values). "
            + _hint("averages_parameters"))
    if close(o.data["expected"], got, atol=ATOL):
        return
    if o.data["initial_parameter_all_reduces"]:
        raise CheckFailed(
            f"on {where} the parameters differ from torch DDP's, and your code all-reduced the "
            f"parameters before the first backward ({o.data['initial_parameter_all_reduces']} "
            f"call(s)). {_hint('averages_initial_weights')}")
    if close(v["sum"], got, atol=ATOL):
        raise CheckFailed(
            f"on {where} the parameters are what training with the SUM of the gradients gives "
            f"(as if the learning rate were {world} times larger). Usual mistake: "
            f"{_hint('sums_instead_of_averaging')} ({world}); DDP averages them.")
    if close(v["no broadcast"], got, atol=ATOL):
        raise CheckFailed(
            f"on {where} the gradients were averaged correctly, but the ranks started from "
            f"different weights and so never agree. Usual mistake: {_hint('no_initial_broadcast')}")
    if o.data["loss_all_reduces"]:
        raise CheckFailed(
            f"on {where} the gradients were never averaged: your code all-reduced a tensor of "
            f"the autograd graph (the loss) {o.data['loss_all_reduces']} time(s). "
            + _hint("averages_the_loss"))
    if close(v["no sync"], got, atol=ATOL) or close(v["nothing"], got, atol=ATOL):
        raise CheckFailed(f"on {where} the model trained only on its own shard: "
                          + _hint("all_reduce_before_backward"))
    compare_tensors(o.data["expected"], got, atol=ATOL, what=f"parameters after {_STEPS} SGD steps",
                    where=where, hint=_hint("weights_only"))
