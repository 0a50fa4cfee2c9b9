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
