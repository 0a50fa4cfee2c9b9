"""Is this machine quiet enough to record measurements?  Exit 0 if so, 1 (with the reason) if not.

    python benchmarks/quiet.py [--seconds 2] [--max-share 0.15] [--wait 0]

The committed notebooks carry measurements (throughput, step times, bandwidth) and the verdicts
their cells print from them.  Recorded while something else keeps the cores busy, they say more
about that other work than about the code.  This samples, for ``--seconds``, the CPU time used by
every process that is not this script's caller or one of its descendants (``make notebooks`` and
the notebook kernels it starts) and calls the machine quiet when those others used less than
``--max-share`` of one core.  ``--wait S`` keeps checking for up to ``S`` seconds before giving up.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import psutil


def _ours(root: psutil.Process) -> set[int]:
    pids = {root.pid}
    try:
        pids |= {p.pid for p in root.children(recursive=True)}
    except psutil.Error:
        pass
    return pids


def _cpu_by_process() -> dict[int, tuple[str, float]]:
    out = {}
    for p in psutil.process_iter(["name", "cpu_times"]):
        t = p.info["cpu_times"]
        if t is not None:
            out[p.pid] = (p.info["name"] or "?", t.user + t.system)
    return out


def others_busy(root: psutil.Process, seconds: float) -> tuple[float, list[tuple[str, int, float]]]:
    """Share of one core used by processes outside ``root``'s tree over ``seconds``, and the top ones."""
    before = _cpu_by_process()
    time.sleep(seconds)
    after = _cpu_by_process()
    ours = _ours(root)
    used = []
    for pid, (name, t) in after.items():
        if pid in ours or pid not in before:
            continue
        delta = t - before[pid][1]
        if delta > 0:
            used.append((name, pid, delta / seconds))
    used.sort(key=lambda x: -x[2])
    return sum(u for _, _, u in used), used[:3]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--max-share", type=float, default=0.15)
    ap.add_argument("--wait", type=float, default=0.0)
    ap.add_argument("--root", type=int, default=os.getppid(),
                    help="pid whose process tree is ours (default: the caller; 0: this script only)")
    a = ap.parse_args(argv)
    try:
        root = psutil.Process(a.root) if a.root else psutil.Process()
    except psutil.NoSuchProcess:
        root = psutil.Process()
    deadline = time.monotonic() + a.wait
    while True:
        share, top = others_busy(root, a.seconds)
        if share < a.max_share:
            print(f"quiet: other processes used {share:.0%} of a core over {a.seconds:g} s")
            return 0
        if time.monotonic() >= deadline:
            break
        time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
    names = ", ".join(f"{n} (pid {pid}, {u:.0%})" for n, pid, u in top)
    print(f"not quiet: other processes used {share:.0%} of a core over {a.seconds:g} s "
          f"(limit {a.max_share:.0%}); busiest: {names}.\n"
          "Measurements recorded now would carry their noise. Stop that work and run again, "
          "or record anyway with QUIET=skip (the committed numbers then say little).",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
