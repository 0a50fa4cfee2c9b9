"""What every display records (``Recorder``), and the two displays without widgets.

What each display leaves in the cell
------------------------------------
``text`` (``TextDisplay``): nothing while the workers run, then one line per rank whose wording
depends only on the steps reached and how each rank ended (``rank 0: step 50/50, done``), so a cell
may carry ``# NBVAL_CHECK_OUTPUT``; then, in a kernel, one static figure of the loss per rank
(final values in its legend).  In a terminal the lines also carry the last metrics, and there is
no figure.

``none`` (``NullDisplay``): nothing; the reports are still recorded (the checkers read them).

``widgets``: see ``widget.WidgetDisplay``.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

from .settings import SETTINGS
from .state import RankState, fmt_metrics, is_number, status_line

__all__ = ["Recorder", "NullDisplay", "TextDisplay", "in_kernel", "has_ipywidgets", "show_png"]


def in_kernel() -> bool:
    """True inside an IPython kernel (JupyterLab, nbval, nbconvert), not in a terminal IPython."""
    try:
        from IPython import get_ipython  # optional: absent outside Jupyter
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


def has_ipywidgets() -> bool:
    try:
        import ipywidgets  # noqa: F401  (optional: only for the widget display)
    except ImportError:
        return False
    return True


def show_png(png: bytes) -> None:
    from IPython.display import Image, display  # only in a kernel, where figures can be shown

    display(Image(data=png, format="png"))


class Recorder:
    """Keeps every rank's state and draws its figures; the displays add what they show."""

    def __init__(self, world: int, *, plot: str | None = None):
        self.world = world
        self.plot_key = plot or SETTINGS.PLOT_KEY
        self.states: dict[int, RankState] = {r: RankState() for r in range(world)}
        self.failures: dict | None = None  # set by finish()

    def update(self, rank: int, metrics: dict) -> None:
        self.states.setdefault(rank, RankState()).add(metrics, self.plot_key)

    def lines(self, failures: dict, *, metrics: bool = False) -> list[str]:
        out = []
        for rank in sorted(self.states):
            st = self.states[rank]
            line = status_line(rank, st, failures.get(rank))
            if metrics and st.latest:
                line += "; " + fmt_metrics(st.latest, sep=" ", eq="=", skip=("step", "total"))
            out.append(line)
        return out

    def has_curve(self) -> bool:
        return any(st.last_point is not None for st in self.states.values())

    def _curves(self) -> Iterator[tuple[int, list, list]]:
        """``(rank, xs, ys)`` for each rank that has a point to draw, in rank order."""
        for rank in sorted(self.states):
            xs, ys = self.states[rank].points()
            if xs:
                yield rank, xs, ys

    # The figures use matplotlib's object API, not pyplot: no global state, no inline duplicate.
    def _new_axes(self) -> tuple[Any, Any]:
        from matplotlib.figure import Figure  # slow to import: only when a figure is drawn

        fig = Figure(figsize=(6.4, 3.0), dpi=90)
        fig.subplots_adjust(left=0.12, right=0.98, top=0.9, bottom=0.19)
        ax = fig.add_subplot()
        ax.set_ylabel(self.plot_key)
        ax.grid(alpha=0.3)
        return fig, ax

    def _set_scale(self, ax: Any, curves: list[tuple[list, list]]) -> None:
        xs_any = any(is_number(st.step) for st in self.states.values())
        ax.set_xlabel("step" if xs_any else "report")
        lo = min((min(ys) for _, ys in curves if ys), default=0.0)
        hi = max((max(ys) for _, ys in curves if ys), default=0.0)
        scale = "log" if lo > 0 and hi / lo > 50 else "linear"
        if ax.get_yscale() != scale:
            ax.set_yscale(scale)

    def figure_png(self, failures: dict | None = None) -> bytes:
        """The final figure: one curve per rank, last values in the legend, x where a rank stopped."""
        fig, ax = self._new_axes()
        failures = failures or {}
        curves = []
        for rank, xs, ys in self._curves():
            curves.append((xs, ys))
            label = f"rank {rank}: {self.plot_key} {ys[-1]:.4g}"
            f = failures.get(rank)
            if f is not None and not f.finished_anyway:
                label += f" (stopped: {f.short()})"
            (line,) = ax.plot(xs, ys, lw=1.2, label=label)
            if f is not None and not f.finished_anyway:
                ax.plot(xs[-1:], ys[-1:], "x", ms=9, mew=2, color=line.get_color())
        ax.set_title(f"{self.plot_key} per rank", fontsize=10)
        self._set_scale(ax, curves)
        if curves:
            ax.legend(fontsize=8, loc="upper right")
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return buf.getvalue()

    def live_png(self) -> bytes:
        """The live figure, redrawn in place: the same axes and lines get new data each time."""
        live = getattr(self, "_live", None)
        if live is None:
            fig, ax = self._new_axes()
            ax.set_title(f"{self.plot_key} per rank (live)", fontsize=10)
            live = self._live = {"fig": fig, "ax": ax, "lines": {}}
        ax, lines = live["ax"], live["lines"]
        curves = []
        for rank, xs, ys in self._curves():
            curves.append((xs, ys))
            if rank not in lines:
                (lines[rank],) = ax.plot([], [], lw=1.2, label=f"rank {rank}")
                ax.legend(fontsize=8, loc="upper right")
            lines[rank].set_data(xs, ys)
        self._set_scale(ax, curves)
        ax.relim()
        ax.autoscale_view()
        buf = io.BytesIO()
        live["fig"].savefig(buf, format="png")
        return buf.getvalue()


class NullDisplay(Recorder):
    """Records the reports and shows nothing (``COURSE_DISPLAY=none``)."""

    def finish(self, failures: dict) -> None:
        self.failures = dict(failures)


class TextDisplay(Recorder):
    """Headless display: nothing while the workers run; at the end one line per rank + a figure.

    The lines depend only on the steps reached and on how each rank ended, so that nbval can
    compare them.  In a kernel the final figure follows (its legend has the last values); in a
    terminal the lines carry the last metrics instead and no figure is drawn.
    """

    def finish(self, failures: dict) -> None:
        self.failures = dict(failures)
        kernel = in_kernel()
        print("\n".join(self.lines(self.failures, metrics=not kernel)), flush=True)
        if kernel and self.has_curve():
            show_png(self.figure_png(self.failures))
