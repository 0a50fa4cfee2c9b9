"""Torch alone (no course code): a gloo rank that aborts at interpreter exit.

    python benchmarks/gloo_teardown_minimal.py [--runs 30]

Each run spawns 2 fresh interpreters.  Every rank starts one asynchronous all-reduce from a gradient
hook (as a DDP written by hand does), waits for it, drops its handle at once, calls
``destroy_process_group()`` and returns.  Three variants:

- ``lazy``: ``torch.distributed.nn`` is first imported *after* ``init_process_group`` (``torch._dynamo``
  imports it, and every ``torch.optim`` constructor and DDP's constructor import ``torch._dynamo``).
  Its module ``functional`` binds ``group.WORLD`` as the default argument of ten functions, so the
  group can no longer be freed: ``destroy_process_group()`` leaves gloo's worker threads running
  until the interpreter exits.
- ``early``: the same import *before* ``init_process_group`` (the default is then ``None``): the
  group is freed by ``destroy_process_group()``, which joins gloo's threads.
- ``outside``: as ``lazy``, but the all-reduce starts after ``backward()`` returns.

Why ``lazy`` aborts: a collective started during backward snapshots the thread-local state, which
holds a Python object (``torch/autograd/graph.py`` stashes ``contextvars.copy_context()`` there for
every backward), so destroying its work object takes the GIL.  After ``wait()`` returns, gloo's
worker thread still holds the work for a moment; when the rank drops its handle first, that thread
destroys the work, and if the main thread has begun interpreter shutdown by then, Python ends the
thread with ``pthread_exit`` inside a ``noexcept`` C++ destructor: ``std::terminate``, "terminate
called without an active exception", SIGABRT (a core shows ``c10d::ProcessGroupGloo::runLoop`` →
``~AsyncAllreduceWork`` → ``~ThreadLocalState`` → ``SafePyObject`` → ``take_gil`` →
``PyThread_exit_thread``).  ``outside`` has no Python object in the snapshot; ``early`` has no
gloo thread left at exit.
"""

from __future__ import annotations

import argparse
import importlib
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def rank_main(rank: int, port: int, variant: str) -> None:
    if variant == "early":
        importlib.import_module("torch.distributed.nn")
    dist.init_process_group("gloo", init_method=f"tcp://localhost:{port}", rank=rank, world_size=2)
    if variant != "early":
        importlib.import_module("torch.distributed.nn")
    weight = torch.nn.Parameter(torch.ones(1000))
    handles = []
    if variant == "outside":
        (weight * 2).sum().backward()
        handles.append(dist.all_reduce(weight.grad, async_op=True))
    else:
        weight.register_post_accumulate_grad_hook(
            lambda p: handles.append(dist.all_reduce(p.grad, async_op=True)))
        (weight * 2).sum().backward()
    handles.pop().wait()  # the rank's reference goes here
    assert weight.grad[0].item() == 4.0
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--variants", nargs="+", default=["lazy", "early", "outside"])
    args = parser.parse_args()
    aborted = dict.fromkeys(args.variants, 0)
    for _ in range(args.runs):
        for variant in args.variants:  # interleaved, so that a change of load hits every variant
            try:
                mp.spawn(rank_main, args=(_free_port(), variant), nprocs=2)
            except mp.ProcessExitedException:
                aborted[variant] += 1
    for variant, n in aborted.items():
        print(f"{variant:8s}: {n} of {args.runs} runs failed")


if __name__ == "__main__":
    main()
