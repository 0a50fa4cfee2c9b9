"""Which torch ``make lab`` installs, from where, and why: ``make which-torch`` (installs nothing).

On Linux x86_64 the torch that PyPI serves is the CUDA build, which brings NVIDIA's CUDA libraries
(the ``nvidia-*`` packages) with it. A machine without an NVIDIA GPU needs none of them, so there
``make lab`` takes PyTorch's CPU build from its CPU index (torch 2.13.0 for Python 3.11: a 183 MiB
wheel), and the other packages from the indexes pip is configured with. The rules, first match wins:

1. ``WHEELS=<folder>`` (offline install, pip's ``--no-index``): the requirement as written.
2. ``TORCH_SPEC=...`` given: the requirement as written (it may carry its own ``--index-url``).
3. ``TORCH_INDEX=<url>``: that index for torch; ``TORCH_INDEX=`` (empty) or ``default``: pip's own.
4. Otherwise (``TORCH_INDEX=auto``): the CPU index on Linux x86_64 without an NVIDIA driver
   (no ``nvidia-smi`` on PATH, no ``/proc/driver/nvidia``) when it answers within a few seconds;
   else, with a message saying why, pip's own index.

``--pip-args`` prints the arguments for ``pip install`` on stdout and the reason on stderr (the
Makefile's install rule); without it the script prints the choice for a reader. Plain Python 3.9+,
no torch: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shlex
import shutil
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PYPI = "https://pypi.org/simple"
TIMEOUT = 5.0  # seconds the CPU index has to answer before pip's own index is used instead


@dataclasses.dataclass
class Choice:
    args: list[str]  # what follows `pip install`
    index: str  # where torch comes from, in words
    why: str


def nvidia_driver() -> str | None:
    """Evidence of an NVIDIA driver on this machine, or None."""
    smi = shutil.which("nvidia-smi")
    if smi:
        return f"nvidia-smi at {smi}"
    return "/proc/driver/nvidia" if os.path.exists("/proc/driver/nvidia") else None


def unreachable(index: str, timeout: float = TIMEOUT) -> str | None:
    """None when ``index`` answers for torch within ``timeout`` seconds, else the reason it did not.

    The request runs in a thread so that a slow name lookup (which no socket timeout covers) cannot
    hold up the install either."""
    problem: list[str] = [f"no answer in {timeout:.0f} s"]

    def ask() -> None:
        try:
            req = urllib.request.Request(index.rstrip("/") + "/torch/", method="HEAD")
            with urllib.request.urlopen(req, timeout=timeout):
                problem.clear()
        except Exception as e:  # any failure means: do not send pip there
            problem[:] = [f"{type(e).__name__}: {e}"]

    t = threading.Thread(target=ask, daemon=True)
    t.start()
    t.join(timeout + 1)
    return problem[0] if problem else None


def configured_indexes() -> list[str]:
    """The indexes pip uses here (its environment and config files), pip's default when none is set."""
    found = {"index-url": os.environ.get("PIP_INDEX_URL", "").split(),
             "extra-index-url": os.environ.get("PIP_EXTRA_INDEX_URL", "").split()}
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        key, _, value = line.partition("=")
        variant, _, option = key.rpartition(".")
        if option in found and (variant == ":env:" or not found[option]):  # the environment wins
            found[option] = value.strip().strip("'\"").split()
    urls = (found["index-url"] or [PYPI]) + found["extra-index-url"]
    return list(dict.fromkeys(urls))


def _on_linux_x86_64() -> bool:
    return sys.platform.startswith("linux") and platform.machine().lower() in ("x86_64", "amd64")


def _from(index: str, configured: list[str]) -> list[str]:
    """pip arguments taking torch from ``index`` and everything else from the configured indexes."""
    args = ["--index-url", index]
    for url in configured:
        args += ["--extra-index-url", url]
    return args


def choose(spec: str, *, spec_given: bool = False, index: str = "auto", cpu_index: str = CPU_INDEX,
           no_index: bool = False, linux_x86_64: bool | None = None,
           gpu: Callable[[], str | None] | None = None,
           reach: Callable[[str], str | None] | None = None,
           configured: Callable[[], list[str]] | None = None) -> Choice:
    """The choice for this machine; ``gpu``, ``reach`` and ``configured`` replace its probes."""
    gpu, reach = gpu or nvidia_driver, reach or unreachable
    configured = configured or configured_indexes
    req = shlex.split(spec)
    if no_index:
        return Choice(req, "the wheelhouse only (no index)", "WHEELS is set: pip installs from that folder")
    if spec_given:
        return Choice(req, "as TORCH_SPEC says", "TORCH_SPEC was given: it is installed as written")
    if index != "auto":
        if index in ("", "default"):
            return Choice(req, "pip's configured index", "TORCH_INDEX is set to the configured index")
        return Choice(req + _from(index, configured()), index, "TORCH_INDEX names this index")
    if not (_on_linux_x86_64() if linux_x86_64 is None else linux_x86_64):
        return Choice(req, "pip's configured index", f"on {sys.platform} {platform.machine()} PyPI's torch "
                      "is used: the CPU index is chosen only on Linux x86_64, where PyPI's is the CUDA build")
    evidence = gpu()
    if evidence:
        return Choice(req, "pip's configured index (PyPI's own torch is the CUDA build)",
                      f"an NVIDIA driver is here ({evidence}), so the CUDA build")
    problem = reach(cpu_index)
    if problem:
        return Choice(req, "pip's configured index (PyPI's own torch is the CUDA build)",
                      f"no NVIDIA GPU here, but the CPU index {cpu_index} cannot be reached ({problem}); "
                      "falling back to the default build, a larger download (set TORCH_INDEX or "
                      "TORCH_SPEC to choose another)")
    return Choice(req + _from(cpu_index, configured()), f"{cpu_index} (PyTorch's CPU builds)",
                  "no NVIDIA GPU here (no nvidia-smi on PATH, no /proc/driver/nvidia), so the CPU build "
                  "(183 MiB for torch 2.13.0 on Python 3.11) instead of the CUDA build and its nvidia-* "
                  "libraries")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default="torch", help="the requirement (the Makefile's TORCH_SPEC)")
    ap.add_argument("--spec-given", action="store_true", help="TORCH_SPEC was set by the user")
    ap.add_argument("--index", default="auto", help="auto, default (or empty), or an index URL")
    ap.add_argument("--cpu-index", default=CPU_INDEX, help="PyTorch's CPU index")
    ap.add_argument("--no-index", action="store_true", help="install from a wheelhouse, no index")
    ap.add_argument("--pip-args", action="store_true",
                    help="print the arguments for pip install (the reason goes to stderr)")
    ns = ap.parse_args(argv)
    no_index = ns.no_index or os.environ.get("PIP_NO_INDEX", "").lower() in ("1", "true", "yes", "on")
    c = choose(ns.spec, spec_given=ns.spec_given, index=ns.index, cpu_index=ns.cpu_index, no_index=no_index)
    if ns.pip_args:
        print(f"torch: {' '.join(shlex.split(ns.spec))} from {c.index}: {c.why}", file=sys.stderr)
        print(" ".join(c.args))
        return 0
    print(f"requirement: {' '.join(shlex.split(ns.spec))}")
    print(f"index:       {c.index}")
    print(f"why:         {c.why}")
    print(f"make lab runs: pip install {' '.join(c.args)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
