"""Checkers of chapter 06 (multi-node training with torchrun).

- ``check_launch_commands(make_commands)``: ``make_commands(master_addr, port, job_id, script,
  script_args)`` returns ``{"node0": argv, "node1": argv}``, the torchrun command of each machine
  of the cluster the exercise describes. The arguments are first read with torchrun's own parser
  (fast, precise messages), then both commands run for real as two simulated nodes on this
  machine, and every worker's environment is compared with what the cluster needs.
- ``check_resumable(save_checkpoint, load_checkpoint)``: the two functions must make training
  resumable. Checked in one process (what is saved and restored, a crash in the middle of a save,
  ``weights_only``), then for real: two DDP workers train, rank 1 is killed with SIGKILL
  mid-run, a second launch resumes from the checkpoint, and the final model must equal an
  uninterrupted run's.

Misconceptions recognised (tests/test_ch06_checks.py, the wrong answer in brackets).
06.a: "--nproc_per_node is the number of GPUs in the cluster" [commands_total_gpus]; "--nnodes counts
GPUs" [commands_nnodes_is_gpus]; a rendezvous id per node [commands_id_per_node]; localhost as the
endpoint on every node [commands_localhost_everywhere]; ``--standalone`` on a cluster
[commands_standalone]; no restarts [commands_no_restart]; script arguments before the script
[commands_args_before_script]; a command that is one string [commands_one_string].
06.b: torch.save straight onto the checkpoint [save_in_place]; the model without the optimizer
[save_model_only]; loading with weights_only=False [load_unsafe]; returning step + 1
[load_next_step]; loading into a copy [load_into_new_model]; whole objects saved
[save_whole_objects]; a temporary file in /tmp, renamed across filesystems [save_via_system_temp,
save_via_system_temp_and_move]; a failed save that leaves its temporary file
[save_leaves_temp_on_failure] or hides its error [save_swallows_errors].  Accepted: a temporary
name beside the checkpoint, or tempfile.NamedTemporaryFile(dir=that folder).
"""

from __future__ import annotations

import contextlib
import errno
import gc
import io
import json
import os
import shlex
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.run import get_args_parser
from torch.nn.parallel import DistributedDataParallel as DDP

from ..checking import CheckFailed, checker, diff_table, format_table, require_callable, run_workers
from ..data import make_dataset, make_model
from ..devices import backend_and_device, process_group_kwargs
from ..workers.commands import run_commands
from ..workers.supervisor import WorkerError, free_port, launch

__all__ = ["check_launch_commands", "check_resumable"]

# --------------------------------------------------------------------------------------------
# 06.a launch commands
# --------------------------------------------------------------------------------------------

NODES = ("node0", "node1")
GPUS_PER_NODE = 2
RUN_TIMEOUT = 90.0

# What every simulated worker prints: its environment and the result of one all_reduce.
_PROBE = r'''
import json, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
keys = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
        "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID")
info = {k: os.environ.get(k) for k in keys}
info["sum"] = t.item()
sys.stdout.write("PROBE " + json.dumps(info) + "\n")  # one write: lines of two workers never mix
sys.stdout.flush()
dist.barrier()
dist.destroy_process_group()
'''


def _torchrun_parser():

    return get_args_parser()


