"""`make update`: take the course's latest version without losing your work, and without conflicts.

Running a lesson writes its outputs into the notebook (and its helper files next to it), and doing an
exercise writes your answers into ``exercises/``: all tracked files, so a plain ``git pull`` of a
course update can refuse to run or stop with conflicts. This tool:

1. copies every tracked file you changed into ``my-work/<date-time>/`` (same paths; ignored by git);
2. puts those files back as committed, and runs ``git pull --ff-only``;
3. copies your exercise notebooks back over the new version where the update did not change the
   exercise itself, so that you keep your answers; where the update changed only its text (the
   Markdown cells, the code cells as they were), your code cells and their outputs are put into the
   new version; otherwise the new exercise stays and the tool says where your old answers are.

Close the course's notebooks first: a notebook still open in JupyterLab offers, when its file changes
on disk, to overwrite the file with the open copy, which would put the old version back. The tool asks
the Jupyter servers it finds on this machine (their files in Jupyter's runtime folder) which notebooks
have a session open, and stops when one of the course's files is among them (``--force`` goes on).

Lessons and solutions come back as the update has them (their outputs are the course's measured
ones); your runs of them are in the copy. Nothing is deleted. ``--dry-run`` says what it would do.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BACKUP = "my-work"


def git(*args: str, check: bool = True) -> str:
    r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    if check and r.returncode:
        sys.exit(f"git {' '.join(args)} failed:\n{(r.stderr or r.stdout).strip()}")
    return r.stdout


def changed_files() -> list[str]:
    """Tracked files that differ from the last commit (modified or deleted), as repository paths."""
    out = git("status", "--porcelain=v1", "--untracked-files=no", "-z")
    paths = []
    for entry in out.split("\0"):
        if len(entry) > 3 and entry[:2].strip():
            paths.append(entry[3:])
    return sorted(paths)


def _runtime_dirs() -> list[Path]:
    """Where Jupyter servers leave their jpserver-*.json files (jupyter_core's rule, without it)."""
    if os.environ.get("JUPYTER_RUNTIME_DIR"):
        return [Path(os.environ["JUPYTER_RUNTIME_DIR"])]
    data = os.environ.get("JUPYTER_DATA_DIR") or os.path.join(
        os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share"), "jupyter")
    return [Path(data) / "runtime"]


def open_notebooks() -> list[str]:
    """Course files that a Jupyter server on this machine has a session open for (repository paths).

    Servers that do not answer within two seconds, or whose files are stale, are passed over."""
    found = set()
    for folder in _runtime_dirs():
        for info_file in sorted(folder.glob("jpserver-*.json")):
            try:
                info = json.loads(info_file.read_text())
                url = f"{info['url'].rstrip('/')}/api/sessions?token={info.get('token', '')}"
                with urllib.request.urlopen(url, timeout=2) as r:
                    sessions = json.load(r)
                root = Path(info.get("root_dir") or info.get("notebook_dir") or ".").resolve()
            except (OSError, ValueError, KeyError):
                continue
            for session in sessions:
                path = (root / session.get("path", "")).resolve()
                if path.is_relative_to(ROOT):
                    found.add(str(path.relative_to(ROOT)))
    return sorted(found)


def _only_text_changed(old: dict, new: dict, mine: dict) -> bool:
    """Same cells of the same kinds in all three, and the update changed no code cell."""
    kinds = [[c["cell_type"] for c in nb["cells"]] for nb in (old, new, mine)]
    code = [["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"] for nb in (old, new)]
    return kinds[0] == kinds[1] == kinds[2] and code[0] == code[1]


def _merge_text(new: dict, mine: dict) -> dict:
    """The new notebook with the learner's code cells (answers, outputs) in place of its own."""
    merged = json.loads(json.dumps(new))
    merged["cells"] = [m if m["cell_type"] == "code" else n for n, m in zip(new["cells"], mine["cells"])]
    return merged


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make update", description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="say what would happen, change nothing")
    p.add_argument("--force", action="store_true", help="go on even with course notebooks open")
    args = p.parse_args(argv)
    if not (ROOT / ".git").exists():
        sys.exit("not a git clone: download the new version of the course instead")
    opened = open_notebooks()
    if opened and not args.force:
        sys.exit("close these notebooks in JupyterLab first (File > Close and Shut Down Notebook), then run "
                 "make update again: an open notebook would offer to write its old copy over the update.\n"
                 + "".join(f"  {o}\n" for o in opened) + "(make update FORCE=1 goes on anyway)")
    if not opened:
        print("(no open course notebook found; if JupyterLab shows one, close it before you go on "
              "working: its tab still holds the old version)")
    changed = changed_files()
    before = git("rev-parse", "HEAD").strip()
    if args.dry_run:
        print(f"{len(changed)} changed tracked file(s) would be copied to {BACKUP}/ and restored:")
        print("".join(f"  {c}\n" for c in changed), end="")
        print("then: git pull --ff-only; your exercise notebooks copied back where the update "
              "did not change them")
        return 0
    backup = ROOT / BACKUP / time.strftime("%Y-%m-%d-%H%M%S")
    for rel in changed:
        src = ROOT / rel
        if src.is_file():
            (backup / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, backup / rel)
    if changed:
        print(f"your changes to {len(changed)} file(s) are copied to {backup.relative_to(ROOT)}/")
        git("checkout", "--", *changed)
    pulled = subprocess.run(["git", "pull", "--ff-only"], cwd=ROOT, text=True)
    if pulled.returncode:  # nothing new came: every file goes back as you had it
        for rel in changed:
            if (backup / rel).is_file():
                shutil.copy2(backup / rel, ROOT / rel)
        print("git pull did not complete (see above): your files are as they were (a copy is in "
              f"{backup.relative_to(ROOT)}/)", file=sys.stderr)
        return pulled.returncode
    after = git("rev-parse", "HEAD").strip()
    updated = set(git("diff", "--name-only", before, after).split()) if after != before else set()
    kept, replaced, merged = [], [], []
    for rel in changed:
        if not rel.startswith("exercises/") or not (backup / rel).is_file():
            continue
        if rel in updated and rel.endswith(".ipynb"):
            try:
                old, new, mine = (json.loads(text) for text in (
                    git("show", f"{before}:{rel}"), (ROOT / rel).read_text(), (backup / rel).read_text()))
                if _only_text_changed(old, new, mine):
                    (ROOT / rel).write_text(json.dumps(_merge_text(new, mine), indent=1, ensure_ascii=False)
                                            + "\n")
                    merged.append(rel)
                    continue
            except (ValueError, KeyError):  # not a notebook as the course writes them: keep both copies
                pass
        if rel in updated:
            replaced.append(rel)
        else:
            shutil.copy2(backup / rel, ROOT / rel)
            kept.append(rel)
    if kept:
        print("your answers are back in: " + ", ".join(kept))
    for rel in merged:
        print(f"{rel}: the update changed only its text; your code cells and outputs are kept in it")
    for rel in replaced:
        print(f"{rel} changed in the update: the new version is in place, your answers are in "
              f"{(backup / rel).relative_to(ROOT)}")
    print("up to date" if after == before else f"updated {before[:8]} -> {after[:8]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
