"""The learner's progress file against any content and any file type.

Each case puts something hostile where the progress file should be: JSON nested 200,000 deep,
binary data, a 50 MB file, a FIFO, a folder, a link to a FIFO, a file nobody may read.  A checker
still prints its result, with one warning line at most; the table still prints; a damaged file is
kept aside (never lost) and a new one started; something that is not a regular file is never
opened, and left as it was.
"""

from __future__ import annotations

import importlib
import json
import os
import stat
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from course_utils.checking import CheckFailed, checker

progress = importlib.import_module("course_utils.progress")

ROOT = Path(__file__).resolve().parents[2]
HUGE = 50 * 2**20


def _deep(p: Path) -> None:
    p.write_text("[" * 200_000)


def _binary(p: Path) -> None:
    p.write_bytes(bytes(range(255, -1, -1)) * 64)


def _huge(p: Path) -> None:
    with open(p, "wb") as f:  # sparse: 50 MB long, no disk used
        f.truncate(HUGE)


def _fifo(p: Path) -> None:
    os.mkfifo(p)  # opening it for reading would wait for a writer forever


def _folder(p: Path) -> None:
    p.mkdir()
    (p / "keep.txt").write_text("a learner's notes\n")


def _link_to_fifo(p: Path) -> None:
    os.mkfifo(p.with_name("elsewhere.fifo"))
    p.symlink_to(p.with_name("elsewhere.fifo"))


def _unreadable(p: Path) -> None:
    p.write_text(json.dumps({"schema": 1, "exercises": {}}))
    p.chmod(0)


DAMAGED = {"deep": _deep, "binary": _binary, "huge": _huge}  # set aside, a new file started
NOT_FILES = {"fifo": _fifo, "folder": _folder, "link to a fifo": _link_to_fifo,
             "unreadable": _unreadable}  # never opened, left alone, the result not recorded
ALL = {**DAMAGED, **NOT_FILES}


@pytest.fixture
def pfile(tmp_path, monkeypatch):
    path = tmp_path / "course" / "progress" / "progress.json"
    path.parent.mkdir(parents=True)
    monkeypatch.setenv("COURSE_PROGRESS_FILE", str(path))
    monkeypatch.delenv("COURSE_PROGRESS", raising=False)
    return path


def _make(kind: str, path: Path) -> None:
    if kind == "unreadable" and os.geteuid() == 0:
        pytest.skip("runs as root, whom file permissions do not stop")
    ALL[kind](path)


def _run_checker(passes: bool) -> list[warnings.WarningMessage]:
    @checker("01.a training step")
    def check(ok):
        if not ok:
            raise CheckFailed("expected ok")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if passes:
            check(True)
        else:
            with pytest.raises(CheckFailed, match="expected ok"):
                check(False)
    return [w for w in caught if issubclass(w.category, progress.ProgressWarning)]


