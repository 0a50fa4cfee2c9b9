"""benchmarks/quiet.py: `make notebooks` refuses to record measurements while other work runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "quiet.py"


def test_a_busy_process_outside_our_tree_makes_the_machine_not_quiet():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        # --root 0: only the script itself is "ours", so the busy loop counts as other work.
        res = subprocess.run([sys.executable, str(SCRIPT), "--seconds", "1", "--root", "0"],
                             capture_output=True, text=True, timeout=60)
    finally:
        busy.kill()
        busy.wait()
    assert res.returncode == 1
    assert "not quiet" in res.stderr and "QUIET=skip" in res.stderr
    assert "busiest: " in res.stderr  # it names the processes to look at


def test_make_notebooks_checks_before_each_notebook():
    out = subprocess.run(["make", "-n", "notebooks"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60).stdout
    assert "benchmarks/chapter_times.py --record --quiet-wait 120" in out
    skipped = subprocess.run(["make", "-n", "notebooks", "QUIET=skip"], cwd=ROOT, capture_output=True,
                             text=True, timeout=60).stdout
    assert "--quiet-wait" not in skipped and "QUIET=skip" in skipped
