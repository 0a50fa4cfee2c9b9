"""Test models and data that more than one chapter's checkers use, written once.

Chapter-specific models stay in their chapter's module; a model moves here when a second chapter
needs it.
"""

from __future__ import annotations

__all__: list[str] = []
