"""The live display for JupyterLab: a progress bar and a metrics line per rank, and a live plot.

While the workers run: a progress bar, a metrics line per rank and, after the first second, a live
plot (redrawn at most every ``monitor.SETTINGS.PLOT_MIN_INTERVAL_S`` seconds, less often when drawing is
slow, so that the launcher's loop keeps reading the pipes and the workers keep their cores).  At the
end the widgets are replaced, in place, by a static summary (HTML, with the text lines as its
plain-text form) followed by the static final figure, so that a saved notebook shows the result
without a kernel or widget state.  (nbval, which ignores display updates, would see the widget's
output: another reason it gets the text display.)
"""

from __future__ import annotations

import html
import math
import threading
import time

from ..workers.errors import FailureKind
from .displays import Recorder, show_png
from .settings import SETTINGS
from .state import fmt_metrics, is_number, status_line

__all__ = ["WidgetDisplay"]

_GREEN, _RED = "#2e7d32", "#c62828"
BEAT_S = 5.0    # while running, the header is redrawn this often from the kernel
STALE_S = 20.0  # without a redraw for this long, the browser itself shows that the kernel is gone
# A CSS animation that the browser runs by itself: each redraw of the header starts it again, so
# its notice appears only when the kernel stopped redrawing (restarted, stopped or dead), instead
# of the last "running ... s left" staying up as if the launch still ran.
_STALE = ("<style>@keyframes course-stale {{from {{visibility: hidden}} to {{visibility: visible}}}}</style>"
          "<span style='visibility: hidden; color: {red}; animation: course-stale 0.01s {delay:g}s forwards'>"
          " · no news from the kernel for {delay:g} s: if it was restarted or stopped, this launch was "
          "stopped with it</span><!-- {beat} -->")


class WidgetDisplay(Recorder):
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

        self._running = f"<b>{world} rank{'s' if world != 1 else ''}</b>: running"
        self.beats = 0
        self.header = w.HTML(value=self._running + self._stale_notice())
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
        self._next_plot = time.monotonic() + SETTINGS.PLOT_FIRST_S
        self._plot_dirty = False
        self.redraws = 0  # live plot redraws (the final figure not counted)
        self._handle = display(self.box, display_id=True)
        self._stop_beating = threading.Event()
        self._beater = threading.Thread(target=self._beat, name="course-widget-beat", daemon=True)
        self._beater.start()

    def _stale_notice(self) -> str:
        return _STALE.format(red=_RED, delay=STALE_S, beat=self.beats)

    def _beat(self) -> None:
        """Redraw the header every ``BEAT_S`` seconds while the launch runs (see ``_STALE``)."""
        while not self._stop_beating.wait(BEAT_S):
            self.beats += 1
            try:
                self.header.value = self._running + self._stale_notice()
            except Exception:  # the widget was closed meanwhile
                return

    def _stop_beat(self) -> None:
        self._stop_beating.set()
        if self._beater is not threading.current_thread():
            self._beater.join(timeout=BEAT_S)

    def close(self) -> None:
        self._stop_beat()

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
            self._next_refresh = now + SETTINGS.REFRESH_S
        if self._plot_dirty and now >= self._next_plot:
            t = time.monotonic()
            self._redraw(final=False)
            took = time.monotonic() - t
            # at most 1 / PLOT_MIN_INTERVAL_S redraws a second, and drawing takes at most 1/11 of
            # the time: the launching process shares the cores with the workers
            self._next_plot = time.monotonic() + max(SETTINGS.PLOT_MIN_INTERVAL_S, 10 * took)

    def _refresh(self, failures: dict | None = None) -> None:
        ranks = range(self.world) if failures is not None else sorted(self._dirty)
        self._dirty.clear()
        for rank in ranks:
            if rank >= self.world:
                continue
            st = self.states[rank]
            bar, label = self.bars[rank], self.labels[rank]
            if is_number(st.total) and st.total > 0:
                bar.max = int(math.ceil(st.total))
                bar.layout.visibility = "visible"
            if is_number(st.step):
                bar.value = max(0, min(int(st.step), bar.max))
            text = html.escape(st.where())
            shown = fmt_metrics(st.latest, skip=("step", "total"))
            if failures is None:
                pace = st.pace()
                text += f" ({pace})" if pace else ""
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
                min(1.0, st.step / st.total) if is_number(st.step) and is_number(st.total) and st.total > 0
                else 0.0)
            color = _GREEN if done else _RED
            bar = (f"<div style='width:12em;height:0.8em;background:#e0e0e0;display:inline-block'>"
                   f"<div style='width:{100 * frac:.0f}%;height:100%;background:{color}'></div></div>")
            line = html.escape(status_line(rank, st, f).split(": ", 1)[1])
            shown = html.escape(fmt_metrics(st.latest, skip=("step", "total")))
            rows.append(f"<tr><td>rank {rank}</td><td>{bar}</td>"
                        f"<td style='color:{color}'>{line}</td><td>{shown}</td></tr>")
        return "<table>" + "".join(rows) + "</table>"

    def finish(self, failures: dict) -> None:
        self.failures = dict(failures)
        if self.closed:
            return
        from IPython.display import display  # this display exists only in a Jupyter kernel

        self._stop_beat()
        self._refresh(self.failures)
        bad = sorted(r for r, f in self.failures.items() if getattr(f, "kind", "") != FailureKind.STOPPED)
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
            show_png(png)
        self.closed = True
        # Free the models in the kernel; their last state stays readable from Python.
        for wdg in (self.box, self.header, self.plot, *self.rows, *self.names, *self.bars, *self.labels):
            wdg.close()
