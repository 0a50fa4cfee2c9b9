"""The pieces of ``course_utils.workers`` that the launcher tests do not reach directly.

- every socket a launch opens, in the launcher or in its workers, listens on loopback only;
- the thread budget follows the CPU affinity and the cgroup quota, not the machine's core count;
- the fork server is started early in a notebook kernel, and only there;
- output is split into whole lines the same way for workers and commands.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from course_utils import launch
from course_utils.workers import budget
from course_utils.workers.lines import LineSplitter

ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


# --------------------------------------------------------------------------------------------
# The store and the process group listen on loopback only
# --------------------------------------------------------------------------------------------


def _listening_sockets(launcher_pid: int) -> list[tuple[int, str, int]]:
    """Worker: join a gloo group, then (rank 0) list what the launch's processes listen on."""
    dist.init_process_group("gloo")
    t = torch.ones(4)
    dist.all_reduce(t)  # gloo's pairs are connected by now
    pids = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    out = []
    if dist.get_rank() == 0:
        mine = {launcher_pid, *pids}
        for c in psutil.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN and c.pid in mine:
                out.append((c.pid, c.laddr.ip, c.laddr.port))
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_no_socket_of_a_launch_listens_beyond_loopback():
    found = launch(_listening_sockets, 2, args=(os.getpid(),), timeout=60, display=None)[0]
    assert found, "no listening socket seen: the test proves nothing"
    assert any(pid == os.getpid() for pid, _, _ in found), "the store's socket was not seen"
    outside = [(pid, ip, port) for pid, ip, port in found if ip not in LOOPBACK]
    assert not outside, f"listening beyond loopback (pid, address, port): {outside}"


# --------------------------------------------------------------------------------------------
# Thread budget
# --------------------------------------------------------------------------------------------


def test_thread_budget_follows_the_cpu_affinity():
    code = "from course_utils.workers.budget import cpu_threads_per_worker as t; print(t(1), t(2))"
    out = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    assert out == ["1", "1"]


def _fake_cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpu_max: str | None) -> Path:
    root = tmp_path / "cgroup"
    leaf = root / "user.slice" / "learner"
    leaf.mkdir(parents=True)
    if cpu_max is not None:
        (leaf / "cpu.max").write_text(cpu_max + "\n")
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text("0::/user.slice/learner\n")
    monkeypatch.setattr(budget, "CGROUP_ROOT", root)
    return proc


def test_cgroup_v2_quota_caps_the_budget(tmp_path, monkeypatch):
    proc = _fake_cgroup(tmp_path, monkeypatch, "200000 100000")  # 2 CPUs
    assert budget.cgroup_cpu_limit(str(proc)) == 2.0
    monkeypatch.setattr(budget, "cgroup_cpu_limit", lambda: 2.0)
    monkeypatch.setattr(budget, "_affinity_cpus", lambda: 64)
    assert budget.usable_cpus() == 2
    assert budget.cpu_threads_per_worker(2) == 1  # not 32 on a 64-core host


def test_unlimited_or_missing_cgroup_quota_leaves_the_affinity(tmp_path, monkeypatch):
    assert budget.cgroup_cpu_limit(str(_fake_cgroup(tmp_path, monkeypatch, "max 100000"))) is None
    assert budget.cgroup_cpu_limit(str(tmp_path / "does-not-exist")) is None
    monkeypatch.setattr(budget, "cgroup_cpu_limit", lambda: None)
    monkeypatch.setattr(budget, "_affinity_cpus", lambda: 6)
    assert budget.cpu_threads_per_worker(2) == 3


def test_a_fractional_quota_still_gets_one_core(monkeypatch):
    monkeypatch.setattr(budget, "cgroup_cpu_limit", lambda: 0.5)
    monkeypatch.setattr(budget, "_affinity_cpus", lambda: 8)
    assert budget.usable_cpus() == 1


# --------------------------------------------------------------------------------------------
# Fork server started early in a notebook kernel only
# --------------------------------------------------------------------------------------------

_PROBE = textwrap.dedent("""
    import psutil
    import course_utils
    from course_utils.workers import prewarm
    # The background start is decided at import: when it was, wait for it to finish; when it was
    # not, nothing can start a server later but a launch, so there is nothing to wait for.
    if prewarm._started.is_set():
        prewarm.wait_ready(90)
    servers = [p for p in psutil.Process().children() if "forkserver" in " ".join(p.cmdline())]
    print(len(servers), prewarm._started.is_set())
""")


def _probe(env: dict[str, str]) -> int:
    """The number of fork servers a fresh Python that imports course_utils (with ``env``) starts
    (the prewarm test below sees its server with the same test of the command line)."""
    full = {k: v for k, v in os.environ.items() if k not in ("COURSE_PREWARM", "COURSE_LAUNCHER")}
    full.update(env)
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         timeout=120, env=full, cwd=ROOT, check=True).stdout.split()
    return int(out[0])


def test_plain_python_and_test_processes_start_no_fork_server_on_import():
    assert _probe({}) == 0


