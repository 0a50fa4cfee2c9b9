"""Each lesson's first cell says how long it takes to read, computed from its own text.

The line is ``**Reading:** about N minutes for its W words of text, at 200 words a minute; ...``:
W is the number of words in the lesson's markdown cells (this line left out), N is W / 200 rounded.
A lesson that grows or shrinks by more than 5% fails here until the line is updated (recount
with the rule below).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
LESSONS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
READING = re.compile(r"\*\*Reading:\*\* about (\d+) minutes? for its ([\d,]+) words of text, "
                     r"at 200 words a minute")


def words_of_text(nb: dict) -> int:
    """Words in the markdown cells, the reading line itself left out."""
    text = "\n".join(re.sub(r"\*\*Reading:\*\*[^\n]*", "", "".join(c["source"]))
                     for c in nb["cells"] if c["cell_type"] == "markdown")
    return len(re.findall(r"[A-Za-z0-9][\w'’\-]*", text))


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_the_header_gives_the_reading_time_of_the_lesson_as_it_is(lesson):
    nb = json.loads(lesson.read_text())
    header = "".join(nb["cells"][0]["source"])
    m = READING.search(header)
    assert m, f"{lesson.name}: the first cell has no '**Reading:** about N minutes for its W words ...' line"
    minutes, claimed = int(m.group(1)), int(m.group(2).replace(",", ""))
    counted = words_of_text(nb)
    assert abs(claimed - counted) <= 0.05 * counted, (
        f"{lesson.name}: the header says {claimed} words, the lesson has {counted} now: update the line")
    assert minutes == max(1, round(claimed / 200)), f"{lesson.name}: {claimed} words, not {minutes} minutes"
    assert "**How long" in header or "**Runs in**" in header or "**Time:**" in header, (
        f"{lesson.name}: the header says nothing of the machine time")
