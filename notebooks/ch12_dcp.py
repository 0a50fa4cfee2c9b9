"""Chapter 12: sharded checkpoints with torch.distributed.checkpoint (DCP).

Workers import this file (``from ch12_dcp import save_sharded, load_resharded``).

- ``save_atomic(state, root)`` / ``load_latest(state, root)``: the checkpoint recipe. Every save goes
  into a new folder of ``root``; once every rank has written its shards, rank 0 points ``root/latest``
  at it with one ``os.replace`` (atomic on POSIX), so a reader finds the last whole checkpoint or
  the new one, never a mix; ``load_latest`` reads the folder ``latest`` names and refuses, saying
  why, when there is none.
- ``save_sharded(path)`` trains an FSDP2 model with AdamW for a few steps on every rank of the group
  and saves model and optimizer with ``save_atomic`` (every rank writes its own shards with
  ``dcp.save``); it times ``dcp.save`` against ``dcp.async_save`` (alternating, after a warm-up of
  each); it also saves what chapter 06 did, rank 0's ``torch.save(model.state_dict())``, to show what
  that file holds.
- ``load_resharded(path)`` builds the same model for however many ranks run it, loads the checkpoint
  (DCP reshards: each rank reads the pieces of the saved shards that make up its new shard) and
  returns the full state, to compare with the one that was saved.
- ``interrupted_save(path)`` saves twice into the same place, the second save failing on rank 1 after
  rank 0 has written its shards, once with ``dcp.save`` into one folder and once with
  ``save_atomic``, and reports where the rows of the model that loads afterwards come from.
- ``save_2d_load_fsdp(path)`` (4 ranks) does the same across layouts: it trains and saves the model
  sharded two ways at once, FSDP2 x TP on a 2 x 2 mesh (section 3), and loads the files into FSDP2
  alone over the same 4 ranks.
"""

import copy
import logging
import os
import shutil
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from ch12_mesh import group  # the same gloo group as section 3
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

DIM, HIDDEN, STEPS = 64, 1024, 3
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered, on CPU, on every rank


