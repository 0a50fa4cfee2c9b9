"""Chapter 09 checkers: each accepts the fix and rejects the broken script and typical half-fixes
with a message that names the mistake."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from misconceptions import cases  # tests/checkers/misconceptions.py, beside this file
from torch.distributed.algorithms.join import Join
from torch.utils.data import DataLoader, DistributedSampler, Subset

from course_utils.checking import CheckFailed
from course_utils.checks import (
    check_checkpoint_collective,
    check_distributed_loader,
    check_eval_no_leak,
    check_metrics_sync,
    check_nan_skip_step,
    check_uneven_join,
)
from course_utils.checks.ch09 import (
    a_checkpoint_collective,
    b_distributed_loader,
    c_metrics_order,
    d_nan_skip,
    e_uneven_join,
    f_eval_leak,
)

HANG = 4  # seconds: only for the answers that are expected to hang


# Every test here must leave no worker behind (the shared fixture in conftest.py).
pytestmark = pytest.mark.usefixtures("no_leftover_processes")


# ---- 09.a ----------------------------------------------------------------------------------


def _end_of_epoch(model, local_val_loss, path, *, on_rank0_only=False, reduce=True,
                  divide=True, everyone_saves=False, barrier=True, save_what="all"):
    rank = dist.get_rank()
    val = float(local_val_loss)

    def mean():
        t = torch.tensor([val])
        if reduce:
            dist.all_reduce(t)
        return t.item() / (dist.get_world_size() if divide and reduce else 1)

    if not on_rank0_only:
        val = mean()
    if rank == 0 or everyone_saves:
        if on_rank0_only:
            val = mean()
        obj = {"model": model.state_dict(), "val_loss": val} if save_what == "all" else val
        torch.save(obj, path)
    if barrier:
        dist.barrier()
    return val


def test_09a_accepts_the_fix(capsys):
    check_checkpoint_collective(_end_of_epoch)
    assert "[PASS] 09.a checkpoint collective" in capsys.readouterr().out








# ---- 09.b ----------------------------------------------------------------------------------


def _loader(dataset, batch_size, epoch, *, sampler=True, set_epoch=True, shuffle=True):
    if not sampler:
        return DataLoader(dataset, batch_size=batch_size, shuffle=True)
    s = DistributedSampler(dataset, shuffle=shuffle)
    if set_epoch:
        s.set_epoch(epoch)
    return DataLoader(dataset, batch_size=batch_size, sampler=s)


def test_09b_accepts_the_fix(capsys):
    check_distributed_loader(_loader)
    assert "[PASS] 09.b distributed loader" in capsys.readouterr().out






def test_09b_rejects_none_and_the_wrong_batch_size():
    with pytest.raises(CheckFailed, match=r"rank 0: make_loader returned None"):
        check_distributed_loader(lambda d, b, e: None)
    with pytest.raises(CheckFailed, match="batches of 4 samples, expected batch_size=8"):
        check_distributed_loader(lambda d, b, e: _loader(d, 4, e))


# ---- 09.c ----------------------------------------------------------------------------------


def _sync(metrics, *, union=True, order="sorted", op="sum", as_list=False):
    if union:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, sorted(metrics))
        keys = sorted(set().union(*everyone))
    else:
        keys = sorted(metrics)
    if order == "own":  # this rank's insertion order first, then the keys it lacks
        keys = list(metrics) + [k for k in keys if k not in metrics]
    t = torch.tensor([float(metrics.get(k, 0.0)) for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    if op == "mean":
        t /= dist.get_world_size()
    out = dict(zip(keys, t.tolist()))
    return list(out.items()) if as_list else out


def sync_broken(metrics):
    totals = {}
    for name, value in metrics.items():
        t = torch.tensor([float(value)])
        dist.all_reduce(t)
        totals[name] = t.item()
    return totals


def test_09c_accepts_the_fix(capsys):
    check_metrics_sync(_sync)
    assert "[PASS] 09.c metrics order" in capsys.readouterr().out






# ---- 09.d ----------------------------------------------------------------------------------


def _step(model, optimizer, x, y, *, guard="grads", zero_when_skipping=True):
    loss = F.cross_entropy(model(x), y)
    if guard == "local loss" and not torch.isfinite(loss):
        return False
    if guard == "flag":  # agree before backward: skip the whole step on every rank
        bad = torch.tensor([0.0 if torch.isfinite(loss) else 1.0])
        dist.all_reduce(bad)
        if bad.item() > 0:
            return False
    loss.backward()
    if guard == "grads isnan":  # "non-finite means NaN": an overflow (+inf) passes this guard
        ok = not any(torch.isnan(p.grad).any() for p in model.parameters() if p.grad is not None)
    else:
        ok = guard != "grads" or all(torch.isfinite(p.grad).all() for p in model.parameters()
                                     if p.grad is not None)
    if ok:
        optimizer.step()
    if ok or zero_when_skipping:
        optimizer.zero_grad()
    return bool(ok)


def test_09d_accepts_the_fix(capsys):
    check_nan_skip_step(_step)
    assert "[PASS] 09.d NaN skip" in capsys.readouterr().out


def test_09d_accepts_a_flag_agreed_before_backward(capsys):
    check_nan_skip_step(lambda m, o, x, y: _step(m, o, x, y, guard="flag"))
    assert "[PASS] 09.d NaN skip" in capsys.readouterr().out






# ---- 09.e ----------------------------------------------------------------------------------


def _uneven(model, optimizer, batches, *, join=True, truncate=False, local=False):
    if truncate:
        n = torch.tensor([len(batches)])
        dist.all_reduce(n, op=dist.ReduceOp.MIN)
        batches = batches[: int(n)]
    net = model.module if local else model
    steps = 0
    with Join([model], enable=join and not local):
        for x, y in batches:
            F.cross_entropy(net(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    return steps


def test_09e_accepts_the_fix(capsys):
    check_uneven_join(_uneven)
    assert "[PASS] 09.e uneven inputs" in capsys.readouterr().out





def test_09e_rejects_a_missing_step_count():
    with pytest.raises(CheckFailed, match="train_uneven returned None, expected the number of "
                                          "optimizer steps it took"):
        check_uneven_join(lambda m, o, b: [_uneven(m, o, b), None][1])


# ---- 09.f ----------------------------------------------------------------------------------


def _evaluate(model, batches, *, no_grad=True, item=True, eval_mode=True, restore=True,
              reduce=True, per_batch=False):
    if eval_mode:
        model.eval()
    totals = torch.zeros(2, dtype=torch.float64)
    tensor_total = 0.0
    with torch.no_grad() if no_grad else torch.enable_grad():
        for x, y in batches:
            if per_batch:
                loss, n = F.cross_entropy(model(x), y), 1
            else:
                loss, n = F.cross_entropy(model(x), y, reduction="sum"), len(y)
            if item:
                totals[0] += loss.item()
            else:
                tensor_total = tensor_total + loss
            totals[1] += n
    if reduce:
        dist.all_reduce(totals)
    if restore:
        model.train()
    if not item:
        return tensor_total / totals[1]
    return (totals[0] / totals[1]).item()


def test_09f_accepts_the_fix(capsys):
    check_eval_no_leak(_evaluate)
    assert "[PASS] 09.f evaluation leak" in capsys.readouterr().out








# ---- misconceptions added with the catalogue, and correct answers written differently ----------


def end_of_epoch_barrier_inside_if(model, local_val_loss, path):
    t = torch.tensor([float(local_val_loss)])
    dist.all_reduce(t)
    val = t.item() / dist.get_world_size()
    if dist.get_rank() == 0:
        torch.save({"model": model.state_dict(), "val_loss": val}, path)
        dist.barrier()  # "the others must wait for the save": but only rank 0 is here
    return val


def end_of_epoch_reduce_to_rank_0(model, local_val_loss, path):
    t = torch.tensor([float(local_val_loss)])
    dist.reduce(t, dst=0)  # "only rank 0 saves, so only rank 0 needs the mean"
    val = t.item() / dist.get_world_size()
    if dist.get_rank() == 0:
        torch.save({"model": model.state_dict(), "val_loss": val}, path)
    dist.barrier()
    return val


def end_of_epoch_all_gather(model, local_val_loss, path):
    losses = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(losses, torch.tensor([float(local_val_loss)]))
    val = float(torch.cat(losses).mean())
    if dist.get_rank() == 0:
        torch.save({"model": model.state_dict(), "val_loss": val}, path)
    dist.barrier()
    return val


def end_of_epoch_objects_and_broadcast(model, local_val_loss, path):
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, float(local_val_loss))
    val = sum(everyone) / len(everyone)
    done = torch.zeros(1)
    if dist.get_rank() == 0:
        torch.save({"model": model.state_dict(), "val_loss": val}, path)
        done += 1
    dist.broadcast(done, src=0)  # rank 0 sends only once the file is written
    return val


def end_of_epoch_tensor_mean(model, local_val_loss, path):
    t = torch.tensor([float(local_val_loss)])
    dist.all_reduce(t)
    val = t / dist.get_world_size()  # "a loss is a tensor"
    if dist.get_rank() == 0:
        torch.save({"model": model.state_dict(), "val_loss": val.item()}, path)
    dist.barrier()
    return val


@pytest.mark.parametrize("fn", [end_of_epoch_all_gather, end_of_epoch_objects_and_broadcast],
                         ids=lambda f: f.__name__)
def test_09a_accepts_other_collectives(fn, capsys):
    check_checkpoint_collective(fn)
    assert "[PASS] 09.a checkpoint collective" in capsys.readouterr().out





def loader_seed_per_rank(dataset, batch_size, epoch):
    sampler = DistributedSampler(dataset, seed=dist.get_rank())  # "each rank its own randomness"
    sampler.set_epoch(epoch)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def loader_shuffle_and_sampler(dataset, batch_size, epoch):
    sampler = DistributedSampler(dataset)
    sampler.set_epoch(epoch)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, shuffle=True)


def loader_seeded_by_epoch(dataset, batch_size, epoch):
    sampler = DistributedSampler(dataset, num_replicas=dist.get_world_size(), rank=dist.get_rank(),
                                 seed=epoch)  # the same seed on every rank, a new one each epoch
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def loader_by_hand(dataset, batch_size, epoch):
    g = torch.Generator().manual_seed(1000 + epoch)  # the same permutation on every rank
    order = torch.randperm(len(dataset), generator=g)
    mine = order[dist.get_rank()::dist.get_world_size()].tolist()
    return DataLoader(Subset(dataset, mine), batch_size=batch_size)


@pytest.mark.parametrize("fn", [loader_seeded_by_epoch, loader_by_hand], ids=lambda f: f.__name__)
def test_09b_accepts_other_shardings(fn, capsys):
    check_distributed_loader(fn)
    assert "[PASS] 09.b distributed loader" in capsys.readouterr().out




def sync_sorted_local_keys(metrics):
    keys = sorted(metrics)  # "sorting makes the order the same on every rank"
    t = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    return dict(zip(keys, t.tolist()))


def sync_in_set_order(metrics):
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, list(metrics))
    keys = set().union(*everyone)  # "the same keys on every rank, so the same set"
    t = torch.tensor([float(metrics.get(k, 0.0)) for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    return dict(zip(keys, t.tolist()))


def sync_one_key_at_a_time_in_agreed_order(metrics):
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, list(metrics))
    totals = {}
    for k in sorted(set().union(*everyone)):  # many collectives, but the same ones everywhere
        t = torch.tensor([float(metrics.get(k, 0.0))], dtype=torch.float64)
        dist.all_reduce(t)
        totals[k] = t.item()
    return totals


def sync_gather_the_dicts(metrics):
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, dict(metrics))
    keys = set().union(*everyone)
    return {k: sum(d.get(k, 0.0) for d in everyone) for k in keys}


@pytest.mark.parametrize("fn", [sync_one_key_at_a_time_in_agreed_order, sync_gather_the_dicts],
                         ids=lambda f: f.__name__)
def test_09c_accepts_other_collectives(fn, capsys):
    check_metrics_sync(fn)
    assert "[PASS] 09.c metrics order" in capsys.readouterr().out




def step_own_loss_after_backward(model, optimizer, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()  # every rank takes part in the all-reduce now...
    if not torch.isfinite(loss):  # ...but decides from its own loss
        optimizer.zero_grad()
        return False
    optimizer.step()
    optimizer.zero_grad()
    return True


def step_total_norm(model, optimizer, x, y):
    F.cross_entropy(model(x), y).backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    ok = bool(torch.isfinite(norm))  # NaN anywhere makes the norm NaN, on every rank alike
    if ok:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return ok


def step_gathered_flags(model, optimizer, x, y):
    loss = F.cross_entropy(model(x), y)
    flags = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(flags, torch.tensor([float(torch.isfinite(loss))]))
    loss.backward()
    ok = all(f.item() == 1.0 for f in flags)
    if ok:
        optimizer.step()
    optimizer.zero_grad()
    return ok


@pytest.mark.parametrize("fn", [step_total_norm, step_gathered_flags], ids=lambda f: f.__name__)
def test_09d_accepts_other_agreements(fn, capsys):
    check_nan_skip_step(fn)
    assert "[PASS] 09.d NaN skip" in capsys.readouterr().out



def uneven_ddp_join(model, optimizer, batches):
    steps = 0
    with model.join():  # DDP's own shortcut for Join([model])
        for x, y in batches:
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    return steps


def uneven_padded(model, optimizer, batches):
    n = torch.tensor([len(batches)])
    dist.all_reduce(n, op=dist.ReduceOp.MAX)  # every rank runs as many steps as the longest
    steps = 0
    for i in range(int(n)):
        x, y = batches[min(i, len(batches) - 1)]
        loss = F.cross_entropy(model(x), y)
        if i >= len(batches):
            loss = loss * 0  # a padding step: takes part in the all-reduce, contributes nothing
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
    return steps


def uneven_padded_with_a_real_batch(model, optimizer, batches):
    n = torch.tensor([len(batches)])
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    for i in range(int(n)):
        x, y = batches[i % len(batches)]  # "reuse a batch to keep the ranks in step"
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return int(n)


def uneven_counts_batches_not_steps(model, optimizer, batches):
    _uneven(model, optimizer, batches)
    return 5  # "the longest rank's count"


@pytest.mark.parametrize("fn", [uneven_ddp_join, uneven_padded], ids=lambda f: f.__name__)
def test_09e_accepts_other_ways_to_even_out(fn, capsys):
    check_uneven_join(fn)
    assert "[PASS] 09.e uneven inputs" in capsys.readouterr().out




def evaluate_inference_mode(model, batches):
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        loss_sum = sum(F.cross_entropy(model(x), y, reduction="sum") for x, y in batches)
        count = torch.tensor(float(sum(len(y) for _, y in batches)))
        both = torch.stack([loss_sum.double(), count.double()])
        dist.all_reduce(both)  # inside inference_mode: an inference tensor cannot change outside
    model.train(was_training)
    return (both[0] / both[1]).item()


@torch.no_grad()
def evaluate_decorated_two_reduces(model, batches):
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64)
    count = torch.zeros((), dtype=torch.float64)
    for x, y in batches:
        loss_sum += F.cross_entropy(model(x), y, reduction="none").double().sum()
        count += len(y)
    dist.all_reduce(loss_sum)
    dist.all_reduce(count)
    model.train()
    return float(loss_sum / count)


def evaluate_mean_of_rank_means(model, batches):
    model.eval()
    with torch.no_grad():
        loss_sum = sum(F.cross_entropy(model(x), y, reduction="sum").item() for x, y in batches)
        mean = torch.tensor([loss_sum / sum(len(y) for _, y in batches)], dtype=torch.float64)
    dist.all_reduce(mean)  # "the average of the ranks' averages"
    model.train()
    return mean.item() / dist.get_world_size()


@pytest.mark.parametrize("fn", [evaluate_inference_mode, evaluate_decorated_two_reduces],
                         ids=lambda f: f.__name__)
def test_09f_accepts_other_ways_without_graphs(fn, capsys):
    check_eval_no_leak(fn)
    assert "[PASS] 09.f evaluation leak" in capsys.readouterr().out



# ---- each catalogue's misconceptions, by the name of the wrong answer written with them ---------


def end_of_epoch_collective_on_rank_0_only(model, local_val_loss, path):
    return _end_of_epoch(model, local_val_loss, path, on_rank0_only=True)


def end_of_epoch_local_loss(model, local_val_loss, path):
    return _end_of_epoch(model, local_val_loss, path, reduce=False)


def end_of_epoch_sum(model, local_val_loss, path):
    return _end_of_epoch(model, local_val_loss, path, divide=False)


def end_of_epoch_everyone_saves(model, local_val_loss, path):
    return _end_of_epoch(model, local_val_loss, path, everyone_saves=True)


def end_of_epoch_no_barrier(model, local_val_loss, path):
    return _end_of_epoch(model, local_val_loss, path, barrier=False)


def end_of_epoch_saves_only_the_loss(model, local_val_loss, path):
    return _end_of_epoch(model, local_val_loss, path, save_what="loss")


def loader_plain(dataset, batch_size, epoch):
    return _loader(dataset, batch_size, epoch, sampler=False)


def loader_without_set_epoch(dataset, batch_size, epoch):
    return _loader(dataset, batch_size, epoch, set_epoch=False)


def loader_unshuffled(dataset, batch_size, epoch):
    return _loader(dataset, batch_size, epoch, shuffle=False)


def loader_strided(dataset, batch_size, epoch):  # a hand-made shard that forgets the tail
    rank = dist.get_rank()
    return DataLoader(Subset(dataset, range(rank, 80, 2)), batch_size=batch_size, shuffle=True)


def loader_fixed_shards(dataset, batch_size, epoch):  # shuffled, but always the same half
    rank = dist.get_rank()
    return DataLoader(Subset(dataset, range(rank, len(dataset), 2)), batch_size=batch_size, shuffle=True)


def loader_repeats_epoch_1(dataset, batch_size, epoch):  # epoch 2 repeats epoch 1, not epoch 0
    return _loader(dataset, batch_size, min(epoch, 1))


def test_09b_compares_every_pair_of_epochs():
    with pytest.raises(CheckFailed, match=r"rank 0: epoch 2 visits the samples in exactly the same "
                                          r"order as epoch 1"):
        check_distributed_loader(loader_repeats_epoch_1)


def sync_in_own_order(metrics):
    return _sync(metrics, order="own")


def sync_mean(metrics):
    return _sync(metrics, op="mean")


def sync_as_list(metrics):
    return _sync(metrics, as_list=True)


def step_local_skip(model, optimizer, x, y):
    return _step(model, optimizer, x, y, guard="local loss")


def step_no_guard(model, optimizer, x, y):
    return _step(model, optimizer, x, y, guard="none")


def step_nan_only(model, optimizer, x, y):
    return _step(model, optimizer, x, y, guard="grads isnan")


def step_keeps_nan_gradients(model, optimizer, x, y):
    return _step(model, optimizer, x, y, zero_when_skipping=False)


def step_without_return(model, optimizer, x, y):
    _step(model, optimizer, x, y)


def uneven_plain_loop(model, optimizer, batches):
    return _uneven(model, optimizer, batches, join=False)


def uneven_truncated(model, optimizer, batches):
    return _uneven(model, optimizer, batches, truncate=True)


def uneven_without_ddp(model, optimizer, batches):
    return _uneven(model, optimizer, batches, local=True)


def evaluate_tensor_total(model, batches):
    return _evaluate(model, batches, no_grad=False, item=False)


def evaluate_with_grad(model, batches):
    return _evaluate(model, batches, no_grad=False)


def evaluate_in_training_mode(model, batches):
    return _evaluate(model, batches, eval_mode=False)


def evaluate_leaves_eval_mode(model, batches):
    return _evaluate(model, batches, restore=False)


def evaluate_local_mean(model, batches):
    return _evaluate(model, batches, reduce=False)


def evaluate_mean_of_batch_means(model, batches):
    return _evaluate(model, batches, per_batch=True)


def _wrong(*answers):
    """{name: (answer, what the failure must match, timeout)}; a hang gets the short HANG timeout."""
    return {fn.__name__: (fn, message, timeout) for fn, message, timeout in answers}


WRONG_A = _wrong(
    (end_of_epoch_collective_on_rank_0_only,
     r"(?s)hung.*rank 0 was stuck here:.*dist\.all_reduce.*rank 1 was stuck here:.*dist\.barrier\(\).*"
     r"only under `if rank == 0:`", HANG),
    (end_of_epoch_local_loss,
     r"rank 0 returned 1, expected the mean validation loss 2; that is this rank's own loss", None),
    (end_of_epoch_sum, "that is the sum over ranks: divide by the world size", None),
    (end_of_epoch_everyone_saves, r"rank\(s\) \[1\] also called torch.save", None),
    (end_of_epoch_no_barrier, r"rank\(s\) \[1\] returned before the checkpoint existed", None),
    (end_of_epoch_saves_only_the_loss, "must be a dict with keys 'model'", None),
    (end_of_epoch_barrier_inside_if,
     r"(?s)hung.*rank 0 was stuck here:.*dist\.barrier\(\).*or the barrier itself\) is called only "
     r"under `if rank == 0:`.*put the barrier after the `if`", HANG),
    (end_of_epoch_reduce_to_rank_0,
     r"rank 1 returned [-\d.e]+, expected the mean validation loss 2; rank 0 has the mean, this "
     r"rank does not.*dist\.reduce", None),
    (end_of_epoch_tensor_mean, r"rank 0: end_of_epoch returned a torch.Tensor; return a Python float", None),
)

WRONG_B = _wrong(
    (loader_plain, r"(?s)epoch 0: 96 of 96 samples were seen by more than one rank.*DistributedSampler",
     None),
    (loader_without_set_epoch,
     r"(?s)rank 0: epoch 1 visits the samples in exactly the same order as epoch 0.*set_epoch\(epoch\)",
     None),
    (loader_unshuffled, "reads its shard in index order: shuffle it", None),
    (loader_strided, "epoch 0: 16 samples were seen by no rank", None),
    (loader_seed_per_rank,
     r"(?s)seen by more than one rank.*DistributedSamplers have different seeds \(0, 1\).*same seed", None),
    (loader_shuffle_and_sampler, r"(?s)mutually exclusive.*the sampler shuffles.*no shuffle=", None),
    (loader_fixed_shards, r"(?s)every rank read the same 48 samples in each of the 3 epochs.*the split "
                          r"is fixed.*set_epoch", None),
)

WRONG_C = _wrong(
    (sync_broken, r"rank 0 returned the keys \['correct', 'samples'\], "
                  r"expected \['correct', 'samples', 'skipped_nan'\]", None),
    (sync_in_own_order,
     r"(?s)rank 0: correct = 114, expected the total 91.*Collectives match by order, not by name", None),
    (sync_mean, "correct = 45.5, expected the total 91", None),
    (sync_as_list, "sync_metrics returned a list; expected a dict", None),
    (sync_in_set_order, r"(?s)rank 0: \w+ = .*expected the total.*a set of the keys is not in the same "
                        r"order on every rank", None),
    (sync_sorted_local_keys, r"(?s)one rank had a key the other lacked.*agree on the keys first", HANG),
)

WRONG_D = _wrong(
    (step_local_skip, "one rank decided alone to skip", HANG),
    (step_no_guard, r"rank 0 stepped at steps \[0, 1, 2, 3, 4\].*step 1 \(rank 1's batch holds a NaN\) "
                    r"was taken", None),
    (step_nan_only, r"rank 0 stepped at steps \[0, 2, 3, 4\].*expected all but steps 1 and 3: step 3 was "
                    r"taken: its loss and one gradient are \+inf.*torch\.isnan alone.*torch\.isfinite", None),
    (step_keeps_nan_gradients, r"stepped at steps \[0\].*every step after the NaN was skipped too.*"
                               r"zero_grad\(\) also when you skip", None),
    (step_without_return, r"rank 0: train_step returned \[None, None, None, None, None\]", None),
    (step_own_loss_after_backward, r"(?s)at step 1 the ranks decided differently: rank 0 stepped, rank 1 "
                                   r"skipped.*own loss.*gradients", None),
)

WRONG_E = _wrong(
    (uneven_plain_loop, r"(?s)hung.*rank 0 was stuck here:.*\.backward\(\).*with Join\(\[model\]\)", HANG),
    (uneven_truncated, "rank 0 ran the model on 3 of its 5 batches", None),
    (uneven_without_ddp, r"(?s)parameters of rank 1 vs rank 0 differ.*trained apart", None),
    (uneven_padded_with_a_real_batch, r"(?s)parameters on rank 0 differ.*padding: rank 1 ran the model 5 "
                                      r"times on its 3 batches.*multiply its loss by 0", None),
    (uneven_counts_batches_not_steps, r"rank 1: train_uneven returned 5, but optimizer.step\(\) ran 3 times",
     None),
)

WRONG_F = _wrong(
    (evaluate_tensor_total, "returned a torch.Tensor that still carries an autograd graph", None),
    (evaluate_with_grad, r"evaluate\(\) made autograd save \d+ tensors.*torch.no_grad\(\)", None),
    (evaluate_in_training_mode, r"BatchNorm statistics .* changed during evaluation: call model.eval\(\) "
                                r"first", None),
    (evaluate_leaves_eval_mode, "still in eval mode after evaluate", None),
    (evaluate_local_mean, "that is this rank's own mean", None),
    (evaluate_mean_of_batch_means, "mean of per-batch means: weight each batch by its size", None),
    (evaluate_mean_of_rank_means, "mean of the ranks' means.*all-reduce the sum and the count", None),
)


# Every exercise's catalogue, with its checker and its wrong answers.
CATALOGUED = [
    (check_checkpoint_collective, a_checkpoint_collective.CATALOGUE, WRONG_A),
    (check_distributed_loader, b_distributed_loader.CATALOGUE, WRONG_B),
    (check_metrics_sync, c_metrics_order.CATALOGUE, WRONG_C),
    (check_nan_skip_step, d_nan_skip.CATALOGUE, WRONG_D),
    (check_uneven_join, e_uneven_join.CATALOGUE, WRONG_E),
    (check_eval_no_leak, f_eval_leak.CATALOGUE, WRONG_F),
]


@pytest.mark.parametrize("check, mistake, wrong", [
    pytest.param(check, *case.values, id=f"{catalogue.exercise[:4]}-{case.id}")
    for check, catalogue, wrong in CATALOGUED for case in cases(catalogue, wrong)])
def test_rejects_the_catalogued_mistakes(check, mistake, wrong):
    fn, message, timeout = wrong
    kwargs = {} if timeout is None else {"timeout": timeout}
    with pytest.raises(CheckFailed, match=message) as info:
        check(fn, **kwargs)
    assert mistake.message in info.value.args[0]
