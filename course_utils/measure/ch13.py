"""Chapter 13's tools for a job that hangs: its flight records read per rank, and py-spy's stacks.

- ``load_dumps(folder)`` reads the dumps a job left (``rank<N>.pkl``, each the pickle that
  ``torch._C._distributed_c10d._dump_fr_trace()`` returns) into ``{rank: dump}``, as data only: the
  pickle may build dicts, lists, tuples, strings and numbers, nothing that runs code (a file that
  asks for anything else, or is not a regular file, too large, cut short or not a dump, is skipped
  with a warning that names it, and the other ranks are kept);
- ``collectives(dump)`` gives one rank's recorded collectives as rows (sequence id, operation,
  shapes, state, the learner's frame), ``print_records(dumps)`` prints the last ones of every rank;
- ``py_spy_dump(pid)`` runs ``py-spy dump --pid`` on a live process and ``stuck_frame(stack)``
  picks from its main thread (``main_thread(stack)``) the innermost frame that is not torch's or the
  interpreter's own;
- ``stacks_under_slurm(cluster, ...)`` runs chapter 13's hanging job on two nodes of a
  ``course_utils.slurm_cluster`` and dumps every node's ranks from a step of their own inside the
  job's allocation (``srun --jobid=J --overlap``), as one does on a real cluster.

A dump, as torch 2.13 writes it, is a dict: ``version``, ``pg_config`` (the groups and their ranks),
``pg_status`` (per group: the last collective enqueued, started, completed) and ``entries``, one per
collective, oldest first, with ``collective_seq_id`` (per group: the k-th collective of the group on
every rank), ``profiling_name`` (``"gloo:all_reduce"``), ``input_sizes``, ``state`` and ``frames``
(the Python stack when it was called, innermost first).
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import re
import shlex
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil

__all__ = ["Collective", "DumpSkipped", "MAX_DUMP_BYTES", "load_dumps", "collectives", "learner_frame",
           "print_records", "py_spy_dump", "main_thread", "stuck_frame", "stacks_under_slurm", "PY_SPY"]

# py-spy installs one executable beside the interpreter (`.venv/bin/py-spy`).
PY_SPY = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")

# Frames that are not the learner's: torch's own and its logging wrapper, the interpreter's.
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NOT_LEARNER = re.compile(r"(^|/)(torch|threading\.py|runpy\.py)(/|$)|site-packages/|/lib/python3")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One recorded collective of one rank."""

    seq: int          # collective_seq_id: the same number for the same collective on every rank
    op: str           # "all_reduce", "barrier", ... (the backend's prefix removed)
    shapes: tuple     # the input tensors' shapes
    state: str        # "scheduled", "started", "completed" (gloo records "scheduled" only)
    frame: str        # where the learner's code called it: "file:line in function"
    group: str        # the process group's name ("0" is the default group)


# A dump of 2000 entries with their stacks is about 0.3 MB; a file far larger is not one.
MAX_DUMP_BYTES = 64 * 2**20


class DumpSkipped(UserWarning):
    """A rank's dump file that ``load_dumps`` could not read; the warning names the file and why."""


class _DataOnly(pickle.Unpickler):
    """An unpickler that builds only what pickle makes without a name: dicts, lists, tuples, sets,
    strings, bytes, numbers, None.  A pickle that names a class or a function (the only way a pickle
    runs code) is refused before anything is called."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it asks for {module}.{name}: a flight-recorder dump holds plain "
                                     "data only, so the file is not one (or was tampered with)")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it refers to persistent objects: not a flight-recorder dump")


def _read_dump(path: Path, max_bytes: int) -> dict:
    """One rank's dump, or ValueError saying why the file is not one."""
    st = path.stat()
    if not path.is_file():
        raise ValueError("not a regular file (a pipe, a folder or a device): not read")
    if st.st_size == 0:
        raise ValueError("the file is empty (the rank was killed while it wrote its dump?)")
    if st.st_size > max_bytes:
        raise ValueError(f"{st.st_size:,} bytes, more than a dump holds (limit {max_bytes:,}): not read")
    try:
        dump = _DataOnly(io.BytesIO(path.read_bytes())).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError,
            AttributeError, MemoryError, OverflowError, UnicodeDecodeError) as e:
        raise ValueError(f"not a readable pickle ({type(e).__name__}: {e}); cut short while written, "
                         "or not a dump") from None
    if not isinstance(dump, dict) or not isinstance(dump.get("entries"), list) or \
            not all(isinstance(e, dict) for e in dump["entries"]):
        raise ValueError(f"it holds a {type(dump).__name__}, not a dump (a dict with a list of "
                         "'entries', as _dump_fr_trace() writes)")
    return dump


