"""Checkers of chapter 06 (multi-node training with torchrun).

- ``check_launch_commands(make_commands)``: ``make_commands(master_addr, port, job_id, script,
  script_args)`` returns ``{"node0": argv, "node1": argv}``, the torchrun command of each machine
  of the cluster the exercise describes. The arguments are first read with torchrun's own parser
  (fast, precise messages), then both commands run for real as two simulated nodes on this
  machine, and every worker's environment is compared with what the cluster needs.
- ``check_resumable(save_checkpoint, load_checkpoint, epoch_batches)``: the three pieces of a
  training loop that survives a killed worker, in the middle of an epoch.  Checked in one process
  (what is saved and restored, only rank 0 writing, a crash in the middle of a save, a checkpoint
  written on a GPU machine, ``weights_only``), then for real: two DDP workers train 3 epochs of a
  ``DistributedSampler`` (Adam, StepLR), rank 1 is killed with SIGKILL in the middle of epoch 1, a
  second launch resumes from the checkpoint, and it must train on exactly the batches the
  uninterrupted run trained on from there (sample ids compared batch by batch: none repeated,
  none skipped), ending with the same model, optimizer state and learning rate.

Misconceptions recognised (tests/checkers/test_ch06_checks.py, the wrong answer in brackets).
06.a: "--nproc_per_node is the number of GPUs in the cluster" [commands_total_gpus]; "--nnodes counts
GPUs" [commands_nnodes_is_gpus]; a rendezvous id per node [commands_id_per_node]; localhost as the
endpoint on every node [commands_localhost_everywhere]; ``--standalone`` on a cluster
[commands_standalone]; no restarts [commands_no_restart]; script arguments before the script
[commands_args_before_script]; a command that is one string [commands_one_string].
06.b: torch.save straight onto the checkpoint [save_in_place]; the position without the optimizer
[save_model_only] or without the LR scheduler [save_without_scheduler]; every rank saving to the
same path [save_on_every_rank]; loading without map_location [load_without_map_location]; loading
with weights_only=False [load_unsafe]; "resume at the start of the epoch": only the epoch saved
[load_epoch_only, load_epoch_number], or the batches already done not skipped
[batches_from_epoch_start]; forgetting set_epoch on resume [batches_no_set_epoch_on_resume], or
both mistakes at once (the loader returned as it is); skipping one batch too many
[batches_skip_one_more]; loading into a copy [load_into_new_model]; whole objects saved
[save_whole_objects]; a temporary file in /tmp, renamed across filesystems [save_via_system_temp,
save_via_system_temp_and_move]; a failed save that leaves its temporary file
[save_leaves_temp_on_failure] or hides its error [save_swallows_errors].  Accepted: a temporary
name beside the checkpoint, or tempfile.NamedTemporaryFile(dir=that folder); the remaining
batches by itertools.islice or by a loop that skips them; the position as a tuple or a list.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import io
import itertools
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
from torch.utils.data import DataLoader, DistributedSampler

from ..checking import CheckFailed, checker, diff_table, format_table, require_callable, run_workers
from ..data import make_dataset, make_model
from ..devices import backend_and_device, process_group_kwargs
from ..diagnose import IndexedDataset
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

# The distributed run: 2 ranks, 96 samples, batches of 8 per rank, so 6 steps per epoch, 3 epochs.
# Adam (state that a resume must bring back) and StepLR (halves the LR every 5 steps).
N_SAMPLES, BATCH, EPOCHS = 96, 8, 3
STEPS_PER_EPOCH = N_SAMPLES // (2 * BATCH)
SAVE_EVERY = 4      # every rank calls save_checkpoint after global steps 4, 8, 12, 16
KILL_AT = 10        # rank 1 is killed (SIGKILL) before global step 10 (epoch 1, batch 4)
LR, LR_EVERY, LR_GAMMA = 3e-3, 5, 0.5
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
    torch.save({"model": {}, "optimizer": {}, "scheduler": {}, "epoch": 0, "step_in_epoch": 0,
                "extra": _RunsCodeWhenLoaded(marker)}, path)


def _saved_on_a_gpu(src: str, dst: str) -> None:
    """Rewrite the checkpoint ``src`` as a GPU machine would have written it, into ``dst``.

    Every storage is tagged with a GPU this machine lacks (``cuda:0`` without CUDA, else the GPU
    one past the last): ``torch.load`` without ``map_location`` fails on it, as it does on a CPU
    machine given a checkpoint saved from GPU tensors.  The old (non-zip) format keeps the tag as
    one short pickled string, so it can be replaced in place.
    """
    state = torch.load(src, map_location="cpu", weights_only=True)
    buf = io.BytesIO()
    torch.save(state, buf, _use_new_zipfile_serialization=False)
    tag = f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}".encode()
    raw = buf.getvalue().replace(b"X\x03\x00\x00\x00cpu", b"X" + len(tag).to_bytes(4, "little") + tag)
    Path(dst).write_bytes(raw)


def _setup(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    model = make_model(seed=seed)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=LR_EVERY, gamma=LR_GAMMA)


def _train_some(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: int,
                seed: int) -> None:
    x, y = make_dataset(256, seed=seed).tensors
    for s in range(steps):
        rows = slice(32 * s, 32 * (s + 1))
        opt.zero_grad()
        F.cross_entropy(model(x[rows]), y[rows]).backward()
        opt.step()
        sched.step()


def _opt_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of an optimizer's state, by a readable name ('param 0 exp_avg', ...)."""
    out = {}
    for i, (_, state) in enumerate(sorted(opt.state_dict()["state"].items())):
        for k, v in state.items():
            out[f"param {i} {k}"] = torch.as_tensor(v).detach().cpu().clone()
    return out


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _position(value: Any, saved: tuple[int, int]) -> tuple[int, int]:
    """``load_checkpoint``'s return value as (epoch, step_in_epoch), or CheckFailed."""
    e, s = saved
    if value is None:
        raise CheckFailed(f"load_checkpoint returned None; return (epoch, step_in_epoch) as saved "
                          f"({saved} here): where the training loop continues")
    if (not isinstance(value, (tuple, list)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
        if isinstance(value, int) and value == e:
            raise CheckFailed(
                f"load_checkpoint returned only the epoch ({value}): training would resume at the "
                f"start of epoch {e} and train its first {s} batches a second time (each of their "
                "samples seen twice). Save step_in_epoch too and return (epoch, step_in_epoch)")
        raise CheckFailed(f"load_checkpoint returned {value!r}; return the tuple (epoch, "
                          f"step_in_epoch) of two ints, as saved ({saved} here)")
    got = (int(value[0]), int(value[1]))
    if got == (e, 0) and s:
        raise CheckFailed(
            f"saved at {saved}, load_checkpoint returned {got}: resuming at the start of epoch {e} "
            f"trains its first {s} batches a second time (their samples seen twice, the model "
            "stepped twice on them). Save step_in_epoch and return it as saved")
    if got != (e, s):
        raise CheckFailed(f"saved at (epoch, step_in_epoch) = {saved}, load_checkpoint returned "
                          f"{got}; return them exactly as saved (the loop continues from there)")
    return got


def _single_process_checks(save_fn: Callable, load_fn: Callable, tmp: str) -> bool:
    path = os.path.join(tmp, "ckpt.pt")
    model, opt, sched = _setup(seed=1)
    _train_some(model, opt, sched, 3, seed=0)

    # a. Save on rank 0, then load into a fresh model, optimizer and scheduler.
    save_fn(path, 0, model, opt, sched, 2, 3)
    if not os.path.exists(path):
        left = os.listdir(tmp)
        raise CheckFailed(f"save_checkpoint(path, 0, ...) left no file at `path` "
                          f"(the folder holds {left}); did the final rename happen?")
    try:
        torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckFailed(
            "the checkpoint cannot be read with torch.load(..., weights_only=True): "
            f"{' '.join(str(e).split())[:200]}. Save state_dicts and plain numbers, not objects "
            "(not the model, not the optimizer itself)") from None
    fresh, fresh_opt, fresh_sched = _setup(seed=2)
    _position(load_fn(path, fresh, fresh_opt, fresh_sched), (2, 3))
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
            "Usual mistake: saving only the model and the position; save optimizer.state_dict() "
            "too and restore it with optimizer.load_state_dict")
    rows = diff_table(expected, got)
    if any(d != 0 for _, d, _ in rows):
        raise CheckFailed("the optimizer's state after load_checkpoint differs from the saved "
                          "one:\n" + format_table(rows, 0.0))
    want, have = sched.state_dict(), fresh_sched.state_dict()
    if (want["last_epoch"], want["_last_lr"]) != (have["last_epoch"], have["_last_lr"]):
        raise CheckFailed(
            f"after load_checkpoint the LR scheduler counts {have['last_epoch']} steps (learning "
            f"rate {have['_last_lr'][0]:g}), the saved one {want['last_epoch']} "
            f"({want['_last_lr'][0]:g}): a fresh scheduler decays the learning rate at other steps "
            "than the interrupted run would have. Usual mistake: saving the position but not "
            "scheduler.state_dict(); save it and restore it with scheduler.load_state_dict")

    # b. Only rank 0 writes: the loop calls save_checkpoint on every rank.
    other = os.path.join(tmp, "rank1", "ckpt.pt")
    os.makedirs(os.path.dirname(other))
    save_fn(other, 1, model, opt, sched, 2, 3)
    written = os.listdir(os.path.dirname(other))
    if written:
        raise CheckFailed(
            f"save_checkpoint(path, rank=1, ...) wrote {written}: the loop calls save_checkpoint "
            "on every rank, so every rank writes the same file at the same moment. They race: "
            "with a shared temporary name their writes interleave into a corrupt file, and with "
            "separate ones the same state is still written once per rank. Usual mistake: saving "
            "on every rank to the same path; "
            "write on rank 0 only (`if rank != 0: return`)")

    # c. A crash in the middle of the next save must leave the previous checkpoint readable.
    opt.param_groups[0]["crash_during_save"] = _ExplodesWhenSaved()
    raised = False
    try:
        save_fn(path, 0, model, opt, sched, 2, 4)
    except Exception:
        raised = True  # expected: the save failed
    finally:
        del opt.param_groups[0]["crash_during_save"]
    left_behind = sorted(set(os.listdir(tmp)) - {"ckpt.pt", "rank1"})
    try:
        torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckFailed(
            "a crash in the middle of a save destroyed the previous checkpoint: afterwards "
            f"torch.load says {' '.join(str(e).split())[:160]!r}. Usual mistake: torch.save "
            "straight to `path`, which empties the old file first. Write to a temporary file in "
            "the same folder, then os.replace(tmp, path)") from None
    again = load_fn(path, *_setup(seed=2))
    if tuple(again) != (2, 3):
        raise CheckFailed(f"after a save that crashed, load_checkpoint returned {again}; the "
                          "previous checkpoint (2, 3) should still be there, untouched")
    if not raised:
        raise CheckFailed(
            "torch.save raised inside save_checkpoint (a simulated crash in the middle of the "
            "write), but save_checkpoint returned normally: the training loop then believes "
            "this position is saved. Clean up and re-raise (`except BaseException: "
            "os.unlink(tmp); raise`).")
    if left_behind:
        raise CheckFailed(
            f"a save that failed left {left_behind} beside the checkpoint; every crashed save would "
            "leave one more. Remove the temporary file when the save fails (`except "
            "BaseException: os.unlink(tmp); raise`).")
    other_fs = _check_other_filesystem(save_fn, model, opt, sched)

    # d. A checkpoint written on a GPU machine, loaded here.
    gpu = os.path.join(tmp, "from-gpu.pt")
    _saved_on_a_gpu(path, gpu)
    try:
        load_fn(gpu, *_setup(seed=2))
    except RuntimeError as e:
        if "deserialize object on" not in str(e):
            raise
        raise CheckFailed(
            "a checkpoint saved on a GPU machine cannot be loaded here: torch.load puts every "
            "tensor back on the device it was saved from (the saving rank's GPU), which this "
            "machine lacks; on a GPU cluster every rank would load onto that one GPU. Usual "
            "mistake: torch.load without map_location. Load onto this rank's device: "
            "torch.load(path, map_location=next(model.parameters()).device, "
            "weights_only=True)") from None

    # e. weights_only: a planted file must not run code when loaded.
    planted, marker = os.path.join(tmp, "planted.pt"), os.path.join(tmp, "code_ran")
    _planted_checkpoint(planted, marker)
    try:
        load_fn(planted, *_setup(seed=3))
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


def _check_other_filesystem(save_fn: Callable, model: torch.nn.Module, opt, sched) -> bool:
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
            save_fn(target, 0, model, opt, sched, 2, 5)
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


def _reference_batches(loader: DataLoader, epoch: int, step_in_epoch: int):
    loader.sampler.set_epoch(epoch)
    return itertools.islice(loader, step_in_epoch, None)


def _resumable_worker(save_fn: Callable | None, load_fn: Callable | None,
                      batches_fn: Callable | None, path: str, attempt: int) -> dict:
    """Train with DDP for EPOCHS epochs; rank 1 dies before global step KILL_AT in attempt 0.

    ``batches_fn`` None is the reference: the checker's own loop, never saved nor interrupted.
    Returns where the run started, the sample ids of every batch it trained on (with their
    epoch and position), and the final model, optimizer state and learning rate.
    """
    backend, device = backend_and_device()
    dist.init_process_group(**process_group_kwargs(backend, device))
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt, sched = _setup(seed=0)
    model = model.to(device)
    start = (0, 0)
    if load_fn is not None and os.path.exists(path):
        start = tuple(load_fn(path, model, opt, sched))
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    dataset = IndexedDataset(make_dataset(N_SAMPLES, seed=0))
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    seen: list[tuple[int, int, list[int]]] = []
    first_epoch, first_step = start
    for epoch in range(first_epoch, EPOCHS):
        step = first_step if epoch == first_epoch else 0
        batches = (_reference_batches if batches_fn is None else batches_fn)(loader, epoch, step)
        for x, y, ids in batches:
            global_step = epoch * STEPS_PER_EPOCH + step
            if attempt == 0 and global_step == KILL_AT and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)  # no exception, no clean-up: the process is gone
            seen.append((epoch, step, ids.tolist()))
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(x.to(device)), y.to(device)).backward()
            opt.step()
            sched.step()
            step += 1
            if save_fn is not None and (global_step + 1) % SAVE_EVERY == 0:
                save_fn(path, rank, model, opt, sched, epoch, step)  # on every rank, as loops do
            dist.barrier()  # a checkpoint is complete before any rank passes it
    out = {"start": start, "seen": seen, "state": _state(model), "opt": _opt_tensors(opt),
           "lr": sched.get_last_lr()[0]}
    del ddp  # the reducer holds the process group; release it before destroying the group
    gc.collect()
    dist.destroy_process_group()
    return out


