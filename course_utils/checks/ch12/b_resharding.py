"""12.b Resharding a checkpoint: ``check_resharding(shard, save_checkpoint, load_checkpoint)``.

The learner writes three functions, each called on every rank::

    shard(model) -> model                         # fully_shard the plain model over this job's ranks
    save_checkpoint(model, optimizer, path)       # model and AdamW state, from every rank
    load_checkpoint(model, optimizer, path)       # into a model and optimizer of another job size

The checker builds the model, calls ``shard``, trains 3 AdamW steps on 2 ranks and calls
``save_checkpoint``; it reads the checkpoint's metadata (every element of every tensor must be in
it, the optimizer's state too); then on 4 ranks it builds a model with other weights, calls
``shard`` and ``load_checkpoint``, and compares the full model and optimizer state
(``get_state_dict`` with ``full_state_dict=True``) with the state that was saved, exactly.
"""

from __future__ import annotations

import copy
import math
import os
import shutil
import tempfile
import traceback
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from ...checking import (
    Catalogue,
    CheckFailed,
    Misconception,
    Outcome,
    checker,
    close,
    judge,
    learner_frames,
    process_group,
    require_callable,
    run_workers,
)
from ...workers.errors import indent

__all__ = ["CATALOGUE", "check_resharding", "SAVE_WORLD", "LOAD_WORLD"]

CATALOGUE = Catalogue(
    "12.b resharding",
    Misconception(
        "saves_on_rank_zero_only",
        "only rank 0 saves, as in chapter 06",
        "the checkpoint is one file, or its metadata covers only rank 0's shards",
        "with FSDP each rank holds only its shards: every rank must take part in the save "
        "(dcp.save on all ranks writes each rank's shards and one metadata file)",
    ),
    Misconception(
        "loads_without_optimizer",
        "the weights are the checkpoint; the optimizer starts afresh",
        "after loading, the AdamW state differs from the saved one (or is empty)",
        "save and load the optimizer state too: get_state_dict(model, optimizer) gives both "
        "state dicts, set_state_dict(model, optimizer, ...) puts both back; without AdamW's "
        "moments and step count the resumed run is not the run that was saved",
    ),
    Misconception(
        "model_for_old_world",
        "the model is sharded the way it was saved: over 2 ranks",
        "on 4 ranks the parameters' mesh has 2 ranks",
        "build the mesh for the job that runs now, init_device_mesh(\"cpu\", (dist.get_world_size(),)): "
        "DCP reshards on load, so the new job never needs the old layout",
    ),
)

SAVE_WORLD, LOAD_WORLD = 2, 4
STEPS = 3
DIM, HIDDEN = 16, 64
# torch.distributed.checkpoint and torch.distributed.tensor take about a second to import: the
# functions that need them import them, so that importing the checkers stays quick.


def _model(seed: int) -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, DIM))


def _sharded(shard, seed: int, world: int) -> tuple[nn.Module, str]:
    try:
        model = shard(_model(seed))
    except NotImplementedError:
        raise
    except Exception as e:  # reported as a problem, so that a rank with a clearer one is judged first
        # (a mesh of 2 ranks built on 4: ranks 2 and 3, outside it, fail inside fully_shard)
        frames = learner_frames(traceback.format_exc())
        return None, f"shard(model) raised {type(e).__name__}: {e}\n{indent(frames)}"
    if not isinstance(model, nn.Module):
        return model, f"shard(model) returned {type(model).__name__}; expected the sharded model"
    from torch.distributed.tensor import DTensor  # slow to import: see the note above _model

    params = list(model.parameters())
    if not all(isinstance(p, DTensor) for p in params):
        return model, ("after shard(model) some parameters are plain tensors: apply fully_shard "
                       "(to each layer and to the whole model) before returning it")
    sizes = {p.device_mesh.size() for p in params}
    if sizes != {world}:
        return model, (f"on {world} ranks the parameters are sharded over a mesh of "
                       f"{', '.join(map(str, sorted(sizes)))} rank(s). Usual mistake: "
                       f"{CATALOGUE.hint('model_for_old_world')}.")
    return model, ""


