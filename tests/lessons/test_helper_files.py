"""The helper files committed beside the lessons are exactly what the lessons' ``%%writefile`` cells write.

A learner who runs a lesson rewrites them; an edit made to the file alone would be undone then, and
an edit made to the cell alone would leave the committed file stale.  Also: every notebook removes
the temporary folders it makes (``tempfile.mkdtemp``), so that re-runs leave nothing in /tmp.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
LESSONS = sorted(p for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb") if "%%writefile" in p.read_text())


def writefile_cells(lesson: Path) -> dict[str, str]:
    """File name -> what the lesson's ``%%writefile`` (and ``%%writefile -a``) cells write."""
    out: dict[str, str] = {}
    for c in json.loads(lesson.read_text())["cells"]:
        src = "".join(c["source"])
        if c["cell_type"] == "code" and src.startswith("%%writefile "):
            first, _, body = src.partition("\n")
            words = first.split()
            if words[1] == "-a":
                out[words[2]] += body.rstrip("\n") + "\n"
            else:
                out[words[1]] = body.rstrip("\n") + "\n"
    return out


def test_the_lessons_that_write_files_are_found():
    assert {p.name[:2] for p in LESSONS} >= {"04", "06"}


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_helper_files_match_their_cells(lesson):
    cells = writefile_cells(lesson)
    assert cells
    for name, body in cells.items():
        on_disk = (NOTEBOOKS / name).read_text()
        # %%writefile writes the cell body plus a final newline
        assert on_disk.rstrip("\n") == body.rstrip("\n"), (
            f"notebooks/{name} differs from the cell of {lesson.name} that writes it: change both")


# ---- temporary folders ------------------------------------------------------------------------

ROOT = NOTEBOOKS.parent
ALL_NOTEBOOKS = sorted(p for d in ("notebooks", "exercises", "solutions")
                       for p in (ROOT / d).glob("[0-9][0-9]_*.ipynb"))
MKDTEMP = re.compile(r"^\s*(\w+)\s*=\s*(?:Path\()?tempfile\.mkdtemp\(", re.M)


def _code(notebook: Path) -> str:
    return "\n".join("".join(c["source"]) for c in json.loads(notebook.read_text())["cells"]
                     if c["cell_type"] == "code")


@pytest.mark.parametrize("notebook", ALL_NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_temporary_folder_a_notebook_makes_is_removed_by_it(notebook):
    """A folder from ``tempfile.mkdtemp`` outlives the kernel unless a cell removes it: every run of
    the notebook would leave one more in /tmp (``TemporaryDirectory`` in a ``with`` needs nothing)."""
    code = _code(notebook)
    kept = [name for name in MKDTEMP.findall(code) if f"shutil.rmtree({name}" not in code]
    assert not kept, f"{notebook.name} never removes {kept} (add shutil.rmtree in its last cell)"


def test_the_temporary_folder_rule_finds_the_folders():
    assert MKDTEMP.findall('WORK = Path(tempfile.mkdtemp(prefix="x-"))\n  T = tempfile.mkdtemp()') == \
        ["WORK", "T"]