def _parse(name: str, argv: Any, script: str) -> Any:
    """torchrun's own reading of one node's command, or CheckFailed saying what is wrong."""
    if argv is None:
        raise CheckFailed(f"the command for {name} is None (a missing `return`?)")
    if isinstance(argv, str):
        raise CheckFailed(
            f"the command for {name} is one string ({argv[:60]!r}...); give a list of arguments, "
            "as subprocess does: [sys.executable, '-m', 'torch.distributed.run', '--nnodes=2', ...]")
    if not isinstance(argv, (list, tuple)) or not all(isinstance(a, (str, int)) for a in argv):
        raise CheckFailed(f"the command for {name} must be a list of strings, got "
                          f"{type(argv).__name__}")
    argv = [str(a) for a in argv]
    head = [sys.executable, "-m", "torch.distributed.run"]
    if argv[:3] != head:
        raise CheckFailed(
            f"the command for {name} starts with {shlex.join(argv[:3])!r}; start it with "
            "[sys.executable, '-m', 'torch.distributed.run'] (torchrun itself, run by this "
            "notebook's Python, so that every node uses the same torch)")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = _torchrun_parser().parse_args(argv[3:])
    except SystemExit:
        msg = err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "?"
        hint = (" (the script's own arguments go after the script's name; before it, torchrun "
                "takes them for its options)" if "unrecognized arguments" in msg else "")
        raise CheckFailed(f"torchrun cannot read the command for {name}: {msg}{hint}") from None
    if args.training_script != script:
        raise CheckFailed(
            f"{name} runs {args.training_script!r} as the training script; expected the "
            f"`script` argument ({script!r}) after all of torchrun's options")
    return args


def _static_checks(cmds: Any, master_addr: str, port: int, job_id: str, script: str,
                   script_args: list[str]) -> None:
    if not isinstance(cmds, dict):
        raise CheckFailed(f"expected a dict {{'node0': [...], 'node1': [...]}}, got "
                          f"{type(cmds).__name__}")
    if sorted(cmds) != list(NODES):
        raise CheckFailed(f"expected the keys {list(NODES)}, got {sorted(map(str, cmds))}")
    parsed = {n: _parse(n, cmds[n], script) for n in NODES}
    endpoint = f"{master_addr}:{port}"
    for n, a in parsed.items():
        if a.standalone:
            raise CheckFailed(
                f"{n} uses --standalone: that makes a private rendezvous on a random local port, "
                "for one machine only; the two nodes would never find each other. Use "
                "--rdzv_backend=c10d with --rdzv_endpoint on node0")
        if str(a.nnodes) not in ("2", "2:2"):
            raise CheckFailed(
                f"{n} has --nnodes={a.nnodes}; the cluster has 2 machines (--nnodes counts "
                "machines, that is torchrun agents, not GPUs)")
        if str(a.nproc_per_node) != str(GPUS_PER_NODE):
            raise CheckFailed(
                f"{n} has --nproc_per_node={a.nproc_per_node}; it counts the worker processes "
                f"on ONE machine, one per GPU: {GPUS_PER_NODE}. torchrun computes the world size "
                "(nnodes x nproc_per_node) itself")
        if a.rdzv_backend != "c10d":
            raise CheckFailed(f"{n} has --rdzv_backend={a.rdzv_backend}; the exercise asks for "
                              "the c10d rendezvous (no extra service, hosted by node0's agent)")
        if a.rdzv_endpoint != endpoint:
            raise CheckFailed(
                f"{n} has --rdzv_endpoint={a.rdzv_endpoint!r}; expected {endpoint!r}. Every node "
                "points at the same place, node0's address and the agreed port (on node1, "
                "'localhost' would be node1 itself)")
        if a.max_restarts != 1:
            raise CheckFailed(f"{n} has --max-restarts={a.max_restarts}; the job must survive "
                              "one failure: --max-restarts=1")
        if list(a.training_script_args) != [str(s) for s in script_args]:
            raise CheckFailed(
                f"{n} passes {a.training_script_args} to the script; expected script_args "
                f"{list(script_args)} after the script (arguments before it go to torchrun)")
    ids = {n: a.rdzv_id for n, a in parsed.items()}
    if len(set(ids.values())) != 1:
        raise CheckFailed(
            f"the nodes use different --rdzv_id ({ids}); the agents would each wait in a "
            "rendezvous of their own until the join timeout (600 s by default). Use the same job "
            "id on every node")
    if ids["node0"] != job_id:
        raise CheckFailed(f"--rdzv_id is {ids['node0']!r}; use the job id given ({job_id!r}), "
                          "so that two jobs on the same machines never join each other")


