"""A small DistributedDataParallel of your own: one asynchronous all-reduce per parameter.

Exercise 04.b.  Workers import this file (``from mini_ddp import DDPIndividualParameters``), exactly
as a training script run by ``torchrun`` would, so edit it here and rerun the check cell.

What it must do, as ``torch.nn.parallel.DistributedDataParallel`` does, minus the buckets:

1. At construction, make every rank's module equal to rank 0's: broadcast each parameter and each
   buffer from rank 0.
2. During backward, as soon as a parameter's gradient is ready (it has been accumulated into
   ``.grad``), start an **asynchronous** all-reduce of that gradient (``async_op=True``) and keep
   the handle.  ``Tensor.register_post_accumulate_grad_hook`` calls a function at exactly that
   moment.  Do not wait inside the hook: backward must go on computing the earlier layers while
   the gradient travels.
3. ``finish_gradient_synchronization()``, called after ``loss.backward()`` and before
   ``optimizer.step()``, waits for every outstanding all-reduce and divides each gradient by the
   world size, so that ``.grad`` holds the average over ranks.

It must work for any module torch DDP accepts, including parameters with ``requires_grad=False``
(frozen: no gradient, no hook) and a parameter shared by two layers (it appears once in
``module.parameters()`` and must be all-reduced once per backward).

Usage, in every rank::

    model = DDPIndividualParameters(make_model())
    for x, y in batches:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        model.finish_gradient_synchronization()
        optimizer.step()
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class DDPIndividualParameters(nn.Module):
    """Wrap ``module``; average its gradients over all ranks, overlapping backward."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        raise NotImplementedError("Exercise 04.b mini DDP: replace this line with your code")

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Wait for the all-reduces started during backward; leave the average in ``.grad``."""
        raise NotImplementedError("Exercise 04.b mini DDP: replace this line with your code")


# ================================================================================================
# Chapter 10: buckets, and an optimizer whose state is split across the ranks
# ================================================================================================


class DDPBucketed(nn.Module):
    """Exercise 10.a: average gradients over all ranks with one all-reduce per *bucket*.

    ``DDPIndividualParameters`` pays the fixed cost of a collective (the latency α of chapter 10's
    cost model) once per parameter.  Torch DDP groups gradients into buckets of about
    ``bucket_cap_mb`` and all-reduces each bucket as one flat tensor.  This class does the same:

    1. At construction, broadcast rank 0's parameters and buffers (as in 04.b).
    2. Put the trainable parameters into buckets of at most ``bucket_size_mb`` MiB
       (``numel() * element_size()`` bytes each), walking ``module.parameters()`` in *reverse*:
       backward computes the last layer's gradients first, so the first bucket fills first.  A
       parameter larger than the cap gets a bucket of its own.
    3. From each parameter's post-accumulate-grad hook, count the ready gradients of its bucket;
       when the last one arrives, flatten the bucket's gradients into one tensor and start
       ``dist.all_reduce(flat, async_op=True)``.  Never wait in the hook.
    4. ``finish_gradient_synchronization()`` waits for every bucket, divides by the world size and
       copies each slice of the result back into its parameter's ``.grad``.  Leave everything
       ready for the next backward.
    5. ``on_train_batch_start()`` (optional, called before each forward) may reset per-step state.

    All gradients of the module must have one dtype (flattening needs it).

    Two things torch DDP does that this design leaves out (chapter 04, section 3.2): DDP launches
    its buckets in index order, so the k-th all-reduce is the same bucket on every rank even where
    autograd finishes gradients in a different order on different ranks; launching in completion
    order, as here, relies on every rank running the same graph.  And DDP raises an error at the
    next forward when a parameter got no gradient (unless ``find_unused_parameters=True``); here a
    bucket with such a parameter never fills, is never all-reduced, and its gradients silently stay
    those of this rank alone.
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float):
        super().__init__()
        self.module = module
        raise NotImplementedError("Exercise 10.a bucketed DDP: replace this line with your code")

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def on_train_batch_start(self) -> None:
        """Called before each forward pass: reset per-step state here if your design needs it."""

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's all-reduce; leave the average in each ``.grad``."""
        raise NotImplementedError("Exercise 10.a bucketed DDP: replace this line with your code")


class ShardedOptimizer(torch.optim.Optimizer):
    """Exercise 10.b: ZeRO stage 1, an optimizer whose state is split across the ranks.

    ``ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.1)`` behaves
    like ``torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)`` on every rank, given
    the same (already averaged) gradients on every rank, but each parameter's optimizer state
    (AdamW: two tensors the size of the parameter) lives on one rank only:

    1. Every parameter is owned by exactly one rank, the same on all ranks (decide it from the
       order of the parameters, never from anything that differs between ranks).
    2. An inner ``optimizer_cls`` on this rank gets only the parameters this rank owns, with the
       hyperparameters of their group.
    3. ``step()`` steps the inner optimizer, then brings every rank up to date: each parameter is
       broadcast from its owner.
    4. ``params`` may be a generator (it can be read only once); ``add_param_group()`` (which
       ``torch.optim.Optimizer.__init__`` itself calls for each group) must shard the new group
       too; ``zero_grad()`` clears every parameter's gradient, owned or not.
    """

    def __init__(self, params, optimizer_cls: type[torch.optim.Optimizer], **kwargs):
        raise NotImplementedError("Exercise 10.b sharded optimizer: replace this line with your code")

    def add_param_group(self, param_group: dict) -> None:
        raise NotImplementedError("Exercise 10.b sharded optimizer: replace this line with your code")

    @torch.no_grad()
    def step(self, closure=None):
        raise NotImplementedError("Exercise 10.b sharded optimizer: replace this line with your code")