def _full(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """The whole model and AdamW state, gathered on rank 0 (the other ranks get empty dicts)."""
    # slow to import: see the note above _model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, opt, options=full)
    return copy.deepcopy({"model": msd, "optim": osd.get("state", {})})  # AdamW's step tensors are live


def _save_worker(shard, save_checkpoint, path: str) -> Outcome:
    warnings.filterwarnings("ignore", message=".*FSDP2-wrapped module")
    with process_group("gloo") as pg:  # FSDP2 over gloo on CPU, also on a machine with GPUs
        model, problem = _sharded(shard, 0, pg.world)
        if problem:
            return Outcome(pg.rank, problem=problem)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for s in range(STEPS):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(10 + s)
                x = torch.randn(8, DIM)
            F.mse_loss(model(x), x).backward()
            opt.step()
            opt.zero_grad()
        saved = _full(model, opt)
        save_checkpoint(model, opt, path)
        torch.distributed.barrier()
        return Outcome(pg.rank, data={"saved": saved if pg.rank == 0 else None})


def _load_worker(shard, load_checkpoint, path: str, saved: dict) -> Outcome:
    warnings.filterwarnings("ignore", message=".*FSDP2-wrapped module")
    with process_group("gloo") as pg:
        model, problem = _sharded(shard, 1, pg.world)
        if problem:
            return Outcome(pg.rank, problem=problem)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        load_checkpoint(model, opt, path)
        got = _full(model, opt)
        if pg.rank != 0:
            return Outcome(pg.rank)
        where = f"after loading into {pg.world} ranks"
        if not close(got["model"], saved["model"], atol=0):
            names = [k for k in saved["model"] if not close(got["model"].get(k), saved["model"][k], atol=0)]
            return Outcome(pg.rank, problem=f"{where}, the model differs from the one saved in "
                                            f"{', '.join(names)} (it still has the new model's weights?)")
        if not close(got["optim"], saved["optim"], atol=0):
            what = "is empty" if not got["optim"] else "differs from the saved one"
            return Outcome(pg.rank, problem=f"{where}, the model is right but the AdamW state {what}. "
                                            f"Usual mistake: {CATALOGUE.hint('loads_without_optimizer')}.")
        return Outcome(pg.rank)


def _coverage_problem(path: str, saved: dict) -> str:
    """Why the checkpoint at ``path`` does not hold every element of the saved state, or ''."""
    # slow to import: see the note above _model
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    rank0 = CATALOGUE.hint("saves_on_rank_zero_only")
    if os.path.isfile(path):
        return (f"the checkpoint is one file ({os.path.basename(path)}), written by one rank: it holds "
                f"that rank's shards only. Usual mistake: {rank0}.")
    try:
        meta = FileSystemReader(path).read_metadata()
    except Exception as e:  # no .metadata: nothing or something else was written
        return (f"no DCP checkpoint at the path given ({type(e).__name__}: {e}); save with "
                f"torch.distributed.checkpoint.save(state, checkpoint_id=path) on every rank")
    tensors = {k: m for k, m in meta.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    for key, m in tensors.items():
        total = math.prod(m.size)
        stored = sum(math.prod(c.sizes) for c in m.chunks)
        if total and stored < total:
            return (f"the checkpoint holds {stored} of the {total} elements of {key!r}: the other "
                    f"ranks' shards are missing. Usual mistake: {rank0}.")
    if not any("exp_avg" in k for k in tensors):
        return (f"the checkpoint has no optimizer state (keys: {', '.join(sorted(tensors)[:4])}...). "
                f"Usual mistake: {CATALOGUE.hint('loads_without_optimizer')}.")
    return ""


@checker("12.b resharding")
def check_resharding(shard, save_checkpoint, load_checkpoint, *, timeout: float = 60.0) -> None:
    """Save on 2 ranks, load on 4, compare with the saved state; see the module docstring."""
    require_callable(shard, "shard(model)")
    require_callable(save_checkpoint, "save_checkpoint(model, optimizer, path)")
    require_callable(load_checkpoint, "load_checkpoint(model, optimizer, path)")
    tmp = tempfile.mkdtemp(prefix="ch12b_")
    path = os.path.join(tmp, "checkpoint")
    try:
        saved = judge(run_workers(_save_worker, SAVE_WORLD, args=(shard, save_checkpoint, path),
                                  timeout=timeout), world=SAVE_WORLD)[0].data["saved"]
        problem = _coverage_problem(path, saved)
        if problem:
            raise CheckFailed(f"saved on {SAVE_WORLD} ranks: {problem}")
        judge(run_workers(_load_worker, LOAD_WORLD, args=(shard, load_checkpoint, path, saved),
                          timeout=timeout), world=LOAD_WORLD)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
