"""Chapter 09's fault labs as tests: each failure is provoked in real workers and the diagnosis
the lesson relies on is asserted (error texts, stacks, DETAIL's mismatch report, the rank named
by monitored_barrier, the duplicate detector, the NaN spread, the leak's graph growth)."""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from course_utils import WorkerError, WorkerTimeout, diagnose, free_port, launch
from course_utils.data import make_dataset, make_model

HANG = 3.0  # seconds before a lab is declared hung (the hang itself is the point)


# Every test here must leave no worker behind (the shared fixture in conftest.py).
pytestmark = pytest.mark.usefixtures("no_leftover_processes")


# ---- 1. hang at initialisation ---------------------------------------------------------------


def _join_with(bad_env, ranks=(1,), timeouts=(1.5, 1.5)):
    rank = int(os.environ["RANK"])
    if rank in ranks:
        os.environ.update(bad_env)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeouts[rank]))
    dist.destroy_process_group()


def _init_failure(e: WorkerError, rank: int):
    f = e.failures[rank]
    assert f.kind == "exception", f.describe()
    return f


def test_wrong_master_port_rank0_waits_for_rank1():
    # rank 1 (wrong port) keeps trying longer, so rank 0's timeout comes first
    with pytest.raises(WorkerError) as info:
        launch(_join_with, 2, args=({"MASTER_PORT": str(free_port())},), kwargs={"timeouts": (1.5, 20)},
               timeout=30)
    f = _init_failure(info.value, 0)
    assert f.exc_type == "DistStoreError" and "wait timeout" in f.message
    assert f.message.rstrip().endswith("/1")  # the key of the missing rank


def test_wrong_master_port_the_socket_check_says_refused():
    def check_on_rank1():
        if int(os.environ["RANK"]) == 1:
            good = diagnose.check_rendezvous(show=False)
            os.environ["MASTER_PORT"] = str(free_port())
            bad = diagnose.check_rendezvous(show=False)
            return [c.ok for c in good], [c.ok for c in bad], bad[-1].detail
    good, bad, detail = launch(check_on_rank1, 2, timeout=20)[1]
    assert good == [True, True] and bad == [True, False] and "refused" in detail


def test_world_size_too_large_every_rank_waits_for_rank2():
    with pytest.raises(WorkerError) as info:
        launch(_join_with, 2, args=({"WORLD_SIZE": "3"}, (0, 1)), timeout=30)
    failed = [f for f in info.value.failures.values() if f.kind == "exception"]
    assert failed and all(f.message.rstrip().endswith("/2") for f in failed)


def test_unresolvable_master_addr():
    assert "does not resolve" in diagnose.check_address("master-node.invalid").detail
    with pytest.raises(WorkerError) as info:
        launch(_join_with, 2, args=({"MASTER_ADDR": "master-node.invalid"},),
               kwargs={"timeouts": (20, 1.5)}, timeout=30)
    f = _init_failure(info.value, 1)
    assert "master-node.invalid" in f.message


# ---- 2. port already in use ----------------------------------------------------------------


def _rank0_hosts_store(port):
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=5))
    dist.destroy_process_group()


def test_port_in_use_gives_eaddrinuse():
    with socket.socket() as stale:
        stale.bind(("127.0.0.1", 0))
        stale.listen()
        port = stale.getsockname()[1]
        assert diagnose.port_in_use(port)
        with pytest.raises(WorkerError) as info:
            launch(_rank0_hosts_store, 2, args=(port,), timeout=20)
    f = _init_failure(info.value, 0)
    assert f.exc_type == "DistNetworkError" and "EADDRINUSE" in f.message


def test_launch_picks_a_new_free_port_each_time():
    ports = {launch(lambda: os.environ["MASTER_PORT"], 1, timeout=20)[0] for _ in range(3)}
    assert len(ports) == 3


# ---- 3. skipped collective, different orders, monitored_barrier ---------------------------


def _metrics_loop(detail=False, steps=3):
    if detail:
        dist.set_debug_level_from_env()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for step in range(steps):
        grad = torch.full((4,), float(rank + 1))
        dist.all_reduce(grad)
        loss = torch.tensor([10.0 * (rank + 1)])
        if not (rank == 1 and step == 1):
            dist.all_reduce(loss)
        print(f"step {step}: loss sum {loss.item():g}")
    dist.destroy_process_group()


def test_skipped_collective_corrupts_then_hangs(capsys):
    with pytest.raises(WorkerTimeout) as info:
        launch(_metrics_loop, 2, timeout=HANG)
    out = capsys.readouterr().out
    assert "[rank0] step 1: loss sum 12" in out  # silently wrong before the hang
    stacks = {r: f.stack for r, f in info.value.failures.items()}
    assert set(stacks) == {0, 1}
    for stack in stacks.values():
        assert "in all_reduce" in stack and "_metrics_loop" in stack
        assert diagnose.stuck_where(stack).startswith("in torch all_reduce(), called from _metrics_loop()")


