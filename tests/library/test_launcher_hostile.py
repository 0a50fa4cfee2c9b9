"""The launcher against workers that misbehave on purpose: each promise provoked for real.

A worker that loses its output, exits with a message, starts processes that ignore SIGTERM or
leave its session, or stops itself: ``launch`` still reports what happened, and nothing the
launch started is left running once it returns or raises.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from course_utils import WorkerError, WorkerTimeout, launch

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pids: list[int], limit: float = 5.0) -> None:
    deadline = time.monotonic() + limit
    while not all(_gone(p) for p in pids):
        assert time.monotonic() < deadline, f"still running: {[p for p in pids if not _gone(p)]}"
        time.sleep(0.05)


# ---------------------------------------------------------------- output lost, exit with a message


def _closes_its_output() -> int:
    sys.stdout.write("no newline, and then no stdout at all")
    os.close(1)
    os.close(2)
    return 42


def test_a_worker_that_closed_stdout_and_stderr_still_returns_its_result():
    assert launch(_closes_its_output, 2, timeout=30) == [42, 42]


def _closes_every_descriptor() -> int:
    os.closerange(0, 65536)  # the result pipe too: the result cannot arrive
    return 42


def test_a_worker_that_cannot_send_its_result_fails_instead_of_returning_none():
    with pytest.raises(WorkerError) as ei:
        launch(_closes_every_descriptor, 1, timeout=30)
    assert ei.value.failed_ranks == [0], ei.value
    assert "closed the file descriptors the launcher gave" in str(ei.value), ei.value


def _closes_its_descriptors_and_waits() -> None:
    os.closerange(3, 65536)
    time.sleep(120)


def test_a_worker_that_closed_its_descriptors_is_named_for_it_not_as_an_oom_kill_or_a_hang(two_busy_loops):
    """It was SIGKILLed by its own watchdog (its pipe gone) and called an OOM kill, or, alone, timed out."""
    for world in (1, 2):
        start = time.monotonic()
        with pytest.raises(WorkerError) as ei:
            launch(_closes_its_descriptors_and_waits, world, timeout=60)
        text = str(ei.value)
        assert not isinstance(ei.value, WorkerTimeout) and "OOM" not in text, text
        assert "closed the file descriptors the launcher gave" in text, text
        assert time.monotonic() - start < 50


def _own_sigusr1_handler() -> None:
    signal.signal(signal.SIGUSR1, lambda *_: None)
    signal.signal(signal.SIGUSR2, lambda *_: None)
    time.sleep(120)


def test_a_hang_in_a_worker_with_its_own_sigusr1_handler_still_shows_the_stack(two_busy_loops):
    with pytest.raises(WorkerTimeout) as ei:
        launch(_own_sigusr1_handler, 2, timeout=3)
    for f in ei.value.failures.values():
        assert "_own_sigusr1_handler" in f.stack and "time.sleep(120)" in f.stack, ei.value


def _ignores_every_signal() -> None:
    for s in signal.valid_signals():
        if s not in (signal.SIGKILL, signal.SIGSTOP):
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                signal.signal(s, signal.SIG_IGN)
    time.sleep(120)


def test_a_hang_without_a_stack_says_why(two_busy_loops):
    with pytest.raises(WorkerTimeout) as ei:
        launch(_ignores_every_signal, 1, timeout=3)
    text = str(ei.value)
    assert "blocks or ignores signal" in text and "no Python stack could be collected" not in text, text


def _returns_one() -> int:
    return 1


def test_a_launch_right_after_the_fork_server_was_killed_starts_a_new_one():
    """Right after the kill the dead server is not reaped yet: multiprocessing still connects to it
    and its first start failed with EOFError (each restart imports torch: one kill is enough)."""
    from multiprocessing import forkserver

    assert launch(_returns_one, 2, timeout=60) == [1, 1]
    os.kill(forkserver._forkserver._forkserver_pid, signal.SIGKILL)
    assert launch(_returns_one, 2, timeout=60) == [1, 1]


def test_sys_exit_keeps_its_message_and_its_code():
    with pytest.raises(WorkerError) as ei:
        launch(sys.exit, 1, args=("the data folder is missing",), timeout=30)
    assert "rank 0 raised SystemExit: exit code 1: the data folder is missing" in str(ei.value)
    with pytest.raises(WorkerError, match="rank 0 raised SystemExit: exit code 3\n"):
        launch(sys.exit, 1, args=(3,), timeout=30)
    assert launch(sys.exit, 1, args=(0,)) == [None]  # success, as under torchrun


@pytest.mark.parametrize("name", ["timeout", "finish_within"])
@pytest.mark.parametrize("bad", [-1, 0, math.nan, math.inf, -math.inf, "5", True])
def test_invalid_time_limits_are_refused_before_anything_starts(tmp_path, name, bad):
    marker = tmp_path / "ran"
    with pytest.raises(ValueError, match=f"{name}=.*seconds above 0"):
        launch(marker.touch, 1, **{name: bad})
    assert not marker.exists()


# ---------------------------------------------------------------- descendants of a worker


def _start_a_stubborn_grandchild(path: str, leave_session: bool) -> int:
    """Daemonise (fork twice) a process that ignores SIGTERM; it writes its pid to ``path``."""
    pid = os.fork()
    if pid == 0:  # the intermediate child
        try:
            if leave_session:
                os.setsid()
            if os.fork() == 0:  # the grandchild: its parent exits at once, it is an orphan
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                Path(path + ".tmp").write_text(str(os.getpid()))
                os.rename(path + ".tmp", path)
                time.sleep(120)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    deadline = time.monotonic() + 20
    while not os.path.exists(path):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return int(Path(path).read_text())


def _worker_with_grandchild(folder: str, leave_session: bool, end: str) -> int:
    pid = _start_a_stubborn_grandchild(f"{folder}/{os.environ['RANK']}", leave_session)
    # Every rank's grandchild exists before any rank fails or hangs: on a loaded machine, rank 1
    # once failed while rank 0 had not yet started its own, which the launcher then stopped first.
    deadline = time.monotonic() + 20
    while not all(os.path.exists(f"{folder}/{r}") for r in range(int(os.environ["WORLD_SIZE"]))):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    if end == "raise":
        raise RuntimeError("failing on purpose")
    if end == "hang":
        time.sleep(120)
    return pid


@pytest.mark.parametrize("leave_session", [False, True], ids=["same-session", "setsid"])
@pytest.mark.parametrize("end", ["return", "raise", "hang"])
def test_no_grandchild_survives_its_worker(tmp_path, leave_session, end):
    t0 = time.monotonic()
    if end == "return":
        launch(_worker_with_grandchild, 2, args=(str(tmp_path), leave_session, end), timeout=30)
    else:
        with pytest.raises(WorkerTimeout if end == "hang" else WorkerError):
            # 8 s: both workers start and their grandchildren write their pids first, under load too
            launch(_worker_with_grandchild, 2, args=(str(tmp_path), leave_session, end), timeout=8)
    assert time.monotonic() - t0 < 20
    pids = [int((tmp_path / str(r)).read_text()) for r in (0, 1)]
    _wait_gone(pids)


def _worker_that_kills_itself(folder: str) -> None:
    """Start a program that ignores SIGTERM and leaves the session, then die by SIGKILL (as the OOM
    killer would do it): the worker's own clean-up never runs, and init adopts the program."""
    path = f"{folder}/{os.environ['RANK']}"
    subprocess.Popen(["bash", "-c", f"trap '' TERM; echo $$ > {path}.tmp; mv {path}.tmp {path}; "
                      "exec sleep 120"], start_new_session=True)
    deadline = time.monotonic() + 20
    while not os.path.exists(path):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    if os.environ["RANK"] == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)


