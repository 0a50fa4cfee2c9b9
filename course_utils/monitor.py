"""Progress reports from workers, and the display that shows them in the notebook.

Worker code calls ``report(step=..., loss=..., total=...)``:

- inside ``course_utils.launch`` the values travel to the notebook through a non-blocking pipe
  (``workers.reports.send_report``) and the cell shows one progress bar per rank with its latest metrics
  and a live loss curve per rank;
- inside ``with monitor.live():`` (training in the notebook's own process) they go straight to the
  same display;
- anywhere else (plain ``python``, ``torchrun``) rank 0 prints a log line now and then, so the same
  training file runs everywhere unchanged.

Keys with a meaning: ``step`` (the progress; report the number of steps *done*, ``i + 1``),
``total`` (the number of steps expected; gives the progress bar its length), ``loss`` (plotted;
see ``PLOT_KEY``).  Any other number or short string is shown as text next to the bar.

Which display the launch gets (``display_mode``)
------------------------------------------------
There is no reliable way for a kernel to know whether a browser is looking at it: nbval, nbconvert
and JupyterLab all run the same IPython kernel with ipywidgets importable.  The rule used here:

1. ``monitor.DISPLAY`` (set it in a notebook: ``course_utils.monitor.DISPLAY = "text"``), else
2. the environment variable ``COURSE_DISPLAY`` (``widgets``, ``text`` or ``none``), else
3. ``widgets`` when this is an IPython kernel with ipywidgets *and* a Jupyter server started it
   (JupyterLab and Notebook 7 put ``JPY_SESSION_NAME`` in the kernel's environment; nbval,
   nbconvert and nbclient do not) and no pytest run is in progress; ``text`` otherwise.

In another front end that shows widgets (VS Code, say) set ``COURSE_DISPLAY=widgets``.

What each display leaves in the cell
------------------------------------
``text``: nothing while the workers run, then one line per rank whose wording depends only on
the steps reached and how each rank ended (``rank 0: step 50/50, done``), so a cell may carry
``# NBVAL_CHECK_OUTPUT``; then, in a kernel, one static figure of the loss per rank (final values
in its legend).  In a terminal the lines also carry the last metrics, and there is no figure.

``widgets``: while the workers run, a progress bar, a metrics line per rank and, after the first
second, a live plot (redrawn at most every ``PLOT_MIN_INTERVAL_S`` seconds, less often when
drawing is slow, so that the launcher's loop keeps reading the pipes and the workers keep their
cores).  At the end the widgets are replaced, in place, by a static summary (HTML, with the text
lines as its plain-text form) followed by the static final figure, so that a saved notebook shows
the result without a kernel or widget state.  (nbval, which ignores display updates, would see
the widget's output: another reason it gets the text display.)

Cost, measured with ``benchmarks/report_overhead.py`` on the course's 2-core machine: a
``report()`` call takes about 3-12 microseconds in the worker; the rest of the overhead is the
notebook's process reading and drawing on the cores the workers train on.
"""

from __future__ import annotations

import contextlib
import html
import io
import math
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from .workers import reports as _reports
from .workers.errors import RankFailure

__all__ = [
    "report",
    "make_display",
    "DisplayGuard",
    "display_mode",
    "live",
    "TextDisplay",
    "WidgetDisplay",
    "NullDisplay",
    "DISPLAY",
    "PLOT_KEY",
]

#: "widgets", "text" or "none" to force a display in this kernel; None: ``COURSE_DISPLAY`` or auto.
DISPLAY: str | None = None
#: The metric drawn as a curve per rank.
PLOT_KEY = "loss"
#: Outside ``launch``: rank 0 prints at most one line every this many seconds.
LOG_EVERY_S = 5.0
#: Widget display: the bars and metric lines are refreshed at most this often...
REFRESH_S = 0.2
#: ...and the live plot at most this often, less often when drawing is slow (at most 1/11 of the
#: time goes to drawing: the notebook's process shares the cores with the workers), and not at
#: all in the first ``PLOT_FIRST_S`` seconds (a short run only gets its final figure).
PLOT_MIN_INTERVAL_S = 0.5
PLOT_FIRST_S = 1.0
#: Points kept per rank for the curve; beyond that every other point is dropped (the shape stays).
MAX_POINTS = 4000

