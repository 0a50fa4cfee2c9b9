"""Chapter 11's measurements (when one model does not fit): where a step's memory goes.

- ``ActivationMeter``: a dispatch mode that counts the bytes of every new tensor storage created
  while autograd records (the forward pass, and the recomputation of checkpointed segments during
  backward), from its creation until it is freed, and keeps the peak.  Gradients (computed with
  autograd not recording), parameters and the input are not counted.  It works the same on CPU and
  GPU, because it counts tensors, not what the allocator reserved; of a ``DTensor`` it counts the
  local shard, what this rank holds.
- ``MLPBlock``, ``mlp_stack``, ``forward_in_segments``: the residual MLP block of the chapter and a
  stack of them run with every segment of ``segment`` consecutive blocks checkpointed.
- ``peak_activation_bytes(layers, segment, ...)``: the measured peak of one training step of that
  stack.
- ``bytes_by_category(model, optimizer, step)``: parameters, gradients, optimizer state and the
  activation peak of one step, each measured.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

__all__ = ["ActivationMeter", "MLPBlock", "mlp_stack", "forward_in_segments", "peak_activation_bytes",
           "bytes_by_category", "tensor_bytes"]


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank holds), any other tensor itself.

    ``torch.distributed.tensor`` takes a second to import: it is not imported here, since a DTensor
    can only exist once the code that made it has imported that module.
    """
    dtensor = sys.modules.get("torch.distributed.tensor")
    return t.to_local() if dtensor is not None and isinstance(t, dtensor.DTensor) else t


def _storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    """Where ``t``'s memory is; None for a tensor without usable storage (one FSDP freed, say)."""
    t = _plain(t)
    try:
        return (t.device.type, t.untyped_storage().data_ptr())
    except RuntimeError:
        return None


class ActivationMeter(TorchDispatchMode):
    """Live and peak bytes of the tensors autograd-recorded operations create (see the module doc).

    ``ignore`` are tensors whose storage never counts (parameters, the input); a view or an in-place
    result shares its input's storage and is not counted twice.
    """

    def __init__(self, ignore: list[torch.Tensor] | tuple = ()):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._ignore = {_storage_key(t) for t in ignore}
        self._refs: dict[tuple[str, int], weakref.ref] = {}

    def _gone(self, key: tuple[str, int], nbytes: int) -> Callable:
        def callback(_ref: weakref.ref) -> None:
            self.live -= nbytes
            self._refs.pop(key, None)
        return callback

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not torch.is_grad_enabled():
            return out
        seen = {_storage_key(a) for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            key = _storage_key(t)
            storage = _plain(t).untyped_storage()
            if key is None or key in seen or key in self._ignore or key in self._refs or not storage.nbytes():
                continue
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            self._refs[key] = weakref.ref(storage, self._gone(key, storage.nbytes()))
        return out


class MLPBlock(nn.Module):
    """``x + fc2(gelu(fc1(x)))`` with ``fc1: hidden -> 4*hidden``: the MLP half of a transformer block.

    Autograd keeps, per block, ``fc1``'s input (the block's input, ``hidden`` wide), ``fc1``'s
    output (for GELU's backward, ``4*hidden``) and GELU's output (for ``fc2``'s backward, ``4*hidden``):
    9 x batch x seq x hidden numbers.
    """

    def __init__(self, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


def mlp_stack(layers: int, hidden: int, seed: int = 0) -> nn.ModuleList:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.ModuleList(MLPBlock(hidden) for _ in range(layers))


def forward_in_segments(blocks: nn.ModuleList, x: torch.Tensor, segment: int | None) -> torch.Tensor:
    """Run ``blocks`` on ``x``; with ``segment=k`` every k consecutive blocks form one checkpoint.

    A checkpointed segment keeps only its input during forward and runs again, with autograd
    recording, when backward reaches it (``torch.utils.checkpoint``, non-reentrant).
    """
    if not segment:
        for b in blocks:
            x = b(x)
        return x

    def run(i: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def seg(h: torch.Tensor) -> torch.Tensor:
            for b in blocks[i:i + segment]:
                h = b(h)
            return h
        return seg

    for i in range(0, len(blocks), segment):
        x = checkpoint(run(i), x, use_reentrant=False)
    return x


def peak_activation_bytes(layers: int, segment: int | None, *, batch: int = 2, seq: int = 32,
                          hidden: int = 64, seed: int = 0) -> int:
    """The ``ActivationMeter`` peak of one forward and backward of ``mlp_stack(layers, hidden)``."""
    blocks = mlp_stack(layers, hidden, seed)
    x = torch.randn(batch, seq, hidden, generator=torch.Generator().manual_seed(seed))
    meter = ActivationMeter(ignore=[*blocks.parameters(), x])
    with meter:
        loss = forward_in_segments(blocks, x, segment).square().mean()
        loss.backward()
    return meter.peak


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among ``tensors`` (a tensor, an iterable, or a state dict's values)."""
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen[_storage_key(t)] = _plain(t).untyped_storage().nbytes()
    return sum(seen.values())


def bytes_by_category(model: nn.Module, optimizer: torch.optim.Optimizer,
                      step: Callable[[], torch.Tensor]) -> dict[str, int]:
    """Measured bytes of parameters, gradients, optimizer state and the activation peak of one step.

    ``step()`` runs the forward and returns the loss; this runs backward and ``optimizer.step()``.
    """
    params = list(model.parameters())
    meter = ActivationMeter(ignore=params)
    with meter:
        loss = step()
        loss.backward()
    optimizer.step()
    state = [v for s in optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"parameters": tensor_bytes(params),
            "gradients": tensor_bytes(p.grad for p in params if p.grad is not None),
            "optimizer state": tensor_bytes(state),
            "activations (peak)": meter.peak}
