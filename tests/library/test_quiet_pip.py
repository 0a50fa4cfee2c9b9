"""``make lab``'s pip output (``tools/quiet_pip.py``): downloads with sizes and progress, errors in
full, and none of the noise a learner took for errors (setuptools' ``!!``/``****`` notices, the
"Location 'file:///...' is ignored" warnings of configured indexes, packages already there)."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("quiet_pip", ROOT / "tools" / "quiet_pip.py")
quiet_pip = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(quiet_pip)

# What pip printed for `make lab` (shortened), setuptools' notice included.
PIP_SAYS = """\
Looking in links: /opt/wheels
Requirement already satisfied: pip in ./.venv/lib/python3.11/site-packages (26.3)
WARNING: Location 'file:///opt/pypi-more/simple/torch/' is ignored: it is neither a file nor a directory.
Collecting torch==2.13.0
  Downloading https://download.pytorch.org/whl/cpu/torch-2.13.0%2Bcpu-cp311-cp311-manylinux_2_28_x86_64.whl (183.2 MB)
Progress 0 of 192099123
Progress 40000000 of 192099123
Progress 100000000 of 192099123
Progress 150000000 of 192099123
Progress 192099123 of 192099123
Collecting sympy
  Downloading sympy-1.14.0-py3-none-any.whl (6.3 MB)
Progress 0 of 6300000
Progress 6300000 of 6300000
Obtaining file:///work/course
  Installing build dependencies: started
  Installing build dependencies: finished with status 'done'
/tmp/pip-build-env-x/overlay/lib/python3.11/site-packages/setuptools/config/_apply_pyprojecttoml.py:82: SetuptoolsDeprecationWarning: `project.license` as a TOML table is deprecated
!!

        ********************************************************************************
        Please use a simple string containing a SPDX expression for `project.license`.

        By 2026-Feb-18, you need to update your project and remove deprecated calls
        or your builds will no longer be supported.
        ********************************************************************************

!!
  corresp(dist, value, root_dir)
Building editable for course-utils (pyproject.toml): started
Building editable for course-utils (pyproject.toml): finished with status 'done'
Successfully built course-utils
Installing collected packages: sympy, torch, course-utils
Successfully installed course-utils-0.1 sympy-1.14.0 torch-2.13.0+cpu
WARNING: Running pip as the 'root' user can result in broken permissions and conflicting behaviour
"""  # noqa: E501


def _shown(text: str, terminal: bool = False) -> str:
    out: list[str] = []
    f = quiet_pip.Filter(out.append, terminal)
    for line in text.splitlines():
        f.feed(line)
    f.close(0)
    return "".join(out)


def test_downloads_show_their_size_and_progress_and_the_noise_is_gone():
    shown = _shown(PIP_SAYS)
    assert shown.splitlines() == [
        "  downloading torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl (183.2 MB)",
        "      0 % of 183 MiB", "     52 % of 183 MiB", "     78 % of 183 MiB",  # one line a quarter
        "    100 % of 183 MiB",
        "  downloading sympy-1.14.0-py3-none-any.whl (6.3 MB)",  # small: its size only
        "  building the course's package (an editable install of this folder)",
        "  installing 3 packages (unpacking torch takes a while)",
        "  installed 3 packages",
    ], shown


def test_on_a_terminal_the_progress_is_one_growing_line():
    shown = _shown(PIP_SAYS, terminal=True)
    assert ("\r     20 % of 183 MiB\r     52 % of 183 MiB\r     78 % of 183 MiB\r    100 % of 183 MiB\n"
            in shown), shown


def test_errors_are_shown_in_full_and_a_silent_failure_shows_the_last_lines():
    out: list[str] = []
    f = quiet_pip.Filter(out.append, False)
    for line in ["Collecting nothing-here", "ERROR: Could not find a version that satisfies the requirement",
                 "ERROR: No matching distribution found for nothing-here", "  more detail"]:
        f.feed(line)
    f.close(1)
    assert "".join(out).splitlines() == ["ERROR: Could not find a version that satisfies the requirement",
                                         "ERROR: No matching distribution found for nothing-here",
                                         "  more detail"]
    out.clear()
    f = quiet_pip.Filter(out.append, False)
    f.feed("Collecting something")
    f.close(2)
    assert "pip failed (exit code 2); its last lines:\n  Collecting something\n" == "".join(out)


def _tiny_wheel(folder: Path) -> Path:
    """A wheel of one module, made by hand (no build tool needed)."""
    name = folder / "tiny_course_probe-1.0-py3-none-any.whl"
    files = {"tiny_course_probe.py": b"X = 1\n",
             "tiny_course_probe-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tiny-course-probe\n"
                                                         b"Version: 1.0\n",
             "tiny_course_probe-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: hand\n"
                                                      b"Root-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append("tiny_course_probe-1.0.dist-info/RECORD,,")
    with zipfile.ZipFile(name, "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
        z.writestr("tiny_course_probe-1.0.dist-info/RECORD", "\n".join(record) + "\n")
    return name


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "quiet_pip.py"), sys.executable, "-m", "pip",
                           "install", "--no-index", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, timeout=300)


def test_real_pip_installs_quietly_and_its_failure_is_shown(tmp_path):
    _tiny_wheel(tmp_path)
    # A configured index that lacks the package: pip warns "Location ... is ignored" (hidden).
    p = _run("--find-links", str(tmp_path), "--extra-index-url", f"file://{tmp_path}/no-index",
             "--target", str(tmp_path / "site"), "tiny-course-probe")
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.splitlines() == ["  installing 1 package", "  installed 1 package"], p.stdout
    assert (tmp_path / "site" / "tiny_course_probe.py").exists()
    p = _run("--find-links", str(tmp_path), "--target", str(tmp_path / "site2"), "no-such-course-package")
    assert p.returncode == 1, p.stdout
    assert "ERROR: No matching distribution found for no-such-course-package" in p.stdout
