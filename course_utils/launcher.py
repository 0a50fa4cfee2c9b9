"""Run a function in real worker processes, the way ``torchrun`` would, from a notebook cell.

``launch(fn, nprocs)`` starts ``nprocs`` worker processes, gives each one the environment that
``torchrun`` gives its workers (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...), runs
``fn(*args, **kwargs)`` in each, streams their output into the cell and returns their return
values, indexed by global rank.

How it works, in the order things happen:

1. **Start method.** Workers are forked from a *fork server*: a fresh Python process, started once
   per kernel, that has imported ``torch`` and nothing else.  Forking from it is fast (no second
   ``import torch``) and safe: the fork server never ran OpenMP work or touched CUDA, which is what
   makes a plain ``fork`` of the notebook kernel hang or crash.
2. **Payload.** ``fn`` and its arguments are serialised with ``cloudpickle``, which (unlike plain
   pickle) can ship functions and classes defined in a notebook cell.
3. **Rendezvous.** The launcher hosts the ``TCPStore`` itself on port 0, so the operating system
   picks a free port and two launches never collide.  Workers find it through ``MASTER_ADDR`` /
   ``MASTER_PORT`` and ``TORCHELASTIC_USE_AGENT_STORE=True``, exactly as under ``torchrun``.
4. **Supervision.** One loop in the calling thread reads every worker's stdout/stderr (printed as
   whole lines prefixed with the rank), results, progress reports and exit status.  When a rank
   fails, the others are killed at once; after ``timeout`` seconds the stuck ranks' Python stacks
   are collected (``faulthandler``) and they are killed.
5. **Clean-up.** Each worker runs in its own process group and watches a pipe from the launcher: if
   the launcher (the notebook kernel) dies, the pipe closes and the worker kills its whole group.
   On any exit from ``launch`` (success, failure, KeyboardInterrupt) every worker is reaped and
   every pipe and the store's port are closed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import linecache
import multiprocessing
import multiprocessing.connection
import os
import pickle
import selectors
import signal
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "launch",
    "WorkerError",
    "WorkerTimeout",
    "RankFailure",
    "free_port",
    "cpu_threads_per_worker",
    "run_commands",
    "CommandResult",
    "CommandFailed",
]

# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RankFailure:
    """What happened to one rank that did not return normally."""

    rank: int
    kind: str  # "exception", "exit", "signal", "timeout", "stopped"
    exc_type: str = ""
    message: str = ""
    traceback: str = ""
    exitcode: int | None = None
    stack: str = ""

    def describe(self) -> str:
        if self.kind == "exception":
            head = f"rank {self.rank} raised {self.exc_type}: {self.message}"
            return head + ("\n" + _indent(self.traceback) if self.traceback else "")
        if self.kind == "signal":
            sig = -(self.exitcode or 0)
            try:
                name = signal.Signals(sig).name
            except ValueError:
                name = f"signal {sig}"
            return f"rank {self.rank} was killed by {name}" + (
                " (out of memory? the kernel's OOM killer sends SIGKILL)" if name == "SIGKILL" else ""
            )
        if self.kind == "exit":
            return f"rank {self.rank} exited with code {self.exitcode} without returning a result"
        if self.kind == "timeout":
            where = _indent(self.stack) if self.stack else "  (no Python stack could be collected)"
            return f"rank {self.rank} was still running; it was stuck here:\n{where}"
        return f"rank {self.rank} was stopped by the launcher ({self.message})"


class WorkerError(RuntimeError):
    """One or more worker processes failed.  ``failures`` maps each failed rank to a RankFailure."""

    def __init__(self, failures: dict[int, RankFailure], summary: str):
        self.failures = failures
        self.summary = summary
        details = "\n".join(f.describe() for f in sorted(failures.values(), key=lambda f: f.rank))
        super().__init__(f"{summary}\n{details}")

    @property
    def failed_ranks(self) -> list[int]:
        """Ranks that failed by themselves (not the ones the launcher stopped afterwards)."""
        return sorted(r for r, f in self.failures.items() if f.kind != "stopped")


class WorkerTimeout(WorkerError):
    """The workers did not finish within ``timeout`` seconds; the stuck ranks' stacks are attached."""


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.rstrip().splitlines())


