"""Run pip for the Makefile's install rules: show what a learner waits for, hide the rest, keep errors.

    python tools/quiet_pip.py PIP install ARGS...

What is shown:

- each download with its size (``downloading torch-2.13.0+cpu-...whl (183.2 MB)``) and, for one over
  ``PROGRESS_OVER`` bytes, its progress: one line that grows on a terminal, a line every 25 % in a log
  (pip's ``--progress-bar raw`` reports it; a pip too old for it shows the size only);
- the long steps, so that no silence looks like a hang: building the course's package, installing N
  packages (unpacking torch takes a while), and how many were installed;
- every ``ERROR``/``error:`` line and everything after it, and, when pip fails, the last lines it
  printed before that, so a real error is never hidden.

What is hidden: packages already there, the "Location 'file:///...' is ignored" warnings of
configured indexes that lack a package, setuptools' ``!!``/``****`` notices from the build of the
editable install, the root-user warning, and pip's bookkeeping lines.  The exit code is pip's.
Plain Python 3.9+, standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import deque
from collections.abc import Callable

PROGRESS_OVER = 10 * 2**20  # bytes: smaller downloads take a moment, their size is enough
KEEP_ON_FAILURE = 30        # hidden lines shown when pip fails, the last ones before its end

_DOWNLOAD = re.compile(r"^\s*(Downloading|Resuming download)\s+(\S+)(?:\s+\(([^)]*)\))?")
_PROGRESS = re.compile(r"^Progress (\d+) of (\d+)$")
_HIDDEN = re.compile(
    r"^\s*(Requirement already satisfied|Looking in (indexes|links)|Collecting |Using cached |"
    r"Obtaining |Installing build dependencies|Checking if build backend|Getting requirements|"
    r"Preparing (editable )?metadata|Created wheel|Stored in directory|Attempting uninstall|"
    r"Found existing installation|Uninstalling |Successfully uninstalled|Building wheels? for|"
    r"Processing |Downloading .* \(from |  Link requires|Building editable for|Successfully built )"
    r"|^WARNING: Location '.*' is ignored"
    r"|^WARNING: Running pip as the 'root' user"
    r"|^\[notice\]"
    r"|(pip-build-env|setuptools).*Warning:"
    r"|^\s*warnings\.warn\(|^\s*$")
_ERROR = re.compile(r"^\s*(ERROR|error)\b|Traceback \(most recent call last\)")


class Filter:
    """Turns pip's lines into what the learner sees; ``out`` receives text to write, as is."""

    def __init__(self, out: Callable[[str], None], terminal: bool):
        self.out, self.terminal = out, terminal
        self.hidden: deque[str] = deque(maxlen=KEEP_ON_FAILURE)
        self.in_notice = False
        self.after_warning = False  # the source line that Python prints under a warning comes next
        self.failed = False
        self.download: str | None = None  # the file whose progress is being shown
        self.shown_pct = -1
        self.open_line = False  # a progress line without its newline yet

    def _say(self, text: str) -> None:
        self._end_progress()
        self.out(text + "\n")

    def _end_progress(self) -> None:
        if self.open_line:
            self.out("\n")
            self.open_line = False

    def _hide(self, line: str) -> None:
        self.hidden.append(line)

    def feed(self, line: str) -> None:
        line = line.rstrip("\r\n")
        if self.failed:
            self._say(line)
            return
        if _ERROR.search(line):
            self.failed = True
            self._say(line)
            return
        if line.strip() == "!!":  # setuptools' notices start and end with a line "!!"
            self.in_notice = not self.in_notice
            self.after_warning = not self.in_notice
            self._hide(line)
            return
        if self.in_notice:
            self._hide(line)
            return
        if self.after_warning:
            self.after_warning = False
            if line.startswith("  ") and not line.lstrip().startswith(("Downloading", "Building")):
                self._hide(line)
                return
        m = _PROGRESS.match(line.strip())
        if m:
            self._progress(int(m.group(1)), int(m.group(2)))
            return
        m = _DOWNLOAD.match(line)
        if m:
            name = m.group(2).rstrip("/").rsplit("/", 1)[-1].replace("%2B", "+")
            size = f" ({m.group(3)})" if m.group(3) else ""
            self._say(f"  downloading {name}{size}")
            self.download, self.shown_pct = name, -1
            return
        if line.startswith("Installing collected packages:"):
            names = [p.strip() for p in line.split(":", 1)[1].split(",") if p.strip()]
            slow = " (unpacking torch takes a while)" if "torch" in names else ""
            self._say(f"  installing {len(names)} package{'s' if len(names) != 1 else ''}{slow}")
            return
        if line.startswith("Successfully installed"):
            count = len(line.split()) - 2
            self._say(f"  installed {count} package{'s' if count != 1 else ''}")
            return
        if line.lstrip().startswith("Building editable for") and line.rstrip().endswith("started"):
            self._say("  building the course's package (an editable install of this folder)")
            return
        if _HIDDEN.search(line) or set(line.strip()) <= set("*"):
            self.after_warning = "Warning:" in line
            self._hide(line)
            return
        self._say(line)

    def _progress(self, done: int, total: int) -> None:
        if total < PROGRESS_OVER or self.download is None:
            return
        pct = min(100, done * 100 // total)
        step = 1 if self.terminal else 25
        if pct // step == self.shown_pct // step:
            return
        self.shown_pct = pct
        text = f"    {pct:3d} % of {total / 2**20:.0f} MiB"
        if self.terminal:
            self.out("\r" + text)
            self.open_line = True
            if pct == 100:
                self._end_progress()
        else:
            self.out(text + "\n")

    def close(self, code: int) -> None:
        """At pip's end: its last hidden lines when it failed without an error line of its own."""
        self._end_progress()
        if code and not self.failed and self.hidden:
            self.out(f"pip failed (exit code {code}); its last lines:\n")
            for line in self.hidden:
                self.out(f"  {line}\n")


def _supports_raw_progress(pip: list[str]) -> bool:
    """pip 24.1 and later report download progress as ``Progress N of M`` lines."""
    try:
        text = subprocess.run([*pip, "--version"], capture_output=True, text=True, timeout=60).stdout
        major, minor = (int(x) for x in text.split()[1].split(".")[:2])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return False
    return (major, minor) >= (24, 1)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    split = argv.index("install") if "install" in argv else len(argv)
    pip, rest = argv[:split], argv[split:]
    bar = ["--progress-bar", "raw"] if _supports_raw_progress(pip) else ["--progress-bar", "off"]
    cmd = [*pip, *rest[:1], *bar, *rest[1:]]
    filt = Filter(lambda s: (sys.stdout.write(s), sys.stdout.flush()), sys.stdout.isatty())
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", bufsize=1)
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            filt.feed(line)
    except KeyboardInterrupt:
        proc.terminate()
    code = proc.wait()
    filt.close(code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
