"""Chapter 12: sharded checkpoints with torch.distributed.checkpoint (DCP).

Workers import this file (``from ch12_dcp import save_sharded, load_resharded``).

- ``save_sharded(path)`` trains an FSDP2 model with AdamW for a few steps on every rank of the group
  and saves model and optimizer with ``dcp.save`` (every rank writes its own shards), then once more
  with ``dcp.async_save`` while the next step runs; it also saves what chapter 06 did, rank 0's
  ``torch.save(model.state_dict())``, to show what that file holds.
- ``load_resharded(path)`` builds the same model for however many ranks run it, loads the checkpoint
  (DCP reshards: each rank reads the pieces of the saved shards that make up its new shard) and
  returns the full state, to compare with the one that was saved.
- ``save_2d_load_fsdp(path)`` (4 ranks) does the same across layouts: it trains and saves the model
  sharded two ways at once, FSDP2 x TP on a 2 x 2 mesh (section 3), and loads the files into FSDP2
  alone over the same 4 ranks.
"""

import copy
import logging
import os
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


def save_sharded(path):
    warnings.filterwarnings("ignore", message=".*FSDP2-wrapped module")
    with group() as (rank, world):
        model, opt = build()
        for s in range(STEPS):
            step(model, opt, s)
        saved = copy.deepcopy(full_state(model, opt))  # a copy: AdamW's "step" tensors are live
        msd, osd = get_state_dict(model, opt)  # this rank's shards (DTensors), by parameter name
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{path}/step{STEPS}")
        save_s = time.perf_counter() - t0

        # The same state once more, written in the background while training goes on.  The background
        # thread's collectives get a group of their own: on the default group they would interleave
        # with the training step's all-gathers in a different order on each rank.
        ckpt_group = dist.new_group(backend="gloo")
        dist.barrier()
        t0 = time.perf_counter()
        future = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=f"{path}/async",
                                process_group=ckpt_group)
        returned_s = time.perf_counter() - t0  # the state is copied to CPU memory before this returns
        step(model, opt, STEPS)  # a training step overlapping the write
        step_done_s = time.perf_counter() - t0
        future.result()
        async_total_s = time.perf_counter() - t0

        if rank == 0:  # chapter 06's single-file checkpoint, applied to sharded state
            torch.save(model.state_dict(), f"{path}/rank0.pt")
        local = {k: tuple(v.to_local().shape) for k, v in model.state_dict().items()}
        dist.barrier()
        files = sorted(os.listdir(f"{path}/step{STEPS}"))
        return {"rank": rank, "world": world, "saved": saved if rank == 0 else None, "files": files,
                "save_s": save_s, "async_returned_s": returned_s, "async_step_done_s": step_done_s,
                "async_total_s": async_total_s, "local_shapes": local}


def load_resharded(path):
    warnings.filterwarnings("ignore", message=".*FSDP2-wrapped module")
    with group() as (rank, world):
        model, opt = build(seed=1)  # other weights: whatever is equal afterwards came from the file
        msd, osd = get_state_dict(model, opt)  # shards for *this* world size, optimizer state included
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=f"{path}/step{STEPS}")
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