# --------------------------------------------------------------------------------------------
# Small public helpers
# --------------------------------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    """Ask the operating system for a TCP port that is free right now.

    Use it for ``init_method="tcp://..."`` demos.  Another program could take the port between
    this call and its use; the launcher avoids that race by binding its store to port 0 itself.
    """
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def cpu_threads_per_worker(total_workers: int) -> int:
    """Intra-op threads each worker gets so that all workers together use each core once."""
    return max(1, (os.cpu_count() or 1) // max(1, total_workers))


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------

# Set in a worker by _worker_main; read by course_utils.monitor.report.
_REPORT_FD: int | None = None
_REPORT_MAX = 4096  # pipe writes up to PIPE_BUF bytes are atomic: a report is never half-written
_REPORT_PIPE_BYTES = (1 << 20, 1 << 18)  # pipe sizes to ask for (Linux default: 64 KiB)
_report_state: dict = {"fd": None, "pending": None, "dropped": 0, "lock": None, "flusher": None}


def send_report(metrics: dict) -> bool:
    """Send one progress report from a worker to the launching notebook, never blocking.

    Returns False when not inside ``launch``, or when the report could not be written now.

    The pipe is enlarged to 1 MiB where the system allows (some 10,000 reports), and the launcher
    empties it continuously, so normally every report arrives, in order.  If the notebook falls
    so far behind that the pipe is full, the report is held back instead of blocking training:
    only the newest held-back report is kept (the ones it replaces are intermediate values,
    dropped by design and counted in ``_report_state["dropped"]``), it is written before the next
    report, and a helper thread writes it as soon as the notebook has read, so that a rank's last
    report still arrives when training ends while the pipe is full.  (It is lost only if the
    worker exits before the notebook reads anything more.)
    """
    fd = _REPORT_FD
    if fd is None:
        return False
    body = pickle.dumps(metrics, protocol=pickle.HIGHEST_PROTOCOL)
    frame = struct.pack("<I", len(body)) + body
    if len(frame) > _REPORT_MAX:
        raise ValueError("a report must be a few numbers and short strings (under 4 KiB pickled)")
    st = _report_state
    if st["fd"] != fd:  # first report of this worker
        st.update(fd=fd, pending=None, dropped=0, lock=threading.Lock(), flusher=None)
        import fcntl

        for size in _REPORT_PIPE_BYTES:
            try:
                fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, size)
                break
            except (OSError, AttributeError):
                continue
    with st["lock"]:
        if st["pending"] is not None and not _write_report(fd, st["pending"]):
            st["pending"] = frame  # the held-back one was an intermediate value: replace it
            st["dropped"] += 1
            return False
        st["pending"] = None
        if _write_report(fd, frame):
            return True
        st["pending"] = frame
        if st["flusher"] is None or not st["flusher"].is_alive():
            st["flusher"] = threading.Thread(target=_flush_reports, args=(fd,),
                                             name="report-flusher", daemon=True)
            st["flusher"].start()
        return False


def _write_report(fd: int, frame: bytes) -> bool:
    """One non-blocking, all-or-nothing write (frames are at most PIPE_BUF bytes)."""
    try:
        os.write(fd, frame)
        return True
    except BlockingIOError:
        return False
    except OSError:  # the launcher is gone; the watchdog ends this worker
        return True


def _flush_reports(fd: int) -> None:
    """Worker thread: write the held-back report as soon as the pipe has room, then end."""
    import select

    st = _report_state
    while True:
        with st["lock"]:
            if st["pending"] is None:
                return
        try:
            select.select([], [fd], [], 0.5)
        except (OSError, ValueError):
            return
        with st["lock"]:
            if st["pending"] is not None and _write_report(fd, st["pending"]):
                st["pending"] = None


def _worker_main(
    spec: dict,
    payload: bytes,
    out_w: multiprocessing.connection.Connection,
    err_w: multiprocessing.connection.Connection,
    stack_w: multiprocessing.connection.Connection,
    report_w: multiprocessing.connection.Connection,
    result_w: multiprocessing.connection.Connection,
    alive_r: multiprocessing.connection.Connection,
) -> None:
    """Entry point of every worker process (runs in the child, forked from the fork server)."""
    global _REPORT_FD
    os.setpgid(0, 0)  # own process group: the launcher can kill the worker and its children
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the notebook's interrupt is the launcher's job

    # Die with the launcher: when it exits, the write end of this pipe closes and read() returns.
    alive_fd = alive_r.fileno()

    def _watch_parent() -> None:
        try:
            while os.read(alive_fd, 1):
                pass
        except OSError:
            pass
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=_watch_parent, name="launcher-watchdog", daemon=True).start()

    # stdout / stderr go to the launcher line by line.
    os.dup2(out_w.fileno(), 1)
    os.dup2(err_w.fileno(), 2)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0), line_buffering=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", buffering=0), line_buffering=True)
    out_w.close()
    err_w.close()

    # On SIGUSR1 (sent on timeout) dump every thread's Python stack to the stack pipe.
    import faulthandler

    stack_file = os.fdopen(stack_w.fileno(), "w", closefd=False)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)

    report_fd = report_w.fileno()
    os.set_blocking(report_fd, False)
    _REPORT_FD = report_fd

    # Look like the launching kernel: its working directory, import path and environment.
    os.chdir(spec["cwd"])
    sys.path[:] = spec["sys_path"]
    os.environ.clear()
    os.environ.update(spec["env"])
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    for name, text in spec["linecache"].items():
        linecache.cache[name] = (len(text), None, text.splitlines(True), name)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    # torch read TORCH_DISTRIBUTED_DEBUG when the fork server imported it: read it again now.
    dist.set_debug_level_from_env()
    # Children of this worker (DataLoader workers) start the way they would under torchrun: the
    # platform's default method, not the fork server this worker came from.
    import multiprocessing as _mp

    _mp.set_start_method("fork" if sys.version_info < (3, 14) else "forkserver", force=True)

    status: tuple
    try:
        fn, args, kwargs = pickle.loads(payload)
        value = fn(*args, **kwargs)
        status = ("ok", value)
    except SystemExit as e:  # sys.exit(0) in a worker counts as success, like under torchrun
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        status = ("ok", None) if code == 0 else ("exc", "SystemExit", f"exit code {code}", "")
    except BaseException as e:  # noqa: BLE001 - everything must reach the notebook
        # Drop this bootstrap frame: the learner's code starts one level down.
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))
        status = ("exc", type(e).__name__, str(e), tb)

    import cloudpickle

    try:
        data = cloudpickle.dumps(status)
    except Exception as e:  # the return value could not be pickled
        data = cloudpickle.dumps(
            ("exc", "PicklingError", f"the return value of rank {spec['rank']} cannot be sent "
             f"back to the notebook ({e}); return tensors, numbers, lists or dicts", "")
        )
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        result_w.send_bytes(data)
    finally:
        os._exit(0)


# --------------------------------------------------------------------------------------------
# Launcher side
# --------------------------------------------------------------------------------------------

_ctx_lock = threading.Lock()
_ctx: Any = None


def _context():
    """The fork-server context, created once per process, preloading torch into the server."""
    global _ctx
    with _ctx_lock:
        if _ctx is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(["course_utils._preload"])
            _ctx = ctx
        return _ctx


def _dumps(obj: Any) -> bytes:
    """cloudpickle, keeping each function's source file name (for example a notebook cell's).

    cloudpickle replaces the file name of the code it ships by value with "<dynamic-code>";
    keeping the real one lets worker tracebacks point at, and quote, the cell that failed.
    """
    import types
    from collections import ChainMap

    import cloudpickle
    from cloudpickle import cloudpickle as cp

    def code_reduce(code: types.CodeType):
        ctor, args = cp._code_reduce(code)
        return ctor, tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)

    class _Pickler(cloudpickle.Pickler):
        dispatch_table = ChainMap({types.CodeType: code_reduce}, cloudpickle.Pickler.dispatch_table)

    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


@contextlib.contextmanager
def _main_module_hidden():
    """Stop multiprocessing from re-running the caller's script in every worker.

    multiprocessing normally re-imports ``__main__`` in each child so that pickled references to
    its functions resolve.  cloudpickle already ships those functions by value, so re-running a
    script (or pytest's entry point) in every worker would only cost time and repeat side effects.
    """
    main = sys.modules.get("__main__")
    with _ctx_lock:
        saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main and k in main.__dict__}
        try:
            if main is not None:
                main.__dict__.pop("__file__", None)
                main.__dict__["__spec__"] = None
            yield
        finally:
            if main is not None:
                main.__dict__.pop("__spec__", None)
                main.__dict__.update(saved)


def _linecache_snapshot(limit: int = 2_000_000) -> dict[str, str]:
    """Source of notebook cells (which exist only in memory) so worker tracebacks show code."""
    snap: dict[str, str] = {}
    size = 0
    for name, entry in list(linecache.cache.items()):
        if len(entry) != 4 or not isinstance(entry[2], list) or os.path.exists(name):
            continue
        text = "".join(entry[2])
        size += len(text)
        if size > limit:
            break
        snap[name] = text
    return snap


@dataclasses.dataclass
class _Rank:
    rank: int
    proc: Any
    parent_ends: dict  # name -> Connection kept by the launcher
    partial: dict  # stream name -> bytes not yet ending in a newline
    stack: bytes = b""
    result: tuple | None = None
    exited: bool = False
    report_buf: bytes = b""


def launch(
    fn: Callable[..., Any],
    nprocs: int = 2,
    *,
    args: Sequence[Any] = (),
    kwargs: dict | None = None,
    timeout: float = 120.0,
    nnodes: int = 1,
    env: dict[str, str] | None = None,
    display: Any = "auto",
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` in ``nnodes * nprocs`` worker processes; return their results.

    Parameters
    ----------
    fn:
        Any function, including one defined in a notebook cell.  It runs once per rank and can
        call ``torch.distributed.init_process_group(backend)`` with no other arguments.
    nprocs:
        Worker processes per (simulated) node, like ``torchrun --nproc_per_node``.
    args, kwargs:
        Passed to ``fn``; notebook-defined classes and closures are fine.
    timeout:
        Seconds before the launch is declared hung: the stuck ranks' stacks are shown and the
        workers are killed (``WorkerTimeout``).
    nnodes:
        Simulated nodes.  Ranks are laid out node by node: node ``g`` holds global ranks
        ``g*nprocs ... g*nprocs + nprocs - 1`` with ``GROUP_RANK=g``.
    env:
        Extra environment variables for every worker (for example ``{"TORCH_DISTRIBUTED_DEBUG":
        "DETAIL"}``).
    display:
        Where progress reports sent with ``course_utils.report`` go: ``"auto"`` (a live display
        created on the first report), ``None`` (ignored), or an object with ``update(rank,
        metrics)`` and ``finish(failures)`` methods.

    Returns
    -------
    list
        ``fn``'s return value on each rank, indexed by global rank.

    Raises
    ------
    WorkerError
        A rank raised, exited non-zero or was killed; the message names each rank and why.
    WorkerTimeout
        Some ranks were still running after ``timeout`` seconds.
    """
    if not callable(fn):
        raise TypeError(f"launch() needs a function to run, got {type(fn).__name__}")
    if nprocs < 1 or nnodes < 1:
        raise ValueError("nprocs and nnodes must be at least 1")
    import torch.distributed as dist

    try:
        payload = _dumps((fn, tuple(args), dict(kwargs or {})))
    except Exception as e:
        raise TypeError(
            f"launch() could not send {getattr(fn, '__name__', fn)!r} or its arguments to the "
            f"workers: {e}. Pass tensors, numbers and objects defined in Python code, not open "
            "files, locks or CUDA streams."
        ) from e

    world = nprocs * nnodes
    base_env = dict(os.environ)
    if env:
        base_env.update({k: str(v) for k, v in env.items()})
    base_env.setdefault("OMP_NUM_THREADS", str(cpu_threads_per_worker(world)))
    # init_process_group returns on one rank before the others have finished connecting; a rank
    # that then leaves at once (no collective, destroy_process_group) makes gloo's connectFullMesh
    # fail on the slower rank with "Connection closed by peer".  The store-based barrier that
    # torch runs at the end of init when this is 1 closes that race, for one store round trip.
    base_env.setdefault("TORCH_DIST_INIT_BARRIER", "1")
    base_env["MPLBACKEND"] = "Agg"
    base_env["PYTHONUNBUFFERED"] = "1"

    ctx = _context()
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    common = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_RUN_ID": f"course-{os.getpid()}-{store.port}",
        "COURSE_LAUNCHER": "1",
    }
    cwd, sys_path, lines = os.getcwd(), list(sys.path), _linecache_snapshot()

    ranks: list[_Rank] = []
    sel = selectors.DefaultSelector()
    alive_writers = []
    try:
        for rank in range(world):
            node, local = divmod(rank, nprocs)
            wenv = dict(base_env, **common, RANK=str(rank), LOCAL_RANK=str(local),
                        GROUP_RANK=str(node), ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(world))
            spec = {"rank": rank, "cwd": cwd, "sys_path": sys_path, "env": wenv, "linecache": lines}
            pipes = {n: ctx.Pipe(duplex=False) for n in ("out", "err", "stack", "report", "result")}
            alive_r, alive_w = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_worker_main,
                args=(spec, payload, pipes["out"][1], pipes["err"][1], pipes["stack"][1],
                      pipes["report"][1], pipes["result"][1], alive_r),
                name=f"course-rank{rank}",
                daemon=False,
            )
            with _main_module_hidden():
                proc.start()
            for _, w in pipes.values():
                w.close()  # the child has its own copy now
            alive_r.close()
            alive_writers.append(alive_w)
            r = _Rank(rank, proc, {n: p[0] for n, p in pipes.items()}, {"out": b"", "err": b""})
            ranks.append(r)
            for name, conn in r.parent_ends.items():
                sel.register(conn.fileno(), selectors.EVENT_READ, (r, name))
            sel.register(proc.sentinel, selectors.EVENT_READ, (r, "exit"))

        results = _supervise(ranks, sel, timeout, display, world)
        return results
    finally:
        _shutdown(ranks, sel, alive_writers)
        del store


