"""Chapter 06 checkers: each accepts a right answer and rejects the usual mistakes by name."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest
import torch

from course_utils.checking import CheckFailed
from course_utils.checks import ch06, check_launch_commands, check_resumable

# --------------------------------------------------------------------------------------------
# 06.a launch commands
# --------------------------------------------------------------------------------------------

HEAD = [sys.executable, "-m", "torch.distributed.run"]


def _both(build):
    def make_commands(master_addr, port, job_id, script, script_args):
        return {n: build(n, master_addr, port, job_id, script, script_args) for n in ("node0", "node1")}
    return make_commands


@_both
def commands_right(node, master_addr, port, job_id, script, script_args):
    return HEAD + ["--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d",
                   f"--rdzv_endpoint={master_addr}:{port}", f"--rdzv_id={job_id}",
                   "--max-restarts=1", script, *script_args]


@_both
def commands_total_gpus(node, master_addr, port, job_id, script, script_args):
    return HEAD + ["--nnodes=2", "--nproc_per_node=4", "--rdzv_backend=c10d",
                   f"--rdzv_endpoint={master_addr}:{port}", f"--rdzv_id={job_id}",
                   "--max-restarts=1", script, *script_args]


@_both
def commands_nnodes_is_gpus(node, master_addr, port, job_id, script, script_args):
    return HEAD + ["--nnodes=4", "--nproc_per_node=2", "--rdzv_backend=c10d",
                   f"--rdzv_endpoint={master_addr}:{port}", f"--rdzv_id={job_id}",
                   "--max-restarts=1", script, *script_args]


@_both
def commands_id_per_node(node, master_addr, port, job_id, script, script_args):
    return HEAD + ["--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d",
                   f"--rdzv_endpoint={master_addr}:{port}", f"--rdzv_id={job_id}-{node}",
                   "--max-restarts=1", script, *script_args]


@_both
def commands_localhost_everywhere(node, master_addr, port, job_id, script, script_args):
    host = master_addr if node == "node0" else "localhost"
    return HEAD + ["--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d",
                   f"--rdzv_endpoint={host}:{port}", f"--rdzv_id={job_id}",
                   "--max-restarts=1", script, *script_args]


@_both
def commands_standalone(node, master_addr, port, job_id, script, script_args):
    return HEAD + ["--standalone", "--nnodes=2", "--nproc_per_node=2", "--max-restarts=1",
                   script, *script_args]


@_both
def commands_no_restart(node, master_addr, port, job_id, script, script_args):
    return HEAD + ["--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d",
                   f"--rdzv_endpoint={master_addr}:{port}", f"--rdzv_id={job_id}",
                   script, *script_args]


@_both
def commands_args_before_script(node, master_addr, port, job_id, script, script_args):
    return HEAD + ["--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d",
                   f"--rdzv_endpoint={master_addr}:{port}", f"--rdzv_id={job_id}",
                   "--max-restarts=1", *script_args, script]


@_both
def commands_bare_torchrun(node, master_addr, port, job_id, script, script_args):
    return ["torchrun", "--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d",
            f"--rdzv_endpoint={master_addr}:{port}", f"--rdzv_id={job_id}", "--max-restarts=1",
            script, *script_args]


@_both
def commands_one_string(node, master_addr, port, job_id, script, script_args):
    return " ".join(HEAD + ["--nnodes=2", script])


def commands_one_node(master_addr, port, job_id, script, script_args):
    return {"node0": commands_right(master_addr, port, job_id, script, script_args)["node0"]}


def test_launch_commands_accepts_the_c10d_commands_and_runs_them(capsys, no_leftover_processes):
    check_launch_commands(commands_right)
    out = capsys.readouterr().out
    assert "4 workers, RANK 0..3" in out
    assert "[PASS] 06.a launch commands" in out


@pytest.mark.parametrize("wrong, message", [
    (commands_total_gpus, r"--nproc_per_node=4; it counts the worker processes on ONE machine"),
    (commands_nnodes_is_gpus, r"--nnodes=4; the cluster has 2 machines"),
    (commands_id_per_node, r"different --rdzv_id .* wait in a rendezvous of their own"),
    (commands_localhost_everywhere, r"node1 has --rdzv_endpoint='localhost:29400'"),
    (commands_standalone, r"--standalone: that makes a private rendezvous"),
    (commands_no_restart, r"--max-restarts=0; the job must survive one failure"),
    (commands_args_before_script, r"unrecognized arguments: --steps.*go after the script's name"),
    (commands_bare_torchrun, r"starts with 'torchrun --nnodes=2 --nproc_per_node=2'"),
    (commands_one_string, r"is one string"),
    (commands_one_node, r"expected the keys \['node0', 'node1'\]"),
    (lambda *a: None, r"expected a dict"),
    (None, r"got None"),
])
def test_launch_commands_rejects_usual_mistakes(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        check_launch_commands(wrong)


def test_launch_commands_stub_is_not_done_yet():
    def stub(*args):
        raise NotImplementedError("Exercise 06.a launch commands: replace this line with your code")

    with pytest.raises(CheckFailed, match=r"not done yet.*06\.a launch commands"):
        check_launch_commands(stub)


# --------------------------------------------------------------------------------------------
# 06.b resumable training
# --------------------------------------------------------------------------------------------


def save_right(path, model, optimizer, step):
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": step}, f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_right(path, model, optimizer):
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def save_in_place(path, model, optimizer, step):
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
               path)


def save_model_only(path, model, optimizer, step):
    torch.save({"model": model.state_dict(), "step": step}, path + ".tmp")
    os.replace(path + ".tmp", path)


def load_model_only(path, model, optimizer):
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    return state["step"]


def load_unsafe(path, model, optimizer):
    state = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def load_next_step(path, model, optimizer):
    return load_right(path, model, optimizer) + 1


def load_returns_nothing(path, model, optimizer):
    load_right(path, model, optimizer)


def load_into_new_model(path, model, optimizer):
    import copy

    state = torch.load(path, weights_only=True)
    copy.deepcopy(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def save_whole_objects(path, model, optimizer, step):
    torch.save({"model": model, "optimizer": optimizer, "step": step}, path + ".tmp")
    os.replace(path + ".tmp", path)


def save_to_other_name(path, model, optimizer, step):
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
               path + ".tmp")


def save_with_named_temp_beside(path, model, optimizer, step):
    folder = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile(dir=folder, suffix=".tmp", delete=False) as f:
        try:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": step}, f)
        except BaseException:
            f.close()
            os.unlink(f.name)
            raise
    os.replace(f.name, path)


def save_via_system_temp(path, model, optimizer, step):
    fd, tmp = tempfile.mkstemp(suffix=".pt")  # in /tmp, not beside `path`
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": step}, f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_via_system_temp_and_move(path, model, optimizer, step):
    fd, tmp = tempfile.mkstemp(suffix=".pt")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": step}, f)
        shutil.move(tmp, path)  # "move works across filesystems"
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_leaves_temp_on_failure(path, model, optimizer, step):
    tmp = path + ".tmp"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)


def save_swallows_errors(path, model, optimizer, step):
    tmp = path + ".tmp"
    try:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "step": step}, tmp)
        os.replace(tmp, path)
    except Exception as e:  # "a failed checkpoint must not stop training"
        print("checkpoint failed:", e)
        if os.path.exists(tmp):
            os.unlink(tmp)


@pytest.mark.parametrize("save", [save_right, save_with_named_temp_beside], ids=lambda f: f.__name__)
def test_resumable_accepts_atomic_save_and_safe_load(save, capsys, no_leftover_processes):
    check_resumable(save, load_right)
    out = capsys.readouterr().out
    assert "a crash during a save keeps the previous checkpoint" in out
    assert "final model bit-identical to the uninterrupted run's" in out
    assert "[PASS] 06.b resumable training" in out


@pytest.mark.parametrize("save, load, message", [
    (save_in_place, load_right, r"a crash in the middle of a save destroyed the previous checkpoint"),
    (save_model_only, load_model_only, r"the optimizer has no state: Adam's moments"),
    (save_right, load_unsafe, r"ran the code hidden in it.*weights_only=True"),
    (save_right, load_next_step, r"saved at step 7, load_checkpoint returned 8"),
    (save_right, load_returns_nothing, r"load_checkpoint returned None"),
    (save_right, load_into_new_model, r"parameters after load_checkpoint differ"),
    (save_whole_objects, load_right, r"cannot be read with torch.load\(\.\.\., weights_only=True\)"),
    (save_to_other_name, load_right, r"left no file at `path`"),
    (save_via_system_temp, load_right, r"another filesystem than the checkpoint.*EXDEV.*dir="),
    (save_via_system_temp_and_move, load_right, r"another filesystem.*shutil\.move falls back to a "
                                                r"copy, which is not atomic"),
    (save_leaves_temp_on_failure, load_right, r"a save that failed left \['ckpt\.pt\.tmp'\]"),
    (save_swallows_errors, load_right, r"save_checkpoint returned normally.*re-raise"),
    (None, load_right, r"expected save_checkpoint.*got None"),
])
def test_resumable_rejects_usual_mistakes(save, load, message):
    with pytest.raises(CheckFailed, match=message):
        check_resumable(save, load)


def test_resumed_run_comparison_catches_a_resume_that_loses_the_optimizer(tmp_path,
                                                                          no_leftover_processes):
    """The distributed half on its own: a resume without Adam's state ends elsewhere."""
    with pytest.raises(CheckFailed, match=r"differs from the uninterrupted run's by up to"):
        ch06._compare_resumed_run(save_model_only, load_model_only, str(tmp_path))


def test_resumable_stub_is_not_done_yet():
    def stub(*args):
        raise NotImplementedError("Exercise 06.b resumable training: replace this line with your code")

    with pytest.raises(CheckFailed, match=r"not done yet.*06\.b resumable training"):
        check_resumable(stub, stub)
