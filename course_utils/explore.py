"""Plots shared by several chapters, and ``explore``: a widget-driven measurement.

Chapter-specific plots live in their notebooks, where the learner can read and change them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .monitor import display_mode

__all__ = ["explore", "has_widget_frontend"]


def has_widget_frontend() -> bool:
    """True where the live display uses widgets (a kernel started by JupyterLab or Notebook).

    One rule for the whole course, ``course_utils.monitor.display_mode``: nbval, nbconvert and
    terminals get plain output, and ``COURSE_DISPLAY=text`` forces it anywhere.
    """
    return display_mode() == "widgets"


def explore(run: Callable[..., Any], *, title: str = "", **controls: Any) -> Any:
    """Let the learner change parameters with widgets and re-run a real measurement.

    ``controls`` maps each keyword of ``run`` to its choices: a list (a dropdown) or an
    ``ipywidgets`` widget; the first choice (or the widget's value) is the default.  ``run`` is
    called once immediately with the defaults, so the cell shows a result headless too (nbval,
    nbconvert); in JupyterLab a "Run" button re-runs it with the chosen values and shows the new
    result under the controls.  Returns the result of the first run.
    """
    defaults = {}
    for name, spec in controls.items():
        if isinstance(spec, (list, tuple)):
            if not spec:
                raise ValueError(f"explore(): no choices for {name!r}")
            defaults[name] = spec[0]
        else:
            defaults[name] = spec.value
    if not has_widget_frontend():
        return run(**defaults)

    # Widgets exist only in a Jupyter kernel; the course runs headless without them.
    import ipywidgets as w
    from IPython.display import display

    inputs = {}
    for name, spec in controls.items():
        if isinstance(spec, (list, tuple)):
            inputs[name] = w.Dropdown(options=list(spec), value=spec[0], description=name)
        else:
            inputs[name] = spec
    button = w.Button(description="Run", button_style="primary", icon="play")
    out = w.Output()
    header = [w.HTML(f"<b>{title}</b>")] if title else []
    display(w.VBox(header + [w.HBox(list(inputs.values()) + [button]), out]))

    def _go(_: Any = None) -> Any:
        button.disabled = True
        try:
            out.clear_output(wait=True)
            with out:
                return run(**{k: v.value for k, v in inputs.items()})
        finally:
            button.disabled = False

    button.on_click(_go)
    # The first run prints straight into the cell, so that a saved or headless notebook shows it;
    # the runs started with the button appear in the output area under the controls.
    return run(**defaults)
