"""What a launch prepares before its workers start: the fork server, ports, the payload, the environment.

- ``fork_server_context``: the fork server workers are forked from (torch preloaded, see
  ``supervisor``'s module doc), and ``start_fork_server``, which spawns it deaf to an early SIGINT,
  its socket in a temporary folder that a later start removes if this process was killed;
- ``free_port`` and ``loopback_listener``: ports on 127.0.0.1 that the operating system picked;
- ``dumps_payload``: cloudpickle, keeping each shipped function's file name (a notebook cell's), so
  worker tracebacks quote the cell;
- ``main_module_hidden``: workers do not re-run the caller's script;
- ``linecache_snapshot`` and ``worker_env``: the notebook's cells and the environment every worker gets.
"""

from __future__ import annotations

import contextlib
import glob
import io
import linecache
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import multiprocessing.util
import os
import pickle
import shutil
import signal
import socket
import stat
import sys
import tempfile
import threading
import types
from collections import ChainMap
from collections.abc import Iterator
from typing import Any

import cloudpickle
from cloudpickle import cloudpickle as _cp

from .budget import cpu_threads_per_worker

__all__ = ["PRELOAD", "free_port", "loopback_listener", "fork_server_context", "start_fork_server",
           "remove_dead_temp_dirs", "dumps_payload", "main_module_hidden", "linecache_snapshot",
           "worker_env"]

PRELOAD = "course_utils._preload"

# --------------------------------------------------------------------------------------------
# Small public helpers
# --------------------------------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    """Ask the operating system for a TCP port that is free right now.

    Use it for ``init_method="tcp://..."`` demos.  Another program could take the port between
    this call and its use; the launcher avoids that race by binding its store's socket itself.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def loopback_listener() -> socket.socket:
    """A TCP socket listening on 127.0.0.1 on a port the operating system picked."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


_ctx_lock = threading.Lock()
_ctx: Any = None


def fork_server_context() -> Any:
    """The fork-server context, created once per process, preloading torch into the server."""
    global _ctx
    with _ctx_lock:
        if _ctx is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload([PRELOAD])
            _ctx = ctx
        return _ctx


def start_fork_server() -> None:
    """Start the fork server unless it runs, with SIGINT blocked in this thread while it is spawned.

    Jupyter interrupts a kernel's whole process group when it shuts the kernel down, and the fork
    server is in it.  The server inherits the blocked signal, so an interrupt that comes before it
    has set SIGINT to ignored (the first lines of ``course_utils/_preload.py``, once Python has
    started and imported multiprocessing) waits, and is then dropped, instead of ending the server's
    start with a ``KeyboardInterrupt`` traceback on the terminal that started Jupyter.
    (multiprocessing spawns its resource tracker the same way: CPython issue bpo-33613.)  The
    spawn itself takes milliseconds: the server imports torch after it, with this thread unblocked.
    Call it after :func:`fork_server_context` (which sets the preload list) and with
    :func:`main_module_hidden` entered, as multiprocessing records ``__main__`` here.
    """
    _claim_temp_dir()
    # The resource tracker first: multiprocessing starts it from ensure_running() below unless it
    # runs, and unblocks SIGINT in this thread once it has (instead of restoring the mask).
    multiprocessing.resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


# The fork server listens on a Unix socket in multiprocessing's temporary folder of this process
# ("pymp-..." in /tmp), which multiprocessing removes when this process exits normally.  A kernel
# that is killed (nbval stops every kernel with SIGKILL to its process group; a kernel that dies of
# memory) leaves it behind.  This process's folder is named after its PID instead, so that a later
# start can tell the folders of dead processes and remove them; only this user's, only these names.
_TEMP_PREFIX = "pymp-course-"


def _claim_temp_dir() -> None:
    """Give multiprocessing this process's temporary folder, named after its PID, unless it has one."""
    config = multiprocessing.current_process()._config  # where multiprocessing.util.get_temp_dir keeps it
    if config.get("tempdir") is not None:
        return
    remove_dead_temp_dirs()
    path = tempfile.mkdtemp(prefix=f"{_TEMP_PREFIX}{os.getpid()}-")
    # As get_temp_dir does: removed at this process's normal exit, after multiprocessing's own finalizers.
    multiprocessing.util.Finalize(None, shutil.rmtree, args=(path,), kwargs={"ignore_errors": True},
                                  exitpriority=-100)
    config["tempdir"] = path


def remove_dead_temp_dirs() -> list[str]:
    """Remove the fork-server folders (see ``_claim_temp_dir``) whose process has died; return them.

    A folder is removed only if it is a directory (not a link) owned by this user, named
    ``pymp-course-PID-...``, and no process PID exists.
    """
    removed = []
    for path in sorted(glob.glob(os.path.join(tempfile.gettempdir(), _TEMP_PREFIX + "*"))):
        pid = os.path.basename(path)[len(_TEMP_PREFIX):].split("-", 1)[0]
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if not (pid.isdigit() and stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()):
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive (or its number taken by another process): kept
        except ProcessLookupError:
            pass
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


# --------------------------------------------------------------------------------------------
# Preparing the payload and the workers' view of the kernel
# --------------------------------------------------------------------------------------------


def _keep_filename(code: types.CodeType) -> tuple:
    ctor, args = _cp._code_reduce(code)
    return ctor, tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, keeping each function's source file name (for example a notebook cell's).

    cloudpickle replaces the file name of the code it ships by value with "<dynamic-code>";
    keeping the real one lets worker tracebacks point at, and quote, the cell that failed.
    """

    dispatch_table = ChainMap({types.CodeType: _keep_filename}, cloudpickle.Pickler.dispatch_table)


def dumps_payload(obj: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
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


def linecache_snapshot(limit: int = 2_000_000) -> dict[str, str]:
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


def worker_env(world: int, env: dict[str, str] | None) -> dict[str, str]:
    """What every worker's environment has in common, before the store's address is known."""
    base = dict(os.environ)
    if env:
        base.update({k: str(v) for k, v in env.items()})
    base.setdefault("OMP_NUM_THREADS", str(cpu_threads_per_worker(world)))
    # init_process_group returns on one rank before the others have finished connecting; a rank
    # that then leaves at once (no collective, destroy_process_group) makes gloo's connectFullMesh
    # fail on the slower rank with "Connection closed by peer".  The store-based barrier that
    # torch runs at the end of init when this is 1 closes that race, for one store round trip.
    base.setdefault("TORCH_DIST_INIT_BARRIER", "1")
    # Every rank runs on this machine: gloo's and NCCL's own sockets listen on loopback only.
    base.setdefault("GLOO_SOCKET_IFNAME", "lo")
    base.setdefault("NCCL_SOCKET_IFNAME", "lo")
    base["MPLBACKEND"] = "Agg"
    base["PYTHONUNBUFFERED"] = "1"
    return base
