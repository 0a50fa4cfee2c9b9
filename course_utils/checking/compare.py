"""Comparing what the learner's code produced with the reference, and the small steps workers repeat.

- ``close``, ``compare_tensors``, ``diff_table``, ``format_table``: tensors and nested values side
  by side, with a per-tensor table of the largest difference;
- ``as_tensor``, ``as_float``, ``require_callable``: the learner's values checked for type first;
- ``state_to_cpu``, ``wrap_ddp``: a model's state on CPU, a model wrapped in DDP on CPU or GPU.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from .errors import CheckFailed

__all__ = ["close", "compare_tensors", "diff_table", "format_table", "as_tensor", "as_float",
           "require_callable", "state_to_cpu", "wrap_ddp"]


def require_callable(obj: Any, what: str) -> None:
    """Reject None and non-callables with a message that says what was expected."""
    if obj is None:
        raise CheckFailed(f"expected {what}, got None. Did the cell that defines it run?")
    if not callable(obj):
        raise CheckFailed(f"expected {what} (a function), got a {type(obj).__name__}")


def as_tensor(value: Any, name: str, *, like: torch.Tensor | None = None) -> torch.Tensor:
    """``value`` as a tensor, or a CheckFailed naming what was wrong with it."""
    if value is None:
        raise CheckFailed(f"{name}: expected a tensor, got None (a missing `return`?)")
    if not isinstance(value, torch.Tensor):
        raise CheckFailed(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if like is not None:
        if value.shape != like.shape:
            raise CheckFailed(f"{name}: expected shape {tuple(like.shape)}, got {tuple(value.shape)}")
        if value.dtype != like.dtype:
            raise CheckFailed(f"{name}: expected dtype {like.dtype}, got {value.dtype}")
    return value


def as_float(value: Any) -> Any:
    """A learner's returned number as a float, or ``("not a number", type name)`` to report."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach().cpu())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return ("not a number", type(value).__name__)


def diff_table(
    expected: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor]
) -> list[tuple[str, float, bool]]:
    """Max abs difference per tensor name; names missing in ``got`` count as infinitely wrong."""
    rows = []
    for name, e in expected.items():
        g = got.get(name)
        if g is None or g.shape != e.shape:
            rows.append((name, float("inf"), False))
        else:
            diff = g.detach().double().cpu() - e.detach().double().cpu()
            d = diff.abs().max().item() if e.numel() else 0.0
            rows.append((name, d, torch.equal(g.detach().cpu(), e.detach().cpu())))
    return rows


def format_table(rows: Iterable[tuple[str, float, bool]], atol: float) -> str:
    lines = [f"  {'tensor':<28} {'max abs diff':>12}  verdict"]
    for name, d, exact in rows:
        verdict = "exact" if exact else ("close" if d <= atol else "DIFFERENT")
        lines.append(f"  {name:<28} {d:>12.3g}  {verdict}")
    return "\n".join(lines)


def compare_tensors(
    expected: Mapping[str, torch.Tensor],
    got: Mapping[str, torch.Tensor],
    *,
    atol: float = 1e-5,
    what: str = "parameters",
    where: str = "",
    hint: str = "",
    show: bool = False,
) -> float:
    """Compare named tensors; raise CheckFailed with a per-tensor table when any differs.

    Returns the largest difference.  ``where`` names the rank, ``hint`` the usual mistake.
    """
    rows = diff_table(expected, got)
    worst = max((d for _, d, _ in rows), default=0.0)
    table = format_table(rows, atol)
    if worst > atol or worst != worst:
        loc = f" on {where}" if where else ""
        raise CheckFailed(
            f"{what}{loc} differ from the reference by up to {worst:.3g} (tolerance {atol:g}):\n"
            f"{table}" + (f"\nUsual mistake: {hint}" if hint else "")
        )
    if show:
        print(table)
    return worst


def state_to_cpu(obj: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A detached CPU copy of a module's state dict (parameters and buffers) or of a mapping.

    A DDP model's ``module.`` prefix is dropped, so a DDP model and a plain one compare by name.
    """
    if isinstance(obj, DistributedDataParallel):
        obj = obj.module
    items = obj.state_dict().items() if isinstance(obj, torch.nn.Module) else obj.items()
    return {k: v.detach().cpu().clone() for k, v in items if isinstance(v, torch.Tensor)}


def wrap_ddp(model: torch.nn.Module, device: torch.device, **kwargs: Any) -> DistributedDataParallel:
    """``model`` moved to ``device`` and wrapped in DDP the way each rank needs it on CPU or GPU."""
    model = model.to(device)
    if device.type == "cuda":
        return DistributedDataParallel(model, device_ids=[device.index], **kwargs)
    return DistributedDataParallel(model, **kwargs)


def close(a: Any, b: Any, *, atol: float = 1e-5, rtol: float = 0.0) -> bool:
    """Whether ``a`` and ``b`` agree: tensors, numbers, and (nested) mappings or sequences of them.

    Tensors must have the same shape; NaN never agrees with anything.
    """
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
            return False
        if a.numel() == 0:
            return True
        a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
        return bool(torch.allclose(a64, b64, atol=atol, rtol=rtol))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(close(a[k], b[k], atol=atol, rtol=rtol) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(close(x, y, atol=atol, rtol=rtol) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=rtol, abs_tol=atol)
    return a == b
