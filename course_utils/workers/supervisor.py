"""``launch``: run a function in real worker processes, the way ``torchrun`` would, from a notebook cell.

``launch(fn, nprocs)`` (which ``course_utils.launch`` calls, handing it the display) starts
``nprocs`` worker processes, gives each one the environment that ``torchrun`` gives its workers
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...), runs ``fn(*args, **kwargs)`` in
each, streams their output into the cell and returns their return values, indexed by global rank.

How it works, in the order things happen:

1. **Start method.** Workers are forked from a *fork server*: a fresh Python process, started once
   per kernel, that has imported ``torch`` and nothing else.  Forking from it is fast (no second
   ``import torch``) and safe: the fork server never ran OpenMP work or touched CUDA, which is what
   makes a plain ``fork`` of the notebook kernel hang or crash.  In a notebook kernel it is started
   in the background when ``course_utils`` is imported (``prewarm``).
2. **Payload.** ``fn`` and its arguments are serialised with ``cloudpickle``, which (unlike plain
   pickle) can ship functions and classes defined in a notebook cell.
3. **Rendezvous.** The launcher hosts the ``TCPStore`` itself, on a socket it binds to 127.0.0.1
   port 0: the operating system picks a free port, so two launches never collide, and nothing
   outside this machine can reach the store (it has no authentication).  Workers find it through
   ``MASTER_ADDR`` / ``MASTER_PORT`` and ``TORCHELASTIC_USE_AGENT_STORE=True``, exactly as under
   ``torchrun``, and gloo/NCCL are told to use the loopback interface.
4. **Supervision.** One loop in the calling thread reads every worker's stdout/stderr (printed as
   whole lines prefixed with the rank), results, progress reports (handed to the display its
   caller gave, if any; this package knows no display) and exit status.  When a rank
   fails, the others are killed at once (when the failure only echoes another rank's, such as a
   closed connection, after up to ``ECHO_GRACE`` seconds for the cause to arrive).  ``timeout``
   seconds after every rank has started the function (starting a worker, which may import
   modules, is not counted, up to ``STARTUP_GRACE`` seconds), the stuck ranks' Python stacks are
   collected (``faulthandler``) and they are killed.
5. **Clean-up.** Each worker runs in its own process group and is a child subreaper (``tree``):
   every process it starts, at any depth, stays in its process tree, also one that called
   ``setsid()`` or lost its parent.  What is guaranteed on Linux:

   - a worker whose function returned, raised or called ``sys.exit`` ends every process it started
     (SIGTERM, ``tree.GRACE`` seconds, SIGKILL) after sending its result and before it exits;
   - a worker the launcher stops (another rank failed, a timeout, an interrupt) is frozen with its
     whole tree (SIGSTOP, so nothing forks meanwhile) and SIGKILLed with it; a stopped (SIGSTOP)
     worker is killed like any other;
   - if the launcher (the notebook kernel) dies, a pipe closes and each worker's watchdog thread
     kills its descendants and its group; a stopped worker, whose thread cannot run, is SIGKILLed
     when the fork server exits with the kernel (``tree.die_with_parent``);
   - a worker that died of SIGKILL (its own, the OOM killer's) cannot end its tree, and init
     adopts its orphans: every worker's environment holds ``COURSE_LAUNCH_ID``, and at the end
     the launcher kills every process whose environment holds this launch's value;
   - not covered: such an orphan that cleared its environment or was forked without ``exec``
     (its ``/proc/PID/environ`` predates the variable), and a process that moved itself out of
     reach (another user, a ``PR_SET_CHILD_SUBREAPER`` of its own).

   On any exit from ``launch`` (success, failure, KeyboardInterrupt) every worker is reaped and
   every pipe and the store's socket are closed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import pickle
import selectors
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch.distributed as dist

from . import tree
from .entry import CLOSED_PIPES, NOT_SENT, STACK_SIGNAL, worker_main
from .errors import FailureKind, RankFailure, RankResult, WorkerError, WorkerTimeout, failure_summary
from .lines import LineSplitter
from .reports import STARTED, decode_frames
from .stacks import tidy_stack
from .startup import (
    dumps_payload,
    fork_server_context,
    free_port,
    linecache_snapshot,
    loopback_listener,
    main_module_hidden,
    start_fork_server,
    worker_env,
)

__all__ = ["launch", "Display", "free_port", "fork_server_context", "loopback_listener", "main_module_hidden"]

# --------------------------------------------------------------------------------------------
# One rank, as the launcher sees it
# --------------------------------------------------------------------------------------------

STREAMS = ("out", "err", "stack", "report", "result")


@dataclasses.dataclass
class _Rank:
    rank: int
    proc: Any
    parent_ends: dict  # stream name -> Connection kept by the launcher
    lines: dict = dataclasses.field(default_factory=lambda: {"out": LineSplitter(), "err": LineSplitter()})
    stack: bytes = b""
    result: RankResult | None = None
    exited: bool = False
    started: bool = False  # its function has started (the worker said so)
    report_buf: bytes = b""
    read_reports_after: float = 0.0  # see _Supervisor._pace_report_read

    @property
    def returned(self) -> bool:
        """Its function returned: its result has arrived.

        The process may still be exiting: a thread-group leader shows as a zombie while its
        other threads end, and the fork server reports the exit only once it has reaped it.
        """
        return self.result is not None and self.result.ok

    def failure(self) -> RankFailure | None:
        """How this rank failed, judged from its result and exit code (None: it did not fail)."""
        if self.result is not None:
            if self.result.ok:
                return None
            res = self.result
            return RankFailure(self.rank, FailureKind.EXCEPTION, exc_type=res.exc_type, message=res.message,
                               traceback=res.traceback)
        code = self.proc.exitcode
        if code is None:
            return None
        if code < 0:
            return RankFailure(self.rank, FailureKind.SIGNAL, exitcode=code)
        if code == 0:  # os._exit(0) before returning: treat as "returned None", as torchrun would
            self.result = RankResult()
            return None
        if code == CLOSED_PIPES:
            return RankFailure(self.rank, FailureKind.EXIT, exitcode=code, message=_CLOSED_PIPES)
        if code == NOT_SENT:
            return RankFailure(self.rank, FailureKind.EXIT, exitcode=code,
                               message="its function finished, but its result could not be sent back")
        return RankFailure(self.rank, FailureKind.EXIT, exitcode=code)


_CLOSED_PIPES = ("its code closed the file descriptors the launcher gave the worker (its output, "
                 "result and watch pipes; os.closerange does that), so it could neither be watched "
                 "nor send its result, and it ended: close only the descriptors your code opened")
FORK_SERVER_TRIES = 3


class ForkServerFailed(RuntimeError):
    """The fork server that workers are started from stopped answering (it was killed, or died)."""


def _start_rank(ctx: Any, rank: int, spec: dict, payload: bytes) -> tuple[_Rank, Any]:
    """Fork one worker from the fork server.  A fork server that died (killed, say) is noticed by
    multiprocessing only once it has been reaped: the request then fails with EOFError or a broken
    connection, so the start is tried again, and multiprocessing starts a new server."""
    for attempt in range(FORK_SERVER_TRIES):
        pipes = {n: ctx.Pipe(duplex=False) for n in STREAMS}
        alive_r, alive_w = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=worker_main,
            args=(spec, payload, *(pipes[n][1] for n in STREAMS), alive_r),
            name=f"course-rank{rank}",
            daemon=False,
        )
        try:
            with main_module_hidden():
                start_fork_server()  # a new one, with the interrupt of a kernel shutdown blocked
                proc.start()
            break
        except (EOFError, ConnectionError) as e:
            for conn in (alive_r, alive_w, *(c for pair in pipes.values() for c in pair)):
                conn.close()
            if attempt + 1 == FORK_SERVER_TRIES:
                raise ForkServerFailed(
                    f"the course's fork server, from which workers are started, stopped answering "
                    f"({type(e).__name__}) {FORK_SERVER_TRIES} times in a row; nothing of your code "
                    "ran. Run the cell again; if it happens again, restart the kernel.") from None
            time.sleep(0.3 * (attempt + 1))  # the dead server becomes reapable: a new one starts
    for _, w in pipes.values():
        w.close()  # the child has its own copy now
    alive_r.close()
    return _Rank(rank, proc, {n: p[0] for n, p in pipes.items()}), alive_w


# --------------------------------------------------------------------------------------------
# launch
# --------------------------------------------------------------------------------------------


class Display(Protocol):
    """Where a launch's progress reports go: one object per launch, made by the caller's factory."""

    def update(self, rank: int, metrics: dict) -> None: ...

    def finish(self, failures: dict[int, RankFailure]) -> None: ...

    def close(self) -> None: ...


class _NoDisplay:
    """Reports are read (the pipes must not fill up) and dropped."""

    def update(self, rank: int, metrics: dict) -> None:
        pass

    def finish(self, failures: dict[int, RankFailure]) -> None:
        pass

    def close(self) -> None:
        pass


def launch(
    fn: Callable[..., Any],
    nprocs: int = 2,
    *,
    args: Sequence[Any] = (),
    kwargs: dict | None = None,
    timeout: float = 120.0,
    nnodes: int = 1,
    env: dict[str, str] | None = None,
    display: Callable[[int], Display] | None = None,
    finish_within: float | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` in ``nnodes * nprocs`` worker processes; return their results.

    The parameters, results and errors are those of ``course_utils.launch`` (documented there),
    except ``display``: ``None`` (reports are read and dropped) or a factory that takes the world
    size and returns the launch's ``Display``.  ``display.update(rank, metrics)`` gets each report
    as it is read, ``display.finish(failures)`` the outcome (``{}`` when every rank returned),
    and ``display.close()`` is called last, whatever happened.  ``course_utils.launch`` passes
    ``course_utils.monitor.display_factory(display)``.
    """
    if not callable(fn):
        raise TypeError(f"launch() needs a function to run, got {type(fn).__name__}")
    if nprocs < 1 or nnodes < 1:
        raise ValueError("nprocs and nnodes must be at least 1")
    _check_seconds("timeout", timeout)
    if finish_within is not None:
        _check_seconds("finish_within", finish_within)
    try:
        payload = dumps_payload((fn, tuple(args), dict(kwargs or {})))
    except Exception as e:
        raise TypeError(
            f"launch() could not send {getattr(fn, '__name__', fn)!r} or its arguments to the "
            f"workers: {e}. Pass tensors, numbers and objects defined in Python code, not open "
            "files, locks or CUDA streams."
        ) from e

    world = nprocs * nnodes
    base_env = worker_env(world, env)
    ctx = fork_server_context()
    listener = loopback_listener()
    port = listener.getsockname()[1]
    try:
        store = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False,
                              master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the socket now, and closes it when it is freed
    common = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_RUN_ID": f"course-{os.getpid()}-{port}",
        "COURSE_LAUNCHER": "1",
        # Inherited by every program a worker starts: found again if its worker dies (tree.marked).
        MARKER: f"{os.getpid()}-{port}-{time.monotonic_ns()}",
    }
    cwd, sys_path, lines = os.getcwd(), list(sys.path), linecache_snapshot()

    ranks: list[_Rank] = []
    sel = selectors.DefaultSelector()
    alive_writers = []
    try:
        for rank in range(world):
            node, local = divmod(rank, nprocs)
            wenv = dict(base_env, **common, RANK=str(rank), LOCAL_RANK=str(local),
                        GROUP_RANK=str(node), ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(world))
            spec = {"rank": rank, "cwd": cwd, "sys_path": sys_path, "env": wenv, "linecache": lines}
            r, alive_w = _start_rank(ctx, rank, spec, payload)
            alive_writers.append(alive_w)
            ranks.append(r)
            for name, conn in r.parent_ends.items():
                sel.register(conn.fileno(), selectors.EVENT_READ, (r, name))
            sel.register(r.proc.sentinel, selectors.EVENT_READ, (r, "exit"))

        shown = display(world) if display is not None else _NoDisplay()
        return _Supervisor(ranks, sel, shown, world).run(timeout, finish_within)
    finally:
        try:
            with _interrupts_deferred():  # a second Ctrl-C must not cut the clean-up short
                _shutdown(ranks, sel, alive_writers)
                tree.kill_marked(MARKER, common[MARKER])  # what a dead worker left to init
        finally:
            # A kept traceback (IPython keeps the last one) holds this frame: the store must go
            # here, or its port stays bound as long as the kernel lives.
            del store


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Hold SIGINT back while the block runs; raise KeyboardInterrupt after it if one came."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals are delivered to the main thread only
        return
    came: list[Any] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: came.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if not came or previous == signal.SIG_IGN:
        return
    if callable(previous):
        previous(signal.SIGINT, came[0])  # Python's own handler raises KeyboardInterrupt
    else:  # SIG_DFL: what the signal would have done
        os.kill(os.getpid(), signal.SIGINT)


