"""The learner's progress table: every exercise of the course, passed / failed / not tried.

Every checker (``@checker`` in ``checking.py``) calls ``record(exercise, passed)`` after it runs.
The results live in one small JSON file in the learner's course folder, never on a network:

- ``$COURSE_PROGRESS_FILE`` when set, else
- ``<course folder>/progress/progress.json`` (the folder holding ``course_utils/``; ``/progress/``
  is in ``.gitignore``), or ``./progress/progress.json`` when the package is installed elsewhere.

Show it with ``python -m course_utils.progress`` or ``course_utils.show_progress()`` in a notebook:
one row per exercise of every chapter (found in the ``@checker("NN.x name")`` decorators of
``course_utils/checks/ch*.py``, so exercises not tried yet are listed too).  An exercise counts as
*passed* once any attempt passed (a later failing run, say of the untouched exercise notebook,
does not undo it; the "last" column shows it); *failed* when it was tried and never passed.

Several kernels may run checkers at the same time: each update takes an exclusive lock
(``fcntl.flock`` on ``progress.json.lock``), reads the file, changes it and replaces it atomically
(a temporary file and ``os.replace``), so no update is lost and no reader sees half a file.
A corrupt file is kept aside as ``progress.json.corrupt-<time>`` and rebuilt, with a warning; a
missing folder is created; nothing here ever makes a checker fail.

An instructor collects the learners' files in one folder (a shared drive, or files handed in, each
renamed to ``<learner>.json``) and prints the room's table with
``python -m course_utils.progress --room DIR``: one row per exercise (how many learners passed,
failed, did not try it) and one per learner.  Files that are not progress files are named, with
the reason, and skipped.

``COURSE_PROGRESS=off`` turns recording off.  So does a pytest run that does not set
``COURSE_PROGRESS_FILE``: the course's own tests run checkers on wrong answers on purpose, and
must not fill the learner's table with them.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import datetime as _dt
import errno
import fcntl
import json
import os
import re
import stat
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["record", "load", "progress_file", "known_exercises", "rows", "table", "show",
           "ProgressWarning", "Row", "room", "room_table", "Room", "Learner"]

SCHEMA = 1
LOCK_TIMEOUT_S = 10.0

_PKG = Path(__file__).resolve().parent.parent  # course_utils/


class ProgressWarning(UserWarning):
    """The progress file had to be rebuilt, or a result could not be recorded."""


def _warn(msg: str) -> None:
    warnings.warn(msg, ProgressWarning, stacklevel=3)


# --------------------------------------------------------------------------------------------
# Where the file is
# --------------------------------------------------------------------------------------------


def course_root() -> Path:
    """The learner's course folder: the one holding ``course_utils/`` when it is a checkout."""
    root = _PKG.parent
    if (root / "pyproject.toml").exists() or (root / "notebooks").is_dir():
        return root
    return Path.cwd()


def progress_file() -> Path:
    """The progress file in use (``COURSE_PROGRESS_FILE`` or the course folder's)."""
    env = os.environ.get("COURSE_PROGRESS_FILE")
    if env:
        return Path(env).expanduser()
    return course_root() / "progress" / "progress.json"


def recording_enabled() -> bool:
    """False with ``COURSE_PROGRESS=off``, and in pytest runs without ``COURSE_PROGRESS_FILE``."""
    if os.environ.get("COURSE_PROGRESS", "").strip().lower() in ("0", "off", "no", "false"):
        return False
    if "PYTEST_CURRENT_TEST" in os.environ and not os.environ.get("COURSE_PROGRESS_FILE"):
        return False
    return True


# --------------------------------------------------------------------------------------------
# Reading and writing
# --------------------------------------------------------------------------------------------


def _empty() -> dict:
    return {"schema": SCHEMA, "exercises": {}}


def _now() -> str:
    return _dt.datetime.now().isoformat(timespec="seconds")


_ENTRY_INTS = ("tries", "passes")
_ENTRY_STRS = ("last_result", "first_tried", "last_tried", "first_passed")


