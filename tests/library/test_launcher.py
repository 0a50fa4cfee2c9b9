"""Every promise of course_utils.launch, each provoked for real."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from course_utils import RankFailure, WorkerError, WorkerTimeout, launch, report, run_commands
from course_utils.devices import choose_backend
from course_utils.workers import supervisor, tree
from course_utils.workers.errors import FailureKind

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
ENV_KEYS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
            "MASTER_PORT"]

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def _port_is_bound(port: int) -> bool:
    """Someone still listens on ``port`` (TIME_WAIT leftovers of closed connections do not count)."""
    return any(c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
               for c in psutil.net_connections("tcp"))


# ---------------------------------------------------------------- what workers get


def test_closures_and_local_classes_travel_to_workers():
    class Scale:  # defined inside the test: plain pickle cannot ship it
        def __init__(self, k):
            self.k = k

    offset = 100

    def work(s, extra=0):
        return int(os.environ["RANK"]) * s.k + offset + extra

    assert launch(work, 3, args=(Scale(10),), kwargs={"extra": 1}) == [101, 111, 121]


def test_torchrun_environment_and_default_init():
    def work():
        env = {k: os.environ[k] for k in ENV_KEYS}
        dist.init_process_group("gloo")  # env:// with nothing else, as under torchrun
        t = torch.ones(1)
        dist.all_reduce(t)
        dist.destroy_process_group()
        return env, t.item()

    out = launch(work, 2, nnodes=2)
    assert [o[1] for o in out] == [4.0] * 4
    envs = [o[0] for o in out]
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0", "1"]
    assert [e["GROUP_RANK"] for e in envs] == ["0", "0", "1", "1"]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"}
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"}
    assert len({e["MASTER_PORT"] for e in envs}) == 1


def test_same_function_runs_under_launch_and_torchrun(tmp_path):
    sys.path.insert(0, str(HERE))
    try:
        import launch_targets
        assert launch(launch_targets.rank_sum, 2) == [1.0, 1.0]
    finally:
        sys.path.remove(str(HERE))
    res = run_commands({"torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                     "--nproc_per_node=2", str(HERE / "launch_targets.py")]},
                       timeout=90, echo=False)[0]
    assert res.ok, res.output
    assert res.output.count("total=1.0") == 2


def test_workers_share_cores_instead_of_oversubscribing(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = launch(lambda: (torch.get_num_threads(), os.environ["OMP_NUM_THREADS"]), 2)
    want = max(1, (os.cpu_count() or 1) // 2)
    assert threads == [(want, str(want))] * 2


def test_extra_environment_and_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = launch(lambda: (os.getcwd(), os.environ["COURSE_TEST"]), 2, env={"COURSE_TEST": "yes"})
    assert out == [(str(tmp_path), "yes")] * 2


# ---------------------------------------------------------------- output


def test_output_arrives_as_rank_prefixed_whole_lines(capsys):
    def work():
        import sys as _sys

        rank = os.environ["RANK"]
        for i in range(3):
            print(f"line {i} from {rank}")
        _sys.stdout.write("no newline at the end")
        print(f"warning from {rank}", file=_sys.stderr)

    launch(work, 2)
    out, err = capsys.readouterr()
    for r in (0, 1):
        for i in range(3):
            assert f"[rank{r}] line {i} from {r}\n" in out
        assert f"[rank{r}] no newline at the end\n" in out
        assert f"[rank{r}] warning from {r}\n" in err


# ---------------------------------------------------------------- failures


def _logs_like_torchs_cpp_code() -> None:
    rank = os.environ["RANK"]
    print(f"[rank{rank}]:[W1201 05:14:27.291172993 reducer.cpp:1529] Warning: a C++ warning",
          file=sys.stderr, flush=True)


def test_a_cpp_log_line_names_its_rank_once(capsys):
    launch(_logs_like_torchs_cpp_code, 2, display=None)
    err = capsys.readouterr().err
    for r in (0, 1):
        assert f"[rank{r}] [W1201 05:14:27.291172993 reducer.cpp:1529] Warning: a C++ warning\n" in err
    assert "]:[W1201" not in err


def test_raising_rank_is_named_with_type_message_and_traceback():
    def work():
        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            raise ValueError("bad batch on purpose")
        dist.barrier()  # rank 0 blocks here; it must be stopped at once

    t0 = time.monotonic()
    with pytest.raises(WorkerError) as ei:
        launch(work, 2, timeout=60)
    assert time.monotonic() - t0 < 15
    e = ei.value
    assert e.failed_ranks == [1]
    assert e.failures[1].exc_type == "ValueError"
    msg = str(e)
    assert "rank 1 raised ValueError: bad batch on purpose" in msg
    assert "Traceback" in msg and "in work" in msg
    # Rank 0 is either stopped, or (under load) its barrier saw rank 1's connection close first.
    if e.failures[0].kind is FailureKind.STOPPED:
        assert "rank 0 was stopped by the launcher" in msg
    else:
        assert e.failures[0].echo_of == 1, e
        assert "rank 0 raised" in msg and "only because rank 1 failed first" in msg
    assert not isinstance(e, WorkerTimeout)


def _wait_until_gone(flag: str, limit: float = 30.0) -> None:
    """Wait (up to ``limit`` s) until the process whose pid rank 0 wrote to ``flag`` has exited."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if os.path.exists(flag) and (pid := Path(flag).read_text()):
            # /proc's state: "" once the process is gone, "Z" while nobody has reaped it (asking psutil
            # whether it exists and then for its status raced with the reaping: NoSuchProcess, once)
            if tree.state(int(pid)) in ("", "Z"):
                return
        time.sleep(0.01)