_MODES = ("widgets", "text", "none")

# --------------------------------------------------------------------------------------------
# The worker side
# --------------------------------------------------------------------------------------------

_sink: Any = None  # the display of an enclosing ``live()`` block in this process
_last_log = 0.0
_logged_any = False


def report(**metrics: Any) -> None:
    """Send this rank's latest metrics (numbers or short strings) to the notebook's display.

    ``report(step=i + 1, total=steps, loss=loss, samples_per_s=rate)``.  Tensors and NumPy scalars
    are converted with ``.item()`` (on a GPU that waits for the step to finish: report every few
    steps there).

    Inside ``launch`` this never blocks and costs a few microseconds: the report is pickled and
    written to a pipe to the notebook, which reads it within ``DisplayGuard.READ_EVERY_S``
    (20 ms).  If the notebook falls so far behind that the pipe is full
    (about 1 MiB, some 10,000 reports), intermediate reports are dropped by design: the newest is
    held back and written as soon as there is room, so the last report of each rank arrives (see
    ``workers.reports``).

    Outside ``launch`` and ``live()``, rank 0 (``RANK`` unset or ``0``) prints its first report,
    then at most one line every ``LOG_EVERY_S`` seconds, and the report where ``step`` reaches
    ``total``; the other ranks print nothing.
    """
    clean = {k: _plain(k, v) for k, v in metrics.items()}
    if _reports.in_worker():
        _reports.send_report(clean)
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
    last = _is_last(clean)
    if not _logged_any or last or now - _last_log >= LOG_EVERY_S:
        _last_log = now
        _logged_any = True
        print("[report] " + _fmt_metrics(clean, sep=" ", eq="="), file=sys.stderr, flush=True)


def _is_last(m: dict) -> bool:
    step, total = m.get("step"), m.get("total")
    return _is_number(step) and _is_number(total) and step >= total


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v.is_integer() and abs(v) < 1e15:
            return str(int(v))
        return f"{v:.4g}"
    return str(v)


def _fmt_metrics(m: dict, *, sep: str = " · ", eq: str = " ", skip: tuple = ()) -> str:
    return sep.join(f"{k}{eq}{_fmt(v)}" for k, v in m.items() if k not in skip)


# --------------------------------------------------------------------------------------------
# Choosing a display
# --------------------------------------------------------------------------------------------


def _in_kernel() -> bool:
    """True inside an IPython kernel (JupyterLab, nbval, nbconvert), not in a terminal IPython."""
    try:
        from IPython import get_ipython  # optional: absent outside Jupyter
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


def _has_ipywidgets() -> bool:
    try:
        import ipywidgets  # noqa: F401  (optional: only for the widget display)
    except ImportError:
        return False
    return True


def display_mode() -> str:
    """``"widgets"``, ``"text"`` or ``"none"``: what ``launch`` shows (rules in the module doc)."""
    for source, value in (("monitor.DISPLAY", DISPLAY), ("COURSE_DISPLAY", os.environ.get("COURSE_DISPLAY"))):
        if value:
            value = value.strip().lower()
            if value == "auto":
                break
            if value not in _MODES:
                raise ValueError(f"{source} must be one of {', '.join(_MODES)} or auto, not {value!r}")
            if value == "widgets" and not (_has_ipywidgets() and _in_kernel()):
                return "text"  # no widgets outside a kernel (a terminal): the text display
            return value
    if (_in_kernel() and _has_ipywidgets() and "JPY_SESSION_NAME" in os.environ
            and "PYTEST_CURRENT_TEST" not in os.environ):
        return "widgets"
    return "text"


