"""``run_commands``: every process a command starts ends with the command, the call or the caller.

Each test provokes it for real beside two busy loops (a loaded machine is where a slow keeper or a
missed orphan shows): a daemon (fork, setsid, fork) that keeps the output pipe and ignores SIGTERM,
torchrun's agent SIGKILLed under its worker, the caller SIGKILLed while its commands run a shell's
background jobs, a process that ignores SIGTERM and a daemon; and the scratch folders of callers
that died.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from course_utils import run_commands

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux process trees")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_for(path: Path, limit: float = 90.0) -> str:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if path.exists() and path.read_text().endswith("\n"):
            return path.read_text()
        time.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


# Forks, calls setsid, forks again: the grandchild ignores SIGTERM, keeps the output pipe open and
# sleeps; the command itself exits at once (code 0) once the daemon has written its pid.
DAEMON = """
import os, signal, sys, time
pidfile = sys.argv[1]
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with open(pidfile + ".tmp", "w") as f:
            f.write(f"{os.getpid()}\\n")
        os.rename(pidfile + ".tmp", pidfile)
        print("daemon up", flush=True)
        time.sleep(300)
    os._exit(0)
while not os.path.exists(pidfile):
    time.sleep(0.01)
print("command done", flush=True)
"""


def test_a_daemon_neither_holds_the_call_nor_outlives_it(tmp_path, two_busy_loops):
    pidfile = tmp_path / "daemon.pid"
    start = time.monotonic()
    (res,) = run_commands({"d": [sys.executable, "-c", DAEMON, str(pidfile)]}, timeout=120, echo=False)
    took = time.monotonic() - start
    daemon = int(pidfile.read_text())
    assert res.returncode == 0 and not res.timed_out, res
    assert "command done" in res.output and "daemon up" in res.output
    assert took < 60, f"the call waited {took:.0f} s for a daemon its command had left"
    assert not _alive(daemon), "the daemon outlived its command"


WORKER = """
import os, sys, time
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {os.getppid()}\\n")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(300)
"""


def test_torchruns_agent_sigkilled_takes_its_worker_along_and_the_call_returns(tmp_path, two_busy_loops):
    script, pidfile = tmp_path / "worker.py", tmp_path / "worker.pid"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           str(script), str(pidfile)]
    out: list = []
    call = threading.Thread(target=lambda: out.append(run_commands({"job": cmd}, timeout=240, echo=False)))
    call.start()
    try:
        worker, agent = map(int, _wait_for(pidfile, 180).split())
        os.kill(agent, signal.SIGKILL)
        killed = time.monotonic()
        call.join(120)
        took = time.monotonic() - killed
    finally:
        call.join()
    (res,) = out[0]
    assert res.returncode == -signal.SIGKILL and not res.timed_out, res
    assert took < 60, f"run_commands returned {took:.0f} s after the agent's death"
    assert not _alive(worker), "torchrun's worker outlived its agent"


DRIVER = """
import sys
from course_utils import run_commands
stubborn = '''
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(300)
    os._exit(0)
open(sys.argv[1], "w").close()
time.sleep(300)
'''
run_commands({"shell": ["sh", "-c", "sleep 91 & sleep 92 & wait"],
              "stubborn": [sys.executable, "-c", stubborn, sys.argv[1]]}, timeout=600, echo=False)
