"""The skeleton of every checker: a decorator, workers that open one process group, one result type.

A checker reads in three steps::

    @checker("NN.x name")                          # names the exercise, records pass/fail
    def check_thing(learner_fn):
        require_callable(learner_fn, "thing(x)")
        outcomes = run_workers(_worker, 2, args=(learner_fn,))   # the learner's code in workers
        judge(outcomes)                             # the notebook process turns them into a verdict

    def _worker(learner_fn) -> Outcome:
        with process_group() as pg:                 # opened and closed the same way everywhere
            ...
            return Outcome(pg.rank, problem="...", data={...})

- ``checker`` turns a stub's ``NotImplementedError`` into "not done yet" and any other crash of the
  learner's code in the notebook process into a ``CheckFailed`` that shows it;
- ``run_workers`` runs the worker on several ranks: an exception in the learner's code, a stub, a
  hang, a crash or a signal all become one ``CheckFailed`` that names the rank and the usual cause;
- ``process_group`` opens a worker's default group (gloo on CPU, NCCL with ``device_id`` where the
  rank owns a GPU) and closes it in the right order, also when the learner's code raised;
- every worker returns an ``Outcome``; ``judge`` (or ``first_problem``) raises the first problem a
  rank reported, lowest rank first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import os
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..devices import backend_and_device, process_group_kwargs
from ..launching import launch
from ..monitor import NullDisplay
from ..progress import record
from ..workers.errors import FailureKind, RankFailure, WorkerError, WorkerTimeout, indent
from ..workers.stacks import drop_frames
from ..workers.supervisor import ForkServerFailed
from .errors import CheckFailed
from .limits import time_limit

__all__ = [
    "checker",
    "run_workers",
    "process_group",
    "Group",
    "Outcome",
    "first_problem",
    "judge",
    "learner_frames",
]


def checker(exercise: str, *, in_process: bool = False) -> Callable:
    """Decorate a ``check_*`` function: name the exercise, record the outcome, never crash.

    - a stub that still raises ``NotImplementedError`` gives "exercise X is not done yet";
    - any other unexpected exception in the learner's code becomes a ``CheckFailed`` that shows it;
    - ``in_process=True``: the checker runs the learner's code in the notebook's own process (not in
      workers); it is interrupted after ``limits.IN_PROCESS_LIMIT`` seconds (``time_limit``), so
      that no answer freezes the cell;
    - pass/fail is written to the learner's progress file (``course_utils.progress``).
    """

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> None:
            bound = (time_limit(None, "your code, run in this notebook's process,")
                     if in_process else contextlib.nullcontext())
            try:
                with bound:
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
            except ForkServerFailed as e:  # the course's machinery, not the answer: nothing recorded
                raise CheckFailed(f"[{exercise}] could not run the check: {e}") from None
            except WorkerError as e:  # a launch outside run_workers: at least name a stub
                _record(exercise, False)
                raise CheckFailed(f"[{exercise}] {_error_message(e, NullDisplay(0), '')}") from None
            except Exception as e:  # the learner's code crashed in this process
                _record(exercise, False)
                frames = _own_frames(e)
                raise CheckFailed(f"[{exercise}] your code raised {type(e).__name__}: {e}"
                                  + (f"\n{indent(frames)}" if frames else "")) from e
            _record(exercise, True)
            print(f"[PASS] {exercise}")

        run.exercise = exercise  # type: ignore[attr-defined]
        return run

    return wrap


# In this process, torch's own frames are left out too: the line the learner can change is theirs.
_NOT_THEIRS = ("course_utils/", f"{os.sep}torch{os.sep}", "/pytest/", "/_pytest/", "/pluggy/")


def _own_frames(e: BaseException) -> str:
    """The frames of the learner's code in ``e``'s traceback (file, line, source line), no others;
    "" when none of theirs is in it (the error came from the checker's own calls)."""
    text = "".join(traceback.format_exception(type(e), e, e.__traceback__, chain=False))
    kept = drop_frames(text, _NOT_THEIRS).splitlines()
    frames = [line for line in kept if line.strip().startswith("File ")]
    if not frames or any(s in f for f in frames for s in _NOT_THEIRS):
        return ""  # only the checker's or torch's frames: nothing of theirs to show
    body = [line for line in kept if not line.startswith("Traceback") and line.startswith(" ")]
    return "\n".join(line[2:] if line.startswith("  ") else line for line in body)


def _record(exercise: str, passed: bool) -> None:
    try:
        record(exercise, passed)
    except Exception:  # a broken progress file must never break a check
        pass


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



def judge(outcomes: Sequence[Any], *, world: int | None = None) -> list[Outcome]:
    """The notebook side of a checker: every rank's ``Outcome``, or the first problem as CheckFailed.

    ``world`` (when given) requires one ``Outcome`` per rank: a worker that returned something
    else is a bug of the checker, reported as such rather than judged.
    """
    got = [o for o in outcomes if isinstance(o, Outcome)]
    if world is not None and len(got) != world:
        kinds = ", ".join(type(o).__name__ for o in outcomes)
        raise RuntimeError(f"checker bug: expected {world} Outcome(s), the workers returned {kinds}")
    first_problem(got)
    return sorted(got, key=lambda o: o.rank)


@dataclasses.dataclass(frozen=True)
class Group:
    """What ``process_group`` opened: this rank, the world size, the backend and the rank's device."""

    rank: int
    world: int
    backend: str
    device: torch.device


@contextlib.contextmanager
def process_group(backend: str | None = None) -> Iterator[Group]:
    """Open this worker's default process group; close it on the way out, also after an error.

    ``backend=None`` takes ``backend_and_device()``: NCCL with the rank's own GPU (bound before any
    other CUDA call, and passed as ``device_id``) when there is one GPU per rank, else gloo on CPU.
    ``backend="gloo"`` forces gloo on CPU (a checker that must see CPU tensors).

    Teardown order: objects the body dropped are collected first (a DDP reducer that outlives its
    group can hang a gloo process at exit), pending GPU work is waited for, then the group is
    destroyed, unless the body destroyed it already.
    """
    if backend is None:
        backend, device = backend_and_device()
    else:
        device = torch.device("cpu") if backend == "gloo" else backend_and_device()[1]
    dist.init_process_group(**process_group_kwargs(backend, device))
    try:
        yield Group(dist.get_rank(), dist.get_world_size(), backend, device)
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if dist.is_initialized():
            dist.destroy_process_group()

# Frames of the checker and of the launcher: the learner cannot act on them.
_CHECKER_FRAMES = ("course_utils/checks/", "course_utils/checking/", "course_utils/workers/",
                   "torch/distributed/", "torch/nn/modules/module.py", "torch/nn/parallel/")


def learner_frames(text: str) -> str:
    """A traceback or stack reduced to the frames of the learner's code (and the error line).

    Frames are kept with their quoted source line; the checker's, the launcher's and torch's own
    frames are left out.  When nothing is left, the last frame is kept so that the message still
    says where.
    """
    return drop_frames(text, _CHECKER_FRAMES)


def _root_causes(failures: dict[int, RankFailure]) -> list[RankFailure]:
    """The ranks whose failure is their own: not stopped by the launcher, not a peer's echo."""
    own = [f for f in failures.values() if f.kind is not FailureKind.STOPPED]
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
        stacks = {r: f.stack for r, f in e.failures.items() if f.kind is FailureKind.TIMEOUT}
        custom = explain_hang(stacks) if explain_hang is not None else None
        raise CheckFailed(custom or _hang_message(e, progress, timeout, hang_hint)) from None
    except WorkerError as e:
        roots = _root_causes(e.failures)
        custom = None
        if explain_error is not None and roots and roots[0].exc_type != "NotImplementedError":
            custom = explain_error(roots[0])
        raise CheckFailed(custom or _error_message(e, progress, error_hint)) from None


def _hang_message(e: WorkerTimeout, progress: NullDisplay, timeout: float, hint: str) -> str:
    stuck = sorted(r for r, f in e.failures.items() if f.kind is FailureKind.TIMEOUT)
    done = sorted(r for r, f in e.failures.items() if f.kind is FailureKind.STOPPED)
    if e.early_finish is not None and done:
        head = (f"rank(s) {', '.join(map(str, done))} returned, but rank(s) "
                f"{', '.join(map(str, stuck))} still waited {e.early_finish:g} s later: a rank that "
                "returns (or skips a step) leaves the others waiting in a collective it never joins.")
    else:
        head = f"your code hung: after {timeout:g} s rank(s) {', '.join(map(str, stuck))} were still running."
    parts = [head]
    for r in stuck:
        stack = learner_frames(e.failures[r].stack)
        parts.append(f"rank {r}{_where(progress, r)} was stuck here:\n" + indent(stack or "(no stack)"))
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
    if f.kind is FailureKind.EXCEPTION:
        head = f"rank {f.rank}{where}: your code raised {f.exc_type}: {f.message}"
        frames = learner_frames(f.traceback)
        body = "\n" + indent(frames) if frames else ""
    else:
        head = f"rank {f.rank}{where}: " + f.describe().split(" ", 2)[2]
        body = ""
    others = [g.rank for g in roots[1:]]
    tail = f"\n(rank(s) {', '.join(map(str, others))} failed too.)" if others else ""
    return head + body + tail + (f"\nUsual mistake: {hint}" if hint else "")
