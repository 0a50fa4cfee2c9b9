"""09.c metrics in different orders: collectives match by order, not by name.

``sync_metrics(metrics) -> dict`` runs on two ranks whose metric dicts hold their keys in different
orders, one key on one rank only; every rank must return the totals of every key any rank has.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch

from ...checking import (
    Catalogue,
    CheckFailed,
    Misconception,
    Outcome,
    checker,
    judge,
    process_group,
    require_callable,
    run_workers,
)
from .common import WORLD, agree, number

__all__ = ["CATALOGUE", "check_metrics_sync"]

_METRICS = [
    [{"samples": 64.0, "correct": 50.0}, {"correct": 41.0, "samples": 64.0, "skipped_nan": 1.0}],
    [{"loss_sum": 2.5}, {"loss_sum": 5.0}],
]

CATALOGUE = Catalogue(
    "09.c metrics order",
    Misconception(
        "sync_broken",
        "one all-reduce per key, in this rank's own keys",
        "a rank returned only its own keys",
        "every key that any rank has (a key missing on a rank counts as 0)"),
    Misconception(
        "sync_in_own_order",
        "each rank may reduce its keys in its own order",
        "totals that add up values of different names",
        "the ranks issued their all-reduces in different orders"),
    Misconception(
        "sync_sorted_local_keys",
        "sorting makes the order the same on every rank",
        "a hang, or an error: one rank issued an all-reduce more than the other",
        "one rank had a key the other lacked and issued an extra one"),
    Misconception(
        "sync_in_set_order",
        "the same keys on every rank make the same set",
        "totals that add up values of different names (the checker salts each rank's hashes)",
        "a set of the keys is not in the same order on every rank: each process salts string "
        "hashes differently"),
    Misconception(
        "sync_mean",
        "a synchronised metric is the mean over the ranks",
        "every value is the total divided by the world size",
        "the mean over the ranks: these metrics are counts and sums, return their totals (no "
        "division by the world size)"),
    Misconception(
        "sync_as_list",
        "any container of pairs will do",
        "the returned value is not a dict",
        "expected a dict of totals"),
)
_hint = CATALOGUE.hint

_ORDER = (f"{_hint('sync_in_own_order')}, or {_hint('sync_sorted_local_keys')}. Collectives match by "
          "order, not by name: agree on the keys first (dist.all_gather_object), then reduce in "
          f"sorted order ({_hint('sync_in_set_order')})")


class _MetricName(str):
    """A metric's name that hashes differently on each rank, as names do under torchrun.

    Python salts the hash of every str with a seed drawn when the interpreter starts (unless
    PYTHONHASHSEED is set), so the workers torchrun starts iterate one set of names in different
    orders.  The checker's workers are forked from one process and share its seed; this name
    brings the difference back, deterministically (with salts 0 and 1 the set of case 0's three
    names iterates in two different orders).
    """

    salt = 0

    def __hash__(self) -> int:
        return zlib.crc32(f"{_MetricName.salt}:{self}".encode())

    def __eq__(self, other: object) -> bool:
        return str.__eq__(self, other)


def _worker(fn: Callable) -> Outcome:
    """Each case's result; an exception ends the run (the partner rank has usually gone) and is
    reported with the others' results, as ``data["raised"]``."""
    with process_group("gloo") as pg:
        _MetricName.salt = pg.rank
        results: list = []
        raised = ""
        for case in _METRICS:
            try:
                got = fn({_MetricName(k): v for k, v in case[pg.rank].items()})
                results.append({str(k): v for k, v in got.items()} if isinstance(got, dict) else got)
            except NotImplementedError:
                raise
            except Exception as e:  # usually: the partner rank finished and closed the connection
                raised = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                break
    return Outcome(pg.rank, data={"results": results, "raised": raised})


def _item(raw: object) -> object:
    return raw.item() if isinstance(raw, torch.Tensor) and raw.numel() == 1 else raw


@checker("09.c metrics order")
def check_metrics_sync(sync_metrics: Callable, *, timeout: float = 20.0) -> None:
    """Two ranks with metric dicts in different orders, one key on one rank only."""
    require_callable(sync_metrics, "sync_metrics(metrics)")
    outcomes = run_workers(_worker, WORLD, args=(sync_metrics,), timeout=timeout, hang_hint=_ORDER,
                           error_hint=_ORDER)
    out = [o.data for o in judge(outcomes, world=WORLD)]
    errors = []
    for i, case in enumerate(_METRICS):
        keys = sorted({k for d in case for k in d})
        expected = {k: sum(d.get(k, 0.0) for d in case) for k in keys}
        for r in range(WORLD):
            results = out[r]["results"]
            if i >= len(results):
                if i == len(results) and out[r]["raised"]:
                    errors.append(f"rank {r} raised {out[r]['raised']}")
                continue
            got = results[i]
            if not isinstance(got, dict):
                raise CheckFailed(f"rank {r}: sync_metrics returned a {type(got).__name__}; "
                                  + _hint("sync_as_list"))
            if sorted(got) != keys:
                raise CheckFailed(
                    f"rank {r} returned the keys {sorted(got)}, expected {keys}: "
                    f"{_hint('sync_broken')}. Inputs: {case}")
            for k in keys:
                v = number(_item(got[k]), f"sync_metrics()[{k!r}]", r)
                if not agree(v, expected[k]):
                    mean = all(isinstance(_item(got[j]), (int, float))
                               and agree(_item(got[j]), expected[j] / WORLD) for j in keys)
                    raise CheckFailed(
                        f"rank {r}: {k} = {v:g}, expected the total {expected[k]:g} (inputs "
                        f"{case}).\nUsual mistake: " + (_hint("sync_mean") if mean else _ORDER))
    if errors:
        raise CheckFailed("; ".join(errors) + f"\nUsual mistake: {_ORDER}")