"""


def test_the_callers_sigkill_leaves_nothing_running_and_no_scratch_folder(tmp_path, two_busy_loops):
    ready = tmp_path / "ready"
    driver = subprocess.Popen([sys.executable, "-c", textwrap.dedent(DRIVER), str(ready)])
    try:
        end = time.monotonic() + 120
        tree: list[psutil.Process] = []
        while time.monotonic() < end:
            tree = psutil.Process(driver.pid).children(recursive=True)
            names = " ".join(" ".join(p.cmdline()) for p in tree if _alive(p.pid))
            if ready.exists() and "sleep 91" in names and "sleep 92" in names:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the commands never started")
        tree = psutil.Process(driver.pid).children(recursive=True)  # the daemon is in it by now
        sleeper = next(p for p in tree if "sleep 91" in " ".join(p.cmdline()))
        scratch = [Path(sleeper.environ()["TMPDIR"])]
        assert scratch[0].name.startswith("course-commands-") and scratch[0].is_dir()
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        _, alive = psutil.wait_procs(tree, timeout=10)
        alive = [p for p in alive if _alive(p.pid)]
        assert not alive, f"still running 10 s after the caller's death: {[p.cmdline() for p in alive]}"
        end = time.monotonic() + 5
        while any(p.exists() for p in scratch) and time.monotonic() < end:
            time.sleep(0.1)
        assert not any(p.exists() for p in scratch), "the dead caller's scratch folder was left behind"
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()


def test_the_scratch_folder_of_a_dead_caller_is_swept_on_the_next_call():
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = Path(tempfile.mkdtemp(prefix=f"course-commands-{gone.pid}-"))
    (stale / "torchelastic_x").mkdir()
    alive = Path(tempfile.mkdtemp(prefix=f"course-commands-{os.getppid()}-"))  # its owner lives
    try:
        (res,) = run_commands({"n": ["true"]}, timeout=30, echo=False)
        assert res.ok
        assert not stale.exists() or psutil.pid_exists(gone.pid)  # unless the pid was reused at once
        assert alive.exists()
    finally:
        for p in (stale, alive):
            if p.exists():
                subprocess.run(["rm", "-rf", str(p)], check=True)


PRINTER = """
import sys, time
me, start = sys.argv[1], float(sys.argv[2])
time.sleep(max(0.0, start - time.time() - 0.05))  # both print at the same time: wait without
while time.time() < start:                         # using a core, then spin the last 50 ms
    pass
for i in range(N):
    print(f"{me} line {i} = {i * 3}", flush=True)
"""
N = 20000


def test_two_processes_sharing_the_output_never_merge_lines(two_busy_loops):
    """As torchrun's workers do: two Python processes print into one pipe (chapter 00 showed
    ``... = 3rank 1 of 2 ...`` when each print was two writes); also with PYTHONUNBUFFERED=1."""
    code = PRINTER.replace("range(N)", f"range({N})")
    expected = {f"{me} line {i} = {i * 3}" for me in "ab" for i in range(N)}
    for env in ({}, {"PYTHONUNBUFFERED": "1"}):
        start = time.time() + 3
        both = f"{sys.executable} -c '{code}' a {start} & {sys.executable} -c '{code}' b {start} & wait"
        (res,) = run_commands({"two": ["sh", "-c", both]}, timeout=120, echo=False, env=env)
        lines = res.output.splitlines()
        bad = [line for line in lines if line not in expected]
        assert res.ok and not bad and len(lines) == 2 * N, (env, bad[:5], len(lines))


FREEZE_PROBE = """
import gc
before = gc.get_freeze_count()
runs = sum(s["collections"] for s in gc.get_stats())
import torch
runs = sum(s["collections"] for s in gc.get_stats()) - runs
after = gc.get_freeze_count()
on_after_torch = gc.isenabled()
import torch._dynamo
after_dynamo = gc.get_freeze_count()
class Node:
    pass
a, b = Node(), Node()
a.other, b.other = b, a  # a cycle created after the imports: the collector must still find it
del a, b
print("frozen", before, after, after_dynamo, "enabled", on_after_torch, gc.isenabled(),
      "collected", gc.collect(), "runs", runs)
"""


def test_a_commands_python_freezes_what_importing_torch_created_and_still_collects_the_rest():
    """``line_buffered/sitecustomize`` freezes the objects of torch's import and of torch._dynamo's
    (a quicker start and exit), after each import and not before, with the collector off during the
    imports and on again afterwards: garbage made later is still collected."""
    (res,) = run_commands({"probe": [sys.executable, "-c", FREEZE_PROBE]}, timeout=120, echo=False,
                          network="host")
    lines = [line.split() for line in res.output.splitlines() if line.startswith("frozen ")]
    assert res.ok and len(lines) == 1, res.output
    words = lines[0]
    before, after, after_dynamo, collected = int(words[1]), int(words[2]), int(words[3]), int(words[8])
    assert before == 0, f"frozen before torch was imported: {before} objects"
    assert after > 50_000, f"only {after} objects frozen after `import torch`"
    assert after_dynamo > after + 20_000, f"torch._dynamo's import froze {after_dynamo - after} objects"
    assert words[5:7] == ["True", "True"], f"the collector stayed off after an import: {words}"
    assert collected >= 2, "a cycle made after the imports was not collected"
    assert int(words[10]) == 0, f"the collector ran {words[10]} times while torch was imported"
