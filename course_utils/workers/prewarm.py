"""Start the fork server in the background when a notebook kernel imports ``course_utils``.

The first ``launch`` of a kernel otherwise pays for starting the fork server, which imports torch
(about 2 s).  In a notebook, the learner reads for a few seconds between the import cell and the
first launch: starting the server then, in a background thread, makes that first launch as quick
as the following ones.  It happens only in a Jupyter kernel: not in worker processes, not under
``torchrun`` or plain ``python``, not in test processes (unless ``COURSE_PREWARM=1``); and
``COURSE_PREWARM=0`` turns it off.  The fork server exits with its kernel, so a kernel that never
launches anything leaves nothing behind.
"""

from __future__ import annotations

import multiprocessing.forkserver
import os
import sys
import threading

from .supervisor import fork_server_context

__all__ = ["should_prewarm", "start_in_background"]

_started = threading.Event()


def _in_notebook_kernel() -> bool:
    shell_module = sys.modules.get("IPython")
    if shell_module is None or "ipykernel" not in sys.modules:
        return False
    shell = shell_module.get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def should_prewarm() -> bool:
    """Whether this process is one where a background fork server start pays off."""
    setting = os.environ.get("COURSE_PREWARM", "")
    if setting == "0":
        return False
    if os.environ.get("COURSE_LAUNCHER") or os.environ.get("TORCHELASTIC_RUN_ID"):
        return False  # a worker, or a script under torchrun
    return setting == "1" or _in_notebook_kernel()


def start_in_background() -> threading.Thread | None:
    """Start the fork server from a daemon thread (once per process); None when not wanted."""
    if _started.is_set() or not should_prewarm():
        return None
    _started.set()
    def run() -> None:
        fork_server_context()
        try:
            multiprocessing.forkserver.ensure_running()
        except Exception:  # the first launch will start it, and report any problem itself
            pass

    t = threading.Thread(target=run, name="course-prewarm", daemon=True)
    t.start()
    return t
