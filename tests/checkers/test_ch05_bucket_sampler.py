"""Chapter 05.a: a distributed-aware length-bucketing batch sampler.

The checker must accept a right answer and name each usual mistake.  Each wrong answer below is a
small sampler with one typical fault.
"""

from __future__ import annotations

import random
import sys

import cloudpickle
import numpy as np
import pytest
import torch
import torch.distributed as dist
from misconceptions import cases  # tests/checkers/misconceptions.py, beside this file

from course_utils.checking import CheckFailed
from course_utils.checks import check_bucket_sampler
from course_utils.checks.ch05 import CATALOGUE
from course_utils.measure.ch05 import padding_waste

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need no import path


class Right:
    """Shuffle with seed + epoch, sort buckets of many steps, give rank r its slice of each step."""

    bucket_steps = 16

    def __init__(self, lengths, batch_size, num_replicas=None, rank=None, seed=0):
        self.lengths, self.batch_size, self.seed, self.epoch = list(lengths), batch_size, seed, 0
        self.num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
        self.rank = dist.get_rank() if rank is None else rank

    def set_epoch(self, epoch):
        self.epoch = epoch

    def generator(self):
        return torch.Generator().manual_seed(self.seed + self.epoch)

    def steps(self):
        g = self.generator()
        order = torch.randperm(len(self.lengths), generator=g).tolist()
        step = self.batch_size * self.num_replicas
        bucket = step * self.bucket_steps
        groups = []
        for start in range(0, len(order), bucket):
            chunk = sorted(order[start:start + bucket], key=self.lengths.__getitem__)
            groups += [chunk[i:i + step] for i in range(0, len(chunk) - step + 1, step)]
        return [groups[k] for k in torch.randperm(len(groups), generator=g).tolist()]

    def __iter__(self):
        b = self.batch_size
        for group in self.steps():
            yield group[self.rank * b:(self.rank + 1) * b]

    def __len__(self):
        return len(self.steps())


class ArticleSampler(Right):
    """The article's LengthAwareSampler: sort, batch, shuffle the batches; every rank the same."""

    def __iter__(self):
        indices = sorted(range(len(self.lengths)), key=self.lengths.__getitem__)
        b = self.batch_size
        batches = [indices[i:i + b] for i in range(0, len(indices) - b + 1, b)]
        random.shuffle(batches)
        yield from batches

    def __len__(self):
        return len(self.lengths) // self.batch_size


class ForgetsEpoch(Right):
    def generator(self):
        return torch.Generator().manual_seed(self.seed)  # set_epoch is stored, never used


class SeedPerRank(Right):
    def generator(self):
        return torch.Generator().manual_seed(self.seed + self.epoch + 1000 * self.rank)


class UnevenBatches(Right):
    """Bucketed batches dealt out batches[r::N] without trimming: some ranks get one batch more."""

    def batches(self):
        g = self.generator()
        order = torch.randperm(len(self.lengths), generator=g).tolist()
        b, bucket = self.batch_size, self.batch_size * 64
        batches = []
        for start in range(0, len(order), bucket):
            chunk = sorted(order[start:start + bucket], key=self.lengths.__getitem__)
            batches += [chunk[i:i + b] for i in range(0, len(chunk) - b + 1, b)]
        return [batches[k] for k in torch.randperm(len(batches), generator=g).tolist()]

    def __iter__(self):
        yield from self.batches()[self.rank::self.num_replicas]

    def __len__(self):
        return len(self.batches()[self.rank::self.num_replicas])


class UnevenBehindEqualLen(UnevenBatches):
    """The same untrimmed round-robin deal, with a __len__ that gives every rank the same number."""

    def __len__(self):
        return len(self.batches()) // self.num_replicas


class ReordersFixedBatches(Right):
    """The article's batches made distributed: sorted by length once and cut into batches, only
    their order shuffled with seed + epoch, trimmed to a multiple of the ranks, dealt out
    batches[r::N]."""

    def batches(self):
        indices = sorted(range(len(self.lengths)), key=lambda i: (self.lengths[i], i))
        b = self.batch_size
        batches = [indices[i:i + b] for i in range(0, len(indices) - b + 1, b)]
        batches = [batches[k] for k in torch.randperm(len(batches), generator=self.generator()).tolist()]
        return batches[:len(batches) - len(batches) % self.num_replicas]

    def __iter__(self):
        yield from self.batches()[self.rank::self.num_replicas]

    def __len__(self):
        return len(self.batches()) // self.num_replicas


class NoBucketing(Right):
    bucket_steps = 1  # sorting within a single step changes nothing: random batches

    def steps(self):
        g = self.generator()
        order = torch.randperm(len(self.lengths), generator=g).tolist()
        step = self.batch_size * self.num_replicas
        return [order[i:i + step] for i in range(0, len(order) - step + 1, step)]


