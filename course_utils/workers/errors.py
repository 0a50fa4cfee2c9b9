"""What a rank sent back, and what went wrong in a launch, rank by rank."""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import signal
from typing import Any

__all__ = ["ECHO", "FailureKind", "RankResult", "RankFailure", "WorkerError", "WorkerTimeout",
           "LaunchInterrupted", "failure_summary", "indent"]

# Messages that one rank's failure causes on its peers (a closed connection, a receive that timed
# out): the root cause is on another rank.
ECHO = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|Connection refused|ECONNRESET|EPIPE|"
    r"recvBytes|Socket Timeout|Timed out waiting|Application timeout caused pair closure|"
    r"Check the logs of the remote worker|pair\.cc",
    re.IGNORECASE,
)


def indent(text: str, prefix: str = "    ") -> str:
    """Every line of ``text`` with ``prefix`` in front (for nesting output in a message)."""
    return "\n".join(prefix + line for line in text.rstrip().splitlines())


def signal_name(exitcode: int | None) -> str:
    """``SIGKILL`` for an exit code of -9."""
    sig = -(exitcode or 0)
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


@dataclasses.dataclass(frozen=True)
class RankResult:
    """What a worker sends back: its function's return value, or the exception it raised.

    ``exc_type`` is empty when the function returned ``value``; otherwise it names the exception,
    with its message and formatted traceback (the exception itself may not unpickle here).
    """

    value: Any = None
    exc_type: str = ""
    message: str = ""
    traceback: str = ""

    @property
    def ok(self) -> bool:
        return not self.exc_type

    @classmethod
    def raised(cls, exc_type: str, message: str, traceback: str = "") -> RankResult:
        return cls(exc_type=exc_type, message=message, traceback=traceback)


class FailureKind(enum.StrEnum):
    """How a rank failed.  A ``str``: ``failure.kind == "stopped"`` holds for ``STOPPED``."""

    EXCEPTION = "exception"  # the function raised
    EXIT = "exit"  # the process exited without a result
    SIGNAL = "signal"  # it was killed
    TIMEOUT = "timeout"  # still running at the deadline (``stack`` says where)
    STOPPED = "stopped"  # the launcher stopped it because another rank failed


@dataclasses.dataclass
class RankFailure:
    """What happened to one rank that did not return normally.

    ``kind`` is a ``FailureKind`` (a plain string such as ``"exception"`` is converted).
    ``finished_anyway`` is set by the launcher on a ``STOPPED`` rank that had already returned
    when another rank failed or hung.  ``echo_of`` names the rank whose failure this one's exception
    only echoes (its connection to that rank closed, ``is_echo``), when that rank failed by itself.
    """

    rank: int
    kind: FailureKind
    exc_type: str = ""
    message: str = ""
    traceback: str = ""
    exitcode: int | None = None
    stack: str = ""
    finished_anyway: bool = False
    echo_of: int | None = None

    def __post_init__(self) -> None:
        self.kind = FailureKind(self.kind)

    def short(self) -> str:
        """A few words for a status line: ``raised ValueError``, ``killed by SIGKILL``..."""
        if self.echo_of is not None:
            return f"echoed rank {self.echo_of}'s failure"
        if self.kind is FailureKind.EXCEPTION:
            return f"raised {self.exc_type}"
        if self.kind is FailureKind.SIGNAL:
            return f"killed by {signal_name(self.exitcode)}"
        if self.kind is FailureKind.EXIT:
            return f"exited with code {self.exitcode}"
        if self.kind is FailureKind.TIMEOUT:
            return "stopped (state T) when the launch timed out" if self.message else \
                "still running when the launch timed out"
        return self.message or "stopped"

    @property
    def is_echo(self) -> bool:
        """An exception that reads like a peer's failure seen from here (``ECHO``), not a cause."""
        return self.kind is FailureKind.EXCEPTION and bool(ECHO.search(self.message))

    def describe(self) -> str:
        """The full account: the exception with its traceback, the signal, or the hung stack."""
        if self.echo_of is not None:  # its traceback would only point at the collective it was in
            return (f"rank {self.rank} raised {self.exc_type} only because rank {self.echo_of} failed "
                    f"first (its connection to that rank closed): {self.message}")
        if self.kind is FailureKind.EXCEPTION:
            head = f"rank {self.rank} raised {self.exc_type}: {self.message}"
            return head + ("\n" + indent(self.traceback) if self.traceback else "")
        if self.kind is FailureKind.SIGNAL:
            name = signal_name(self.exitcode)
            return f"rank {self.rank} was killed by {name}" + (
                " (out of memory? the kernel's OOM killer sends SIGKILL)" if name == "SIGKILL" else ""
            )
        if self.kind is FailureKind.EXIT:
            why = f": {self.message}" if self.message else ""
            return f"rank {self.rank} exited with code {self.exitcode} without returning a result{why}"
        if self.kind is FailureKind.TIMEOUT:
            if self.message:  # why no stack could be collected
                return f"rank {self.rank} was still running, but {self.message}"
            where = indent(self.stack) if self.stack else "  (no Python stack could be collected)"
            return f"rank {self.rank} was still running; it was stuck here:\n{where}"
        return f"rank {self.rank} was stopped by the launcher ({self.message})"