def _clean_entry(entry: Any) -> dict | None:
    """A well-formed copy of one exercise's entry, or None when it cannot be read."""
    if not isinstance(entry, dict):
        return None
    out: dict = {}
    for k in _ENTRY_INTS:
        v = entry.get(k, 0)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            return None
        out[k] = v
    for k in _ENTRY_STRS:
        v = entry.get(k)
        if v is not None and not isinstance(v, str):
            return None
        out[k] = v
    if out["passes"] > out["tries"] or out["last_result"] not in (None, "passed", "failed"):
        return None
    return out


def _parse(text: str) -> tuple[dict, str]:
    """(data, problem): problem is "" for a good file, else what is wrong with it."""
    try:
        raw = json.loads(text)
    except ValueError as e:
        return _empty(), f"it is not valid JSON ({e})"
    if not isinstance(raw, dict) or not isinstance(raw.get("exercises"), dict):
        return _empty(), "it does not hold an \"exercises\" table"
    data = _empty()
    bad = []
    for name, entry in raw["exercises"].items():
        clean = _clean_entry(entry)
        if clean is None:
            bad.append(name)
        else:
            data["exercises"][name] = clean
    if bad:
        return data, f"{len(bad)} unreadable entr{'y' if len(bad) == 1 else 'ies'} ({', '.join(bad[:3])})"
    return data, ""


