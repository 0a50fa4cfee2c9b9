"""The first code every worker runs, in the child process forked from the fork server."""

from __future__ import annotations

import contextlib
import faulthandler
import io
import linecache
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import pickle
import select
import signal
import sys
import threading
import traceback

import cloudpickle
import torch
import torch.distributed as dist

from ..workarounds import apply_all as apply_torch_workarounds
from . import reports, tree
from .errors import RankResult

__all__ = ["worker_main", "SENT", "NOT_SENT", "CLOSED_PIPES", "STACK_SIGNAL"]

# The worker's exit code: its result was sent (0), or sending it failed (the launcher says so), or
# the function closed the descriptors the launcher gave the worker (its pipes): it could no longer
# be watched, report or send a result, so it ended.
SENT = 0
NOT_SENT = 70
CLOSED_PIPES = 71
# The signal that makes a worker dump its threads' stacks (faulthandler): a real-time signal, which
# learner code does not use the way it uses SIGUSR1 (a handler of its own would take the dump away).
STACK_SIGNAL = signal.SIGRTMIN + 6 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR1

Connection = multiprocessing.connection.Connection


def _identity(fds: list[int]) -> list[tuple[int, int] | None]:
    out: list[tuple[int, int] | None] = []
    for fd in fds:
        try:
            st = os.fstat(fd)
            out.append((st.st_dev, st.st_ino))
        except OSError:
            out.append(None)
    return out


class _Pipes:
    """The descriptors the launcher gave this worker, as they were: ``intact()`` is False once the
    function closed one of them (``os.closerange``), even if its number was reused since."""

    def __init__(self, fds: list[int]):
        self.fds, self.was = fds, _identity(fds)

    def intact(self) -> bool:
        return _identity(self.fds) == self.was


def _end_closed_pipes() -> None:
    """The function closed the launcher's pipes: end its tree and exit, the code saying why."""
    tree.kill_descendants()
    os._exit(CLOSED_PIPES)


def _die_with_launcher(alive_r: Connection, pipes: _Pipes) -> None:
    """When the launcher exits, the write end of this pipe closes: kill this worker's group.

    Closing a descriptor does not wake a thread blocked reading it, and a number closed by the
    function can be reused by a file of its own: so the pipe is read only while it is still the
    one the launcher gave, checked every half second."""
    alive_fd = alive_r.fileno()

    def watch() -> None:
        try:
            while pipes.intact():
                if select.select([alive_fd], [], [], 0.5)[0]:
                    if not pipes.intact():
                        break
                    if not os.read(alive_fd, 1):
                        raise EOFError
            _end_closed_pipes()
        except (OSError, ValueError, EOFError):
            if not pipes.intact():
                _end_closed_pipes()
        tree.kill_descendants()  # also those that left this group (setsid)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="launcher-watchdog", daemon=True).start()


def _let_the_fork_server_go() -> None:
    """Close this worker's copy of the fork server's "kernel alive" pipe.

    multiprocessing hands every child of a fork server the write end of the pipe whose closing
    tells the fork server that the kernel is gone. A worker holding it kept the fork server alive
    after the kernel's death (while the worker itself was stopped, forever); without it, the fork
    server exits with the kernel and ``tree.die_with_parent`` takes the worker with it.  This
    worker's own children are not started from the fork server (see ``_become_the_kernel``).
    """
    server = multiprocessing.forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None


def _redirect_output(out_w: Connection, err_w: Connection) -> None:
    """stdout / stderr go to the launcher, line by line."""
    os.dup2(out_w.fileno(), 1)
    os.dup2(err_w.fileno(), 2)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0), line_buffering=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", buffering=0), line_buffering=True)
    out_w.close()
    err_w.close()


def _become_the_kernel(spec: dict) -> None:
    """Look like the launching kernel: its working directory, import path, environment, cells."""
    os.chdir(spec["cwd"])
    sys.path[:] = spec["sys_path"]
    os.environ.clear()
    os.environ.update(spec["env"])
    for name, text in spec["linecache"].items():
        linecache.cache[name] = (len(text), None, text.splitlines(True), name)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    # torch read TORCH_DISTRIBUTED_DEBUG when the fork server imported it: read it again now.
    dist.set_debug_level_from_env()
    # Children of this worker (DataLoader workers) start the way they would under torchrun: the
    # platform's default method, not the fork server this worker came from.
    multiprocessing.set_start_method("fork" if sys.version_info < (3, 14) else "forkserver", force=True)


def _run(payload: bytes) -> RankResult:
    """The function's return value, or the exception it raised, as a ``RankResult``."""
    try:
        fn, args, kwargs = pickle.loads(payload)  # may import modules: start-up, not yet fn's time
        reports.announce_start()
        return RankResult(fn(*args, **kwargs))
    except SystemExit as e:  # sys.exit(0) in a worker counts as success, like under torchrun
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if code == 0:
            return RankResult()
        # sys.exit("message") prints the message and exits with 1: keep both.
        said = "" if e.code is None or isinstance(e.code, int) else f": {e.code}"
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))
        return RankResult.raised("SystemExit", f"exit code {code}{said}", tb)
    except BaseException as e:  # everything must reach the notebook
        # Drop this bootstrap frame: the learner's code starts one level down.
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))
        return RankResult.raised(type(e).__name__, str(e), tb)


def worker_main(
    spec: dict,
    payload: bytes,
    out_w: Connection,
    err_w: Connection,
    stack_w: Connection,
    report_w: Connection,
    result_w: Connection,
    alive_r: Connection,
) -> None:
    """Run one rank: set the process up like a ``torchrun`` worker, run the function, send the result."""
    os.setpgid(0, 0)  # own process group: the launcher can kill the worker and its children
    tree.become_subreaper()  # orphaned descendants (setsid'd ones too) stay in this worker's tree
    _let_the_fork_server_go()
    parent = os.getppid()
    tree.die_with_parent()  # the fork server exits when the kernel dies: so does this worker
    if os.getppid() != parent:  # it already has
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the notebook's interrupt is the launcher's job
    _redirect_output(out_w, err_w)
    pipes = _Pipes([c.fileno() for c in (stack_w, report_w, result_w, alive_r)])
    _die_with_launcher(alive_r, pipes)
    # On STACK_SIGNAL (sent on timeout) dump every thread's Python stack to the stack pipe.
    faulthandler.register(STACK_SIGNAL, file=os.fdopen(stack_w.fileno(), "w", closefd=False),
                          all_threads=True)
    reports.open_channel(report_w.fileno())
    _become_the_kernel(spec)
    apply_torch_workarounds()

    result = _run(payload)
    try:
        data = cloudpickle.dumps(result)
    except Exception as e:  # the return value could not be pickled
        data = cloudpickle.dumps(RankResult.raised(
            "PicklingError", f"the return value of rank {spec['rank']} cannot be sent back to the "
            f"notebook ({e}); return tensors, numbers, lists or dicts"))
    code = SENT
    try:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # the function may have closed fd 1 or 2
                stream.flush()
        if not pipes.intact():
            code = CLOSED_PIPES
        else:
            result_w.send_bytes(data)
    except BaseException:
        code = NOT_SENT if pipes.intact() else CLOSED_PIPES
    finally:
        try:
            tree.end_descendants()  # nothing this worker started outlives it
        finally:
            os._exit(code)
