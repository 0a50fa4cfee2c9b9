"""`make update` (tools/update_course.py): a course update after a learner ran lessons and did
exercises, in a real clone of a real upstream repository made in a temporary folder."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "update_course.py"


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd,
                          check=True, capture_output=True, text=True).stdout


def _course(tmp_path: Path) -> tuple[Path, Path]:
    """An upstream repository with a lesson, two exercises and the tool, and a learner's clone."""
    up = tmp_path / "upstream"
    for rel, text in {"notebooks/01.ipynb": "lesson v1\n", "exercises/01.ipynb": "exercise 01 v1\n",
                      "exercises/02.ipynb": "exercise 02 v1\n", ".gitignore": "/my-work/\n"}.items():
        (up / rel).parent.mkdir(parents=True, exist_ok=True)
        (up / rel).write_text(text)
    (up / "tools").mkdir()
    shutil.copy(TOOL, up / "tools" / "update_course.py")
    _git(up, "init", "-q", "-b", "main")
    _git(up, "add", ".")
    _git(up, "commit", "-q", "-m", "v1")
    clone = tmp_path / "learner"
    _git(tmp_path, "clone", "-q", str(up), str(clone))
    return up, clone


def _update(clone: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tools/update_course.py", *args], cwd=clone,
                          capture_output=True, text=True, timeout=60)


def test_an_update_keeps_the_answers_and_takes_the_new_lesson(tmp_path):
    up, clone = _course(tmp_path)
    (clone / "notebooks/01.ipynb").write_text("lesson v1 with my outputs\n")
    (clone / "exercises/01.ipynb").write_text("exercise 01 with my answers\n")
    (clone / "exercises/02.ipynb").write_text("exercise 02 with my answers\n")
    (up / "notebooks/01.ipynb").write_text("lesson v2\n")
    (up / "exercises/02.ipynb").write_text("exercise 02 v2\n")
    _git(up, "commit", "-q", "-am", "v2")
    # what a plain pull does here: refuses
    assert subprocess.run(["git", "pull", "--ff-only"], cwd=clone, capture_output=True).returncode

    r = _update(clone)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (clone / "notebooks/01.ipynb").read_text() == "lesson v2\n"
    assert (clone / "exercises/01.ipynb").read_text() == "exercise 01 with my answers\n"
    assert (clone / "exercises/02.ipynb").read_text() == "exercise 02 v2\n"  # changed upstream
    (backup,) = (clone / "my-work").iterdir()
    assert (backup / "notebooks/01.ipynb").read_text() == "lesson v1 with my outputs\n"
    assert (backup / "exercises/02.ipynb").read_text() == "exercise 02 with my answers\n"
    assert "your answers are back in: exercises/01.ipynb" in r.stdout
    assert "exercises/02.ipynb changed in the update" in r.stdout and "my-work/" in r.stdout
    assert _git(clone, "status", "--porcelain", "--untracked-files=no") == " M exercises/01.ipynb\n"


def test_a_failed_pull_leaves_every_file_as_it_was(tmp_path):
    up, clone = _course(tmp_path)
    (clone / "exercises/01.ipynb").write_text("my answers\n")
    shutil.rmtree(up)  # the upstream is gone (no network, say)
    r = _update(clone)
    assert r.returncode != 0
    assert (clone / "exercises/01.ipynb").read_text() == "my answers\n"
    assert "your files are as they were" in r.stderr


def test_dry_run_changes_nothing(tmp_path):
    up, clone = _course(tmp_path)
    (clone / "notebooks/01.ipynb").write_text("my outputs\n")
    r = _update(clone, "--dry-run")
    assert r.returncode == 0 and "notebooks/01.ipynb" in r.stdout
    assert (clone / "notebooks/01.ipynb").read_text() == "my outputs\n"
    assert not (clone / "my-work").exists()
