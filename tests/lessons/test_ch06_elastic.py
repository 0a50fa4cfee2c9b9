"""Chapter 06: failures under torchrun, and the checkpoint helpers of ``ch06_train.py``.

The restart itself (``--max-restarts=1``: resumed from the checkpoint, bit-identical to the
uninterrupted run, a fresh store for each attempt, ``@record``'s error file) is asserted by the
lesson's own cells in section 5, under nbval; these tests cover what the lesson does not run.
"""

from __future__ import annotations

import importlib.util
import os
import re
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


def test_a_failure_without_restarts_reports_its_cause_with_the_traceback(job,
                                                                         no_leftover_processes):
    cmd = TORCHRUN + ["--standalone", "--nproc_per_node=2", "ch06_train.py", "--steps", "6",
                      "--crash-at-step", "2", "--crash-rank", "0", "--log-every", "0",
                      "--out", str(job / "never.pt")]
    (result,) = run_commands({"node0": cmd}, timeout=120, env=QUIET, cwd=NOTEBOOKS, echo=False)
    assert result.returncode not in (0, None), result.output[-2000:]
    failures = _reported_failures(result.output)
    assert sorted(failures) == [0, 1], result.output[-3000:]
    # @record: rank 0's own exception and its traceback, not "error_file: <N/A>" (rank 1 fails
    # inside the all-reduce, or is stopped by the agent before it can: SIGTERM, no error file)
    assert "simulated failure on rank 0 at step 2" in failures[0]
    assert 'ch06_train.py", line' in failures[0]
    assert "error_file: <N/A>" not in failures[0]
    # torchrun's "Root Cause" is the failure its agent stored first among the earliest whole
    # seconds: rank 0's, or rank 1's echo of it when both errors carry the same second and rank 1
    # ended first (the lesson, section 5.3). Whichever it names, it is one of the two above.
    root = result.output.split("Root Cause (first observed failure):", 1)[1]
    named = int(re.search(r"rank\s*: (\d+) \(local_rank", root).group(1))
    assert named == 0 or "simulated failure" not in failures[1] and _is_an_echo(failures[1]), root
    assert not (job / "never.pt").exists()


def _reported_failures(output: str) -> dict[int, str]:
    """Global rank -> its entry in torchrun's summary of a failed job (after ``Failures:``)."""
    summary = output.split("FAILED\n", 1)[1]
    entries = re.split(r"\n\[\d+\]:\n", summary)[1:]
    return {int(re.search(r"rank\s*: (\d+) \(local_rank", e).group(1)): e for e in entries}


def _is_an_echo(text: str) -> bool:
    """The error a rank gets when its peer's process is gone in the middle of a collective."""
    return any(s in text for s in ("Connection closed", "Connection reset", "Broken pipe"))


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


_WRITER = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import ch06_train
big = torch.nn.Linear(3000, 3000)  # about 36 MB of parameters: a save that lasts a while
opt = torch.optim.Adam(big.parameters())
big(torch.ones(1, 3000)).sum().backward()
opt.step()  # Adam's moments: the checkpoint is three times the parameters
print("saving", flush=True)
while True:
    ch06_train.save_checkpoint(sys.argv[2], big, opt, 20)
"""


def test_a_writer_killed_mid_save_leaves_the_previous_checkpoint_whole(tmp_path):
    """SIGKILL while the next checkpoint is half written: the file under the real name is still the
    previous, whole one (a reader sees old or new, never a mix)."""
    import signal
    import subprocess

    train = _load("ch06_train")
    from course_utils.data import make_model

    path = tmp_path / "ckpt.pt"
    model = make_model(seed=0)
    train.save_checkpoint(str(path), model, torch.optim.Adam(model.parameters()), 10)
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(NOTEBOOKS), str(path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "saving"
        deadline = psutil.time.time() + 60
        while not any(p.name.endswith(".tmp") and p.stat().st_size > 1_000_000 for p in tmp_path.iterdir()):
            assert psutil.time.time() < deadline and writer.poll() is None, "the save never started"
            psutil.time.sleep(0.002)
        os.kill(writer.pid, signal.SIGKILL)  # mid-write of the temporary file
        writer.wait()
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    assert any(p.name.endswith(".tmp") for p in tmp_path.iterdir())  # the half-written file
    fresh = make_model(seed=1)
    assert train.load_checkpoint(str(path), fresh, torch.optim.Adam(fresh.parameters()), "cpu") == 10
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("keep", [0.5, 0.99, 0.0])
def test_loading_a_cut_short_checkpoint_fails_and_says_so(tmp_path, keep):
    """What a save written in place and stopped half-way leaves: refused by name, not loaded."""
    train = _load("ch06_train")
    from course_utils.data import make_model

    path = tmp_path / "ckpt.pt"
    model = make_model(seed=0)
    train.save_checkpoint(str(path), model, torch.optim.Adam(model.parameters()), 10)
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(RuntimeError, match="is not a whole checkpoint"):
        train.load_checkpoint(str(path), model, torch.optim.Adam(model.parameters()), "cpu")


def test_a_preemption_warning_reaches_every_worker_through_torchrun_and_they_stop_together(job):
    """SIGUSR1 to torchrun's agent (what srun forwards from the batch shell): with SIGUSR1 among
    --signals-to-handle the agent passes it on (and then ends itself, with the signal as its error:
    torchrun treats every signal it handles as a death signal); both workers stop after the same
    step, and rank 0 saves that step's checkpoint.

    That a run resumed from this checkpoint ends bit-identical to an uninterrupted one is
    tests/system/test_slurm.py's preemption test (the same script and signal, under Slurm), which
    CI runs; it is not repeated here, where it took two more torchrun jobs."""
    import signal
    import subprocess

    agent = TORCHRUN + ["--standalone", "--nproc_per_node=2",
                        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "ch06_train.py",
                        "--steps", "16", "--save-every", "5", "--log-every", "0"]
    ckpt = job / "ckpt.pt"
    env = dict(os.environ, **QUIET, TMPDIR=str(job))  # torchrun's log folder goes with the test's
    first = subprocess.Popen(agent + ["--ckpt", str(ckpt), "--step-time", "0.4"], cwd=NOTEBOOKS, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in first.stdout:
            lines.append(line)
            if "step   5  checkpoint saved" in line:
                first.send_signal(signal.SIGUSR1)
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    out = "".join(lines)
    assert f"Received {int(signal.SIGUSR1)} death signal" in out and "closing signal SIGUSR1" in out, out
    stopped = [x for x in lines if "preemption warning: stopped after step" in x]
    assert len(stopped) == 1, out  # rank 0 logs it once, for all
    step = int(stopped[0].split("after step ")[1].split(",")[0])
    assert 5 <= step < 16 and f"step {step:3d}  checkpoint saved" in out, out
    assert "done: 16 steps" not in out, out
    assert torch.load(ckpt, weights_only=True)["step"] == step
