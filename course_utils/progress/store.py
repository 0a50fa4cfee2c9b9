"""The learner's progress file: where it is, reading it, and adding one checker outcome to it.

The file is ``{"schema": 1, "exercises": {name: entry}}``, one entry per exercise tried (tries,
passes, the last result, when it was first tried, last tried and first passed).  Every update
takes an exclusive lock (``fcntl.flock`` on the folder holding the file, which nothing can delete
while the file is in it; a lock file deleted or replaced meanwhile let two writers in at once),
reads the file, changes it and replaces it atomically (a temporary file and ``os.replace``):
several kernels may record at the same time, no update is lost and no reader sees half a file.
A damaged file (not JSON, not text, nested too deeply, larger than ``MAX_FILE_BYTES``) is set aside
and rebuilt; something that is not
a regular file (a FIFO, a folder, a device) is never opened, only named in a warning; nothing
here ever raises into a checker.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import json
import os
import stat
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .course import PACKAGE

__all__ = ["SCHEMA", "LOCK_TIMEOUT_S", "MAX_FILE_BYTES", "ProgressWarning", "Refused", "course_root",
           "progress_file", "recording_enabled", "empty", "parse", "read_bytes", "load", "record", "status"]

SCHEMA = 1
LOCK_TIMEOUT_S = 10.0
MAX_FILE_BYTES = 5 * 2**20  # a progress file is a few KiB; anything this large is something else


class ProgressWarning(UserWarning):
    """The progress file had to be rebuilt, or a result could not be recorded."""


def _warn(msg: str) -> None:
    """One line, ``<course_utils.progress>:0: ProgressWarning: <msg>``: no source line under it."""
    warnings.warn_explicit(msg, ProgressWarning, "<course_utils.progress>", 0)


# --------------------------------------------------------------------------------------------
# Where the file is
# --------------------------------------------------------------------------------------------


def course_root() -> Path:
    """The learner's course folder: the one holding ``course_utils/`` when it is a checkout."""
    root = PACKAGE.parent
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


def empty() -> dict:
    """A progress file with no results."""
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


def parse(text: str) -> tuple[dict, str]:
    """(data, problem): problem is "" for a good file, else what is wrong with it.

    The readable entries are kept either way (a damaged file still counts what it can)."""
    try:
        raw = json.loads(text)
    except ValueError as e:
        return empty(), f"it is not valid JSON ({e})"
    except RecursionError:
        return empty(), "it is not a progress file (its JSON is nested too deeply to read)"
    if not isinstance(raw, dict) or not isinstance(raw.get("exercises"), dict):
        return empty(), "it does not hold an \"exercises\" table"
    data = empty()
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


class Refused(Exception):
    """A file that is not read: ``str()`` says why; ``damaged`` when it may be set aside and rebuilt."""

    def __init__(self, why: str, damaged: bool = False):
        super().__init__(why)
        self.damaged = damaged


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISLNK, "a symbolic link"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"))


def _check_regular(st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "something else")
        raise Refused(f"not a regular file ({kind})")
    if st.st_size > MAX_FILE_BYTES:
        raise Refused(f"too large for a progress file ({st.st_size / 2**20:.0f} MiB; the limit is "
                      f"{MAX_FILE_BYTES / 2**20:.0f} MiB)", damaged=True)


def read_bytes(path: Path | str, *, follow: bool = True) -> bytes:
    """The content of a regular file of at most ``MAX_FILE_BYTES``; ``Refused`` for anything else.

    Nothing but a regular file is opened (so a FIFO or a device never blocks the reader), the open
    itself does not block (``O_NONBLOCK``), and with ``follow=False`` a symbolic link is refused
    (``O_NOFOLLOW``).  A missing file raises ``FileNotFoundError``.
    """
    try:
        _check_regular(os.stat(path) if follow else os.lstat(path))
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
        fd = os.open(path, flags)
    except (FileNotFoundError, Refused):
        raise
    except OSError as e:
        raise Refused(f"cannot be read ({e.strerror or e})") from None
    try:
        _check_regular(os.fstat(fd))  # the file opened is the one checked
        chunks, size = [], 0
        while size <= MAX_FILE_BYTES:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            size += len(chunk)
        raise Refused(f"too large for a progress file (over {MAX_FILE_BYTES / 2**20:.0f} MiB)",
                      damaged=True)
    except OSError as e:
        raise Refused(f"cannot be read ({e.strerror or e})") from None
    finally:
        os.close(fd)


def _read_text(path: Path) -> tuple[dict, str]:
    """(data, problem) for a file that exists and can be read; ``Refused``/``FileNotFoundError`` else."""
    try:
        return parse(read_bytes(path).decode("utf-8"))
    except UnicodeDecodeError as e:
        return empty(), f"it is not text ({e})"


