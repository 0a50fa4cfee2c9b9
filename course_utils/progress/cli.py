"""The command line: ``python -m course_utils.progress`` (the learner's table, ``--json`` for its rows)
and ``python -m course_utils.progress --room DIR`` (the room's)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from .room import room, room_table
from .table import rows, show

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
    if args.room:
        if args.json:
            json.dump(dataclasses.asdict(room(args.room)), sys.stdout, indent=1)
            print()
        else:
            print(room_table(args.room))
        return 0 if Path(args.room).is_dir() else 2
    if args.json:
        json.dump([dataclasses.asdict(r) for r in rows(args.file)], sys.stdout, indent=1)
        print()
    else:
        show(args.file)
    return 0
