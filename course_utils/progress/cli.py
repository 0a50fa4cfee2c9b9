"""The command line: ``python -m course_utils.progress`` (the learner's table, ``--json`` for its rows)
and ``python -m course_utils.progress --room DIR`` (the room's)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from pathlib import Path

from .room import room, room_table
from .store import ProgressWarning
from .table import rows, table

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course_utils.progress",
        description="Show which course exercises you passed, failed or have not tried yet.")
    parser.add_argument("--file", help="progress file to read (default: $COURSE_PROGRESS_FILE "
                        "or <course>/progress/progress.json)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--room", metavar="DIR",
                        help="instead: one table for a whole room, from every learner's progress file "
                        "collected in DIR (<learner>.json, or <learner>/progress.json)")
    args = parser.parse_args(argv)
    # A damaged or odd file is a warning, printed as one line before the table: never a traceback.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ProgressWarning)
        if args.room:
            out = (json.dumps(dataclasses.asdict(room(args.room)), indent=1) if args.json
                   else room_table(args.room))
        elif args.json:
            out = json.dumps([dataclasses.asdict(r) for r in rows(args.file)], indent=1)
        else:
            out = table(args.file)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    print(out)
    if args.room:
        return 0 if Path(args.room).is_dir() else 2
    return 0
