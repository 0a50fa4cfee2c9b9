"""12.b Resharding a checkpoint: ``check_resharding(shard, save_checkpoint, load_checkpoint)``.

The learner writes three functions, each called on every rank::

    shard(model) -> model                         # fully_shard the plain model over this job's ranks
    save_checkpoint(model, optimizer, path)       # model and AdamW state, from every rank
    load_checkpoint(model, optimizer, path)       # into a model and optimizer of another job size

The checker builds the model, calls ``shard``, trains 3 AdamW steps on 2 ranks and calls
``save_checkpoint``; rank 0 reads the checkpoint's metadata (every element of every tensor must be in
it, the optimizer's state too; the newest ``.metadata`` under ``path``, wherever the answer keeps its
folders).  Then, in the same job, one more step and a second ``save_checkpoint`` into the same
``path`` that fails part way: on rank 1 every file opened for writing under ``path`` raises
``OSError`` (an audit hook, ``sys.addaudithook``), after rank 0 has written its shards, as a full
disk or a rank killed mid-save would leave it.  Then on 4 ranks it builds a model with other weights,
calls ``shard`` and ``load_checkpoint``, and compares the full model and optimizer state
(``get_state_dict`` with ``full_state_dict=True``) with the state of the last *whole* save, exactly:
a save written over the previous checkpoint's files loads as a mix of both (rank 0's rows from the
failed save, rank 1's from the earlier one), which the checker names.
"""

from __future__ import annotations

import copy
import glob
import math
import os
import re
import shutil
import sys
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
        "saves_in_place",
        "a new checkpoint simply overwrites the old one in the same folder",
        "after a save that failed on rank 1, the load returns rank 0's rows from the failed save and "
        "rank 1's from the earlier one",
        "write each save into a new folder and switch to it only once every rank has finished "
        "(after a barrier, rank 0 points a `latest` link at it with os.replace, which is atomic; "
        "the load reads the folder `latest` names): a save that dies part way then leaves the last "
        "whole checkpoint as it was",
    ),
    Misconception(
        "optimizer_by_position",
        "optimizer.state_dict() is the optimizer's checkpoint, whatever loads it",
        "dcp.load raises CheckpointException: the keys it asks for are not in the checkpoint",
        "save and load the optimizer state in the same form: optimizer.state_dict() keys it by "
        "position (0, 1, ...), get_state_dict / get_optimizer_state_dict by parameter name "
        "(\"0.weight\", ...); use get_state_dict(model, optimizer) on both sides",
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


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, s: int) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(10 + s)
        x = torch.randn(8, DIM)
    F.mse_loss(model(x), x).backward()
    opt.step()
    opt.zero_grad()


class _FailingDisk:
    """While armed, every file this process opens for writing under ``root`` raises ``OSError``.

    An audit hook sees each ``open`` before it happens (``sys.addaudithook``; hooks cannot be removed,
    so it is installed once per worker and disarmed).  Nothing is replaced: the answer's own calls run.
    """

    armed = False
    root = ""

    @classmethod
    def install(cls, root: str) -> None:
        cls.root = os.path.abspath(root) + os.sep
        sys.addaudithook(cls._hook)

    @classmethod
    def _hook(cls, event: str, args: tuple) -> None:
        if not cls.armed or event != "open" or not isinstance(args[0], (str, os.PathLike)):
            return
        mode, flags = args[1], args[2] if len(args) > 2 else 0
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
            (isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR))
        if writes and os.path.abspath(os.fspath(args[0])).startswith(cls.root):
            raise OSError(28, "No space left on device (simulated by the checker)", os.fspath(args[0]))


def _learner_save(save_checkpoint, model, opt, path: str) -> None:
    save_checkpoint(model, opt, path)  # named in the stacks of a hang: who had returned from it


