"""Chapter 16's scripts: local SGD with H = 1 is DDP; DiLoCo with outer lr 1 and no momentum is local
SGD; bf16, int8 and fragments send the bytes they claim; the α-β crossover; the shaped-link run
(root only, skipped with a reason otherwise) leaves nothing behind; torchft's DiLoCo equals the
one-process simulation and heals a killed replica (skipped without torchft)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from course_utils import launch
from course_utils.measure.ch16 import crossover_bps, run_ft, step_seconds, steps_to

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
sys.path.insert(0, str(NOTEBOOKS))  # the scripts import each other by name, as files beside them do
import ch16_diloco  # noqa: E402
import ch16_ft  # noqa: E402
import ch16_slownet  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

SGD = dict(inner="sgd", inner_lr=0.2, steps=32)
CONFIGS = [
    dict(algo="ddp", **SGD),
    dict(algo="local_sgd", H=1, **SGD),
    dict(algo="local_sgd", H=8, **SGD),
    dict(algo="diloco", H=8, outer_lr=1.0, momentum=0.0, **SGD),
    dict(algo="diloco", H=8, steps=32),
    dict(algo="diloco", H=8, steps=32, comm="bf16"),
    dict(algo="diloco", H=8, steps=32, comm="int8"),
    dict(algo="diloco", H=8, steps=32, fragments=4, overlap=2),
]


@pytest.fixture(scope="module")
def runs():
    return launch(ch16_diloco.train_many, nprocs=2, args=(CONFIGS,), timeout=180, display=None)[0]


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_local_sgd_with_h1_is_ddp_and_diloco_with_lr1_is_local_sgd(runs):
    ddp, h1, h8, diloco_avg = runs[:4]
    assert _max_diff(ddp["state"], h1["state"]) < 1e-5
    assert _max_diff(h8["state"], diloco_avg["state"]) < 1e-5
    assert _max_diff(ddp["state"], h8["state"]) > 1e-4  # and H = 8 is not DDP


def test_bytes_per_sync(runs):
    params = sum(t.numel() for t in runs[0]["state"].values())
    fp32, bf16, int8, frag = runs[4:]
    assert [b for _, b in fp32["syncs"]] == [params * 4] * 4  # 2 ranks: a ring sends the message once
    assert [b for _, b in bf16["syncs"]] == [params * 2] * 4
    assert [b for _, b in int8["syncs"]] == [params + 4] * 4  # the int8 values and one float32 scale
    peak = max(b for _, b in frag["syncs"])
    assert abs(peak - params) <= 4 and frag["bytes"] == pytest.approx(fp32["bytes"], abs=16)
    assert all(r["evals"][-1][2] < r["evals"][0][2] for r in runs)


def test_alpha_beta_arithmetic():
    assert steps_to([(0, 0, 2.0), (8, 1, 0.9), (16, 2, 0.5)], 1.0) == 8
    assert steps_to([(0, 0, 2.0)], 1.0) is None
    # 1 MB every step against every 10 steps, 1 ms of compute, no latency: at 8 Mbit/s (1 MB/s) a
    # sync costs 1 s, so 100 steps of the first take 100.1 s, 150 of the second 15.15 s
    assert step_seconds(1e-3, 1e6, 1, 8e6, 0.0) == pytest.approx(1.001)
    rate = crossover_bps(1e-3, (100, 1e6, 1), (150, 1e6, 10), 0.0)
    t = [n * step_seconds(1e-3, 1e6, h, rate, 0.0) for n, h in ((100, 1), (150, 10))]
    assert t[0] == pytest.approx(t[1])
    assert crossover_bps(1e-3, (100, 1e6, 1), (50, 1e6, 10), 0.0) is None  # the second is always faster


def test_not_root_is_skipped_with_a_reason(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    out = ch16_slownet.slow_steps([1e8])
    assert set(out) == {"skipped"} and "root" in out["skipped"]


@pytest.mark.skipif(ch16_slownet.ch10_slownet.unavailable_reason() is not None,
                    reason=f"shaped links: {ch16_slownet.ch10_slownet.unavailable_reason()}")
def test_on_a_slow_link_diloco_steps_are_cheaper_and_nothing_is_left():
    out = ch16_slownet.slow_steps([1e7], H=8, timeout=120)
    (row,) = out["rows"]
    mean = {k: sum(v) / len(v) for k, v in row["times"].items()}
    # 177 KiB per DDP step at 10 Mbit/s is about 145 ms; DiLoCo sends it once per 8 steps
    assert mean["ddp"] > 0.1 and mean["ddp"] > 3 * mean["diloco"], mean
    assert not [n for n in ch16_slownet.ch06_netns.ours() if f"-{os.getpid()}-" in n]


@pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                    reason='torchft is not installed (the optional extra: pip install -e ".[ft]")')
def test_torchft_diloco_equals_the_simulation_and_heals_a_killed_replica(tmp_path):
    import ch13_ft

    logs, _ = run_ft(NOTEBOOKS / "ch16_ft.py", tmp_path, rounds=2, sync_every=4, kill_at=1, together=1,
                     round_time=0.05, rejoin_after=1)
    steps = {k: [r for r in v if "step" in r and "event" not in r] for k, v in logs.items()}
    model = ch16_diloco.make_model(0)
    model.load_state_dict(ch16_ft.simulate(1, 4))
    assert steps[0, 0][0]["digest"] == steps[1, 0][0]["digest"] == ch13_ft.digest(model)
    assert any(r["participants"] == 1 for r in steps[0, 0])  # the survivor went on alone
    assert any(r.get("event") == "healed" for r in logs[1, 1])
    survivor = {r["step"]: r["digest"] for r in steps[0, 0]}
    joined = [r for r in steps[1, 1] if r["participants"] == 2]
    assert joined and all(survivor[r["step"]] == r["digest"] for r in joined)
