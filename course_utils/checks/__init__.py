"""Exercise checkers, one module per chapter (``ch03.py`` holds chapter 03's).

Import them from here: ``from course_utils.checks import check_ring_allreduce``.  Each chapter
module lists its checkers in ``__all__``; this package finds them by name on first use.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any


def _chapter_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name.startswith("ch"))


def __getattr__(name: str) -> Any:
    for mod_name in _chapter_modules():
        mod = importlib.import_module(f"{__name__}.{mod_name}")
        if name in getattr(mod, "__all__", ()):
            value = getattr(mod, name)
            globals()[name] = value
            return value
    raise AttributeError(f"course_utils.checks has no checker named {name!r}")


def __dir__() -> list[str]:
    names = []
    for mod_name in _chapter_modules():
        names += list(getattr(importlib.import_module(f"{__name__}.{mod_name}"), "__all__", ()))
    return sorted(names)
