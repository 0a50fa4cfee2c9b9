"""The environment self-check passes here and says what to do when something is wrong."""

from __future__ import annotations

import importlib.metadata
import os
import resource
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

import course_utils
from course_utils import doctor

ROOT = Path(__file__).resolve().parents[2]


def test_doctor_passes_on_this_machine_and_ends_with_the_room_line():
    quiet = os.getloadavg()[0] < (os.cpu_count() or 1)
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "course_utils.doctor"], capture_output=True, text=True,
                       timeout=120)
    wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "[OK] worker launch: 2 workers ran an all_reduce" in p.stdout
    assert "[FAIL]" not in p.stdout
    assert "FutureWarning" not in p.stderr  # no deprecated pynvml shim next to torch
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith("ROOM: READY for every chapter on CPU; GPU parts: "), last
    # Under 10 s: the work it does (CPU seconds of it and its workers) always; the wall time only
    # when the machine was not busy with other programs (a loaded machine slows everything).
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    assert cpu < 10, f"the doctor used {cpu:.1f} CPU seconds"
    if quiet:
        assert wall < 10, f"the doctor took {wall:.1f} s on a quiet machine"


def test_room_line_names_the_failures_and_the_gpus(monkeypatch):
    ok = [doctor.Result("OK", "torch", "2.13"), doctor.Result("INFO", "GPUs", "none")]
    monkeypatch.setattr(doctor, "_gpu_count", lambda: 0)
    assert doctor.room_line(ok, 6.2) == ("ROOM: READY for every chapter on CPU; GPU parts: no GPU, "
                                         "their CPU versions run (checked in 6 s)")
    monkeypatch.setattr(doctor, "_gpu_count", lambda: 1)
    assert "GPU parts: 1 GPU; the two-rank demos need one GPU per rank" in doctor.room_line(ok)
    bad = ok + [doctor.Result("FAIL", "worker launch", "refused"), doctor.Result("FAIL", "NVML", "x")]
    assert doctor.room_line(bad) == "ROOM: NOT READY: fix the [FAIL] line(s) above (worker launch, NVML)"


def test_broken_launch_is_a_fail_line_with_advice(monkeypatch, capsys):
    def broken(*a, **k):
        raise OSError("address already in use")

    monkeypatch.setattr(course_utils, "launch", broken)
    monkeypatch.setattr(doctor, "CHECKS", [doctor._launch])
    assert doctor.main() == 1
    out = capsys.readouterr().out
    assert "[FAIL] worker launch: OSError: address already in use" in out
    assert "restart the kernel" in out
    assert out.strip().splitlines()[-1].startswith("ROOM: NOT READY: fix the [FAIL] line(s) above "
                                                   "(worker launch) (checked in ")


def test_deprecated_pynvml_package_is_reported(monkeypatch):
    real = importlib.metadata.version

    def fake_version(name):
        return "12.0.0" if name == "pynvml" else real(name)

    monkeypatch.setattr(importlib.metadata, "version", fake_version)
    r = doctor._shim()
    assert r.status == "FAIL" and "pip uninstall -y pynvml" in r.detail


def test_a_crashing_check_is_reported_not_raised(monkeypatch):
    def crash():
        raise RuntimeError("boom")

    monkeypatch.setattr(doctor, "CHECKS", [crash])
    [r] = doctor.run_checks(echo=False)
    assert r.status == "FAIL" and "boom" in r.detail


def _bare_python() -> str | None:
    """A Python without torch: the machine's own, as a learner has before `make lab`."""
    for exe in ("/usr/bin/python3", shutil.which("python3") or ""):
        if exe and subprocess.run([exe, "-I", "-c", "import torch"], capture_output=True,
                                  timeout=60).returncode != 0:
            return exe
    return None


def test_without_torch_the_doctor_names_what_is_missing_and_the_command_not_a_traceback(tmp_path):
    exe = _bare_python()
    if exe is None:
        pytest.skip("every python3 on this machine has torch")
    shutil.copytree(ROOT / "course_utils", tmp_path / "course_utils",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "Makefile", tmp_path)
    run = [exe, "-E", "-s", "-m", "course_utils.doctor"]  # as a learner types it, in the course folder
    p = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 1 and "Traceback" not in out, out
    assert "[FAIL] packages: missing torch" in p.stdout and "`make lab` in " in p.stdout, out
    assert p.stdout.strip().splitlines()[-1].startswith("ROOM: NOT READY: fix the [FAIL] line(s) above")
    # With a .venv beside it that has torch, the fix is to use that one.
    (tmp_path / ".venv" / "lib" / "python3.11" / "site-packages" / "torch").mkdir(parents=True)
    p = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "Traceback" not in p.stdout + p.stderr
    assert f"`. {tmp_path}/.venv/bin/activate`" in p.stdout, p.stdout
    # The package itself says where to look instead of failing on `import torch`.
    p = subprocess.run([exe, "-E", "-s", "-c", "from course_utils import launch"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert "ImportError: course_utils needs torch" in p.stderr and "course_utils.doctor" in p.stderr


def test_a_cuda_build_without_an_nvidia_driver_is_a_warning_with_the_cpu_build(monkeypatch):
    fake = types.SimpleNamespace(__version__="2.13.0", version=types.SimpleNamespace(cuda="12.8"))
    monkeypatch.setattr(doctor, "torch", fake)
    monkeypatch.setattr(doctor, "_nvidia_driver", lambda: None)
    r = doctor._torch()
    assert r.status == "WARN" and "no NVIDIA driver" in r.detail and "CPU build" in r.detail, r.detail
    monkeypatch.setattr(doctor, "_gpu_count", lambda: 0)
    assert doctor.room_line([r]).startswith("ROOM: READY")  # a warning, not a failure
    monkeypatch.setattr(doctor, "_nvidia_driver", lambda: "nvidia-smi at /usr/bin/nvidia-smi")
    assert doctor._torch().status == "OK"