def _echoes_first_then_the_cause(flag: str) -> None:
    """Rank 0 raises a peer's echo at once; rank 1 raises the cause once rank 0's process is gone
    (so the echo is always seen first, however loaded the machine)."""
    if os.environ["RANK"] == "0":
        Path(flag).write_text(str(os.getpid()))
        raise RuntimeError("[pair.cc:534] Connection closed by peer [127.0.0.1]:4242")
    _wait_until_gone(flag)
    raise ValueError("the cause")


def test_a_peers_echo_is_reported_as_the_echo_of_the_cause(tmp_path):
    with pytest.raises(WorkerError) as ei:
        launch(_echoes_first_then_the_cause, 2, args=(str(tmp_path / "pid"),), timeout=30)
    e = ei.value
    assert e.failed_ranks == [1], e
    assert e.failures[0].echo_of == 1 and e.failures[0].short() == "echoed rank 1's failure"
    assert str(e).startswith("1 of 2 rank(s) failed; rank(s) 0 raised only because of it."), e
    assert "rank 1 raised ValueError: the cause" in str(e)


def test_a_rank_whose_exception_arrived_before_its_exit_was_seen_is_reported_with_it(monkeypatch):
    """The fork server reports a worker's exit only once it has reaped it, late on a loaded machine
    (two busy runs labelled the echo's rank 'killed after rank 1 failed'): a rank whose exception
    has been read counts as failed with it, not as stopped by the launcher."""
    import selectors
    import types

    from course_utils.workers.errors import RankResult

    monkeypatch.setattr(supervisor, "_kill_all", lambda ranks: None)
    echo = supervisor._Rank(0, types.SimpleNamespace(exitcode=None, pid=-1), {}, result=RankResult.raised(
        "RuntimeError", "[pair.cc:534] Connection closed by peer [127.0.0.1]:4242"))  # exit not seen yet
    cause = supervisor._Rank(1, types.SimpleNamespace(exitcode=1, pid=-1), {},
                             result=RankResult.raised("ValueError", "the cause"), exited=True)
    sup = supervisor._Supervisor([echo, cause], selectors.DefaultSelector(), supervisor._NoDisplay(), 2)
    with pytest.raises(WorkerError) as ei:
        sup._fail({1: cause.failure()})
    e = ei.value
    assert e.failures[0].echo_of == 1 and e.failures[0].short() == "echoed rank 1's failure", e.failures[0]
    assert "rank 1 raised ValueError: the cause" in str(e)


