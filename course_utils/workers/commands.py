"""``run_commands``: run ``torchrun`` (or any command) from a notebook cell, with its whole process tree."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import psutil

from .errors import indent
from .keeper import STOP_GRACE
from .lines import LineSplitter
from .netns import PrivateNetwork

__all__ = ["run_commands", "CommandResult", "CommandFailed", "terminate_trees"]


@dataclasses.dataclass
class CommandResult:
    """What one command did: its exit code (None when it was killed on timeout) and its output."""

    name: str
    returncode: int | None
    output: str
    timed_out: bool = False
    network: str = "host"  # "private": it ran in the call's own network namespace (only loopback)

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class CommandFailed(RuntimeError):
    """A command run by ``run_commands(..., check=True)`` failed or timed out."""

    def __init__(self, results: list[CommandResult]):
        self.results = results
        lines = []
        for r in results:
            if r.ok:
                continue
            why = "timed out" if r.timed_out else f"exited with code {r.returncode}"
            tail = "\n".join(r.output.rstrip().splitlines()[-15:])
            lines.append(f"[{r.name}] {why}; last lines:\n{indent(tail)}")
        super().__init__("\n".join(lines))


PR_SET_PDEATHSIG = 1
_DRAIN = 2.0  # seconds the output of a command may go on arriving after its keeper exited
_SCRATCH = "course-commands-"  # then the caller's pid: a folder whose owner died is swept away
_LINE_BUFFERED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "line_buffered")
# The keeper runs in a Python started with -I -S (a tenth of a second): it imports only this package.
_KEEPER = ("import sys; sys.path.insert(0, {root!r}); "
           "from course_utils.workers.keeper import main; main()")


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _child_setup(private: PrivateNetwork | None) -> Any:
    """What a command's child does before exec: join the call's namespace, then arm the death
    signal (joining a user namespace changes the process's credentials, which clears it)."""
    if private is None:
        return _die_with_parent

    def setup() -> None:
        private.join()
        _die_with_parent()

    return setup


_noted: set[str] = set()


def _note_no_private_network(why: str, echo: bool) -> None:
    """Say once per reason that the commands run on the machine's own network."""
    if echo and why not in _noted:
        _noted.add(why)
        print(f"[launcher] note: the commands run on this machine's network, where torchrun's stores "
              f"listen on every interface (a network of their own could not be made: {why})", flush=True)


def run_commands(
    commands: dict[str, Sequence[str]] | Sequence[Sequence[str]],
    *,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    echo: bool = True,
    check: bool = False,
    stagger: float = 0.0,
    network: str = "private",
) -> list[CommandResult]:
    """Run one or several commands at once (say two ``torchrun`` agents), streaming their output.

    Each output line is printed prefixed with the command's name (``[node0] ...``).  Every process
    a command starts ends with the command, the call or the kernel, whatever it does with its
    session or its signals: each command runs under a keeper (``keeper.py``, a child subreaper, so
    a daemon that forked and called ``setsid`` stays below it) that, when the command exits, ends
    what it left running (torchrun's workers whose agent was SIGKILLed, a daemon) and returns; after
    ``timeout`` seconds, or on KeyboardInterrupt, it gets SIGTERM and ends the command and all it
    started (SIGTERM, 3 s, SIGKILL); when the notebook's kernel dies, even by SIGKILL, each keeper
    does the same by itself (its death signal).  ``env`` adds variables to the current environment.
    ``stagger`` waits that many seconds between starts (to show, say, that rendezvous waits for everyone).

    The commands get a temporary folder of their own (``TMPDIR``, unless ``env`` sets it), removed
    when they are done: torchrun's log folders and whatever a killed process leaves there go with it.
    When the caller was SIGKILLed, the keepers remove it, and the next call sweeps any folder whose
    owner died.

    ``network="private"`` (the default) runs all the commands of the call in one network namespace
    of their own whose only interface is loopback (``course_utils.workers.netns``): they reach each
    other on 127.0.0.1, and nothing outside reaches the stores torchrun opens on every interface.
    Where the system cannot make one, they run on the machine's network and a note says why, once.
    ``network="host"``: the machine's network (a command that must reach a server the notebook runs,
    or one that enters a namespace of its own with ``ip netns exec``, which works from either).
    """
    if network not in ("private", "host"):
        raise ValueError(f'run_commands(network=...) is "private" or "host", got {network!r}')
    if not isinstance(commands, dict):
        commands = {f"cmd{i}": c for i, c in enumerate(commands)}
    _sweep_stale_scratch()
    scratch = tempfile.mkdtemp(prefix=f"{_SCRATCH}{os.getpid()}-")
    full_env = dict(os.environ, TMPDIR=scratch)
    if env:
        full_env.update({k: str(v) for k, v in env.items()})
    # Every Python process of a command writes whole lines, streamed as they come (see the file).
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (_LINE_BUFFERED, full_env.get("PYTHONPATH")) if p)
    procs: dict[str, subprocess.Popen] = {}  # each command's keeper
    outputs: dict[str, list[str]] = {n: [] for n in commands}
    splitters = {n: LineSplitter() for n in commands}
    sel = selectors.DefaultSelector()
    still_running: set[str] = set()

    def emit(name: str, lines: list[str]) -> None:
        outputs[name].extend(lines)
        if echo:
            for line in lines:
                print(f"[{name}] {line}", flush=True)

    private = PrivateNetwork() if network == "private" else None
    try:
        if private is not None and (why := private.start()) is not None:
            private = None
            _note_no_private_network(why, echo)
        for i, (name, cmd) in enumerate(commands.items()):
            if i and stagger:
                time.sleep(stagger)
            procs[name] = _start_keeper(name, [str(c) for c in cmd], scratch, full_env, cwd, private, sel)
        deadline = time.monotonic() + timeout
        ended: dict[str, float] = {}  # when each keeper exited: it ended its tree first
        while len(ended) < len(procs) or sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                break
            for key, _ in sel.select(timeout=min(deadline - now, 0.2)):
                name = key.data
                data = os.read(key.fd, 65536)
                if data:
                    emit(name, splitters[name].feed(data))
                else:
                    _close_output(sel, key.fd)
                    emit(name, splitters[name].flush())
            for name, p in procs.items():
                if name not in ended and p.poll() is not None:
                    ended[name] = time.monotonic()
            for key in list(sel.get_map().values()):
                # The keeper ended everything its command started, so the pipe closes at once; a
                # process outside the tree that was handed the pipe must not hold the call.
                if key.data in ended and time.monotonic() - ended[key.data] > _DRAIN:
                    _close_output(sel, key.fd)
                    emit(key.data, splitters[key.data].flush())
    finally:
        still_running = {n for n, p in procs.items() if p.poll() is None}
        _stop_keepers(list(procs.values()))
        for key in list(sel.get_map().values()):
            _close_output(sel, key.fd)
        sel.close()
        if private is not None:
            private.close()
        shutil.rmtree(scratch, ignore_errors=True)
    results = [
        CommandResult(n, None if n in still_running else procs[n].returncode,
                      "\n".join(outputs[n]), n in still_running,
                      "private" if private is not None else "host")
        for n in procs
    ]
    if echo and still_running:
        print(f"[launcher] timed out after {timeout:g} s: stopped "
              f"{', '.join(sorted(still_running))} and everything they started", flush=True)
    if check and any(not r.ok for r in results):
        raise CommandFailed(results)
    return results


