"""Chapter 06: two torchrun agents on this machine act as two nodes.

The lesson's own cells assert what its two-node jobs show (node ranks from the sorted addresses
under c10d, from ``--node_rank`` under the static form, ``MASTER_PORT`` apart from the rendezvous
port), so nbval fails when they stop holding; these tests cover what the lesson does not run.
Each test runs real ``torchrun`` agents (``python -m torch.distributed.run``) through
``course_utils.run_commands`` and then checks that no agent or worker of it is left running,
including workers that torchrun started in sessions of their own.
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from course_utils import run_commands

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
QUIET = {"OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}


def _mentioning(token: str) -> list[psutil.Process]:
    """Processes whose command line contains ``token`` (orphans included)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if token in " ".join(p.info["cmdline"] or []):
                found.append(p)
        except psutil.Error:
            continue
    return found


@pytest.fixture
def job(tmp_path):
    """A folder named like a unique job id, passed in every command line (as the id, and as the
    ``--out`` path, so workers carry it too); after the test no process may still mention it."""
    folder = tmp_path / f"t06-{uuid.uuid4().hex[:10]}"
    folder.mkdir()
    yield folder
    tok = str(folder)
    deadline = psutil.time.time() + 10
    left = _mentioning(tok)
    while left and psutil.time.time() < deadline:
        psutil.time.sleep(0.2)
        left = _mentioning(tok)
    assert not left, f"still running: {[p.pid for p in left]}"


def _env_rows(results) -> list[dict]:
    rows = [dict(json.loads(line[4:]), agent=r.name)
            for r in results for line in r.output.splitlines() if line.startswith("ENV ")]
    return sorted(rows, key=lambda d: int(d["RANK"]))


def test_timeout_kills_agents_and_their_workers(job, no_leftover_processes):
    """A job still training when the timeout comes: the agent and its workers are all gone after.

    Each step lasts at least half a second (``--step-time``), so that the workers wait for the
    timeout asleep instead of taking the cores from the tests running beside this one."""
    cmd = TORCHRUN + ["--standalone", "--nproc_per_node=2", f"--rdzv_id={job.name}",
                      "ch06_train.py", "--steps", "100000000", "--step-time", "0.5", "--log-every", "0",
                      "--show-env",
                      "--out", str(job / "final.pt")]
    # Long enough for an agent and two workers to import torch on a busy 2-core machine.
    (result,) = run_commands({"node0": cmd}, timeout=25, env=QUIET, cwd=NOTEBOOKS, echo=False)
    assert result.timed_out and result.returncode is None
    # The workers had started (they print ENV before joining), so the teardown reached them.
    assert len(_env_rows([result])) == 2, result.output[-1500:]
    # The fixture `job` then checks that no process mentioning the job's folder is left.
