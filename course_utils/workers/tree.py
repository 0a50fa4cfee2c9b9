"""A worker's process tree on Linux: keep every descendant in it, end them all.

A worker makes itself a *child subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``): a process it starts
that loses its parent (a daemonised grandchild, one that called ``setsid()``) is re-parented to the
worker instead of escaping to init, so while the worker lives, ``descendants(worker)`` is every
process it started, at any depth, whatever their session or process group.

- ``become_subreaper``: called by the worker on itself (a no-op where ``prctl`` is missing);
- ``die_with_parent``: the worker is SIGKILLed when the fork server, its parent, exits (which it
  does when the kernel dies); unlike the worker's watchdog thread, this reaches a stopped worker;
- ``end_descendants``: the worker's last act, after it has sent its result: SIGTERM to every
  descendant, ``GRACE`` seconds, then SIGKILL, and reap them;
- ``kill_descendants``: the same at once, when the worker learns that its launcher died;
- ``marked`` and ``kill_marked``: the processes that inherited a launch's marker variable, found
  even after the worker that started them died (SIGKILLed) and init adopted them;
- ``kill_tree``: the launcher's way to end a worker that is still running: stop the worker and
  every descendant (SIGSTOP cannot be ignored, and a stopped process cannot fork), list the tree
  again until nothing new appears, then SIGKILL them all (SIGKILL acts on stopped processes).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time

__all__ = ["GRACE", "become_subreaper", "descendants", "die_with_parent", "end_descendants",
           "kill_descendants", "kill_marked", "kill_tree", "marked", "state"]

GRACE = 0.3  # seconds a descendant gets between SIGTERM and SIGKILL
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_PDEATHSIG = 1


def _prctl(option: int, value: int) -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def become_subreaper() -> bool:
    """Orphans among this process's descendants are re-parented to it. False where unsupported."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent() -> bool:
    """SIGKILL this process when its parent (the fork server) exits: it acts on a stopped process too."""
    return _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
    return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first), read from ``/proc/PID/task/*/children``."""
    seen: list[int] = []
    todo = _children(pid)
    while todo:
        p = todo.pop()
        if p not in seen:
            seen.append(p)
            todo.extend(_children(p))
    return seen


def state(pid: int) -> str:
    """The one-letter state in ``/proc/PID/stat`` (``R``, ``S``, ``T`` stopped, ``Z``...), or ``""``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _signal_all(pids: list[int], sig: int) -> None:
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, sig)


def _reap_children() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def end_descendants(grace: float = GRACE) -> None:
    """In a worker: end every process it started (SIGTERM, ``grace`` seconds, SIGKILL) and reap them."""
    me = os.getpid()
    left = descendants(me)
    if not left:
        return
    _signal_all(left, signal.SIGTERM)
    _signal_all(left, signal.SIGCONT)  # a stopped process acts on SIGTERM only once continued
    end = time.monotonic() + grace
    while time.monotonic() < end:
        _reap_children()
        left = [p for p in descendants(me) if state(p) not in ("Z", "")]
        if not left:
            return
        time.sleep(0.01)
    for _ in range(20):  # a descendant may fork while we kill: repeat until none is left
        left = descendants(me)
        if not left:
            break
        _signal_all(left, signal.SIGKILL)
        time.sleep(0.01)
        _reap_children()


def _stop_and_kill(pid: int, first: list[int]) -> None:
    """SIGSTOP ``first`` and ``pid``'s descendants until no new one appears, then SIGKILL them all."""
    frozen: list[int] = []
    for _ in range(50):
        new = [p for p in [*first, *descendants(pid)] if p not in frozen]
        if not new:
            break
        _signal_all(new, signal.SIGSTOP)
        frozen.extend(new)
    _signal_all([*frozen, *descendants(pid)], signal.SIGKILL)


def kill_tree(pid: int) -> None:
    """From the launcher: SIGKILL ``pid`` and every descendant, none getting the chance to fork."""
    _stop_and_kill(pid, [pid])


def kill_descendants() -> None:
    """In a worker whose launcher is gone: SIGKILL every descendant at once, no grace."""
    _stop_and_kill(os.getpid(), [])


def marked(name: str, value: str) -> list[int]:
    """Processes of this user whose environment, as they were started, holds ``name=value``.

    The launcher gives every worker of a launch one such variable: a program a worker started
    inherits it, so the launcher finds it again even after the worker died without ending it (a
    worker SIGKILLed, by itself or by the OOM killer, leaves its children to init).  It misses a
    descendant that cleared its environment, and one forked without ``exec`` (its ``environ``
    is its parent's, from before the variable was set).
    """
    needle = b"\0" + f"{name}={value}".encode() + b"\0"
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        with contextlib.suppress(OSError), open(f"/proc/{entry}/environ", "rb") as f:
            if needle in b"\0" + f.read() + b"\0":
                found.append(int(entry))
    return found


def kill_marked(name: str, value: str) -> list[int]:
    """SIGKILL every process ``marked(name, value)`` finds (stopped first, so none forks meanwhile)."""
    pids = marked(name, value)
    _signal_all(pids, signal.SIGSTOP)
    pids = sorted({*pids, *marked(name, value)})
    _signal_all(pids, signal.SIGKILL)
    return pids