@checker("06.a launch commands")
def check_launch_commands(make_commands: Callable[..., dict]) -> None:
    require_callable(make_commands, "make_commands(master_addr, port, job_id, script, script_args)")

    # 1. The cluster of the exercise, read by torchrun's parser.
    args = ["--steps", "100"]
    cmds = make_commands("10.1.1.20", 29400, "bert-run-7", "train.py", list(args))
    _static_checks(cmds, "10.1.1.20", 29400, "bert-run-7", "train.py", args)

    # 2. The same function for two simulated nodes on this machine, run for real.
    with tempfile.TemporaryDirectory(prefix="check-06a-") as tmp:
        probe = os.path.join(tmp, "probe.py")
        Path(probe).write_text(_PROBE)
        port, job = free_port(), f"check-06a-{os.getpid()}"
        args = ["--steps", "4"]
        cmds = make_commands("127.0.0.1", port, job, probe, list(args))
        _static_checks(cmds, "127.0.0.1", port, job, probe, args)
        results = run_commands({n: [str(a) for a in cmds[n]] for n in NODES},
                               timeout=RUN_TIMEOUT, echo=False, cwd=tmp,
                               env={"OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"})
    for r in results:
        if not r.ok:
            why = "timed out" if r.timed_out else f"exited with code {r.returncode}"
            tail = "\n".join("    " + line for line in r.output.strip().splitlines()[-12:])
            raise CheckFailed(f"running the two nodes: {r.name} {why}; its last lines:\n{tail}")
    seen: dict[str, list[dict]] = {}
    for r in results:
        seen[r.name] = [json.loads(line[6:]) for line in r.output.splitlines()
                        if line.startswith("PROBE ")]
    workers = [w for ws in seen.values() for w in ws]
    if sorted(int(w["RANK"]) for w in workers) != [0, 1, 2, 3]:
        raise CheckFailed(f"expected 4 workers with RANK 0..3, got ranks "
                          f"{sorted(w['RANK'] for w in workers)}")
    for name, ws in seen.items():
        if len(ws) != GPUS_PER_NODE:
            raise CheckFailed(f"{name} started {len(ws)} workers, expected {GPUS_PER_NODE}")
        groups = {w["GROUP_RANK"] for w in ws}
        if len(groups) != 1:
            raise CheckFailed(f"the workers of {name} report different node ranks {groups}")
        for w in ws:
            if (w["WORLD_SIZE"], w["LOCAL_WORLD_SIZE"], w["TORCHELASTIC_MAX_RESTARTS"]) != ("4", "2", "1"):
                raise CheckFailed(
                    f"rank {w['RANK']} on {name} got WORLD_SIZE={w['WORLD_SIZE']}, "
                    f"LOCAL_WORLD_SIZE={w['LOCAL_WORLD_SIZE']}, TORCHELASTIC_MAX_RESTARTS="
                    f"{w['TORCHELASTIC_MAX_RESTARTS']}; expected 4, 2 and 1")
            if w["sum"] != 6.0:
                raise CheckFailed(f"rank {w['RANK']}: all_reduce of the ranks gave {w['sum']}, "
                                  "expected 0+1+2+3 = 6")
    if len({ws[0]["GROUP_RANK"] for ws in seen.values()}) != 2:
        raise CheckFailed("both nodes got the same node rank")
    print("  both nodes met in one rendezvous: 4 workers, RANK 0..3, WORLD_SIZE 4, "
          "2 per node, one restart allowed")


# --------------------------------------------------------------------------------------------
# 06.b resumable training
# --------------------------------------------------------------------------------------------

STEPS = 12          # steps of the distributed run
SAVE_EVERY = 3      # rank 0 saves after steps 3, 6, 9, 12
KILL_AT = 7         # rank 1 is killed (SIGKILL) at the start of this step in the first attempt
ATOL = 1e-6         # CPU runs are bit-identical; a GPU may reorder a reduction


class _ExplodesWhenSaved:
    """Put into the state being saved: pickling it fails, like a crash in the middle of a save."""

    def __reduce__(self):
        raise RuntimeError("simulated crash in the middle of writing the checkpoint")