def _explain_samples(rank: int, got: list, ref: list, start: tuple[int, int]) -> str | None:
    """Why the resumed run's batches on ``rank`` differ from the uninterrupted run's, or None."""
    offset = start[0] * STEPS_PER_EPOCH + start[1]
    expected = ref[offset:]
    if [ids for *_, ids in got] == [ids for *_, ids in expected]:
        return None
    e, s = start
    epoch_start = ref[e * STEPS_PER_EPOCH][2]
    first = got[0][2] if got else []
    head = (f"rank {rank} resumed from (epoch, step_in_epoch) = {start}, but the batches it then "
            "trained on are not the ones the uninterrupted run trained on from there")
    if s and first == epoch_start:
        repeated = sorted(i for _, _, ids in ref[e * STEPS_PER_EPOCH:offset] for i in ids)
        return (f"{head}: it began epoch {e} again from its first batch, so the {len(repeated)} "
                f"samples of its first {s} batches (ids {repeated[:6]}...), trained before the "
                "checkpoint, were trained twice.\nUsual mistake: resuming at the start of the "
                "epoch. Skip the batches already done: itertools.islice(loader, step_in_epoch, "
                "None), after loader.sampler.set_epoch(epoch)")
    later = [k for k in range(offset + 1, len(ref)) if ref[k][2] == first]
    if later:
        skipped = later[0] - offset
        return (f"{head}: its first batch is the uninterrupted run's batch {ref[later[0]][1]} of "
                f"epoch {ref[later[0]][0]}, so {skipped} batch(es) were never trained on.\n"
                "Usual mistake: skipping one batch too many; skip exactly step_in_epoch batches")
    epoch0 = [ids for _, _, ids in ref[:STEPS_PER_EPOCH]]
    if e and first in epoch0:
        k = epoch0.index(first)
        also = ("" if k == s else f" It also began at batch {k} of the epoch, not at batch {s}: "
                "skip exactly step_in_epoch batches (itertools.islice(loader, step_in_epoch, None)).")
        return (f"{head}: its batches of epoch {e} are those of epoch 0 (the sampler still shuffles "
                "with epoch 0's seed).\nUsual mistake: forgetting set_epoch on resume. "
                "DistributedSampler shuffles with seed + epoch, and the epoch only changes when "
                "you call loader.sampler.set_epoch(epoch) before iterating: call it on the resumed "
                "epoch too, then skip the batches already done." + also)
    k = next((i for i, (a, b) in enumerate(zip(got, expected)) if a[2] != b[2]),
             min(len(got), len(expected)))
    where = (f"epoch {expected[k][0]}, batch {expected[k][1]}" if k < len(expected)
             else "the end of training")
    return (f"{head}: the first difference is at {where} ({len(got)} batches trained after the "
            f"resume, expected {len(expected)}).\nUsual mistake: the sampler's epoch or position "
            "not restored: call loader.sampler.set_epoch(epoch) every epoch, and on the resumed "
            "epoch skip the first step_in_epoch batches")


