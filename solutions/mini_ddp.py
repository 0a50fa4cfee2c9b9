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
        ### BEGIN SOLUTION 04.b mini DDP
        self.world_size = dist.get_world_size()
        self._pending: list[tuple[torch.Tensor, dist.Work]] = []

        # 1. Everyone starts from rank 0's state.  parameters() and buffers() list a tensor shared
        #    by two layers once, so it is broadcast once.
        with torch.no_grad():
            for tensor in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(tensor, src=0)

        # 2. A hook per trainable parameter, called once its gradient is accumulated.
        def start_all_reduce(param: torch.Tensor) -> None:
            work = dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, async_op=True)
            self._pending.append((param.grad, work))

        for param in module.parameters():
            if param.requires_grad:  # a frozen parameter has no gradient and accepts no hook
                param.register_post_accumulate_grad_hook(start_all_reduce)
        ### END SOLUTION

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Wait for the all-reduces started during backward; leave the average in ``.grad``."""
        ### BEGIN SOLUTION 04.b mini DDP
        for grad, work in self._pending:
            work.wait()
            grad.div_(self.world_size)
        self._pending.clear()
        ### END SOLUTION


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
        ### BEGIN SOLUTION 10.a bucketed DDP
        self.world_size = dist.get_world_size()
        with torch.no_grad():
            for tensor in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(tensor, src=0)

        cap = bucket_size_mb * 2**20
        self.buckets: list[list[nn.Parameter]] = []
        size = cap + 1  # forces a new bucket for the first parameter
        for param in reversed([p for p in module.parameters() if p.requires_grad]):
            nbytes = param.numel() * param.element_size()
            if size + nbytes > cap:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(param)
            size += nbytes
        bucket_of = {param: i for i, bucket in enumerate(self.buckets) for param in bucket}
        self._ready = [0] * len(self.buckets)
        self._pending: list[tuple[int, torch.Tensor, dist.Work]] = []

        def gradient_ready(param: torch.Tensor) -> None:
            i = bucket_of[param]
            self._ready[i] += 1
            if self._ready[i] == len(self.buckets[i]):  # the bucket's last gradient just arrived
                flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[i]])
                self._pending.append((i, flat, dist.all_reduce(flat, async_op=True)))

        for param in bucket_of:
            param.register_post_accumulate_grad_hook(gradient_ready)
        ### END SOLUTION

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def on_train_batch_start(self) -> None:
        """Called before each forward pass: reset per-step state here if your design needs it."""

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's all-reduce; leave the average in each ``.grad``."""
        ### BEGIN SOLUTION 10.a bucketed DDP
        for i, flat, work in self._pending:
            work.wait()
            flat.div_(self.world_size)
            offset = 0
            for p in self.buckets[i]:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        self._pending.clear()
        self._ready = [0] * len(self.buckets)
        ### END SOLUTION


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
        ### BEGIN SOLUTION 10.b sharded optimizer
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.optimizer_cls, self.kwargs = optimizer_cls, kwargs
        self.owner: dict[torch.Tensor, int] = {}
        self.load = [0] * self.world_size  # elements owned by each rank, to balance the shards
        self.local: torch.optim.Optimizer | None = None
        super().__init__(params, defaults=kwargs)  # calls self.add_param_group for each group
        ### END SOLUTION

    def add_param_group(self, param_group: dict) -> None:
        ### BEGIN SOLUTION 10.b sharded optimizer
        super().add_param_group(param_group)  # fills in the defaults, rejects duplicates
        group = self.param_groups[-1]
        mine = []
        for p in group["params"]:
            rank = min(range(self.world_size), key=lambda r: self.load[r])  # least loaded
            self.owner[p] = rank
            self.load[rank] += p.numel()
            if rank == self.rank:
                mine.append(p)
        local_group = {**{k: v for k, v in group.items() if k != "params"}, "params": mine}
        if self.local is None:
            self.local = self.optimizer_cls([local_group], **self.kwargs)
        else:
            self.local.add_param_group(local_group)
        ### END SOLUTION

    @torch.no_grad()
    def step(self, closure=None):
        ### BEGIN SOLUTION 10.b sharded optimizer
        for group, local in zip(self.param_groups, self.local.param_groups):
            for key, value in group.items():  # a scheduler changes lr in self.param_groups
                if key != "params":
                    local[key] = value
        loss = self.local.step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                dist.broadcast(p, src=self.owner[p])
        return loss
        ### END SOLUTION