class _RunsCodeWhenLoaded:
    """Unpickling this calls open(marker, "w"): it proves that a loader ran pickled code."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _planted_checkpoint(path: str, marker: str) -> None:
    """A checkpoint that creates ``marker`` when loaded with weights_only=False."""
    torch.save({"model": {}, "optimizer": {}, "step": 0, "extra": _RunsCodeWhenLoaded(marker)},
               path)


def _train_some(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:

    x, y = make_dataset(256, seed=seed).tensors
    for s in range(steps):
        rows = slice(32 * s, 32 * (s + 1))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        opt.step()


def _opt_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of an optimizer's state, by a readable name ('param 0 exp_avg', ...)."""
    out = {}
    for i, (_, state) in enumerate(sorted(opt.state_dict()["state"].items())):
        for k, v in state.items():
            out[f"param {i} {k}"] = torch.as_tensor(v).detach().cpu().clone()
    return out


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _single_process_checks(save_fn: Callable, load_fn: Callable, tmp: str) -> bool:

    path = os.path.join(tmp, "ckpt.pt")
    model = make_model(seed=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train_some(model, opt, 3, seed=0)

    # a. Save, then load into a fresh model and a fresh optimizer.
    save_fn(path, model, opt, 7)
    if not os.path.exists(path):
        left = os.listdir(tmp)
        raise CheckFailed(f"save_checkpoint(path, ...) left no file at `path` "
                          f"(the folder holds {left}); did the final rename happen?")
    try:
        torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckFailed(
            "the checkpoint cannot be read with torch.load(..., weights_only=True): "
            f"{' '.join(str(e).split())[:200]}. Save state_dicts and plain numbers, not objects "
            "(not the model, not the optimizer itself)") from None
    fresh = make_model(seed=2)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    step = load_fn(path, fresh, fresh_opt)
    if step is None:
        raise CheckFailed("load_checkpoint returned None; return the step stored in the "
                          "checkpoint (7 here), where training continues")
    if not isinstance(step, int) or isinstance(step, bool):
        raise CheckFailed(f"load_checkpoint returned {step!r} ({type(step).__name__}); return "
                          "the stored step as an int")
    if step != 7:
        raise CheckFailed(f"saved at step 7, load_checkpoint returned {step}; return the step "
                          "exactly as saved (the loop continues with that step)")
    rows = diff_table(_state(model), _state(fresh))
    if any(d != 0 for _, d, _ in rows):
        raise CheckFailed("the model's parameters after load_checkpoint differ from the saved "
                          "ones:\n" + format_table(rows, 0.0) +
                          "\nUsual mistake: loading into a new model instead of calling "
                          "model.load_state_dict on the one passed in")
    expected, got = _opt_tensors(opt), _opt_tensors(fresh_opt)
    if not got:
        raise CheckFailed(
            "after load_checkpoint the optimizer has no state: Adam's moments (exp_avg, "
            "exp_avg_sq) and step counts are lost, so the resumed run takes different steps. "
            "Usual mistake: saving only model.state_dict(); save optimizer.state_dict() too and "
            "restore it with optimizer.load_state_dict")
    rows = diff_table(expected, got)
    if any(d != 0 for _, d, _ in rows):
        raise CheckFailed("the optimizer's state after load_checkpoint differs from the saved "
                          "one:\n" + format_table(rows, 0.0))

    # b. A crash in the middle of the next save must leave the step-7 checkpoint readable.
    opt.param_groups[0]["crash_during_save"] = _ExplodesWhenSaved()
    raised = False
    try:
        save_fn(path, model, opt, 8)
    except Exception:
        raised = True  # expected: the save failed
    finally:
        del opt.param_groups[0]["crash_during_save"]
    left_behind = sorted(set(os.listdir(tmp)) - {"ckpt.pt"})
    try:
        torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckFailed(
            "a crash in the middle of a save destroyed the previous checkpoint: afterwards "
            f"torch.load says {' '.join(str(e).split())[:160]!r}. Usual mistake: torch.save "
            "straight to `path`, which empties the old file first. Write to a temporary file in "
            "the same folder, then os.replace(tmp, path)") from None
    again = load_fn(path, make_model(seed=2), torch.optim.Adam(make_model(seed=2).parameters()))
    if again != 7:
        raise CheckFailed(f"after a save that crashed, load_checkpoint returned step {again}; "
                          "the previous checkpoint (step 7) should still be there, untouched")
    if not raised:
        raise CheckFailed(
            "torch.save raised inside save_checkpoint (a simulated crash in the middle of the "
            "write), but save_checkpoint returned normally: the training loop then believes step 8 "
            "is saved. Clean up and re-raise (`except BaseException: os.unlink(tmp); raise`).")
    if left_behind:
        raise CheckFailed(
            f"a save that failed left {left_behind} beside the checkpoint; every crashed save would "
            "leave one more. Remove the temporary file when the save fails (`except "
            "BaseException: os.unlink(tmp); raise`).")
    other_fs = _check_other_filesystem(save_fn, model, opt)

    # c. weights_only: a planted file must not run code when loaded.
    planted, marker = os.path.join(tmp, "planted.pt"), os.path.join(tmp, "code_ran")
    _planted_checkpoint(planted, marker)
    try:
        load_fn(planted, make_model(seed=3),
                torch.optim.Adam(make_model(seed=3).parameters(), lr=1e-2))
    except Exception:
        pass  # refusing the file is the right outcome
    if os.path.exists(marker):
        raise CheckFailed(
            "loading a planted checkpoint ran the code hidden in it: load_checkpoint unpickles "
            "arbitrary objects. Load with torch.load(path, map_location=..., weights_only=True), "
            "which accepts tensors and plain containers only")
    return other_fs


_CROSS_FS = ("the temporary file was created on another filesystem than the checkpoint ({src} -> "
             "{dst}). A rename cannot cross filesystems: os.replace fails with EXDEV (\"Invalid "
             "cross-device link\"), and shutil.move falls back to a copy, which is not atomic. "
             "Usual mistake: tempfile.NamedTemporaryFile() or mkstemp() without dir=, which puts "
             "the file in /tmp. Create it in the checkpoint's folder: "
             "tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path))).")


def _check_other_filesystem(save_fn: Callable, model: torch.nn.Module, opt) -> bool:
    """Save into a folder on another filesystem than the temp folder (/dev/shm, a tmpfs).

    Returns whether this machine had such a second filesystem to try.
    """
    shm = "/dev/shm"
    if not os.path.isdir(shm) or os.stat(shm).st_dev == os.stat(tempfile.gettempdir()).st_dev:
        return False  # no second filesystem here: nothing to learn from this part
    renames: list[tuple[str, str]] = []
    real = {"replace": os.replace, "rename": os.rename}

    def recording(name: str) -> Callable:
        def f(src, dst, *args, **kwargs):
            renames.append((os.fspath(src), os.fspath(dst)))
            return real[name](src, dst, *args, **kwargs)
        return f

    with tempfile.TemporaryDirectory(prefix="check-06b-", dir=shm) as other:
        target = os.path.join(other, "ckpt.pt")
        os.replace, os.rename = recording("replace"), recording("rename")
        try:
            save_fn(target, model, opt, 9)
        except OSError as e:
            if e.errno != errno.EXDEV:
                raise
            src = renames[-1][0] if renames else "?"
            raise CheckFailed(_CROSS_FS.format(src=src, dst=target)) from None
        finally:
            os.replace, os.rename = real["replace"], real["rename"]
        for src, dst in renames:
            src_dir = os.path.dirname(os.path.abspath(src))
            dst_dir = os.path.dirname(os.path.abspath(dst))
            if os.path.isdir(src_dir) and os.stat(src_dir).st_dev != os.stat(dst_dir).st_dev:
                raise CheckFailed(_CROSS_FS.format(src=src, dst=dst))
    return True


def _resumable_worker(save_fn: Callable, load_fn: Callable, path: str, attempt: int,
                      kill_at: int) -> dict:
    """Train the course model with DDP; rank 1 dies at ``kill_at`` in attempt 0."""


    backend, device = backend_and_device()
    dist.init_process_group(**process_group_kwargs(backend, device))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(seed=0).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    start = 0
    if os.path.exists(path):
        start = load_fn(path, model, opt)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    x, y = make_dataset(2048, seed=0).tensors
    for step in range(start, STEPS):
        if attempt == 0 and step == kill_at and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # no exception, no clean-up: the process is gone
        g = torch.Generator().manual_seed(step)  # the batch depends on the step alone
        rows = torch.randperm(len(x), generator=g)[:64][rank::world]
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x[rows].to(device)), y[rows].to(device)).backward()
        opt.step()
        if (step + 1) % SAVE_EVERY == 0 and rank == 0:
            save_fn(path, model, opt, step + 1)
        dist.barrier()  # a checkpoint is complete before any rank passes it
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    del ddp  # the reducer holds the process group; release it before destroying the group
    gc.collect()
    dist.destroy_process_group()
    return {"start": start, "state": state}


