"""Progress reports from workers, and the display that shows them in the notebook.

Worker code calls ``report(step=..., loss=...)``.  Inside ``course_utils.launch`` the values travel
to the notebook through a non-blocking pipe; anywhere else (plain ``python``, ``torchrun``) rank 0
prints an occasional log line instead, so the same training file runs everywhere unchanged.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

__all__ = ["report", "make_display", "TextDisplay"]

_last_log = 0.0
LOG_EVERY_S = 5.0


def report(**metrics: Any) -> None:
    """Send this rank's latest metrics (numbers or short strings) to the notebook's display.

    Never blocks: when the notebook falls behind, intermediate reports are dropped by design; the
    display always shows the latest values it received.  Outside ``launch`` rank 0 prints at most
    one line every ``LOG_EVERY_S`` seconds.
    """
    from . import launcher as _launch

    clean = {k: (v.item() if hasattr(v, "item") else v) for k, v in metrics.items()}
    if _launch._REPORT_FD is not None:
        _launch.send_report(clean)
        return
    global _last_log
    if os.environ.get("RANK", "0") != "0":
        return
    now = time.monotonic()
    if now - _last_log >= LOG_EVERY_S:
        _last_log = now
        print(" ".join(f"{k}={_fmt(v)}" for k, v in clean.items()), file=sys.stderr)


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


class TextDisplay:
    """Plain-text display: one summary line per rank when the launch ends."""

    def __init__(self, world: int):
        self.world = world
        self.latest: dict[int, dict] = {}
        self.count: dict[int, int] = {}

    def update(self, rank: int, metrics: dict) -> None:
        self.latest[rank] = metrics
        self.count[rank] = self.count.get(rank, 0) + 1

    def finish(self, failures: dict) -> None:
        for rank in range(self.world):
            m = self.latest.get(rank, {})
            state = "stopped" if rank in failures else "done"
            fields = " ".join(f"{k}={_fmt(v)}" for k, v in m.items())
            print(f"rank {rank}: {state}; last report: {fields or '(none)'}")


def make_display(world: int) -> Any:
    """The display used by ``launch`` for ``display="auto"``."""
    return TextDisplay(world)
