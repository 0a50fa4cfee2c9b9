"""Checkers of chapter 05 (distributed data loading).

- ``check_bucket_sampler(BucketBatchSampler)``: a distributed-aware length-bucketing batch sampler.
  ``BucketBatchSampler(lengths, batch_size, num_replicas=None, rank=None, seed=0)`` with
  ``set_epoch(epoch)``, ``__iter__`` (lists of indices) and ``__len__``.  Checked on several world
  sizes and epochs, in this process (one sampler object per simulated rank) and in real worker
  processes (``num_replicas`` and ``rank`` left out, so read from the process group): batches of
  exactly ``batch_size`` indices, disjoint across ranks, covering the data set but for fewer than
  one round of batches, reshuffled every epoch identically on every rank (the batches themselves
  change, not only their order), the same number of batches on every rank, ``len()`` telling
  the truth, and little padding.

The misconceptions it recognises are ``CATALOGUE`` below: each entry's key names the wrong
sampler written with it in tests/checkers/test_ch05_bucket_sampler.py, its message is what the
failure says.

Right answers written differently pass: steps sorted with Python's ``sorted`` and dealt every
N-th sample [Right]; numpy (``default_rng(seed + epoch)``, ``argsort``) with contiguous slices
[NumpyContiguousSlices]; bucketed batches from a ``random.Random(seed + epoch)`` instance dealt
round-robin after trimming their number to a multiple of the ranks [BatchesDealtRoundRobin].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import cloudpickle
import torch

from ..checking import (
    Catalogue,
    CheckFailed,
    Misconception,
    Outcome,
    checker,
    judge,
    process_group,
    require_callable,
    run_workers,
    time_limit,
)
from ..data import make_sequences
from ..measure.ch05 import padding_waste

__all__ = ["CATALOGUE", "check_bucket_sampler"]

_N, _BATCH, _EPOCHS, _WORLDS = 1500, 16, 3, (2, 3)
_MAX_WASTE = 0.20

CATALOGUE = Catalogue(
    "05.a bucket sampler",
    Misconception(
        "ArticleSampler",
        "the source article's sampler: bucketing alone is enough under DDP",
        "every simulated rank yields the same set of samples",
        "every rank yielded the same samples, so each rank trains on the whole data set and the "
        "world does the same work N times. The sampler is not distributed-aware (like the "
        "article's LengthAwareSampler): after forming the batches, give rank r only its share of "
        "them."),
    Misconception(
        "IgnoresProcessGroup",
        "num_replicas and rank are only needed in tests",
        "in real worker processes, with both left out, the two ranks read the same batches",
        "with num_replicas and rank left out, both ranks got the same batches: when they are None, "
        "read them from the process group (dist.get_world_size(), dist.get_rank()), as "
        "DistributedSampler does."),
    Misconception(
        "ForgetsEpoch",
        "the shuffle is fixed once (set_epoch stored, never used)",
        "rank 0 yields the same batches in epoch 0 and epoch 1",
        "rank 0 yields exactly the same batches in epoch 0 and epoch 1: set_epoch has no effect. "
        "Seed the shuffle with seed + epoch (as DistributedSampler does), or every epoch repeats "
        "the first one."),
    Misconception(
        "SeedPerRank",
        "each rank needs its own random seed",
        "two ranks' shards share samples",
        "a seed that depends on the rank"),
    Misconception(
        "GlobalRandom",
        "Python's global random shuffles as well as a seeded generator",
        "two ranks' shards share samples: each process draws differently",
        "Python's global random"),
    Misconception(
        "UnevenBatches",
        "ranks may get a different number of batches",
        "the simulated ranks yield different numbers of batches",
        "The ranks with fewer batches finish the epoch first, and the others wait forever in their "
        "next gradient all-reduce. Drop the last few batches so that their number is a multiple of "
        "num_replicas (this exercise asks for disjoint shards, so no padding with repeated "
        "samples)."),
    Misconception(
        "UnevenBehindEqualLen",
        "the ranks may differ by one batch as long as len() gives every rank the same number",
        "the simulated ranks yield different numbers of batches, while len() gives one number",
        "a DataLoader runs as many steps as __iter__ yields, whatever len() says: the rank with one "
        "batch more runs a step the others skip, and DDP hangs in that step's gradient all-reduce, "
        "waiting for ranks that never join it. Fix __iter__, not __len__."),
    Misconception(
        "DropsPerBucket",
        "an incomplete batch may be dropped in every bucket",
        "a whole round of batches or more is missing from the epoch",
        "dropping an incomplete batch in every bucket instead of once."),
    Misconception(
        "LenCountsAllRanks",
        "len() counts the batches of all ranks",
        "len(sampler) differs from the number of batches iterating yields",
        "DataLoader and progress bars rely on len()"),
    Misconception(
        "NoBucketing",
        "random batches are good enough",
        "the padding is above the limit",
        "Group samples of similar length: shuffle, cut into buckets of many batches, sort each "
        "bucket by length, then cut it into batches."),
    Misconception(
        "YieldsIndices",
        "a batch sampler yields indices, like a sampler",
        "the sampler yields single ints instead of lists",
        "a batch sampler yields lists of indices, one list per batch"),
    Misconception(
        "PadsByRepeating",
        "pad the last round like DistributedSampler(drop_last=False)",
        "some samples appear twice in the epoch while none is left out",
        "the last round was padded by repeating samples, as DistributedSampler(drop_last=False) "
        "does. This exercise asks for disjoint shards (a repeated sample counts twice in the "
        "gradient): drop the incomplete last step instead"),
    Misconception(
        "ReordersFixedBatches",
        "shuffling the order of the batches each epoch is the reshuffle set_epoch asks for",
        "most batches of epoch 1 hold exactly the samples of a batch of epoch 0",
        "the batches hold the same samples in every epoch, only their order changes: they are "
        "formed once (from a fixed sort or the seed alone) and only then shuffled with seed + "
        "epoch. Every epoch then averages the same batch gradients. Shuffle all indices with "
        "torch.Generator().manual_seed(seed + epoch) before cutting them into buckets and "
        "batches, so that the batches themselves change."),
    Misconception(
        "SortedNeverShuffled",
        "sorting by length is all the bucketing needs",
        "rank 0's batches come in order of length, the same in every epoch",
        "the data set was sorted once and never shuffled. The model then sees all short "
        "sequences, then all long ones, in the same order each epoch, and the loss drifts with the "
        "length instead of falling. Shuffle with torch.Generator().manual_seed(seed + epoch), sort "
        "only within buckets of a few steps, and shuffle the order of the steps too."),
)
_hint = CATALOGUE.hint


def _random_waste(lengths: Sequence[int], batch_size: int) -> float:
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(0)).tolist()
    batches = [order[i:i + batch_size] for i in range(0, len(order) - batch_size + 1, batch_size)]
    return padding_waste(batches, lengths)


def _epoch_batches(cls: Any, lengths: list[int], world: int, epoch: int, **kw: Any) -> list[list[list[int]]]:
    """The batches each simulated rank yields in ``epoch`` (fresh sampler objects)."""
    per_rank, lens = [], []
    for rank in range(world):
        sampler = cls(lengths, _BATCH, num_replicas=world, rank=rank, **kw)
        if not hasattr(sampler, "set_epoch"):
            raise CheckFailed("the sampler has no set_epoch(epoch) method; DistributedSampler has "
                              "one, and the training loop calls it at the start of every epoch")
        sampler.set_epoch(epoch)
        per_rank.append(_as_batches(iter(sampler), rank))
        lens.append(_len(sampler, rank))
    # Ranks that yield different numbers of batches are the fault, whatever len() says of each.
    _require_equal_counts(per_rank, f"world size {world}, epoch {epoch}", lens)
    for rank, (n, batches) in enumerate(zip(lens, per_rank)):
        if n != len(batches):
            raise CheckFailed(f"rank {rank} of {world}, epoch {epoch}: len(sampler) is {n} but "
                              f"iterating yields {len(batches)} batches; "
                              + _hint("LenCountsAllRanks"))
    return per_rank


def _require_equal_counts(per_rank: list[list[list[int]]], where: str, lens: list[int] | None = None) -> None:
    counts = [len(b) for b in per_rank]
    if len(set(counts)) == 1:
        return
    message = (f"{where}: the ranks get different numbers of batches "
               f"({', '.join(f'rank {r}: {c}' for r, c in enumerate(counts))}). ")
    if lens is not None and len(set(lens)) == 1:
        message += f"len(sampler) is {lens[0]} on every rank, but " + _hint("UnevenBehindEqualLen") + " "
    raise CheckFailed(message + _hint("UnevenBatches"))


def _same_batches(before: list[list[list[int]]], after: list[list[list[int]]]) -> float:
    """The share of the batches of ``after`` (all ranks) that hold exactly the samples of a batch
    of ``before``: about 0 for batches cut afresh each epoch, 1 for fixed batches reordered."""
    old = {frozenset(b) for batches in before for b in batches}
    new = [frozenset(b) for batches in after for b in batches]
    return sum(b in old for b in new) / max(1, len(new))


def _len(sampler: Any, rank: int) -> int:
    try:
        n = len(sampler)
    except TypeError as e:
        raise CheckFailed(f"len(sampler) failed on rank {rank}: {e}; define __len__") from None
    return n


def _as_batches(it: Any, rank: int) -> list[list[int]]:
    out = []
    for b in it:
        if isinstance(b, int) or not hasattr(b, "__iter__"):
            raise CheckFailed(f"rank {rank}: the sampler yielded {b!r}, a single index; "
                              + _hint("YieldsIndices"))
        batch = list(b)
        for i in batch:
            if not isinstance(i, int) or isinstance(i, bool):
                raise CheckFailed(f"rank {rank}: a batch holds {type(i).__name__} {i!r}; expected "
                                  "Python ints (use .tolist() on tensors)")
        out.append(batch)
    return out


def _judge_epoch(per_rank: list[list[list[int]]], world: int, epoch: int, n: int) -> None:
    where = f"world size {world}, epoch {epoch}"
    sets = [set(i for b in batches for i in b) for batches in per_rank]
    if world > 1 and all(s == sets[0] for s in sets[1:]):
        raise CheckFailed(f"{where}: " + _hint("ArticleSampler"))
    for rank, batches in enumerate(per_rank):
        for b in batches:
            if len(b) != _BATCH:
                raise CheckFailed(f"{where}: rank {rank} yielded a batch of {len(b)} indices; every "
                                  f"batch must hold exactly batch_size={_BATCH} (drop the incomplete "
                                  "last batch, as drop_last=True does)")
            bad = [i for i in b if not 0 <= i < n]
            if bad:
                raise CheckFailed(f"{where}: rank {rank} yielded index {bad[0]}, outside 0..{n - 1}")
    total = sum(len(b) for batches in per_rank for b in batches)
    extra = total - len(set().union(*sets))
    if 0 < extra < world * _BATCH and len(set().union(*sets)) == n:
        raise CheckFailed(
            f"{where}: {extra} samples appear twice in this epoch, while none is left out: "
            + _hint("PadsByRepeating")
            + f", fewer than num_replicas x batch_size = {world * _BATCH} samples.")
    for rank, batches in enumerate(per_rank):
        flat = [i for b in batches for i in b]
        if len(flat) != len(set(flat)):
            raise CheckFailed(f"{where}: rank {rank} yields some samples twice within one epoch")
    for r in range(world):
        for s in range(r + 1, world):
            common = sets[r] & sets[s]
            if common:
                raise CheckFailed(
                    f"{where}: ranks {r} and {s} share {len(common)} samples (e.g. {sorted(common)[:3]}). "
                    f"Usual mistake: the ranks shuffled differently ({_hint('SeedPerRank')}, "
                    f"or {_hint('GlobalRandom')}): every rank must build the same global list of "
                    "batches from the same generator, torch.Generator().manual_seed(seed + epoch), "
                    "and then take its own share.")
    _require_equal_counts(per_rank, where)
    covered = len(set().union(*sets))
    dropped = n - covered
    if dropped >= world * _BATCH:
        raise CheckFailed(
            f"{where}: only {covered} of {n} samples appear in this epoch ({dropped} dropped); "
            f"dropping is fine only to complete a round, fewer than num_replicas x batch_size = "
            f"{world * _BATCH} samples. Usual mistake: " + _hint("DropsPerBucket"))


@checker("05.a bucket sampler")
def check_bucket_sampler(BucketBatchSampler: Any, *, timeout: float = 120.0) -> None:
    """Check a distributed length-bucketing batch sampler class (see the module docstring)."""
    require_callable(BucketBatchSampler,
                     "the class BucketBatchSampler(lengths, batch_size, num_replicas, rank, seed)")
    lengths = list(make_sequences(_N, seed=1).lengths)
    with time_limit(None, "BucketBatchSampler, run in this notebook's process,"):
        waste, random_waste = _check_in_process(BucketBatchSampler, lengths)
    _check_in_workers(BucketBatchSampler, lengths, timeout)
    print(f"BucketBatchSampler: disjoint, equal-length shards on {' and '.join(map(str, _WORLDS))} "
          f"ranks, reshuffled each epoch, padding {100 * waste:.0f}% (random batching "
          f"{100 * random_waste:.0f}%), agreed across real processes")


def _check_in_process(BucketBatchSampler: Any, lengths: list[int]) -> tuple[float, float]:
    """Every world size and epoch in this process: shards, reshuffling, determinism, padding."""
    for world in _WORLDS:
        epochs = [_epoch_batches(BucketBatchSampler, lengths, world, e) for e in range(_EPOCHS)]
        for e, per_rank in enumerate(epochs):
            _judge_epoch(per_rank, world, e, len(lengths))
        # Reshuffled every epoch.
        if epochs[1][0] == epochs[0][0]:
            longest = [max(lengths[i] for i in b) for b in epochs[0][0]]
            if longest in (sorted(longest), sorted(longest, reverse=True)):
                raise CheckFailed(
                    f"world size {world}: rank 0's batches come in order of length, "
                    f"{'shortest' if longest == sorted(longest) else 'longest'} first, and the "
                    "same in every epoch: " + _hint("SortedNeverShuffled"))
            raise CheckFailed(f"world size {world}: " + _hint("ForgetsEpoch"))
        same = _same_batches(epochs[0], epochs[1])
        if same > 0.5:
            raise CheckFailed(f"world size {world}: {100 * same:.0f}% of the batches of epoch 1 hold "
                              "exactly the samples of a batch of epoch 0; "
                              + _hint("ReordersFixedBatches"))
        # Deterministic: a second object with the same arguments agrees (as another process would).
        again = _epoch_batches(BucketBatchSampler, lengths, world, 1)
        if again != epochs[1]:
            raise CheckFailed(
                f"world size {world}: two samplers built with the same seed yield different batches "
                "for the same epoch. Processes can only agree on a shuffle they compute from the same "
                "seed: use torch.Generator().manual_seed(seed + epoch), not the global `random` or "
                "torch RNG.")
        # A different seed gives a different shuffle.
        other = _epoch_batches(BucketBatchSampler, lengths, world, 1, seed=1)
        if other == epochs[1]:
            raise CheckFailed(f"world size {world}: seed=1 and seed=0 give the same batches; use the "
                              "seed argument in the generator")
        waste = padding_waste([b for per_rank in epochs[0] for b in per_rank], lengths)
        random_waste = _random_waste(lengths, _BATCH)
        if waste > _MAX_WASTE:
            raise CheckFailed(
                f"world size {world}: {100 * waste:.0f}% of the padded batches is padding (random "
                f"batching: {100 * random_waste:.0f}%; required: at most {100 * _MAX_WASTE:.0f}%). "
                + _hint("NoBucketing"))
    return waste, random_waste


def _worker(cls_bytes: bytes, lengths: list[int]) -> Outcome:
    with process_group() as pg:
        cls = cloudpickle.loads(cls_bytes)
        sampler = cls(lengths, _BATCH)  # num_replicas and rank from the process group
        sampler.set_epoch(2)
        return Outcome(pg.rank, data={"batches": [list(map(int, b)) for b in sampler]})


def _check_in_workers(cls: Any, lengths: list[int], timeout: float) -> None:
    try:
        payload = cloudpickle.dumps(cls)
    except Exception as e:
        raise CheckFailed(f"the sampler class cannot be sent to worker processes: {e}") from None
    world = 2
    outcomes = run_workers(_worker, world, args=(payload, lengths), timeout=timeout,
                           hang_hint="a sampler that waits in a collective only some ranks reach "
                                     "(the sampler needs no communication: every rank computes the "
                                     "same shuffle from seed + epoch).")
    per_rank = [o.data["batches"] for o in judge(outcomes, world=world)]
    if set(map(tuple, per_rank[0])) == set(map(tuple, per_rank[1])):
        raise CheckFailed(f"in {world} real worker processes, " + _hint("IgnoresProcessGroup"))
    _judge_epoch(per_rank, world, 2, len(lengths))
