"""course_utils.diagnose: the pure parts, without worker processes (the fault labs are in
test_ch09_faults.py)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
from torch.utils.data import DataLoader

from course_utils import RankFailure, WorkerError, WorkerTimeout, diagnose, free_port

# ---- start-up checks -------------------------------------------------------------------------


def test_check_address_resolves_localhost_and_rejects_an_invalid_name():
    assert diagnose.check_address("localhost").ok
    bad = diagnose.check_address("master-node.invalid")  # .invalid never resolves (RFC 2606)
    assert not bad.ok and "does not resolve" in bad.detail
    assert str(bad).startswith("[FAIL] address 'master-node.invalid'")


def test_check_port_open_tells_refused_from_open():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        ok = diagnose.check_port_open("127.0.0.1", s.getsockname()[1])
    assert ok.ok and "accepts connections" in ok.detail
    refused = diagnose.check_port_open("127.0.0.1", free_port())
    assert not refused.ok and "refused" in refused.detail and "MASTER_PORT" in refused.detail


def test_port_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert diagnose.port_in_use(port)
    assert not diagnose.port_in_use(free_port())


def test_check_rendezvous_reads_the_environment(monkeypatch, capsys):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    (c,) = diagnose.check_rendezvous()
    assert not c.ok and "must both be set" in c.detail
    assert "[FAIL] environment" in capsys.readouterr().out
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "not-a-port")
    (c,) = diagnose.check_rendezvous(show=False)
    assert not c.ok and "not a TCP port" in c.detail
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        monkeypatch.setenv("MASTER_PORT", str(s.getsockname()[1]))
        checks = diagnose.check_rendezvous(show=False)
    assert [c.ok for c in checks] == [True, True]


# ---- duplicates ----------------------------------------------------------------------------


def test_find_duplicates_reports_shared_repeated_and_missing():
    ok = diagnose.find_duplicates([[0, 2, 4], [1, 3, 5]], dataset_size=6)
    assert ok.ok and ok.counts == [3, 3] and ok.unique == 6 and "OK" in ok.summary()

    every_rank_everything = diagnose.find_duplicates([[0, 1, 2, 3], [3, 2, 1, 0]], 4)
    assert not every_rank_everything.ok
    assert every_rank_everything.shared == {0: [0, 1], 1: [0, 1], 2: [0, 1], 3: [0, 1]}
    assert "DUPLICATES: 4 samples" in every_rank_everything.summary()

    padded = diagnose.find_duplicates([[0, 2, 4], [1, 3, 0]], 5)  # DistributedSampler padding
    assert padded.shared == {0: [0, 1]} and not padded.missing

    messy = diagnose.find_duplicates([[0, 0, 1], [2]], 5)
    assert messy.repeated == {0: 1} and messy.missing == [3, 4]
    assert "REPEATS" in messy.summary() and "MISSING: 2" in messy.summary()


def test_indexed_dataset_and_sample_ids():
    base = torch.utils.data.TensorDataset(torch.arange(10.0), torch.arange(10))
    ds = diagnose.IndexedDataset(base)
    assert len(ds) == 10 and ds[3][-1] == 3 and ds[3][0].item() == 3.0
    loader = DataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))
    ids = diagnose.sample_ids(loader)
    assert sorted(ids) == list(range(10)) and ids != list(range(10))


# ---- NaN -----------------------------------------------------------------------------------


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def test_grad_status_by_name_with_none_nan_and_inf():
    m = _model()
    m[0].bias.requires_grad_(False)  # frozen: grad stays None
    m(torch.randn(3, 4)).sum().backward()
    status = diagnose.grad_status(m)
    assert status == {"0.weight": "finite", "0.bias": "none", "2.weight": "finite",
                      "2.bias": "finite"}
    m[2].weight.grad[0, 0] = float("nan")
    m[2].bias.grad[1] = float("inf")
    assert diagnose.nonfinite_grads(m) == ["2.weight", "2.bias"]
    assert diagnose.grad_status(m)["2.bias"] == "inf"


def test_article_check_crashes_where_grad_status_does_not():
    """The check of article 003 fails on a parameter without gradient; ours does not."""
    m = _model()
    m[0].bias.requires_grad_(False)
    m(torch.randn(3, 4)).sum().backward()
    with pytest.raises(TypeError):
        for param in m.parameters():
            torch.isnan(param.grad).any()
    assert diagnose.grad_status(m)["0.bias"] == "none"


def test_nan_watcher_names_the_first_module():
    m = _model()
    x = torch.randn(3, 4)
    x[1, 2] = float("nan")
    with diagnose.NaNWatcher(m) as w:
        m(x)
    assert w.first == ("0", "Linear", "input")
    assert not m[0]._forward_hooks  # hooks removed on exit

    with torch.no_grad():
        m[2].weight[0, 0] = float("inf")
    with diagnose.NaNWatcher(m) as w:
        m(torch.ones(3, 4))
    assert w.first == ("2", "Linear", "output")

    with pytest.raises(FloatingPointError, match="non-finite output at module '2'"):
        with diagnose.NaNWatcher(m, raise_error=True):
            m(torch.ones(3, 4))


# ---- reading failures ----------------------------------------------------------------------

STACK = """(most recent call first)
File "/x/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
    work.wait()
