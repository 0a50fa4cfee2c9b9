"""What every checker shares: ``CheckFailed``, running learner code safely, comparing tensors.

A checker takes the learner's function or object, runs it against the real thing and either
prints one short line starting with ``[PASS]`` or raises ``CheckFailed`` saying what was expected,
what came out, on which rank, and what the usual mistake is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

__all__ = [
    "CheckFailed",
    "checker",
    "compare_tensors",
    "diff_table",
    "require_callable",
]


class CheckFailed(AssertionError):
    """The learner's answer is wrong; the message says how and what usually causes it."""


def checker(exercise: str) -> Callable:
    """Decorate a ``check_*`` function: name the exercise, record the outcome, never crash.

    - a stub that still raises ``NotImplementedError`` gives "exercise X is not done yet";
    - any other unexpected exception in the learner's code becomes a ``CheckFailed`` that shows it;
    - pass/fail is written to the learner's progress file (``course_utils.progress``).
    """

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> None:
            try:
                fn(*args, **kwargs)
            except CheckFailed as e:
                _record(exercise, False)
                raise CheckFailed(f"[{exercise}] {e}") from None
            except NotImplementedError as e:
                _record(exercise, False)
                raise CheckFailed(
                    f"[{exercise}] not done yet: the code still raises NotImplementedError ({e}). "
                    "Replace the stub with your solution and run the check again."
                ) from None
            except Exception as e:  # the learner's code crashed
                _record(exercise, False)
                from .launcher import WorkerError

                if isinstance(e, WorkerError):
                    nie = [f for f in e.failures.values() if f.exc_type == "NotImplementedError"]
                    if nie:
                        raise CheckFailed(
                            f"[{exercise}] not done yet: rank {nie[0].rank} raised "
                            f"NotImplementedError ({nie[0].message}). Fill in the stub and rerun."
                        ) from None
                raise CheckFailed(
                    f"[{exercise}] your code raised {type(e).__name__}: {e}"
                ) from e
            _record(exercise, True)
            print(f"[PASS] {exercise}")

        run.exercise = exercise  # type: ignore[attr-defined]
        return run

    return wrap


def _record(exercise: str, passed: bool) -> None:
    try:
        from .progress import record
    except ImportError:  # progress tracking is optional
        return
    try:
        record(exercise, passed)
    except Exception:  # a broken progress file must never break a check
        pass


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
            d = (g.detach().double().cpu() - e.detach().double().cpu()).abs().max().item() if e.numel() else 0.0
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
