"""Start the fork server in the background when a notebook kernel imports ``course_utils``.

The first ``launch`` of a kernel otherwise pays for starting the fork server, which imports torch
(about 2 s).  In a notebook, the learner reads for a few seconds between the import cell and the
first launch: starting the server then, in a background thread, makes that first launch as quick
as the following ones.  It happens only in a Jupyter kernel: not in worker processes, not under
``torchrun`` or plain ``python``, not in test processes (unless ``COURSE_PREWARM=1``), never in a
fork server itself (it has the kernel's environment: with ``COURSE_PREWARM=1``, each server once
started a server of its own); and ``COURSE_PREWARM=0`` turns it off.  The background start ends by
forking one no-op child through the server, which returns once the server has imported torch:
:func:`wait_ready` waits for that.
The fork server exits with its kernel, so a kernel that never launches anything leaves nothing
behind.  (With ``COURSE_PREWARM=1`` in a script, ``__main__.__file__`` is hidden for a moment
while the server starts, as during every launch: see ``startup.main_module_hidden``.)
"""

from __future__ import annotations

import os
import sys
import threading

from .startup import fork_server_context, main_module_hidden, start_fork_server

__all__ = ["should_prewarm", "start_in_background", "wait_ready"]

_started = threading.Event()
_ready = threading.Event()


def _in_notebook_kernel() -> bool:
    shell_module = sys.modules.get("IPython")
    if shell_module is None or "ipykernel" not in sys.modules:
        return False
    shell = shell_module.get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def _is_fork_server() -> bool:
    """Whether this process is a multiprocessing fork server (``-c "from multiprocessing.forkserver
    import main; ..."``): it imports ``course_utils`` with its preload, with the kernel's environment."""
    return any(a.startswith("from multiprocessing.forkserver import main") for a in sys.orig_argv)


def should_prewarm() -> bool:
    """Whether this process is one where a background fork server start pays off."""
    setting = os.environ.get("COURSE_PREWARM", "")
    if setting == "0" or _is_fork_server():
        return False
    if os.environ.get("COURSE_LAUNCHER") or os.environ.get("TORCHELASTIC_RUN_ID"):
        return False  # a worker, or a script under torchrun
    return setting == "1" or _in_notebook_kernel()


def wait_ready(timeout: float | None = None) -> bool:
    """Wait until a background start has finished (True), or ``timeout`` seconds (False)."""
    return _ready.wait(timeout)


def start_in_background() -> threading.Thread | None:
    """Start the fork server from a daemon thread (once per process); None when not wanted."""
    if _started.is_set() or not should_prewarm():
        return None
    _started.set()
    def run() -> None:
        ctx = fork_server_context()
        try:
            with main_module_hidden():
                start_fork_server()
                # A no-op child: it returns once the server has finished importing torch.
                child = ctx.Process(target=os.getpid, name="course-prewarm")
                child.start()
            child.join()
            child.close()
        except Exception:  # the first launch will start it, and report any problem itself
            pass
        finally:
            _ready.set()

    t = threading.Thread(target=run, name="course-prewarm", daemon=True)
    t.start()
    return t
