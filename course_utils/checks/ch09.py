"""Checkers for chapter 09 (troubleshooting lab): six broken scripts, fixed by the learner.

Each checker runs the learner's function in real worker processes (two ranks, gloo on CPU) with a
timeout, so a fix that still hangs fails with the stuck ranks' positions instead of freezing the
notebook.  Then it checks that the symptom is gone *and* that the result is right, against a
reference computed in the same workers.

| exercise | the learner writes | the symptom that must be gone |
| --- | --- | --- |
| 09.a | ``end_of_epoch(model, local_val_loss, path) -> float`` | hang: a collective inside ``if rank == 0`` |
| 09.b | ``make_loader(dataset, batch_size, epoch) -> DataLoader`` | duplicates; one order every epoch |
| 09.c | ``sync_metrics(metrics) -> dict`` | collectives in different orders (wrong totals, hang) |
| 09.d | ``train_step(model, optimizer, x, y) -> bool`` | NaN on one rank: NaN weights, or a hang |
| 09.e | ``train_uneven(model, optimizer, batches) -> int`` | uneven inputs: hang at the last batch |
| 09.f | ``evaluate(model, batches) -> float`` | evaluation that builds graphs (memory leak) |

Misconceptions recognised (tests/checkers/test_ch09_checks.py; the message names each one and its fix):

- 09.a: the all-reduce only under ``if rank == 0:`` (hang, both ranks' positions shown); the
  barrier inside ``if rank == 0:`` "so that the others wait for the save" (rank 0 waits alone: a
  hang; the checker synchronises on a group of its own, so its barrier cannot pair with that
  one); no barrier at all (a rank returns before the file exists); this rank's loss, or the sum,
  returned instead of the mean; ``dist.reduce`` to rank 0 "because only rank 0 saves" (the
  other ranks return no mean); every rank saving the one file; a checkpoint without the model;
  a tensor returned instead of a float.  Accepted as well: ``all_gather`` of the losses,
  ``all_gather_object`` with a broadcast from rank 0 after the save instead of a barrier.
- 09.b: a plain ``DataLoader(shuffle=True)`` on every rank (every rank reads everything);
  ``set_epoch`` forgotten (the same order every epoch); a seed per rank in ``DistributedSampler``
  (the shards overlap: named from the samplers' seeds); ``shuffle=True`` as well as the sampler
  (DataLoader's ValueError explained); an unshuffled shard; a hand-made shard that misses
  samples.  Accepted as well: ``DistributedSampler(seed=epoch)`` without ``set_epoch``, a shard cut
  by hand from a permutation that every rank draws with the same seed.
- 09.c: one all-reduce per key in each rank's own order (values added across names), the keys
  sorted locally without agreeing on them first (one rank has a key more), the agreed keys
  reduced in a set's order (each process salts string hashes: the checker gives each rank's
  names its own salt, which the forked workers would otherwise share), the mean instead of
  the total, a list instead of a dict.  Accepted as well: one all-reduce per key in an agreed
  order, ``all_gather_object`` of the whole dicts summed locally.
- 09.d: skipping before ``backward()`` from the local loss (hang); deciding from the local loss
  after ``backward()`` (the ranks decide differently: named with each rank's decision); no guard
  (NaN weights); no ``zero_grad`` when skipping (every later step skipped); no return value.
  Accepted as well: a flag all-reduced before backward, the gradients' total norm
  (``get_total_norm``), an ``all_gather`` of the ranks' flags.
- 09.e: the plain loop (hang at the last batch); truncating to the shortest rank; training
  ``model.module`` (the ranks drift apart); padding with a real batch repeated, whose gradients
  count twice (named from the forward count); a step count that is not the number of
  ``optimizer.step()`` calls this rank made (counted with a step hook).  Accepted as well:
  ``with model.join():``, padding (every rank runs the longest rank's number of steps, the extra
  ones with the loss multiplied by 0).
- 09.f: a tensor total that keeps every batch's graph; no ``no_grad`` (autograd saves tensors,
  counted with ``saved_tensors_hooks``); no ``eval()`` (BatchNorm statistics move); eval mode
  left on; this rank's mean; the mean of per-batch means; the mean of the ranks' means.
  Accepted as well: ``inference_mode`` with the all-reduce inside it, a ``@torch.no_grad()``
  function with two all-reduces (sum and count), the previous mode restored with
  ``model.train(was_training)``.
"""