def test_the_summary_marks_an_echo_only_when_its_cause_is_known():
    from course_utils.workers.errors import failure_summary

    echo = RankFailure(0, "exception", "RuntimeError", "Connection closed by peer [127.0.0.1]:1")
    cause = RankFailure(1, "exception", "ValueError", "bad batch")
    failures = {0: echo, 1: cause, 2: RankFailure(2, "stopped")}
    assert failure_summary(failures, 3) == (
        "1 of 3 rank(s) failed; rank(s) 0 raised only because of it; the others were stopped.")
    assert echo.echo_of == 1 and cause.echo_of is None
    alone = RankFailure(0, "exception", "RuntimeError", "Connection closed by peer [127.0.0.1]:1")
    assert failure_summary({0: alone, 1: RankFailure(1, "stopped")}, 2) == (
        "1 of 2 rank(s) failed; the others were stopped.")
    assert alone.echo_of is None  # no cause known: the echo is all there is to show
    both = {0: RankFailure(0, "exception", "ValueError", "a"), 1: RankFailure(1, "signal", exitcode=-9)}
    assert failure_summary(both, 2) == "2 of 2 rank(s) failed."


def _returns_or_fails_once_rank0_is_gone(flag: str) -> str:
    """Rank 0 returns at once; rank 1 raises once rank 0's process has exited."""
    if os.environ["RANK"] == "0":
        Path(flag).write_text(str(os.getpid()))
        return "done"
    _wait_until_gone(flag)
    raise ValueError("late failure")


def test_a_rank_that_had_returned_is_stopped_as_finished_anyway(tmp_path):
    with pytest.raises(WorkerError) as ei:
        launch(_returns_or_fails_once_rank0_is_gone, 2, args=(str(tmp_path / "pid"),), timeout=60)
    done, failed = ei.value.failures[0], ei.value.failures[1]
    assert failed.kind is FailureKind.EXCEPTION and not failed.finished_anyway
    assert done.kind is FailureKind.STOPPED and done.finished_anyway, done
    assert done.message == "finished, but rank 1 failed"
    assert ei.value.failed_ranks == [1]


def test_failure_kinds_are_an_enum_that_still_compares_as_text():
    f = RankFailure(0, "stopped", message="killed after rank 1 failed")
    assert f.kind is FailureKind.STOPPED and f.kind == "stopped" and f"{f.kind}" == "stopped"
    assert not f.finished_anyway  # set by the launcher, never read from the message
    with pytest.raises(ValueError):
        RankFailure(0, "crashed")


def _three_reports() -> int:
    for i in range(3):
        report(step=i + 1)
    return int(os.environ["RANK"])


def test_the_workers_launcher_gives_reports_to_the_display_its_caller_makes():
    made = []

    class Sink:
        def __init__(self, world):
            self.world, self.got, self.failures, self.closed = world, [], None, False
            made.append(self)

        def update(self, rank, metrics):
            self.got.append((rank, metrics["step"]))

        def finish(self, failures):
            self.failures = dict(failures)

        def close(self):
            self.closed = True

    assert supervisor.launch(_three_reports, 2, display=Sink) == [0, 1]
    (sink,) = made
    assert sink.world == 2 and sink.failures == {} and sink.closed
    assert sorted(sink.got) == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]
    assert supervisor.launch(_three_reports, 2) == [0, 1]  # no display: reports are read and dropped


def test_os_exit_is_named_with_exit_code():
    def work():
        if os.environ["RANK"] == "1":
            os._exit(3)
        time.sleep(30)

    with pytest.raises(WorkerError, match="rank 1 exited with code 3"):
        launch(work, 2, timeout=60)


