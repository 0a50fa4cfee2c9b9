"""How many CPU threads each worker gets: every core this process may use, once, shared out.

The count starts from the cores this process may actually run on, not the machine's total: the
CPU affinity mask (``taskset``, Slurm, a container's cpuset) and the cgroup CPU quota (a container
or a JupyterHub user limited to, say, 2 CPUs on a 64-core host).  Giving each of two workers 32
threads on such a 2-CPU allowance would make them fight for the CPU instead of computing.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["usable_cpus", "cpu_threads_per_worker"]

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _affinity_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _quota_v2(cgroup_dir: Path) -> float | None:
    """``cpu.max`` of this cgroup and its parents: the smallest quota/period, None if unlimited."""
    best: float | None = None
    d = cgroup_dir
    while True:
        try:
            quota, period = (d / "cpu.max").read_text().split()[:2]
            if quota != "max":
                cpus = int(quota) / int(period)
                best = cpus if best is None else min(best, cpus)
        except (OSError, ValueError):
            pass
        if d == CGROUP_ROOT or d.parent == d:
            return best
        d = d.parent


def _quota_v1(cgroup_dir: Path) -> float | None:
    try:
        quota = int((cgroup_dir / "cpu.cfs_quota_us").read_text())
        period = int((cgroup_dir / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def cgroup_cpu_limit(proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """CPUs allowed by the cgroup CPU quota of this process (v2 or v1), or None when unlimited."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        rel = path.lstrip("/")
        if hierarchy == "0" and controllers == "":  # cgroup v2
            limit = _quota_v2(CGROUP_ROOT / rel)
            if limit is not None:
                return limit
        elif "cpu" in controllers.split(","):  # cgroup v1
            for base in (CGROUP_ROOT / controllers, CGROUP_ROOT / "cpu,cpuacct", CGROUP_ROOT / "cpu"):
                for d in (base / rel, base):
                    limit = _quota_v1(d)
                    if limit is not None:
                        return limit
    return None


def usable_cpus() -> int:
    """Cores this process may use: its affinity mask, capped by the cgroup quota (at least 1)."""
    cpus = _affinity_cpus()
    limit = cgroup_cpu_limit()
    if limit is not None:
        cpus = min(cpus, max(1, math.floor(limit)))
    return max(1, cpus)


def cpu_threads_per_worker(total_workers: int) -> int:
    """Intra-op threads each worker gets so that all workers together use each usable core once."""
    return max(1, usable_cpus() // max(1, total_workers))
