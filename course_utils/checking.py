"""What every checker shares: ``CheckFailed``, running learner code in workers, comparing results.

A checker takes the learner's function or object, runs it against the real thing and either
prints one short line starting with ``[PASS]`` or raises ``CheckFailed`` saying what was expected,
what came out, on which rank, and what the usual mistake is.

- ``@checker("NN.x name")`` names the exercise, records pass/fail, turns stubs into "not done yet";
- ``run_workers`` runs a checker's worker function on several ranks: an exception in the learner's
  code, a stub's ``NotImplementedError``, a hang, a crash or a signal all become one ``CheckFailed``
  that names the rank and the usual cause;
- a worker returns an ``Outcome`` (or any picklable value); ``first_problem`` raises the first
  problem a rank reported;
- ``close``, ``compare_tensors``, ``diff_table`` compare results; ``state_to_cpu`` and
  ``wrap_ddp`` are the small steps every chapter's workers repeat.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from .monitor import NullDisplay
from .progress import record
from .workers.errors import RankFailure, WorkerError, WorkerTimeout
from .workers.supervisor import launch

__all__ = [
    "CheckFailed",
    "checker",
    "run_workers",
    "Outcome",
    "first_problem",
    "learner_frames",
    "close",
    "compare_tensors",
    "diff_table",
    "format_table",
    "state_to_cpu",
    "wrap_ddp",
    "as_tensor",
    "as_float",
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
            except WorkerError as e:  # a launch outside run_workers: at least name a stub
                _record(exercise, False)
                raise CheckFailed(f"[{exercise}] {_error_message(e, NullDisplay(0), '')}") from None
            except Exception as e:  # the learner's code crashed in this process
                _record(exercise, False)
                raise CheckFailed(f"[{exercise}] your code raised {type(e).__name__}: {e}") from e
            _record(exercise, True)
            print(f"[PASS] {exercise}")

        run.exercise = exercise  # type: ignore[attr-defined]
        return run

    return wrap


def _record(exercise: str, passed: bool) -> None:
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


# --------------------------------------------------------------------------------------------
# Running the learner's code in workers
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    """What a checker's worker returns: whether the learner's code behaved, and what it produced.

    ``problem`` is a complete sentence for the learner ("optimizer.step() ran twice...");
    ``data`` holds what the checker compares (state dicts on CPU, counts, losses).
    """

    rank: int
    problem: str = ""
    data: dict = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problem


def first_problem(outcomes: Sequence[Any]) -> None:
    """Raise a CheckFailed for the first ``Outcome`` that reports a problem (lowest rank first)."""
    for o in sorted((o for o in outcomes if isinstance(o, Outcome)), key=lambda o: o.rank):
        if o.problem:
            raise CheckFailed(f"rank {o.rank}: {o.problem}")


# Frames of the checker and of the launcher: the learner cannot act on them.
_CHECKER_FRAMES = ("course_utils/checks/", "course_utils/checking.py", "course_utils/workers/",
                   "torch/distributed/", "torch/nn/modules/module.py", "torch/nn/parallel/")


def learner_frames(text: str) -> str:
    """A traceback or stack reduced to the frames of the learner's code (and the error line).

    Frames are kept with their quoted source line; the checker's, the launcher's and torch's own
    frames are left out.  When nothing is left, the last frame is kept so that the message still
    says where.
    """
    lines = text.rstrip().splitlines()
    out: list[str] = []
    skip_code = False
    frames = 0
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("File "):
            frames += 1
            skip_code = any(s in stripped for s in _CHECKER_FRAMES)
            if not skip_code:
                out.append(line)
            continue
        if line.startswith(("    ", "\t")) and not stripped.startswith(("Traceback", "(most")):
            if not skip_code:
                out.append(line)
            continue
        skip_code = False
        out.append(line)
    if frames and not any(s.strip().startswith("File ") for s in out):
        last = [i for i, s in enumerate(lines) if s.strip().startswith("File ")][-1]
        out = lines[last:]
    return "\n".join(out)


def _root_causes(failures: dict[int, RankFailure]) -> list[RankFailure]:
    """The ranks whose failure is their own: not stopped by the launcher, not a peer's echo."""
    own = [f for f in failures.values() if f.kind != "stopped"]
    primary = [f for f in own if not f.is_echo]
    return sorted(primary or own, key=lambda f: f.rank)


def _where(display: NullDisplay, rank: int) -> str:
    st = display.states.get(rank)
    return "" if st is None or not st.count else f" at {st.where()}"


