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