def make_display(world: int, *, mode: str | None = None, plot: str | None = None) -> Any:
    """The display used by ``launch`` for ``display="auto"``: see ``display_mode``."""
    mode = mode or display_mode()
    if mode == "none":
        return NullDisplay(world)
    if mode == "widgets":
        return WidgetDisplay(world, plot=plot)
    return TextDisplay(world, plot=plot)


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
        failures = {0: RankFailure(0, "exception", exc_type=type(e).__name__, message=str(e))}
        raise
    finally:
        _sink = previous
        disp.finish(failures)


# --------------------------------------------------------------------------------------------
# What every display records
# --------------------------------------------------------------------------------------------


class RankState:
    """One rank's reports, reduced to what a display needs."""

    __slots__ = ("count", "step", "total", "latest", "xs", "ys", "stride", "last_point")

    def __init__(self) -> None:
        self.count = 0
        self.step: Any = None
        self.total: Any = None
        self.latest: dict = {}
        self.xs: list = []
        self.ys: list = []
        self.stride = 1  # keep one point in ``stride`` once MAX_POINTS was reached
        self.last_point: tuple | None = None

    def add(self, metrics: dict, plot_key: str) -> None:
        self.count += 1
        if "step" in metrics:
            self.step = metrics["step"]
        if "total" in metrics:
            self.total = metrics["total"]
        self.latest = metrics
        y = metrics.get(plot_key)
        if _is_number(y) or isinstance(y, bool):
            x = self.step if _is_number(self.step) else self.count
            self.last_point = (x, float(y))
            if (self.count - 1) % self.stride == 0:
                self.xs.append(x)
                self.ys.append(float(y))
                if len(self.xs) > MAX_POINTS:
                    self.xs, self.ys = self.xs[::2], self.ys[::2]
                    self.stride *= 2

    def points(self) -> tuple[list, list]:
        """The curve, always ending at the last reported value."""
        xs, ys = list(self.xs), list(self.ys)
        if self.last_point is not None and (not xs or (xs[-1], ys[-1]) != self.last_point):
            xs.append(self.last_point[0])
            ys.append(self.last_point[1])
        return xs, ys

    def where(self) -> str:
        """How far the rank got, in words that depend only on the steps reached."""
        if _is_number(self.step):
            if _is_number(self.total):
                return f"step {_fmt(self.step)}/{_fmt(self.total)}"
            return f"step {_fmt(self.step)}"
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


class _Recorder:
    """Keeps every rank's state; the displays below add what they show."""

    def __init__(self, world: int, *, plot: str | None = None):
        self.world = world
        self.plot_key = plot or PLOT_KEY
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
                line += "; " + _fmt_metrics(st.latest, sep=" ", eq="=", skip=("step", "total"))
            out.append(line)
        return out

    def has_curve(self) -> bool:
        return any(st.last_point is not None for st in self.states.values())

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
        xs_any = any(_is_number(st.step) for st in self.states.values())
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
        for rank in sorted(self.states):
            xs, ys = self.states[rank].points()
            if not xs:
                continue
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
        for rank in sorted(self.states):
            xs, ys = self.states[rank].points()
            if not xs:
                continue
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


def _show_png(png: bytes) -> None:
    from IPython.display import Image, display  # only in a kernel, where figures can be shown

    display(Image(data=png, format="png"))


class NullDisplay(_Recorder):
    """Records the reports and shows nothing (``COURSE_DISPLAY=none``)."""

    def finish(self, failures: dict) -> None:
        self.failures = dict(failures)


class TextDisplay(_Recorder):
    """Headless display: nothing while the workers run; at the end one line per rank + a figure.

    The lines depend only on the steps reached and on how each rank ended, so that nbval can
    compare them.  In a kernel the final figure follows (its legend has the last values); in a
    terminal the lines carry the last metrics instead and no figure is drawn.
    """

    def finish(self, failures: dict) -> None:
        self.failures = dict(failures)
        kernel = _in_kernel()
        print("\n".join(self.lines(self.failures, metrics=not kernel)), flush=True)
        if kernel and self.has_curve():
            _show_png(self.figure_png(self.failures))


