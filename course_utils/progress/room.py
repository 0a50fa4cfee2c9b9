"""The instructor's view: every learner's progress file in one folder, in one table.

``python -m course_utils.progress --room DIR`` prints one row per exercise (how many learners
passed, failed, did not try it) and one per learner.  A learner is a ``*.json`` file in the folder
(``<learner>.json``) or a subfolder holding ``progress.json``; anything else is named, with the
reason, and skipped: nothing a folder holds makes the report fail.  Only regular files are opened
(never a FIFO or a device), none larger than ``MAX_FILE_BYTES``, and a symbolic link is followed
only to a file inside the folder.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from .course import all_exercises, chapter_heading, chapter_of, chapter_titles
from .store import MAX_FILE_BYTES, SCHEMA, Refused, parse, read_bytes, status

__all__ = ["Learner", "Room", "room", "room_table", "MAX_FILE_BYTES"]


@dataclasses.dataclass
class Learner:
    name: str  # the file's "learner" field, else its name without ".json"
    source: str  # the file, relative to the folder
    exercises: dict  # exercise name -> cleaned entry
    note: str = ""  # what was wrong with a partly readable file


@dataclasses.dataclass
class Room:
    folder: str
    learners: list[Learner]
    skipped: list[tuple[str, str]]  # (file, why it is not a progress file)
    exercises: list[str]  # the course's exercises, then any other recorded one


def _printable(text: str, limit: int = 60) -> str:
    """A name from someone else's file, safe to print in a table cell."""
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _read_learner(path: Path, rel: str) -> tuple[Learner | None, str]:
    """(learner, "") for a progress file; (None, why not) for anything else."""
    try:
        raw = read_bytes(path, follow=False)
    except FileNotFoundError as e:
        return None, f"cannot be read ({e.strerror or e})"
    except Refused as e:
        return None, str(e)
    if not raw:
        return None, "empty file"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not text (binary data)"
    try:
        doc = json.loads(text)
    except ValueError as e:
        return None, f"not valid JSON ({e})"
    except RecursionError:
        return None, "not a progress file (JSON nested too deeply to read)"
    if not isinstance(doc, dict) or not isinstance(doc.get("exercises"), dict):
        return None, 'JSON, but not a progress file (no "exercises" table)'
    if doc.get("schema", SCHEMA) != SCHEMA:
        return None, f"progress file of schema {doc.get('schema')!r}; this course reads schema {SCHEMA}"
    data, problem = parse(text)
    name = doc.get("learner")
    if not isinstance(name, str) or not name.strip():
        name = Path(rel).parent.name if Path(rel).name == "progress.json" and "/" in rel else Path(rel).stem
    return Learner(_printable(name.strip()), rel, data["exercises"], problem), ""


def room(folder: Path | str, *, checks_dir: Path | str | None = None) -> Room:
    """Read every learner's progress file in ``folder``; never raises for what the folder holds.

    A learner is a ``*.json`` file directly in the folder, or a subfolder holding ``progress.json``
    (a learner's whole ``progress/`` folder handed in).  Anything else (other files, corrupt or
    foreign JSON, unreadable or empty files, other folders) is listed in ``skipped`` with the reason.
    """
    folder = Path(folder)
    learners: list[Learner] = []
    skipped: list[tuple[str, str]] = []
    try:
        entries = sorted(folder.iterdir(), key=lambda p: p.name)
    except OSError as e:
        return Room(str(folder), [], [(str(folder), f"cannot list the folder ({e.strerror or e})")], [])
    base = os.path.realpath(folder)

    def inside(p: Path) -> Path | None:
        """Where ``p`` leads, with its links resolved, when that is inside the folder."""
        real = os.path.realpath(p)
        return Path(real) if os.path.commonpath([base, real]) == base and real != base else None

    for entry in entries:
        rel = _printable(entry.name, 200)
        target = inside(entry)
        if target is None:
            skipped.append((rel, "a link to outside the folder (not followed)"))
            continue
        try:
            is_dir = target.is_dir()
        except OSError:
            is_dir = False
        if is_dir:
            inner = entry / "progress.json"
            try:
                has_file = os.path.lexists(inner)
            except OSError:
                has_file = False
            if not has_file:
                skipped.append((rel + "/", "a folder without a progress.json"))
                continue
            rel = f"{rel}/progress.json"
            target = inside(inner)
            if target is None:
                skipped.append((rel, "a link to outside the folder (not followed)"))
                continue
        learner, why = _read_learner(target, rel)
        if learner is None:
            skipped.append((rel, why))
        else:
            learners.append(learner)
    # Two files naming the same learner stay two rows, told apart by their file.
    counts: dict[str, int] = {}
    for lr in learners:
        counts[lr.name] = counts.get(lr.name, 0) + 1
    for lr in learners:
        if counts[lr.name] > 1:
            lr.name = f"{lr.name} ({lr.source})"
    learners.sort(key=lambda lr: (lr.name.lower(), lr.source))
    recorded = {n for lr in learners for n in lr.exercises}
    return Room(str(folder), learners, skipped, all_exercises(recorded, checks_dir))


def room_table(folder: Path | str, *, checks_dir: Path | str | None = None) -> str:
    """The room report as text: one row per exercise, one per learner, then the skipped files."""
    r = room(folder, checks_dir=checks_dir)
    n = len(r.learners)
    lines = [f"Room progress: {n} learner{'s' if n != 1 else ''} in {r.folder}"]
    if r.exercises:
        width = max(len("exercise"), *(len(_printable(e)) for e in r.exercises))
        lines.append(f"{'exercise':<{width}}  {'passed':>6}  {'failed':>6}  {'not tried':>9}")
        titles = chapter_titles()
        chapter = None
        for ex in r.exercises:
            if chapter_of(ex) != chapter:
                chapter = chapter_of(ex)
                lines.append(chapter_heading(chapter, titles))
            counts = {"passed": 0, "failed": 0, "not tried": 0}
            for lr in r.learners:
                counts[status(lr.exercises.get(ex))] += 1
            lines.append(f"{_printable(ex):<{width}}  {counts['passed']:>6}  {counts['failed']:>6}  "
                         f"{counts['not tried']:>9}")
    if r.learners:
        width = max(len("learner"), *(len(lr.name) for lr in r.learners))
        lines += ["", f"{'learner':<{width}}  {'passed':>6}  {'failed':>6}  {'not tried':>9}  "
                      f"{'last active':<16}  file"]
        for lr in r.learners:
            st = [status(lr.exercises.get(ex)) for ex in r.exercises]
            last = max((e["last_tried"] for e in lr.exercises.values() if e.get("last_tried")),
                       default="")
            lines.append(f"{lr.name:<{width}}  {st.count('passed'):>6}  {st.count('failed'):>6}  "
                         f"{st.count('not tried'):>9}  {_printable(last.replace('T', ' '))[:16]:<16}  "
                         f"{lr.source}".rstrip())
        for lr in r.learners:
            if lr.note:
                lines.append(f"note: {lr.source} is partly damaged: {lr.note}; its other results are counted")
    if r.skipped:
        lines += ["", f"Skipped, not progress files ({len(r.skipped)}):"]
        lines += [f"  {name}: {why}" for name, why in r.skipped]
    if not r.learners:
        lines.append("No progress files found: collect each learner's progress/progress.json here, "
                     "renamed to <learner>.json.")
    return "\n".join(lines)
