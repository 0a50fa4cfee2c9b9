"""The learner's table: one row per exercise of the course, passed / failed / not tried (``show()``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .course import all_exercises, chapter_heading, chapter_of, chapter_titles
from .store import load, progress_file, status

__all__ = ["Row", "rows", "table", "show"]


@dataclasses.dataclass
class Row:
    chapter: str  # "01", or "" when the name has no chapter number
    exercise: str
    status: str  # "passed", "failed" or "not tried"
    tries: int
    last_result: str | None
    last_tried: str | None


def rows(path: Path | str | None = None, *, checks_dir: Path | str | None = None,
         quiet: bool = False) -> list[Row]:
    """One row per exercise: the course's (discovered) and any other recorded one."""
    data = load(path, quiet=quiet)["exercises"]
    out = []
    for name in all_exercises(data, checks_dir):
        e = data.get(name)
        st = status(e)
        if st == "not tried":
            out.append(Row(chapter_of(name), name, st, 0, None, None))
        else:
            out.append(Row(chapter_of(name), name, st, e["tries"], e["last_result"], e["last_tried"]))
    return out


def table(path: Path | str | None = None, *, checks_dir: Path | str | None = None,
          quiet: bool = False) -> str:
    """The progress table as text (what ``show`` prints)."""
    path = Path(path) if path is not None else progress_file()
    rs = rows(path, checks_dir=checks_dir, quiet=quiet)
    titles = chapter_titles()
    lines = [f"Course progress ({path})"]
    if not path.exists():
        lines.append("No results recorded yet: the file is created when you first run a checker.")
    if not rs:
        lines.append("No exercises found in course_utils/checks/.")
        return "\n".join(lines)
    width = max(len("exercise"), *(len(r.exercise) for r in rs))
    lines.append(f"{'exercise':<{width}}  {'status':<9}  {'tries':>5}  {'last':<6}  last tried")
    chapter = None
    for r in rs:
        if r.chapter != chapter:
            chapter = r.chapter
            lines.append(chapter_heading(chapter, titles))
        when = r.last_tried.replace("T", " ")[:16] if r.last_tried else ""
        lines.append(f"{r.exercise:<{width}}  {r.status:<9}  {r.tries or '':>5}  "
                     f"{r.last_result or '':<6}  {when}".rstrip())
    n = {s: sum(r.status == s for r in rs) for s in ("passed", "failed", "not tried")}
    lines.append(f"{n['passed']} of {len(rs)} passed, {n['failed']} failed, {n['not tried']} not tried")
    return "\n".join(lines)


def show(path: Path | str | None = None, *, checks_dir: Path | str | None = None) -> None:
    """Print the table of chapters and exercises: passed / failed / not tried."""
    print(table(path, checks_dir=checks_dir))