def _supervise(ranks: list[_Rank], sel, timeout: float, display: Any, world: int) -> list[Any]:
    """The launcher's loop: forward output, collect results, detect failure and hangs."""
    deadline = time.monotonic() + timeout
    failures: dict[int, RankFailure] = {}
    live = _DisplayHolder(display, world)
    try:
        while not all(r.exited for r in ranks):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                failures = _collect_stacks(ranks, sel, live)
                summary = (
                    f"Timed out after {timeout:g} s: rank(s) "
                    f"{', '.join(str(r) for r in sorted(failures))} still running. A rank stuck in "
                    "a collective usually means another rank skipped it or called a different one."
                )
                _kill_all(ranks)
                live.finish(failures)
                raise WorkerTimeout(failures, summary)
            for key, _ in sel.select(timeout=min(remaining, 0.2)):
                r, name = key.data
                _handle(r, name, key.fd, sel, live)
            failed = [r for r in ranks if r.exited and _failure_of(r) is not None]
            if failed:
                break
        # Gather output still in the pipes (a worker may exit before its last lines are read).
        _drain(ranks, sel, live, 2.0 if any(not r.exited for r in ranks) else 5.0)
        for r in ranks:
            f = _failure_of(r) if r.exited else None
            if f is not None:
                failures[r.rank] = f
        if failures:
            first = min(failures)
            _kill_all(ranks)
            _drain(ranks, sel, live, 1.0)
            for r in ranks:
                if r.rank not in failures:
                    failures[r.rank] = RankFailure(
                        r.rank, "stopped",
                        message=f"killed after rank {first} failed" if not r.exited or r.result is None
                        else f"finished, but rank {first} failed")
            summary = (f"{len([f for f in failures.values() if f.kind != 'stopped'])} of {world} "
                       "rank(s) failed; the others were stopped.")
            live.finish(failures)
            raise WorkerError(failures, summary)
        live.finish({})
        return [r.result[1] for r in ranks]  # type: ignore[index]
    finally:
        live.close()