from __future__ import annotations

import copy
import os
import tempfile
import time
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from ..checking import CheckFailed, checker, close, compare_tensors, require_callable, run_workers
from ..data import make_dataset, make_model
from ..diagnose import IndexedDataset, check_duplicates, sample_ids
from ..workers.errors import RankFailure

__all__ = [
    "check_checkpoint_collective",
    "check_distributed_loader",
    "check_metrics_sync",
    "check_nan_skip_step",
    "check_uneven_join",
    "check_eval_no_leak",
]

WORLD = 2


# --------------------------------------------------------------------------------------------
# Running the learner's code in workers
# --------------------------------------------------------------------------------------------


def _agree(a: float, b: float) -> bool:
    """Two losses or metrics agree to 1e-5 (relative), by the harness's ``close``."""
    return close(a, b, atol=1e-7, rtol=1e-5)


def _number(value: Any, what: str, rank: int) -> float:
    if value is None:
        raise CheckFailed(f"rank {rank}: {what} returned None (a missing `return`?)")
    if isinstance(value, torch.Tensor):
        extra = (" that still carries an autograd graph (grad_fn set): keeping it keeps every "
                 "batch's graph alive" if value.grad_fn is not None or value.requires_grad else "")
        raise CheckFailed(f"rank {rank}: {what} returned a torch.Tensor{extra}; return a Python "
                          "float (`.item()`)")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckFailed(f"rank {rank}: {what} returned a {type(value).__name__}; expected a "
                          "Python float")
    return float(value)


def _states_equal(states: list[dict], what: str, hint: str) -> None:
    for r in range(1, len(states)):
        compare_tensors(states[0], states[r], atol=0.0, what=f"{what} of rank {r} vs rank 0",
                        hint=hint)


# --------------------------------------------------------------------------------------------
# 09.a  end of epoch: a collective inside `if rank == 0`
# --------------------------------------------------------------------------------------------


def _w_end_of_epoch(fn: Callable, path: str) -> dict:


    dist.init_process_group("gloo")
    rank = dist.get_rank()
    saves: list[int] = []
    real_save = torch.save

    def slow_save(obj, f, *args, **kwargs):  # a slow disk makes a missing barrier visible
        saves.append(rank)
        time.sleep(0.3)
        return real_save(obj, f, *args, **kwargs)

    model = make_model(0, hidden=16)
    # The checker waits on a group of its own: a barrier on the default group would pair with a
    # barrier the learner's code called on one rank only, and hide that mistake.
    checker_group = dist.new_group(backend="gloo")
    torch.save = slow_save
    try:
        value = fn(model, 1.0 + 2.0 * rank, path)
        exists_at_return = os.path.exists(path)
    finally:
        torch.save = real_save
    dist.barrier(group=checker_group)
    dist.destroy_process_group()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"value": value, "saves": saves, "exists_at_return": exists_at_return, "state": state}


