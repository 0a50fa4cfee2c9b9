"""The environment self-check passes here and says what to do when something is wrong."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

from course_utils import doctor


def test_doctor_passes_on_this_machine():
    p = subprocess.run([sys.executable, "-m", "course_utils.doctor"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "[OK] worker launch: 2 workers ran an all_reduce" in p.stdout
    assert "[FAIL]" not in p.stdout
    assert "FutureWarning" not in p.stderr  # no deprecated pynvml shim next to torch


def test_broken_launch_is_a_fail_line_with_advice(monkeypatch, capsys):
    import course_utils.launcher as launcher

    def broken(*a, **k):
        raise OSError("address already in use")

    monkeypatch.setattr(launcher, "launch", broken)
    monkeypatch.setattr(doctor, "CHECKS", [doctor._launch])
    assert doctor.main() == 1
    out = capsys.readouterr().out
    assert "[FAIL] worker launch: OSError: address already in use" in out
    assert "restart the kernel" in out


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
