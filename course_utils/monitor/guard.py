"""Between the launcher's loop and a display: ``DisplayGuard`` paces the display and shields the launch.

``course_utils.launch`` hands the workers' launcher ``display_factory(display)``; the launcher
calls it with the world size and gets a guard, to which it gives every report.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from typing import Any

from ..workers.errors import FailureKind, RankFailure
from .choice import make_display

__all__ = ["DisplayGuard", "display_factory"]


class DisplayGuard:
    """Creates the launch's display lazily, on the first report, and shields the launch from it.

    The launcher's loop also reads the workers' pipes, so a slow display must not slow it down:
    once the display's ``update`` calls have used more than ``BUDGET`` of the time since it was
    created, reports are coalesced (each rank's newest one waits, replacing older ones) and handed
    over when the display is back within budget.  ``finish`` first hands over every waiting report,
    so a display may miss intermediate reports but never a rank's last one.  A display that fails
    to be created is dropped; exceptions from it never reach the launch.

    ``display`` is what ``launch`` was given: ``"auto"`` (``make_display`` on the first report),
    ``None`` (reports are ignored) or a display object.
    """

    BUDGET = 0.5

    def __init__(self, display: Any, world: int):
        self._spec = display
        self._world = world
        self._obj: Any = None
        self._pending: dict[int, dict] = {}
        self.spent_s = 0.0  # time spent in the display's update calls
        self._t0 = 0.0
        self._finished = False
        self.coalesced = 0  # reports replaced by a newer one before the display saw them

    def update(self, rank: int, metrics: dict) -> None:
        if self._spec is None or self._finished:
            return
        if self._obj is None:
            try:
                self._obj = make_display(self._world) if self._spec == "auto" else self._spec
            except Exception:
                self._spec = None
                return
            self._t0 = time.monotonic()
        if rank in self._pending:
            self.coalesced += 1
        self._pending[rank] = metrics
        if self.spent_s <= self.BUDGET * max(1.0, time.monotonic() - self._t0):
            self._flush()

    def _flush(self) -> None:
        pending, self._pending = self._pending, {}
        start = time.monotonic()
        for rank, metrics in pending.items():
            with contextlib.suppress(Exception):
                self._obj.update(rank, metrics)
        self.spent_s += time.monotonic() - start

    def finish(self, failures: dict) -> None:
        if self._obj is not None and not self._finished:
            try:
                self._flush()
                self._obj.finish(failures)
            except Exception:
                pass
        self._finished = True
        if self._spec == "auto":
            self._obj = None

    def close(self) -> None:
        """End of the launch: a display that was not finished (an interrupt) is told so."""
        if self._obj is not None and not self._finished:
            self.finish({r: RankFailure(r, FailureKind.STOPPED, message="the launch was interrupted")
                         for r in range(self._world)})
        self._obj = None


def display_factory(display: Any) -> Callable[[int], DisplayGuard]:
    """What ``course_utils.launch`` gives the workers' launcher: world size -> the launch's guard."""
    return functools.partial(DisplayGuard, display)
