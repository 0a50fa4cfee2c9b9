"""Chapter 06 checkers: each accepts a right answer and rejects the usual mistakes by name."""

from __future__ import annotations

import functools
import itertools
import os
import shutil
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
from misconceptions import cases  # tests/checkers/misconceptions.py, beside this file

from course_utils.checking import CheckFailed
from course_utils.checks import check_launch_commands, check_resumable
from course_utils.checks.ch06 import a_launch_commands, b_resumable

# --------------------------------------------------------------------------------------------
# 06.a launch commands
# --------------------------------------------------------------------------------------------

HEAD = [sys.executable, "-m", "torch.distributed.run"]
ENV = ["env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"]  # a fresh workers' store for each attempt


def _both(build):
    @functools.wraps(build)  # keeps the name: the catalogue's key
    def make_commands(master_addr, port, job_id, script, script_args):
        return {n: build(n, master_addr, port, job_id, script, script_args) for n in ("node0", "node1")}
    return make_commands


@_both
def commands_right(node, master_addr, port, job_id, script, script_args):
    return ENV + HEAD + ["--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d",
                   f"--rdzv_endpoint={master_addr}:{port}", f"--rdzv_id={job_id}",
                   "--max-restarts=1", script, *script_args]


@_both
def commands_total_gpus(node, master_addr, port, job_id, script, script_args):
    return HEAD + ["--nnodes=2", "--nproc_per_node=4", "--rdzv_backend=c10d",
                   f"--rdzv_endpoint={master_addr}:{port}", f"--rdzv_id={job_id}",
                   "--max-restarts=1", script, *script_args]


@_both
def commands_nproc_cpu(node, master_addr, port, job_id, script, script_args):
    return HEAD + ["--nnodes=2", "--nproc-per-node=cpu", "--rdzv_backend=c10d",
                   f"--rdzv_endpoint={master_addr}:{port}", f"--rdzv_id={job_id}",
                   "--max-restarts=1", script, *script_args]