@checker("09.a checkpoint collective")
def check_checkpoint_collective(end_of_epoch: Callable, *, timeout: float = 20.0) -> None:
    """Run ``end_of_epoch(model, local_val_loss, path)`` on two ranks (losses 1.0 and 3.0)."""
    require_callable(end_of_epoch, "end_of_epoch(model, local_val_loss, path)")
    path = os.path.join(tempfile.mkdtemp(prefix="ch09a-"), "checkpoint.pt")
    out = run_workers(_w_end_of_epoch, WORLD, args=(end_of_epoch, path), timeout=timeout,
               hang_hint="a collective (all_reduce inside a helper, or the barrier itself) is "
               "called only under `if rank == 0:`; the other ranks never join it (in a real loop "
               "their next collective would pair with it: a hang or a mismatched collective). "
               "Compute the mean on every rank, save on rank 0 only, and put the barrier after "
               "the `if`.")
    expected = sum(1.0 + 2.0 * r for r in range(WORLD)) / WORLD
    for r, o in enumerate(out):
        got = _number(o["value"], "end_of_epoch", r)
        if not _agree(got, expected):
            rank0_right = r > 0 and _agree(_number(out[0]["value"], "end_of_epoch", 0), expected)
            why = ("that is this rank's own loss: average it over all ranks with an all-reduce"
                   if _agree(got, 1.0 + 2.0 * r) else
                   "rank 0 has the mean, this rank does not. Usual mistake: dist.reduce(t, dst=0) "
                   "\"because only rank 0 saves\": reduce delivers the total to dst only, the other "
                   "ranks' tensors do not hold it; every rank returns the mean, so all_reduce"
                   if rank0_right else
                   "that is the sum over ranks: divide by the world size"
                   if _agree(got, expected * WORLD) else "expected the mean over all ranks")
            raise CheckFailed(f"rank {r} returned {got:g}, expected the mean validation loss "
                              f"{expected:g}; {why}")
    writers = sorted({r for o in out for r in o["saves"]})
    if any(r != 0 for r in writers):
        raise CheckFailed(f"rank(s) {[r for r in writers if r != 0]} also called torch.save: "
                          "only rank 0 should write the checkpoint (several ranks writing one "
                          "file race each other)")
    if not os.path.exists(path):
        raise CheckFailed(f"no checkpoint at {path}: rank 0 must torch.save it there")
    ckpt = torch.load(path, map_location="cpu")
    if not isinstance(ckpt, dict) or "model" not in ckpt or "val_loss" not in ckpt:
        raise CheckFailed("the checkpoint must be a dict with keys 'model' (the state_dict) and "
                          f"'val_loss'; got {type(ckpt).__name__} "
                          f"{sorted(ckpt) if isinstance(ckpt, dict) else ''}")
    if not _agree(float(ckpt["val_loss"]), expected):
        raise CheckFailed(f"the checkpoint's val_loss is {float(ckpt['val_loss']):g}, expected "
                          f"the mean over ranks {expected:g}")
    compare_tensors(out[0]["state"], ckpt["model"], atol=0.0, what="the checkpoint's weights",
                    hint="save model.state_dict()")
    late = [r for r, o in enumerate(out) if not o["exists_at_return"]]
    if late:
        raise CheckFailed(f"rank(s) {late} returned before the checkpoint existed (rank 0 was "
                          "still writing it): end with dist.barrier() on every rank, after the "
                          "`if rank == 0:` block, so nobody reads a half-written file")


# --------------------------------------------------------------------------------------------
# 09.b  the loader of one epoch: DistributedSampler and set_epoch
# --------------------------------------------------------------------------------------------

_N_SAMPLES = 96
_BATCH = 8


def _w_epoch_loader(fn: Callable, epochs: int) -> dict:


    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank())  # ranks seed differently, as most scripts do
    dataset = IndexedDataset(make_dataset(_N_SAMPLES))
    orders, sizes, reports, seeds, problem = [], [], [], [], ""
    for epoch in range(epochs):
        loader = fn(dataset, _BATCH, epoch)
        if loader is None:
            problem = "make_loader returned None (a missing `return`?)"
            ids = []
        else:
            try:
                batches = list(loader)
            except TypeError:
                problem = f"make_loader returned a {type(loader).__name__}, not a DataLoader"
                batches = []
            ids = sample_ids(batches)
            sizes.append(len(batches[0][-1]) if batches else 0)
            sampler = getattr(loader, "sampler", None)
            if isinstance(sampler, DistributedSampler):
                seeds.append(sampler.seed)
        orders.append(ids)
        reports.append(check_duplicates(ids, _N_SAMPLES))  # a collective: every rank, every epoch
    dist.destroy_process_group()
    return {"orders": orders, "sizes": sizes, "reports": reports, "seeds": seeds, "problem": problem}


