"""Chapter 06: two torchrun agents on this machine act as two nodes.

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

from course_utils import free_port, run_commands

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


def _train(job: Path) -> list[str]:
    return ["ch06_train.py", "--steps", "4", "--log-every", "2", "--show-env", "--out",
            str(job / "final.pt")]


def test_c10d_two_agents_form_one_job_and_ranks_follow_the_sorted_addresses(job, no_leftover_processes):
    port = free_port()

    def agent(local_addr):
        return TORCHRUN + ["--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d",
                           f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id={job.name}",
                           f"--local-addr={local_addr}", *_train(job)]

    # "first" starts earlier but announces the address that sorts second.
    results = run_commands({"first": agent("127.0.0.2"), "second": agent("127.0.0.1")},
                           timeout=120, env=QUIET, stagger=0.5, cwd=NOTEBOOKS, echo=False)
    assert all(r.ok for r in results), [r.output[-2000:] for r in results]
    rows = _env_rows(results)
    assert [int(r["RANK"]) for r in rows] == [0, 1, 2, 3]
    for r in rows:
        assert (r["WORLD_SIZE"], r["LOCAL_WORLD_SIZE"]) == ("4", "2")
        assert int(r["RANK"]) == int(r["GROUP_RANK"]) * 2 + int(r["LOCAL_RANK"])
        assert r["MASTER_ADDR"] == "127.0.0.1"  # node 0's announced address
        assert r["MASTER_PORT"] != str(port)  # the workers' store is not the rendezvous port
    groups = {r["agent"]: {x["GROUP_RANK"] for x in rows if x["agent"] == r["agent"]} for r in rows}
    assert groups == {"second": {"0"}, "first": {"1"}}
    assert "[train] done: 4 steps" in " ".join(r.output for r in results)


def test_static_rendezvous_node_rank_decides(job, no_leftover_processes):
    port = free_port()

    def agent(node_rank):
        return TORCHRUN + ["--nnodes=2", "--nproc_per_node=1", f"--node_rank={node_rank}",
                           "--master_addr=127.0.0.1", f"--master_port={port}",
                           f"--rdzv_id={job.name}", *_train(job)]

    results = run_commands({"node1": agent(1), "node0": agent(0)}, timeout=120, env=QUIET,
                           stagger=0.5, cwd=NOTEBOOKS, echo=False)
    assert all(r.ok for r in results), [r.output[-2000:] for r in results]
    rows = _env_rows(results)
    assert {(r["agent"], r["GROUP_RANK"], r["RANK"]) for r in rows} == {("node0", "0", "0"),
                                                                        ("node1", "1", "1")}
    assert {r["MASTER_PORT"] for r in rows} == {str(port)}


def test_timeout_kills_agents_and_their_workers(job, no_leftover_processes):
    """A job still training when the timeout comes: the agent and its workers are all gone after."""
    cmd = TORCHRUN + ["--standalone", "--nproc_per_node=2", f"--rdzv_id={job.name}",
                      "ch06_train.py", "--steps", "100000000", "--log-every", "0", "--show-env",
                      "--out", str(job / "final.pt")]
    # Long enough for an agent and two workers to import torch on a busy 2-core machine.
    (result,) = run_commands({"node0": cmd}, timeout=25, env=QUIET, cwd=NOTEBOOKS, echo=False)
    assert result.timed_out and result.returncode is None
    # The workers had started (they print ENV before joining), so the teardown reached them.
    assert len(_env_rows([result])) == 2, result.output[-1500:]
    # The fixture `job` then checks that no process mentioning the job's folder is left.
