"""Progress reports from workers, and the display that shows them in the notebook.

Worker code calls ``report(step=..., loss=..., total=...)``; inside ``course_utils.launch`` the cell
shows one progress bar per rank with its latest metrics and a live loss curve per rank (in
JupyterLab), or one line per rank and a figure at the end (nbval, nbconvert, a terminal).  Inside
``with monitor.live():`` reports made in the notebook's own process go to the same display;
anywhere else (plain ``python``, ``torchrun``) rank 0 prints a log line now and then.

One module per job:

- ``reporting``  the worker side: ``report()``, and ``live()`` for training in this process
- ``state``      one rank's reports reduced to what a display needs (``RankState``, ``status_line``)
- ``displays``   ``Recorder`` (what every display records, and its figures), ``NullDisplay``, ``TextDisplay``
- ``widget``     ``WidgetDisplay``, the live display for JupyterLab
- ``choice``     which display a launch gets: ``display_mode()``, ``make_display()``
- ``guard``      the launcher side: ``DisplayGuard`` creates the display on the first report, paces
                 it and shields the launch from it; ``display_factory`` is what ``launch`` passes on
- ``settings``   ``DISPLAY``, ``PLOT_KEY`` and the timings, in ``SETTINGS``
                 (``course_utils.monitor.SETTINGS.DISPLAY = "text"`` in a notebook)

The workers' launcher (``course_utils.workers``) knows nothing of these: ``course_utils.launch``
hands it ``display_factory(display)``.
"""

from __future__ import annotations

from .choice import display_mode, make_display
from .displays import NullDisplay, Recorder, TextDisplay
from .guard import DisplayGuard, display_factory
from .reporting import live, report
from .settings import SETTINGS, Settings
from .state import RankState, status_line
from .widget import WidgetDisplay

__all__ = [
    "report",
    "make_display",
    "DisplayGuard",
    "display_mode",
    "live",
    "TextDisplay",
    "WidgetDisplay",
    "NullDisplay",
    "display_factory",
    "Recorder",
    "RankState",
    "status_line",
    "SETTINGS",
    "Settings",
]
