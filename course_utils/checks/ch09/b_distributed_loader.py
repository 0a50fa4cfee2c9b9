"""09.b the loader of one epoch: ``DistributedSampler`` and ``set_epoch``.

``make_loader(dataset, batch_size, epoch) -> DataLoader`` is called for epochs 0, 1 and 2 on two
ranks; the sample ids each rank reads are audited (``course_utils.diagnose.check_duplicates``):
disjoint shards that cover the data set, shuffled, in a new order every epoch, and dealt anew (a
rank's share of the data set changes between epochs).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.data import DistributedSampler

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
from ...data import make_dataset
from ...diagnose import IndexedDataset, check_duplicates, sample_ids
from ...workers.errors import RankFailure
from .common import WORLD

__all__ = ["CATALOGUE", "check_distributed_loader"]

_N_SAMPLES = 96
_BATCH = 8
_EPOCHS = 3

CATALOGUE = Catalogue(
    "09.b distributed loader",
    Misconception(
        "loader_plain",
        "a DataLoader(shuffle=True) on every rank is enough",
        "every sample was read by more than one rank",
        "a plain DataLoader(shuffle=True) on every rank reads the whole data set; give it "
        "sampler=DistributedSampler(dataset) (and no shuffle=)"),
    Misconception(
        "loader_without_set_epoch",
        "DistributedSampler reshuffles every epoch by itself",
        "a rank visits its samples in the same order in two epochs",
        "DistributedSampler shuffles with seed + epoch, and the epoch only changes when you call "
        "sampler.set_epoch(epoch) before iterating"),
    Misconception(
        "loader_seed_per_rank",
        "each rank needs its own randomness",
        "the shards overlap, and the ranks' samplers have different seeds",
        "a seed per rank for randomness. Give every rank the same seed (the default, 0) and change "
        "the order between epochs with sampler.set_epoch(epoch)"),
    Misconception(
        "loader_shuffle_and_sampler",
        "shuffle=True as well as the sampler shuffles more",
        "DataLoader raised its 'mutually exclusive with shuffle' ValueError",
        "shuffle=True as well as a sampler; the sampler shuffles (DistributedSampler's "
        "shuffle=True is its default), so give the DataLoader sampler=sampler and no shuffle= "
        "argument"),
    Misconception(
        "loader_unshuffled",
        "sharding is all the sampler is for",
        "a rank reads its shard in index order",
        "reads its shard in index order: shuffle it (DistributedSampler(dataset, shuffle=True), its "
        "default)"),
    Misconception(
        "loader_fixed_shards",
        "a fixed split of the data set, shuffled on each rank, reshuffles every epoch",
        "every rank reads the same set of samples in every epoch (only their order changes)",
        "the split is fixed: each rank only shuffles its own share. DistributedSampler permutes the "
        "whole data set with seed + epoch before dealing it out, so with sampler.set_epoch(epoch) "
        "every rank gets a different share each epoch"),
    Misconception(
        "loader_strided",
        "a shard cut by hand covers the data set",
        "some samples were read by no rank",
        "the ranks' shards must cover the data set"),
)
_hint = CATALOGUE.hint


def _worker(fn: Callable, epochs: int) -> Outcome:
    with process_group("gloo") as pg:
        torch.manual_seed(pg.rank)  # ranks seed differently, as most scripts do
        dataset = IndexedDataset(make_dataset(_N_SAMPLES))
        orders, sizes, reports, seeds, problem = [], [], [], [], ""
        for epoch in range(epochs):
            loader = fn(dataset, _BATCH, epoch)
            if loader is None:
                problem = "make_loader returned None (a missing `return`?)"
                ids = []
            else:
                try:
                    batches = list(loader)
                except TypeError:
                    problem = f"make_loader returned a {type(loader).__name__}, not a DataLoader"
                    batches = []
                ids = sample_ids(batches)
                sizes.append(len(batches[0][-1]) if batches else 0)
                sampler = getattr(loader, "sampler", None)
                if isinstance(sampler, DistributedSampler):
                    seeds.append(sampler.seed)
            orders.append(ids)
            reports.append(check_duplicates(ids, _N_SAMPLES))  # a collective: every rank, every epoch
    return Outcome(pg.rank, problem=problem,
                   data={"orders": orders, "sizes": sizes, "reports": reports, "seeds": seeds})


def _explain_error(f: RankFailure) -> str | None:
    if "mutually exclusive with shuffle" in f.message:
        return (f"rank {f.rank}: DataLoader raised ValueError: {f.message}.\nUsual mistake: "
                + _hint("loader_shuffle_and_sampler"))
    return None


@checker("09.b distributed loader")
def check_distributed_loader(make_loader: Callable, *, timeout: float = 20.0) -> None:
    """Call ``make_loader(dataset, 8, epoch)`` for epochs 0, 1, 2 on two ranks; audit the ids."""
    require_callable(make_loader, "make_loader(dataset, batch_size, epoch)")
    outcomes = run_workers(_worker, WORLD, args=(make_loader, _EPOCHS), timeout=timeout,
                           hang_hint="the loader should not communicate; build it from "
                                     "DistributedSampler",
                           explain_error=_explain_error)
    out = [o.data for o in judge(outcomes, world=WORLD)]
    for r, o in enumerate(out):
        if any(s != _BATCH for s in o["sizes"]):
            raise CheckFailed(f"rank {r}: batches of {o['sizes'][0]} samples, expected "
                              f"batch_size={_BATCH}")
    for epoch, rep in enumerate(out[0]["reports"]):
        seeds = [o["seeds"][epoch] if len(o["seeds"]) > epoch else None for o in out]
        if rep.shared and None not in seeds and len(set(seeds)) > 1:
            raise CheckFailed(
                f"epoch {epoch}: {len(rep.shared)} of {_N_SAMPLES} samples were seen by more "
                f"than one rank: the ranks' DistributedSamplers have different seeds "
                f"({', '.join(map(str, seeds))}). Each rank permutes the data set with its own "
                "seed and takes every world_size-th sample of that permutation, so the shards "
                "overlap and miss samples.\nUsual mistake: " + _hint("loader_seed_per_rank"))
        if rep.shared:
            raise CheckFailed(
                f"epoch {epoch}: {len(rep.shared)} of {_N_SAMPLES} samples were seen by more "
                f"than one rank (samples per rank: {rep.counts}; e.g. ids {sorted(rep.shared)[:5]}).\n"
                "Usual mistake: " + _hint("loader_plain"))
        if rep.repeated:
            raise CheckFailed(f"epoch {epoch}: some ranks saw the same sample twice "
                              f"({rep.repeated}); each sample once per epoch")
        if rep.missing:
            raise CheckFailed(f"epoch {epoch}: {len(rep.missing)} samples were seen by no rank "
                              f"(e.g. {rep.missing[:5]}); " + _hint("loader_strided"))
    for r, o in enumerate(out):
        orders = o["orders"]
        if orders[0] == sorted(orders[0]):
            raise CheckFailed(f"rank {r} " + _hint("loader_unshuffled"))
        same = [(a, b) for b in range(1, len(orders)) for a in range(b) if orders[a] == orders[b]]
        if same:
            a, b = same[0]
            raise CheckFailed(
                f"rank {r}: epoch {b} visits the samples in exactly the same order as epoch "
                f"{a}.\nUsual mistake: " + _hint("loader_without_set_epoch"))
    if all(len({frozenset(order) for order in o["orders"]}) == 1 for o in out):
        raise CheckFailed(
            f"every rank read the same {len(out[0]['orders'][0])} samples in each of the "
            f"{_EPOCHS} epochs, in a new order each time: " + _hint("loader_fixed_shards"))
