"""The learner's progress file: recording, the table, concurrent kernels, damaged files."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import course_utils
from course_utils.checking import CheckFailed, checker

# The module, not the package's ``progress()`` function of the same name.
progress = importlib.import_module("course_utils.progress")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def pfile(tmp_path, monkeypatch):
    path = tmp_path / "course" / "progress" / "progress.json"
    monkeypatch.setenv("COURSE_PROGRESS_FILE", str(path))
    monkeypatch.delenv("COURSE_PROGRESS", raising=False)
    return path


@pytest.fixture
def checks_dir(tmp_path):
    d = tmp_path / "checks"
    d.mkdir()
    (d / "ch01.py").write_text(textwrap.dedent('''
        from ..checking import checker
        __all__ = ["check_a", "check_b"]

        @checker("01.a training step")
        def check_a(fn): ...

        @checker("01.b evaluation")
        def check_b(fn): ...
    '''))
    (d / "ch10.py").write_text('@checker("10.a overlap")\ndef check_c(fn): ...\n')
    (d / "ch02.py").write_text('@checking.checker("02.a ddp step")\ndef check_d(fn): ...\n')
    (d / "ch03.py").write_text("def broken(:\n")  # a chapter with a syntax error lists nothing
    return d


def test_checkers_record_pass_and_fail_and_the_table_shows_all_exercises(pfile, checks_dir, capsys):
    @checker("01.a training step")
    def check_ok(x):
        if x != 1:
            raise CheckFailed("expected 1")

    with pytest.raises(CheckFailed):
        check_ok(0)
    check_ok(1)
    with pytest.raises(CheckFailed):
        check_ok(2)  # a later failure does not undo the pass
    with pytest.raises(CheckFailed, match="not done yet"):
        checker("02.a ddp step")(lambda: (_ for _ in ()).throw(NotImplementedError("stub")))()
    data = json.loads(pfile.read_text())["exercises"]
    assert data["01.a training step"]["tries"] == 3 and data["01.a training step"]["passes"] == 1
    assert data["01.a training step"]["last_result"] == "failed"
    rows = {r.exercise: r for r in progress.rows(checks_dir=checks_dir)}
    assert list(rows) == ["01.a training step", "01.b evaluation", "02.a ddp step", "10.a overlap"]
    assert [(r.status, r.tries) for r in rows.values()] == [
        ("passed", 3), ("not tried", 0), ("failed", 1), ("not tried", 0)]
    capsys.readouterr()
    progress.show(checks_dir=checks_dir)
    out = capsys.readouterr().out
    assert f"Course progress ({pfile})" in out
    assert "1 of 4 passed, 1 failed, 2 not tried" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("01.a training step"))
    assert line.split()[3:6] == ["passed", "3", "failed"]


def test_the_course_checkers_are_discovered():
    names = progress.known_exercises()
    found = []
    checks = ROOT / "course_utils" / "checks"
    # A chapter is a module chNN.py or a package chNN/ (one module per exercise).
    chapters = [p.stem for p in checks.glob("ch*.py")]
    chapters += [p.parent.name for p in checks.glob("ch*/__init__.py")]
    for chapter in sorted(chapters):
        mod = __import__(f"course_utils.checks.{chapter}", fromlist=["__all__"])
        found += [getattr(mod, n).exercise for n in mod.__all__ if hasattr(getattr(mod, n), "exercise")]
    assert sorted(names) == sorted(set(found))


def test_a_chapter_package_lists_every_exercise_module(checks_dir):
    package = checks_dir / "ch04"
    package.mkdir()
    (package / "__init__.py").write_text("from .a_hand import check_hand\n")
    (package / "a_hand.py").write_text('@checker("04.a hand all-reduce")\ndef check_hand(fn): ...\n')
    (package / "b_mini.py").write_text('@checker("04.b mini DDP")\ndef check_mini(fn): ...\n')
    assert progress.known_exercises(checks_dir) == [
        "01.a training step", "01.b evaluation", "02.a ddp step", "04.a hand all-reduce", "04.b mini DDP",
        "10.a overlap"]


def test_course_utils_progress_and_the_module_entry_point(pfile, capsys):
    progress.record("01.a training step", True)
    course_utils.show_progress()
    import course_utils as cu

    cu.show_progress()
    out = capsys.readouterr().out
    assert out.count(f"Course progress ({pfile})") == 2
    res = subprocess.run([sys.executable, "-m", "course_utils.progress"], capture_output=True,
                         text=True, timeout=60, env=dict(os.environ), cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert "01.a training step" in res.stdout and "passed" in res.stdout
    res = subprocess.run([sys.executable, "-m", "course_utils.progress", "--json"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    rows = {r["exercise"]: r for r in json.loads(res.stdout)}
    assert rows["01.a training step"]["status"] == "passed"


def test_a_missing_folder_is_created(pfile):
    assert not pfile.parent.exists()
    progress.record("03.a all-reduce mean", False)
    assert json.loads(pfile.read_text())["exercises"]["03.a all-reduce mean"]["tries"] == 1


def test_a_missing_file_is_rebuilt_with_a_warning(pfile):
    progress.record("03.a all-reduce mean", True)
    pfile.unlink()  # deleted after it had existed
    with pytest.warns(progress.ProgressWarning, match="was missing; starting a new one"):
        progress.record("03.a all-reduce mean", False)
    entry = json.loads(pfile.read_text())["exercises"]["03.a all-reduce mean"]
    assert entry["tries"] == 1 and entry["passes"] == 0


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe\x00binary", b"[1, 2, 3]",
                                     b'{"exercises": "none"}', b""])
def test_a_corrupt_file_never_breaks_a_checker_and_is_rebuilt(pfile, content, capsys):
    pfile.parent.mkdir(parents=True)
    pfile.write_bytes(content)
    with pytest.warns(progress.ProgressWarning, match="damaged.*rebuilt"):
        checker("01.a training step")(lambda: None)()
    assert "[PASS] 01.a training step" in capsys.readouterr().out
    data = json.loads(pfile.read_text())
    assert data["exercises"]["01.a training step"]["passes"] == 1
    backups = list(pfile.parent.glob("progress.json.corrupt-*"))
    assert len(backups) == 1 and backups[0].read_bytes() == content


def test_damaged_entries_are_dropped_and_good_ones_kept(pfile):
    pfile.parent.mkdir(parents=True)
    good = {"tries": 2, "passes": 1, "last_result": "passed", "first_tried": "2026-01-01T10:00:00",
            "last_tried": "2026-01-01T10:05:00", "first_passed": "2026-01-01T10:05:00"}
    pfile.write_text(json.dumps({"schema": 1, "exercises": {
        "01.a training step": good, "01.b evaluation": {"tries": "many"}, "02.a ddp step": 7}}))
    with pytest.warns(progress.ProgressWarning, match="damaged"):
        rows = {r.exercise: r.status for r in progress.rows()}
    assert rows["01.a training step"] == "passed"
    with pytest.warns(progress.ProgressWarning, match="keeping 1 readable result"):
        progress.record("02.a ddp step", True)
    data = json.loads(pfile.read_text())["exercises"]
    assert data["01.a training step"] == good and data["02.a ddp step"]["passes"] == 1
    assert "01.b evaluation" not in data


def test_an_unwritable_folder_warns_and_the_checker_still_passes(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("COURSE_PROGRESS_FILE", str(blocker / "progress.json"))
    with pytest.warns(progress.ProgressWarning, match="could not record"):
        checker("01.a training step")(lambda: None)()
    assert "[PASS]" in capsys.readouterr().out


def test_no_recording_in_pytest_runs_without_an_explicit_file(monkeypatch, tmp_path):
    monkeypatch.delenv("COURSE_PROGRESS_FILE", raising=False)
    assert "PYTEST_CURRENT_TEST" in os.environ
    assert not progress.recording_enabled()
    monkeypatch.setenv("COURSE_PROGRESS_FILE", str(tmp_path / "p.json"))
    assert progress.recording_enabled()
    monkeypatch.setenv("COURSE_PROGRESS", "off")
    assert not progress.recording_enabled()
    progress.record("01.a training step", True)
    assert not (tmp_path / "p.json").exists()


WRITER = textwrap.dedent('''
    import os, sys, time
    from course_utils.progress import record
    start, me, n = float(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    while time.time() < start:
        time.sleep(0.001)
    for i in range(n):
        record(f"05.{me} exercise {i % 5}", i % 2 == 0)
        record("05.z shared", i % 3 == 0)
''')


def test_concurrent_writes_from_two_kernels_lose_nothing(pfile):
    n = 60
    start = time.time() + 3.0  # both processes start writing at the same moment
    env = dict(os.environ, COURSE_PROGRESS_FILE=str(pfile))
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(start), me, str(n)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for me in ("a", "b")]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert "Warning" not in err, err
    data = json.loads(pfile.read_text())["exercises"]
    assert data["05.z shared"]["tries"] == 2 * n
    assert data["05.z shared"]["passes"] == 2 * len([i for i in range(n) if i % 3 == 0])
    for me in ("a", "b"):
        for k in range(5):
            e = data[f"05.{me} exercise {k}"]
            assert e["tries"] == n // 5
            assert e["passes"] == len([i for i in range(n) if i % 5 == k and i % 2 == 0])
    assert not list(pfile.parent.glob(".progress.json.*.tmp")), "a temporary file was left behind"


def test_a_held_lock_does_not_hang_a_checker(pfile, monkeypatch):
    import fcntl

    pfile.parent.mkdir(parents=True)
    monkeypatch.setattr(progress.store, "LOCK_TIMEOUT_S", 0.3)
    fd = os.open(pfile.parent, os.O_RDONLY | os.O_DIRECTORY)  # what a writer locks: the folder
    try:
        # flock locks belong to the open file: another open of the same folder conflicts
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.warns(progress.ProgressWarning, match="stayed locked"):
            progress.record("01.a training step", True)
    finally:
        os.close(fd)
    progress.record("01.a training step", True)
    assert json.loads(pfile.read_text())["exercises"]["01.a training step"]["tries"] == 1