@checker("09.b distributed loader")
def check_distributed_loader(make_loader: Callable, *, timeout: float = 20.0) -> None:
    """Call ``make_loader(dataset, 8, epoch)`` for epochs 0, 1, 2 on two ranks; audit the ids."""
    require_callable(make_loader, "make_loader(dataset, batch_size, epoch)")
    epochs = 3
    def explain_error(f: RankFailure) -> str | None:
        if "mutually exclusive with shuffle" in f.message:
            return (f"rank {f.rank}: DataLoader raised ValueError: {f.message}.\nUsual mistake: "
                    "shuffle=True as well as a sampler; the sampler shuffles (DistributedSampler's "
                    "shuffle=True is its default), so give the DataLoader sampler=sampler and no "
                    "shuffle= argument")
        return None

    out = run_workers(_w_epoch_loader, WORLD, args=(make_loader, epochs), timeout=timeout,
                      hang_hint="the loader should not communicate; build it from DistributedSampler",
                      explain_error=explain_error)
    for r, o in enumerate(out):
        if o["problem"]:
            raise CheckFailed(f"rank {r}: {o['problem']}")
        if any(s != _BATCH for s in o["sizes"]):
            raise CheckFailed(f"rank {r}: batches of {o['sizes'][0]} samples, expected "
                              f"batch_size={_BATCH}")
    for epoch, rep in enumerate(out[0]["reports"]):
        seeds = [o["seeds"][epoch] if len(o["seeds"]) > epoch else None for o in out]
        if rep.shared and None not in seeds and len(set(seeds)) > 1:
            raise CheckFailed(
                f"epoch {epoch}: {len(rep.shared)} of {_N_SAMPLES} samples were seen by more "
                f"than one rank: the ranks' DistributedSamplers have different seeds "
                f"({', '.join(map(str, seeds))}). Each rank permutes the data set with its own "
                "seed and takes every world_size-th sample of that permutation, so the shards "
                "overlap and miss samples.\nUsual mistake: a seed per rank for randomness. Give "
                "every rank the same seed (the default, 0) and change the order between epochs "
                "with sampler.set_epoch(epoch)")
        if rep.shared:
            raise CheckFailed(
                f"epoch {epoch}: {len(rep.shared)} of {_N_SAMPLES} samples were seen by more "
                f"than one rank (samples per rank: {rep.counts}; e.g. ids {sorted(rep.shared)[:5]}).\n"
                "Usual mistake: a plain DataLoader(shuffle=True) on every rank reads the whole "
                "data set; give it sampler=DistributedSampler(dataset) (and no shuffle=)")
        if rep.repeated:
            raise CheckFailed(f"epoch {epoch}: some ranks saw the same sample twice "
                              f"({rep.repeated}); each sample once per epoch")
        if rep.missing:
            raise CheckFailed(f"epoch {epoch}: {len(rep.missing)} samples were seen by no rank "
                              f"(e.g. {rep.missing[:5]}); the ranks' shards must cover the data set")
    for r, o in enumerate(out):
        orders = o["orders"]
        if orders[0] == sorted(orders[0]):
            raise CheckFailed(f"rank {r} reads its shard in index order: shuffle it "
                              "(DistributedSampler(dataset, shuffle=True), its default)")
        same = [e for e in range(1, len(orders)) if orders[e] == orders[0]]
        if same:
            raise CheckFailed(
                f"rank {r}: epoch {same[0]} visits the samples in exactly the same order as epoch "
                "0.\nUsual mistake: DistributedSampler shuffles with seed + epoch, and the epoch "
                "only changes when you call sampler.set_epoch(epoch) before iterating")


# --------------------------------------------------------------------------------------------
# 09.c  metrics in different orders
# --------------------------------------------------------------------------------------------

_METRICS = [
    [{"samples": 64.0, "correct": 50.0}, {"correct": 41.0, "samples": 64.0, "skipped_nan": 1.0}],
    [{"loss_sum": 2.5}, {"loss_sum": 5.0}],
]