def _compare_resumed_run(save_fn: Callable, load_fn: Callable, batches_fn: Callable,
                         tmp: str) -> None:
    """Uninterrupted run vs. a run whose rank 1 is killed mid-epoch and then resumed."""
    quiet = {"OMP_NUM_THREADS": "1"}
    ref = run_workers(_resumable_worker, 2, args=(None, None, None, "", -1), timeout=120, env=quiet)
    path = os.path.join(tmp, "resumed.pt")
    args = (save_fn, load_fn, batches_fn, path)
    try:
        launch(_resumable_worker, 2, args=(*args, 0), timeout=120, env=quiet, display=None)
        raise CheckFailed(f"rank 1 should have been killed at global step {KILL_AT}, but the run "
                          "finished: did epoch_batches yield every batch of each epoch?")
    except WorkerError as e:
        if 1 not in e.failed_ranks or e.failures[1].kind != "signal":
            raise CheckFailed(f"the first attempt failed in an unexpected way:\n{e}") from None
    if not os.path.exists(path):
        raise CheckFailed("after the first attempt there is no checkpoint to resume from")
    resumed = run_workers(_resumable_worker, 2, args=(*args, 1), timeout=120, env=quiet)
    last = (KILL_AT // SAVE_EVERY) * SAVE_EVERY
    saved = (last // STEPS_PER_EPOCH, last % STEPS_PER_EPOCH)
    for rank, out in enumerate(resumed):
        if out["start"] != saved:
            raise CheckFailed(f"rank {rank} resumed at (epoch, step_in_epoch) = {out['start']}; the "
                              f"last checkpoint before the kill (global step {KILL_AT}) was written "
                              f"at {saved}")
    for rank in range(2):
        why = _explain_samples(rank, resumed[rank]["seen"], ref[rank]["seen"], saved)
        if why:
            raise CheckFailed(why)
    hint = ("\nUsual mistakes: the optimizer or the LR scheduler state not saved or not restored")
    for what, key in (("model", "state"), ("optimizer state", "opt")):
        rows = diff_table(ref[0][key], resumed[0][key])
        worst = max((d for _, d, _ in rows), default=float("inf"))
        if worst > ATOL or worst != worst:
            raise CheckFailed(
                f"the {what} of the run that was killed at global step {KILL_AT} and resumed from "
                f"{saved} differs from the uninterrupted run's by up to {worst:.3g}:\n"
                + format_table(rows, ATOL) + hint)
    if abs(ref[0]["lr"] - resumed[0]["lr"]) > 1e-12:
        raise CheckFailed(f"the resumed run ends with learning rate {resumed[0]['lr']:g}, the "
                          f"uninterrupted one with {ref[0]['lr']:g}" + hint)
    exact = all(e for _, _, e in diff_table(ref[0]["state"], resumed[0]["state"]))
    print(f"  rank 1 killed (SIGKILL) in epoch {KILL_AT // STEPS_PER_EPOCH}, batch "
          f"{KILL_AT % STEPS_PER_EPOCH}; resumed from (epoch, step_in_epoch) = {saved}: every rank "
          "trained on exactly the uninterrupted run's batches; final model "
          f"{'bit-identical to' if exact else 'within tolerance of'} the uninterrupted run's, "
          "optimizer state and learning rate equal")


@checker("06.b resumable training")
def check_resumable(save_checkpoint: Callable, load_checkpoint: Callable,
                    epoch_batches: Callable) -> None:
    """Check the three pieces of a resumable training loop, alone and in a killed-and-resumed run.

    ``save_checkpoint(path, rank, model, optimizer, scheduler, epoch, step_in_epoch)`` is called on
    every rank; ``load_checkpoint(path, model, optimizer, scheduler)`` returns ``(epoch,
    step_in_epoch)``; ``epoch_batches(loader, epoch, step_in_epoch)`` returns the batches of
    ``epoch`` that remain after the first ``step_in_epoch``.
    """
    require_callable(save_checkpoint, "save_checkpoint(path, rank, model, optimizer, scheduler, "
                                      "epoch, step_in_epoch)")
    require_callable(load_checkpoint, "load_checkpoint(path, model, optimizer, scheduler) -> "
                                      "(epoch, step_in_epoch)")
    require_callable(epoch_batches, "epoch_batches(loader, epoch, step_in_epoch)")
    with tempfile.TemporaryDirectory(prefix="check-06b-") as tmp:
        other_fs = _single_process_checks(save_checkpoint, load_checkpoint, tmp)
        print("  one process: model, optimizer, scheduler and position restored; only rank 0 "
              "writes; a crash during a save keeps the previous checkpoint, raises and leaves no "
              "temporary file; a GPU checkpoint loads here; a planted file runs no code"
              + ("; a save onto another filesystem than the temp folder (/dev/shm) renames within "
                 "it" if other_fs else ""))
    with tempfile.TemporaryDirectory(prefix="check-06b-") as tmp:
        _compare_resumed_run(save_checkpoint, load_checkpoint, epoch_batches, tmp)