def _start_keeper(name: str, cmd: list[str], scratch: str, env: dict[str, str], cwd: str | None,
                  private: PrivateNetwork | None, sel: selectors.BaseSelector) -> subprocess.Popen:
    """Start ``cmd`` under its keeper (``keeper.py``), its output on a pipe registered in ``sel``."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    read_end, write_end = os.pipe()
    try:
        p = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _KEEPER.format(root=root), str(os.getpid()), scratch,
             "--", *cmd],
            stdin=subprocess.PIPE, stdout=write_end, stderr=write_end, env=env, cwd=cwd,
            start_new_session=True, preexec_fn=_child_setup(private))
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    sel.register(read_end, selectors.EVENT_READ, name)
    return p


def _close_output(sel: selectors.BaseSelector, fd: int) -> None:
    sel.unregister(fd)
    os.close(fd)


def _stop_keepers(keepers: list[subprocess.Popen]) -> None:
    """SIGTERM the keepers still running (each ends its command's whole tree, then exits); a keeper
    that does not exit in time is killed with whatever is below it."""
    for p in keepers:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
    end = time.monotonic() + STOP_GRACE + 5
    for p in keepers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.1, end - time.monotonic()))
    stuck = [p for p in keepers if p.poll() is None]
    if stuck:
        terminate_trees(stuck, grace=0.5)
    for p in keepers:
        with contextlib.suppress(Exception):
            p.stdin.close()  # type: ignore[union-attr]


def _sweep_stale_scratch() -> None:
    """Remove the scratch folders of callers that died (SIGKILLed before their keepers could)."""
    me = os.getuid()
    with contextlib.suppress(OSError):
        for entry in os.scandir(tempfile.gettempdir()):
            owner = entry.name[len(_SCRATCH):].split("-", 1)[0]
            if not (entry.name.startswith(_SCRATCH) and owner.isdigit()):
                continue
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid == me and not psutil.pid_exists(int(owner)):
                    shutil.rmtree(entry.path, ignore_errors=True)


def terminate_trees(procs: list[Any], grace: float = 3.0) -> None:
    """SIGTERM each process and all its descendants, then SIGKILL whatever is left."""
    victims: list[psutil.Process] = []
    for p in procs:
        try:
            root = psutil.Process(p.pid)
            victims += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    for v in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            v.terminate()
    _, alive = psutil.wait_procs(victims, timeout=grace)
    for v in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            v.kill()
    psutil.wait_procs(alive, timeout=grace)
    for p in procs:
        with contextlib.suppress(Exception):
            p.wait(timeout=grace)