class _MetricName(str):
    """A metric's name that hashes differently on each rank, as names do under torchrun.

    Python salts the hash of every str with a seed drawn when the interpreter starts (unless
    PYTHONHASHSEED is set), so the workers torchrun starts iterate one set of names in different
    orders.  The checker's workers are forked from one process and share its seed; this name
    brings the difference back, deterministically (with salts 0 and 1 the set of case 0's three
    names iterates in two different orders).
    """

    salt = 0

    def __hash__(self) -> int:
        return zlib.crc32(f"{_MetricName.salt}:{self}".encode())

    def __eq__(self, other: object) -> bool:
        return str.__eq__(self, other)


def _w_sync_metrics(fn: Callable) -> list:

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    _MetricName.salt = rank
    results: list = []
    for case in _METRICS:
        try:
            got = fn({_MetricName(k): v for k, v in case[rank].items()})
            results.append({str(k): v for k, v in got.items()} if isinstance(got, dict) else got)
        except NotImplementedError:
            raise
        except Exception as e:  # usually: the partner rank finished and closed the connection
            results.append(("error", type(e).__name__, str(e).splitlines()[0][:200]))
            break
    dist.destroy_process_group()
    return results


@checker("09.c metrics order")
def check_metrics_sync(sync_metrics: Callable, *, timeout: float = 20.0) -> None:
    """Two ranks with metric dicts in different orders, one key on one rank only."""
    require_callable(sync_metrics, "sync_metrics(metrics)")
    hint = ("the ranks issued their all-reduces in different orders, or one rank had a key the "
            "other lacked and issued an extra one. Collectives match by order, not by name: agree "
            "on the keys first (dist.all_gather_object), then reduce in sorted order (a set of "
            "the keys is not in the same order on every rank: each process salts string hashes "
            "differently)")
    out = run_workers(_w_sync_metrics, WORLD, args=(sync_metrics,), timeout=timeout, hang_hint=hint,
                      error_hint=hint)
    errors = []
    for i, case in enumerate(_METRICS):
        keys = sorted({k for d in case for k in d})
        expected = {k: sum(d.get(k, 0.0) for d in case) for k in keys}
        for r in range(WORLD):
            if i >= len(out[r]):
                continue
            got = out[r][i]
            if isinstance(got, tuple) and len(got) == 3 and got[0] == "error":
                errors.append(f"rank {r} raised {got[1]}: {got[2]}")
                continue
            if not isinstance(got, dict):
                raise CheckFailed(f"rank {r}: sync_metrics returned a {type(got).__name__}; "
                                  "expected a dict of totals")
            if sorted(got) != keys:
                raise CheckFailed(
                    f"rank {r} returned the keys {sorted(got)}, expected {keys}: every key that "
                    f"any rank has (a key missing on a rank counts as 0). Inputs: {case}")
            for k in keys:
                raw = got[k]
                if isinstance(raw, torch.Tensor) and raw.numel() == 1:
                    raw = raw.item()
                v = _number(raw, f"sync_metrics()[{k!r}]", r)
                if not _agree(v, expected[k]):
                    raise CheckFailed(
                        f"rank {r}: {k} = {v:g}, expected the total {expected[k]:g} (inputs "
                        f"{case}).\nUsual mistake: {hint}")
    if errors:
        raise CheckFailed("; ".join(errors) + f"\nUsual mistake: {hint}")


# --------------------------------------------------------------------------------------------
# 09.d  NaN on one rank: skip the step on every rank
# --------------------------------------------------------------------------------------------

_NAN_STEPS = 4
_NAN_AT = 1


def _nan_batches(rank: int) -> list:

    X, Y = make_dataset(16 * _NAN_STEPS, seed=10 + rank).tensors
    batches = []
    for s in range(_NAN_STEPS):
        x, y = X[s * 16:(s + 1) * 16].clone(), Y[s * 16:(s + 1) * 16].clone()
        if rank == 1 and s == _NAN_AT:
            x[2, 3] = float("nan")  # one bad value in one sample of one rank
        batches.append((x, y))
    return batches


