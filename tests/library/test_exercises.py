"""exercises/ is generated from solutions/, and every stub fails its checker naming the exercise."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The generator is a maintainer's script beside the course, not a module of its package.
_spec = importlib.util.spec_from_file_location("exercises_generator", ROOT / "tools" / "exercises.py")
_generator = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_generator)
exercise_notebook, generate, strip_solutions = (
    _generator.exercise_notebook, _generator.generate, _generator.strip_solutions)
EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))


def test_committed_exercises_match_generator(tmp_path):
    differ = generate(ROOT / "solutions", ROOT / "exercises", check=True)
    assert differ == [], f"run `make exercises`: {differ}"


def test_strip_solutions_keeps_indentation_and_names_exercise():
    src = "def f(x):\n    ### BEGIN SOLUTION 03.a ring\n    return x\n    ### END SOLUTION\n"
    out = strip_solutions(src, "fallback")
    assert out == ('def f(x):\n    raise NotImplementedError("Exercise 03.a ring: '
                   'replace this line with your code")\n')
    assert "fallback" in strip_solutions("### BEGIN SOLUTION\nx = 1\n### END SOLUTION\n", "fallback")


@pytest.mark.parametrize("bad", ["### BEGIN SOLUTION\nx = 1\n", "x = 1\n### END SOLUTION\n"])
def test_unbalanced_markers_are_rejected(bad):
    with pytest.raises(ValueError):
        strip_solutions(bad, "nb")


def test_exercise_notebooks_have_no_outputs_and_no_solutions():
    for path in EXERCISES:
        nb = json.loads(path.read_text())
        for cell in nb["cells"]:
            src = "".join(cell["source"])
            assert "BEGIN SOLUTION" not in src, path
            if cell["cell_type"] == "code":
                assert cell["outputs"] == [] and cell["execution_count"] is None, path


def test_generator_drops_outputs():
    nb = {"cells": [{"cell_type": "code", "source": "1", "outputs": [{"x": 1}],
                     "execution_count": 3, "metadata": {}}], "metadata": {}}
    cell = exercise_notebook(nb, "n")["cells"][0]
    assert cell["outputs"] == [] and cell["execution_count"] is None


@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.stem)
def test_every_stub_fails_its_checker_naming_the_exercise(path):
    """Run the exercise notebook as a learner would before writing anything.

    Every cell that calls a checker must fail with CheckFailed saying the exercise is not done,
    and naming the exercise that its stub names.
    """
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=300, allow_errors=True, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    stub_names = {name for c in nb.cells if c.cell_type == "code"
                  for name in re.findall(r'NotImplementedError\("Exercise ([^:]+):', c.source)}
    check_cells = [c for c in nb.cells if c.cell_type == "code" and re.search(r"\bcheck_\w+\(", c.source)]
    assert check_cells, f"{path.name} has no checker call"
    assert stub_names, f"{path.name} has no exercise stub"
    seen = set()
    for cell in check_cells:
        errors = [o for o in cell.outputs if o.output_type == "error"]
        assert errors, f"{path.name}: a checker passed on the untouched stub:\n{cell.source}"
        err = errors[0]
        assert err.ename == "CheckFailed", f"{path.name}: {err.ename}: {err.evalue}"
        assert "not done yet" in err.evalue, err.evalue
        seen |= {n for n in stub_names if n in err.evalue}
    assert seen == stub_names, f"{path.name}: stubs never reported by a checker: {stub_names - seen}"


def test_the_make_target_runs_the_generator_as_a_script():
    """``make exercises`` and ``make test`` run the file itself, from any folder."""
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "exercises.py"), "--check"],
                          cwd=ROOT / "notebooks", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "checked exercises: 0 file(s) differ" in proc.stdout