def load_dumps(folder: str | Path, max_bytes: int = MAX_DUMP_BYTES) -> dict[int, dict]:
    """``{rank: dump}`` from the files ``rank<N>.pkl`` in ``folder`` (a rank without a file is
    absent: it never dumped).

    Read as data only (``_DataOnly``: no class or function a pickle names is ever looked up, so a
    dump cannot run code).  A file that is not a dump is skipped with a ``DumpSkipped`` warning that
    names it and says why; the other ranks are returned.  A folder that does not exist raises
    ``FileNotFoundError`` naming it; one without any ``rank<N>.pkl`` warns.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"no folder {str(folder)!r}: the dumps are read from the folder the job "
                                "wrote them to (check its name)")
    out = {}
    files = [(int(m.group(1)), p) for p in folder.glob("rank*.pkl")
             if (m := re.fullmatch(r"rank(\d+)\.pkl", p.name))]
    if not files:
        warnings.warn(f"{folder}: no rank<N>.pkl file in it: no rank has dumped there", DumpSkipped,
                      stacklevel=2)
    for rank, path in sorted(files):
        try:
            out[rank] = _read_dump(path, max_bytes)
        except (ValueError, OSError) as e:
            warnings.warn(f"{path}: skipped, {e}", DumpSkipped, stacklevel=2)
    return out


def learner_frame(frames: list[Mapping[str, Any]]) -> str:
    """The innermost frame outside torch and the interpreter, as ``file:line in function``."""
    for f in frames:
        if not _NOT_LEARNER.search(str(f.get("filename", ""))):
            return f"{Path(str(f['filename'])).name}:{f['line']} in {f['name']}"
    return "(no frame outside torch)"


def collectives(dump: Mapping[str, Any]) -> list[Collective]:
    """One rank's recorded collectives (point-to-point entries left out), oldest first."""
    return [Collective(seq=int(e["collective_seq_id"]), op=str(e["profiling_name"]).split(":")[-1],
                       shapes=tuple(tuple(s) for s in e["input_sizes"]), state=str(e["state"]),
                       frame=learner_frame(e.get("frames") or []), group=str(e["process_group"][0]))
            for e in dump.get("entries", []) if not e.get("is_p2p")]


def print_records(dumps: Mapping[int, Mapping[str, Any]], last: int = 4) -> None:
    """Print, for every rank, its last ``last`` collectives: sequence id, operation, shapes, frame."""
    for rank, dump in sorted(dumps.items()):
        rows = collectives(dump)
        print(f"rank {rank}: {len(rows)} collective(s) recorded, the last {min(last, len(rows))}:")
        print(f"    {'seq':>4}  {'op':<11} {'shapes':<12} {'state':<10} called from")
        for c in rows[-last:]:
            shapes = ", ".join("x".join(map(str, s)) or "-" for s in c.shapes) or "-"
            print(f"    {c.seq:>4}  {c.op:<11} {shapes:<12} {c.state:<10} {c.frame}")


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def py_spy_dump(pid: int, timeout: float = 30.0) -> str:
    """``py-spy dump --pid PID``: every thread's Python stack of a running process, innermost first.

    A process that ends while py-spy reads it raises ``ProcessLookupError`` (py-spy may then panic
    and print a Rust backtrace, which is not shown); any other failure raises ``RuntimeError`` with
    py-spy's own error line."""
    if PY_SPY is None:
        raise RuntimeError("py-spy is not installed: `pip install py-spy` (it is in pyproject.toml)")
    r = subprocess.run([PY_SPY, "dump", "--pid", str(pid)], capture_output=True, text=True,
                       timeout=timeout)
    out, err = _ANSI.sub("", r.stdout), _ANSI.sub("", r.stderr)  # py-spy colours its output even into a pipe
    panicked = any(s in out + err for s in ("panicked at", "stack backtrace:", "RUST_BACKTRACE"))
    if r.returncode or panicked or not out.strip():
        if not _running(pid):
            raise ProcessLookupError(f"process {pid} ended while py-spy read its stack: nothing to show")
        lines = [line.strip() for line in (err + "\n" + out).splitlines() if line.strip()]
        said = next((line for line in lines if line.startswith("Error")), lines[0] if lines else "no output")
        raise RuntimeError(f"py-spy dump --pid {pid} failed: {said[:300]}")
    return out


def main_thread(stack: str) -> str:
    """The part of a py-spy dump that shows the main thread (the first thread when none is named so)."""
    threads = ["Thread " + t for t in stack.split("\nThread ")[1:]]
    return next((t for t in threads if '"MainThread"' in t.splitlines()[0]), threads[0] if threads else stack)


