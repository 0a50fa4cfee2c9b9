"""What chapter 14's checkers watch besides ``CollectiveSpy``: torch's functional collectives.

``all_to_all_single_autograd`` and the other functions of ``torch.distributed._functional_collectives``
run ``torch.ops._c10d_functional`` operators, not ``torch.distributed``'s functions, so the spy does
not see them.  ``FunctionalCalls`` is a dispatch mode that records each one, ``(name, bytes of its
input)``, and lets everything run as usual.  (``measure.ch12.FunctionalCollectives`` does the same
for DTensor code and imports DTensor on its first operator, a second per worker that these checks,
which see no DTensor, need not pay.)
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["FunctionalCalls"]


class FunctionalCalls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional":
            name = func._overloadpacket.__name__
            if not name.startswith("_") and name != "wait_tensor":
                first = args[0] if args else None
                tensors = first if isinstance(first, (list, tuple)) else [first]
                nbytes = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
                self.calls.append((name, nbytes))
        return func(*args, **(kwargs or {}))
