"""09.e uneven inputs: ``Join``.

``train_uneven(model, optimizer, batches) -> int`` runs on two ranks, rank 0 with 5 batches and
rank 1 with 3: every batch is trained on, nobody hangs at the last batch, the replicas stay equal
and end with the weights of a reference trained under ``Join``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join

from ...checking import (
    Catalogue,
    CheckFailed,
    Misconception,
    Outcome,
    checker,
    compare_tensors,
    judge,
    process_group,
    require_callable,
    run_workers,
    state_to_cpu,
)
from ...data import make_dataset
from .common import WORLD, ddp_sgd, states_equal

__all__ = ["CATALOGUE", "check_uneven_join"]

CATALOGUE = Catalogue(
    "09.e uneven inputs",
    Misconception(
        "uneven_plain_loop",
        "each rank can simply train on the batches it has",
        "a hang: the rank with more batches waits in backward()",
        "the rank with fewer batches left its loop while the other was still in DDP's gradient "
        "all-reduce. Wrap the loop in `with Join([model]):` (torch.distributed.algorithms.join)"),
    Misconception(
        "uneven_truncated",
        "truncating to the shortest rank evens the ranks out",
        "a rank ran the model on fewer batches than it has",
        "train on every batch (Join lets the ranks with more batches go on; truncating to the "
        "shortest rank throws data away)"),
    Misconception(
        "uneven_without_ddp",
        "model.module is the same model",
        "the ranks' weights differ",
        "the ranks trained apart (model.module bypasses DDP's all-reduce, or no_sync() was left on)"),
    Misconception(
        "uneven_padded_with_a_real_batch",
        "reuse a batch to keep the ranks in step",
        "a rank ran the model more often than it has batches, and the weights differ from Join's",
        "A padding step must take part in the all-reduce and contribute nothing: multiply its loss "
        "by 0. Or let `with Join([model]):` do it"),
    Misconception(
        "uneven_counts_batches_not_steps",
        "the step count is the longest rank's",
        "the returned count differs from the optimizer steps this rank made (a step hook counts)",
        "return the number of steps this rank took"),
)
_hint = CATALOGUE.hint


def _uneven_batches(rank: int) -> list:
    X, Y = make_dataset(16 * 5, seed=20 + rank).tensors
    n = 5 if rank == 0 else 3
    return [(X[i * 16:(i + 1) * 16], Y[i * 16:(i + 1) * 16]) for i in range(n)]


def _worker(fn: Callable) -> Outcome:
    with process_group("gloo") as pg:
        batches = _uneven_batches(pg.rank)

        ref, ref_opt = ddp_sgd()
        with Join([ref]):
            for x, y in batches:
                F.cross_entropy(ref(x), y).backward()
                ref_opt.step()
                ref_opt.zero_grad()
        reference = state_to_cpu(ref)
        del ref, ref_opt

        model, opt = ddp_sgd()
        forwards, stepped = [0], [0]
        model.module.register_forward_pre_hook(lambda m, a: forwards.__setitem__(0, forwards[0] + 1))
        opt.register_step_post_hook(lambda o, a, k: stepped.__setitem__(0, stepped[0] + 1))
        steps = fn(model, opt, batches)
        dist.barrier()  # reached only if the learner's loop left the ranks in step
        state = state_to_cpu(model)
        del model, opt
    return Outcome(pg.rank, data={"steps": steps, "forwards": forwards[0], "stepped": stepped[0],
                                  "batches": len(batches), "state": state, "reference": reference})


@checker("09.e uneven inputs")
def check_uneven_join(train_uneven: Callable, *, timeout: float = 20.0) -> None:
    """Rank 0 has 5 batches, rank 1 has 3; the loop must use them all and not hang."""
    require_callable(train_uneven, "train_uneven(model, optimizer, batches)")
    outcomes = run_workers(_worker, WORLD, args=(train_uneven,), timeout=timeout,
                           hang_hint=_hint("uneven_plain_loop"))
    out = [o.data for o in judge(outcomes, world=WORLD)]
    for r, o in enumerate(out):
        if o["forwards"] < o["batches"]:
            raise CheckFailed(f"rank {r} ran the model on {o['forwards']} of its {o['batches']} "
                              "batches: " + _hint("uneven_truncated"))
        steps = o["steps"]
        if not isinstance(steps, int) or isinstance(steps, bool):
            raise CheckFailed(f"rank {r}: train_uneven returned {steps!r}, expected the number "
                              f"of optimizer steps it took (an int: {o['stepped']} here)")
        if steps != o["stepped"]:
            raise CheckFailed(f"rank {r}: train_uneven returned {steps}, but optimizer.step() "
                              f"ran {o['stepped']} times on this rank; "
                              + _hint("uneven_counts_batches_not_steps"))
    states_equal([o["state"] for o in out], "parameters", _hint("uneven_without_ddp"))
    padded = [r for r, o in enumerate(out) if o["forwards"] > o["batches"]]
    hint = ("forward through the DDP model, backward, step, zero_grad, inside `with Join([model]):`")
    if padded:
        o = out[padded[0]]
        hint = (f"padding: rank {padded[0]} ran the model {o['forwards']} times on its "
                f"{o['batches']} batches, and its extra steps contributed gradients, so a batch was "
                "trained on twice. " + _hint("uneven_padded_with_a_real_batch"))
    compare_tensors(out[0]["reference"], out[0]["state"], atol=1e-6, what="parameters",
                    where="rank 0", hint=hint)