def _w_nan_step(fn: Callable) -> dict:


    dist.init_process_group("gloo")
    rank = dist.get_rank()
    batches = _nan_batches(rank)

    # the reference first, so that a learner's hang cannot spoil it
    ref = DDP(make_model(0, hidden=32))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in batches:
        F.cross_entropy(ref(x), y).backward()
        if all(torch.isfinite(p.grad).all() for p in ref.parameters() if p.grad is not None):
            ref_opt.step()
        ref_opt.zero_grad()
    reference = {k: v.detach().clone() for k, v in ref.module.state_dict().items()}
    del ref, ref_opt

    model = DDP(make_model(0, hidden=32))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    flags = [fn(model, opt, x, y) for x, y in batches]
    state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    del model, opt
    dist.destroy_process_group()
    return {"flags": flags, "state": state, "reference": reference}


@checker("09.d NaN skip")
def check_nan_skip_step(train_step: Callable, *, timeout: float = 20.0) -> None:
    """Four DDP steps on two ranks; rank 1's second batch holds a NaN."""
    require_callable(train_step, "train_step(model, optimizer, x, y)")
    hang = ("one rank decided alone to skip: it returned before backward() (a local "
            "`if not torch.isfinite(loss): return False`), so its DDP all-reduce never happened "
            "and the other rank waits in backward(). Decide on all ranks together: check the "
            "gradients after backward() (DDP has made them identical), or all-reduce a flag")
    out = run_workers(_w_nan_step, WORLD, args=(train_step,), timeout=timeout, hang_hint=hang,
                      error_hint=hang)
    expected = [s != _NAN_AT for s in range(_NAN_STEPS)]
    for r, o in enumerate(out):
        flags = o["flags"]
        if any(not isinstance(f, bool) for f in flags):
            raise CheckFailed(f"rank {r}: train_step returned {flags}; return True when the "
                              "optimizer stepped, False when the step was skipped")
    for s in range(_NAN_STEPS):
        decided = [o["flags"][s] for o in out]
        if len(set(decided)) > 1:
            who = ", ".join(f"rank {r} {'stepped' if d else 'skipped'}" for r, d in enumerate(decided))
            raise CheckFailed(
                f"at step {s} the ranks decided differently: {who}. The loss is each rank's own "
                "(only rank 1's holds the NaN), so a decision made from it differs between ranks, "
                "and the rank that steps applies the NaN gradients DDP gave it: the replicas "
                "diverge.\nUsual mistake: deciding from this rank's own loss. Decide from the "
                "gradients after backward() (DDP has made them identical on every rank), or "
                "all-reduce a flag")
    for r, o in enumerate(out):
        flags = o["flags"]
        if flags != expected:
            taken = [s for s, f in enumerate(flags) if f]
            if flags[_NAN_AT]:
                why = (f"step {_NAN_AT} (rank 1's batch holds a NaN) was taken: after DDP's "
                       "all-reduce every rank's gradients are NaN, and so would the weights be")
            elif not any(flags[_NAN_AT + 1:]):
                why = ("every step after the NaN was skipped too: the NaN gradients stayed in "
                       ".grad. Call optimizer.zero_grad() also when you skip")
            else:
                why = "expected only the NaN step to be skipped"
            raise CheckFailed(f"rank {r} stepped at steps {taken} of 0..{_NAN_STEPS - 1}, "
                              f"expected all but step {_NAN_AT}: {why}")
    for r, o in enumerate(out):
        bad = [k for k, v in o["state"].items() if not torch.isfinite(v).all()]
        if bad:
            raise CheckFailed(f"rank {r}: parameters {bad} hold NaN/Inf after training: the "
                              "NaN step was applied")
    _states_equal([o["state"] for o in out], "parameters",
                  "the ranks skipped different steps: the decision must be the same on all ranks")
    compare_tensors(out[0]["reference"], out[0]["state"], atol=1e-6,
                    what="parameters after 4 steps", where="rank 0",
                    hint="forward, backward, then step only when every gradient is finite; "
                    "always zero_grad()")


# --------------------------------------------------------------------------------------------
# 09.e  uneven inputs: Join
# --------------------------------------------------------------------------------------------


def _uneven_batches(rank: int) -> list:

    X, Y = make_dataset(16 * 5, seed=20 + rank).tensors
    n = 5 if rank == 0 else 3
    return [(X[i * 16:(i + 1) * 16], Y[i * 16:(i + 1) * 16]) for i in range(n)]


