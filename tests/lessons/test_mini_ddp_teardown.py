"""solutions/mini_ddp.py dropped into someone else's training script: no abort at interpreter exit.

The mechanism (``benchmarks/ddp_teardown.py --cls none`` shows it with torch's DDP alone): an all-reduce
started during backward holds Python state, so whoever drops the last reference to its handle needs
the GIL.  When gloo's worker thread drops it while the interpreter exits, Python ends that thread
inside a C++ destructor and the process aborts.  Gloo's threads are still there at exit whenever
something holds the group after ``destroy_process_group()`` (``torch.distributed.nn``, first imported
after ``init_process_group``, does).  The course's classes keep their finished handles, so the
training thread, not gloo's, releases them.

``benchmarks/ddp_teardown.py --runs 50`` measures the abort rate; here: the property that prevents
it (deterministic) and a few runs of the same harness.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from course_utils.checking import Outcome, judge, process_group, run_workers

ROOT = Path(__file__).resolve().parents[2]
MINI_DDP = ROOT / "solutions" / "mini_ddp.py"

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def _handles_after_synchronization(path: str, cls_name: str) -> Outcome:
    """Train two steps; after each synchronization, count the Python references to every handle
    that the hooks started, other than this function's own."""
    spec = importlib.util.spec_from_file_location("mini_ddp_under_test", path)
    mini_ddp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mini_ddp)
    with process_group("gloo") as pg:
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        cls = getattr(mini_ddp, cls_name)
        ddp = cls(model, bucket_size_mb=0.0001) if cls_name == "DDPBucketed" else cls(model)
        started = []
        real = dist.all_reduce

        def spy(*args, **kwargs):
            work = real(*args, **kwargs)
            started.append(work)
            return work

        held = []
        with mock.patch.object(dist, "all_reduce", spy):
            for _ in range(2):
                started.clear()
                ddp(torch.randn(4, 6)).sum().backward()
                ddp.finish_gradient_synchronization()
                # getrefcount counts the list `started`, the loop's name and its own argument:
                # anything above 3 is a reference kept by the model
                held.append([sys.getrefcount(w) - 3 for w in started])
        started.clear()
        del ddp, model
        return Outcome(pg.rank, data={"held": held})


@pytest.mark.parametrize("cls_name", ["DDPIndividualParameters", "DDPBucketed"])
def test_finished_handles_stay_with_the_model_until_the_next_synchronization(cls_name):
    for outcome in judge(run_workers(_handles_after_synchronization, 2, args=(str(MINI_DDP), cls_name),
                                   timeout=60),
                         world=2):
        for step, refs in enumerate(outcome.data["held"]):
            assert refs and all(n >= 1 for n in refs), (
                f"rank {outcome.rank}, step {step}: references kept per handle {refs}; a handle "
                "dropped at once is released last by gloo's thread, which aborts at interpreter exit")


@pytest.mark.parametrize("cls_name", ["DDPBucketed", "DDPIndividualParameters"])
def test_a_foreign_harness_exits_cleanly(cls_name):
    """Spawned ranks (fresh interpreters), the group kept alive, destroyed with the model alive and
    no garbage collection: before the handles were kept, 2 of 20 runs of this harness aborted."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "ddp_teardown.py"), "--runs", "2", "--fast",
         "--cls", cls_name, "--module", str(MINI_DDP)], capture_output=True, text=True, timeout=240, cwd=ROOT)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-2000:]
    assert result.returncode == 0 and "0 of 2 runs failed" in summary, (
        f"{summary}\n--- the harness's stderr, last lines ---\n{result.stderr[-3000:]}")
