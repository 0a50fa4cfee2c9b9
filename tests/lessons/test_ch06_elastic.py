"""Chapter 06: failures under torchrun, and the checkpoint helpers of ``ch06_train.py``.

The restart itself (``--max-restarts=1``: resumed from the checkpoint, bit-identical to the
uninterrupted run, a fresh store for each attempt, ``@record``'s error file) is asserted by the
lesson's own cells in section 5, under nbval; these tests cover what the lesson does not run.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import uuid
from pathlib import Path

import psutil
import pytest
import torch

from course_utils import run_commands

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
QUIET = {"OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, NOTEBOOKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def job(tmp_path):
    """A folder whose path is in every command line; no process may mention it afterwards."""
    folder = tmp_path / f"t06-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    yield folder
    deadline = psutil.time.time() + 10
    while True:
        left = [p for p in psutil.process_iter(["cmdline"])
                if str(folder) in " ".join(p.info["cmdline"] or [])]
        if not left or psutil.time.time() > deadline:
            break
        psutil.time.sleep(0.2)
    assert not left, f"still running: {[p.pid for p in left]}"


def test_a_failure_without_restarts_names_the_root_cause_with_its_traceback(job,
                                                                             no_leftover_processes):
    cmd = TORCHRUN + ["--standalone", "--nproc_per_node=2", "ch06_train.py", "--steps", "6",
                      "--crash-at-step", "2", "--crash-rank", "0", "--log-every", "0",
                      "--out", str(job / "never.pt")]
    (result,) = run_commands({"node0": cmd}, timeout=120, env=QUIET, cwd=NOTEBOOKS, echo=False)
    assert result.returncode not in (0, None), result.output[-2000:]
    root = result.output.split("Root Cause", 1)[1]
    assert "simulated failure on rank 0 at step 2" in root  # the traceback, thanks to @record
    assert "error_file: <N/A>" not in root
    assert not (job / "never.pt").exists()


def test_atomic_save_keeps_the_previous_checkpoint_when_a_save_fails(tmp_path):
    train = _load("ch06_train")
    from course_utils.data import make_model

    class FailsHalfway:
        def __reduce__(self):
            raise OSError("simulated failure half-way through the save")

    path = str(tmp_path / "ckpt.pt")
    model = make_model(seed=0)
    opt = torch.optim.Adam(model.parameters())
    train.save_checkpoint(path, model, opt, 10)
    opt.param_groups[0]["boom"] = FailsHalfway()
    with pytest.raises(OSError, match="half-way"):
        train.save_checkpoint(path, model, opt, 20)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]  # no temporary file left
    fresh = make_model(seed=1)
    assert train.load_checkpoint(path, fresh, torch.optim.Adam(fresh.parameters()), "cpu") == 10
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def test_atomic_save_forces_the_directory_to_disk_after_the_rename(tmp_path, monkeypatch):
    import stat

    train = _load("ch06_train")
    from course_utils.data import make_model

    synced, real_fsync = [], os.fsync

    def recording_fsync(fd):
        mode = os.fstat(fd).st_mode
        synced.append(("directory" if stat.S_ISDIR(mode) else "file",
                       sorted(p.name for p in tmp_path.iterdir())))
        real_fsync(fd)

    monkeypatch.setattr(train.os, "fsync", recording_fsync)
    model = make_model(seed=0)
    train.save_checkpoint(str(tmp_path / "ckpt.pt"), model, torch.optim.Adam(model.parameters()), 10)
    kinds = [kind for kind, _ in synced]
    assert kinds == ["file", "directory"], synced
    assert synced[1][1] == ["ckpt.pt"], "the directory is synced after the rename, not before"


@pytest.mark.parametrize("env, bound", [
    ({"SLURM_PROCID": "3", "CUDA_VISIBLE_DEVICES": "3"}, True),        # --gpus-per-task=1
    ({"SLURM_PROCID": "3", "CUDA_VISIBLE_DEVICES": "0"}, True),        # the same, cgroup-constrained
    ({"SLURM_PROCID": "3", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, False),  # --gpus-per-node, no binding
    ({"SLURM_PROCID": "0"}, False),                                     # no GPUs
    ({"CUDA_VISIBLE_DEVICES": "1"}, False),                             # not under Slurm
])
def test_a_slurm_task_bound_to_one_gpu_is_recognised(env, bound):
    assert _load("ch06_train").slurm_bound_one_gpu(env) is bound