def test_sigkill_is_named_with_the_signal():
    def work():
        if os.environ["RANK"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(30)

    with pytest.raises(WorkerError, match="rank 0 was killed by SIGKILL"):
        launch(work, 2, timeout=60)


def test_unpicklable_result_and_argument_get_clear_messages():
    with pytest.raises(WorkerError, match="cannot be sent back to the notebook"):
        launch(lambda: threading.Lock(), 2)
    with pytest.raises(TypeError, match="could not send"):
        launch(lambda lock: None, 2, args=(threading.Lock(),))


def test_rank_that_skips_a_collective_times_out_with_stacks():
    def work():
        dist.init_process_group("gloo")
        if dist.get_rank() != 1:  # rank 1 skips the barrier and waits elsewhere
            dist.barrier()
        else:
            time.sleep(60)

    t0 = time.monotonic()
    with pytest.raises(WorkerTimeout) as ei:
        launch(work, 3, timeout=4)
    elapsed = time.monotonic() - t0
    assert 4 <= elapsed < 15
    e = ei.value
    assert sorted(e.failures) == [0, 1, 2]
    assert "Timed out after 4 s" in str(e)
    assert "barrier" in e.failures[0].stack and "in work" in e.failures[0].stack
    assert "sleep" not in e.failures[0].stack
    assert "in work" in e.failures[1].stack and "barrier" not in e.failures[1].stack


# ---------------------------------------------------------------- interrupt and kernel death

_DRIVER = textwrap.dedent("""
    import os, sys, time
    from course_utils import launch
    def work(path):
        with open(path + "." + os.environ["RANK"], "w") as f:
            f.write(str(os.getpid()) + " " + os.environ["MASTER_PORT"])
        time.sleep(120)
    try:
        launch(work, 2, args=(sys.argv[1],), timeout=300)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(7)
""")


def _default_sigint() -> None:
    """In the driver: Ctrl-C as in a fresh kernel, whatever this test process inherited or blocked
    (a SIGINT ignored or blocked here would be ignored by the driver too, and the test would hang)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _start_driver(tmp_path: Path, code: str = _DRIVER) -> tuple[subprocess.Popen, list[int], int]:
    script = tmp_path / "driver.py"
    script.write_text(code)
    marker = str(tmp_path / "pid")
    proc = subprocess.Popen([sys.executable, str(script), marker], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, preexec_fn=_default_sigint)
    return (proc, *_workers_of(marker))


def _workers_of(marker: str) -> tuple[list[int], int]:
    """The pids of the driver's two workers and their port, once both have written them."""
    deadline = time.monotonic() + 60
    files = [Path(f"{marker}.{r}") for r in (0, 1)]
    while not all(f.exists() and f.read_text() for f in files):
        assert time.monotonic() < deadline, "workers never started"
        time.sleep(0.1)
    pids, port = [], 0
    for f in files:
        pid, port_s = f.read_text().split()
        pids.append(int(pid))
        port = int(port_s)
    assert all(psutil.pid_exists(p) for p in pids) and _port_is_bound(port)
    return pids, port


def _wait_gone(pids: list[int], port: int, limit: float = 15.0, what: str = "") -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        alive = [p for p in pids if tree.state(p) not in ("", "Z")]  # gone, or a zombie (see above)
        if not alive and not _port_is_bound(port):
            return
        time.sleep(0.2)
    raise AssertionError(f"{what}: workers {alive} or port {port} survived")


# Like IPython, the driver keeps every KeyboardInterrupt (and so the frames of its traceback) and
# lives on after it; a second Ctrl-C that lands while launch cleans up must not stop the clean-up.
# One driver serves every round in turn, as one kernel would (a line on its stdin starts the next
# launch, whose workers write to "<marker>-<round>"): one Ctrl-C, then two Ctrl-C 2, 5 and 10 ms
# apart, then SIGKILL of the driver itself, like a kernel killed from JupyterLab or by the OOM killer.
ONE_CTRL_C, KILL = "one Ctrl-C", "SIGKILL"
ROUNDS = (ONE_CTRL_C, 0.002, 0.005, 0.01, KILL)
_KEEPING_DRIVER = _DRIVER.replace("""try:
    launch(work, 2, args=(sys.argv[1],), timeout=300)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(7)
""", """import signal
for round in range(ROUNDS):
    kept = []
    signal.signal(signal.SIGINT, signal.default_int_handler)
    while True:
        try:
            if not kept:
                launch(work, 2, args=(sys.argv[1] + (f"-{round}" if round else ""),), timeout=300)
            break
        except KeyboardInterrupt as e:
            kept.append(e)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    print("interrupted", len(kept), flush=True)
    sys.stdin.readline()
""".replace("ROUNDS", str(len(ROUNDS))))
assert _KEEPING_DRIVER != _DRIVER


def test_ctrl_c_once_or_twice_and_the_kernel_death_stop_every_worker_and_free_the_port(tmp_path):
    proc, pids, port = _start_driver(tmp_path, _KEEPING_DRIVER)
    try:
        for round, what in enumerate(ROUNDS):
            if round:
                proc.stdin.write("next\n")
                proc.stdin.flush()
                pids, port = _workers_of(f"{tmp_path / 'pid'}-{round}")
            if what == KILL:
                proc.kill()
                proc.wait()
            else:
                proc.send_signal(signal.SIGINT)
                if what != ONE_CTRL_C:
                    time.sleep(what)
                    proc.send_signal(signal.SIGINT)
                line = proc.stdout.readline()
                # launch raised KeyboardInterrupt to its caller, and nothing else did
                assert line.startswith("interrupted"), f"{what}: {line!r}"
                assert what != ONE_CTRL_C or line.split()[1] == "1", line
            _wait_gone(pids, port, what=str(what))  # while the driver lives on, holding the tracebacks
    finally:
        if proc.poll() is None:  # never leave the driver (and its workers) to the next test
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------- concurrency and leaks


def test_two_launches_at_once_never_collide():
    def work(tag):
        dist.init_process_group("gloo")
        t = torch.tensor([float(tag)])
        dist.all_reduce(t)
        time.sleep(0.5)
        dist.destroy_process_group()
        return t.item(), os.environ["MASTER_PORT"]

    results: dict[int, list] = {}
    threads = [threading.Thread(target=lambda k=k: results.__setitem__(k, launch(work, 2, args=(k,))))
               for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r[0] for r in results[1]] == [2.0, 2.0]
    assert [r[0] for r in results[2]] == [4.0, 4.0]
    assert results[1][0][1] != results[2][0][1]


def test_two_processes_launch_at_once(tmp_path):
    code = ("from course_utils import launch\nimport torch.distributed as dist, torch\n"
            "def w():\n    dist.init_process_group('gloo'); t=torch.ones(1); dist.all_reduce(t)\n"
            "    return t.item()\n"
            "print('OK', launch(w, 2))\n")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all("OK [2.0, 2.0]" in o for o in outs), outs


# A process of its own, which only launches: in the test process, whatever earlier tests of the
# same pytest worker left running there (threads, kernel clients) opened and closed descriptors
# while the launches ran, and loaded runs counted 334 against 335, then 325 against 322.
_HUNDRED_LAUNCHES = textwrap.dedent("""
    import json, os, signal, threading, time
    import psutil, torch, torch.distributed as dist
    from course_utils import launch

    def work():
        dist.init_process_group("gloo")
        t = torch.ones(4)
        dist.all_reduce(t)
        dist.destroy_process_group()
        return t.sum().item()

    def state():
        return {"fds": sorted(os.listdir("/proc/self/fd")), "threads": threading.active_count(),
                "children": sorted(p.pid for p in psutil.Process().children(recursive=True)),
                "rss": psutil.Process().memory_info().rss,
                "handlers": {str(s): str(signal.getsignal(s)) for s in signal.valid_signals()
                             if s not in (signal.SIGKILL, signal.SIGSTOP)}}

    launch(work, 2)  # warm up: starts the fork server once
    before = state()
    t0 = time.monotonic()
    results = [launch(work, 2) for _ in range(100)]
    per_launch = (time.monotonic() - t0) / 100
    print(json.dumps({"before": before, "after": state(), "results": results, "per_launch": per_launch}))
""")


def test_hundred_launches_leak_nothing():
    proc = subprocess.run([sys.executable, "-c", _HUNDRED_LAUNCHES], capture_output=True, text=True,
                          timeout=280, env={**os.environ, "COURSE_PREWARM": "0"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    before, after = out["before"], out["after"]
    assert out["results"] == [[8.0, 8.0]] * 100
    assert after["fds"] == before["fds"]
    assert after["threads"] == before["threads"]
    assert after["children"] == before["children"]
    assert after["rss"] - before["rss"] < 50 * 2**20
    assert after["handlers"] == before["handlers"]
    print(f"repeated launch: {out['per_launch'] * 1000:.0f} ms")


# ---------------------------------------------------------------- backend choice


def test_backend_choice_on_cpu_and_with_enough_gpus(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    c = choose_backend(2)
    assert (c.backend, c.device_type) == ("gloo", "cpu") and "no CUDA GPU" in c.reason
    assert "backend: gloo" in capsys.readouterr().out
    choose_backend(2)
    assert capsys.readouterr().out == ""  # said once
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert choose_backend(2, announce=False).backend == "gloo"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert choose_backend(2, announce=False).backend == "nccl"


def test_run_commands_kills_the_whole_tree_on_timeout():
    res = run_commands({"sleepy": ["bash", "-c", "sleep 300 & sleep 300"]}, timeout=1, echo=False)
    assert res[0].timed_out and res[0].returncode is None


def test_run_commands_gives_the_commands_a_temporary_folder_and_removes_it(tmp_path):
    """torchrun leaves its log folder in TMPDIR, and a killed process its files: both go."""
    script = 'mkdir "$TMPDIR/torchelastic_x" && echo "$TMPDIR" && sleep 300'
    (res,) = run_commands({"n": ["bash", "-c", script]}, timeout=2, echo=False)
    scratch = res.output.strip().splitlines()[0]
    assert res.timed_out and os.path.basename(scratch).startswith("course-commands-")
    assert not os.path.exists(scratch)
    (res,) = run_commands({"n": ["bash", "-c", 'echo "$TMPDIR"']}, env={"TMPDIR": str(tmp_path)},
                          echo=False)
    assert res.output.strip() == str(tmp_path)  # a caller's TMPDIR wins


def test_workers_see_debug_level_and_default_start_method():
    import multiprocessing

    def work():
        return str(dist.get_debug_level()), multiprocessing.get_start_method()

    out = launch(work, 2, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    expected_method = "fork" if sys.version_info < (3, 14) else "forkserver"
    assert out == [("DebugLevel.DETAIL", expected_method)] * 2


def test_leftover_fixture_counts_workers_but_not_the_fork_server(tmp_path):
    """The no_leftover_processes fixture must see a running worker (it shares the fork server's
    command line) while ignoring the fork server itself."""
    import conftest

    launch(lambda: None, 1)  # the fork server is up, and is not counted
    assert conftest._descendants() == set()
    marker = tmp_path / "pid"

    def slow():
        marker.write_text(str(os.getpid()))
        time.sleep(3)

    t = threading.Thread(target=launch, args=(slow, 1))
    t.start()
    try:
        deadline = time.monotonic() + 30
        while not (marker.exists() and marker.read_text()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert int(marker.read_text()) in conftest._descendants()
    finally:
        t.join()
    assert conftest._descendants() == set()


def test_stack_of_a_hang_after_return_still_says_something():
    from course_utils.workers.stacks import tidy_stack

    raw = ('Current thread 0x00007f (most recent call first):\n'
           '  File "/x/course_utils/workers/entry.py", line 240 in worker_main\n'
           '  File "/usr/lib/python3.11/multiprocessing/process.py", line 108 in run\n')
    text = tidy_stack(raw)
    assert "worker_main" in text and "del model" in text


def test_init_is_a_barrier_so_a_rank_leaving_at_once_cannot_break_the_others():
    """Without TORCH_DIST_INIT_BARRIER=1, a rank that inits and leaves at once made the slower
    rank's connectFullMesh fail ("Connection closed by peer") about 1 launch in 30 under load."""

    def init_and_leave():
        dist.init_process_group("gloo")
        dist.destroy_process_group()
        return os.environ["TORCH_DIST_INIT_BARRIER"]

    for _ in range(10):
        assert launch(init_and_leave, 4) == ["1"] * 4


INTERRUPTED_IN_IPYTHON = """
import os, signal, sys, threading, time
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
flag = sys.argv[1]
# Python's own Ctrl-C handler, as in a terminal or a kernel, even if this process was started with
# SIGINT ignored (a test run started in the background by a shell without job control).
signal.signal(signal.SIGINT, signal.default_int_handler)
shell.run_cell("from course_utils import launch\\nimport pathlib, time")
shell.run_cell(f"def work():\\n    pathlib.Path({flag!r}).touch()\\n    time.sleep(120)\\n")

def interrupt():
    while not os.path.exists(flag):
        time.sleep(0.05)
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGINT)

threading.Thread(target=interrupt, daemon=True).start()
print("=== cell", flush=True)
result = shell.run_cell("launch(work, 2, timeout=300)")
print("=== done", type(result.error_in_exec).__name__, flush=True)
"""


def test_an_interrupted_launch_shows_one_line_in_ipython_and_no_traceback(tmp_path):
    p = subprocess.run([sys.executable, "-c", INTERRUPTED_IN_IPYTHON, str(tmp_path / "started")],
                       capture_output=True, text=True, timeout=180)
    out = p.stdout.split("=== cell", 1)[-1]
    assert "=== done LaunchInterrupted" in out, p.stdout + p.stderr
    shown = [line for line in out.splitlines() if line.strip() and not line.startswith("===")]
    assert len(shown) == 1 and "KeyboardInterrupt" in shown[0] and "every worker was stopped" in shown[0], out
    assert "course_utils" not in p.stdout + p.stderr and "Traceback" not in p.stdout + p.stderr
