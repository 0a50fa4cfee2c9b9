"""How often does a from-scratch DDP abort at teardown inside someone else's test harness?

    python benchmarks/ddp_teardown.py [--runs 50] [--cls DDPBucketed] [--module solutions/mini_ddp.py]

The harness is built like a public DDP test suite, knowing nothing of this course: each run is one
``torch.multiprocessing.spawn`` of 2 fresh interpreters (the start method ``spawn``); every rank
imports the module under test *before* ``init_process_group`` (as a test file's top-level import
does), opens a gloo group on ``localhost``, wraps a toy model in the class under test, trains a few
steps against a reference model trained on the whole batch in the same process, then calls
``dist.destroy_process_group()`` with the model still alive and no garbage collection, and returns.
A rank killed by a signal (SIGABRT: "terminate called without an active exception") fails the run.

``--fast`` (the suite's test, ``tests/lessons/test_mini_ddp_teardown.py``) keeps the ranks from
importing ``torch._dynamo`` (every ``torch.optim`` constructor imports it, and it takes seconds: the
step is SGD written out) and keeps the group alive by holding ``dist.group.WORLD`` in a global,
which is what that lazy import does: ``torch.distributed.nn.functional``, which ``torch._dynamo``
imports, binds ``group.WORLD`` as a default argument of ten functions, so ``destroy_process_group()``
cannot free a group that existed at that moment and gloo's threads live until the interpreter exits.

``--cls ShardedOptimizer`` trains with torch DDP's arithmetic done by hand (all-reduce and divide)
and the sharded optimizer; ``--cls none`` runs the same harness without any course code (torch
DDP), the control.  ``--preimport`` imports ``torch._dynamo`` in each rank before the group exists.
Prints the number of runs that aborted.
"""

from __future__ import annotations

import argparse
import importlib.util
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
STEPS = 3


def _load(module_path: str):
    spec = importlib.util.spec_from_file_location("module_under_test", module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _toy() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 5))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


class _HandSGD:
    """Plain SGD without ``torch.optim``, whose constructor imports ``torch._dynamo``."""

    def __init__(self, params, lr: float):
        self.params, self.lr = list(params), lr

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:
            p.sub_(self.lr * p.grad)


_KEPT = []  # --fast: the group, held as torch.distributed.nn's default arguments hold it


def train_and_destroy(rank: int, world: int, port: int, module_path: str, cls: str, preimport: bool,
                      keep_group: bool = False) -> None:
    """One rank of the harness: import, init, train STEPS steps against a reference, destroy, return."""
    if preimport:
        importlib.import_module("torch._dynamo")
    module = _load(module_path) if cls != "none" else None  # the test file's import, before init
    dist.init_process_group("gloo", init_method=f"tcp://localhost:{port}", rank=rank, world_size=world)
    if keep_group:
        _KEPT.append(dist.group.WORLD)
    reference = _toy()
    model = _toy()
    if rank != 0:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # every rank but 0 starts different: the wrapper must broadcast rank 0's
    if cls == "DDPBucketed":
        ddp = module.DDPBucketed(model, bucket_size_mb=0.001)
    elif cls == "DDPIndividualParameters":
        ddp = module.DDPIndividualParameters(model)
    elif cls == "ShardedOptimizer":
        with torch.no_grad():
            for p in model.parameters():
                dist.broadcast(p, src=0)
        ddp = model
    else:
        ddp = nn.parallel.DistributedDataParallel(model)
    if cls == "ShardedOptimizer":
        opt = module.ShardedOptimizer(ddp.parameters(), torch.optim.AdamW, lr=0.05)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05)
    else:
        sgd = _HandSGD if keep_group else torch.optim.SGD  # keep_group (--fast): no torch._dynamo
        opt, ref_opt = sgd(ddp.parameters(), lr=0.05), sgd(reference.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(42)
    for _ in range(STEPS):
        x, y = torch.randn(8, 10, generator=gen), torch.randn(8, 5, generator=gen)
        ref_opt.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
        shard = slice(rank * 8 // world, (rank + 1) * 8 // world)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x[shard]), y[shard]).backward()
        if cls in ("DDPBucketed", "DDPIndividualParameters"):
            ddp.finish_gradient_synchronization()
        elif cls == "ShardedOptimizer":
            for p in ddp.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        opt.step()
    for p, q in zip(ddp.parameters(), reference.parameters()):
        assert torch.allclose(p, q, atol=1e-5), (p - q).abs().max()
    dist.destroy_process_group()  # the model and the optimizer are still alive; no gc


def one_run(module_path: str, cls: str, preimport: bool, fast: bool = False) -> str:
    """'' when both ranks returned, else why the run failed."""
    try:
        mp.spawn(train_and_destroy, args=(2, _free_port(), module_path, cls, preimport, fast), nprocs=2)
    except mp.ProcessExitedException as e:
        signal = f" ({e.signal_name})" if e.signal_name else ""
        return f"rank {e.error_index}: exit code {e.exit_code}{signal}"
    except mp.ProcessRaisedException as e:
        return "raised: " + str(e).strip().splitlines()[-1]
    return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--cls", default="DDPBucketed",
                        choices=["DDPBucketed", "DDPIndividualParameters", "ShardedOptimizer", "none"])
    parser.add_argument("--module", default=str(ROOT / "solutions" / "mini_ddp.py"))
    parser.add_argument("--preimport", action="store_true")
    parser.add_argument("--fast", action="store_true")
    args = parser.parse_args()
    failures = []
    start = time.perf_counter()
    for i in range(args.runs):
        why = one_run(args.module, args.cls, args.preimport, args.fast)
        if why:
            failures.append(why)
            print(f"run {i}: {why}", flush=True)
    module = Path(args.module).resolve()
    where = module.relative_to(ROOT) if ROOT in module.parents else module
    how = (" (torch._dynamo imported first)" if args.preimport else "") + (" (fast)" if args.fast else "")
    print(f"{args.cls} from {where}{how}: {len(failures)} of {args.runs} runs failed, "
          f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
