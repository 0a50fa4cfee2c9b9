"""The room report: every learner's progress file in one folder, in one table; nothing crashes it."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

progress = importlib.import_module("course_utils.progress")


def entry(tries: int, passes: int, last: str = "2026-11-30T10:00:00") -> dict:
    return {"tries": tries, "passes": passes, "last_result": "passed" if passes else "failed",
            "first_tried": last, "last_tried": last, "first_passed": last if passes else None}


def progress_doc(exercises: dict, **extra) -> str:
    return json.dumps({"schema": 1, "exercises": exercises, **extra})


@pytest.fixture
def checks_dir(tmp_path):
    d = tmp_path / "checks"
    d.mkdir()
    (d / "ch01.py").write_text(textwrap.dedent('''
        @checker("01.a training step")
        def check_a(fn): ...

        @checker("01.b evaluation")
        def check_b(fn): ...
    '''))
    (d / "ch04.py").write_text('@checker("04.a hand all-reduce")\ndef check_c(fn): ...\n')
    return d


@pytest.fixture
def room_dir(tmp_path):
    d = tmp_path / "room"
    d.mkdir()
    # good: one learner per file, named by the file or by a "learner" field
    (d / "alice.json").write_text(progress_doc({
        "01.a training step": entry(2, 1, "2026-11-30T10:05:00"),
        "01.b evaluation": entry(1, 0, "2026-11-30T10:20:00")}))
    (d / "x7.json").write_text(progress_doc({"01.a training step": entry(1, 1)}, learner="bob"))
    (d / "carol").mkdir()  # a whole progress/ folder handed in
    (d / "carol" / "progress.json").write_text(progress_doc({
        "01.a training step": entry(3, 0), "04.a hand all-reduce": entry(1, 1),
        "99.z from a newer course": entry(1, 1)}))
    # partly damaged: the readable entry counts, the file is named
    (d / "dave.json").write_text(progress_doc({"01.a training step": entry(1, 1),
                                               "01.b evaluation": {"tries": "many"}}))
    # bad: corrupt, wrong schema, binary, empty, a folder, a pipe, a dangling link
    (d / "corrupt.json").write_text('{"schema": 1, "exercises": {"01.a')
    (d / "schema2.json").write_text(json.dumps({"schema": 2, "exercises": {}}))
    (d / "list.json").write_text("[1, 2, 3]")
    (d / "binary.json").write_bytes(bytes(range(256)) * 4)
    (d / "empty.json").write_text("")
    (d / "old-runs").mkdir()
    os.mkfifo(d / "pipe.json")  # reading it would block forever
    (d / "gone.json").symlink_to(d / "nowhere.json")
    # foreign: files other programs leave in a shared folder
    (d / "package.json").write_text(json.dumps({"name": "x", "version": "1.0"}))
    (d / "notes.txt").write_text("bring USB sticks\n")
    (d / "progress.json.lock").write_text("progress.json lock\n")
    (d / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1\x00")
    return d


EXPECTED_SKIPS = {
    ".DS_Store": "not valid JSON",
    "binary.json": "not text (binary data)",
    "corrupt.json": "not valid JSON",
    "empty.json": "empty file",
    "gone.json": "cannot be read",
    "list.json": 'JSON, but not a progress file (no "exercises" table)',
    "notes.txt": "not valid JSON",
    "old-runs/": "a folder without a progress.json",
    "package.json": 'JSON, but not a progress file (no "exercises" table)',
    "pipe.json": "not a regular file",
    "progress.json.lock": "not valid JSON",
    "schema2.json": "progress file of schema 2; this course reads schema 1",
}


def test_room_counts_each_exercise_and_each_learner(room_dir, checks_dir):
    r = progress.room(room_dir, checks_dir=checks_dir)
    assert [lr.name for lr in r.learners] == ["alice", "bob", "carol", "dave"]
    assert [lr.source for lr in r.learners] == ["alice.json", "x7.json", "carol/progress.json",
                                                "dave.json"]
    assert r.exercises == ["01.a training step", "01.b evaluation", "04.a hand all-reduce",
                           "99.z from a newer course"]
    skipped = dict(r.skipped)
    assert set(skipped) == set(EXPECTED_SKIPS)
    for name, why in EXPECTED_SKIPS.items():
        assert skipped[name].startswith(why), (name, skipped[name])

    text = progress.room_table(room_dir, checks_dir=checks_dir)
    rows = {line.rsplit(None, 3)[0]: line.split()[-3:] for line in text.splitlines()
            if line[:2] in ("01", "04", "99")}
    # passed, failed, not tried, out of 4 learners
    assert rows == {"01.a training step": ["3", "1", "0"], "01.b evaluation": ["0", "1", "3"],
                    "04.a hand all-reduce": ["1", "0", "3"],
                    "99.z from a newer course": ["1", "0", "3"]}
    learners = {line.split()[0]: line.split()[1:4] for line in text.splitlines()
                if line.split()[:1] and line.split()[0] in ("alice", "bob", "carol", "dave")}
    assert learners == {"alice": ["1", "1", "2"], "bob": ["1", "0", "3"], "carol": ["2", "1", "1"],
                        "dave": ["1", "0", "3"]}
    assert "alice  " in text and "2026-11-30 10:20" in text  # last active: the latest try
    assert "note: dave.json is partly damaged: 1 unreadable entry (01.b evaluation)" in text
    assert f"Skipped, not progress files ({len(EXPECTED_SKIPS)}):" in text
    for name in EXPECTED_SKIPS:
        assert f"  {name}: " in text


def test_an_unreadable_file_is_named_not_raised(room_dir, checks_dir, monkeypatch):
    real = os.open

    def open_(path, *args, **kwargs):  # the open as an unprivileged user sees it (root reads anything)
        if Path(path).name == "alice.json":
            raise PermissionError(13, "Permission denied")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    r = progress.room(room_dir, checks_dir=checks_dir)
    assert "alice" not in [lr.name for lr in r.learners]
    assert dict(r.skipped)["alice.json"] == "cannot be read (Permission denied)"


def test_same_learner_twice_stays_two_rows(tmp_path, checks_dir):
    (tmp_path / "a.json").write_text(progress_doc({"01.a training step": entry(1, 1)}, learner="eve"))
    (tmp_path / "b.json").write_text(progress_doc({}, learner="eve"))
    r = progress.room(tmp_path, checks_dir=checks_dir)
    assert [lr.name for lr in r.learners] == ["eve (a.json)", "eve (b.json)"]


def test_empty_and_missing_folders(tmp_path, checks_dir):
    text = progress.room_table(tmp_path, checks_dir=checks_dir)
    assert "Room progress: 0 learners" in text and "No progress files found" in text
    missing = progress.room(tmp_path / "nope", checks_dir=checks_dir)
    assert missing.learners == [] and "cannot list the folder" in missing.skipped[0][1]


def test_command_line(room_dir):
    cmd = [sys.executable, "-m", "course_utils.progress", "--room"]
    p = subprocess.run(cmd + [str(room_dir)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"Room progress: 4 learners in {room_dir}")
    assert "01.a training step" in p.stdout and "Traceback" not in p.stderr
    p = subprocess.run(cmd + [str(room_dir), "--json"], capture_output=True, text=True, timeout=60)
    doc = json.loads(p.stdout)
    assert [lr["name"] for lr in doc["learners"]] == ["alice", "bob", "carol", "dave"]
    p = subprocess.run(cmd + [str(room_dir / "nope")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "cannot list the folder" in p.stdout
    assert "Traceback" not in p.stderr


@pytest.fixture
def hostile_room(tmp_path):
    """One good learner among files made to break a reader, and links leading out of the folder."""
    d = tmp_path / "hostile"
    d.mkdir()
    (d / "alice.json").write_text(progress_doc({"01.a training step": entry(1, 1)}))
    (d / "deep.json").write_text("[" * 200_000)
    with open(d / "huge.json", "wb") as f:  # sparse: 50 MB long, no disk used
        f.truncate(50 * 2**20)
    os.mkfifo(d / "fifo.json")
    (d / "folder.json").mkdir()
    secret = tmp_path / "outside"
    secret.mkdir()
    (secret / "progress.json").write_text(progress_doc({"01.a training step": entry(1, 1)},
                                                       learner="mallory"))
    (d / "out.json").symlink_to(secret / "progress.json")
    (d / "outdir").symlink_to(secret)
    (d / "erin").mkdir()
    (d / "erin" / "progress.json").symlink_to(secret / "progress.json")
    (d / "alias.json").symlink_to(d / "alice.json")  # inside the folder: followed
    return d


HOSTILE_SKIPS = {
    "deep.json": "not a progress file (JSON nested too deeply to read)",
    "huge.json": "too large for a progress file (50 MiB",
    "fifo.json": "not a regular file (a FIFO)",
    "folder.json/": "a folder without a progress.json",
    "out.json": "a link to outside the folder (not followed)",
    "outdir": "a link to outside the folder (not followed)",
    "erin/progress.json": "a link to outside the folder (not followed)",
}


@pytest.mark.timeout(20)
def test_hostile_files_are_named_and_the_others_still_counted(hostile_room, checks_dir):
    r = progress.room(hostile_room, checks_dir=checks_dir)
    assert [lr.name for lr in r.learners] == ["alias", "alice"]
    skipped = dict(r.skipped)
    assert set(skipped) == set(HOSTILE_SKIPS)
    for name, why in HOSTILE_SKIPS.items():
        assert skipped[name].startswith(why), (name, skipped[name])
    assert "mallory" not in progress.room_table(hostile_room, checks_dir=checks_dir)


def test_hostile_files_through_the_command_line(hostile_room):
    p = subprocess.run([sys.executable, "-m", "course_utils.progress", "--room", str(hostile_room)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert p.stdout.startswith(f"Room progress: 2 learners in {hostile_room}")
    for name, why in HOSTILE_SKIPS.items():
        assert f"  {name}: {why}" in p.stdout


@pytest.mark.skipif(os.geteuid() == 0, reason="runs as root, whom file permissions do not stop")
def test_a_file_without_read_permission_is_named(room_dir, checks_dir):
    (room_dir / "alice.json").chmod(0)
    r = progress.room(room_dir, checks_dir=checks_dir)
    assert dict(r.skipped)["alice.json"] == "cannot be read (Permission denied)"
