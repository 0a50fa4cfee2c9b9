"""06.b resumable training: a loop that survives a killed worker in the middle of an epoch.

``check_resumable(save_checkpoint, load_checkpoint, epoch_batches)``: the three pieces, checked in
one process (what is saved and restored, only rank 0 writing, a crash in the middle of a save, a
checkpoint written on a GPU machine, ``weights_only``), then for real: two DDP workers train 3
epochs of a ``DistributedSampler`` (Adam, StepLR), rank 1 is killed with SIGKILL in the middle of
epoch 1, a second launch resumes from the checkpoint, and it must train on exactly the batches the
uninterrupted run trained on from there (sample ids compared batch by batch: none repeated, none
skipped), ending with the same model, optimizer state and learning rate.

Accepted as well: a temporary name beside the checkpoint, or tempfile.NamedTemporaryFile(dir=that
folder); the remaining batches by itertools.islice or by a loop that skips them; the position as a
tuple or a list.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import signal
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from ...checking import (
    Catalogue,
    CheckFailed,
    Misconception,
    Outcome,
    checker,
    diff_table,
    format_table,
    judge,
    process_group,
    require_callable,
    run_workers,
    state_to_cpu,
)
from ...data import make_dataset
from ...diagnose import IndexedDataset
from ...workers.supervisor import WorkerError, launch
from .common import (
    ExplodesWhenSaved,
    opt_tensors,
    planted_checkpoint,
    saved_on_a_gpu,
    setup_training,
    train_some,
)

__all__ = ["CATALOGUE", "check_resumable"]

CATALOGUE = Catalogue(
    "06.b resumable training",
    Misconception(
        "save_in_place",
        "torch.save onto the checkpoint is safe",
        "a crash in the middle of a save leaves no readable checkpoint",
        "torch.save straight to `path`, which empties the old file first. Write to a temporary "
        "file in the same folder, then os.replace(tmp, path)"),
    Misconception(
        "save_model_only",
        "the model and the position are the state of training",
        "the optimizer has no state after load_checkpoint",
        "saving only the model and the position; save optimizer.state_dict() too and restore it "
        "with optimizer.load_state_dict"),
    Misconception(
        "save_without_scheduler",
        "the learning rate is the optimizer's business",
        "the LR scheduler's step count is not restored",
        "saving the position but not scheduler.state_dict(); save it and restore it with "
        "scheduler.load_state_dict"),
    Misconception(
        "save_on_every_rank",
        "every rank may save the checkpoint",
        "save_checkpoint(path, rank=1, ...) wrote a file",
        "saving on every rank to the same path; write on rank 0 only (`if rank != 0: return`)"),
    Misconception(
        "load_without_map_location",
        "a checkpoint loads anywhere",
        "a checkpoint saved on a GPU cannot be loaded on this machine",
        "torch.load without map_location. Load onto this rank's device: torch.load(path, "
        "map_location=next(model.parameters()).device, weights_only=True)"),
    Misconception(
        "load_unsafe",
        "a checkpoint is only data",
        "loading a planted file ran the code hidden in it",
        "Load with torch.load(path, map_location=..., weights_only=True), which accepts tensors "
        "and plain containers only"),
    Misconception(
        "load_epoch_only",
        "resume at the start of the epoch",
        "saved at (epoch, step), load_checkpoint returned (epoch, 0)",
        "Save step_in_epoch and return it as saved"),
    Misconception(
        "load_epoch_number",
        "the epoch is the position",
        "load_checkpoint returned the epoch alone",
        "Save step_in_epoch too and return (epoch, step_in_epoch)"),
    Misconception(
        "load_into_new_model",
        "load_checkpoint may build its own model",
        "the model passed in does not hold the saved parameters",
        "loading into a new model instead of calling model.load_state_dict on the one passed in"),
    Misconception(
        "save_whole_objects",
        "saving the objects is simpler than their state_dicts",
        "the checkpoint cannot be read with weights_only=True",
        "Save state_dicts and plain numbers, not objects (not the model, not the optimizer itself)"),
    Misconception(
        "save_via_system_temp",
        "any temporary file will do",
        "the rename from the temporary file crossed filesystems (EXDEV)",
        "A rename cannot cross filesystems: os.replace fails with EXDEV (\"Invalid cross-device "
        "link\")"),
    Misconception(
        "save_via_system_temp_and_move",
        "shutil.move renames anywhere",
        "the temporary file was moved from another filesystem",
        "shutil.move falls back to a copy, which is not atomic"),
    Misconception(
        "save_leaves_temp_on_failure",
        "a failed save cleans up after itself",
        "a temporary file is left beside the checkpoint after a save that failed",
        "Remove the temporary file when the save fails (`except BaseException: os.unlink(tmp); "
        "raise`)."),
    Misconception(
        "save_leaves_new_temp_each_failure",
        "a fresh temporary name for every save is safer, and what a failed save leaves does no harm",
        "after two failed saves, two temporary files lie beside the checkpoint",
        "a temporary name that changes from save to save is never overwritten: every failed save "
        "leaves one more half-written file as large as the checkpoint, until the disk is full"),
    Misconception(
        "save_swallows_errors",
        "a failed save should not stop training",
        "save_checkpoint returned normally although torch.save raised",
        "the training loop then believes this position is saved. Clean up and re-raise (`except "
        "BaseException: os.unlink(tmp); raise`)."),
    Misconception(
        "batches_from_epoch_start",
        "resume at the start of the epoch",
        "the resumed run began the epoch again from its first batch",
        "resuming at the start of the epoch. Skip the batches already done: "
        "itertools.islice(loader, step_in_epoch, None), after loader.sampler.set_epoch(epoch)"),
    Misconception(
        "batches_no_set_epoch_on_resume",
        "set_epoch is for the epochs that start",
        "the resumed epoch's batches are those of epoch 0",
        "forgetting set_epoch on resume. DistributedSampler shuffles with seed + epoch, and the "
        "epoch only changes when you call loader.sampler.set_epoch(epoch) before iterating: call it "
        "on the resumed epoch too, then skip the batches already done."),
    Misconception(
        "batches_skip_one_more",
        "skip the batch that was being trained too",
        "the resumed run's first batch is a later one than due",
        "skipping one batch too many; skip exactly step_in_epoch batches"),
    Misconception(
        "batches_whole_loader",
        "the loader knows where it was",
        "the resumed epoch's batches are those of epoch 0, from its first batch",
        "skip exactly step_in_epoch batches (itertools.islice(loader, step_in_epoch, None))."),
)
_hint = CATALOGUE.hint


# The distributed run: 2 ranks, 96 samples, batches of 8 per rank, so 6 steps per epoch, 3 epochs.
# Adam (state that a resume must bring back) and StepLR (halves the LR every 5 steps: common.py).
N_SAMPLES, BATCH, EPOCHS = 96, 8, 3
STEPS_PER_EPOCH = N_SAMPLES // (2 * BATCH)
SAVE_EVERY = 4      # every rank calls save_checkpoint after global steps 4, 8, 12, 16
KILL_AT = 10        # rank 1 is killed (SIGKILL) before global step 10 (epoch 1, batch 4)
ATOL = 1e-6         # CPU runs are bit-identical; a GPU may reorder a reduction


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
                "samples seen twice). " + _hint("load_epoch_number"))
        raise CheckFailed(f"load_checkpoint returned {value!r}; return the tuple (epoch, "
                          f"step_in_epoch) of two ints, as saved ({saved} here)")
    got = (int(value[0]), int(value[1]))
    if got == (e, 0) and s:
        raise CheckFailed(
            f"saved at {saved}, load_checkpoint returned {got}: resuming at the start of epoch {e} "
            f"trains its first {s} batches a second time (their samples seen twice, the model "
            "stepped twice on them). " + _hint("load_epoch_only"))
    if got != (e, s):
        raise CheckFailed(f"saved at (epoch, step_in_epoch) = {saved}, load_checkpoint returned "
                          f"{got}; return them exactly as saved (the loop continues from there)")
    return got


def _single_process_checks(save_fn: Callable, load_fn: Callable, tmp: str) -> bool:
    path = os.path.join(tmp, "ckpt.pt")
    model, opt, sched = setup_training(seed=1)
    train_some(model, opt, sched, 3, seed=0)

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
            f"{' '.join(str(e).split())[:200]}. " + _hint("save_whole_objects")) from None
    fresh, fresh_opt, fresh_sched = setup_training(seed=2)
    _position(load_fn(path, fresh, fresh_opt, fresh_sched), (2, 3))
    rows = diff_table(state_to_cpu(model), state_to_cpu(fresh))
    if any(d != 0 for _, d, _ in rows):
        raise CheckFailed("the model's parameters after load_checkpoint differ from the saved "
                          "ones:\n" + format_table(rows, 0.0) +
                          "\nUsual mistake: " + _hint("load_into_new_model"))
    expected, got = opt_tensors(opt), opt_tensors(fresh_opt)
    if not got:
        raise CheckFailed(
            "after load_checkpoint the optimizer has no state: Adam's moments (exp_avg, "
            "exp_avg_sq) and step counts are lost, so the resumed run takes different steps. "
            "Usual mistake: " + _hint("save_model_only"))
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
            "than the interrupted run would have. Usual mistake: " + _hint("save_without_scheduler"))

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
            "separate ones the same state is still written once per rank. Usual mistake: "
            + _hint("save_on_every_rank"))

    # c. A crash in the middle of the next save must leave the previous checkpoint readable.
    raised = False
    with _crashes_when_saved(opt):
        try:
            save_fn(path, 0, model, opt, sched, 2, 4)
        except Exception:
            raised = True  # expected: the save failed
    left_behind = sorted(set(os.listdir(tmp)) - {"ckpt.pt", "rank1"})
    try:
        torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckFailed(
            "a crash in the middle of a save destroyed the previous checkpoint: afterwards "
            f"torch.load says {' '.join(str(e).split())[:160]!r}. Usual mistake: "
            + _hint("save_in_place")) from None
    again = load_fn(path, *setup_training(seed=2))
    if tuple(again) != (2, 3):
        raise CheckFailed(f"after a save that crashed, load_checkpoint returned {again}; the "
                          "previous checkpoint (2, 3) should still be there, untouched")
    if not raised:
        raise CheckFailed(
            "torch.save raised inside save_checkpoint (a simulated crash in the middle of the "
            "write), but save_checkpoint returned normally: " + _hint("save_swallows_errors"))
    if left_behind:
        raise _leftover_problem(save_fn, path, model, opt, sched, left_behind)
    other_fs = _check_other_filesystem(save_fn, model, opt, sched)

    # d. A checkpoint written on a GPU machine, loaded here.
    gpu = os.path.join(tmp, "from-gpu.pt")
    saved_on_a_gpu(path, gpu)
    try:
        load_fn(gpu, *setup_training(seed=2))
    except RuntimeError as e:
        if "deserialize object on" not in str(e):
            raise
        raise CheckFailed(
            "a checkpoint saved on a GPU machine cannot be loaded here: torch.load puts every "
            "tensor back on the device it was saved from (the saving rank's GPU), which this "
            "machine lacks; on a GPU cluster every rank would load onto that one GPU. Usual "
            "mistake: " + _hint("load_without_map_location")) from None

    # e. weights_only: a planted file must not run code when loaded.
    planted, marker = os.path.join(tmp, "planted.pt"), os.path.join(tmp, "code_ran")
    planted_checkpoint(planted, marker)
    try:
        load_fn(planted, *setup_training(seed=3))
    except Exception:
        pass  # refusing the file is the right outcome
    if os.path.exists(marker):
        raise CheckFailed(
            "loading a planted checkpoint ran the code hidden in it: load_checkpoint unpickles "
            "arbitrary objects. " + _hint("load_unsafe"))
    return other_fs


def _cross_fs(src: str, dst: str) -> str:
    return (f"the temporary file was created on another filesystem than the checkpoint ({src} -> "
            f"{dst}). {_hint('save_via_system_temp')}, and {_hint('save_via_system_temp_and_move')}. "
            "Usual mistake: tempfile.NamedTemporaryFile() or mkstemp() without dir=, which puts "
            "the file in /tmp. Create it in the checkpoint's folder: "
            "tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path))).")


@contextlib.contextmanager
def _crashes_when_saved(opt: torch.optim.Optimizer) -> Iterator[None]:
    """The optimizer's state cannot be pickled while inside: a crash in the middle of a save."""
    opt.param_groups[0]["crash_during_save"] = ExplodesWhenSaved()
    try:
        yield
    finally:
        del opt.param_groups[0]["crash_during_save"]


