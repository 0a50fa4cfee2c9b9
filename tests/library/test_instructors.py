"""INSTRUCTORS.md embeds exactly the table that benchmarks/chapter_table.py makes from the JSON."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _chapter_table():
    spec = importlib.util.spec_from_file_location("chapter_table", ROOT / "benchmarks" / "chapter_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_guide_table_matches_the_measurements():
    data = json.loads((ROOT / "benchmarks" / "results" / "chapter_times.json").read_text())
    guide = (ROOT / "INSTRUCTORS.md").read_text()
    embedded = guide.split("<!-- chapter-times:begin -->\n", 1)[1].split("\n<!-- chapter-times:end -->", 1)[0]
    assert embedded == _chapter_table().table(data), (
        "INSTRUCTORS.md's table is out of date: paste in the output of python benchmarks/chapter_table.py")


def test_measurements_say_when_where_and_cover_every_chapter():
    data = json.loads((ROOT / "benchmarks" / "results" / "chapter_times.json").read_text())
    assert data["measured"]["started_utc"] and data["machine"]["logical_cpus"]
    lessons = {p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    measured = {Path(k).name for k in data["notebooks"] if k.startswith("notebooks/")}
    # a chapter being written may not be measured yet; every measured one must still exist
    assert measured <= lessons and len(measured) >= 10
    for nb in data["notebooks"].values():
        assert nb["wall_s"] > 0 and nb["peak_pss_mib"] > 0


def test_reading_time_is_an_estimate_rounded_to_five_minutes():
    mod = _chapter_table()
    assert mod.reading_minutes({"markdown_words": 2000, "code_lines": 100}) == 15
    assert mod.reading_minutes({"markdown_words": 10, "code_lines": 0}) == 5


def test_jupyterhub_page_quotes_the_room_simulation():
    spec = importlib.util.spec_from_file_location("room_simulation",
                                                  ROOT / "benchmarks" / "room_simulation.py")
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the script imports its sibling _measure
    try:
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    data = json.loads((ROOT / "benchmarks" / "results" / "room_simulation.json").read_text())
    page = (ROOT / "docs" / "jupyterhub.md").read_text()
    quoted = page.split("<!-- room-simulation:begin -->\n", 1)[1]
    quoted = quoted.split("\n<!-- room-simulation:end -->", 1)[0]
    assert quoted == mod.markdown(data), (
        "docs/jupyterhub.md is out of date: paste in python benchmarks/room_simulation.py --markdown")
    assert [r["learners"] for r in data["rounds"]] and data["measured"]["started_utc"]


def test_a_merged_measurement_keeps_the_other_notebooks_and_says_when_each_was_measured():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        path = ROOT / "benchmarks" / "chapter_times.py"
        spec = importlib.util.spec_from_file_location("chapter_times", path)
        times = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(times)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    data = json.loads((ROOT / "benchmarks" / "results" / "chapter_times.json").read_text())
    first = {"measured": data["measured"], "machine": data["machine"],
             "notebooks": {k: v for k, v in data["notebooks"].items() if "01_" not in k}}
    again = {"measured": {"started_utc": "T1", "ended_utc": "T2", "note": "rerun",
                          "load_average_before": [0.5], "load_average_after": [0.7]},
             "machine": data["machine"], "notebooks": {"notebooks/01_single_device.ipynb":
                                                       data["notebooks"]["notebooks/01_single_device.ipynb"]}}
    merged = times._merged(first, again)
    assert set(merged["notebooks"]) == set(first["notebooks"]) | set(again["notebooks"])
    assert merged["measured"] == data["measured"]
    table = _chapter_table().table(merged)
    assert ("Measured again T1 to T2, load average 0.5 before, 0.7 after: "
            "notebooks/01_single_device.ipynb. rerun") in table
    # measured once more: the earlier session no longer lists it
    again2 = dict(again, measured=dict(again["measured"], started_utc="T3", ended_utc="T4"))
    twice = times._merged(merged, again2)
    assert [x["started_utc"] for x in twice["later"]] == ["T3"]
