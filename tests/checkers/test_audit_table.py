"""docs/checker_audit.md's contents table names every checker with the size of its catalogue.

The table is read by instructors and reviewers to see what each checker recognises; a misconception
added to a catalogue (or a checker added) without the table following would make it wrong.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import course_utils.checks as checks

AUDIT = Path(__file__).resolve().parents[2] / "docs" / "checker_audit.md"
ROW = re.compile(r"^\| (\d\d\.\w) \| `(\w+)` \(`([\w/]+)\.py`\) \| (\d+) \| `(\w+\.py)` \|$", re.M)


def test_the_table_lists_every_checker_with_its_catalogue_size():
    rows = ROW.findall(AUDIT.read_text())
    assert len(rows) >= 29
    listed = set()
    for ex, name, module, size, tests in rows:
        mod = importlib.import_module("course_utils.checks." + module.replace("/", "."))
        assert getattr(checks, name) is getattr(mod, name), f"{ex}: {name} is not in {module}.py"
        assert len(mod.CATALOGUE) == int(size), \
            f"{ex}: the table says {size} misconceptions, {module}.py's CATALOGUE has {len(mod.CATALOGUE)}"
        assert (AUDIT.parents[1] / "tests" / "checkers" / tests).exists(), tests
        listed.add(name)
    missing = {n for n in checks.__all__ if n.startswith("check_")} - listed
    assert not missing, f"checkers missing from the audit table: {sorted(missing)}"