def build(seed=0, tp=1):
    """The model and optimizer, sharded over every rank of the group (mesh on "cpu": see ch12_mesh).

    With ``tp=2``, on a (world / 2) x 2 mesh instead: each Linear split in two across "tp" (chapter
    11's column-then-row pair), and each half sharded by FSDP2 across "dp".
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, DIM))
    if tp == 1:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    else:
        mesh2 = init_device_mesh("cpu", (dist.get_world_size() // tp, tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh2["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        mesh = mesh2["dp"]
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step(model, opt, seed):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(100 + seed)
        x = torch.randn(16, DIM)
    F.mse_loss(model(x), x).backward()
    opt.step()
    opt.zero_grad()


def full_state(model, opt):
    msd, osd = get_state_dict(model, opt, options=FULL)
    return {"model": msd, "optim": osd}


def save_atomic(state, root):
    """dcp.save into a folder no earlier save used, then switch ``root/latest`` to it: all or nothing."""
    rank = dist.get_rank()
    name = [f"ckpt-{time.time_ns()}" if rank == 0 else None]  # one folder name for every rank
    dist.broadcast_object_list(name, src=0)
    dcp.save(state, checkpoint_id=os.path.join(root, name[0]))  # every rank writes its shards
    dist.barrier()  # every rank's dcp.save has returned: all shards and the .metadata are on disk
    if rank == 0:
        tmp = os.path.join(root, f".latest-{name[0]}")
        os.symlink(name[0], tmp)
        os.replace(tmp, os.path.join(root, "latest"))  # one rename: readers see the old or the new
        fd = os.open(root, os.O_RDONLY)
        os.fsync(fd)  # the rename itself on disk, not only in the page cache
        os.close(fd)
        for old in os.listdir(root):  # earlier checkpoints, and the folders of failed saves
            if old.startswith("ckpt-") and old != name[0]:
                shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    dist.barrier()  # nobody reads root/latest before it is switched


def load_latest(state, root):
    """dcp.load from the folder ``root/latest`` names; an error that says so where there is none."""
    try:
        name = os.readlink(os.path.join(root, "latest"))
    except (FileNotFoundError, OSError):
        raise FileNotFoundError(
            f"no complete checkpoint in {root}: it has no 'latest' link, which a save writes only "
            f"after every rank has written its shards (a save that was interrupted leaves none)") from None
    dcp.load(state, checkpoint_id=os.path.join(root, name))
    return name


def save_sharded(path, repeats=3):
    warnings.filterwarnings("ignore", message=".*FSDP2-wrapped module")
    with group() as (rank, world):
        model, opt = build()
        for s in range(STEPS):
            step(model, opt, s)
        saved = copy.deepcopy(full_state(model, opt))  # a copy: AdamW's "step" tensors are live
        msd, osd = get_state_dict(model, opt)  # this rank's shards (DTensors), by parameter name
        save_atomic({"model": msd, "optim": osd}, path)
        files = sorted(os.listdir(f"{path}/latest"))

        # dcp.save against dcp.async_save, the same state, alternating after a warm-up of each (the
        # first call of each pays one-off costs).  The background thread's collectives get a group
        # of their own: on the default group they would interleave with the training step's
        # all-gathers in a different order on each rank.  A scratch copy of the model trains beside
        # the writes, so that the checkpoint above stays the state of step STEPS.
        ckpt_group = dist.new_group(backend="gloo")
        times = {"save_s": [], "async_returned_s": [], "async_step_done_s": [], "async_total_s": []}
        for i in range(repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{path}/timing/sync{i}")
            save_s = time.perf_counter() - t0
            dist.barrier()
            t0 = time.perf_counter()
            future = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=f"{path}/timing/async{i}",
                                    process_group=ckpt_group)
            returned_s = time.perf_counter() - t0  # the state is copied to CPU memory before this returns
            step(model, opt, STEPS + i)  # a training step overlapping the write
            step_done_s = time.perf_counter() - t0
            future.result()
            if i:  # i == 0 is the warm-up
                for k, v in zip(times, (save_s, returned_s, step_done_s, time.perf_counter() - t0)):
                    times[k].append(v)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(f"{path}/timing")
            # chapter 06's single-file checkpoint, applied to sharded state
            torch.save(model.state_dict(), f"{path}/rank0.pt")
        local = {k: tuple(v.to_local().shape) for k, v in model.state_dict().items()}
        dist.barrier()
        return {"rank": rank, "world": world, "saved": saved if rank == 0 else None, "files": files,
                "times": times, "local_shapes": local}


def load_resharded(path):
    warnings.filterwarnings("ignore", message=".*FSDP2-wrapped module")
    with group() as (rank, world):
        model, opt = build(seed=1)  # other weights: whatever is equal afterwards came from the file
        msd, osd = get_state_dict(model, opt)  # shards for *this* world size, optimizer state included
        load_latest({"model": msd, "optim": osd}, path)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        local = {k: tuple(v.to_local().shape) for k, v in model.state_dict().items()}
        loaded = full_state(model, opt)
        return {"rank": rank, "world": world, "loaded": loaded if rank == 0 else None,
                "local_shapes": local}


def save_2d_load_fsdp(path):
    warnings.filterwarnings("ignore", message=".*FSDP2-wrapped module")
    # Gathering a 2D tensor in full takes two all-gathers; torch logs a note about it each time.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    with group() as (rank, world):
        model, opt = build(tp=2)
        for s in range(STEPS):
            step(model, opt, s)
        saved = copy.deepcopy(full_state(model, opt))
        layout = {k: (str(v.placements), tuple(v.to_local().shape), tuple(v.shape))
                  for k, v in model.state_dict().items()}
        w = model[0].weight  # which rows of the full 0.weight this rank's piece is
        full, mine = w.full_tensor(), w.to_local()
        rows = [i for i in range(len(full)) if any(torch.equal(full[i], r) for r in mine)]
        coordinate = w.device_mesh.get_coordinate()  # this rank's place on the (dp, tp) mesh
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{path}/fsdp_x_tp")

        model, opt = build(seed=1)  # FSDP2 alone: every tensor in 4 row blocks, other weights
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=f"{path}/fsdp_x_tp")
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        loaded = full_state(model, opt)
        return {"rank": rank, "coordinate": coordinate, "rows": (rows[0], rows[-1]),
                "layout": layout, "saved": saved if rank == 0 else None,
                "loaded": loaded if rank == 0 else None,
                "new_local_shapes": {k: tuple(v.to_local().shape) for k, v in model.state_dict().items()}}


class FailingDisk:
    """While ``on``, this process's files opened for writing raise OSError, as on a full disk.

    An audit hook (``sys.addaudithook``) sees every ``open`` before it happens; hooks stay for the
    life of the process, so this one is installed once and switched on and off.
    """

    on = False

    @classmethod
    def install(cls):
        sys.addaudithook(cls._hook)

    @classmethod
    def _hook(cls, event, args):
        if cls.on and event == "open" and isinstance(args[1], str) and "w" in args[1]:
            raise OSError(28, "No space left on device (simulated)", str(args[0]))


def _rows(got, a, b):
    """Which rows of ``got`` equal those of ``a`` and which those of ``b``, as row ranges."""
    def ranges(rows):
        return ", ".join(f"{r[0]}-{r[-1]}" for r in _runs(rows)) or "none"
    same_a = [i for i in range(len(got)) if torch.equal(got[i], a[i])]
    same_b = [i for i in range(len(got)) if torch.equal(got[i], b[i])]
    return ranges(same_a), ranges(same_b)


def _runs(rows):
    out = []
    for i in rows:
        if out and out[-1][-1] == i - 1:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _save(layout, state, root):
    if layout == "save_atomic":
        save_atomic(state, root)
    else:
        dcp.save(state, checkpoint_id=root)


def interrupted_save(path):
    """Save (state A), train a step, save again (state B) with rank 1's disk failing; then load."""
    warnings.filterwarnings("ignore", message=".*FSDP2-wrapped module")
    warnings.filterwarnings("ignore", message=".*existing checkpoint")  # dcp.save over a folder
    FailingDisk.install()
    with group() as (rank, world):
        report = {}
        for layout in ("one folder, dcp.save", "save_atomic"):
            root = os.path.join(path, layout.split(",")[0].replace(" ", "_"))
            model, opt = build()
            for s in range(STEPS):
                step(model, opt, s)
            a = copy.deepcopy(full_state(model, opt))["model"].get("0.weight")  # on rank 0 only
            msd, osd = get_state_dict(model, opt)
            _save(layout, {"model": msd, "optim": osd}, root)
            step(model, opt, STEPS)
            b = copy.deepcopy(full_state(model, opt))["model"].get("0.weight")
            FailingDisk.on = rank == 1  # rank 1 cannot write; rank 0 writes its shards
            try:
                _save(layout, {"model": msd, "optim": osd}, root)
                error = "none"
            except BaseException as e:  # dcp's CheckpointException derives from BaseException
                error = type(e).__name__
            finally:
                FailingDisk.on = False
            model, opt = build(seed=1)  # other weights: what is equal afterwards came from the files
            msd, osd = get_state_dict(model, opt)
            if layout == "save_atomic":
                load_latest({"model": msd, "optim": osd}, root)
            else:
                dcp.load({"model": msd, "optim": osd}, checkpoint_id=root)
            set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
            got = full_state(model, opt)["model"].get("0.weight")
            if rank == 0:
                report[layout] = {"save error": error, "rows": len(got), "from": _rows(got, a, b)}
        try:  # a folder whose only save failed: there is nothing whole to load
            FailingDisk.on = rank == 1
            try:
                save_atomic({"model": msd, "optim": osd}, os.path.join(path, "fresh"))
            except BaseException:
                pass
            finally:
                FailingDisk.on = False
            load_latest({"model": msd, "optim": osd}, os.path.join(path, "fresh"))
            report["fresh"] = "loaded"
        except FileNotFoundError as e:
            report["fresh"] = str(e).replace(path, "<path>")
        dist.barrier()
        return report
