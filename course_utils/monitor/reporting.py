"""The worker side: ``report()``, and ``live()`` for training in the notebook's own process.

Where a report goes:

- inside ``course_utils.launch`` the values travel to the notebook through a non-blocking pipe
  (``workers.reports.send_report``), and the launch's display shows them;
- inside ``with monitor.live():`` (training in the notebook's own process) they go straight to a
  display in this process;
- anywhere else (plain ``python``, ``torchrun``) rank 0 prints a log line now and then, so the same
  training file runs everywhere unchanged.

Cost, measured with ``benchmarks/report_overhead.py`` on the course's 2-core machine: a
``report()`` call takes about 3-12 microseconds in the worker; the rest of the overhead is the
notebook's process reading and drawing on the cores the workers train on.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from ..workers import reports
from ..workers.errors import FailureKind, RankFailure
from .choice import make_display
from .settings import SETTINGS
from .state import fmt_metrics, is_number

__all__ = ["report", "live"]

_sink: Any = None  # the display of an enclosing ``live()`` block in this process
_last_log = 0.0
_logged_any = False


def report(**metrics: Any) -> None:
    """Send this rank's latest metrics (numbers or short strings) to the notebook's display.

    ``report(step=i + 1, total=steps, loss=loss, samples_per_s=rate)``.  Tensors and NumPy scalars
    are converted with ``.item()`` (on a GPU that waits for the step to finish: report every few
    steps there).

    Keys with a meaning: ``step`` (the progress; report the number of steps *done*, ``i + 1``),
    ``total`` (the number of steps expected; gives the progress bar its length), ``loss`` (plotted;
    see ``monitor.SETTINGS.PLOT_KEY``).  Any other number or short string is shown as text next to the bar.

    Inside ``launch`` this never blocks and costs a few microseconds: the report is pickled and
    written to a pipe to the notebook, which reads it within
    ``workers.supervisor.REPORT_READ_EVERY_S`` (20 ms).  If the notebook falls so far behind that
    the pipe is full (about 1 MiB, some 10,000 reports), intermediate reports are dropped by
    design: the newest is held back and written as soon as there is room, so the last report of
    each rank arrives (see ``workers.reports``).

    Outside ``launch`` and ``live()``, rank 0 (``RANK`` unset or ``0``) prints its first report,
    then at most one line every ``monitor.SETTINGS.LOG_EVERY_S`` seconds, and the report where ``step``
    reaches ``total``; the other ranks print nothing.
    """
    clean = {k: _plain(k, v) for k, v in metrics.items()}
    if reports.in_worker():
        reports.send_report(clean)
        return
    if _sink is not None:
        _sink.update(0, clean)
        return
    _log(clean)


def _plain(key: str, v: Any) -> Any:
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    if hasattr(v, "item"):
        try:
            return v.item()
        except (ValueError, RuntimeError):
            raise TypeError(
                f"report({key}=...) takes a number; got a {type(v).__name__} with "
                f"{getattr(v, 'numel', lambda: '?')()} elements (report one value, e.g. the mean)"
            ) from None
    if isinstance(v, (bytes, bytearray)):
        return bytes(v).decode("utf-8", "replace")
    return str(v)


def _log(clean: dict) -> None:
    global _last_log, _logged_any
    if os.environ.get("RANK", "0") != "0":
        return
    now = time.monotonic()
    step, total = clean.get("step"), clean.get("total")
    last = is_number(step) and is_number(total) and step >= total
    if not _logged_any or last or now - _last_log >= SETTINGS.LOG_EVERY_S:
        _last_log = now
        _logged_any = True
        print("[report] " + fmt_metrics(clean, sep=" ", eq="="), file=sys.stderr, flush=True)


@contextlib.contextmanager
def live(world: int = 1, *, display: Any = None) -> Iterator[Any]:
    """Show ``report()`` calls made in *this* process (training in the notebook itself).

    ::

        with monitor.live():
            for i in range(steps):
                ...
                report(step=i + 1, total=steps, loss=loss)

    Reports are shown as rank 0.  The display is finished when the block ends; an exception
    leaves it showing where training stopped, and is raised as usual.
    """
    global _sink
    disp = display if display is not None else make_display(world)
    previous, _sink = _sink, disp
    failures: dict = {}
    try:
        yield disp
    except BaseException as e:
        failures = {0: RankFailure(0, FailureKind.EXCEPTION, exc_type=type(e).__name__, message=str(e))}
        raise
    finally:
        _sink = previous
        disp.finish(failures)