MARKER = "COURSE_LAUNCH_ID"


def _check_seconds(name: str, value: Any) -> None:
    """A time limit is a finite number of seconds above 0 (a bool, NaN or infinity is not)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise ValueError(f"launch({name}=...) takes a number of seconds above 0, got {value!r}")


STARTUP_GRACE = 60.0  # seconds a worker may take to start its function, beyond ``timeout``
# When the only failure so far is a peer's echo ("connection closed by peer"), the rank that caused
# it may still be sending its own exception (it closed its connections first, in a ``finally``):
# wait this long for it before stopping everyone, so that the cause is reported, not the echo.
ECHO_GRACE = 2.0
# A rank's reports are read in batches, at most every this many seconds (see _pace_report_read).
REPORT_READ_EVERY_S = 0.02


class _Supervisor:
    """The launcher's loop: forward output, collect results, detect failure and hangs."""

    def __init__(self, ranks: list[_Rank], sel: selectors.BaseSelector, display: Display, world: int):
        self.ranks, self.sel, self.display, self.world = ranks, sel, display, world

    def run(self, timeout: float, finish_within: float | None = None) -> list[Any]:
        deadline = time.monotonic() + STARTUP_GRACE + timeout  # until every rank has started
        all_started = False
        first_done: float | None = None
        echo_since: float | None = None
        try:
            while not all(r.exited for r in self.ranks):
                now = time.monotonic()
                if not all_started and all(r.started or r.exited for r in self.ranks):
                    all_started, deadline = True, min(deadline, now + timeout)
                remaining = deadline - now
                if remaining <= 0:
                    self._time_out(timeout)
                if first_done is None and any(r.returned for r in self.ranks):
                    first_done = now
                if finish_within is not None and first_done is not None:
                    if now - first_done > finish_within:
                        self._time_out(timeout, early_finish=finish_within)
                    remaining = min(remaining, first_done + finish_within - now + 0.01)
                for key, _ in self.sel.select(timeout=min(remaining, 0.2)):
                    self._handle(*key.data, key.fd)
                failed = [f for r in self.ranks if r.exited and (f := r.failure()) is not None]
                if failed and not all(f.is_echo for f in failed):
                    break
                if failed:  # only a peer's echo so far: its cause may still be on its way
                    echo_since = echo_since or now
                    if now - echo_since > ECHO_GRACE:
                        break
            # Gather output still in the pipes (a worker may exit before its last lines are read).
            self._drain(2.0 if any(not r.exited for r in self.ranks) else 5.0)
            failures = {r.rank: f for r in self.ranks if r.exited and (f := r.failure()) is not None}
            if failures:
                self._fail(failures)
            self.display.finish({})
            return [r.result.value for r in self.ranks]  # type: ignore[union-attr]
        finally:
            self.display.close()

    def _time_out(self, timeout: float, early_finish: float | None = None) -> None:
        failures = self._collect_stacks()
        stuck = ", ".join(str(r) for r in sorted(failures))
        if early_finish is None:
            summary = (f"Timed out after {timeout:g} s: rank(s) {stuck} still running. A rank stuck in "
                       "a collective usually means another rank skipped it or called a different one.")
        else:
            done = [r.rank for r in self.ranks if r.rank not in failures]
            summary = (f"Rank(s) {', '.join(map(str, done))} returned, but rank(s) {stuck} were still "
                       f"running {early_finish:g} s later: a rank that returns early leaves the others "
                       "waiting in a collective it never joins.")
            for r in done:
                failures[r] = RankFailure(r, FailureKind.STOPPED, message="finished, but others were stuck",
                                          finished_anyway=True)
        _kill_all(self.ranks)
        self.display.finish(failures)
        raise WorkerTimeout(failures, summary, early_finish)

    def _fail(self, failures: dict[int, RankFailure]) -> None:
        _kill_all(self.ranks)
        self._drain(1.0)
        # A rank whose own exception was still in its pipe when another rank's failure was seen
        # (under load, the echo of a failure can be read before its cause) failed too; also one
        # whose exception has been read but whose exit not yet: the fork server, which reaps it and
        # only then reports its exit code, can be late on a loaded machine (a rank 0 that raised
        # first was once reported as "killed after rank 1 failed").
        for r in self.ranks:
            if r.rank not in failures and r.result is not None and not r.result.ok:
                failures[r.rank] = r.failure()  # type: ignore[assignment]
        first = min(failures)
        for r in self.ranks:
            if r.rank not in failures:
                failures[r.rank] = RankFailure(
                    r.rank, FailureKind.STOPPED, finished_anyway=r.returned,
                    message=f"finished, but rank {first} failed" if r.returned
                    else f"killed after rank {first} failed")
        summary = failure_summary(failures, self.world)
        self.display.finish(failures)
        raise WorkerError(failures, summary)

    def _unregister(self, fd: int) -> None:
        if fd in self.sel.get_map():
            self.sel.unregister(fd)

    def _handle(self, r: _Rank, name: str, fd: int) -> None:
        if fd not in self.sel.get_map():
            return  # already finished earlier in this batch of events
        if name == "exit":
            self._unregister(fd)
            r.proc.join()
            # The result may still sit in its pipe: read it before judging the exit.
            conn = r.parent_ends["result"]
            if r.result is None and not conn.closed and conn.poll(0):
                self._handle(r, "result", conn.fileno())
            r.exited = True
            return
        conn = r.parent_ends[name]
        if name == "result":
            try:
                r.result = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                pass
            except Exception as e:  # a class the notebook cannot unpickle
                r.result = RankResult.raised("UnpicklingError", f"could not read rank {r.rank}'s result: {e}")
            self._unregister(fd)
            return
        if name == "report":
            self._pace_report_read(r)
        try:
            data = os.read(fd, 65536)
        except OSError:
            data = b""
        if not data:
            self._unregister(fd)
            if name in ("out", "err"):
                _emit(r.rank, name, r.lines[name].flush())
            return
        if name == "stack":
            r.stack += data
        elif name == "report":
            reports, r.report_buf = decode_frames(r.report_buf + data)
            for metrics in reports:
                if STARTED in metrics:
                    r.started = True
                else:
                    self.display.update(r.rank, metrics)
        else:
            _emit(r.rank, name, r.lines[name].feed(data))

    @staticmethod
    def _pace_report_read(r: _Rank) -> None:
        """Read a rank's reports in batches, at most every ``REPORT_READ_EVERY_S`` seconds.

        A worker's write into the pipe wakes the launcher, and on a machine whose cores are all
        training, each wake-up takes a core from a worker for a moment.  Measured on 2 cores with
        chapter 01's training reporting every step: reading each report as it came, a report()
        call took about 30 us (a step about 0.5 ms) and the launcher used about 40 us of CPU per
        report; reading every 20 ms, about 3-12 us and 7 us.  Letting the reports gather costs the
        display nothing it needs (it redraws a few times a second) and holds other output back
        by at most ``REPORT_READ_EVERY_S``.
        """
        now = time.monotonic()
        wait = r.read_reports_after - now
        if wait > 0:
            time.sleep(wait)
            now += wait
        r.read_reports_after = now + REPORT_READ_EVERY_S

    def _drain(self, limit: float) -> None:
        """Read what is left in the pipes of exited workers, for at most ``limit`` seconds."""
        end = time.monotonic() + limit
        while time.monotonic() < end:
            if not any(k.data[0].proc.exitcode is not None for k in self.sel.get_map().values()):
                return  # nothing left to read from a worker that has exited
            for key, _ in self.sel.select(timeout=0.05):
                self._handle(*key.data, key.fd)

    def _collect_stacks(self) -> dict[int, RankFailure]:
        """Ask every running rank for its Python stacks (faulthandler on STACK_SIGNAL), wait briefly."""
        stuck = [r for r in self.ranks if not r.exited and r.proc.exitcode is None]
        for r in stuck:
            with contextlib.suppress(ProcessLookupError):
                os.kill(r.proc.pid, STACK_SIGNAL)
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            for key, _ in self.sel.select(timeout=0.1):
                rr, name = key.data
                if name != "exit":
                    self._handle(rr, name, key.fd)
            if all(r.stack.count(b"\n") >= 2 for r in stuck) and time.monotonic() > end - 1.0:
                break
        return {r.rank: RankFailure(r.rank, FailureKind.TIMEOUT,
                                    stack=tidy_stack(r.stack.decode(errors="replace")),
                                    message=_no_stack_reason(r, set(self.sel.get_map())))
                for r in stuck}