def stuck_frame(stack: str) -> str:
    """The innermost frame of py-spy's main thread that belongs to the learner's code."""
    for line in main_thread(stack).splitlines()[1:]:
        m = re.match(r"\s+(\S+) \((.+):(\d+)\)", line)
        if m and not _NOT_LEARNER.search(m.group(2)):
            return f"{Path(m.group(2)).name}:{m.group(3)} in {m.group(1)}"
    return "(no frame outside torch)"


def _node_dump_command(script: str) -> str:
    """What one step per node runs: py-spy on every process of ``script`` *on this node*.

    The cluster's nodes share this machine's process table, as containers would not; the
    processes of a node are those in its network namespace (``pgrep --ns $$ --nslist net``).  The
    pattern starts at the interpreter, so that srun's own command line, which names the script
    too, does not match."""
    return (f"for p in $(pgrep -f '^[^ ]*python[^ ]* {script}' --ns $$ --nslist net); do "
            f"echo \"== $(hostname) pid $p\"; {shlex.quote(str(PY_SPY))} dump --pid $p; done")


def _per_process(srun_output: str) -> dict[tuple[str, int], str]:
    """``{(host, pid): py-spy's dump}`` from the labelled output (``srun --label``) of the steps."""
    texts: dict[str, list[str]] = {}
    for line in srun_output.splitlines():
        task, _, rest = line.partition(": ")
        texts.setdefault(task.strip(), []).append(rest)
    found = {}
    for lines in texts.values():
        for part in "\n".join(lines).split("== ")[1:]:
            head, _, dump = part.partition("\n")
            host, _, pid = head.partition(" pid ")
            found[(host.strip(), int(pid))] = _ANSI.sub("", dump)
    return found


def stacks_under_slurm(cluster: Any, folder: Path, cwd: Path, timeout: float = 60.0) -> dict:
    """Run ``ch13_hang.py --fault missing`` as a two-node Slurm job (one task per node, no torchrun),
    dump every rank from a step inside its allocation until their frames hold still, release it.

    Returns ``{"job", "command", "stacks": {(host, rank, pid): dump}, "state"}``; ``folder`` gets the
    job's pid files, flight records and log, ``cwd`` holds ``ch13_hang.py``."""
    if PY_SPY is None:
        raise RuntimeError("py-spy is not installed: `pip install py-spy` (it is in pyproject.toml)")
    worker = ("RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=0 "
              "MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -1) "
              "MASTER_PORT=$((20000 + SLURM_JOB_ID % 10000)) OMP_NUM_THREADS=1 TORCH_CPP_LOG_LEVEL=FATAL "
              f"exec {shlex.quote(sys.executable)} ch13_hang.py --fault missing "
              f"--dumps {shlex.quote(str(folder))} --timeout {timeout:g}")
    job = cluster.sbatch("--wrap", f"srun bash -c {shlex.quote(worker)}", cwd=cwd,
                         options=["-N", "2", "--ntasks-per-node=1", f"--output={folder}/job-%j.out"])
    pid_rank = {}
    try:
        deadline = time.monotonic() + timeout
        while len(list(folder.glob("pid*"))) < 2:
            if time.monotonic() > deadline or cluster.job(job).get("JobState") not in ("PENDING", "RUNNING"):
                raise RuntimeError(f"the job's ranks did not start: {cluster.job(job)}\n{cluster.logs()}")
            time.sleep(0.2)
        pid_rank = {int(p.read_text()): int(p.name[3:]) for p in folder.glob("pid*")}
        command = ["srun", f"--jobid={job}", "--overlap", "-N", "2", "--ntasks-per-node=1", "--label",
                   "bash", "-c", _node_dump_command("ch13_hang.py")]
        before, stacks = None, {}
        for _ in range(10):  # until two rounds in a row find every rank in the same frame, and the
            # rank's own background import (the flight recorder's, see ch13_hang.py) has finished
            stacks = _per_process(cluster.run(*command, timeout=timeout))
            frames = {k: stuck_frame(v) for k, v in stacks.items()}
            settled = all("import_module" not in v for v in stacks.values())
            if frames == before and len(frames) == 2 and settled:
                break
            before = frames
            time.sleep(0.3)
    finally:
        (folder / "release").touch()
    state = cluster.wait(job, timeout=timeout).get("JobState")
    return {"job": job, "command": command,
            "stacks": {(host, pid_rank.get(pid, -1), pid): dump for (host, pid), dump in stacks.items()},
            "state": state}
