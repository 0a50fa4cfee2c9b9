"""What the hardware is doing while training runs: GPU utilisation and memory, or CPU and RSS.

Two tools:

- ``gpu_summary()``: one reading of every GPU through NVML (the library behind ``nvidia-smi``,
  reached with the ``pynvml`` module of the ``nvidia-ml-py`` package).  Returns ``[]`` when there is
  no NVML library or no GPU, so a notebook can call it anywhere.
- ``ResourceSampler``: a context manager that samples in a background thread while the body of the
  ``with`` block runs (training, say) and can plot what it saw::

      with ResourceSampler(interval=0.1) as rs:
          course_utils.launch(train, nprocs=2)
      rs.plot()

  Each sample holds the CPU use and resident memory (RSS) of the watched process *and all its
  descendants* (the notebook kernel's ``launch`` workers and their DataLoader workers are
  descendants), the machine's total CPU use, and, when NVML sees GPUs, each GPU's utilisation and
  memory in use.  ``plot()`` shows the GPU curves when there are GPUs, else the CPU curves.

What the numbers mean:

- NVML's *GPU utilisation* is the percentage of the last sample period (1/6 s to 1 s, depending
  on the GPU) during which at least one kernel was running.  A GPU at 100 % can still be poorly
  used (one tiny kernel at a time), but a GPU well below 100 % is certainly waiting for something:
  data, the CPU, or communication.
- *CPU %* follows ``top``: 100 % is one core fully busy, so two busy processes show 200 %.
- *RSS* sums the resident memory of the processes; pages that forked processes share are counted
  once per process, so the total overstates real use.  Watch how it *changes*, not its level.

GPU numbers are NVML's (``nvidia-smi``'s), which count every GPU of the machine in PCI order.  CUDA
counts only the GPUs in ``CUDA_VISIBLE_DEVICES``, so with ``CUDA_VISIBLE_DEVICES=2,3`` the job's
``cuda:0`` is NVML's GPU 2.  ``ResourceSampler(gpus="auto")`` samples exactly the GPUs this process
may use (``visible_gpus()`` does the translation); a list of indices means NVML indices.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import psutil

__all__ = ["ResourceSampler", "gpu_summary", "nvml_available", "visible_gpus"]


# --------------------------------------------------------------------------------------------
# NVML
# --------------------------------------------------------------------------------------------

_nvml_lock = threading.Lock()
_nvml_state: dict[str, Any] = {"ok": None, "error": ""}


def _nvml():
    """The initialised ``pynvml`` module, or None (no package, no driver, no GPU)."""
    with _nvml_lock:
        if _nvml_state["ok"] is False:
            return None
        try:
            import pynvml  # optional: NVML is only there on machines with NVIDIA drivers
        except ImportError as e:
            _nvml_state.update(ok=False, error=f"pynvml is not installed ({e})")
            return None
        if _nvml_state["ok"] is None:
            try:
                pynvml.nvmlInit()  # reference-counted in NVML; never shut down while we sample
            except Exception as e:  # NVMLError_LibraryNotFound / DriverNotLoaded / ...
                _nvml_state.update(ok=False, error=f"NVML is not usable here: {e}")
                return None
            _nvml_state["ok"] = True
        return pynvml


def nvml_available() -> tuple[bool, str]:
    """(True, "") when NVML answers, else (False, why not)."""
    nv = _nvml()
    if nv is None:
        return False, _nvml_state["error"]
    return True, ""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _gpu_count(nv) -> int:
    try:
        return int(nv.nvmlDeviceGetCount())
    except Exception:
        return 0


def _read_gpu(nv, index: int, *, details: bool) -> dict:
    h = nv.nvmlDeviceGetHandleByIndex(index)
    util = nv.nvmlDeviceGetUtilizationRates(h)
    mem = nv.nvmlDeviceGetMemoryInfo(h)
    row = {
        "index": index,
        "util_percent": float(util.gpu),
        "mem_util_percent": float(util.memory),
        "memory_used_mb": mem.used / 2**20,
        "memory_total_mb": mem.total / 2**20,
    }
    if details:
        row["name"] = _text(nv.nvmlDeviceGetName(h))
        try:
            row["temperature_c"] = float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
        except Exception:
            row["temperature_c"] = None
        try:
            row["power_w"] = nv.nvmlDeviceGetPowerUsage(h) / 1000.0
        except Exception:
            row["power_w"] = None
    return row


def visible_gpus(nv: Any = None) -> list[int]:
    """NVML indices of the GPUs this process's CUDA may use, in CUDA's order (``cuda:0`` first).

    Every GPU when ``CUDA_VISIBLE_DEVICES`` is unset; else its entries, which are NVML indices
    (CUDA numbers them in the same PCI order when the GPUs are alike, or with
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID``) or ``GPU-`` UUIDs.  CUDA stops at the first entry it cannot
    use, and so does this.  ``[]`` without NVML.
    """
    nv = nv or _nvml()
    if nv is None:
        return []
    count = _gpu_count(nv)
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return list(range(count))
    out: list[int] = []
    for entry in (e.strip() for e in env.split(",")):
        if entry.isdigit() and int(entry) < count:
            index = int(entry)
        elif entry.startswith("GPU-"):
            try:
                index = int(nv.nvmlDeviceGetIndex(nv.nvmlDeviceGetHandleByUUID(entry)))
            except Exception:  # a UUID prefix, a MIG instance, an unknown GPU
                break
        else:
            break
        if index in out:
            break
        out.append(index)
    return out


def gpu_summary() -> list[dict]:
    """One NVML reading per GPU: name, utilisation, memory (MiB), temperature, power.

    Returns ``[]`` without the ``pynvml`` module, without an NVIDIA driver or without a GPU.
    """
    nv = _nvml()
    if nv is None:
        return []
    rows = []
    for i in range(_gpu_count(nv)):
        try:
            rows.append(_read_gpu(nv, i, details=True))
        except Exception as e:  # one unreadable GPU must not hide the others
            rows.append({"index": i, "error": str(e)})
    return rows


# --------------------------------------------------------------------------------------------
# The sampler
# --------------------------------------------------------------------------------------------


class ResourceSampler:
    """Sample CPU/RSS of a process tree, and GPU utilisation/memory via NVML, in a thread.

    Parameters
    ----------
    interval:
        Seconds between samples.
    pid:
        The process to watch (default: this one).  Its descendants are included unless
        ``children=False``.
    children:
        Include every descendant process (``launch`` workers, DataLoader workers).
    gpus:
        ``"auto"`` (the GPUs this process's CUDA may use, see ``visible_gpus``; none without
        NVML), ``None`` (no GPU sampling, CPU only), or a list of NVML GPU indices.

    After the ``with`` block, ``samples`` is a list of dicts with the keys ``t`` (seconds since
    the start), ``cpu_percent`` (the watched tree; 100 = one core), ``rss_mb`` (the tree),
    ``system_cpu_percent`` (the whole machine, 0-100), ``nprocs`` (processes in the tree), and,
    when GPUs are sampled, ``gpu_util`` and ``gpu_mem_mb`` (one value per sampled GPU).
    ``marks`` holds ``(t, label)`` pairs added with ``mark()``.
    """

    def __init__(self, interval: float = 0.1, pid: int | None = None, *, children: bool = True,
                 gpus: Any = "auto"):
        if interval <= 0:
            raise ValueError("interval must be positive (seconds between samples)")

        self.interval = float(interval)
        self.pid = os.getpid() if pid is None else int(pid)
        self.children = children
        self.samples: list[dict] = []
        self.marks: list[tuple[float, str]] = []
        self.error: str = ""
        self._root = psutil.Process(self.pid)  # raises NoSuchProcess for a wrong pid: good
        self._procs: dict[int, Any] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._nv = None
        self.gpu_indices: list[int] = []
        if gpus is not None:
            nv = _nvml()
            if nv is not None:
                count = _gpu_count(nv)
                wanted = visible_gpus(nv) if gpus == "auto" else list(gpus)
                self.gpu_indices = [i for i in wanted if 0 <= i < count]
                self._nv = nv if self.gpu_indices else None

    # ---- what is being sampled ------------------------------------------------------------
    @property
    def source(self) -> str:
        """``"nvml"`` when GPUs are sampled, else ``"cpu"``."""
        return "nvml" if self._nv is not None else "cpu"

    # ---- start / stop ---------------------------------------------------------------------
    def start(self) -> ResourceSampler:
        if self._thread is not None:
            raise RuntimeError("this ResourceSampler is already running")

        psutil.cpu_percent(None)  # prime the machine-wide counter
        self._t0 = time.monotonic()
        self._stop.clear()
        self._sample()  # a first sample at t=0 primes the per-process counters
        self._thread = threading.Thread(target=self._run, name="resource-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> ResourceSampler:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=max(5.0, 5 * self.interval))
            self._thread = None
            self._sample()  # a last sample at the end of the block
        return self

    def __enter__(self) -> ResourceSampler:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def mark(self, label: str) -> None:
        """Remember a moment (drawn as a vertical line by ``plot``), e.g. ``mark("num_workers=2")``."""
        self.marks.append((time.monotonic() - self._t0, str(label)))

    # ---- sampling -------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._sample()
            except Exception as e:  # the watched process may be gone; keep what we have
                self.error = f"{type(e).__name__}: {e}"
                if not self._root.is_running():
                    return

    def _tree(self) -> list[Any]:

        try:
            procs = [self._root] + (self._root.children(recursive=True) if self.children else [])
        except psutil.NoSuchProcess:
            return []
        live = {}
        for p in procs:
            # Reuse the Process object we already know, so cpu_percent() measures since last time.
            live[p.pid] = self._procs.get(p.pid, p)
        self._procs = live
        return list(live.values())

    def _sample(self) -> None:

        cpu = 0.0
        rss = 0
        n = 0
        for p in self._tree():
            try:
                with p.oneshot():
                    cpu += p.cpu_percent(None)  # 0.0 on the first call for a process
                    rss += p.memory_info().rss
                n += 1
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        sample: dict[str, Any] = {
            "t": time.monotonic() - self._t0,
            "cpu_percent": cpu,
            "rss_mb": rss / 2**20,
            "system_cpu_percent": psutil.cpu_percent(None),
            "nprocs": n,
        }
        if self._nv is not None:
            util, mem = [], []
            for i in self.gpu_indices:
                try:
                    row = _read_gpu(self._nv, i, details=False)
                    util.append(row["util_percent"])
                    mem.append(row["memory_used_mb"])
                except Exception:
                    util.append(float("nan"))
                    mem.append(float("nan"))
            sample["gpu_util"] = util
            sample["gpu_mem_mb"] = mem
        self.samples.append(sample)

    # ---- results --------------------------------------------------------------------------
    def series(self, key: str) -> list[Any]:
        """One key across all samples, e.g. ``rs.series("cpu_percent")``."""
        return [s.get(key) for s in self.samples]

    def summary(self) -> dict[str, float]:
        """Mean and peak of the main curves (the first sample, a priming one, is skipped)."""
        body = self.samples[1:] or self.samples
        out: dict[str, float] = {}
        if not body:
            return out
        for key in ("cpu_percent", "rss_mb", "system_cpu_percent"):
            vals = [s[key] for s in body]
            out[f"{key}_mean"] = sum(vals) / len(vals)
            out[f"{key}_max"] = max(vals)
        if self._nv is not None:
            for j, i in enumerate(self.gpu_indices):
                u = [s["gpu_util"][j] for s in body if s.get("gpu_util")]
                m = [s["gpu_mem_mb"][j] for s in body if s.get("gpu_mem_mb")]
                if u:
                    out[f"gpu{i}_util_mean"] = sum(u) / len(u)
                    out[f"gpu{i}_mem_mb_max"] = max(m)
        out["seconds"] = body[-1]["t"] - self.samples[0]["t"]
        return out

    def plot(self, ax: Any = None, *, title: str | None = None) -> Any:
        """Plot utilisation (left axis) and memory (right axis) against time; returns the axis.

        GPU curves when GPUs were sampled, else the CPU curves of the watched process tree (and
        the machine's total CPU use, dotted, since other programs share the CPU).
        """
        import matplotlib.pyplot as plt  # slow to import: only when a plot is drawn

        if ax is None:
            _, ax = plt.subplots(figsize=(8, 3.2))
        t = self.series("t")
        mem_ax = ax.twinx()
        if self._nv is not None:
            for j, i in enumerate(self.gpu_indices):
                ax.plot(t, [s["gpu_util"][j] for s in self.samples], label=f"GPU {i} utilisation")
                mem_ax.plot(t, [s["gpu_mem_mb"][j] for s in self.samples], linestyle="--",
                            label=f"GPU {i} memory")
            ax.set_ylabel("GPU utilisation (%)")
            ax.set_ylim(0, 105)
            mem_ax.set_ylabel("GPU memory used (MiB)")
        else:
            ax.plot(t, self.series("cpu_percent"), label="CPU, watched processes")
            ax.plot(t, [s["system_cpu_percent"] * (os.cpu_count() or 1) for s in self.samples],
                    linestyle=":", color="grey", label="CPU, whole machine")
            mem_ax.plot(t, self.series("rss_mb"), linestyle="--", color="tab:red", label="RSS")
            ax.set_ylabel("CPU (%; 100 = one core)")
            ax.set_ylim(0, 105 * (os.cpu_count() or 1))
            mem_ax.set_ylabel("resident memory (MiB)")
        for when, label in self.marks:
            ax.axvline(when, color="black", linewidth=0.8)
            ax.annotate(label, (when, ax.get_ylim()[1]), xytext=(3, -12),
                        textcoords="offset points", fontsize=8)
        ax.set_xlabel("time (s)")
        lines = [ln for ln in ax.get_lines() + mem_ax.get_lines()
                 if not ln.get_label().startswith("_")]
        ax.legend(lines, [ln.get_label() for ln in lines], loc="upper right", fontsize=8)
        ax.set_title(title or ("GPU, sampled through NVML" if self._nv is not None
                               else "no GPU: CPU and memory of the process tree (psutil)"))
        return ax