def commands_one_per_gpu(node, master_addr, port, job_id, script, script_args):
    """--nproc-per-node given as a device kind, which torchrun turns into the machine's GPU count:
    "gpu" on node0 and "auto" on node1, so that one run tries both."""
    kind = {"node0": "gpu", "node1": "auto"}[node]
    env = ["/usr/bin/env", "OMP_NUM_THREADS=1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"]
    return env + HEAD + ["--nnodes=2", f"--nproc-per-node={kind}", "--rdzv_backend=c10d",
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
def commands_shared_store(node, master_addr, port, job_id, script, script_args):
    """--max-restarts=1 alone: the restarted attempt would reuse node0's store (lesson 06, 5.1)."""
    return HEAD + ["--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d",
                   f"--rdzv_endpoint={master_addr}:{port}", f"--rdzv_id={job_id}",
                   "--max-restarts=1", script, *script_args]


@_both
def commands_share_store_off(node, master_addr, port, job_id, script, script_args):
    return ["env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=0"] + HEAD + [
        "--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d",
        f"--rdzv_endpoint={master_addr}:{port}", f"--rdzv_id={job_id}", "--max-restarts=1",
        script, *script_args]


@_both
def commands_one_string(node, master_addr, port, job_id, script, script_args):
    return " ".join(HEAD + ["--nnodes=2", script])


def commands_one_node(master_addr, port, job_id, script, script_args):
    return {"node0": commands_right(master_addr, port, job_id, script, script_args)["node0"]}


def test_launch_commands_accepts_one_worker_per_gpu_and_runs_the_commands(capsys,
                                                                         no_leftover_processes):
    # The numeric form (--nproc_per_node=2, commands_right) runs through the same checker in the
    # solution notebook, under nbval; this run is the per-GPU forms', both node kinds at once.
    check_launch_commands(_both(commands_one_per_gpu))
    out = capsys.readouterr().out
    assert "--nproc_per_node=auto: one worker per GPU, 2 on each machine" in out  # the first, sorted
    assert "4 workers, RANK 0..3" in out
    assert "rank 3 failed on purpose in the first attempt and the restarted job finished" in out
    assert "[PASS] 06.a launch commands" in out


def test_launch_commands_reads_gpu_and_auto_as_the_gpu_count_before_running_anything():
    cmds = _both(commands_one_per_gpu)("127.0.0.1", 29400, "job", "probe.py", ["--steps", "4"])
    parsed = a_launch_commands._static_checks(cmds, "127.0.0.1", 29400, "job", "probe.py",
                                              ["--steps", "4"])
    for node in ("node0", "node1"):
        simulated = a_launch_commands._as_simulated(cmds[node], parsed[node], 2)
        env, command = a_launch_commands._environment(simulated)
        assert env == {"OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        assert a_launch_commands._torchrun_parser().parse_args(command[3:]).nproc_per_node == "2"
        assert simulated[-3:] == ["probe.py", "--steps", "4"]
    # commands_right, the numeric form, is left as written
    right = commands_right("127.0.0.1", 29400, "job", "probe.py", ["--steps", "4"])
    parsed = a_launch_commands._static_checks(right, "127.0.0.1", 29400, "job", "probe.py",
                                              ["--steps", "4"])
    assert a_launch_commands._as_simulated(right["node0"], parsed["node0"], 2) == right["node0"]


# Each misconception of 06.a's catalogue: the wrong commands of the same name, and what the failure says.
WRONG_A = {f.__name__: (f, message) for f, message in [
    (commands_total_gpus, r"--nproc_per_node=4; it counts the worker processes on ONE machine"),
    (commands_nnodes_is_gpus, r"--nnodes=4; the cluster has 2 machines"),
    (commands_nproc_cpu, r"--nproc_per_node=cpu; 'cpu' starts one worker per CPU core"),
    (commands_id_per_node, r"different --rdzv_id .* wait in a rendezvous of their own"),
    (commands_localhost_everywhere, r"node1 has --rdzv_endpoint='localhost:29400'"),
    (commands_standalone, r"--standalone: that makes a private rendezvous"),
    (commands_no_restart, r"--max-restarts=0; the job must survive one failure"),
    (commands_shared_store, r"node0 has --max-restarts=1, but a restarted attempt reuses node0's store"),
    (commands_args_before_script, r"unrecognized arguments: --steps.*go after the script's name"),
    (commands_bare_torchrun, r"starts with 'torchrun --nnodes=2 --nproc_per_node=2'"),
    (commands_one_string, r"is one string"),
]}


@pytest.mark.parametrize("mistake, wrong", cases(a_launch_commands.CATALOGUE, WRONG_A))
def test_launch_commands_rejects_usual_mistakes(mistake, wrong):
    make_commands, message = wrong
    with pytest.raises(CheckFailed, match=message) as info:
        check_launch_commands(make_commands)
    assert mistake.message in info.value.args[0]


@pytest.mark.parametrize("wrong, message", [
    (commands_one_node, r"expected the keys \['node0', 'node1'\]"),
    (commands_share_store_off, r"node0 has --max-restarts=1, but a restarted attempt reuses"),
    (lambda *a: None, r"expected a dict"),
    (None, r"got None"),
])
def test_launch_commands_rejects_answers_of_the_wrong_shape(wrong, message):
    """(and the store shared across attempts, switched on by name: the same mistake as leaving it)"""
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


def _state(model, optimizer, scheduler, epoch, step_in_epoch):
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "epoch": epoch, "step_in_epoch": step_in_epoch}


def save_right(path, rank, model, optimizer, scheduler, epoch, step_in_epoch):
    if rank != 0:
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(_state(model, optimizer, scheduler, epoch, step_in_epoch), f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_right(path, model, optimizer, scheduler):
    device = next(model.parameters()).device
    state = torch.load(path, map_location=device, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return state["epoch"], state["step_in_epoch"]


def batches_right(loader, epoch, step_in_epoch):
    loader.sampler.set_epoch(epoch)
    return itertools.islice(loader, step_in_epoch, None)


def batches_by_skipping(loader, epoch, step_in_epoch):
    """A generator that skips the batches already done by hand."""
    loader.sampler.set_epoch(epoch)
    for i, batch in enumerate(loader):
        if i >= step_in_epoch:
            yield batch


def load_as_list(path, model, optimizer, scheduler):
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return [int(state["epoch"]), int(state["step_in_epoch"])]


def save_in_place(path, rank, model, optimizer, scheduler, epoch, step_in_epoch):
    if rank == 0:
        torch.save(_state(model, optimizer, scheduler, epoch, step_in_epoch), path)


def save_model_only(path, rank, model, optimizer, scheduler, epoch, step_in_epoch):
    if rank == 0:
        torch.save({"model": model.state_dict(), "epoch": epoch, "step_in_epoch": step_in_epoch},
                   path + ".tmp")
        os.replace(path + ".tmp", path)


def load_model_only(path, model, optimizer, scheduler):
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    return state["epoch"], state["step_in_epoch"]


def save_without_scheduler(path, rank, model, optimizer, scheduler, epoch, step_in_epoch):
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "epoch": epoch, "step_in_epoch": step_in_epoch}, path + ".tmp")
        os.replace(path + ".tmp", path)


def load_without_scheduler(path, model, optimizer, scheduler):
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])  # "the LR is in the optimizer's param_groups"
    return state["epoch"], state["step_in_epoch"]


