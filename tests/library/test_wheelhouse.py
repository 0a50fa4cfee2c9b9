"""Offline install: the course installs from a folder of wheels with the package index turned off.

A full wheelhouse (``make wheelhouse``) is hundreds of MiB; this test builds a small one the same
way pip would use it: the course's own wheel (built here, offline) and the wheel of one of its real
dependencies, ``nvidia-ml-py``, repacked from the installed copy.  A throwaway virtual environment
sees the other dependencies (torch, jupyterlab...) through a ``.pth`` file pointing at a copy of
this environment's package folder *without* nvidia-ml-py, so that pip must take that one from the
wheelhouse.  pip runs with the variables ``make lab WHEELS=...`` sets: ``PIP_NO_INDEX=1`` and
``PIP_FIND_LINKS=<folder>``.  The Makefile's wiring is checked with ``make -n``.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(sysconfig.get_paths()["purelib"])
HIDDEN = "nvidia_ml_py"  # the dependency that must come from the wheelhouse


def _repack(dist_info: Path, dest: Path) -> Path:
    """A wheel of an installed pure-Python distribution, from the files its RECORD lists."""
    keep = []
    for line in (dist_info / "RECORD").read_text().splitlines():
        rel = line.rsplit(",", 2)[0]
        if rel.endswith(".pyc") or rel.split("/")[-1] in ("INSTALLER", "REQUESTED", "RECORD",
                                                           "direct_url.json"):
            continue
        keep.append(rel)
    name = dist_info.name[: -len(".dist-info")]
    wheel = dest / f"{name}-py3-none-any.whl"
    record = []
    with zipfile.ZipFile(wheel, "w") as z:
        for rel in keep:
            data = (SITE / rel).read_bytes()
            z.writestr(rel, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{rel},sha256={digest},{len(data)}")
        record.append(f"{dist_info.name}/RECORD,,")
        z.writestr(f"{dist_info.name}/RECORD", "\n".join(record) + "\n")
    return wheel


def _offline_env(wheels: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheels), PIP_CONFIG_FILE=os.devnull,
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def test_install_from_a_wheelhouse_without_an_index(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    src = tmp_path / "src"  # build from a copy: setuptools writes build/ beside the sources
    src.mkdir()
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src)
    shutil.copytree(ROOT / "course_utils", src / "course_utils",
                    ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(pip + ["wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir",
                          str(wheels), str(src)], check=True, env=_offline_env(wheels), timeout=120)
    # A view of this environment's packages without the dependency the wheelhouse must supply.
    view = tmp_path / "site-view"
    view.mkdir()
    for entry in SITE.iterdir():
        if not entry.name.startswith((HIDDEN, "pynvml", "course_utils", "course-utils", "__editable__",
                                      "_course_utils")) and not entry.name.endswith(".pth"):
            (view / entry.name).symlink_to(entry)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)],
                   check=True, timeout=60)
    py = venv / "bin" / "python"
    target = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 capture_output=True, text=True, check=True).stdout.strip())
    (target / "zz_course_view.pth").write_text(f"{view}\n")
    install = pip + ["--python", str(py), "install", "--quiet", "course-utils"]

    # Without the dependency's wheel, pip cannot fetch it: the index is really off.
    p = subprocess.run(install, capture_output=True, text=True, env=_offline_env(wheels), timeout=120)
    assert p.returncode != 0 and "nvidia-ml-py" in p.stderr, p.stderr

    [dist_info] = SITE.glob(f"{HIDDEN}-*.dist-info")
    _repack(dist_info, wheels)
    p = subprocess.run(install, capture_output=True, text=True, env=_offline_env(wheels), timeout=120)
    assert p.returncode == 0, p.stderr
    out = subprocess.run([str(py), "-c", "import course_utils.progress, pynvml; "
                          "print(course_utils.progress.__file__); print(pynvml.__file__)"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    cu, nv = out.stdout.split()
    assert cu.startswith(str(target)) and nv.startswith(str(target))


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_makefile_wiring():
    def dry(*args: str) -> str:
        return subprocess.run(["make", "-n", "-B", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True, timeout=60).stdout

    for target in ("lab", "test"):
        lines = [ln for ln in dry(target, "WHEELS=/media/usb/wheels", "VENV=/nonexistent/venv").splitlines()
                 if "pip install" in ln]
        assert len(lines) == 3
        offline = ('PIP_NO_INDEX=1 PIP_FIND_LINKS="/media/usb/wheels" '
                   "/nonexistent/venv/bin/python tools/quiet_pip.py ")
        assert all(offline in ln for ln in lines), lines
    online = dry("lab", "VENV=/nonexistent/venv")
    assert "pip install" in online and "PIP_NO_INDEX" not in online
    wh = dry("wheelhouse", "WHEELHOUSE=/media/usb/wheels")
    assert 'pip download --quiet --dest "/media/usb/wheels" pip setuptools "torch==2.13.0" ".[test]"' in wh