def test_detail_mode_reports_the_mismatch():
    with pytest.raises(WorkerError) as info:
        launch(_metrics_loop, 2, kwargs={"detail": True}, timeout=20,
               env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    msgs = [f.message for f in info.value.failures.values() if f.kind == "exception"]
    assert msgs and "Detected mismatch between collectives on ranks" in msgs[0]
    short = diagnose.short_mismatch(msgs[0])
    assert "SequenceNumber=3" in short and "TensorShape=[4]" in short and "TensorShape=[1]" in short


def _metrics_in_rank_order():
    dist.set_debug_level_from_env()
    dist.init_process_group("gloo")
    metrics = {"loss": torch.ones(1), "accuracy_per_class": torch.ones(10)}
    if dist.get_rank() == 1:
        metrics = dict(reversed(list(metrics.items())))
    for value in metrics.values():
        dist.all_reduce(value)
    dist.destroy_process_group()


def test_detail_mode_reports_collectives_in_different_orders():
    with pytest.raises(WorkerError, match=r"(?s)Detected mismatch.*TensorShape=\[10\]"):
        launch(_metrics_in_rank_order, 2, timeout=20, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})


def _late_ranks(late):
    dist.init_process_group("gloo")
    if dist.get_rank() in late:
        time.sleep(60)
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=1.5), wait_all_ranks=True)
    except RuntimeError:
        if dist.get_rank() != 0:  # an on-time rank hears of rank 0's error: let rank 0's come first
            time.sleep(10)
        raise
    dist.destroy_process_group()


@pytest.mark.parametrize("late", [(1,), (2,), (1, 2)])
def test_monitored_barrier_names_the_missing_ranks(late):
    with pytest.raises(WorkerError) as info:
        launch(_late_ranks, 3, args=(late,), timeout=20)
    f = info.value.failures[0]
    assert f.kind == "exception" and "failed to pass monitoredBarrier" in f.message
    named = f.message.split("Ranks ")[1].split(" failed")[0]
    assert sorted(int(r) for r in named.split(",")) == sorted(late)


# ---- 4. a collective on rank 0 only --------------------------------------------------------


def _end_of_epoch(fixed, path):
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def mean(v):
        t = torch.tensor([float(v)])
        dist.all_reduce(t)
        return t.item() / dist.get_world_size()

    if fixed:
        val = mean(1.0 + rank)
        if rank == 0:
            torch.save({"val_loss": val}, path)
    elif rank == 0:
        torch.save({"val_loss": mean(1.0 + rank)}, path)
    dist.barrier()
    dist.destroy_process_group()
    return os.path.exists(path)


def test_collective_on_rank0_only_hangs_with_telling_stacks(tmp_path):
    with pytest.raises(WorkerTimeout) as info:
        launch(_end_of_epoch, 2, args=(False, str(tmp_path / "a.pt")), timeout=HANG)
    where = {r: diagnose.stuck_where(f.stack) for r, f in info.value.failures.items()}
    assert where[0].startswith("in torch all_reduce(), called from mean()")
    assert where[1].startswith("in torch barrier(), called from _end_of_epoch()")
    assert launch(_end_of_epoch, 2, args=(True, str(tmp_path / "b.pt")), timeout=20) == [True, True]
    assert torch.load(tmp_path / "b.pt")["val_loss"] == 1.5


# ---- 5. duplicated data --------------------------------------------------------------------


def _audit(n=100):
    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank())
    ds = diagnose.IndexedDataset(make_dataset(n))
    out = {"plain": diagnose.check_duplicates(
        diagnose.sample_ids(DataLoader(ds, batch_size=10, shuffle=True)), n)}
    for name, set_epoch in [("no set_epoch", False), ("set_epoch", True)]:
        sampler = DistributedSampler(ds, seed=0)
        loader = DataLoader(ds, batch_size=10, sampler=sampler)
        orders = []
        for epoch in range(2):
            if set_epoch:
                sampler.set_epoch(epoch)
            orders.append(diagnose.sample_ids(loader))
        out[name] = (diagnose.check_duplicates(orders[0], n), orders[0] == orders[1])
    odd = diagnose.IndexedDataset(make_dataset(n + 1))
    out["padded"] = diagnose.check_duplicates(
        diagnose.sample_ids(DataLoader(odd, batch_size=10, sampler=DistributedSampler(odd))), n + 1)
    dist.destroy_process_group()
    return out


def test_duplicate_detector_finds_the_duplicates():
    r0, r1 = launch(_audit, 2, timeout=30)
    assert r0["plain"].counts == [100, 100] and len(r0["plain"].shared) == 100
    report, same_order = r0["no set_epoch"]
    assert report.ok and same_order
    report, same_order = r0["set_epoch"]
    assert report.ok and not same_order
    assert len(r0["padded"].shared) == 1 and r0["padded"].counts == [51, 51]
    assert r1["plain"].shared == r0["plain"].shared  # the same report on every rank


# ---- 6. unused parameters, uneven inputs ---------------------------------------------------


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(32, 16)
        self.head_a = torch.nn.Linear(16, 10)
        self.head_b = torch.nn.Linear(16, 10)

    def forward(self, x, task):
        h = torch.relu(self.body(x))
        return self.head_a(h) if task == "a" else self.head_b(h)


