"""What the course holds, for the tables: its exercises and the titles of its chapters.

Read from the sources, never imported: listing the course is instant, and a chapter with a syntax
error still lists the others.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path

__all__ = ["PACKAGE", "known_exercises", "all_exercises", "sort_key", "chapter_of", "chapter_titles",
           "chapter_heading"]

PACKAGE = Path(__file__).resolve().parents[1]  # course_utils/

_NAME = re.compile(r"^(?P<chapter>\d+)\.")


def _is_checker(dec: ast.expr) -> bool:
    """``@checker("...")`` or ``@checking.checker("...")`` with the exercise's name as a string."""
    return (isinstance(dec, ast.Call) and bool(dec.args)
            and getattr(dec.func, "id", getattr(dec.func, "attr", None)) == "checker"
            and isinstance(dec.args[0], ast.Constant) and isinstance(dec.args[0].value, str))


def known_exercises(checks_dir: Path | str | None = None) -> list[str]:
    """Every exercise name in the ``@checker("...")`` decorators of the chapters' checkers.

    A chapter is a module ``checks/chNN.py`` or a package ``checks/chNN/`` (one module per exercise).
    """
    folder = Path(checks_dir) if checks_dir is not None else PACKAGE / "checks"
    names: list[str] = []
    for src in sorted([*folder.glob("ch*.py"), *folder.glob("ch*/*.py")]):
        try:
            tree = ast.parse(src.read_text(encoding="utf-8"), filename=str(src))
        except (SyntaxError, OSError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names += [dec.args[0].value for dec in node.decorator_list if _is_checker(dec)]
    return sorted(set(names), key=sort_key)


def all_exercises(recorded: Iterable[str], checks_dir: Path | str | None = None) -> list[str]:
    """The course's exercises and any other name found in the results, in chapter order."""
    return sorted(set(known_exercises(checks_dir)) | set(recorded), key=sort_key)


def chapter_of(name: str) -> str:
    """``"04.b mini DDP"`` -> ``"04"``; ``""`` for a name without a chapter number."""
    m = _NAME.match(name)
    return m.group("chapter") if m else ""


def sort_key(name: str) -> tuple:
    """Chapters in number order (10 after 09), names without a number last."""
    chapter = chapter_of(name)
    return (int(chapter) if chapter else 10**6, name)


def chapter_titles() -> dict[str, str]:
    """``{"01": "01_one_device"...}`` from the lesson and solution notebooks' names."""
    titles: dict[str, str] = {}
    for folder in ("solutions", "notebooks"):
        for nb in sorted((PACKAGE.parent / folder).glob("[0-9][0-9]_*.ipynb")):
            titles.setdefault(nb.stem[:2], nb.stem)
    return titles


def chapter_heading(chapter: str, titles: dict[str, str]) -> str:
    """The line above a chapter's rows in both tables."""
    return f"-- {titles.get(chapter, f'chapter {chapter}' if chapter else 'other')}"