def load(path: Path | str | None = None, *, quiet: bool = False) -> dict:
    """The recorded results (``{"schema": 1, "exercises": {name: entry}}``), never raising.

    A missing file reads as empty; a corrupt one as empty (or its readable entries) with a
    warning, as does anything that is not a regular file (which is never opened).  Only
    ``record`` rewrites the file.
    """
    path = Path(path) if path is not None else progress_file()
    try:
        data, problem = _read_text(path)
    except FileNotFoundError:
        return empty()
    except Refused as e:
        if not quiet:
            todo = ("it will be set aside and rebuilt the next time a checker runs" if e.damaged
                    else "rename or remove it, so that the next checker can start a new one")
            _warn(f"the progress file {path} is {e}; showing no results: {todo}.")
        return empty()
    if problem and not quiet:
        _warn(f"the progress file {path} is damaged: {problem}. It will be rebuilt the next time "
              "a checker runs.")
    return data


def _marker(path: Path) -> Path:
    """``progress.json.lock``: written once a result was recorded here, so that a progress file
    that later goes missing is reported as such (the name is older than the folder lock)."""
    return path.with_name(path.name + ".lock")


def _lock_fd(path: Path) -> int:
    """What to lock: the folder holding the file (a folder cannot be deleted while it holds it, so
    every writer locks the same thing, whatever else deletes or replaces); where a folder cannot be
    locked (some network file systems), the marker file, which is then checked after each lock."""
    return os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise
        return False


def _lock_marker(path: Path, deadline: float) -> int | None:
    """The fallback: flock the marker file, and keep the lock only if the marker still is the file
    locked (one deleted or replaced meanwhile would let two writers in at once)."""
    marker = _marker(path)
    while True:
        fd = os.open(marker, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, f"its marker {marker.name} is not a regular file")
            if _try_lock(fd):
                with contextlib.suppress(FileNotFoundError):
                    if os.stat(marker).st_ino == os.fstat(fd).st_ino:
                        return fd
                continue  # finally closes it, which also unlocks it
            if time.monotonic() > deadline:
                return None
            time.sleep(0.01)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _lock_folder(path: Path, deadline: float) -> int | None:
    """flock the folder holding ``path``: its fd, or None when the time ran out; OSError where the
    folder cannot be locked (some network file systems; a folder that cannot be read)."""
    fd = _lock_fd(path)
    try:
        while not _try_lock(fd):
            if time.monotonic() > deadline:
                os.close(fd)
                return None
            time.sleep(0.01)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[bool]:
    """Hold an exclusive lock for ``path``'s updates; yields False if it could not be had in time."""
    deadline = time.monotonic() + LOCK_TIMEOUT_S
    try:
        fd = _lock_folder(path, deadline)
    except OSError:
        fd = _lock_marker(path, deadline)
    if fd is None:
        yield False
        return
    try:
        yield True
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _marked(path: Path) -> bool:
    try:
        st = os.lstat(_marker(path))
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size > 0


def _mark(path: Path) -> None:
    """Write the marker once (see ``_marker``); whatever happens to it, the result is recorded."""
    with contextlib.suppress(OSError):
        fd = os.open(_marker(path), os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW,
                     0o644)
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_size == 0:
                os.write(fd, b"progress.json lock\n")
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


def _backup_name(path: Path) -> Path:
    """``progress.json.corrupt-<time>``, with a number added when that name is taken."""
    stem = f"{path.name}.corrupt-{_dt.datetime.now():%Y%m%d-%H%M%S}"
    backup, n = path.with_name(stem), 1
    while os.path.lexists(backup):
        n += 1
        backup = path.with_name(f"{stem}-{n}")
    return backup


def _read_for_update(path: Path, exercise: str) -> dict | None:
    """Current data, under the lock; a damaged file is set aside and rebuilt, with a warning.

    None (after a warning) when the result must not be recorded: the path holds something that is
    not a regular file, or a file that cannot be read or set aside."""
    try:
        data, problem = _read_text(path)
    except FileNotFoundError:
        # The marker is written by the first recorded result: if it exists, so did the file.
        if _marked(path):
            _warn(f"the progress file {path} was missing; starting a new one")
        return empty()
    except Refused as e:
        if not e.damaged:
            _warn(f"the progress file {path} is {e}: the result of {exercise} was not recorded; "
                  "rename or remove it, so that a new one can be started.")
            return None
        data, problem = empty(), f"it is {e}"
    if problem:
        backup = _backup_name(path)
        try:
            os.rename(path, backup)
        except OSError as e:
            _warn(f"the progress file {path} is damaged: {problem}; it could not be set aside "
                  f"({e.strerror or e}), so the result of {exercise} was not recorded.")
            return None
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
            data = _read_for_update(path, exercise)
            if data is None:
                return
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
        _mark(path)
    except OSError as e:
        _warn(f"could not record the result of {exercise} in {path}: {e}")
    except Exception as e:  # a checker's result never fails, nor vanishes without a word
        _warn(f"could not record the result of {exercise} in {path}: {type(e).__name__}: {e}")


def status(entry: dict | None) -> str:
    """``"passed"`` once any try passed, ``"failed"`` when tried and never passed, else ``"not tried"``."""
    if entry is None or not entry["tries"]:
        return "not tried"
    return "passed" if entry["passes"] else "failed"