_GREEN, _RED = "#2e7d32", "#c62828"


class WidgetDisplay(_Recorder):
    """Live display for JupyterLab: per rank an ``IntProgress`` bar and an ``HTML`` metrics line,
    and an ``Image`` widget holding the live plot (PNG), all in one ``VBox``.

    The widgets are plain ipywidgets models: their state (``bars[r].value``, ``.max``,
    ``.bar_style``, ``labels[r].value``, ``plot.value``) can be read from Python, which is how the
    tests check them.  ``finish`` sets their final state, then replaces the widget output with a
    static summary and adds the static final figure, and closes the widgets.
    """

    def __init__(self, world: int, *, plot: str | None = None):
        super().__init__(world, plot=plot)
        # This display exists only in a Jupyter kernel with widgets.
        import ipywidgets as w
        from IPython.display import display

        self.header = w.HTML(value=f"<b>{world} rank{'s' if world != 1 else ''}</b>: running")
        # no total yet: the bar stays hidden and the metrics line counts the steps
        self.bars = [w.IntProgress(value=0, min=0, max=1, layout=w.Layout(width="40%", visibility="hidden"))
                     for _ in range(world)]
        self.labels = [w.HTML(value="waiting for the first report") for _ in range(world)]
        self.plot = w.Image(format="png", layout=w.Layout(display="none", width="600px"))
        self.names = [w.Label(f"rank {r}", layout=w.Layout(width="4em")) for r in range(world)]
        self.rows = [w.HBox([n, b, lab]) for n, b, lab in zip(self.names, self.bars, self.labels)]
        self.box = w.VBox([self.header, *self.rows, self.plot])
        self.closed = False
        self._dirty: set[int] = set()
        self._next_refresh = 0.0
        self._next_plot = time.monotonic() + PLOT_FIRST_S
        self._plot_dirty = False
        self.redraws = 0  # live plot redraws (the final figure not counted)
        self._handle = display(self.box, display_id=True)

    def update(self, rank: int, metrics: dict) -> None:
        super().update(rank, metrics)
        if self.closed:
            return
        self._dirty.add(rank)
        if self.plot_key in metrics:
            self._plot_dirty = True
        now = time.monotonic()
        if now >= self._next_refresh:
            self._refresh()
            self._next_refresh = now + REFRESH_S
        if self._plot_dirty and now >= self._next_plot:
            t = time.monotonic()
            self._redraw(final=False)
            took = time.monotonic() - t
            # at most 1 / PLOT_MIN_INTERVAL_S redraws a second, and drawing takes at most 1/11 of
            # the time: the launching process shares the cores with the workers
            self._next_plot = time.monotonic() + max(PLOT_MIN_INTERVAL_S, 10 * took)

    def _refresh(self, failures: dict | None = None) -> None:
        ranks = range(self.world) if failures is not None else sorted(self._dirty)
        self._dirty.clear()
        for rank in ranks:
            if rank >= self.world:
                continue
            st = self.states[rank]
            bar, label = self.bars[rank], self.labels[rank]
            if _is_number(st.total) and st.total > 0:
                bar.max = int(math.ceil(st.total))
                bar.layout.visibility = "visible"
            if _is_number(st.step):
                bar.value = max(0, min(int(st.step), bar.max))
            text = html.escape(st.where())
            shown = _fmt_metrics(st.latest, skip=("step", "total"))
            if failures is None:
                label.value = f"{text} · {html.escape(shown)}" if shown else text
                continue
            f = failures.get(rank)
            bar.layout.visibility = "visible"
            if f is None:
                bar.value = bar.max
            bar.bar_style = "success" if f is None else "danger"
            state = html.escape(status_line(rank, st, f).split(": ", 1)[1])
            label.value = (f"<span style='color:{_GREEN if f is None else _RED}'>{state}</span>"
                           + (f" · {html.escape(shown)}" if shown else ""))

    def _redraw(self, *, final: bool) -> bytes:
        png = self.figure_png(self.failures) if final else self.live_png()
        self.plot.value = png
        self.plot.layout.display = None
        self._plot_dirty = False
        self.redraws += not final
        return png

    def summary_html(self, failures: dict) -> str:
        rows = []
        for rank in sorted(self.states):
            st = self.states[rank]
            f = failures.get(rank)
            done = f is None
            frac = 1.0 if done else (
                min(1.0, st.step / st.total) if _is_number(st.step) and _is_number(st.total) and st.total > 0
                else 0.0)
            color = _GREEN if done else _RED
            bar = (f"<div style='width:12em;height:0.8em;background:#e0e0e0;display:inline-block'>"
                   f"<div style='width:{100 * frac:.0f}%;height:100%;background:{color}'></div></div>")
            line = html.escape(status_line(rank, st, f).split(": ", 1)[1])
            shown = html.escape(_fmt_metrics(st.latest, skip=("step", "total")))
            rows.append(f"<tr><td>rank {rank}</td><td>{bar}</td>"
                        f"<td style='color:{color}'>{line}</td><td>{shown}</td></tr>")
        return "<table>" + "".join(rows) + "</table>"

    def finish(self, failures: dict) -> None:
        self.failures = dict(failures)
        if self.closed:
            return
        from IPython.display import display  # this display exists only in a Jupyter kernel

        self._refresh(self.failures)
        bad = sorted(r for r, f in self.failures.items() if getattr(f, "kind", "") != "stopped")
        self.header.value = (f"<b>{self.world} rank{'s' if self.world != 1 else ''}</b>: "
                             + (f"<span style='color:{_RED}'>rank(s) {', '.join(map(str, bad))} failed</span>"
                                if bad else ("stopped" if self.failures else "finished")))
        png = self._redraw(final=True) if self.has_curve() else None
        text = "\n".join(self.lines(self.failures))
        if self._handle is not None:
            self._handle.update({"text/plain": text, "text/html": self.summary_html(self.failures)},
                                raw=True)
        else:
            display({"text/plain": text, "text/html": self.summary_html(self.failures)}, raw=True)
        if png is not None:
            _show_png(png)
        self.closed = True
        # Free the models in the kernel; their last state stays readable from Python.
        for wdg in (self.box, self.header, self.plot, *self.rows, *self.names, *self.bars, *self.labels):
            wdg.close()


