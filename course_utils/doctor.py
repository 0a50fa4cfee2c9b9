"""Environment self-check: ``python -m course_utils.doctor`` (and the first cell of chapter 00).

Prints one ``[OK]``, ``[INFO]`` or ``[FAIL]`` line per requirement; every ``[FAIL]`` says what to do.
The last line is the one an instructor asks the room for, e.g.
``ROOM: READY for every chapter on CPU; GPU parts: no GPU, their CPU versions run (checked in 6 s)``
or ``ROOM: NOT READY: fix the [FAIL] line(s) above (worker launch)``.
Exits with status 1 when anything failed.

The checks run at the same time, in threads: the worker launch (which starts the fork server and
imports torch in it) takes most of the time, and the other checks finish while it runs.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import os
import platform
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import psutil
import torch
import torch.distributed as dist

import course_utils

__all__ = ["Result", "run_checks", "room_line", "main"]


@dataclasses.dataclass
class Result:
    status: str  # "OK", "INFO" or "FAIL"
    name: str
    detail: str

    def line(self) -> str:
        return f"[{self.status}] {self.name}: {self.detail}"


def _python() -> Result:
    v = sys.version_info
    if v >= (3, 11):
        return Result("OK", "python", f"{platform.python_version()} ({sys.executable})")
    return Result("FAIL", "python", f"{platform.python_version()} is too old: the course needs 3.11 "
                  "or newer. Create the environment with `make lab` or `environment.yml`.")


def _torch() -> Result:
    # (Without torch, `import course_utils` itself fails: the error names the missing module.)
    cuda = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU-only build"
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
    except ImportError:
        return Result("FAIL", "NVML", "the pynvml module is missing: `pip install nvidia-ml-py`.")
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


def _packages() -> Result:
    missing = []
    for mod in ("matplotlib", "ipywidgets", "cloudpickle", "psutil", "nbformat"):
        try:
            importlib.import_module(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        return Result("FAIL", "packages", f"missing {', '.join(missing)}: run `make lab` or "
                      "`pip install -e .` in the course folder.")
    return Result("OK", "packages", "matplotlib, ipywidgets, cloudpickle, psutil, nbformat")


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


def run_checks(echo: bool = True) -> list[Result]:
    """Run every check (at the same time, in threads), printing the lines in order."""
    results = []
    with ThreadPoolExecutor(max_workers=len(CHECKS) or 1, thread_name_prefix="doctor") as pool:
        futures = [pool.submit(check) for check in CHECKS]
        for check, future in zip(CHECKS, futures):
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
    started = psutil.Process().create_time()  # the time the room waits includes Python and torch starting
    results = run_checks()
    failed = [r for r in results if r.status == "FAIL"]
    print(f"\n{len(failed)} problem(s) found." if failed
          else "\nAll set: open notebooks/01_single_device.ipynb next.")
    print(room_line(results, time.time() - started), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
