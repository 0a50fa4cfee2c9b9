"""Shared fixtures: every test must leave no worker process behind."""

from __future__ import annotations

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
    alive = [psutil.Process(p).cmdline() for p in left if psutil.pid_exists(p)]
    assert not left, f"processes left running: {alive}"