def _two_tasks(find_unused, level=None):
    if level:
        dist.set_debug_level(getattr(dist.DebugLevel, level))
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(TwoHeads(), find_unused_parameters=find_unused)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    X, Y = make_dataset(32, seed=dist.get_rank()).tensors
    for step in range(4):
        F.cross_entropy(model(X, "a" if step % 2 == 0 else "b"), Y).backward()
        opt.step()
        opt.zero_grad()
    del model, opt
    dist.destroy_process_group()


def test_unused_parameters_error_and_fix():
    with pytest.raises(WorkerError, match="Expected to have finished reduction in the prior iteration"):
        launch(_two_tasks, 2, args=(False,), timeout=20)
    with pytest.raises(WorkerError, match=r"did not receive grad for rank \d: head_b.bias, head_b.weight"):
        launch(_two_tasks, 2, args=(False, "INFO"), timeout=20)
    launch(_two_tasks, 2, args=(True,), timeout=20)


def _uneven(use_join):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(make_model(0, hidden=32))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    X, Y = make_dataset(80, seed=rank).tensors
    with Join([model], enable=use_join):
        for x, y in list(zip(X.split(16), Y.split(16)))[: 5 if rank == 0 else 3]:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    dist.barrier()
    state = {k: v.clone() for k, v in model.module.state_dict().items()}
    del model, opt
    dist.destroy_process_group()
    return state


def test_uneven_inputs_hang_and_join_fixes_them():
    with pytest.raises(WorkerTimeout) as info:
        launch(_uneven, 2, args=(False,), timeout=HANG)
    where = {r: diagnose.stuck_where(f.stack) for r, f in info.value.failures.items()}
    assert "backward" in where[0] and where[1].startswith("in torch barrier()")
    s0, s1 = launch(_uneven, 2, args=(True,), timeout=20)
    assert all(torch.equal(s0[k], s1[k]) for k in s0)


# ---- 7. NaN on one rank --------------------------------------------------------------------


def _nan_on_rank1():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = make_model(0, hidden=32)
    model.net[0].bias.requires_grad_(False)
    ddp = DDP(model)
    X, Y = make_dataset(32, seed=rank).tensors
    if rank == 1:
        X[3, 5] = float("nan")
    with diagnose.NaNWatcher(model) as w:
        loss = F.cross_entropy(ddp(X), Y)
    loss.backward()
    out = {"loss_finite": bool(torch.isfinite(loss)), "first": w.first,
           "status": diagnose.grad_status(model)}
    del ddp
    dist.destroy_process_group()
    return out


def test_nan_on_one_rank_reaches_every_rank():
    r0, r1 = launch(_nan_on_rank1, 2, timeout=20)
    assert r0["loss_finite"] and r0["first"] is None  # rank 0's own data is fine...
    assert not r1["loss_finite"] and r1["first"] == ("net.0", "Linear", "input")
    for r in (r0, r1):  # ...but after the all-reduce its gradients are NaN too
        assert r["status"]["net.0.bias"] == "none"
        assert {s for k, s in r["status"].items() if k != "net.0.bias"} == {"nan"}


# ---- 8. memory leak ------------------------------------------------------------------------


def _graph_size(t):
    seen, todo = set(), [getattr(t, "grad_fn", None)]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo += [n for n, _ in node.next_functions]
    return len(seen)


def test_running_total_keeps_graphs_and_no_grad_builds_none():
    model = make_model(0, hidden=16)
    X, Y = make_dataset(64).tensors
    total, sizes = 0.0, []
    for i in range(4):
        loss = F.cross_entropy(model(X[i * 16:(i + 1) * 16]), Y[i * 16:(i + 1) * 16])
        loss.backward()
        total += loss  # the leak: keeps every step's graph nodes
        sizes.append(_graph_size(total))
    steps = [b - a for a, b in zip(sizes, sizes[1:])]
    assert steps[0] > 0 and steps == [steps[0]] * 3  # the same number of nodes more every step

    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(1) or t, lambda t: t):
        F.cross_entropy(model(X), Y)  # evaluation without no_grad: activations saved
        n_without = len(saved)
        with torch.no_grad():
            F.cross_entropy(model(X), Y)
    assert n_without > 0 and len(saved) == n_without


# ---- 10. straggler -------------------------------------------------------------------------


def _straggler(slow_rank):
    dist.init_process_group("gloo")
    waits = []
    for _ in range(2):
        time.sleep(0.4 if dist.get_rank() == slow_rank else 0.0)
        waits.append(diagnose.barrier_waits())
    dist.destroy_process_group()
    return waits


@pytest.mark.parametrize("slow_rank", [0, 1])
def test_barrier_waits_point_at_the_straggler(slow_rank):
    waits = torch.tensor(launch(_straggler, 2, args=(slow_rank,), timeout=30)[0])
    assert int(waits.mean(0).argmin()) == slow_rank