def _snapshot(path: Path):
    st = os.lstat(path)
    inside = sorted(p.name for p in path.iterdir()) if stat.S_ISDIR(st.st_mode) else None
    return stat.S_IFMT(st.st_mode), st.st_size, inside


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", list(DAMAGED))
def test_a_damaged_file_is_set_aside_and_a_new_one_started(pfile, kind, capsys):
    _make(kind, pfile)
    original = pfile.stat().st_size
    head = pfile.read_bytes()[:4096]
    caught = _run_checker(passes=True)
    assert "[PASS] 01.a training step" in capsys.readouterr().out
    assert len(caught) == 1, [str(w.message) for w in caught]
    msg = str(caught[0].message)
    assert str(pfile) in msg and "damaged" in msg and "kept as progress.json.corrupt-" in msg
    backups = list(pfile.parent.glob("progress.json.corrupt-*"))
    assert len(backups) == 1 and backups[0].name in msg
    assert backups[0].stat().st_size == original and backups[0].read_bytes()[:4096] == head
    data = json.loads(pfile.read_text())["exercises"]
    assert data["01.a training step"]["passes"] == 1
    # the warning comes once: the next checker finds a good file
    assert _run_checker(passes=False) == []
    assert json.loads(pfile.read_text())["exercises"]["01.a training step"]["tries"] == 2


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", list(NOT_FILES))
def test_what_is_not_a_regular_file_is_never_opened_and_left_alone(pfile, kind, capsys):
    _make(kind, pfile)
    before = _snapshot(pfile)
    for passes in (True, False):
        caught = _run_checker(passes)
        assert len(caught) == 1, [str(w.message) for w in caught]
        msg = str(caught[0].message)
        assert str(pfile) in msg and "not recorded" in msg and "rename or remove it" in msg
    assert "[PASS] 01.a training step" in capsys.readouterr().out
    assert _snapshot(pfile) == before
    assert not list(pfile.parent.glob("progress.json.corrupt-*"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert progress.load()["exercises"] == {}
    assert len(caught) == 1 and str(pfile) in str(caught[0].message)


def _one_warning_and_the_table(pfile: Path, out: str, err: str) -> None:
    assert out.startswith(f"Course progress ({pfile})") and "01.a training step" in out
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"warning: the progress file {pfile} is "), err
    assert "rebuilt the next time a checker runs" in lines[0] or "rename or remove it" in lines[0]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", list(ALL))
def test_the_command_line_warns_in_one_line_and_prints_the_table(pfile, kind, capsys):
    _make(kind, pfile)
    assert progress.main([]) == 0
    out, err = capsys.readouterr()
    _one_warning_and_the_table(pfile, out, err)


@pytest.mark.parametrize("kind", ["deep", "fifo"])
def test_python_m_course_utils_progress(pfile, kind):
    _make(kind, pfile)
    p = subprocess.run([sys.executable, "-m", "course_utils.progress"], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    _one_warning_and_the_table(pfile, p.stdout, p.stderr)


CHECK_IN_A_KERNEL = textwrap.dedent('''
    from course_utils.checking import checker
    checker("01.a training step")(lambda: None)()
''')


@pytest.mark.parametrize("kind", ["fifo", "deep"])
def test_a_checker_in_a_fresh_process_neither_hangs_nor_stays_silent(pfile, kind):
    _make(kind, pfile)
    p = subprocess.run([sys.executable, "-c", CHECK_IN_A_KERNEL], capture_output=True, text=True,
                       timeout=60, cwd=ROOT, env=dict(os.environ, COURSE_PROGRESS_FILE=str(pfile)))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[PASS] 01.a training step"
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and "ProgressWarning" in lines[0] and str(pfile) in lines[0], p.stderr


@pytest.mark.timeout(20)
def test_a_fifo_where_the_old_lock_file_was_neither_hangs_nor_stops_a_record(pfile, capsys):
    os.mkfifo(str(pfile) + ".lock")  # writers lock the folder; the marker is never opened if not a file
    caught = _run_checker(passes=True)
    assert "[PASS]" in capsys.readouterr().out
    assert not caught, [str(w.message) for w in caught]
    assert json.loads(pfile.read_text())["exercises"]["01.a training step"]["passes"] == 1


WRITER = """
import sys, time, warnings
from course_utils.progress import record
me, n = sys.argv[1], int(sys.argv[2])
warnings.simplefilter("always")
for i in range(n):
    record(f"05.{me} exercise {i % 3}", True)
print("done", flush=True)
"""
DELETER = """
import contextlib, os, sys, time
lock, end = sys.argv[1], time.time() + float(sys.argv[2])
while time.time() < end:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(lock)
"""


def _writers(env: dict, n: int) -> None:
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, me, str(n)], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE) for me in "ab"]
    for w in writers:
        out, err = w.communicate(timeout=300)
        assert w.returncode == 0 and out.strip() == "done", err
        assert "Warning" not in err, err


def _assert_all_recorded(pfile: Path, n: int) -> None:
    data = json.loads(pfile.read_text())["exercises"]
    for me in "ab":
        assert sum(data[f"05.{me} exercise {k}"]["tries"] for k in range(3)) == n, data


def test_two_writers_and_a_third_deleting_the_lock_file_lose_nothing_and_warn_nothing(pfile, two_busy_loops):
    """300 results from each of two processes while a third deletes ``progress.json.lock`` in a
    loop, beside two busy loops: every result recorded, no warning (the old lock file, deleted under
    a writer that held it, let the next writer in beside it, and its stat raised a false warning)."""
    n = 300
    deleter = subprocess.Popen([sys.executable, "-c", DELETER, str(pfile) + ".lock", "600"])
    try:
        _writers(dict(os.environ, COURSE_PROGRESS_FILE=str(pfile)), n)
    finally:
        deleter.kill()
        deleter.wait()
    _assert_all_recorded(pfile, n)


def test_where_a_folder_cannot_be_locked_the_marker_file_is_locked_instead(pfile):
    """As on a network file system whose folders cannot be locked: two writers still lose nothing."""
    n = 100
    (pfile.parent.parent / "sitecustomize.py").write_text(
        "import errno\nfrom course_utils.progress import store\n"
        "def _no(path):\n    raise OSError(errno.ENOLCK, 'no locks on folders here')\n"
        "store._lock_fd = _no\n")
    _writers(dict(os.environ, COURSE_PROGRESS_FILE=str(pfile), PYTHONPATH=str(pfile.parent.parent)), n)
    _assert_all_recorded(pfile, n)
    assert (pfile.parent / "progress.json.lock").stat().st_size > 0
