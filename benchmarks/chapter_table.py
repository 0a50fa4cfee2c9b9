"""Print the Markdown table of time per chapter that INSTRUCTORS.md embeds, from chapter_times.json.

    python benchmarks/chapter_table.py [--json benchmarks/results/chapter_times.json] [--write]

Machine times are measured (``benchmarks/chapter_times.py``); reading times are an estimate from
the notebooks' length: Markdown words at 200 words a minute plus code at 20 lines a minute,
rounded up to 5 minutes.  ``tests/library/test_instructors.py`` checks that INSTRUCTORS.md holds exactly
this table: after re-running the measurement, ``--write`` puts the new table in.

The *main path* of a lesson is its text without the parts marked "Going deeper": a heading whose text
contains "Going deeper" opens such a part, and the next heading of the same or a higher level that does
not closes it. ``lesson_words`` counts both; ``chapter_times.py --record`` keeps the counts with each
measurement, and the table shows them (``tests/lessons/test_headers.py`` checks each lesson's header
against the count of the lesson as it is).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

DEFAULT = Path(__file__).resolve().parent / "results" / "chapter_times.json"
GUIDE = Path(__file__).resolve().parent.parent / "INSTRUCTORS.md"
BEGIN, END = "<!-- chapter-times:begin -->\n", "\n<!-- chapter-times:end -->"
WORDS_PER_MIN, CODE_LINES_PER_MIN = 200, 20
_WORD = re.compile(r"[A-Za-z0-9][\w'’\-]*")
_HEADING = re.compile(r"^(#{1,6})[ \t]+(.*)$", re.M)
# The header's own lines about reading time are not counted.
_HEADER_LINES = re.compile(r"\*\*(?:Reading|Main path):\*\*[^\n]*")


def lesson_words(nb: dict) -> tuple[int, int]:
    """Words of a lesson's Markdown: (main path, parts marked "Going deeper"); rule in the module doc."""
    counts = [0, 0]
    deeper_level = None  # the level of the heading that opened the current "Going deeper" part
    for cell in nb["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        text = _HEADER_LINES.sub("", "".join(cell["source"]))
        starts = [m.start() for m in _HEADING.finditer(text)]
        for a, b in zip([0, *starts], [*starts, len(text)]):
            piece = text[a:b]
            m = _HEADING.match(piece)
            if m:
                level, title = len(m.group(1)), m.group(2)
                if "going deeper" in title.lower():
                    deeper_level = level if deeper_level is None else min(deeper_level, level)
                elif deeper_level is not None and level <= deeper_level:
                    deeper_level = None
            counts[deeper_level is not None] += len(_WORD.findall(piece))
    return counts[0], counts[1]


def _main_path(nb: dict | None) -> str:
    if nb is None or "main_path_words" not in nb:
        return "—"
    main, deeper = nb["main_path_words"], nb["deeper_words"]
    more = f" (+{deeper:,} deeper)" if deeper else ""
    return f"{main:,} words, ~{max(1, round(main / WORDS_PER_MIN))} min{more}"


def reading_minutes(nb: dict) -> int:
    minutes = nb["markdown_words"] / WORDS_PER_MIN + nb["code_lines"] / CODE_LINES_PER_MIN
    return max(5, 5 * math.ceil(minutes / 5))


def _run(nb: dict | None) -> str:
    if nb is None:
        return "—"
    return f"{nb['wall_s']:.0f} s" + ("" if nb["ok"] else " (failed)")


def table(data: dict) -> str:
    nbs = data["notebooks"]
    chapters = sorted({Path(k).stem for k in nbs})
    m = data["measured"]
    lines = [f"Measured {m['started_utc']} to {m.get('ended_utc', '?')} on {data['machine']['logical_cpus']} "
             f"CPUs ({data['machine']['cpu_model']}), {data['machine']['memory_gib']} GiB, torch "
             f"{data['machine']['torch']}; load average {m['load_average_before'][0]} before, "
             f"{m.get('load_average_after', ['?'])[0]} after. {m['note']}".rstrip(),
             *[f"Measured again {x['started_utc']} to {x.get('ended_utc', '?')}, load average "
               f"{x['load_average_before'][0]} before, {x.get('load_average_after', ['?'])[0]} after: "
               f"{', '.join(x['notebooks'])}. {x['note']}".rstrip() for x in data.get("later", [])],
             "",
             "| chapter | lesson: run all (machine) | lesson: reading (estimate) | main path | "
             "exercises | solutions: run all (machine) | peak cores | peak memory (PSS) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for ch in chapters:
        les, sol = nbs.get(f"notebooks/{ch}.ipynb"), nbs.get(f"solutions/{ch}.ipynb")
        runs = [x for x in (les, sol) if x]
        reading = f"~{reading_minutes(les)} min" if les else "—"
        lines.append(f"| {ch} | {_run(les)} | {reading} | {_main_path(les)} | "
                     f"{sol['exercises'] if sol else 0} | {_run(sol)} | "
                     f"{max(x['peak_cores'] for x in runs):.1f} | "
                     f"{max(x['peak_pss_mib'] for x in runs)} MiB |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=DEFAULT)
    ap.add_argument("--write", action="store_true", help=f"replace the table in {GUIDE.name}")
    a = ap.parse_args(argv)
    text = table(json.loads(a.json.read_text(encoding="utf-8")))
    if not a.write:
        print(text)
        return 0
    guide = GUIDE.read_text(encoding="utf-8")
    head, rest = guide.split(BEGIN, 1)
    GUIDE.write_text(head + BEGIN + text + END + rest.split(END, 1)[1], encoding="utf-8")
    print(f"{GUIDE.name}: table replaced")
    return 0


if __name__ == "__main__":
    sys.exit(main())