def _failure_of(r: _Rank) -> RankFailure | None:
    if r.result is not None:
        if r.result[0] == "ok":
            return None
        _, etype, msg, tb = r.result
        return RankFailure(r.rank, "exception", exc_type=etype, message=msg, traceback=tb)
    code = r.proc.exitcode
    if code is None:
        return None
    if code < 0:
        return RankFailure(r.rank, "signal", exitcode=code)
    if code == 0:  # os._exit(0) before returning: treat as "returned None", as torchrun would
        r.result = ("ok", None)
        return None
    return RankFailure(r.rank, "exit", exitcode=code)


def _unregister(sel, fd: int) -> None:
    if fd in sel.get_map():
        sel.unregister(fd)


def _handle(r: _Rank, name: str, fd: int, sel, live: _DisplayHolder) -> None:
    if fd not in sel.get_map():
        return  # already finished earlier in this batch of events
    if name == "exit":
        _unregister(sel, fd)
        r.proc.join()
        # The result may still sit in its pipe: read it before judging the exit.
        conn = r.parent_ends["result"]
        if r.result is None and not conn.closed and conn.poll(0):
            _handle(r, "result", conn.fileno(), sel, live)
        r.exited = True
        return
    conn = r.parent_ends[name]
    if name == "result":
        try:
            r.result = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            pass
        except Exception as e:  # a class the notebook cannot unpickle
            r.result = ("exc", "UnpicklingError", f"could not read rank {r.rank}'s result: {e}", "")
        _unregister(sel, fd)
        return
    if name == "report":
        live.pace_report_read(r.rank)
    try:
        data = os.read(fd, 65536)
    except OSError:
        data = b""
    if not data:
        _unregister(sel, fd)
        if name in ("out", "err") and r.partial[name]:
            _emit(r.rank, name, r.partial[name] + b"\n")
            r.partial[name] = b""
        return
    if name == "stack":
        r.stack += data
    elif name == "report":
        r.report_buf += data
        while len(r.report_buf) >= 4:
            (n,) = struct.unpack("<I", r.report_buf[:4])
            if len(r.report_buf) < 4 + n:
                break
            body, r.report_buf = r.report_buf[4:4 + n], r.report_buf[4 + n:]
            try:
                live.update(r.rank, pickle.loads(body))
            except Exception:  # a display problem must never stop the launch
                pass
    else:
        buf = r.partial[name] + data
        cut = buf.rfind(b"\n")
        if cut >= 0:
            _emit(r.rank, name, buf[: cut + 1])
            buf = buf[cut + 1:]
        r.partial[name] = buf


