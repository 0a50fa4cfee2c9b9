"""exercises/ is generated from solutions/; every stub fails its checker naming the exercise, and every
solution passes all the checkers it calls.

Both run in one kernel, as a learner going from one notebook to the next: the stubs first, then the
solutions (``make test`` does not give the solutions to nbval; the three that
``tests/system/test_three_learners.py`` runs at the same time, each in a kernel of its own, are left
to it).
"""

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
_spec = importlib.util.spec_from_file_location("three_learners",
                                              ROOT / "tests" / "system" / "test_three_learners.py")
_three_learners = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_three_learners)
RUN_TOGETHER = set(_three_learners.NOTEBOOKS)  # their own test runs them, in kernels of their own
SOLUTIONS = [p for p in sorted((ROOT / "solutions").glob("*.ipynb"))
             if p.relative_to(ROOT).as_posix() not in RUN_TOGETHER]


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
    """One kernel for every stub and solution notebook, as a learner going from one to the next.

    Its fork server is started, by a first launch, before the first notebook, so that each test's
    check for leftover processes sees it as already there.  (Waiting for the kernel's background
    start was not enough: under load that start can fail quietly, as it may, and the first stub's
    launch then started the fork server inside the first test.)  Each notebook starts with
    :func:`_fresh_start` in its own folder: nothing a previous notebook defined, or imported from
    exercises/ or solutions/, is left.  One kernel instead of twenty-nine spares the suite a kernel
    start, an import of torch and a fork server per notebook (about 5 CPU-seconds each, measured
    with a one-cell notebook that launches once).  What it does not prove, that each solution also
    runs in a fresh kernel, ``make notebooks`` shows when it re-executes them, and
    ``tests/system/test_three_learners.py`` for three of them on every run.
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


def _fresh_start(folder: Path) -> str:
    """The cell that starts a notebook in the shared kernel as a new kernel in ``folder`` would:
    the namespace emptied, ``folder`` the working directory (where workers start too), and the
    modules imported from exercises/ or solutions/ (``mini_ddp``, files a notebook wrote) forgotten,
    so that ``import mini_ddp`` reads the copy beside this notebook, not the previous one's."""
    folders = (str(ROOT / "exercises"), str(ROOT / "solutions"))
    return ("%reset -f\n"
            "import importlib as _il, os as _os, sys as _sys\n"
            f"_os.chdir({str(folder)!r})\n"
            "for _n in [n for n, m in list(_sys.modules.items())\n"
            f"           if (getattr(m, '__file__', None) or '').startswith({folders!r})]:\n"
            "    del _sys.modules[_n]\n"
            "_il.invalidate_caches()\n"
            "del _il, _os, _sys")


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

    nb = _run_in(learner_kernel, [_fresh_start(path.parent)], nbformat.read(path, as_version=4))
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


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_every_solution_runs_and_passes_each_checker_it_calls(path, learner_kernel):
    """Run the solution notebook as a learner who has filled in every exercise: every cell runs
    without an error, and every checker a cell calls prints its ``[PASS]`` line."""
    import nbformat

    nb = _run_in(learner_kernel, [_fresh_start(path.parent)], nbformat.read(path, as_version=4))
    assert not [o for o in nb.cells[0].outputs if o.output_type == "error"], nb.cells[0].outputs
    errors = [(i, f"{o.ename}: {o.evalue}") for i, c in enumerate(nb.cells[1:]) if c.cell_type == "code"
              for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name}: cells that failed (index, error): {errors}"
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    expected = _three_learners._expected_passes(path)
    assert expected, f"{path.name} calls no checker"
    passed = set(re.findall(r"^\[PASS\] (.+?)\s*$", text, re.M))
    assert expected <= passed, f"{path.name}: no [PASS] line for {sorted(expected - passed)}"


def test_the_make_target_runs_the_generator_as_a_script():
    """``make exercises`` and ``make test`` run the file itself, from any folder."""
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "exercises.py"), "--check"],
                          cwd=ROOT / "notebooks", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "checked exercises: 0 file(s) differ" in proc.stdout