def _save_worker(shard, save_checkpoint, path: str) -> Outcome:
    """Save after 3 steps (checked whole on rank 0), then a 4th step and a save that fails on rank 1."""
    warnings.filterwarnings("ignore", message=".*FSDP2-wrapped module")
    with process_group("gloo") as pg:  # FSDP2 over gloo on CPU, also on a machine with GPUs
        model, problem = _sharded(shard, 0, pg.world)
        if problem:
            return Outcome(pg.rank, problem=problem)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for s in range(STEPS):
            _train_step(model, opt, s)
        saved = _full(model, opt)
        _learner_save(save_checkpoint, model, opt, path)
        verdict = [_coverage_problem(path) if pg.rank == 0 else None]
        torch.distributed.broadcast_object_list(verdict, src=0)  # every rank stops, or goes on
        if verdict[0]:
            return Outcome(pg.rank, problem=f"saved on {pg.world} ranks: {verdict[0]}")

        _train_step(model, opt, STEPS)
        failed = _full(model, opt)
        _FailingDisk.install(path)
        _FailingDisk.armed = pg.rank == 1
        try:
            _learner_save(save_checkpoint, model, opt, path)
            error = ""
        except Exception as e:  # expected: rank 1's files cannot be written
            error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        except BaseException as e:  # dcp's CheckpointException derives from BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            error = f"{type(e).__name__}"
        finally:
            _FailingDisk.armed = False
        return Outcome(pg.rank, data={"saved": saved if pg.rank == 0 else None,
                                      "failed": failed if pg.rank == 0 else None, "error": error})


def _mixed(got: dict, saved: dict, failed: dict) -> list[str]:
    """Tensors of ``got`` whose rows come partly from ``saved`` and partly from ``failed``."""
    out = []
    for k, want in saved.items():
        g, f = got.get(k), failed.get(k)
        if not (isinstance(g, torch.Tensor) and isinstance(f, torch.Tensor)) or g.shape != want.shape \
                or g.dim() == 0:
            continue
        old = [bool(torch.equal(a, b)) for a, b in zip(g, want)]
        new = [bool(torch.equal(a, b)) for a, b in zip(g, f)]
        if any(n and not o for o, n in zip(old, new)) and any(o and not n for o, n in zip(old, new)):
            rows = [i for i, (o, n) in enumerate(zip(old, new)) if n and not o]
            out.append(f"{k} (rows {rows[0]}-{rows[-1]} from the failed save)")
    return out


def _load_worker(shard, load_checkpoint, path: str, saved: dict, failed: dict) -> Outcome:
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
            mixed = _mixed(got["model"], saved["model"], failed["model"])
            if mixed:
                return Outcome(pg.rank, problem=(
                    f"{where}, the model is a mix of two checkpoints: {'; '.join(mixed[:3])}, the other "
                    f"rows from the whole save before it. The checker's second save failed on rank 1 "
                    f"(its files could not be written) after rank 0 had written its shards into the "
                    f"same files, and the earlier .metadata still described them. "
                    f"Usual mistake: {CATALOGUE.hint('saves_in_place')}."))
            if close(got["model"], failed["model"], atol=0):
                return Outcome(pg.rank, problem=(
                    f"{where}, the model is the one of the checker's second save, which failed on "
                    f"rank 1: a save that did not complete on every rank must not become the "
                    f"checkpoint that loads. Usual mistake: {CATALOGUE.hint('saves_in_place')}."))
            names = [k for k in saved["model"] if not close(got["model"].get(k), saved["model"][k], atol=0)]
            return Outcome(pg.rank, problem=f"{where}, the model differs from the one saved in "
                                            f"{', '.join(names)} (it still has the new model's weights?)")
        if not close(got["optim"], saved["optim"], atol=0):
            what = "is empty" if not got["optim"] else "differs from the saved one"
            return Outcome(pg.rank, problem=f"{where}, the model is right but the AdamW state {what}. "
                                            f"Usual mistake: {CATALOGUE.hint('loads_without_optimizer')}.")
        return Outcome(pg.rank)


def _newest_metadata(path: str) -> str:
    """The folder under ``path`` (``path`` included) whose ``.metadata`` was written last, or ''."""
    found = glob.glob(os.path.join(glob.escape(path), "**", ".metadata"), recursive=True)
    return os.path.dirname(max(found, key=os.path.getmtime)) if found else ""


