"""Each lesson's first cell says how long it takes to read, computed from its own text.

The line is ``**Reading:** about N minutes for its W words of text, at 200 words a minute; ...``:
W is the number of words in the lesson's markdown cells (the header's reading lines left out), N is
W / 200 rounded. The next line gives the *main path*: the words outside the parts headed "Going deeper"
(``benchmarks/chapter_table.py``, ``lesson_words``, has the rule), ``**Main path:** about M minutes for
its P words; ...``, or ``**Main path:** the whole text; ...`` where no part is headed so. A lesson that
grows or shrinks by more than 5% fails here until the lines are updated (recount with the rule).
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
LESSONS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
READING = re.compile(r"\*\*Reading:\*\* about (\d+) minutes? for its ([\d,]+) words of text, "
                     r"at 200 words a minute")
MAIN_PATH = re.compile(r"\*\*Main path:\*\* (?:about (\d+) minutes? for its ([\d,]+) words|the whole text)")


def _chapter_table():
    spec = importlib.util.spec_from_file_location("chapter_table", ROOT / "benchmarks" / "chapter_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


lesson_words = _chapter_table().lesson_words


def _close(claimed: int, counted: int) -> bool:
    return abs(claimed - counted) <= 0.05 * counted


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_the_header_gives_the_reading_time_of_the_lesson_as_it_is(lesson):
    nb = json.loads(lesson.read_text())
    header = "".join(nb["cells"][0]["source"])
    m = READING.search(header)
    assert m, f"{lesson.name}: the first cell has no '**Reading:** about N minutes for its W words ...' line"
    minutes, claimed = int(m.group(1)), int(m.group(2).replace(",", ""))
    main, deeper = lesson_words(nb)
    counted = main + deeper
    assert _close(claimed, counted), (
        f"{lesson.name}: the header says {claimed} words, the lesson has {counted} now: update the line")
    assert minutes == max(1, round(claimed / 200)), f"{lesson.name}: {claimed} words, not {minutes} minutes"
    assert "**How long" in header or "**Runs in**" in header or "**Time:**" in header, (
        f"{lesson.name}: the header says nothing of the machine time")


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_the_header_gives_the_main_path_as_it_is(lesson):
    nb = json.loads(lesson.read_text())
    m = MAIN_PATH.search("".join(nb["cells"][0]["source"]))
    main, deeper = lesson_words(nb)
    assert m, f"{lesson.name}: the first cell has no '**Main path:** about M minutes for its P words' line"
    if m.group(1) is None:
        assert deeper == 0, (
            f"{lesson.name}: says the main path is the whole text, but {deeper} words are deeper")
        return
    minutes, claimed = int(m.group(1)), int(m.group(2).replace(",", ""))
    assert deeper > 0, f"{lesson.name}: gives a main path but no part is headed 'Going deeper'"
    assert _close(claimed, main), (
        f"{lesson.name}: the header says {claimed} main-path words, the lesson has {main}")
    assert minutes == max(1, round(claimed / 200)), f"{lesson.name}: {claimed} words, not {minutes} minutes"


def test_the_going_deeper_rule_closes_a_part_at_the_next_heading_of_its_level():
    def md(*texts):
        return {"cells": [{"cell_type": "markdown", "source": t} for t in texts]}
    nb = md("# Title\none two", "## 1. Main\nthree four five",
            "### Going deeper: details\nsix seven", "#### sub\neight", "### 1.2 Back\nnine",
            "## Going deeper: more\nten", "### inside\neleven", "## Summary\ntwelve")
    # main (14 words; "1" and "2" count): Title one two | 1. Main three four five | 1.2 Back nine |
    # Summary twelve
    # deeper (13): Going deeper details six seven | sub eight | Going deeper more ten | inside eleven
    assert lesson_words(nb) == (14, 13)