class DropsPerBucket(Right):
    """Buckets of bucket_steps batches (not steps): an incomplete step is lost in every bucket."""

    def steps(self):
        g = self.generator()
        order = torch.randperm(len(self.lengths), generator=g).tolist()
        step = self.batch_size * self.num_replicas
        bucket = self.batch_size * 5
        groups = []
        for start in range(0, len(order), bucket):
            chunk = sorted(order[start:start + bucket], key=self.lengths.__getitem__)
            groups += [chunk[i:i + step] for i in range(0, len(chunk) - step + 1, step)]
        return [groups[k] for k in torch.randperm(len(groups), generator=g).tolist()]


class GlobalRandom(Right):
    def generator(self):
        return torch.Generator().manual_seed(random.randrange(2**31))  # a different draw each time


class IgnoresProcessGroup(Right):
    def __init__(self, lengths, batch_size, num_replicas=None, rank=None, seed=0):
        super().__init__(lengths, batch_size, num_replicas or 1, rank or 0, seed)


class LenCountsAllRanks(Right):
    def __len__(self):
        return len(self.steps()) * self.num_replicas


class NumpyContiguousSlices:
    """Written with numpy: a permutation from default_rng(seed + epoch), buckets sorted with
    argsort, and rank r takes the r-th contiguous slice of each step."""

    def __init__(self, lengths, batch_size, num_replicas=None, rank=None, seed=0):
        self.lengths = np.asarray(lengths)
        self.batch_size, self.seed, self.epoch = batch_size, seed, 0
        self.num_replicas = num_replicas if num_replicas is not None else dist.get_world_size()
        self.rank = rank if rank is not None else dist.get_rank()

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _steps(self):
        rng = np.random.default_rng(self.seed + self.epoch)
        perm = rng.permutation(len(self.lengths))
        step = self.batch_size * self.num_replicas
        n_steps = len(perm) // step
        perm = perm[:n_steps * step]  # the incomplete last step dropped
        steps = []
        for first in range(0, n_steps * step, 8 * step):  # buckets of 8 steps
            bucket = perm[first:first + 8 * step]
            bucket = bucket[np.argsort(self.lengths[bucket], kind="stable")]
            steps += list(bucket.reshape(-1, step))
        return [steps[k] for k in rng.permutation(len(steps))]

    def __iter__(self):
        b = self.batch_size
        for step in self._steps():
            yield step[self.rank * b:(self.rank + 1) * b].tolist()

    def __len__(self):
        return len(self.lengths) // (self.batch_size * self.num_replicas)


class BatchesDealtRoundRobin:
    """Python only: a random.Random(seed + epoch) instance (not the global random), bucketed
    batches, their number trimmed to a multiple of the ranks, then batches[rank::num_replicas]."""

    def __init__(self, lengths, batch_size, num_replicas=None, rank=None, seed=0):
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
        self.rank = dist.get_rank() if rank is None else rank
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _batches(self):
        rng = random.Random(self.seed + self.epoch)
        indices = list(range(len(self.lengths)))
        rng.shuffle(indices)
        pool = 50 * self.batch_size
        batches = []
        for start in range(0, len(indices), pool):
            chunk = sorted(indices[start:start + pool], key=lambda i: self.lengths[i])
            batches += [chunk[i:i + self.batch_size]
                        for i in range(0, len(chunk) - self.batch_size + 1, self.batch_size)]
        rng.shuffle(batches)
        usable = len(batches) - len(batches) % self.num_replicas  # the same count on every rank
        return batches[:usable]

    def __iter__(self):
        return iter(self._batches()[self.rank::self.num_replicas])

    def __len__(self):
        return len(self._batches()) // self.num_replicas


@pytest.mark.parametrize("right", [Right, NumpyContiguousSlices, BatchesDealtRoundRobin],
                         ids=lambda c: c.__name__)
def test_accepts_right_answers(right, capsys, no_leftover_processes):
    check_bucket_sampler(right)
    out = capsys.readouterr().out
    assert "[PASS] 05.a bucket sampler" in out


class PadsByRepeating(Right):
    """DistributedSampler(drop_last=False)'s padding: the last step completed with the first
    samples of the permutation, which then appear twice in the epoch."""

    def steps(self):
        g = self.generator()
        order = torch.randperm(len(self.lengths), generator=g).tolist()
        step = self.batch_size * self.num_replicas
        order += order[:-len(order) % step]
        bucket = step * self.bucket_steps
        groups = []
        for start in range(0, len(order), bucket):
            chunk = sorted(order[start:start + bucket], key=self.lengths.__getitem__)
            groups += [chunk[i:i + step] for i in range(0, len(chunk), step)]
        return [groups[k] for k in torch.randperm(len(groups), generator=g).tolist()]