class WorkerError(RuntimeError):
    """One or more worker processes failed.  ``failures`` maps each failed rank to a RankFailure."""

    def __init__(self, failures: dict[int, RankFailure], summary: str):
        self.failures = failures
        self.summary = summary
        details = "\n".join(f.describe() for f in sorted(failures.values(), key=lambda f: f.rank))
        super().__init__(f"{summary}\n{details}")

    @property
    def failed_ranks(self) -> list[int]:
        """Ranks that failed by themselves: not the ones the launcher stopped afterwards, nor the
        ones whose exception only echoes another rank's failure (``RankFailure.echo_of``)."""
        return sorted(r for r, f in self.failures.items()
                      if f.kind is not FailureKind.STOPPED and f.echo_of is None)


def failure_summary(failures: dict[int, RankFailure], world: int) -> str:
    """The first line of a failed launch's message; marks each peer's echo with the rank it echoes.

    Under load a peer's echo (its connection to the failed rank closed) can come before the
    launcher stops that peer: it is reported as the echo of the cause, not as a failure of its own.
    """
    own = [f for f in failures.values() if f.kind is not FailureKind.STOPPED]
    causes = sorted(f.rank for f in own if not f.is_echo)
    for f in own:
        if f.is_echo and causes:
            f.echo_of = causes[0]
    echoes = sorted(f.rank for f in own if f.echo_of is not None)
    summary = f"{len(own) - len(echoes)} of {world} rank(s) failed"
    if echoes:
        summary += f"; rank(s) {', '.join(map(str, echoes))} raised only because of it"
    if len(own) < len(failures):
        summary += "; the others were stopped"
    return summary + "."


class WorkerTimeout(WorkerError):
    """Workers were still running at a deadline; the stuck ranks' stacks are attached.

    ``early_finish`` is None for the launch's ``timeout``; with ``launch(finish_within=s)`` it is
    ``s`` when some ranks had returned ``s`` seconds before while others were still running.
    """

    def __init__(self, failures: dict[int, RankFailure], summary: str, early_finish: float | None = None):
        super().__init__(failures, summary)
        self.early_finish = early_finish


class LaunchInterrupted(KeyboardInterrupt):
    """Ctrl-C (the notebook's "interrupt") stopped a launch: still a ``KeyboardInterrupt``.

    Every worker has been stopped by the time it is raised, and the display already shows it; in
    Jupyter it shows one line, not a traceback through the launcher (IPython asks an exception for
    ``_render_traceback_``).  ``COURSE_TRACEBACKS=full`` in the kernel's environment shows the
    whole traceback.
    """

    @property
    def _render_traceback_(self):  # noqa: ANN202 - IPython's hook: a callable returning lines
        if os.environ.get("COURSE_TRACEBACKS") == "full":
            raise AttributeError("_render_traceback_")
        return lambda: [f"\x1b[1;31mKeyboardInterrupt\x1b[0m: {self}"]