File "/x/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper
    return func(*args, **kwargs)
File "/tmp/ipykernel_1/123.py", line 9 in average_across_ranks
    dist.all_reduce(t)
File "/tmp/ipykernel_1/123.py", line 20 in end_of_epoch
"""

MISMATCH = ("Detected mismatch between collectives on ranks. Rank 1 is running collective: "
            "CollectiveFingerPrint(SequenceNumber=3, OpType=ALLREDUCE, TensorShape=[4], "
            "TensorDtypes=Float, TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu, "
            "memory_format=(nullopt))), but Rank 0 is running collective: CollectiveFingerPrint("
            "SequenceNumber=3, OpType=ALLREDUCE, TensorShape=[1], TensorDtypes=Float, "
            "TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu, "
            "memory_format=(nullopt))).Collectives differ in the following aspects:   "
            "Tensor Tensor shapes: 4vs 1")


def test_stuck_where_names_the_collective_and_the_user_line():
    assert diagnose.stuck_where(STACK) == ("in torch all_reduce(), called from "
                                           "average_across_ranks() line 9")
    assert diagnose.stuck_where('File "/tmp/a.py", line 3 in load\n') == "in load() line 3"
    assert diagnose.stuck_where("") == "(no Python stack)"


def test_short_mismatch_drops_tensor_options():
    short = diagnose.short_mismatch(MISMATCH)
    assert "TensorOptions" not in short
    assert "TensorShape=[4], TensorDtypes=Float)" in short and "TensorShape=[1]" in short
    assert "shapes: 4vs 1" in short


def test_explain_summarises_errors_and_timeouts(capsys):
    err = WorkerError({0: RankFailure(0, "stopped", message="killed after rank 1 failed"),
                       1: RankFailure(1, "exception", exc_type="RuntimeError", message=MISMATCH)},
                      "1 of 2 rank(s) failed; the others were stopped.")
    text = diagnose.explain(err)
    assert text == capsys.readouterr().out.rstrip("\n")
    assert "rank 1: RuntimeError: Detected mismatch" in text and "but Rank 0" in text
    assert "TensorOptions" not in text and "rank 0 was stopped by the launcher" in text

    hung = WorkerTimeout({0: RankFailure(0, "timeout", stack=STACK)}, "Timed out after 2 s")
    assert diagnose.explain(hung, show=False).splitlines()[1] == (
        "  rank 0: stuck in torch all_reduce(), called from average_across_ranks() line 9")
    assert diagnose.explain(ValueError("a\nb\nc"), lines=1, show=False) == "ValueError: a"


def test_quiet_cpp_logs_filters_frames_and_repeats(capfd):
    with diagnose.quiet_cpp_logs(keep=2):
        os.write(2, b"[W1130 01:17:06.1 socket.cpp:764] [c10d] cannot connect\n"
                    b"Exception raised from foo at bar.cpp:1 (most recent call first):\n"
                    b"frame #0: c10::Error::Error() + 0x9d (0x7f in libc10.so)\n"
                    b"[W1130 01:17:08.9 socket.cpp:764] [c10d] cannot connect\n"
                    b"second message\nthird message\nfourth message\n")
    err = capfd.readouterr().err
    assert err.splitlines() == ["[W1130 01:17:06.1 socket.cpp:764] [c10d] cannot connect",
                                "second message", "... (2 more log line(s) hidden)"]
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "after\n"  # stderr restored


# ---- stragglers ----------------------------------------------------------------------------


def _waits_worker(slow_rank: int):
    import time

    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        device = diagnose._group_device()
        time.sleep(1.0 if dist.get_rank() == slow_rank else 0.0)
        waits = diagnose.barrier_waits()
    finally:
        dist.destroy_process_group()
    return str(device), waits


def test_barrier_waits_on_gloo_gathers_every_ranks_wait():
    from course_utils import launch

    (dev0, waits0), (dev1, waits1) = launch(_waits_worker, 2, args=(1,), timeout=60)
    assert dev0 == dev1 == "cpu"  # gloo: the gathered tensor stays on the CPU
    assert waits0 == waits1 and len(waits0) == 2  # the same list on every rank
    assert waits0[0] > 0.5 and waits0[1] < waits0[0]  # rank 0 waited for the slow rank 1


def test_timed_barrier_synchronises_the_gpu_before_starting_the_clock(monkeypatch):
    """The NCCL path without a GPU: the tensor goes to this rank's GPU, and queued GPU work is
    waited for before the clock starts (not inside the timed barrier)."""
    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("sync", device)))
    monkeypatch.setattr(dist, "barrier", lambda group=None: calls.append(("barrier", group)))
    assert diagnose._group_device() == torch.device("cuda", 1)
    assert diagnose.timed_barrier() >= 0
    assert calls == [("sync", torch.device("cuda", 1)), ("barrier", None)]