def test_no_program_survives_a_worker_that_was_sigkilled(tmp_path):
    with pytest.raises(WorkerError, match="rank 0 was killed by SIGKILL"):
        launch(_worker_that_kills_itself, 2, args=(str(tmp_path),), timeout=30)
    _wait_gone([int((tmp_path / str(r)).read_text()) for r in (0, 1)])


# ---------------------------------------------------------------- a worker that stops itself


def test_a_worker_that_stopped_itself_is_reported_as_stopped_and_killed(tmp_path):
    def work(folder):
        Path(folder, os.environ["RANK"]).write_text(str(os.getpid()))
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(120)

    with pytest.raises(WorkerTimeout) as ei:
        launch(work, 2, args=(str(tmp_path),), timeout=2)
    stopped, running = ei.value.failures[1], ei.value.failures[0]
    assert "state T" in stopped.message and "stopped by a signal" in str(ei.value)
    assert "rank 1 was still running, but it was stopped by a signal" in str(ei.value)
    assert not running.message and "in work" in running.stack
    _wait_gone([int((tmp_path / r).read_text()) for r in ("0", "1")])


_DRIVER = """
import sys
sys.path.insert(0, sys.argv[2])
from test_launcher_hostile import _worker_with_grandchild
from course_utils import launch
launch(_worker_with_grandchild, 2, args=(sys.argv[1], True, "hang"), timeout=300)
"""


def test_no_grandchild_survives_the_death_of_the_kernel(tmp_path):
    """The kernel is SIGKILLed: each worker's watchdog ends its setsid'd grandchild, then itself."""
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER, str(tmp_path), str(Path(__file__).parent)])
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / r).exists() for r in ("0", "1")):
            assert time.monotonic() < deadline and driver.poll() is None, "workers never started"
            time.sleep(0.05)
        pids = [int((tmp_path / r).read_text()) for r in ("0", "1")]
    finally:
        driver.kill()
        driver.wait()
    _wait_gone(pids, limit=10)


_STOPPED_DRIVER = """
import os, signal, sys, time
from pathlib import Path
from course_utils import launch
def work(folder):
    Path(folder, os.environ["RANK"]).write_text(str(os.getpid()))
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(300)
launch(work, 2, args=(sys.argv[1],), timeout=300)
"""


def test_a_stopped_worker_does_not_survive_the_death_of_the_kernel(tmp_path):
    """Its watchdog thread cannot run while it is stopped: the fork server's exit kills it."""
    driver = subprocess.Popen([sys.executable, "-c", _STOPPED_DRIVER, str(tmp_path)])
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / r).exists() and (tmp_path / r).read_text() for r in ("0", "1")):
            assert time.monotonic() < deadline and driver.poll() is None, "workers never started"
            time.sleep(0.05)
        pids = [int((tmp_path / r).read_text()) for r in ("0", "1")]
        while psutil.Process(pids[1]).status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        driver.kill()
        driver.wait()
    _wait_gone(pids, limit=10)
