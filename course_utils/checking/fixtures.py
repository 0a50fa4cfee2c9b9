"""Test models and data that more than one chapter's checkers use, written once: ``FrozenAndShared``
(a frozen layer, a layer used twice, a tied weight; chapters 04 and 10) and
``ddp_keeping_own_buffers`` (the torch DDP their mini DDPs are compared with).

Chapter-specific models stay in their chapter's module; a model moves here when a second chapter
needs it.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .compare import wrap_ddp

__all__ = ["FrozenAndShared", "ddp_keeping_own_buffers"]


class FrozenAndShared(torch.nn.Module):
    """A model torch DDP accepts, with the awkward cases of gradient synchronisation.

    ``frozen`` has ``requires_grad=False`` (no gradient, no hook); ``block`` is applied twice (one
    module, two uses) and ``tied.weight`` *is* ``block.weight`` (one Parameter in two modules);
    with ``scale=True`` a buffer ``scale`` (ones) multiplies the frozen layer's output, a buffer
    that rank 0 must broadcast.  The hidden layers are ``width`` wide (chapter 04 uses 48 with the
    buffer, chapter 10 64 without: its bucket caps are sized for those layers).  The weights
    depend on ``seed`` only: the global random state is left as it was.
    """

    def __init__(self, seed: int = 0, *, width: int = 48, scale: bool = True):
        super().__init__()
        with torch.random.fork_rng(devices=[]):  # built on CPU: no GPU's generator is touched
            torch.manual_seed(seed)
            self.embed = torch.nn.Linear(32, width)
            self.frozen = torch.nn.Linear(width, width).requires_grad_(False)
            self.block = torch.nn.Linear(width, width)
            self.tied = torch.nn.Linear(width, width)
            self.tied.weight = self.block.weight  # one Parameter in two layers
            self.head = torch.nn.Linear(width, 10)
        if scale:
            self.register_buffer("scale", torch.ones(width))
        else:
            self.scale = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gelu = torch.nn.functional.gelu
        h = gelu(self.frozen(gelu(self.embed(x))))
        if self.scale is not None:
            h = h * self.scale
        h = gelu(self.block(gelu(self.block(h))))  # the same layer twice
        return self.head(gelu(self.tied(h)))


def ddp_keeping_own_buffers(model: torch.nn.Module, device: torch.device) -> DistributedDataParallel:
    """torch DDP as the checkers' reference for a wrapper that syncs gradients only.

    Rank 0's parameters and buffers are broadcast once, at construction; afterwards each rank's
    buffers (BatchNorm's running statistics) follow its own data, as a mini DDP's do
    (``forward_sync_buffers=False``; older torch names it ``broadcast_buffers``, and ``False``
    there also skips the broadcast at construction, which is then done here).
    """
    flag = ("forward_sync_buffers" if "forward_sync_buffers" in
            inspect.signature(DistributedDataParallel).parameters else "broadcast_buffers")
    ddp = wrap_ddp(model, device, **{flag: False})
    if flag == "broadcast_buffers":
        for b in ddp.module.buffers():
            dist.broadcast(b, src=0)
    return ddp
