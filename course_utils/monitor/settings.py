"""The monitor's settings, read each time they are used: change them from a notebook.

``course_utils.monitor.SETTINGS.DISPLAY = "text"`` makes the next launch show plain text.
"""

from __future__ import annotations

__all__ = ["Settings", "SETTINGS"]


class Settings:
    """One object holds the settings, so that every module reads their current value."""

    #: "widgets", "text" or "none" to force a display in this kernel; None: ``COURSE_DISPLAY`` or auto.
    DISPLAY: str | None = None
    #: The metric drawn as a curve per rank.
    PLOT_KEY = "loss"
    #: Outside ``launch``: rank 0 prints at most one line every this many seconds.
    LOG_EVERY_S = 5.0
    #: Widget display: the bars and metric lines are refreshed at most this often...
    REFRESH_S = 0.2
    #: ...and the live plot at most this often, less often when drawing is slow (at most 1/11 of
    #: the time goes to drawing: the notebook's process shares the cores with the workers), and not
    #: at all in the first ``PLOT_FIRST_S`` seconds (a short run only gets its final figure).
    PLOT_MIN_INTERVAL_S = 0.5
    PLOT_FIRST_S = 1.0
    #: Points kept per rank for the curve; beyond that every other point is dropped (the shape stays).
    MAX_POINTS = 4000


SETTINGS = Settings()
