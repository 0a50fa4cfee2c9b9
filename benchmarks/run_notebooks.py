"""Run notebooks headless and print how long each took and whether every cell ran.

    python benchmarks/run_notebooks.py                      # every lesson and solution
    python benchmarks/run_notebooks.py notebooks/08_*.ipynb --out /tmp/executed

An instructor can run it on the workshop machines the day before; it is also how the course is
checked on a GPU machine (the same notebooks take their CUDA/NCCL paths there). Cells tagged
``raises-exception`` may fail; any other error is reported with the cell's first line.
"""

from __future__ import annotations

import argparse
import glob
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parent.parent


def run_one(path: Path, out_dir: Path | None, timeout: int) -> tuple[bool, float, str]:
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    t0 = time.perf_counter()
    ok, note = True, ""
    try:
        client.execute()
    except CellExecutionError as e:
        ok = False
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        note = lines[-1][:300] if lines else "cell error"
    except Exception as e:  # kernel died, timeout
        ok = False
        note = f"{type(e).__name__}: {str(e)[:300]}"
    elapsed = time.perf_counter() - t0
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, out_dir / f"{path.parent.name}__{path.name}")
    return ok, elapsed, note


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="*", help="default: notebooks/*.ipynb solutions/*.ipynb")
    ap.add_argument("--out", type=Path, help="save executed copies here")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    a = ap.parse_args(argv)
    paths = [Path(p) for p in a.notebooks] or [
        Path(p) for p in sorted(glob.glob(str(ROOT / "notebooks/*.ipynb")))
        + sorted(glob.glob(str(ROOT / "solutions/*.ipynb")))]
    failed = 0
    total = 0.0
    for p in paths:
        ok, dt, note = run_one(p, a.out, a.timeout)
        total += dt
        failed += not ok
        print(f"{'[OK]  ' if ok else '[FAIL]'} {dt:7.1f} s  {p.parent.name}/{p.name}"
              + (f"\n         {note}" if note else ""), flush=True)
    print(f"{len(paths) - failed} passed, {failed} failed in {total:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
