"""Three learners at once on the course's 2-core machine: no checker fails a right answer.

Three exercise notebooks filled in with their solutions (the notebooks of solutions/), chosen for
their checkers (03: two collectives in real workers; 04: DDP by hand and mini DDP, 3 ranks beside
torch DDP; 05: the sampler, in-process and in workers) and short enough to run together within
about a minute and a half, are executed at the same time, each in its own kernel and its own copy
of the course (so working files and checkpoints never meet).  Every cell must run, and every
checker the notebook calls must print its ``[PASS]`` line.

It reuses the classroom benchmark's helpers (benchmarks/_measure.py: ``copy_course`` and
``run_notebook``, which runs nbconvert in its own process session and kills it on a timeout).
"""

from __future__ import annotations

import importlib.util
import json
import re
import tempfile
import threading
from pathlib import Path

import course_utils.checks

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ["solutions/03_collectives.ipynb", "solutions/04_ddp.ipynb", "solutions/05_data_loading.ipynb"]

_spec = importlib.util.spec_from_file_location("_measure", ROOT / "benchmarks" / "_measure.py")
_measure = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_measure)


def _expected_passes(notebook: Path) -> set[str]:
    """The exercise names of the checkers the notebook's code cells call (``check_x(...)``)."""
    nb = json.loads(notebook.read_text(encoding="utf-8"))
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    names = set(re.findall(r"^\s*(check_\w+)\(", code, re.M))
    return {getattr(course_utils.checks, n).exercise for n in names}


def _outputs(notebook: Path) -> tuple[str, list[str]]:
    """All stream text of an executed notebook, and the names of any errors it shows."""
    nb = json.loads(notebook.read_text(encoding="utf-8"))
    text, errors = [], []
    for cell in nb["cells"]:
        for o in cell.get("outputs", []):
            if o.get("output_type") == "error":
                errors.append(f"{o.get('ename')}: {o.get('evalue')}")
            t = o.get("text", "")
            text.append("".join(t) if isinstance(t, list) else t)
    return "".join(text), errors


def test_three_learners_at_once_all_checks_pass():
    expected = {nb: _expected_passes(ROOT / nb) for nb in NOTEBOOKS}
    assert all(expected.values()), f"a chosen notebook calls no checker: {expected}"
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="three-learners-") as tmp:
        homes = [Path(tmp) / f"learner{i}" for i in range(len(NOTEBOOKS))]
        for home in homes:
            _measure.copy_course(home)

        def learner(home: Path, nb: str) -> None:
            executed = home / "executed.ipynb"
            try:
                results[nb] = _measure.run_notebook(home / nb, timeout=240, interval=1.0,
                                                    save_to=executed)
                results[nb]["executed"] = executed
            except Exception as e:  # noqa: BLE001 - reported by the assertion below
                results[nb] = {"ok": False, "error": f"{type(e).__name__}: {e}"}

        threads = [threading.Thread(target=learner, args=(h, nb)) for h, nb in zip(homes, NOTEBOOKS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

        problems = []
        for nb in NOTEBOOKS:
            r = results.get(nb, {"ok": False, "error": "no result"})
            if not r["ok"]:
                problems.append(f"{nb}: a cell failed after {r.get('wall_s', '?')} s: {r.get('error')}")
                continue
            text, errors = _outputs(r["executed"])
            passed = set(re.findall(r"^\[PASS\] (.+?)\s*$", text, re.M))
            missing = sorted(expected[nb] - passed)
            if errors or missing:
                problems.append(f"{nb}: errors {errors}, no [PASS] line for {missing}")
    assert not problems, "with three learners at once:\n" + "\n".join(problems)
