"""Environment self-check: ``make doctor`` or ``python -m course_utils.doctor`` (and chapter 00's first cell).

Prints one ``[OK]``, ``[INFO]``, ``[WARN]`` or ``[FAIL]`` line per requirement; every ``[FAIL]`` gives
the one command that fixes it. The last line is the one an instructor asks the room for, e.g.
``ROOM: READY for every chapter on CPU; GPU parts: no GPU, their CPU versions run (checked in 6 s)``
or ``ROOM: NOT READY: fix the [FAIL] line(s) above (worker launch)``.
Exits with status 1 when anything failed.

It runs with any Python 3.9 or newer, also one without torch or the course's other packages (the
machine's own ``python3`` before ``make lab``, or outside the activated ``.venv``): it then names
what is missing and how to get it, and skips the checks that need torch.

The checks run at the same time, in threads: the worker launch (which starts the fork server and
imports torch in it) takes most of the time, and the other checks finish while it runs.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# The doctor runs without them (it reports them missing); ``course_utils`` then imports but cannot launch.
try:
    import psutil
except ImportError:
    psutil = None
try:
    import torch
    import torch.distributed as dist
except ImportError:
    torch = dist = None

import course_utils

_STARTED = time.time()
ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv"
# The modules the course imports, with the distribution that provides each.
REQUIRED = {"torch": "torch", "numpy": "numpy", "cloudpickle": "cloudpickle", "psutil": "psutil",
            "matplotlib": "matplotlib", "ipywidgets": "ipywidgets", "nbformat": "nbformat",
            "pynvml": "nvidia-ml-py"}
# Without these, launching workers (and every check that needs torch) is impossible.
LAUNCHER = ("torch", "numpy", "cloudpickle", "psutil")

__all__ = ["Result", "run_checks", "room_line", "main"]


@dataclasses.dataclass
class Result:
    status: str  # "OK", "INFO", "WARN" (works, but worth fixing) or "FAIL"
    name: str
    detail: str

    def line(self) -> str:
        return f"[{self.status}] {self.name}: {self.detail}"


def _absent(modules) -> list[str]:
    """The modules of ``modules`` that this Python cannot import (found without importing them)."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def _in_course_venv() -> bool:
    return VENV.is_dir() and Path(sys.prefix).resolve() == VENV.resolve()


def _fix(missing: list[str]) -> str:
    """The one command that installs ``missing`` (module names) into the right Python."""
    if not (ROOT / "Makefile").is_file():  # installed from a wheel (Colab, Kaggle): no Makefile here
        return "`pip install " + " ".join(REQUIRED.get(m, m) for m in missing) + "`"
    if _in_course_venv():
        return f"`pip install -e {ROOT}` (this is the course's .venv, but it lacks them)"
    if any(VENV.glob("lib/python*/site-packages/torch")):
        return (f"`. {VENV}/bin/activate` to use the course's .venv, which has them, then run this "
                "again (`make doctor` uses it without activating)")
    return f"`make lab` in {ROOT} (it creates .venv with all of them)"


def _nvidia_driver() -> str | None:
    """Evidence of an NVIDIA driver on this machine, or None."""
    smi = shutil.which("nvidia-smi")
    if smi:
        return f"nvidia-smi at {smi}"
    return "/proc/driver/nvidia" if os.path.exists("/proc/driver/nvidia") else None


def _python() -> Result:
    v = sys.version_info
    where = sys.executable + (", the course's .venv" if _in_course_venv() else "")
    if v >= (3, 11):
        return Result("OK", "python", f"{platform.python_version()} ({where})")
    return Result("FAIL", "python", f"{platform.python_version()} ({where}) is too old: the course needs "
                  "3.11 or newer. Create its environment with one: `make lab PYTHON=python3.11`.")


def _packages() -> Result:
    missing = []
    for mod in REQUIRED:
        try:
            importlib.import_module(mod)
        except Exception:  # missing or broken: either way the course cannot use it
            missing.append(mod)
    if missing:
        names = ", ".join(REQUIRED[m] for m in missing)
        return Result("FAIL", "packages", f"missing {names}: {_fix(missing)}")
    return Result("OK", "packages", ", ".join(REQUIRED.values()))


def _torch() -> Result:
    cuda = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU-only build"
    if torch.version.cuda and not _nvidia_driver():
        fix = ("`rm -rf .venv && make lab` installs the CPU build instead" if _in_course_venv() else
               "the CPU build is `pip install --force-reinstall torch==" + torch.__version__.split("+")[0]
               + " --index-url https://download.pytorch.org/whl/cpu`")
        return Result("WARN", "torch", f"{torch.__version__} ({cuda}) on a machine with no NVIDIA driver "
                      f"(no nvidia-smi, no /proc/driver/nvidia): it runs on CPU, but its CUDA libraries "
                      f"only take space; {fix}")
    return Result("OK", "torch", f"{torch.__version__} ({cuda})")


def _backends() -> Result:

    if not dist.is_available():
        return Result("FAIL", "torch.distributed", "this torch build has no distributed support; "
                      "install the official wheel from PyPI.")
    have = [n for n, f in (("gloo", dist.is_gloo_available), ("nccl", dist.is_nccl_available),
                           ("mpi", dist.is_mpi_available)) if f()]
    if "gloo" not in have:
        return Result("FAIL", "backends", f"available: {have}; gloo is missing, and every CPU demo "
                      "needs it. Install the official torch wheel.")
    missing = [n for n in ("nccl", "mpi") if n not in have]
    note = f"; not in this build: {', '.join(missing)}" if missing else ""
    return Result("OK", "backends", f"{', '.join(have)}{note}")