# --------------------------------------------------------------------------------------------
# Between the launcher's loop and a display
# --------------------------------------------------------------------------------------------


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
    READ_EVERY_S = 0.02

    def __init__(self, display: Any, world: int):
        self._spec = display
        self._world = world
        self._obj: Any = None
        self._pending: dict[int, dict] = {}
        self.spent_s = 0.0  # time spent in the display's update calls
        self._t0 = 0.0
        self._finished = False
        self._read_after: dict[int, float] = {}
        self.coalesced = 0  # reports replaced by a newer one before the display saw them

    def pace_report_read(self, rank: int) -> None:
        """Read a rank's reports in batches, at most every ``READ_EVERY_S`` seconds.

        A worker's write into the pipe wakes the launcher, and on a machine whose cores are all
        training, each wake-up takes a core from a worker for a moment.  Measured on 2 cores with
        chapter 01's training reporting every step: reading each report as it came, a report()
        call took about 30 us (a step about 0.5 ms) and the launcher used about 40 us of CPU per
        report; reading every 20 ms, about 3-12 us and 7 us.  Letting the reports gather costs the
        display nothing it needs (it redraws a few times a second) and holds other output back
        by at most ``READ_EVERY_S``.
        """
        now = time.monotonic()
        wait = self._read_after.get(rank, 0.0) - now
        if wait > 0:
            time.sleep(wait)
            now += wait
        self._read_after[rank] = now + self.READ_EVERY_S

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
            self.finish({r: RankFailure(r, "stopped", message="the launch was interrupted")
                         for r in range(self._world)})
        self._obj = None