def _compare_resumed_run(save_fn: Callable, load_fn: Callable, tmp: str) -> None:
    """Uninterrupted run vs. a run whose rank 1 is killed and then resumed."""

    quiet = {"OMP_NUM_THREADS": "1"}
    ref = run_workers(_resumable_worker, 2, args=(save_fn, load_fn, os.path.join(tmp, "ref.pt"), 0, -1),
                      timeout=120, env=quiet)
    path = os.path.join(tmp, "resumed.pt")
    try:
        launch(_resumable_worker, 2, args=(save_fn, load_fn, path, 0, KILL_AT), timeout=120,
               env=quiet, display=None)
        raise CheckFailed(f"rank 1 should have been killed at step {KILL_AT}, but the run finished")
    except WorkerError as e:
        if 1 not in e.failed_ranks or e.failures[1].kind != "signal":
            raise CheckFailed(f"the first attempt failed in an unexpected way:\n{e}") from None
    if not os.path.exists(path):
        raise CheckFailed("after the first attempt there is no checkpoint to resume from")
    resumed = run_workers(_resumable_worker, 2, args=(save_fn, load_fn, path, 1, KILL_AT),
                          timeout=120, env=quiet)
    last_saved = (KILL_AT // SAVE_EVERY) * SAVE_EVERY
    for rank, out in enumerate(resumed):
        if out["start"] != last_saved:
            raise CheckFailed(f"rank {rank} resumed at step {out['start']}; the last checkpoint "
                              f"before the kill at step {KILL_AT} was written after step "
                              f"{last_saved}")
    rows = diff_table(ref[0]["state"], resumed[0]["state"])
    worst = max(d for _, d, _ in rows)
    if worst > ATOL or worst != worst:
        raise CheckFailed(
            f"the model of the run that was killed at step {KILL_AT} and resumed from step "
            f"{last_saved} differs from the uninterrupted run's by up to {worst:.3g}:\n"
            + format_table(rows, ATOL) +
            "\nUsual mistakes: the optimizer state or the step not saved or not restored")
    exact = all(e for _, _, e in rows)
    print(f"  rank 1 killed (SIGKILL) at step {KILL_AT}; resumed from step {last_saved}; final "
          f"model {'bit-identical to' if exact else f'within {worst:.1g} of'} the uninterrupted run's")


@checker("06.b resumable training")
def check_resumable(save_checkpoint: Callable, load_checkpoint: Callable) -> None:
    require_callable(save_checkpoint, "save_checkpoint(path, model, optimizer, step)")
    require_callable(load_checkpoint, "load_checkpoint(path, model, optimizer) -> step")
    with tempfile.TemporaryDirectory(prefix="check-06b-") as tmp:
        other_fs = _single_process_checks(save_checkpoint, load_checkpoint, tmp)
        print("  one process: model, optimizer and step restored; a crash during a save keeps "
              "the previous checkpoint, raises and leaves no temporary file; a planted file runs "
              "no code" + ("; a save onto another filesystem than the temp folder (/dev/shm) "
                           "renames within it" if other_fs else ""))
    with tempfile.TemporaryDirectory(prefix="check-06b-") as tmp:
        _compare_resumed_run(save_checkpoint, load_checkpoint, tmp)