def save_on_every_rank(path, rank, model, optimizer, scheduler, epoch, step_in_epoch):
    tmp = f"{path}.{os.getpid()}.tmp"  # "each rank has its own temporary file, so it is safe"
    torch.save(_state(model, optimizer, scheduler, epoch, step_in_epoch), tmp)
    os.replace(tmp, path)


def load_without_map_location(path, model, optimizer, scheduler):
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return state["epoch"], state["step_in_epoch"]


def save_epoch_only(path, rank, model, optimizer, scheduler, epoch, step_in_epoch):
    if rank == 0:
        state = _state(model, optimizer, scheduler, epoch, step_in_epoch)
        del state["step_in_epoch"]  # "an epoch is the unit of training"
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)


def load_epoch_only(path, model, optimizer, scheduler):
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return state["epoch"], 0


def load_epoch_number(path, model, optimizer, scheduler):
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return state["epoch"]


def batches_from_epoch_start(loader, epoch, step_in_epoch):
    loader.sampler.set_epoch(epoch)
    return loader  # "the sampler knows where it was"


def batches_no_set_epoch_on_resume(loader, epoch, step_in_epoch):
    if step_in_epoch == 0:
        loader.sampler.set_epoch(epoch)
        return iter(loader)
    return itertools.islice(loader, step_in_epoch, None)  # resume: skip what was done


def batches_skip_one_more(loader, epoch, step_in_epoch):
    loader.sampler.set_epoch(epoch)
    skip = step_in_epoch + 1 if step_in_epoch else 0  # "the saved batch was done, start after it"
    return itertools.islice(loader, skip, None)


def load_unsafe(path, model, optimizer, scheduler):
    state = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return state["epoch"], state["step_in_epoch"]


def load_next_step(path, model, optimizer, scheduler):
    epoch, step = load_right(path, model, optimizer, scheduler)
    return epoch, step + 1


def load_returns_nothing(path, model, optimizer, scheduler):
    load_right(path, model, optimizer, scheduler)