def _leftover_problem(save_fn: Callable, path: str, model: torch.nn.Module, opt: torch.optim.Optimizer,
                      sched: Any, left: list[str]) -> CheckFailed:
    """What the files a failed save left beside the checkpoint cost: a second failed save shows
    whether their name is fixed (the next save overwrites them) or new every time (they pile up)."""
    folder = os.path.dirname(path)
    with _crashes_when_saved(opt), contextlib.suppress(Exception):
        save_fn(path, 0, model, opt, sched, 2, 4)
    after = sorted(set(os.listdir(folder)) - {"ckpt.pt", "rank1"})
    if len(after) > len(left):
        return CheckFailed(f"two saves that failed left {after} beside the checkpoint: "
                           + _hint("save_leaves_new_temp_each_failure") + ". "
                           + _hint("save_leaves_temp_on_failure"))
    if any(str(os.getpid()) in name for name in left):
        return CheckFailed(
            f"a save that failed left {left} beside the checkpoint. Its name holds the process id, "
            "which a restarted job changes, so every job whose save fails leaves one more: "
            + _hint("save_leaves_new_temp_each_failure") + ". " + _hint("save_leaves_temp_on_failure"))
    return CheckFailed(
        f"a save that failed left {left} beside the checkpoint. Its name is fixed, so the next save "
        "overwrites it and no more pile up; but until a save succeeds, a half-written file as "
        "large as the checkpoint lies beside it, and the exercise asks a failed save to leave the "
        "previous checkpoint and nothing else. " + _hint("save_leaves_temp_on_failure"))


