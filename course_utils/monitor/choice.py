"""Which display a launch gets: ``display_mode()`` and ``make_display()``.

There is no reliable way for a kernel to know whether a browser is looking at it: nbval, nbconvert
and JupyterLab all run the same IPython kernel with ipywidgets importable.  The rule used here:

1. ``SETTINGS.DISPLAY`` (set it in a notebook: ``course_utils.monitor.SETTINGS.DISPLAY = "text"``), else
2. the environment variable ``COURSE_DISPLAY`` (``widgets``, ``text`` or ``none``), else
3. ``widgets`` when this is an IPython kernel with ipywidgets *and* a Jupyter server started it
   (JupyterLab and Notebook 7 put ``JPY_SESSION_NAME`` in the kernel's environment; nbval,
   nbconvert and nbclient do not) and no pytest run is in progress; ``text`` otherwise.

In another front end that shows widgets (VS Code, say) set ``COURSE_DISPLAY=widgets``.
"""

from __future__ import annotations

import os
from typing import Any

from .displays import NullDisplay, TextDisplay, has_ipywidgets, in_kernel
from .settings import SETTINGS
from .widget import WidgetDisplay

__all__ = ["display_mode", "make_display"]

_MODES = ("widgets", "text", "none")


def display_mode() -> str:
    """``"widgets"``, ``"text"`` or ``"none"``: what ``launch`` shows (rules in the module doc)."""
    chosen = (("monitor.SETTINGS.DISPLAY", SETTINGS.DISPLAY),
              ("COURSE_DISPLAY", os.environ.get("COURSE_DISPLAY")))
    for source, value in chosen:
        if value:
            value = value.strip().lower()
            if value == "auto":
                break
            if value not in _MODES:
                raise ValueError(f"{source} must be one of {', '.join(_MODES)} or auto, not {value!r}")
            if value == "widgets" and not (has_ipywidgets() and in_kernel()):
                return "text"  # no widgets outside a kernel (a terminal): the text display
            return value
    if (in_kernel() and has_ipywidgets() and "JPY_SESSION_NAME" in os.environ
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
