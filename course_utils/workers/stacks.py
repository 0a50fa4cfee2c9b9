"""Stacks and tracebacks cut down to the frames a reader can act on: the one home for that.

Two formats come in: ``faulthandler``'s dump of a stuck rank (``File "x.py", line 3 in fn``,
innermost frame first, no source) and Python's traceback (``File "x.py", line 3, in fn`` followed
by the quoted source line).  ``parse_frame`` reads a frame line of either.

- ``tidy_stack``: a stuck worker's dump, for ``WorkerTimeout``: the thread that runs the user's
  function, without the launcher's frames, each frame with its line of code;
- ``drop_frames``: a traceback or stack without the frames of some files (the checkers' view of
  the learner's code is ``checking.learner_frames``);
- ``stuck_where``: one line for a stuck rank: the torch call it waits in, and the user line above it.
"""

from __future__ import annotations

import dataclasses
import linecache
import re
from collections.abc import Sequence

__all__ = ["Frame", "parse_frame", "tidy_stack", "drop_frames", "stuck_where"]

_FRAME = re.compile(r'\s*File "(?P<file>[^"]+)", line (?P<line>\d+),? in (?P<fn>\S+)')


@dataclasses.dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str


def parse_frame(line: str) -> Frame | None:
    """The frame a ``File "...", line N in fn`` line names (faulthandler or traceback), or None."""
    m = _FRAME.match(line)
    return Frame(m["file"], int(m["line"]), m["fn"]) if m else None


# Lines of the launcher's own plumbing in a worker's dump (and the dump's thread headers).
_PLUMBING = ("multiprocessing/", "course_utils/workers/", '"<string>"', "thread 0x")


def tidy_stack(text: str) -> str:
    """Keep the thread that runs the user's code, drop launcher plumbing, quote each source line.

    faulthandler prints frames most recent first, without source; the notebook's linecache
    knows the source of its cells and files, so each frame gets its line of code.
    """
    blocks = [b for b in text.strip().split("\n\n") if b.strip()]
    main = [b for b in blocks if "worker_main" in b] or blocks
    keep = ["(most recent call first)"] if main else []
    for line in main[0].splitlines() if main else []:
        if any(s in line for s in _PLUMBING):
            continue
        keep.append(line.strip())
        frame = parse_frame(line)
        code = linecache.getline(frame.file, frame.line).strip() if frame else ""
        if code:
            keep.append(f"    {code}")
    if main and len(keep) == 1:  # no frame of the user's code is left
        keep = [line.strip() for line in main[0].splitlines() if 'File "' in line]
        keep.append("(no frame of your function: it had returned, and the worker hung while its "
                    "objects were freed. A DDP model still alive after destroy_process_group() "
                    "does this: `del model` before destroying the group.)")
    return "\n".join(keep)


def drop_frames(text: str, hidden: Sequence[str]) -> str:
    """A traceback or stack without the frames whose file path contains one of ``hidden``.

    A dropped frame's quoted source line goes with it; every other line (the error, the headers)
    stays.  When no frame is left, the traceback from its last frame on is returned, so that it
    still says where.
    """
    lines = text.rstrip().splitlines()
    out: list[str] = []
    skip_code = False
    frames = 0
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("File "):
            frames += 1
            skip_code = any(s in stripped for s in hidden)
            if not skip_code:
                out.append(line)
            continue
        if line.startswith(("    ", "\t")) and not stripped.startswith(("Traceback", "(most")):
            if not skip_code:
                out.append(line)
            continue
        skip_code = False
        out.append(line)
    if frames and not any(s.strip().startswith("File ") for s in out):
        last = [i for i, s in enumerate(lines) if s.strip().startswith("File ")][-1]
        out = lines[last:]
    return "\n".join(out)


_TORCH_FRAME = re.compile(r"(site-packages|dist-packages)[/\\]torch[/\\]")


def stuck_where(stack: str) -> str:
    """One line from a stuck rank's stack: the torch call it waits in and the user line above it.

    ``stack`` is ``WorkerTimeout.failures[rank].stack`` (innermost frame first, as faulthandler
    writes it).
    """
    lines = [ln.strip() for ln in stack.splitlines() if ln.strip().startswith("File ")]
    if not lines:
        return "(no Python stack)"
    inner = None
    for frame in filter(None, map(parse_frame, lines)):
        if _TORCH_FRAME.search(frame.file):
            if inner is None and frame.function != "wrapper":
                inner = frame.function
            continue
        user = f"{frame.function}() line {frame.line}"
        return f"in torch {inner}(), called from {user}" if inner else f"in {user}"
    return f"in torch {inner}()" if inner else lines[0]
