"""Chapter 15, pipelining and context parallelism with an MoE model: the lesson runs the pipeline rows of
its table and the sequence split over 2 ranks; here the sequence is split over 4 ranks (ring
attention with 4 exchanges, 2 experts per rank), heavier than the lesson's time allows."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from course_utils import launch

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
sys.path.insert(0, str(NOTEBOOKS))  # ch15_mesh imports ch15_moe and ch14_ring by name, as a script does
import ch15_mesh  # noqa: E402
import ch15_recorded  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def test_context_parallel_moe_block_on_4_ranks_equals_one_process():
    start = time.perf_counter()
    out = launch(ch15_mesh.cp_parity, kwargs={"steps": 4}, nprocs=4, timeout=300)[0]
    seconds = time.perf_counter() - start
    curves = dict(out["curves"])
    base = curves.pop("one process")
    assert len(curves) == 2 and {len(c) for c in curves.values()} == {len(base)} == {4}
    for name, c in curves.items():
        assert max(abs(a - b) for a, b in zip(c, base)) < 1e-5, (name, base, c)
    assert max(out["max parameter difference"].values()) < 1e-5, out["max parameter difference"]
    # with CH15_RECORD=1: the lesson shows this run beside its own on 2 ranks
    ch15_recorded.update("CP with an MoE block, 4 ranks", "tests/lessons/test_ch15_pp_cp.py", out["curves"],
                         seconds, max_parameter_difference=out["max parameter difference"])


def test_a_pipeline_must_put_the_balancing_loss_gradient_on_the_routers_stage():
    out = launch(ch15_mesh.parity, kwargs={"steps": 2}, nprocs=4, timeout=300)[0]
    base = out["curves"]["one process"]
    for name in ("PP (2 stages)", "dp x pp (2 x 2)"):
        assert max(abs(a - b) for a, b in zip(out["curves"][name], base)) < 1e-5, name
    router = out["PP router gradient"]
    assert router["right"] < 1e-6 and router["wrong"] > 1e-5, router
