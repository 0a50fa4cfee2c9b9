"""The keeper of one ``run_commands`` command: its parent, and the end of everything it started.

``run_commands`` does not start a command itself: it starts a small keeper (this module, in a
Python started with ``-I -S``, so in about a tenth of a second), and the keeper starts the command.
The keeper is a *child subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``): a process the command
starts that loses its parent (a daemon that forked, called ``setsid`` and forked again; torchrun's
worker whose agent was SIGKILLed) is re-parented to the keeper, not to init, so
``tree.descendants(keeper)`` is everything the command started, whatever it did with its session,
its process group or its signals.  The keeper ends them all (SIGTERM, a grace period, then SIGKILL
after SIGSTOP so none forks meanwhile, ``tree.end_descendants``):

- when the command exits: what it left running goes with it (``LEFTOVER_GRACE`` seconds to end);
- when ``run_commands`` sends it SIGTERM (the timeout, an interrupt): ``STOP_GRACE`` seconds;
- when the caller dies (the notebook's kernel, SIGKILLed too): the keeper's death signal
  (``PR_SET_PDEATHSIG``, armed by ``run_commands`` between fork and exec) is SIGTERM, and the
  keeper also notices its standard input closing or its parent changing; it then removes the
  call's scratch folder as well, which the caller can no longer do.

The keeper then exits as the command did: with its exit code, or killed by the same signal, so
``run_commands`` sees the command's own status.  A command that cannot be started ends with code
127 and one line saying why, as in a shell.
"""

from __future__ import annotations

import contextlib
import os
import resource
import select
import shutil
import signal
import subprocess
import sys

from .tree import become_subreaper, die_with_parent, end_descendants

__all__ = ["LEFTOVER_GRACE", "STOP_GRACE", "main"]

LEFTOVER_GRACE = 1.0  # seconds what a command left running gets between SIGTERM and SIGKILL
STOP_GRACE = 3.0      # the same, for the whole tree, on a timeout, an interrupt or the caller's death


def _exit_as(status: int) -> None:
    """Exit as a process whose ``waitpid`` status was ``status``: same code, or same signal."""
    sys.stdout.flush()
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        with contextlib.suppress(Exception):
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the command's crash, not a core of ours
        with contextlib.suppress(Exception):  # SIGKILL and SIGSTOP have no handler to reset
            signal.signal(sig, signal.SIG_DFL)
        with contextlib.suppress(Exception):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def main(argv: list[str] | None = None) -> None:
    """``CALLER_PID SCRATCH -- COMMAND...``: run the command, end its tree, exit as it did."""
    args = sys.argv[1:] if argv is None else argv
    caller, scratch, command = int(args[0]), args[1], args[3:]
    become_subreaper()
    stop = {"why": ""}
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)

    def asked_to_stop(signum: int, frame: object) -> None:
        stop["why"] = stop["why"] or "signal"

    signal.signal(signal.SIGTERM, asked_to_stop)
    signal.signal(signal.SIGHUP, asked_to_stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's to handle: it sends SIGTERM
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the select below
    if os.getppid() != caller:  # the caller died before the death signal was armed
        stop["why"] = "caller"
    try:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=die_with_parent)
    except OSError as e:
        print(f"[launcher] cannot start {command[0]!r}: {e.strerror or e}", flush=True)
        os._exit(127)
    status: int | None = None
    stdin_open = True
    while status is None and not stop["why"]:
        with contextlib.suppress(ChildProcessError):
            while True:
                pid, st = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                if pid == proc.pid:
                    status = st
        if status is not None:
            break
        if os.getppid() != caller:
            stop["why"] = "caller"
            break
        ready, _, _ = select.select([wake_r] + ([0] if stdin_open else []), [], [], 1.0)
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 512)
        if 0 in ready and not os.read(0, 512):
            stdin_open = False
            stop["why"] = "caller"  # the caller closes it only once we are done, or when it dies
    end_descendants(LEFTOVER_GRACE if status is not None else STOP_GRACE)
    if stop["why"] == "caller" or os.getppid() != caller:
        shutil.rmtree(scratch, ignore_errors=True)
    if status is None:  # stopped: exit as a command that SIGTERM ended
        status = signal.SIGTERM
    _exit_as(status)
