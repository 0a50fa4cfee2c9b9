"""``CheckFailed``: the one exception a checker raises for a wrong answer."""

from __future__ import annotations

import os

__all__ = ["CheckFailed"]


class CheckFailed(AssertionError):
    """The learner's answer is wrong; the message says how and what usually causes it.

    In Jupyter a failed check shows its message only, not the checker's own frames (IPython asks an
    exception for ``_render_traceback_``); ``COURSE_TRACEBACKS=full`` in the environment of the
    kernel shows the whole traceback, for whoever debugs a checker.
    """

    @property
    def _render_traceback_(self):  # noqa: ANN202 - IPython's hook: a callable returning lines
        if os.environ.get("COURSE_TRACEBACKS") == "full":
            raise AttributeError("_render_traceback_")  # hasattr() is False: IPython's usual traceback
        return self._message_lines

    def _message_lines(self) -> list[str]:
        return [f"\x1b[1;31mCheckFailed\x1b[0m: {self}"]
