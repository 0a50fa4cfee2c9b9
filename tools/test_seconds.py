"""Write tests/seconds.json, each test file's and notebook's time, from `pytest --durations=0`.

The root conftest.py sorts `make test`'s files by these times, longest first, so that its two
workers finish together.  Refresh it when tests grow or shrink a lot:

    make test PYTEST_ARGS=--durations=0 | tee durations.txt
    .venv/bin/python tools/test_seconds.py durations.txt

Test files and notebooks (their cells' times summed) are measured in the same run, so their
times compare.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "seconds.json"
LINE = re.compile(r"^([\d.]+)s (?:call|setup|teardown)\s+(\S+?\.(?:py|ipynb))::")


def seconds_per_file(text: str) -> dict[str, float]:
    """Setup, call and teardown seconds summed per file, from --durations=0 output."""
    total: Counter[str] = Counter()
    for line in text.splitlines():
        m = LINE.match(line.strip())
        if m:
            total[m.group(2)] += float(m.group(1))
    return {path: round(s, 1) for path, s in sorted(total.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("durations", type=Path, help="a file holding `pytest --durations=0` output")
    args = ap.parse_args()
    seconds = seconds_per_file(args.durations.read_text())
    if not seconds:
        raise SystemExit(f"{args.durations}: no duration lines (run pytest with --durations=0)")
    OUT.write_text(json.dumps(seconds, indent=1) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}: {len(seconds)} files, {sum(seconds.values()):.0f} s in all")


if __name__ == "__main__":
    main()
