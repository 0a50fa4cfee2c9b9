"""`make update`: take the course's latest version without losing your work, and without conflicts.

Running a lesson writes its outputs into the notebook (and its helper files next to it), and doing an
exercise writes your answers into ``exercises/``: all tracked files, so a plain ``git pull`` of a
course update can refuse to run or stop with conflicts. This tool:

1. copies every tracked file you changed into ``my-work/<date-time>/`` (same paths; ignored by git);
2. puts those files back as committed, and runs ``git pull --ff-only``;
3. copies your exercise notebooks back over the new version where the update did not change the
   exercise itself, so that you keep your answers; where it did, the new exercise stays and the
   tool says where your old answers are.

Lessons and solutions come back as the update has them (their outputs are the course's measured
ones); your runs of them are in the copy. Nothing is deleted. ``--dry-run`` says what it would do.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make update", description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="say what would happen, change nothing")
    args = p.parse_args(argv)
    if not (ROOT / ".git").exists():
        sys.exit("not a git clone: download the new version of the course instead")
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
    kept, replaced = [], []
    for rel in changed:
        if not rel.startswith("exercises/") or not (backup / rel).is_file():
            continue
        if rel in updated:
            replaced.append(rel)
        else:
            shutil.copy2(backup / rel, ROOT / rel)
            kept.append(rel)
    if kept:
        print("your answers are back in: " + ", ".join(kept))
    for rel in replaced:
        print(f"{rel} changed in the update: the new version is in place, your answers are in "
              f"{(backup / rel).relative_to(ROOT)}")
    print("up to date" if after == before else f"updated {before[:8]} -> {after[:8]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
