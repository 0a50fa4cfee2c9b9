"""exercises/ is generated from solutions/, and every stub fails its checker naming the exercise."""

from __future__ import annotations

import importlib.util
import json
import os
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


@pytest.fixture(scope="module")
def learner_kernel(kernel_manager_class):
    """One kernel in exercises/ for every stub notebook, as a learner going from one to the next.

    Its fork server is started, by a first launch, before the first notebook, so that each test's
    check for leftover processes sees it as already there.  (Waiting for the kernel's background
    start was not enough: under load that start can fail quietly, as it may, and the first stub's
    launch then started the fork server inside the first test.)  Each notebook starts with ``%reset -f``:
    nothing a previous notebook defined is left.  One kernel instead of twelve spares the suite a
    kernel start, an import of torch and a fork server per notebook.
    """
    km = kernel_manager_class(kernel_name="python3")
    km.start_kernel(cwd=str(ROOT / "exercises"), env={**os.environ, "COURSE_PREWARM": "1"})
    try:
        (ready,) = _run_in(km, ["import os\nfrom course_utils import launch\n"
                                "assert launch(os.getpid, 1, timeout=120, display=None)"]).cells
        assert not [o for o in ready.outputs if o.output_type == "error"], ready.outputs
        yield km
    finally:
        km.shutdown_kernel(now=True)


def _run_in(km, sources, nb=None):
    """Execute ``sources`` (or the notebook ``nb``, after them) in the running kernel ``km``."""
    import nbformat
    from nbclient import NotebookClient

    nb = nb if nb is not None else nbformat.v4.new_notebook()
    nb.cells[:0] = [nbformat.v4.new_code_cell(s) for s in sources]
    NotebookClient(nb, km=km, timeout=300, allow_errors=True).execute()
    return nb


@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.stem)
def test_every_stub_fails_its_checker_naming_the_exercise(path, learner_kernel):
    """Run the exercise notebook as a learner would before writing anything.

    Every cell that calls a checker must fail with CheckFailed saying the exercise is not done,
    and naming the exercise that its stub names.
    """
    import nbformat

    nb = _run_in(learner_kernel, ["%reset -f"], nbformat.read(path, as_version=4))
    assert not [o for o in nb.cells[0].outputs if o.output_type == "error"], nb.cells[0].outputs
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
