"""Shared by the classroom benchmarks: run one notebook headless, sampling its whole process tree.

``run_notebook(path)`` executes a notebook with ``jupyter nbconvert --execute`` (the executed copy
goes to a temporary folder, and over ``save_to`` only when asked and every cell ran) while a thread
samples, every ``interval`` seconds, the CPU use and memory of the nbconvert process, its kernel and
every worker the kernel starts.  nbconvert plus the kernel stands in for what one learner runs on a server: a
Jupyter server process plus a kernel.

Memory is recorded two ways: the sum of RSS over the tree (pages shared between forked workers are
counted once per process, so this overstates real use) and the sum of PSS (each shared page split
between the processes sharing it; close to what a container's memory limit is charged).
"""

from __future__ import annotations

import datetime as _dt
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent


class TreeSampler:
    """Peak and mean CPU (in cores) and peak RSS/PSS (MiB) of a process and its descendants."""

    def __init__(self, pid: int, interval: float = 0.25):
        self.root = psutil.Process(pid)
        self.interval = interval
        self.procs: dict[int, psutil.Process] = {}
        self.cpu_cores: list[float] = []
        self.rss_mib: list[float] = []
        self.pss_mib: list[float] = []
        self.max_procs = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> TreeSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                tree = [self.root] + self.root.children(recursive=True)
            except psutil.Error:
                return
            cpu = rss = pss = 0.0
            live = {}
            for p in tree:
                p = self.procs.get(p.pid, p)  # keep the object: cpu_percent() is since last call
                live[p.pid] = p
                try:
                    with p.oneshot():
                        cpu += p.cpu_percent(None)
                        rss += p.memory_info().rss
                        try:
                            pss += p.memory_full_info().pss
                        except (AttributeError, psutil.AccessDenied):
                            pss += p.memory_info().rss
                except psutil.Error:
                    continue
            self.procs = live
            self.cpu_cores.append(cpu / 100)
            self.rss_mib.append(rss / 2**20)
            self.pss_mib.append(pss / 2**20)
            self.max_procs = max(self.max_procs, len(live))

    def summary(self) -> dict:
        cpu = self.cpu_cores[1:] or [0.0]  # the first sample only primes the counters
        return {
            "peak_cores": round(max(cpu), 2),
            "mean_cores": round(sum(cpu) / len(cpu), 2),
            "peak_rss_mib": round(max(self.rss_mib, default=0.0)),
            "peak_pss_mib": round(max(self.pss_mib, default=0.0)),
            "max_processes": self.max_procs,
            "samples": len(self.cpu_cores),
        }


def _lesson_words(nb: dict) -> tuple[int, int]:
    """chapter_table.lesson_words, loaded by path: this module is itself loaded by path from tests."""
    path = Path(__file__).with_name("chapter_table.py")
    spec = importlib.util.spec_from_file_location("chapter_table", path)
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    return table.lesson_words(nb)


def notebook_facts(path: Path) -> dict:
    """Words a learner reads (Markdown words plus code lines) and the number of exercises."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    words = code_lines = 0
    exercises = set()
    for cell in nb["cells"]:
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if cell["cell_type"] == "markdown":
            words += len(re.findall(r"\w+", src))
            # a heading per exercise ("## Exercise 01.a: ..." or "## 10.a ..."): some are solved in
            # a .py file beside the notebook (mini_ddp.py), with no solution block in the notebook
            exercises.update(re.findall(r"^#+\s+(?:Exercise\s+)?(\d\d\.[a-z])\b", src, re.M))
        elif cell["cell_type"] == "code":
            code_lines += sum(1 for line in src.splitlines() if line.strip())
            exercises.update(re.findall(r"### BEGIN SOLUTION (\S+)", src))
    main, deeper = _lesson_words(nb)
    return {"markdown_words": words, "code_lines": code_lines, "exercises": len(exercises),
            "main_path_words": main, "deeper_words": deeper}


def copy_course(dest: Path) -> None:
    """Copy the lessons and solutions (with their .py files) so runs never write into the repo."""
    for folder in ("notebooks", "solutions"):
        shutil.copytree(ROOT / folder, dest / folder,
                        ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))


def run_notebook(path: Path, *, timeout: int = 600, interval: float = 0.25,
                 env: dict | None = None, save_to: Path | None = None) -> dict:
    """Execute one notebook headless; wall time, resource peaks, and what its outputs show.

    With ``save_to``, a run in which every cell ran writes the executed notebook there.
    """
    out_dir = Path(tempfile.mkdtemp(prefix="nbrun-"))
    try:
        cmd = [sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
               f"--ExecutePreprocessor.timeout={timeout}", "--output-dir", str(out_dir),
               "--output", path.stem, str(path)]
        if os.name == "posix":
            # The kernel talks to nbconvert over Unix sockets in out_dir, not TCP ports, which
            # another program could take between nbconvert's choice and the kernel's bind (a kernel
            # then dies before its first reply).
            cmd += ["--KernelManager.transport=ipc", f"--KernelManager.ip={out_dir / 'kernel'}"]
        full_env = dict(os.environ, COURSE_PROGRESS="off", **(env or {}))
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=path.parent, env=full_env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        sampler = TreeSampler(proc.pid, interval).start()
        try:
            log, _ = proc.communicate(timeout=timeout * 3)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            log, _ = proc.communicate()
        wall = time.perf_counter() - t0
        sampler.stop()
        result = {"wall_s": round(wall, 1), "ok": proc.returncode == 0, **sampler.summary()}
        executed = out_dir / f"{path.stem}.ipynb"
        passes = 0
        if executed.exists():
            nb = json.loads(executed.read_text(encoding="utf-8"))
            for cell in nb["cells"]:
                for o in cell.get("outputs", []):
                    text = o.get("text", "")
                    text = "".join(text) if isinstance(text, list) else text
                    passes += len(re.findall(r"^\[PASS\]", text, re.M))
        result["pass_lines"] = passes
        if save_to is not None and result["ok"] and executed.exists():
            shutil.copyfile(executed, save_to)
        if not result["ok"]:
            log = re.sub(r"\x1b\[[0-9;]*m", "", log)  # colour codes of the traceback
            lines = [ln for ln in log.splitlines() if ln.strip()]
            result["error"] = " | ".join(lines[-3:])[-400:]
        return result
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def machine() -> dict:
    """What the numbers were measured on."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return {
        "cpu_model": model or platform.processor(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }


def now_utc() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]