def load_into_new_model(path, model, optimizer, scheduler):
    import copy

    state = torch.load(path, map_location="cpu", weights_only=True)
    copy.deepcopy(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return state["epoch"], state["step_in_epoch"]


def save_whole_objects(path, rank, model, optimizer, scheduler, epoch, step_in_epoch):
    if rank == 0:
        torch.save({"model": model, "optimizer": optimizer, "scheduler": scheduler,
                    "epoch": epoch, "step_in_epoch": step_in_epoch}, path + ".tmp")
        os.replace(path + ".tmp", path)


def save_to_other_name(path, rank, model, optimizer, scheduler, epoch, step_in_epoch):
    if rank == 0:
        torch.save(_state(model, optimizer, scheduler, epoch, step_in_epoch), path + ".tmp")


def save_with_named_temp_beside(path, rank, model, optimizer, scheduler, epoch, step_in_epoch):
    if rank != 0:
        return
    folder = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile(dir=folder, suffix=".tmp", delete=False) as f:
        try:
            torch.save(_state(model, optimizer, scheduler, epoch, step_in_epoch), f)
        except BaseException:
            f.close()
            os.unlink(f.name)
            raise
    os.replace(f.name, path)


def save_via_system_temp(path, rank, model, optimizer, scheduler, epoch, step_in_epoch):
    if rank != 0:
        return
    fd, tmp = tempfile.mkstemp(suffix=".pt")  # in /tmp, not beside `path`
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(_state(model, optimizer, scheduler, epoch, step_in_epoch), f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_via_system_temp_and_move(path, rank, model, optimizer, scheduler, epoch, step_in_epoch):
    if rank != 0:
        return
    fd, tmp = tempfile.mkstemp(suffix=".pt")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(_state(model, optimizer, scheduler, epoch, step_in_epoch), f)
        shutil.move(tmp, path)  # "move works across filesystems"
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_leaves_temp_on_failure(path, rank, model, optimizer, scheduler, epoch, step_in_epoch):
    if rank == 0:
        tmp = path + ".tmp"
        torch.save(_state(model, optimizer, scheduler, epoch, step_in_epoch), tmp)
        os.replace(tmp, path)


def save_leaves_new_temp_each_failure(path, rank, model, optimizer, scheduler, epoch, step_in_epoch):
    if rank != 0:
        return
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")  # "a fresh name: two saves never collide"
    with os.fdopen(fd, "wb") as f:
        torch.save(_state(model, optimizer, scheduler, epoch, step_in_epoch), f)
    os.replace(tmp, path)


def save_leaves_pid_temp(path, rank, model, optimizer, scheduler, epoch, step_in_epoch):
    if rank == 0:
        tmp = f"{path}.{os.getpid()}.tmp"
        torch.save(_state(model, optimizer, scheduler, epoch, step_in_epoch), tmp)
        os.replace(tmp, path)


def save_swallows_errors(path, rank, model, optimizer, scheduler, epoch, step_in_epoch):
    if rank != 0:
        return
    tmp = path + ".tmp"
    try:
        torch.save(_state(model, optimizer, scheduler, epoch, step_in_epoch), tmp)
        os.replace(tmp, path)
    except Exception as e:  # "a failed checkpoint must not stop training"
        print("checkpoint failed:", e)
        if os.path.exists(tmp):
            os.unlink(tmp)


@pytest.mark.parametrize("save, load, batches", [
    (save_right, load_right, batches_right),
    (save_with_named_temp_beside, load_as_list, batches_by_skipping),
], ids=["islice", "named_temp_list_generator"])
def test_resumable_accepts_a_resume_in_the_middle_of_an_epoch(save, load, batches, capsys,
                                                              no_leftover_processes):
    check_resumable(save, load, batches)
    out = capsys.readouterr().out
    assert "a crash during a save keeps the previous checkpoint" in out
    assert "trained on exactly the uninterrupted run's batches" in out
    assert "final model bit-identical to the uninterrupted run's" in out
    assert "[PASS] 06.b resumable training" in out


def batches_whole_loader(loader, epoch, step_in_epoch):
    return loader  # "the loader knows where it was"


# Each misconception of 06.b's catalogue: (save, load, batches) with the wrong piece of the same
# name, and what the failure says.
WRONG_B = {
    "save_in_place": (save_in_place, load_right, batches_right,
                      r"a crash in the middle of a save destroyed the previous checkpoint"),
    "save_model_only": (save_model_only, load_model_only, batches_right,
                        r"the optimizer has no state: Adam's moments"),
    "save_without_scheduler": (save_without_scheduler, load_without_scheduler, batches_right,
                               r"LR scheduler counts 0 steps.*saved one 3.*scheduler\.state_dict\(\)"),
    "save_on_every_rank": (save_on_every_rank, load_right, batches_right,
                           r"rank=1, \.\.\.\) wrote .*They race.*saving on every rank to the same "
                           r"path.*`if rank != 0: return`"),
    "load_without_map_location": (save_right, load_without_map_location, batches_right,
                                  r"saved on a GPU machine cannot be loaded here.*"
                                  r"torch\.load without map_location"),
    "load_epoch_only": (save_epoch_only, load_epoch_only, batches_right,
                        r"saved at \(2, 3\), load_checkpoint returned \(2, 0\): resuming at the start "
                        r"of epoch 2"),
    "load_epoch_number": (save_right, load_epoch_number, batches_right,
                          r"returned only the epoch \(2\).*train its first 3 batches a second time"),
    "load_unsafe": (save_right, load_unsafe, batches_right, r"ran the code hidden in it.*weights_only=True"),
    "load_into_new_model": (save_right, load_into_new_model, batches_right,
                            r"parameters after load_checkpoint differ"),
    "save_whole_objects": (save_whole_objects, load_right, batches_right,
                           r"cannot be read with torch.load\(\.\.\., weights_only=True\)"),
    "save_via_system_temp": (save_via_system_temp, load_right, batches_right,
                             r"another filesystem than the checkpoint.*EXDEV.*dir="),
    "save_via_system_temp_and_move": (save_via_system_temp_and_move, load_right, batches_right,
                                      r"another filesystem.*shutil\.move falls back to a copy, which is "
                                      r"not atomic"),
    "save_leaves_temp_on_failure": (save_leaves_temp_on_failure, load_right, batches_right,
                                    r"a save that failed left \['ckpt\.pt\.tmp'\]"),
    "save_leaves_new_temp_each_failure": (save_leaves_new_temp_each_failure, load_right, batches_right,
                                          r"two saves that failed left \['tmp\w+\.tmp', 'tmp\w+\.tmp'\]"
                                          r".*every failed save leaves one more"),
    "save_swallows_errors": (save_swallows_errors, load_right, batches_right,
                             r"save_checkpoint returned normally.*re-raise"),
    # The distributed half: the resumed run must train on exactly the batches still due.
    "batches_from_epoch_start": (save_right, load_right, batches_from_epoch_start,
                                 r"(?s)resumed from \(epoch, step_in_epoch\) = \(1, 2\).*began epoch 1 "
                                 r"again from its first batch.*trained twice.*resuming at the start "
                                 r"of the epoch.*islice"),
    "batches_no_set_epoch_on_resume": (save_right, load_right, batches_no_set_epoch_on_resume,
                                       r"(?s)its batches of epoch 1 are those of epoch 0.*forgetting "
                                       r"set_epoch on resume"),
    "batches_skip_one_more": (save_right, load_right, batches_skip_one_more,
                              r"(?s)1 batch\(es\) were never trained on.*skip exactly step_in_epoch"),
    "batches_whole_loader": (save_right, load_right, batches_whole_loader,
                             r"(?s)those of epoch 0.*forgetting set_epoch.*began at batch 0 of the epoch, "
                             r"not at batch 2"),
}


@pytest.mark.parametrize("mistake, wrong", cases(b_resumable.CATALOGUE, WRONG_B))
def test_resumable_rejects_usual_mistakes(mistake, wrong, no_leftover_processes):
    save, load, batches, message = wrong
    with pytest.raises(CheckFailed, match=message) as info:
        check_resumable(save, load, batches)
    assert mistake.message in info.value.args[0]


@pytest.mark.parametrize("save, load, message", [
    (save_right, load_next_step, r"saved at \(epoch, step_in_epoch\) = \(2, 3\), load_checkpoint "
                                 r"returned \(2, 4\)"),
    (save_right, load_returns_nothing, r"load_checkpoint returned None"),
    (save_to_other_name, load_right, r"left no file at `path`"),
    (None, load_right, r"expected save_checkpoint.*got None"),
])
def test_resumable_rejects_answers_that_break_the_contract(save, load, message):
    with pytest.raises(CheckFailed, match=message):
        check_resumable(save, load, batches_right)


def test_resumable_names_what_a_left_temporary_file_costs():
    """A fixed name is overwritten by the next save (nothing piles up); a name with the process id
    is not, since a restarted job has another one."""
    with pytest.raises(CheckFailed, match=r"left \['ckpt\.pt\.tmp'\].*Its name is fixed, so the next "
                                          r"save overwrites it and no more pile up") as info:
        check_resumable(save_leaves_temp_on_failure, load_right, batches_right)
    assert "leaves one more" not in info.value.args[0]
    with pytest.raises(CheckFailed, match=r"left \['ckpt\.pt\.\d+\.tmp'\].*Its name holds the process "
                                          r"id.*every job whose save fails leaves one more"):
        check_resumable(save_leaves_pid_temp, load_right, batches_right)


def test_resumable_compares_the_killed_runs_final_state(no_leftover_processes):
    """An answer that passes the one-process part but drops Adam's state while training (only
    when a process group exists) is caught by the final comparison of the killed-and-resumed run."""

    def save_no_optimizer_in_training(path, rank, model, optimizer, scheduler, epoch, step_in_epoch):
        state = _state(model, optimizer, scheduler, epoch, step_in_epoch)
        if dist.is_initialized():
            del state["optimizer"]
        if rank == 0:
            try:
                torch.save(state, path + ".tmp")
                os.replace(path + ".tmp", path)
            except BaseException:
                os.unlink(path + ".tmp")
                raise

    def load_what_is_there(path, model, optimizer, scheduler):
        state = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        if "optimizer" in state:
            optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        return state["epoch"], state["step_in_epoch"]

    with pytest.raises(CheckFailed, match=r"(?s)the model of the run that was killed at global step "
                                          r"10 and resumed from \(1, 2\) differs.*optimizer or the "
                                          r"LR scheduler state"):
        check_resumable(save_no_optimizer_in_training, load_what_is_there, batches_right)


def test_resumable_stub_is_not_done_yet():
    def stub(*args):
        raise NotImplementedError("Exercise 06.b resumable training: replace this line with your code")

    with pytest.raises(CheckFailed, match=r"not done yet.*06\.b resumable training"):
        check_resumable(stub, stub, stub)