def run_workers(
    worker: Callable[..., Any],
    world: int = 2,
    *,
    args: Sequence[Any] = (),
    timeout: float = 60.0,
    hang_hint: str = "",
    error_hint: str = "",
    finish_within: float | None = 30.0,
    env: dict[str, str] | None = None,
    explain_error: Callable[[RankFailure], str | None] | None = None,
    explain_hang: Callable[[dict[int, str]], str | None] | None = None,
) -> list[Any]:
    """Run ``worker(*args)`` on ``world`` ranks; every way it can fail becomes one CheckFailed.

    - a stub's ``NotImplementedError`` on any rank: "not done yet", naming the rank;
    - an exception in the learner's code: the rank, the exception and the learner's frames, with
      ``error_hint`` (the usual mistake).  When several ranks failed, the one whose error is its own
      is quoted, not a peer's "connection reset" that it caused;
    - a hang (``timeout`` seconds) or a rank still running ``finish_within`` seconds after another
      one returned (one rank left a collective that the other still waits in): the ranks, where
      each one is stuck, the last step each reported (``course_utils.report(step=...)``), and
      ``hang_hint``;
    - a crash or a signal: the rank and what killed it.

    A chapter whose mistakes leave recognisable traces can word the message itself:
    ``explain_error(failure)`` gets the root-cause ``RankFailure`` of a failed launch and
    ``explain_hang(stacks)`` each stuck rank's whole stack (``learner_frames`` shortens it); what they return
    replaces the default message, None keeps it.

    Returns each rank's return value, indexed by rank.
    """
    progress = NullDisplay(world)
    try:
        return launch(worker, nprocs=world, args=tuple(args), timeout=timeout, display=progress,
                      finish_within=finish_within, env=env)
    except WorkerTimeout as e:
        stacks = {r: f.stack for r, f in e.failures.items() if f.kind == "timeout"}
        custom = explain_hang(stacks) if explain_hang is not None else None
        raise CheckFailed(custom or _hang_message(e, progress, timeout, hang_hint)) from None
    except WorkerError as e:
        roots = _root_causes(e.failures)
        custom = None
        if explain_error is not None and roots and roots[0].exc_type != "NotImplementedError":
            custom = explain_error(roots[0])
        raise CheckFailed(custom or _error_message(e, progress, error_hint)) from None


def _hang_message(e: WorkerTimeout, progress: NullDisplay, timeout: float, hint: str) -> str:
    stuck = sorted(r for r, f in e.failures.items() if f.kind == "timeout")
    done = sorted(r for r, f in e.failures.items() if f.finished_anyway or f.kind == "stopped")
    if e.early_finish is not None and done:
        head = (f"rank(s) {', '.join(map(str, done))} returned, but rank(s) "
                f"{', '.join(map(str, stuck))} still waited {e.early_finish:g} s later: a rank that "
                "returns (or skips a step) leaves the others waiting in a collective it never joins.")
    else:
        head = f"your code hung: after {timeout:g} s rank(s) {', '.join(map(str, stuck))} were still running."
    parts = [head]
    for r in stuck:
        stack = learner_frames(e.failures[r].stack)
        parts.append(f"rank {r}{_where(progress, r)} was stuck here:\n" + _indent(stack or "(no stack)"))
    if hint:
        parts.append(f"Usual mistake: {hint}")
    return "\n".join(parts)


def _error_message(e: WorkerError, progress: NullDisplay, hint: str) -> str:
    roots = _root_causes(e.failures)
    not_done = [f for f in roots if f.exc_type == "NotImplementedError"]
    if not_done:
        f = not_done[0]
        return (f"not done yet: rank {f.rank} raised NotImplementedError ({f.message}). "
                "Fill in the stub and rerun.")
    f = roots[0]
    where = _where(progress, f.rank)
    finished = sorted(r for r, g in e.failures.items() if g.finished_anyway)
    if finished and all(g.is_echo for g in roots):
        # The process of a rank that returned has exited: its peers, still in a collective with it,
        # see their connection to it reset.  The mistake is the early return, not the reset.
        done = ", ".join(f"rank {r}{_where(progress, r)}" for r in finished)
        waiting = ", ".join(f"rank {g.rank}{_where(progress, g.rank)}" for g in roots)
        return (f"{done} returned while {waiting} still waited for it in a collective (its "
                "connection to the finished rank was then reset): every rank must run the same "
                "collectives, in the same order, the same number of times."
                + (f"\nUsual mistake: {hint}" if hint else ""))
    if f.kind == "exception":
        head = f"rank {f.rank}{where}: your code raised {f.exc_type}: {f.message}"
        frames = learner_frames(f.traceback)
        body = "\n" + _indent(frames) if frames else ""
    else:
        head = f"rank {f.rank}{where}: " + f.describe().split(" ", 2)[2]
        body = ""
    others = [g.rank for g in roots[1:]]
    tail = f"\n(rank(s) {', '.join(map(str, others))} failed too.)" if others else ""
    return head + body + tail + (f"\nUsual mistake: {hint}" if hint else "")


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())


# --------------------------------------------------------------------------------------------
# Small steps every chapter's workers repeat
# --------------------------------------------------------------------------------------------


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
