"""Shared fixtures: every test must leave no worker process behind."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest


def _descendants() -> set[int]:
    """Every process below this one, except the launcher's long-lived helpers.

    The fork server and its resource tracker are started once and live as long as the test
    process: they are direct children of it.  Workers are forked *from* the fork server (same
    command line, one level further down), so they are counted.
    """
    me = psutil.Process()
    out = set()
    for p in me.children(recursive=True):
        try:
            helper = p.ppid() == me.pid and any(
                s in " ".join(p.cmdline()) for s in ("forkserver", "resource_tracker"))
        except psutil.Error:
            continue
        if not helper:
            out.add(p.pid)
    return out


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Fail any test that leaves child processes running (every test: most start workers)."""
    before = _descendants()
    yield
    deadline = psutil.time.time() + 10
    left = _descendants() - before
    while left and psutil.time.time() < deadline:
        psutil.time.sleep(0.2)
        left = _descendants() - before
    assert not left, "processes left running:\n" + "\n".join(_describe(p) for p in sorted(left))


def _describe(pid: int) -> str:
    """A leftover process with its parent and age, to tell where it came from."""
    def cmd(p: psutil.Process) -> str:
        return " ".join(p.cmdline())[:300]
    try:
        proc = psutil.Process(pid)
        parent = proc.parent()
        age = psutil.time.time() - proc.create_time()
        return (f"  pid {pid}, {age:.1f} s old, {proc.num_fds()} fds: {cmd(proc)}\n"
                f"    parent {parent.pid if parent else '?'}: {cmd(parent) if parent else '?'}")
    except psutil.Error as e:
        return f"  pid {pid}: {type(e).__name__} (it ended meanwhile)"


@pytest.fixture
def two_busy_loops():
    """Two processes that keep both cores busy while a test runs: a loaded machine, where a slow
    helper or a late signal shows.

    Run alone, a test shares the cores with them as an equal.  Inside the parallel suite (pytest-xdist),
    the other workers already load the machine: there the loops run at nice 19, so they take only
    the CPU time no test wants (the cores stay busy) instead of competing with the other workers'
    tests.
    """
    niceness = 19 if os.environ.get("PYTEST_XDIST_WORKER") else 0
    code = f"import os\nos.nice({niceness})\nwhile True: pass"
    loops = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(2)]
    yield
    for p in loops:
        p.kill()
        p.wait()
