"""Chapter 09 checkers: each accepts the fix and rejects the broken script and typical half-fixes
with a message that names the mistake."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
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


def test_09a_rejects_the_collective_on_rank_0_only():
    with pytest.raises(CheckFailed, match=r"(?s)hung.*rank 0 was stuck here:.*dist\.all_reduce"
                                          r".*rank 1 was stuck here:.*dist\.barrier\(\).*only under "
                                          r"`if rank == 0:`"):
        check_checkpoint_collective(lambda m, v, p: _end_of_epoch(m, v, p, on_rank0_only=True),
                                    timeout=HANG)


def test_09a_rejects_the_local_loss():
    with pytest.raises(CheckFailed, match=r"rank 0 returned 1, expected the mean validation loss 2; "
                                          r"that is this rank's own loss"):
        check_checkpoint_collective(lambda m, v, p: _end_of_epoch(m, v, p, reduce=False))


def test_09a_rejects_the_sum():
    with pytest.raises(CheckFailed, match="that is the sum over ranks: divide by the world size"):
        check_checkpoint_collective(lambda m, v, p: _end_of_epoch(m, v, p, divide=False))


def test_09a_rejects_every_rank_saving():
    with pytest.raises(CheckFailed, match=r"rank\(s\) \[1\] also called torch.save"):
        check_checkpoint_collective(lambda m, v, p: _end_of_epoch(m, v, p, everyone_saves=True))


def test_09a_rejects_a_missing_barrier():
    with pytest.raises(CheckFailed, match=r"rank\(s\) \[1\] returned before the checkpoint existed"):
        check_checkpoint_collective(lambda m, v, p: _end_of_epoch(m, v, p, barrier=False))


def test_09a_rejects_a_checkpoint_without_the_model():
    with pytest.raises(CheckFailed, match="must be a dict with keys 'model'"):
        check_checkpoint_collective(lambda m, v, p: _end_of_epoch(m, v, p, save_what="loss"))


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


def test_09b_rejects_a_plain_loader():
    with pytest.raises(CheckFailed, match=r"(?s)epoch 0: 96 of 96 samples were seen by more than "
                                          r"one rank.*DistributedSampler"):
        check_distributed_loader(lambda d, b, e: _loader(d, b, e, sampler=False))


def test_09b_rejects_a_missing_set_epoch():
    with pytest.raises(CheckFailed, match=r"(?s)rank 0: epoch 1 visits the samples in exactly the "
                                          r"same order as epoch 0.*set_epoch\(epoch\)"):
        check_distributed_loader(lambda d, b, e: _loader(d, b, e, set_epoch=False))


def test_09b_rejects_an_unshuffled_shard():
    with pytest.raises(CheckFailed, match="reads its shard in index order: shuffle it"):
        check_distributed_loader(lambda d, b, e: _loader(d, b, e, shuffle=False))


def test_09b_rejects_shards_that_miss_samples():
    def strided(dataset, batch_size, epoch):  # a hand-made shard that forgets the tail
        rank = dist.get_rank()
        return DataLoader(Subset(dataset, range(rank, 80, 2)), batch_size=batch_size, shuffle=True)

    with pytest.raises(CheckFailed, match="epoch 0: 16 samples were seen by no rank"):
        check_distributed_loader(strided)


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


def test_09c_rejects_the_broken_loop():
    with pytest.raises(CheckFailed, match=r"rank 0 returned the keys \['correct', 'samples'\], "
                                          r"expected \['correct', 'samples', 'skipped_nan'\]"):
        check_metrics_sync(sync_broken)


def test_09c_rejects_each_rank_in_its_own_order():
    with pytest.raises(CheckFailed, match=r"(?s)rank 0: correct = 114, expected the total 91.*"
                                          r"Collectives match by order, not by name"):
        check_metrics_sync(lambda m: _sync(m, order="own"))


def test_09c_rejects_the_mean():
    with pytest.raises(CheckFailed, match="correct = 45.5, expected the total 91"):
        check_metrics_sync(lambda m: _sync(m, op="mean"))


def test_09c_rejects_a_list():
    with pytest.raises(CheckFailed, match="sync_metrics returned a list; expected a dict"):
        check_metrics_sync(lambda m: _sync(m, as_list=True))


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


def test_09d_rejects_a_local_skip():
    with pytest.raises(CheckFailed, match="one rank decided alone to skip"):
        check_nan_skip_step(lambda m, o, x, y: _step(m, o, x, y, guard="local loss"),
                            timeout=HANG)


def test_09d_rejects_no_guard():
    with pytest.raises(CheckFailed, match=r"rank 0 stepped at steps \[0, 1, 2, 3\].*step 1 \(rank "
                                          r"1's batch holds a NaN\) was taken"):
        check_nan_skip_step(lambda m, o, x, y: _step(m, o, x, y, guard="none"))


def test_09d_rejects_stale_nan_gradients():
    with pytest.raises(CheckFailed, match=r"stepped at steps \[0\].*every step after the NaN was "
                                          r"skipped too.*zero_grad\(\) also when you skip"):
        check_nan_skip_step(lambda m, o, x, y: _step(m, o, x, y, zero_when_skipping=False))


def test_09d_rejects_a_missing_return():
    with pytest.raises(CheckFailed, match=r"rank 0: train_step returned \[None, None, None, None\]"):
        check_nan_skip_step(lambda m, o, x, y: [_step(m, o, x, y), None][1])


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


def test_09e_rejects_the_plain_loop():
    with pytest.raises(CheckFailed, match=r"(?s)hung.*rank 0 was stuck here:.*\.backward\(\).*"
                                          r"with Join\(\[model\]\)"):
        check_uneven_join(lambda m, o, b: _uneven(m, o, b, join=False), timeout=HANG)


def test_09e_rejects_truncation():
    with pytest.raises(CheckFailed, match="rank 0 ran the model on 3 of its 5 batches"):
        check_uneven_join(lambda m, o, b: _uneven(m, o, b, truncate=True))


def test_09e_rejects_training_without_ddp():
    with pytest.raises(CheckFailed, match=r"(?s)parameters of rank 1 vs rank 0 differ.*trained apart"):
        check_uneven_join(lambda m, o, b: _uneven(m, o, b, local=True))


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


def test_09f_rejects_a_tensor_total():
    with pytest.raises(CheckFailed, match="returned a torch.Tensor that still carries an autograd graph"):
        check_eval_no_leak(lambda m, b: _evaluate(m, b, no_grad=False, item=False))


def test_09f_rejects_a_graph_built_in_evaluation():
    with pytest.raises(CheckFailed, match=r"evaluate\(\) made autograd save \d+ tensors.*"
                                          r"torch.no_grad\(\)"):
        check_eval_no_leak(lambda m, b: _evaluate(m, b, no_grad=False))


def test_09f_rejects_training_mode():
    with pytest.raises(CheckFailed, match="BatchNorm statistics .* changed during evaluation: call "
                                          r"model.eval\(\) first"):
        check_eval_no_leak(lambda m, b: _evaluate(m, b, eval_mode=False))


def test_09f_rejects_leaving_eval_mode_on():
    with pytest.raises(CheckFailed, match="still in eval mode after evaluate"):
        check_eval_no_leak(lambda m, b: _evaluate(m, b, restore=False))


def test_09f_rejects_the_local_mean():
    with pytest.raises(CheckFailed, match="that is this rank's own mean"):
        check_eval_no_leak(lambda m, b: _evaluate(m, b, reduce=False))


def test_09f_rejects_a_mean_of_batch_means():
    with pytest.raises(CheckFailed, match="mean of per-batch means: weight each batch by its size"):
        check_eval_no_leak(lambda m, b: _evaluate(m, b, per_batch=True))


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


def test_09a_rejects_a_barrier_inside_the_if():
    with pytest.raises(CheckFailed, match=r"(?s)hung.*rank 0 was stuck here:.*dist\.barrier\(\).*"
                                          r"or the barrier itself\) is called only under `if rank == "
                                          r"0:`.*put the barrier after the `if`"):
        check_checkpoint_collective(end_of_epoch_barrier_inside_if, timeout=HANG)


def test_09a_rejects_a_reduce_to_rank_0():
    with pytest.raises(CheckFailed, match=r"rank 1 returned [-\d.e]+, expected the mean validation loss 2; "
                                          r"rank 0 has the mean, this rank does not.*dist\.reduce"):
        check_checkpoint_collective(end_of_epoch_reduce_to_rank_0)


def test_09a_rejects_a_tensor_mean():
    with pytest.raises(CheckFailed, match=r"rank 0: end_of_epoch returned a torch.Tensor; return a "
                                          r"Python float"):
        check_checkpoint_collective(end_of_epoch_tensor_mean)


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


def test_09b_rejects_a_seed_per_rank():
    with pytest.raises(CheckFailed, match=r"(?s)seen by more than one rank.*DistributedSamplers have "
                                          r"different seeds \(0, 1\).*same seed"):
        check_distributed_loader(loader_seed_per_rank)


def test_09b_rejects_shuffle_as_well_as_a_sampler():
    with pytest.raises(CheckFailed, match=r"(?s)mutually exclusive.*the sampler shuffles.*no shuffle="):
        check_distributed_loader(loader_shuffle_and_sampler)


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


def test_09c_rejects_a_set_order():
    with pytest.raises(CheckFailed, match=r"(?s)rank 0: \w+ = .*expected the total.*a set of the keys "
                                          r"is not in the same order on every rank"):
        check_metrics_sync(sync_in_set_order)


def test_09c_rejects_sorting_the_local_keys():
    with pytest.raises(CheckFailed, match=r"(?s)one rank had a key the other lacked.*agree on the "
                                          r"keys first"):
        check_metrics_sync(sync_sorted_local_keys, timeout=HANG)


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


def test_09d_rejects_a_decision_from_the_local_loss_after_backward():
    with pytest.raises(CheckFailed, match=r"(?s)at step 1 the ranks decided differently: rank 0 "
                                          r"stepped, rank 1 skipped.*own loss.*gradients"):
        check_nan_skip_step(step_own_loss_after_backward)


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


def test_09e_rejects_padding_that_trains_twice_on_a_batch():
    with pytest.raises(CheckFailed, match=r"(?s)parameters on rank 0 differ.*padding: rank 1 ran the "
                                          r"model 5 times on its 3 batches.*multiply its loss by 0"):
        check_uneven_join(uneven_padded_with_a_real_batch)


def test_09e_rejects_a_step_count_that_is_not_its_own():
    with pytest.raises(CheckFailed, match=r"rank 1: train_uneven returned 5, but optimizer.step\(\) "
                                          r"ran 3 times"):
        check_uneven_join(uneven_counts_batches_not_steps)


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


def test_09f_rejects_a_mean_of_rank_means():
    with pytest.raises(CheckFailed, match="mean of the ranks' means.*all-reduce the sum and the count"):
        check_eval_no_leak(evaluate_mean_of_rank_means)