@contextlib.contextmanager
def _recorded_renames() -> Iterator[list[tuple[str, str]]]:
    """``os.replace`` and ``os.rename`` note each (src, dst); the real ones are back on the way out."""
    renames: list[tuple[str, str]] = []
    real = {"replace": os.replace, "rename": os.rename}

    def recording(name: str) -> Callable:
        def f(src, dst, *args, **kwargs):
            renames.append((os.fspath(src), os.fspath(dst)))
            return real[name](src, dst, *args, **kwargs)
        return f

    os.replace, os.rename = recording("replace"), recording("rename")
    try:
        yield renames
    finally:
        os.replace, os.rename = real["replace"], real["rename"]


def _check_other_filesystem(save_fn: Callable, model: torch.nn.Module, opt, sched) -> bool:
    """Save into a folder on another filesystem than the temp folder (/dev/shm, a tmpfs).

    Returns whether this machine had such a second filesystem to try.
    """
    shm = "/dev/shm"
    if not os.path.isdir(shm) or os.stat(shm).st_dev == os.stat(tempfile.gettempdir()).st_dev:
        return False  # no second filesystem here: nothing to learn from this part
    with tempfile.TemporaryDirectory(prefix="check-06b-", dir=shm) as other:
        target = os.path.join(other, "ckpt.pt")
        with _recorded_renames() as renames:
            try:
                save_fn(target, 0, model, opt, sched, 2, 5)
            except OSError as e:
                if e.errno != errno.EXDEV:
                    raise
                src = renames[-1][0] if renames else "?"
                raise CheckFailed(_cross_fs(src, target)) from None
        for src, dst in renames:
            src_dir = os.path.dirname(os.path.abspath(src))
            dst_dir = os.path.dirname(os.path.abspath(dst))
            if os.path.isdir(src_dir) and os.stat(src_dir).st_dev != os.stat(dst_dir).st_dev:
                raise CheckFailed(_cross_fs(src, dst))
    return True