def _no_stack_reason(r: _Rank, still_read: set[int]) -> str:
    """Why a stuck rank sent no stack ("" when it sent one); ``still_read``: the fds not at EOF."""
    if tree.state(r.proc.pid) == "T":
        return _STOPPED
    if r.stack.strip():
        return ""
    if r.parent_ends["stack"].closed or r.parent_ends["stack"].fileno() not in still_read:
        return ("its stack could not be collected: it closed the pipe its stack is sent through "
                "(os.closerange, or closing descriptors it did not open); the launcher killed it")
    bit = 1 << (STACK_SIGNAL - 1)
    masks = _signal_masks(r.proc.pid)
    if masks.get("SigBlk", 0) & bit or masks.get("SigIgn", 0) & bit:
        return (f"its stack could not be collected: it blocks or ignores signal {STACK_SIGNAL}, which "
                "asks a worker for its stack (signal.pthread_sigmask or SIG_IGN on every signal?); "
                "the launcher killed it")
    return ("its stack could not be collected: it did not answer the request for it within 1.5 s "
            "(its main thread may be running C code that never lets Python run); the launcher killed it")


def _signal_masks(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("SigBlk", "SigIgn"):
                out[key] = int(value.strip(), 16)
    return out


_STOPPED = ("it was stopped by a signal (state T: SIGSTOP, SIGTSTP, or a debugger), so it could "
            "neither run nor dump its stack; the launcher killed it")


def _emit(rank: int, name: str, lines: list[str]) -> None:
    """Print whole lines from one worker, each prefixed with its rank.

    torch's C++ log lines already start with ``[rankN]:`` (``[rank0]:[W1201 ...] Warning: ...``):
    that prefix is dropped, so that the line does not name its rank twice.
    """
    if not lines:
        return
    stream = sys.stdout if name == "out" else sys.stderr
    own = f"[rank{rank}]:"
    stream.write("".join(f"[rank{rank}] {line.removeprefix(own)}\n" for line in lines))
    stream.flush()


def _kill_all(ranks: list[_Rank]) -> None:
    for r in ranks:
        if r.proc.exitcode is None:
            tree.kill_tree(r.proc.pid)  # the worker and every descendant, setsid'd ones included
            try:
                os.killpg(r.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                with contextlib.suppress(Exception):
                    r.proc.kill()


def _shutdown(ranks: list[_Rank], sel: selectors.BaseSelector, alive_writers: list) -> None:
    """Whatever happened: no worker left running, no pipe left open."""
    _kill_all(ranks)
    for w in alive_writers:
        w.close()
    for r in ranks:
        r.proc.join(timeout=10)
        if r.proc.exitcode is None:  # should not happen: SIGKILL cannot be ignored
            r.proc.kill()
            r.proc.join(timeout=5)
        for conn in r.parent_ends.values():
            conn.close()
        with contextlib.suppress(ValueError):
            r.proc.close()
    sel.close()
