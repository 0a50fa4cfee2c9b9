"""One rank's reports, reduced to what a display needs, and how they are put in words."""

from __future__ import annotations

import time
from typing import Any

from .settings import SETTINGS

__all__ = ["RankState", "status_line", "is_number", "fmt_value", "fmt_metrics"]


def is_number(v: Any) -> bool:
    """An int or a float, not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def fmt_value(v: Any) -> str:
    """``50`` for 50.0, four significant digits for other floats."""
    if isinstance(v, float):
        if v.is_integer() and abs(v) < 1e15:
            return str(int(v))
        return f"{v:.4g}"
    return str(v)


def fmt_metrics(m: dict, *, sep: str = " · ", eq: str = " ", skip: tuple = ()) -> str:
    """``loss 0.5 · phase warm-up``: the metrics of one report, in their order."""
    return sep.join(f"{k}{eq}{fmt_value(v)}" for k, v in m.items() if k not in skip)


class RankState:
    """One rank's reports, reduced to what a display needs."""

    __slots__ = ("count", "step", "total", "latest", "xs", "ys", "stride", "last_point", "first_seen",
                 "last_seen")

    def __init__(self) -> None:
        self.count = 0
        self.step: Any = None
        self.total: Any = None
        self.latest: dict = {}
        self.xs: list = []
        self.ys: list = []
        self.stride = 1  # keep one point in ``stride`` once SETTINGS.MAX_POINTS was reached
        self.last_point: tuple | None = None
        self.first_seen: tuple[float, Any] | None = None  # (arrival time, step) of the first step report
        self.last_seen = 0.0

    def add(self, metrics: dict, plot_key: str) -> None:
        self.count += 1
        if "step" in metrics:
            self.step = metrics["step"]
            self.last_seen = time.monotonic()
            if self.first_seen is None and is_number(self.step):
                self.first_seen = (self.last_seen, self.step)
        if "total" in metrics:
            self.total = metrics["total"]
        self.latest = metrics
        y = metrics.get(plot_key)
        if is_number(y) or isinstance(y, bool):
            x = self.step if is_number(self.step) else self.count
            self.last_point = (x, float(y))
            if (self.count - 1) % self.stride == 0:
                self.xs.append(x)
                self.ys.append(float(y))
                if len(self.xs) > SETTINGS.MAX_POINTS:
                    self.xs, self.ys = self.xs[::2], self.ys[::2]
                    self.stride *= 2

    def points(self) -> tuple[list, list]:
        """The curve, always ending at the last reported value."""
        xs, ys = list(self.xs), list(self.ys)
        if self.last_point is not None and (not xs or (xs[-1], ys[-1]) != self.last_point):
            xs.append(self.last_point[0])
            ys.append(self.last_point[1])
        return xs, ys

    def pace(self) -> str:
        """``9.5 steps/s, about 12 s left``: measured between the first and the latest step report
        (as they arrived here); ``""`` until there are two reports 0.2 s apart."""
        if self.first_seen is None or not is_number(self.step):
            return ""
        t0, s0 = self.first_seen
        seconds, steps = self.last_seen - t0, self.step - s0
        if seconds < 0.2 or steps <= 0:
            return ""
        rate = steps / seconds
        text = f"{rate:.3g} steps/s"
        if is_number(self.total) and self.total > self.step:
            text += f", about {max(1, round((self.total - self.step) / rate))} s left"
        return text

    def where(self) -> str:
        """How far the rank got, in words that depend only on the steps reached."""
        if is_number(self.step):
            if is_number(self.total):
                return f"step {fmt_value(self.step)}/{fmt_value(self.total)}"
            return f"step {fmt_value(self.step)}"
        if self.count:
            return f"{self.count} report{'s' if self.count != 1 else ''}"
        return "no reports"


def status_line(rank: int, st: RankState, failure: Any = None) -> str:
    """``rank 0: step 50/50, done`` / ``rank 1: stopped at step 37/50: raised RuntimeError``."""
    where = st.where()
    if failure is None:
        return f"rank {rank}: {where}, done"
    if failure.finished_anyway:
        return f"rank {rank}: {where}, {failure.message}"
    at = "before its first report" if where == "no reports" else (
        f"at {where}" if where.startswith("step") else f"after {where}")
    return f"rank {rank}: stopped {at}: {failure.short()}"
