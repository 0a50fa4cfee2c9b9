"""`make update` (tools/update_course.py): a course update after a learner ran lessons and did
exercises, in a real clone of a real upstream repository made in a temporary folder."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
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


def _notebook(*cells: tuple[str, str]) -> str:
    return json.dumps({"cells": [{"cell_type": kind, "metadata": {}, "source": src,
                                  **({"outputs": [], "execution_count": None} if kind == "code" else {})}
                                 for kind, src in cells], "metadata": {}, "nbformat": 4, "nbformat_minor": 5})


def test_a_text_only_change_to_an_exercise_keeps_the_answers_in_the_new_text(tmp_path):
    up, clone = _course(tmp_path)
    stub = ("code", "def f():\n    raise NotImplementedError('Exercise 01.a')")
    (up / "exercises/01.ipynb").write_text(_notebook(("markdown", "Write f."), stub, ("code", "check(f)")))
    _git(up, "commit", "-q", "-am", "notebook")
    _git(clone, "pull", "-q", "--ff-only")
    mine = json.loads(_notebook(("markdown", "Write f."), ("code", "def f():\n    return 42"),
                                ("code", "check(f)")))
    mine["cells"][2]["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "[PASS]\n"}]
    (clone / "exercises/01.ipynb").write_text(json.dumps(mine))
    (up / "exercises/01.ipynb").write_text(_notebook(("markdown", "Write f, which returns 42."), stub,
                                                     ("code", "check(f)")))
    _git(up, "commit", "-q", "-am", "clearer text")
    r = _update(clone)
    assert r.returncode == 0, r.stdout + r.stderr
    now = json.loads((clone / "exercises/01.ipynb").read_text())
    assert "".join(now["cells"][0]["source"]) == "Write f, which returns 42."
    assert "".join(now["cells"][1]["source"]) == "def f():\n    return 42"
    assert now["cells"][2]["outputs"][0]["text"] == "[PASS]\n"
    assert "changed only its text" in r.stdout

    # a change to a code cell (a new stub, a new check) keeps the new version and says where the old one is
    (up / "exercises/01.ipynb").write_text(_notebook(("markdown", "Write f, which returns 42."), stub,
                                                     ("code", "check(f, strict=True)")))
    _git(up, "commit", "-q", "-am", "stricter check")
    r = _update(clone)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "strict=True" in (clone / "exercises/01.ipynb").read_text()
    assert "changed in the update" in r.stdout


class _Sessions(http.server.BaseHTTPRequestHandler):
    sessions: list = []

    def do_GET(self):  # noqa: N802 (the name http.server calls)
        body = json.dumps(self.sessions).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_an_open_course_notebook_stops_the_update_and_is_named(tmp_path):
    up, clone = _course(tmp_path)
    (clone / "exercises/01.ipynb").write_text("my answers\n")
    (up / "notebooks/01.ipynb").write_text("lesson v2\n")
    _git(up, "commit", "-q", "-am", "v2")
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    _Sessions.sessions = [{"path": "learner/exercises/01.ipynb"}, {"path": "elsewhere/other.ipynb"}]
    server = http.server.HTTPServer(("127.0.0.1", 0), _Sessions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        (runtime / "jpserver-1.json").write_text(json.dumps(
            {"url": f"http://127.0.0.1:{server.server_port}/", "token": "t", "root_dir": str(tmp_path)}))
        (runtime / "jpserver-2.json").write_text("{not json")  # a stale or broken file is passed over
        env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(runtime)}
        r = subprocess.run([sys.executable, "tools/update_course.py"], cwd=clone, capture_output=True,
                           text=True, timeout=60, env=env)
        assert r.returncode != 0 and "exercises/01.ipynb" in r.stderr and "close these notebooks" in r.stderr
        assert (clone / "exercises/01.ipynb").read_text() == "my answers\n"
        assert (clone / "notebooks/01.ipynb").read_text() == "lesson v1\n"  # nothing pulled
        r = subprocess.run([sys.executable, "tools/update_course.py", "--force"], cwd=clone,
                           capture_output=True, text=True, timeout=60, env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert (clone / "notebooks/01.ipynb").read_text() == "lesson v2\n"
    finally:
        server.shutdown()
        server.server_close()