def _w_uneven(fn: Callable) -> dict:


    dist.init_process_group("gloo")
    rank = dist.get_rank()
    batches = _uneven_batches(rank)

    ref = DDP(make_model(0, hidden=32))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    with Join([ref]):
        for x, y in batches:
            F.cross_entropy(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
    reference = {k: v.detach().clone() for k, v in ref.module.state_dict().items()}
    del ref, ref_opt

    model = DDP(make_model(0, hidden=32))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    forwards, stepped = [0], [0]
    model.module.register_forward_pre_hook(lambda m, a: forwards.__setitem__(0, forwards[0] + 1))
    opt.register_step_post_hook(lambda o, a, k: stepped.__setitem__(0, stepped[0] + 1))
    steps = fn(model, opt, batches)
    dist.barrier()  # reached only if the learner's loop left the ranks in step
    state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    del model, opt
    dist.destroy_process_group()
    return {"steps": steps, "forwards": forwards[0], "stepped": stepped[0], "batches": len(batches),
            "state": state, "reference": reference}


@checker("09.e uneven inputs")
def check_uneven_join(train_uneven: Callable, *, timeout: float = 20.0) -> None:
    """Rank 0 has 5 batches, rank 1 has 3; the loop must use them all and not hang."""
    require_callable(train_uneven, "train_uneven(model, optimizer, batches)")
    out = run_workers(_w_uneven, WORLD, args=(train_uneven,), timeout=timeout,
               hang_hint="the rank with fewer batches left its loop while the other was still "
               "in DDP's gradient all-reduce. Wrap the loop in `with Join([model]):` "
               "(torch.distributed.algorithms.join)")
    for r, o in enumerate(out):
        if o["forwards"] < o["batches"]:
            raise CheckFailed(f"rank {r} ran the model on {o['forwards']} of its {o['batches']} "
                              "batches: train on every batch (Join lets the ranks with more "
                              "batches go on; truncating to the shortest rank throws data away)")
        steps = o["steps"]
        if not isinstance(steps, int) or isinstance(steps, bool):
            raise CheckFailed(f"rank {r}: train_uneven returned {steps!r}, expected the number "
                              f"of optimizer steps it took (an int: {o['stepped']} here)")
        if steps != o["stepped"]:
            raise CheckFailed(f"rank {r}: train_uneven returned {steps}, but optimizer.step() "
                              f"ran {o['stepped']} times on this rank; return the number of "
                              "steps this rank took")
    _states_equal([o["state"] for o in out], "parameters",
                  "the ranks trained apart (model.module bypasses DDP's all-reduce, or "
                  "no_sync() was left on)")
    padded = [r for r, o in enumerate(out) if o["forwards"] > o["batches"]]
    hint = ("forward through the DDP model, backward, step, zero_grad, inside `with Join([model]):`")
    if padded:
        o = out[padded[0]]
        hint = (f"padding: rank {padded[0]} ran the model {o['forwards']} times on its "
                f"{o['batches']} batches, and its extra steps contributed gradients, so a batch was "
                "trained on twice. A padding step must take part in the all-reduce and contribute "
                "nothing: multiply its loss by 0. Or let `with Join([model]):` do it")
    compare_tensors(out[0]["reference"], out[0]["state"], atol=1e-6, what="parameters",
                    where="rank 0", hint=hint)


# --------------------------------------------------------------------------------------------
# 09.f  evaluation without graphs
# --------------------------------------------------------------------------------------------


def _eval_batches(rank: int) -> list:

    X, Y = make_dataset(64, seed=30 + rank).tensors
    sizes = [16, 16, 16] if rank == 0 else [16, 5]  # uneven: a plain mean of means is wrong
    out, start = [], 0
    for s in sizes:
        out.append((X[start:start + s], Y[start:start + s]))
        start += s
    return out


def _w_evaluate(fn: Callable) -> dict:


    dist.init_process_group("gloo")
    rank = dist.get_rank()
    batches = _eval_batches(rank)
    model = make_model(0, hidden=32, norm=True)
    with torch.no_grad():  # non-trivial BatchNorm statistics, identical on both ranks
        model(torch.linspace(-2, 2, 32 * 8).reshape(8, 32))
    model.train()

    ref_model = copy.deepcopy(model).eval()
    with torch.no_grad():
        total = torch.tensor([sum(F.cross_entropy(ref_model(x), y, reduction="sum").item()
                                  for x, y in batches),
                              float(sum(len(y) for _, y in batches))], dtype=torch.float64)
        batch_means = torch.tensor([sum(F.cross_entropy(ref_model(x), y).item() for x, y in batches),
                                    float(len(batches))], dtype=torch.float64)
    local_mean = (total[0] / total[1]).item()
    rank_means = torch.tensor([local_mean], dtype=torch.float64)
    for t in (total, batch_means, rank_means):
        dist.all_reduce(t)
    reference = (total[0] / total[1]).item()

    buffers = {k: v.clone() for k, v in model.named_buffers()}
    saved = [0]

    def pack(t):
        saved[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        value = fn(model, batches)
    changed = [k for k, v in model.named_buffers() if "num_batches" not in k
               and not torch.equal(v, buffers[k])]
    info = {"value": value, "saved": saved[0], "changed": changed, "training": model.training,
            "reference": reference, "local_mean": local_mean,
            "mean_of_batch_means": (batch_means[0] / batch_means[1]).item(),
            "mean_of_rank_means": rank_means.item() / dist.get_world_size()}
    dist.destroy_process_group()
    if isinstance(value, torch.Tensor):  # sent back as a description, not a graph
        info["value"] = torch.tensor(0.0, requires_grad=value.requires_grad) \
            if value.requires_grad or value.grad_fn is not None else value.detach()
    return info


@checker("09.f evaluation leak")
def check_eval_no_leak(evaluate: Callable, *, timeout: float = 20.0) -> None:
    """Two ranks with uneven batches; the global mean loss, without graphs, in eval mode."""
    require_callable(evaluate, "evaluate(model, batches)")
    out = run_workers(_w_evaluate, WORLD, args=(evaluate,), timeout=timeout,
               hang_hint="every rank must take part in the same all-reduces (sum and count)")
    for r, o in enumerate(out):
        value = o["value"]
        if isinstance(value, torch.Tensor) and value.requires_grad:
            _number(value, "evaluate", r)  # raises, naming the graph
        if o["saved"]:
            raise CheckFailed(
                f"rank {r}: evaluate() made autograd save {o['saved']} tensors for a backward "
                "pass that never comes: every batch's activations stay alive as long as "
                "anything references the loss. Wrap the evaluation in torch.no_grad() "
                "(or torch.inference_mode())")
        if o["changed"]:
            raise CheckFailed(f"rank {r}: BatchNorm statistics {o['changed']} changed during "
                              "evaluation: call model.eval() first")
        if not o["training"]:
            raise CheckFailed(f"rank {r}: the model is still in eval mode after evaluate(); "
                              "call model.train() before returning, or training continues "
                              "with frozen BatchNorm statistics and no dropout")
        got = _number(value.item() if isinstance(value, torch.Tensor) and value.numel() == 1
                      else value, "evaluate", r)
        if isinstance(value, torch.Tensor):
            _number(value, "evaluate", r)
        if not _agree(got, o["reference"]):
            if _agree(got, o["local_mean"]):
                why = ("that is this rank's own mean: all-reduce the sum of losses and the "
                       "number of samples, then divide")
            elif _agree(got, o["mean_of_batch_means"]):
                why = "that is the mean of per-batch means: weight each batch by its size"
            elif _agree(got, o["mean_of_rank_means"]):
                why = ("that is the mean of the ranks' means, but the ranks hold different "
                       "numbers of samples: all-reduce the sum and the count instead")
            else:
                why = "expected sum of per-sample losses over all ranks / number of samples"
            raise CheckFailed(f"rank {r} returned {got:.6g}, expected the mean loss over every "
                              f"rank's samples {o['reference']:.6g}; {why}")
