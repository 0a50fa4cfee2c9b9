"""Simulate a classroom server: N learners running solution notebooks at the same time.

    python benchmarks/room_simulation.py --learners 2 3 --note "quiet 2-core VM"
    python benchmarks/room_simulation.py --learners 2 3 solutions/01_*.ipynb solutions/04_*.ipynb

For each N, N copies of the course are made (one per learner) and each learner runs the chosen
solution notebooks one after the other, all learners at once, as a room does in the exercise part
of a workshop.  It records, per learner and notebook, whether every cell ran and how many
``[PASS]`` lines the checkers printed, and the wall time of the whole round.  Results go to
``benchmarks/results/room_simulation.json``; ``--markdown`` prints the summary docs/jupyterhub.md
quotes, and ``--write`` puts it there.  Scaling to a bigger server from these numbers is an
extrapolation, and says so.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import threading
import time
from pathlib import Path

import _measure

DEFAULT_OUT = _measure.ROOT / "benchmarks" / "results" / "room_simulation.json"
CHAPTER_TIMES = _measure.ROOT / "benchmarks" / "results" / "chapter_times.json"
PAGE = _measure.ROOT / "docs" / "jupyterhub.md"
BEGIN, END = "<!-- room-simulation:begin -->\n", "\n<!-- room-simulation:end -->"
DEFAULT_NOTEBOOKS = ["solutions/01_single_device.ipynb", "solutions/03_collectives.ipynb",
                     "solutions/04_ddp.ipynb"]


def one_round(n: int, notebooks: list[str], timeout: int) -> dict:
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix=f"room-{n}-") as tmp:
        homes = [Path(tmp) / f"learner{i}" for i in range(n)]
        for h in homes:
            _measure.copy_course(h)

        def learner(i: int) -> None:
            for nb in notebooks:
                results[f"learner{i}/{nb}"] = _measure.run_notebook(homes[i] / nb, timeout=timeout)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=learner, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
    ok = all(r["ok"] for r in results.values())
    return {"learners": n, "wall_s": round(wall, 1), "all_passed": ok, "runs": results}


def markdown(data: dict) -> str:
    m, mach = data["measured"], data["machine"]
    lines = [f"Measured {m['started_utc']} to {m['ended_utc']} on {mach['logical_cpus']} CPUs "
             f"({mach['cpu_model']}), {mach['memory_gib']} GiB; load average {m['load_average_before'][0]} "
             f"before. {m['note']}".rstrip(),
             f"Each learner ran: {', '.join(data['notebooks'])}.", "",
             "| learners at once | all cells ran, every check passed | [PASS] lines | round took | "
             "slowest notebook |", "| ---: | --- | ---: | ---: | ---: |"]
    for r in data["rounds"]:
        runs = r["runs"].values()
        lines.append(f"| {r['learners']} | {'yes' if r['all_passed'] else 'NO'} | "
                     f"{sum(x['pass_lines'] for x in runs)} | {r['wall_s']:.0f} s | "
                     f"{max(x['wall_s'] for x in runs):.0f} s |")
    lines += ["", sizing(data, json.loads(CHAPTER_TIMES.read_text(encoding="utf-8")))]
    return "\n".join(lines)


def sizing(room: dict, chapters: dict, server_cores: int = 16, server_gib: int = 64,
           reserved_gib: int = 4) -> str:
    """Per-user limits from the measured peaks, and learners per server: an extrapolation."""
    runs = chapters["notebooks"].values()
    peak_mib = max(r["peak_pss_mib"] for r in runs)
    peak_cores = max(r["peak_cores"] for r in runs)
    mem_gib = math.ceil(peak_mib / 512) / 2 + 0.5  # the peak rounded up to 0.5 GiB, plus 0.5 GiB
    cores = max(1, math.ceil(peak_cores))
    machine_cores = room["machine"]["logical_cpus"]
    passed = [r["learners"] for r in room["rounds"] if r["all_passed"]]
    by_mem = (server_gib - reserved_gib) // mem_gib
    by_cpu = server_cores * max(passed) // machine_cores if passed else 0
    return "\n".join([
        f"Sizing, computed by this script: the highest peak of one learner (any notebook, "
        f"`chapter_times.json`) is {peak_mib} MiB PSS and {peak_cores:.1f} cores, so a per-user "
        f"memory limit of {mem_gib:g} GiB and a CPU limit of {cores} core(s), with a guarantee of "
        f"{cores / 2:g}. A {server_cores}-core, {server_gib} GiB server keeping {reserved_gib} GiB "
        f"for the system and the hub holds {by_mem:g} learners by memory (every learner at peak at "
        f"once) and about {by_cpu} by CPU ({max(passed) if passed else 0} learners passed every check "
        f"together on {machine_cores} cores here, scaled by {server_cores}/{machine_cores}): "
        f"plan for **{int(min(by_mem, by_cpu))} learners**. This is an extrapolation from a "
        f"{machine_cores}-core machine, not a measurement on the server."])


def write_page(text: str) -> None:
    """Replace the summary between the room-simulation markers of docs/jupyterhub.md."""
    page = PAGE.read_text(encoding="utf-8")
    head, rest = page.split(BEGIN, 1)
    PAGE.write_text(head + BEGIN + text + END + rest.split(END, 1)[1], encoding="utf-8")
    print(f"{PAGE.name}: summary replaced")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="*", default=DEFAULT_NOTEBOOKS)
    ap.add_argument("--learners", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--note", default="")
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--markdown", action="store_true", help="print the summary of --out and exit")
    ap.add_argument("--write", action="store_true", help=f"put the summary into {PAGE.name}")
    a = ap.parse_args(argv)
    if a.markdown:
        text = markdown(json.loads(a.out.read_text(encoding="utf-8")))
        write_page(text) if a.write else print(text)
        return 0
    data = {"measured": {"started_utc": _measure.now_utc(), "note": a.note,
                         "load_average_before": _measure.load_average(),
                         "command": "python benchmarks/room_simulation.py"},
            "machine": _measure.machine(), "notebooks": a.notebooks, "rounds": []}
    for n in a.learners:
        r = one_round(n, a.notebooks, a.timeout)
        data["rounds"].append(r)
        print(f"{n} learners: {'all passed' if r['all_passed'] else 'FAILURES'} in {r['wall_s']:.0f} s",
              flush=True)
    data["measured"]["ended_utc"] = _measure.now_utc()
    data["measured"]["load_average_after"] = _measure.load_average()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(markdown(data))
    if a.write:
        write_page(markdown(data))
    return 0 if all(r["all_passed"] for r in data["rounds"]) else 1


if __name__ == "__main__":
    sys.exit(main())
