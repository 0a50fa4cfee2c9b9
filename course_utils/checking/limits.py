"""``time_limit``: a bound on learner code that a checker runs in the notebook's own process.

Most checkers run the learner's code in workers, where ``run_workers`` stops a rank that hangs.  A
few call it directly (a training step on one process, a sampler, a formula): an answer that never
returns would freeze the cell.  ``time_limit`` arms a timer (``SIGALRM``) for the block; when it
fires, the learner's code is interrupted where it is, and the checker fails with a message that says
where that was.  It interrupts Python code and sleeps; a single long call into C++ (one huge matmul)
ends first.  Outside the main thread, where signals cannot be delivered, the block runs unbounded.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import traceback
from collections.abc import Iterator

from .errors import CheckFailed

__all__ = ["time_limit", "IN_PROCESS_LIMIT"]

# Seconds for a whole in-process check (they take about a second; the margin is for a loaded machine).
IN_PROCESS_LIMIT = 60.0
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # course_utils/


class _Overtime(BaseException):
    """Raised by the timer: a BaseException, which ``except Exception`` in the learner's code lets by."""


@contextlib.contextmanager
def time_limit(seconds: float | None, what: str) -> Iterator[None]:
    """Run the block for at most ``seconds``; past that, ``CheckFailed`` saying ``what`` did not return.

    ``seconds=None`` is ``IN_PROCESS_LIMIT``, read when the block starts.
    """
    seconds = IN_PROCESS_LIMIT if seconds is None else seconds
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    where: list[str] = []

    def on_alarm(signum: int, frame: object) -> None:
        if outer and outer < seconds and callable(previous):
            previous(signum, frame)  # the outer limit came first: it is the one that fires
            return
        stack = traceback.extract_stack(frame)
        theirs = [f for f in stack if not f.filename.startswith(_PACKAGE)] or stack[-1:]
        where.extend(f"{f.filename}:{f.lineno} in {f.name}" for f in theirs[-3:])
        raise _Overtime(where)  # ``where`` tells this limit's timer from an outer one's

    outer = signal.getitimer(signal.ITIMER_REAL)[0]  # a limit around this one: re-armed after
    started = time.monotonic()
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, min(seconds, outer) if outer else seconds)
    try:
        yield
    except _Overtime as e:
        if e.args[0] is not where:
            raise  # an outer limit's: it reports itself
        at = "\n".join(f"    {w}" for w in where)
        raise CheckFailed(f"{what} did not return within {seconds:g} s; it was interrupted at:\n{at}\n"
                          "Look for a loop that never ends or a wait for something that never "
                          "comes (in one process there is no other rank to answer).") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - started), 1e-3))