def _coverage_problem(path: str) -> str:
    """Why the checkpoint saved at ``path`` does not hold every element of the state, or ''."""
    # slow to import: see the note above _model
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    rank0 = CATALOGUE.hint("saves_on_rank_zero_only")
    if os.path.isfile(path):
        return (f"the checkpoint is one file ({os.path.basename(path)}), written by one rank: it holds "
                f"that rank's shards only. Usual mistake: {rank0}.")
    folder = _newest_metadata(path)
    if not folder:
        return ("no DCP checkpoint under the path given (no .metadata file in it or in a folder "
                "inside it); save with torch.distributed.checkpoint.save(state, checkpoint_id=...) "
                "on every rank")
    try:
        meta = FileSystemReader(folder).read_metadata()
    except Exception as e:
        return f"the checkpoint's .metadata in {folder} could not be read ({type(e).__name__}: {e})"
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


def _save_hang(stacks: dict[int, str]) -> str | None:
    """A hang in the save phase: the ranks that returned from save_checkpoint and those still in it."""
    inside = sorted(r for r, s in stacks.items() if "_learner_save" in s)
    out = sorted(r for r, s in stacks.items() if "_learner_save" not in s)
    if not inside or not out:
        return None
    where = "\n".join(f"rank {r} was stuck here:\n{indent(learner_frames(stacks[r]) or '(no stack)')}"
                      for r in inside)
    return (f"your save hung: rank(s) {', '.join(map(str, out))} returned from save_checkpoint while "
            f"rank(s) {', '.join(map(str, inside))} still waited inside it for the others, in a "
            f"collective of dcp.save (it plans the save and gathers the metadata with every rank of "
            f"the group).\n{where}\nUsual mistake: {CATALOGUE.hint('saves_on_rank_zero_only')}.")


def _load_error(f) -> str | None:
    """dcp.load's CheckpointException for keys that are not in the checkpoint: saved in another form."""
    text = f"{f.message}\n{f.traceback}"
    if f.exc_type != "CheckpointException" and "CheckpointException" not in text:
        return None
    if not any(s in text for s in ("Missing key", "missing key", "not found in checkpoint", "KeyError")):
        return None
    missing = re.findall(r"Missing key in checkpoint state_dict: (\w[\w.]*\w)", text)
    shown = f" (the first: {missing[0]})" if missing else ""
    return (f"rank {f.rank}: dcp.load raised CheckpointException: the checkpoint does not hold keys "
            f"your load asks for{shown}. Usual mistake: {CATALOGUE.hint('optimizer_by_position')}.")


def _outcomes(results: list, world: int, call: str) -> list[Outcome]:
    """``judge``'s outcomes; a rank whose process ended without a result is named, not a checker bug."""
    ended = [r for r, o in enumerate(results) if not isinstance(o, Outcome)]
    if ended:
        raise CheckFailed(f"on {world} ranks, rank(s) {', '.join(map(str, ended))} ended the process without "
                          f"returning from {call} (os._exit() or sys.exit(0) in your code?); return instead.")
    return judge(results, world=world)


@checker("12.b resharding")
def check_resharding(shard, save_checkpoint, load_checkpoint, *, timeout: float = 60.0) -> None:
    """Save on 2 ranks (then a save that fails on rank 1), load on 4; see the module docstring."""
    require_callable(shard, "shard(model)")
    require_callable(save_checkpoint, "save_checkpoint(model, optimizer, path)")
    require_callable(load_checkpoint, "load_checkpoint(model, optimizer, path)")
    tmp = tempfile.mkdtemp(prefix="ch12b_")
    path = os.path.join(tmp, "checkpoint")
    try:
        outcomes = _outcomes(run_workers(_save_worker, SAVE_WORLD, args=(shard, save_checkpoint, path),
                                         timeout=timeout, explain_hang=_save_hang), SAVE_WORLD,
                             "shard or save_checkpoint")
        saved, failed = outcomes[0].data["saved"], outcomes[0].data["failed"]
        _outcomes(run_workers(_load_worker, LOAD_WORLD, args=(shard, load_checkpoint, path, saved, failed),
                              timeout=timeout, explain_error=_load_error), LOAD_WORLD,
                  "shard or load_checkpoint")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
