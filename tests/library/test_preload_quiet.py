"""Shutting a kernel down while its fork server is still importing torch prints nothing.

Jupyter interrupts a kernel's process group (SIGINT) when it shuts it down; the fork server, which
imports torch and ``torch._dynamo`` for several seconds after the kernel starts it, is in that
group, and printed a ``KeyboardInterrupt`` traceback on the terminal that started Jupyter: from its
imports of torch and, before those, from Python's own start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups, /proc")

KERNEL = """
import signal, time
signal.signal(signal.SIGINT, lambda *_: None)  # as ipykernel: a handler of its own, not SIG_IGN
from course_utils.workers import prewarm
prewarm.should_prewarm = lambda: True  # as in a notebook kernel (the server's environment is untouched)
prewarm.start_in_background()
time.sleep(120)
"""


def _fork_server(parent: int) -> psutil.Process | None:
    for p in psutil.Process(parent).children():
        try:
            if "forkserver" in " ".join(p.cmdline()):
                return p
        except psutil.Error:
            pass
    return None


# 0 s: the server is still starting Python and importing multiprocessing, before its first line of
# course code (a quiet run printed a traceback from there: the launcher now spawns it with SIGINT
# blocked); 0.5 s: inside its import of torch (seconds).
@pytest.mark.parametrize("after", [0.0, 0.5], ids=["at-once", "during-torch"])
def test_a_kernel_shut_down_while_its_fork_server_imports_prints_nothing(after):
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True,
                              env={k: v for k, v in os.environ.items() if k != "COURSE_PREWARM"})
    try:
        server = None
        deadline = time.monotonic() + 60
        while server is None and time.monotonic() < deadline:
            server = _fork_server(kernel.pid)
            time.sleep(0.02)
        assert server is not None, "the fork server never started"
        time.sleep(after)
        os.killpg(kernel.pid, signal.SIGINT)  # Jupyter's interrupt at shutdown
        time.sleep(0.3)
        os.kill(kernel.pid, signal.SIGKILL)  # then the kernel is gone
        out, err = kernel.communicate(timeout=120)  # until the fork server, which shares them, exits
        # The server notices its kernel's death only once its imports are done: on a loaded machine
        # that can be seconds after the pipes closed, so wait for it rather than look once.
        gone, alive = psutil.wait_procs([server], timeout=120)
        assert not alive or all(p.status() == psutil.STATUS_ZOMBIE for p in alive), alive
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
        assert err.strip() == "" and out.strip() == "", (out, err)
    finally:
        if kernel.poll() is None:
            kernel.kill()
            kernel.wait()