def _reference_batches(loader: DataLoader, epoch: int, step_in_epoch: int):
    loader.sampler.set_epoch(epoch)
    return itertools.islice(loader, step_in_epoch, None)


def _resumable_worker(save_fn: Callable | None, load_fn: Callable | None,
                      batches_fn: Callable | None, path: str, attempt: int) -> Outcome:
    """Train with DDP for EPOCHS epochs; rank 1 dies before global step KILL_AT in attempt 0.

    ``batches_fn`` None is the reference: the checker's own loop, never saved nor interrupted.
    Returns where the run started, the sample ids of every batch it trained on (with their
    epoch and position), and the final model, optimizer state and learning rate.
    """
    with process_group() as pg:
        out = _train_and_resume(save_fn, load_fn, batches_fn, path, attempt, pg.rank, pg.world,
                                pg.device)
    return Outcome(pg.rank, data=out)


def _train_and_resume(save_fn: Callable | None, load_fn: Callable | None,
                      batches_fn: Callable | None, path: str, attempt: int, rank: int, world: int,
                      device: torch.device) -> dict:
    model, opt, sched = setup_training(seed=0)
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
    # The DDP model (its reducer holds the process group) goes with this frame, before
    # process_group collects garbage and destroys the group.
    return {"start": start, "seen": seen, "state": state_to_cpu(model), "opt": opt_tensors(opt),
            "lr": sched.get_last_lr()[0]}


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
                "checkpoint, were trained twice.\nUsual mistake: " + _hint("batches_from_epoch_start"))
    later = [k for k in range(offset + 1, len(ref)) if ref[k][2] == first]
    if later:
        skipped = later[0] - offset
        return (f"{head}: its first batch is the uninterrupted run's batch {ref[later[0]][1]} of "
                f"epoch {ref[later[0]][0]}, so {skipped} batch(es) were never trained on.\n"
                "Usual mistake: " + _hint("batches_skip_one_more"))
    epoch0 = [ids for _, _, ids in ref[:STEPS_PER_EPOCH]]
    if e and first in epoch0:
        k = epoch0.index(first)
        also = ("" if k == s else f" It also began at batch {k} of the epoch, not at batch {s}: "
                + _hint("batches_whole_loader"))
        return (f"{head}: its batches of epoch {e} are those of epoch 0 (the sampler still shuffles "
                "with epoch 0's seed).\nUsual mistake: " + _hint("batches_no_set_epoch_on_resume")
                + also)
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
    ref = [o.data for o in judge(run_workers(_resumable_worker, 2, args=(None, None, None, "", -1),
                                             timeout=120, env=quiet), world=2)]
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
    resumed = [o.data for o in judge(run_workers(_resumable_worker, 2, args=(*args, 1), timeout=120,
                                                 env=quiet), world=2)]
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
