"""Generate ``exercises/`` from ``solutions/``: ``python tools/exercises.py`` (``make exercises``).

``solutions/`` is the single source.  In every notebook code cell and every ``.py`` module there,
each block ::

    ### BEGIN SOLUTION 04.b mini DDP
    ...the answer...
    ### END SOLUTION

becomes, at the same indentation, ::

    raise NotImplementedError("Exercise 04.b mini DDP: replace this line with your code")

The text after ``BEGIN SOLUTION`` names the exercise; without it the name is the file's stem.
Exercise notebooks are written without outputs or execution counts, so that a learner starts from
a clean page.  ``--check`` exits non-zero when ``exercises/`` is not what the generator makes.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

__all__ = ["strip_solutions", "exercise_notebook", "generate", "main"]

BEGIN = re.compile(r"^(?P<indent>[ \t]*)#+\s*BEGIN SOLUTION\b[ \t:]*(?P<name>.*?)\s*$")
END = re.compile(r"^[ \t]*#+\s*END SOLUTION\b")


def strip_solutions(source: str, default_name: str) -> str:
    """Replace every solution block in ``source`` with a ``NotImplementedError`` stub."""
    out: list[str] = []
    inside = False
    for lineno, line in enumerate(source.splitlines(keepends=True), 1):
        m = BEGIN.match(line)
        if m and not inside:
            inside = True
            name = m.group("name") or default_name
            out.append(f'{m.group("indent")}raise NotImplementedError("Exercise {name}: '
                       'replace this line with your code")\n')
            continue
        if END.match(line):
            if not inside:
                raise ValueError(f"{default_name}: END SOLUTION without BEGIN on line {lineno}")
            inside = False
            continue
        if not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{default_name}: BEGIN SOLUTION is never closed")
    return "".join(out)


def exercise_notebook(nb: dict, default_name: str) -> dict:
    """A copy of notebook ``nb`` with solutions stubbed and all outputs removed."""
    nb = json.loads(json.dumps(nb))
    for cell in nb.get("cells", []):
        src = cell.get("source", "")
        text = "".join(src) if isinstance(src, list) else src
        if cell.get("cell_type") == "code":
            text = strip_solutions(text, default_name)
            cell["outputs"] = []
            cell["execution_count"] = None
        cell["source"] = text.splitlines(keepends=True)
        cell.get("metadata", {}).pop("execution", None)
    return nb


def _render(path: Path) -> str:
    if path.suffix == ".ipynb":
        nb = json.loads(path.read_text(encoding="utf-8"))
        return json.dumps(exercise_notebook(nb, path.stem), indent=1, ensure_ascii=False) + "\n"
    return strip_solutions(path.read_text(encoding="utf-8"), path.stem)


def generate(solutions: Path, exercises: Path, *, check: bool = False) -> list[str]:
    """Write (or with ``check``, compare) every exercise file; return the paths that differ."""
    differ = []
    sources = sorted(p for p in solutions.iterdir() if p.suffix in (".ipynb", ".py"))
    for src in sources:
        dst = exercises / src.name
        text = _render(src)
        if not dst.exists() or dst.read_text(encoding="utf-8") != text:
            differ.append(str(dst))
            if not check:
                exercises.mkdir(parents=True, exist_ok=True)
                dst.write_text(text, encoding="utf-8")
    expected = {p.name for p in sources}
    for extra in sorted(exercises.glob("*")):
        if extra.suffix in (".ipynb", ".py") and extra.name not in expected:
            differ.append(f"{extra} (no matching solution)")
    return differ


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    root = Path(__file__).resolve().parent.parent
    ap.add_argument("--solutions", type=Path, default=root / "solutions")
    ap.add_argument("--exercises", type=Path, default=root / "exercises")
    ap.add_argument("--check", action="store_true", help="only report differences")
    a = ap.parse_args(argv)
    differ = generate(a.solutions, a.exercises, check=a.check)
    if a.check and differ:
        print("exercises/ is out of date; run `make exercises`:\n  " + "\n  ".join(differ))
        return 1
    print(f"{'checked' if a.check else 'wrote'} exercises: {len(differ)} file(s) "
          f"{'differ' if a.check else 'updated'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
