"""``CheckFailed``: the one exception a checker raises for a wrong answer."""

from __future__ import annotations

__all__ = ["CheckFailed"]


class CheckFailed(AssertionError):
    """The learner's answer is wrong; the message says how and what usually causes it."""
