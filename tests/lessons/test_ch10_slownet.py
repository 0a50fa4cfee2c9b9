"""Chapter 10, slow networks: the shaped link has the rate it was given, nothing is left behind,
and without root the section is skipped with a reason instead of failing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from course_utils import CommandFailed

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
sys.path.insert(0, str(NOTEBOOKS))  # ch10_slownet imports ch06_netns by name, as a script beside it does
import ch06_netns  # noqa: E402
import ch10_slownet  # noqa: E402

REASON = ch10_slownet.unavailable_reason()
needs_root_netns = pytest.mark.skipif(REASON is not None, reason=f"shaped links: {REASON}")


def _mine():
    """This process's namespaces and cable ends that still exist."""
    names = [n for n in ch06_netns.ours() if n.startswith(f"{ch06_netns.PREFIX}-{os.getpid()}-")]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return names + [w for w in links.split() if w.startswith(f"{ch06_netns.VETH}{os.getpid()}")]


def test_not_root_is_skipped_with_a_reason(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    out = ch10_slownet.slow_links([1e8], steps=1)
    assert set(out) == {"skipped"}
    assert "root" in out["skipped"]


def test_no_tc_is_skipped_with_a_reason(monkeypatch):
    monkeypatch.setattr(ch10_slownet.ch06_netns, "unavailable_reason", lambda: None)
    monkeypatch.setattr(ch10_slownet.shutil, "which", lambda name: None)
    out = ch10_slownet.slow_links([1e8], steps=1)
    assert "`tc`" in out["skipped"]


@needs_root_netns
def test_shaped_link_has_its_rate_and_nothing_is_left():
    rate = 1e8
    out = ch10_slownet.slow_links([rate], steps=2, timeout=120)
    (row,) = out["rows"]
    measured = row["probe_bytes"] * 8 / row["probe_s"]  # 2 ranks: each sends the message size once
    assert 0.4 * rate < measured < 1.5 * rate, f"{measured / 1e6:.1f} Mbit/s on a {rate / 1e6:g} Mbit/s link"
    assert out["qdiscs"]["tbf"] is None
    assert row["step_s"]["fp16"] < row["step_s"]["none"], "half the bytes should be faster on 100 Mbit/s"
    assert not _mine()


@needs_root_netns
def test_failure_after_shaping_leaves_nothing():
    with pytest.raises(CommandFailed, match="failing on purpose"):
        ch10_slownet.slow_links([1e8], steps=1, timeout=120, fail_after_shaping=True)
    assert not _mine()
