"""Machine time per chapter: run every lesson and solution notebook, record time, cores, memory.

    python benchmarks/chapter_times.py --note "quiet 2-core VM, nothing else running"
    python benchmarks/chapter_times.py notebooks/04_ddp.ipynb --out /tmp/ch04.json
    python benchmarks/chapter_table.py        # the Markdown table INSTRUCTORS.md embeds
    python benchmarks/chapter_times.py --record --quiet-wait 120   # what `make notebooks` runs

Each notebook is executed headless (``jupyter nbconvert --execute``) one after the other, from a
temporary copy of ``notebooks/`` and ``solutions/``, so nothing in the course folder changes.
``--record`` instead runs them where they are and writes each executed notebook back over its
source when every cell ran: the committed outputs and the chapter times then come from the same
run.  ``--quiet-wait S`` checks before each notebook that nothing else keeps the machine busy
(``benchmarks/quiet.py``), waiting up to S seconds, and stops otherwise.
For each it records the wall time, whether every cell ran, the peak and mean CPU use (in cores)
and the peak memory (sum of RSS and sum of PSS, MiB) of the whole process tree: nbconvert, the
kernel and every worker process.  It also records what reading time is estimated from: the words
of the Markdown cells and the lines of code.

The results go to ``benchmarks/results/chapter_times.json`` with a description of the machine,
when the run started and ended, the load average before and after (other programs running at the
same time make every number worse), and ``--note``: say there whether the machine was quiet.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import _measure
import quiet

DEFAULT_OUT = _measure.ROOT / "benchmarks" / "results" / "chapter_times.json"


def _merged(old: dict, new: dict) -> dict:
    """``old`` with ``new``'s notebooks replaced or added, and ``new``'s session listed in ``later``."""
    session = dict(new["measured"], notebooks=sorted(new["notebooks"]))
    earlier = []  # earlier sessions keep the notebooks that this one did not measure again
    for x in old.get("later", []):
        left = [n for n in x["notebooks"] if n not in new["notebooks"]]
        if left:
            earlier.append(dict(x, notebooks=left))
    kept = {"measured": old["measured"], "machine": old["machine"],
            "later": [*earlier, session],
            "notebooks": {**old["notebooks"], **new["notebooks"]}}
    if new["machine"] != old["machine"]:
        session["machine"] = new["machine"]
    return kept


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="*", type=Path,
                    help="notebooks to run (default: notebooks/[0-9]*.ipynb and solutions/[0-9]*.ipynb)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default: {DEFAULT_OUT}")
    ap.add_argument("--note", default="", help="where and under what load this was measured")
    ap.add_argument("--interval", type=float, default=0.25, help="seconds between samples")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    ap.add_argument("--record", action="store_true",
                    help="run in the course folder and write the executed notebooks back")
    ap.add_argument("--merge", action="store_true",
                    help="keep the other notebooks' results in --out, and record this run as a later "
                         "measurement of the notebooks given")
    ap.add_argument("--quiet-wait", type=float, default=None, metavar="S",
                    help="before each notebook, wait up to S seconds for a quiet machine, else stop")
    a = ap.parse_args(argv)
    wanted = [p.resolve() for p in a.notebooks] or sorted(
        list((_measure.ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
        + list((_measure.ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")))
    result = {"measured": {"started_utc": _measure.now_utc(), "note": a.note,
                           "load_average_before": _measure.load_average(),
                           "command": "python benchmarks/chapter_times.py"},
              "machine": _measure.machine(), "notebooks": {}}
    failed = 0
    with tempfile.TemporaryDirectory(prefix="chapter-times-") as tmp:
        if not a.record:
            _measure.copy_course(Path(tmp))
        for src in wanted:
            rel = f"{src.parent.name}/{src.name}"
            if a.quiet_wait is not None and quiet.main(["--wait", str(a.quiet_wait),
                                                        "--root", str(os.getpid())]):
                return 1
            where = src if a.record else Path(tmp) / rel
            run = _measure.run_notebook(where, timeout=a.timeout, interval=a.interval,
                                        save_to=src if a.record else None)
            run.update(_measure.notebook_facts(src))
            result["notebooks"][rel] = run
            failed += not run["ok"]
            print(f"{'[OK]  ' if run['ok'] else '[FAIL]'} {run['wall_s']:6.1f} s  "
                  f"peak {run['peak_cores']:4.1f} cores  {run['peak_pss_mib']:5d} MiB PSS  "
                  f"{run['peak_rss_mib']:5d} MiB RSS  {rel}" + (f"\n       {run['error']}"
                                                                 if not run["ok"] else ""),
                  flush=True)
    result["measured"]["ended_utc"] = _measure.now_utc()
    result["measured"]["load_average_after"] = _measure.load_average()
    if a.merge and a.out.exists():
        result = _merged(json.loads(a.out.read_text(encoding="utf-8")), result)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"{len(wanted) - failed} of {len(wanted)} notebooks ran; results in {a.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