def _emit(rank: int, name: str, data: bytes) -> None:
    """Print whole lines from one worker, each prefixed with its rank."""
    text = data.decode("utf-8", errors="replace")
    stream = sys.stdout if name == "out" else sys.stderr
    stream.write("".join(f"[rank{rank}] {line}\n" for line in text.splitlines()))
    stream.flush()


def _drain(ranks: list[_Rank], sel, live: _DisplayHolder, limit: float) -> None:
    """Read what is left in the pipes of exited workers, for at most ``limit`` seconds."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if not any(k.data[0].proc.exitcode is not None for k in sel.get_map().values()):
            return  # nothing left to read from a worker that has exited
        for key, _ in sel.select(timeout=0.05):
            r, name = key.data
            _handle(r, name, key.fd, sel, live)


def _collect_stacks(ranks: list[_Rank], sel, live: _DisplayHolder) -> dict[int, RankFailure]:
    """Ask every running rank for its Python stacks (faulthandler on SIGUSR1), wait briefly."""
    stuck = [r for r in ranks if not r.exited and r.proc.exitcode is None]
    for r in stuck:
        try:
            os.kill(r.proc.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        for key, _ in sel.select(timeout=0.1):
            rr, name = key.data
            if name != "exit":
                _handle(rr, name, key.fd, sel, live)
        if all(r.stack.count(b"\n") >= 2 for r in stuck) and time.monotonic() > end - 1.0:
            break
    return {
        r.rank: RankFailure(r.rank, "timeout", stack=_tidy_stack(r.stack.decode(errors="replace")))
        for r in stuck
    }


def _tidy_stack(text: str) -> str:
    """Keep the thread that runs the user's code, drop launcher plumbing, quote each source line.

    faulthandler prints frames most recent first, without source; the notebook's linecache
    knows the source of its cells and files, so each frame gets its line of code.
    """
    import re

    blocks = [b for b in text.strip().split("\n\n") if b.strip()]
    main = [b for b in blocks if "_worker_main" in b] or blocks
    keep = ["(most recent call first)"] if main else []
    for line in main[0].splitlines() if main else []:
        if any(s in line for s in ("multiprocessing/", "course_utils/launcher.py", '"<string>"',
                                   "thread 0x")):
            continue
        keep.append(line.strip())
        m = re.match(r'\s*File "(.+)", line (\d+) in ', line)
        code = linecache.getline(m.group(1), int(m.group(2))).strip() if m else ""
        if code:
            keep.append(f"    {code}")
    if main and len(keep) == 1:  # no frame of the user's code is left
        keep = [line.strip() for line in main[0].splitlines() if 'File "' in line]
        keep.append("(no frame of your function: it had returned, and the worker hung while its "
                    "objects were freed. A DDP model still alive after destroy_process_group() "
                    "does this: `del model` before destroying the group.)")
    return "\n".join(keep)


def _kill_all(ranks: list[_Rank]) -> None:
    for r in ranks:
        if r.proc.exitcode is None:
            try:
                os.killpg(r.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                try:
                    r.proc.kill()
                except Exception:
                    pass


def _shutdown(ranks: list[_Rank], sel, alive_writers: list) -> None:
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
        try:
            r.proc.close()
        except ValueError:
            pass
    sel.close()


class _DisplayHolder:
    """Creates the live display lazily, on the first report, and shields the launch from it.

    The launcher's loop also reads the workers' pipes, so a slow display must not slow it down:
    once the display's ``update`` calls have used more than ``BUDGET`` of the time since it was
    created, reports are coalesced (each rank's newest one waits, replacing older ones) and handed
    over when the display is back within budget.  ``finish`` first hands over every waiting report,
    so a display may miss intermediate reports but never a rank's last one.  A display that fails
    to be created is dropped; exceptions from it never reach the launch.
    """

    BUDGET = 0.5
    READ_EVERY_S = 0.02

    def __init__(self, display: Any, world: int):
        self._spec = display
        self._world = world
        self._obj: Any = None
        self._pending: dict[int, dict] = {}
        self._spent = 0.0
        self._t0 = 0.0
        self._finished = False
        self._read_after: dict[int, float] = {}
        self.coalesced = 0  # reports replaced by a newer one before the display saw them

    def pace_report_read(self, rank: int) -> None:
        """Read a rank's reports in batches, at most every ``READ_EVERY_S`` seconds.

        A worker's write into the pipe wakes the launcher, and on a machine whose cores are all
        training, each wake-up takes a core from a worker for a moment.  Measured on 2 cores with
        chapter 01's training reporting every step: reading each report as it came, a report()
        call took about 30 us (a step about 0.5 ms) and the launcher used about 40 us of CPU per
        report; reading every 20 ms, about 3-12 us and 7 us.  Letting the reports gather costs the
        display nothing it needs (it redraws a few times a second) and holds other output back
        by at most ``READ_EVERY_S``.
        """
        now = time.monotonic()
        wait = self._read_after.get(rank, 0.0) - now
        if wait > 0:
            time.sleep(wait)
            now += wait
        self._read_after[rank] = now + self.READ_EVERY_S

    def update(self, rank: int, metrics: dict) -> None:
        if self._spec is None or self._finished:
            return
        if self._obj is None:
            try:
                if self._spec == "auto":
                    from . import monitor

                    self._obj = monitor.make_display(self._world)
                else:
                    self._obj = self._spec
            except Exception:
                self._spec = None
                return
            self._t0 = time.monotonic()
        if rank in self._pending:
            self.coalesced += 1
        self._pending[rank] = metrics
        if self._spent <= self.BUDGET * max(1.0, time.monotonic() - self._t0):
            self._flush()

    def _flush(self) -> None:
        pending, self._pending = self._pending, {}
        start = time.monotonic()
        for rank, metrics in pending.items():
            try:
                self._obj.update(rank, metrics)
            except Exception:
                pass
        self._spent += time.monotonic() - start

    def finish(self, failures: dict) -> None:
        if self._obj is not None and not self._finished:
            try:
                self._flush()
                self._obj.finish(failures)
            except Exception:
                pass
        self._finished = True
        if self._spec == "auto":
            self._obj = None

    def close(self) -> None:
        """End of the launch: a display that was not finished (an interrupt) is told so."""
        if self._obj is not None and not self._finished:
            self.finish({r: RankFailure(r, "stopped", message="the launch was interrupted")
                         for r in range(self._world)})
        self._obj = None


# --------------------------------------------------------------------------------------------
# Command-line launches (torchrun and friends) from a notebook cell
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class CommandResult:
    """What one command did: its exit code (None when it was killed on timeout) and its output."""

    name: str
    returncode: int | None
    output: str
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class CommandFailed(RuntimeError):
    """A command run by ``run_commands(..., check=True)`` failed or timed out."""

    def __init__(self, results: list[CommandResult]):
        self.results = results
        bad = [r for r in results if not r.ok]
        lines = []
        for r in bad:
            why = "timed out" if r.timed_out else f"exited with code {r.returncode}"
            tail = "\n".join(r.output.rstrip().splitlines()[-15:])
            lines.append(f"[{r.name}] {why}; last lines:\n{_indent(tail)}")
        super().__init__("\n".join(lines))


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def run_commands(
    commands: dict[str, Sequence[str]] | Sequence[Sequence[str]],
    *,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    echo: bool = True,
    check: bool = False,
    stagger: float = 0.0,
) -> list[CommandResult]:
    """Run one or several commands at once (say two ``torchrun`` agents), streaming their output.

    Each output line is printed prefixed with the command's name (``[node0] ...``).  After
    ``timeout`` seconds, or on KeyboardInterrupt, every command *and every process it started*
    (torchrun puts its workers in sessions of their own) gets SIGTERM, then SIGKILL.  If the
    notebook kernel dies, each command receives SIGTERM (``PR_SET_PDEATHSIG``), which torchrun
    forwards to its workers.  ``env`` adds variables to the current environment.  ``stagger``
    waits that many seconds between starts (to show, say, that rendezvous waits for everyone).
    """
    import subprocess

    if not isinstance(commands, dict):
        commands = {f"cmd{i}": c for i, c in enumerate(commands)}
    full_env = dict(os.environ, PYTHONUNBUFFERED="1")
    if env:
        full_env.update({k: str(v) for k, v in env.items()})
    procs: dict[str, Any] = {}
    outputs: dict[str, list[str]] = {n: [] for n in commands}
    partial: dict[str, bytes] = {n: b"" for n in commands}
    sel = selectors.DefaultSelector()
    timed_out = False
    still_running: set[str] = set()

    def emit(name: str, chunk: bytes) -> None:
        text = chunk.decode("utf-8", errors="replace")
        for line in text.splitlines():
            outputs[name].append(line)
            if echo:
                print(f"[{name}] {line}", flush=True)

    try:
        for i, (name, cmd) in enumerate(commands.items()):
            if i and stagger:
                time.sleep(stagger)
            p = subprocess.Popen(
                [str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=full_env, cwd=cwd, start_new_session=True,
                preexec_fn=_die_with_parent,
            )
            procs[name] = p
            sel.register(p.stdout, selectors.EVENT_READ, name)
        deadline = time.monotonic() + timeout
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            for key, _ in sel.select(timeout=min(remaining, 0.2)):
                name = key.data
                data = os.read(key.fd, 65536)
                if not data:
                    sel.unregister(key.fileobj)
                    if partial[name]:
                        emit(name, partial[name])
                        partial[name] = b""
                    continue
                buf = partial[name] + data
                cut = buf.rfind(b"\n")
                if cut >= 0:
                    emit(name, buf[: cut + 1])
                    buf = buf[cut + 1:]
                partial[name] = buf
        if not timed_out:
            for p in procs.values():
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        still_running = {n for n, p in procs.items() if p.poll() is None}
        _terminate_trees(list(procs.values()))
        for p in procs.values():
            if p.stdout:
                p.stdout.close()
        sel.close()
    results = [
        CommandResult(n, None if n in still_running else procs[n].returncode,
                      "\n".join(outputs[n]), n in still_running)
        for n in procs
    ]
    if echo and still_running:
        print(f"[launcher] timed out after {timeout:g} s: stopped "
              f"{', '.join(sorted(still_running))} and everything they started", flush=True)
    if check and any(not r.ok for r in results):
        raise CommandFailed(results)
    return results


def _terminate_trees(procs: list, grace: float = 3.0) -> None:
    """SIGTERM each process and all its descendants, then SIGKILL whatever is left."""
    import psutil

    victims: list[Any] = []
    for p in procs:
        try:
            root = psutil.Process(p.pid)
            victims += [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    for v in victims:
        try:
            v.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(victims, timeout=grace)
    for v in alive:
        try:
            v.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace)
    for p in procs:
        try:
            p.wait(timeout=grace)
        except Exception:
            pass