def test_a_worker_or_a_torchrun_script_starts_none_even_when_asked():
    assert _probe({"COURSE_PREWARM": "1", "TORCHELASTIC_RUN_ID": "x"}) == 0
    assert _probe({"COURSE_PREWARM": "1", "COURSE_LAUNCHER": "1"}) == 0


def test_a_fork_server_starts_none_even_with_prewarm_asked_for():
    """A fork server has the kernel's environment, COURSE_PREWARM=1 included, and imports the package."""
    code = ("from multiprocessing.forkserver import main\n"
            "from course_utils.workers import prewarm\n"
            "print(prewarm.should_prewarm())")
    env = {k: v for k, v in os.environ.items() if k != "COURSE_LAUNCHER"}
    env["COURSE_PREWARM"] = "1"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=env, cwd=ROOT, check=True).stdout.split()
    assert out == ["False"], out


def _gone_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` has ended (or is a zombie nobody reaped yet) within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_prewarm_starts_the_fork_server_in_the_background_the_first_launch_uses_it_and_it_exits():
    """One prewarmed process: the server started at import, used by the first launch, gone after.

    The first launch is quick because it starts no server (about 0.1-0.3 s on a quiet 2-core
    machine, 2 s without prewarm): the test checks the cause, that its workers are the background
    server's children, not a time, which a loaded machine can stretch."""
    code = textwrap.dedent("""
        import json, os, psutil, course_utils
        from course_utils.workers import prewarm
        assert prewarm.wait_ready(90)  # the learner reads the notebook meanwhile
        servers = [p.pid for p in psutil.Process().children() if "forkserver" in " ".join(p.cmdline())]
        parents = course_utils.launch(os.getppid, 2, display=None)
        nested = [" ".join(c.cmdline()) for s in servers for c in psutil.Process(s).children()]
        print(json.dumps({"servers": servers, "parents": parents, "nested": nested}))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("COURSE_PREWARM", "COURSE_LAUNCHER")}
    env["COURSE_PREWARM"] = "1"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=env, cwd=ROOT, check=True).stdout.splitlines()
    servers, parents, nested = json.loads(out[-1]).values()
    assert len(servers) == 1, out  # started in the background, before any launch
    # The server has the process's environment (COURSE_PREWARM=1) and imports course_utils: it must
    # not prewarm a server of its own (it did, until should_prewarm recognised a fork server).
    assert nested == [], nested
    assert parents == [servers[0]] * 2, f"the first launch did not use the prewarmed server: {out}"
    # The process has exited: its fork server must be gone too (the autouse fixture checks this
    # process's own children; this one belonged to the finished process).
    assert _gone_within(servers[0], 10), "the prewarmed fork server outlived its process"


# --------------------------------------------------------------------------------------------
# Lines
# --------------------------------------------------------------------------------------------


def test_line_splitter_keeps_partial_lines_until_they_end():
    s = LineSplitter()
    assert s.feed(b"hel") == []
    assert s.feed(b"lo\nwor") == ["hello"]
    assert s.feed("ld \u00e9\r\nnext\n".encode()) == ["world \u00e9", "next"]
    assert s.feed(b"tail") == [] and s.flush() == ["tail"] and s.flush() == []


def test_the_hang_timeout_counts_from_the_start_of_the_function_not_of_the_worker():
    import slow_import_target

    # Importing the function's module takes 3 s in each worker: longer than the 1 s timeout, which
    # must not count it (a busy machine importing slowly is not a hang).
    out = launch(slow_import_target.quick, 2, timeout=1, display=None,
                 env={"COURSE_TEST_IMPORT_DELAY": "3"})
    assert out == [0, 1]


def test_a_worker_that_never_gets_to_start_still_times_out(monkeypatch):
    import slow_import_target

    from course_utils import WorkerTimeout
    from course_utils.workers import supervisor

    monkeypatch.setattr(supervisor, "STARTUP_GRACE", 1.0)
    t0 = time.monotonic()
    with pytest.raises(WorkerTimeout, match="slow_import_target"):
        launch(slow_import_target.quick, 2, timeout=1, display=None,
               env={"COURSE_TEST_IMPORT_DELAY": "30"})
    assert time.monotonic() - t0 < 15


def _fails_after_closing_its_group():
    """Rank 1 raises, but closes its connections first (a ``finally``), so rank 0's error, a closed
    connection, can reach the launcher before rank 1's own exception does."""
    dist.init_process_group("gloo")
    t = torch.ones(1 << 16)
    try:
        if dist.get_rank() == 1:
            raise ValueError("the cause, on rank 1")
        dist.recv(t, src=1)
    finally:
        dist.destroy_process_group()


def test_a_peers_echo_waits_for_the_cause():
    from course_utils import WorkerError

    for _ in range(3):
        with pytest.raises(WorkerError) as info:
            launch(_fails_after_closing_its_group, 2, timeout=30, display=None)
        cause = info.value.failures[1]
        assert cause.kind == "exception" and "the cause, on rank 1" in cause.message
        echo = info.value.failures[0]
        assert echo.kind == "stopped" or echo.is_echo, echo