def _gpus() -> Result:
    try:
        import pynvml  # optional: NVML is only there on machines with NVIDIA drivers
    except ImportError:  # the packages line names it
        return Result("INFO", "GPUs", "not checked: the NVML bindings are missing (see packages)")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return Result("INFO", "GPUs", "no NVIDIA driver or GPU found: everything runs on CPU with "
                      "gloo; cells that need a GPU say so and skip.")
    try:
        n = pynvml.nvmlDeviceGetCount()
        names = []
        for i in range(n):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h).total / 2**30
            names.append(f"{name if isinstance(name, str) else name.decode()} ({mem:.0f} GiB)")
    finally:
        pynvml.nvmlShutdown()

    if n and not torch.cuda.is_available():
        return Result("FAIL", "GPUs", f"NVML sees {n} GPU(s) but torch cannot use them: install a "
                      "CUDA build of torch (see README, 'GPU machines').")
    if not n:
        return Result("INFO", "GPUs", "NVML works but sees no GPU: CPU with gloo.")
    return Result("OK", "GPUs", f"{n}: " + "; ".join(names))


def _shim() -> Result:
    try:
        importlib.metadata.version("pynvml")
    except importlib.metadata.PackageNotFoundError:
        return Result("OK", "NVML bindings", "nvidia-ml-py (no deprecated pynvml package)")
    return Result("FAIL", "NVML bindings", "the deprecated `pynvml` package is installed; it makes "
                  "every `import torch` print a FutureWarning. Run `pip uninstall -y pynvml` and "
                  "`pip install nvidia-ml-py`.")


def _cores() -> Result:

    cores = os.cpu_count() or 1
    mem = psutil.virtual_memory().total / 2**30
    if cores < 2:
        return Result("INFO", "machine", f"1 core, {mem:.0f} GiB: two workers share one core, so "
                      "demos run slowly but correctly.")
    return Result("OK", "machine", f"{cores} cores, {mem:.0f} GiB memory")


def _launch() -> Result:

    def all_reduce_ranks() -> float:

        dist.init_process_group("gloo")
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        dist.destroy_process_group()
        return t.item()

    try:
        t0 = time.perf_counter()
        out = course_utils.launch(all_reduce_ranks, 2, timeout=60)
        dt = time.perf_counter() - t0
    except Exception as e:  # report, never crash the self-check
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return Result("FAIL", "worker launch", f"{type(e).__name__}: {first}. Check that no "
                      "firewall blocks 127.0.0.1 and that /dev/shm is writable; then restart the "
                      "kernel and rerun.")
    if out != [3.0, 3.0]:
        return Result("FAIL", "worker launch", f"2-rank all_reduce gave {out}, expected [3.0, 3.0]")
    return Result("OK", "worker launch", f"2 workers ran an all_reduce over gloo in {dt:.2f} s")


CHECKS: list[Callable[[], Result]] = [_python, _torch, _backends, _gpus, _shim, _cores, _packages,
                                      _launch]
# The checks that run without torch and the launcher's other packages.
STANDALONE = (_python, _packages)


def run_checks(echo: bool = True) -> list[Result]:
    """Run every check (at the same time, in threads), printing the lines in order.

    Without torch (or another package the launcher needs) only the STANDALONE checks run: the
    ``packages`` line says what is missing and how to install it."""
    checks = [c for c in CHECKS if c in STANDALONE] if _absent(LAUNCHER) else CHECKS
    results = []
    with ThreadPoolExecutor(max_workers=len(checks) or 1, thread_name_prefix="doctor") as pool:
        futures = [pool.submit(check) for check in checks]
        for check, future in zip(checks, futures):
            try:
                r = future.result()
            except Exception as e:  # a check that crashes is itself a failure worth reporting
                r = Result("FAIL", check.__name__.strip("_"), f"{type(e).__name__}: {e}")
            results.append(r)
            if echo:
                print(r.line(), flush=True)
    return results


def _gpu_count() -> int:
    """GPUs torch can use."""
    if torch is None:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def room_line(results: list[Result], seconds: float | None = None) -> str:
    """One line summing up the checks, for an instructor asking a room "what does your last line say?"."""
    took = f" (checked in {seconds:.0f} s)" if seconds is not None else ""
    failed = [r.name for r in results if r.status == "FAIL"]
    if failed:
        return f"ROOM: NOT READY: fix the [FAIL] line(s) above ({', '.join(failed)}){took}"
    gpus = _gpu_count() or 0
    if gpus == 0:
        gpu = "no GPU, their CPU versions run"
    elif gpus == 1:
        gpu = "1 GPU; the two-rank demos need one GPU per rank, so they run on CPU with gloo"
    else:

        gpu = (f"{gpus} GPUs with NCCL" if dist.is_nccl_available()
               else f"{gpus} GPUs but no NCCL in this torch build, so gloo on CPU")
    return f"ROOM: READY for every chapter on CPU; GPU parts: {gpu}{took}"


def main() -> int:
    # The time the room waits includes Python and torch starting.
    started = psutil.Process().create_time() if psutil is not None else _STARTED
    results = run_checks()
    failed = [r for r in results if r.status == "FAIL"]
    warned = sum(r.status == "WARN" for r in results)
    print(f"\n{len(failed)} problem(s) found." if failed
          else "\nAll set: open notebooks/01_single_device.ipynb next."
          + (f" ({warned} warning(s) above)" if warned else ""))
    print(room_line(results, time.time() - started), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