def load(path: Path | str | None = None, *, quiet: bool = False) -> dict:
    """The recorded results (``{"schema": 1, "exercises": {name: entry}}``), never raising.

    A missing file reads as empty; a corrupt one as empty (or its readable entries) with a
    warning.  Only ``record`` rewrites the file.
    """
    path = Path(path) if path is not None else progress_file()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return _empty()
    except (OSError, UnicodeDecodeError) as e:
        if not quiet:
            _warn(f"cannot read the progress file {path} ({e}); showing no results")
        return _empty()
    data, problem = _parse(text)
    if problem and not quiet:
        _warn(f"the progress file {path} is damaged: {problem}. It will be rebuilt the next time "
              "a checker runs.")
    return data


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[bool]:
    """Hold an exclusive lock on ``<path>.lock``; yields False if it could not be had in time."""

    lock_path = path.with_name(path.name + ".lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise
                if time.monotonic() > deadline:
                    yield False
                    return
                time.sleep(0.01)
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes it private; the table is nothing secret
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _read_for_update(path: Path) -> dict:
    """Current data, under the lock; a damaged file is set aside and rebuilt, with a warning."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        # The lock file is created by the first recorded result: if it exists, so did the file.
        if path.with_name(path.name + ".lock").stat().st_size > 0:
            _warn(f"the progress file {path} was missing; starting a new one")
        return _empty()
    except UnicodeDecodeError as e:
        text, problem = "", f"it is not text ({e})"
        data = _empty()
    else:
        data, problem = _parse(text)
    if problem:
        backup = path.with_name(f"{path.name}.corrupt-{_dt.datetime.now():%Y%m%d-%H%M%S}")
        with contextlib.suppress(OSError):
            os.replace(path, backup)
        kept = len(data["exercises"])
        _warn(f"the progress file {path} was damaged: {problem}. It was rebuilt"
              + (f" keeping {kept} readable result(s)" if kept else "")
              + f"; the old file is kept as {backup.name}.")
    return data


def record(exercise: str, passed: bool, *, path: Path | str | None = None) -> None:
    """Add one checker outcome to the progress file.  Never raises: problems become warnings."""
    if path is None:
        if not recording_enabled():
            return
        path = progress_file()
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path) as got_lock:
            if not got_lock:
                _warn(f"the progress file {path} stayed locked for {LOCK_TIMEOUT_S:g} s; "
                      f"the result of {exercise} was not recorded")
                return
            data = _read_for_update(path)
            now = _now()
            entry = data["exercises"].setdefault(exercise, {
                "tries": 0, "passes": 0, "last_result": None, "first_tried": now,
                "last_tried": None, "first_passed": None})
            entry["tries"] += 1
            entry["last_tried"] = now
            entry["last_result"] = "passed" if passed else "failed"
            if passed:
                entry["passes"] += 1
                entry["first_passed"] = entry.get("first_passed") or now
            _atomic_write(path, data)
            # mark the lock file: a progress file existed here (see _read_for_update)
            lock = path.with_name(path.name + ".lock")
            if lock.stat().st_size == 0:
                lock.write_text("progress.json lock\n")
    except OSError as e:
        _warn(f"could not record the result of {exercise} in {path}: {e}")


# --------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------

_NAME = re.compile(r"^(?P<chapter>\d+)\.")


def known_exercises(checks_dir: Path | str | None = None) -> list[str]:
    """Every exercise name in the ``@checker("...")`` decorators of ``checks/ch*.py``.

    The sources are parsed, not imported: listing the course is instant and a chapter with a
    syntax error still lists the others.
    """
    folder = Path(checks_dir) if checks_dir is not None else _PKG / "checks"
    names: list[str] = []
    for src in sorted(folder.glob("ch*.py")):
        try:
            tree = ast.parse(src.read_text(encoding="utf-8"), filename=str(src))
        except (SyntaxError, OSError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for dec in node.decorator_list:
                if (isinstance(dec, ast.Call) and dec.args
                        and getattr(dec.func, "id", getattr(dec.func, "attr", None)) == "checker"
                        and isinstance(dec.args[0], ast.Constant)
                        and isinstance(dec.args[0].value, str)):
                    names.append(dec.args[0].value)
    return sorted(set(names), key=_sort_key)


def _sort_key(name: str) -> tuple:
    m = _NAME.match(name)
    return (int(m.group("chapter")) if m else 10**6, name)


def _chapter_titles() -> dict[str, str]:
    """``{"01": "01_one_device"...}`` from the lesson and solution notebooks' names."""
    titles: dict[str, str] = {}
    root = _PKG.parent
    for folder in ("solutions", "notebooks"):
        for nb in sorted((root / folder).glob("[0-9][0-9]_*.ipynb")):
            titles.setdefault(nb.stem[:2], nb.stem)
    return titles


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
    names = known_exercises(checks_dir)
    names += sorted((n for n in data if n not in set(names)), key=_sort_key)
    out = []
    for name in sorted(names, key=_sort_key):
        m = _NAME.match(name)
        e = data.get(name)
        if e is None or not e["tries"]:
            out.append(Row(m.group("chapter") if m else "", name, "not tried", 0, None, None))
        else:
            out.append(Row(m.group("chapter") if m else "", name,
                           "passed" if e["passes"] else "failed", e["tries"], e["last_result"],
                           e["last_tried"]))
    return out


def table(path: Path | str | None = None, *, checks_dir: Path | str | None = None,
          quiet: bool = False) -> str:
    """The progress table as text (what ``show`` prints)."""
    path = Path(path) if path is not None else progress_file()
    rs = rows(path, checks_dir=checks_dir, quiet=quiet)
    titles = _chapter_titles()
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
            lines.append(f"-- {titles.get(chapter, f'chapter {chapter}' if chapter else 'other')}")
        when = r.last_tried.replace("T", " ")[:16] if r.last_tried else ""
        lines.append(f"{r.exercise:<{width}}  {r.status:<9}  {r.tries or '':>5}  "
                     f"{r.last_result or '':<6}  {when}".rstrip())
    n = {s: sum(r.status == s for r in rs) for s in ("passed", "failed", "not tried")}
    lines.append(f"{n['passed']} of {len(rs)} passed, {n['failed']} failed, {n['not tried']} not tried")
    return "\n".join(lines)


def show(path: Path | str | None = None, *, checks_dir: Path | str | None = None) -> None:
    """Print the table of chapters and exercises: passed / failed / not tried."""
    print(table(path, checks_dir=checks_dir))


# --------------------------------------------------------------------------------------------
# The room: every learner's file in one folder
# --------------------------------------------------------------------------------------------

MAX_FILE_BYTES = 5 * 2**20  # a progress file is a few KiB; anything this large is something else


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
        st = path.stat()
    except OSError as e:
        return None, f"cannot be read ({e.strerror or e})"
    if not stat.S_ISREG(st.st_mode):
        return None, "not a regular file"
    if st.st_size == 0:
        return None, "empty file"
    if st.st_size > MAX_FILE_BYTES:
        return None, f"too large for a progress file ({st.st_size / 2**20:.0f} MiB)"
    try:
        raw = path.read_bytes()
    except OSError as e:
        return None, f"cannot be read ({e.strerror or e})"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not text (binary data)"
    try:
        doc = json.loads(text)
    except ValueError as e:
        return None, f"not valid JSON ({e})"
    if not isinstance(doc, dict) or not isinstance(doc.get("exercises"), dict):
        return None, 'JSON, but not a progress file (no "exercises" table)'
    if doc.get("schema", SCHEMA) != SCHEMA:
        return None, f"progress file of schema {doc.get('schema')!r}; this course reads schema {SCHEMA}"
    data, problem = _parse(text)
    name = doc.get("learner")
    if not isinstance(name, str) or not name.strip():
        name = Path(rel).parent.name if path.name == "progress.json" and "/" in rel else path.stem
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
    for entry in entries:
        rel = _printable(entry.name, 200)
        try:
            is_dir = entry.is_dir()
        except OSError:
            is_dir = False
        if is_dir:
            inner = entry / "progress.json"
            try:
                has_file = inner.exists()
            except OSError:
                has_file = False
            if not has_file:
                skipped.append((rel + "/", "a folder without a progress.json"))
                continue
            entry, rel = inner, f"{rel}/progress.json"
        learner, why = _read_learner(entry, rel)
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
    names = known_exercises(checks_dir)
    seen = set(names)
    extra = {n for lr in learners for n in lr.exercises if n not in seen}
    names += sorted(extra, key=_sort_key)
    return Room(str(folder), learners, skipped, sorted(names, key=_sort_key))


def _status(entry: dict | None) -> str:
    if entry is None or not entry["tries"]:
        return "not tried"
    return "passed" if entry["passes"] else "failed"


def room_table(folder: Path | str, *, checks_dir: Path | str | None = None) -> str:
    """The room report as text: one row per exercise, one per learner, then the skipped files."""
    r = room(folder, checks_dir=checks_dir)
    n = len(r.learners)
    lines = [f"Room progress: {n} learner{'s' if n != 1 else ''} in {r.folder}"]
    if r.exercises:
        width = max(len("exercise"), *(len(_printable(e)) for e in r.exercises))
        lines.append(f"{'exercise':<{width}}  {'passed':>6}  {'failed':>6}  {'not tried':>9}")
        titles = _chapter_titles()
        chapter = None
        for ex in r.exercises:
            m = _NAME.match(ex)
            ch = m.group("chapter") if m else ""
            if ch != chapter:
                chapter = ch
                lines.append(f"-- {titles.get(ch, f'chapter {ch}' if ch else 'other')}")
            counts = {"passed": 0, "failed": 0, "not tried": 0}
            for lr in r.learners:
                counts[_status(lr.exercises.get(ex))] += 1
            lines.append(f"{_printable(ex):<{width}}  {counts['passed']:>6}  {counts['failed']:>6}  "
                         f"{counts['not tried']:>9}")
    if r.learners:
        width = max(len("learner"), *(len(lr.name) for lr in r.learners))
        lines += ["", f"{'learner':<{width}}  {'passed':>6}  {'failed':>6}  {'not tried':>9}  "
                      f"{'last active':<16}  file"]
        for lr in r.learners:
            st = [_status(lr.exercises.get(ex)) for ex in r.exercises]
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course_utils.progress",
        description="Show which course exercises you passed, failed or have not tried yet.")
    parser.add_argument("--file", help="progress file to read (default: $COURSE_PROGRESS_FILE "
                        "or <course>/progress/progress.json)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--room", metavar="DIR",
                        help="instead: one table for a whole room, from every learner's progress file "
                        "collected in DIR (<learner>.json, or <learner>/progress.json)")
    args = parser.parse_args(argv)
    if args.room:
        if args.json:
            json.dump(dataclasses.asdict(room(args.room)), sys.stdout, indent=1)
            print()
        else:
            print(room_table(args.room))
        return 0 if Path(args.room).is_dir() else 2
    if args.json:
        json.dump([dataclasses.asdict(r) for r in rows(args.file)], sys.stdout, indent=1)
        print()
    else:
        show(args.file)
    return 0