class SortedNeverShuffled:
    """"Sorting by length is the bucketing": sorted once, cut into steps, dealt out; no shuffle."""

    def __init__(self, lengths, batch_size, num_replicas=None, rank=None, seed=0):
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.num_replicas = num_replicas or dist.get_world_size()
        self.rank = rank if rank is not None else dist.get_rank()
        self.seed = seed

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        order = sorted(range(len(self.lengths)), key=lambda i: (self.lengths[i], i))
        step = self.batch_size * self.num_replicas
        for start in range(0, len(order) - step + 1, step):
            yield order[start:start + step][self.rank::self.num_replicas]

    def __len__(self):
        return len(self.lengths) // (self.batch_size * self.num_replicas)


class YieldsIndices(Right):
    def __iter__(self):
        for batch in super().__iter__():
            yield from batch


# Each misconception of the catalogue: the wrong sampler of the same name, and what the failure says.
WRONG = {
    "ArticleSampler": (ArticleSampler, r"every rank yielded the same samples.*not distributed-aware"),
    "ForgetsEpoch": (ForgetsEpoch, r"same batches in epoch 0 and epoch 1: set_epoch has no effect"),
    "SeedPerRank": (SeedPerRank, r"ranks 0 and 1 share \d+ samples.*a seed that depends on the rank"),
    "UnevenBatches": (UnevenBatches,
                      r"different numbers of batches \(rank 0: \d+, rank 1: \d+\).*wait forever"),
    "UnevenBehindEqualLen": (UnevenBehindEqualLen,
                             r"different numbers of batches \(rank 0: 47, rank 1: 46\)\. "
                             r"len\(sampler\) is 46 on every rank, but a DataLoader runs as many "
                             r"steps as __iter__ yields.*DDP hangs in that step's gradient all-reduce"),
    "ReordersFixedBatches": (ReordersFixedBatches,
                             r"\d+% of the batches of epoch 1 hold exactly the samples of a batch of "
                             r"epoch 0; the batches hold the same samples in every epoch, only their "
                             r"order changes"),
    "NoBucketing": (NoBucketing, r"\d+% of the padded batches is padding \(random batching: \d+%; "
                                 r"required: at most 20%\)"),
    "DropsPerBucket": (DropsPerBucket,
                       r"only \d+ of 1500 samples appear.*dropping an incomplete batch in every bucket"),
    "GlobalRandom": (GlobalRandom, r"ranks 0 and 1 share \d+ samples.*Python's global random"),
    "IgnoresProcessGroup": (IgnoresProcessGroup,
                            r"with num_replicas and rank left out, both ranks got the same batches"),
    "LenCountsAllRanks": (LenCountsAllRanks, r"len\(sampler\) is \d+ but iterating yields \d+ batches"),
    "YieldsIndices": (YieldsIndices,
                      r"yielded \d+, a single index; a batch sampler yields lists"),
    "PadsByRepeating": (PadsByRepeating,
                        r"\d+ samples appear twice in this epoch, while none is left out.*"
                        r"DistributedSampler\(drop_last=False\).*drop the incomplete last step"),
    "SortedNeverShuffled": (SortedNeverShuffled,
                            r"batches come in order of length, shortest first, and the same in every "
                            r"epoch: the data set was sorted once and never shuffled"),
}


@pytest.mark.parametrize("mistake, wrong", cases(CATALOGUE, WRONG))
def test_rejects_usual_mistakes(mistake, wrong, no_leftover_processes):
    cls, message = wrong
    with pytest.raises(CheckFailed, match="(?s)" + message) as info:
        check_bucket_sampler(cls)
    assert info.value.args[0].startswith("[05.a bucket sampler]")
    assert mistake.message in info.value.args[0]


def test_padding_waste_counts_padding():
    lengths = [1, 3, 2, 2]
    assert padding_waste([[0, 1]], lengths) == pytest.approx(1 - 4 / 6)
    assert padding_waste([[2, 3]], lengths) == 0.0


def test_stub_is_not_done():
    class Stub(Right):
        def __iter__(self):
            raise NotImplementedError("Exercise 05.a bucket sampler: replace this line")

    with pytest.raises(CheckFailed, match=r"not done yet"):
        check_bucket_sampler(Stub)


def test_none_and_single_indices_are_rejected_clearly():
    with pytest.raises(CheckFailed, match=r"got None"):
        check_bucket_sampler(None)
    with pytest.raises(CheckFailed, match=r"yielded \d+, a single index; a batch sampler yields lists"):
        check_bucket_sampler(YieldsIndices)


def test_a_sampler_that_never_returns_is_stopped_with_the_line_it_was_on(monkeypatch):
    """The checker builds and iterates the sampler in the notebook's process first: bounded."""
    import time

    from course_utils.checking import limits

    class Sleeps(Right):  # a constructor that waits for something that never comes
        def __init__(self, *args, **kwargs):
            while True:
                time.sleep(0.05)

    monkeypatch.setattr(limits, "IN_PROCESS_LIMIT", 2.0)
    t = time.monotonic()
    with pytest.raises(CheckFailed, match="did not return within 2 s") as e:
        check_bucket_sampler(Sleeps)
    assert time.monotonic() - t < 15 and "__init__" in str(e.value)
