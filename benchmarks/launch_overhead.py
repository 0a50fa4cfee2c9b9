"""Wall time of a trivial 2-rank all_reduce through three launchers, side by side.

    python benchmarks/launch_overhead.py [--repeats 10]

- ``course_utils.launch``: first launch (starts the fork server, which imports torch once),
  first launch made 4 s after ``import course_utils`` in a process where the fork server is started
  in the background on import, as in a notebook kernel (``COURSE_PREWARM=1``), and repeated
  launches (fork from the warm server);
- ``torch.multiprocessing.spawn`` of a module-level function: every launch starts fresh
  interpreters that import torch;
- ``torchrun --standalone``: a new agent process plus fresh workers every time.

Targets on a 2-core machine: a repeated ``launch`` under 0.5 s and under a quarter of torchrun's; a
first launch made 4 s after the import in a notebook under 0.5 s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORKER_SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
dist.destroy_process_group()
"""


def all_reduce_once() -> float:
    """The trivial job: join the group, all-reduce one number, leave."""
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


def _spawn_target(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    all_reduce_once()


PREWARMED_FIRST = """
import sys, time
import course_utils
time.sleep(4)  # the learner reads the next cell
t0 = time.perf_counter()
course_utils.launch(int, 2, display=None)
print(time.perf_counter() - t0)
"""


def prewarmed_first_launch() -> float:
    """A fresh process, prewarmed as a notebook kernel is: its first launch, 4 s after the import."""
    env = dict(os.environ, COURSE_PREWARM="1")
    out = subprocess.run([sys.executable, "-c", PREWARMED_FIRST], check=True, capture_output=True,
                         text=True, env=env).stdout
    return float(out.split()[-1])


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=10)
    a = ap.parse_args()
    from course_utils import free_port, launch

    first = timed(lambda: launch(all_reduce_once, 2))
    repeated = [timed(lambda: launch(all_reduce_once, 2)) for _ in range(a.repeats)]
    n_slow = max(3, a.repeats // 3)
    prewarmed = [prewarmed_first_launch() for _ in range(n_slow)]
    spawned = [timed(lambda: mp.spawn(_spawn_target, args=(2, free_port()), nprocs=2))
               for _ in range(n_slow)]
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(WORKER_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", f.name]
    try:
        torchrun = [timed(lambda: subprocess.run(cmd, check=True, capture_output=True))
                    for _ in range(n_slow)]
    finally:
        os.unlink(f.name)

    rows = [
        ("course_utils.launch, first", [first]),
        ("launch, first, 4 s after import", prewarmed),
        ("course_utils.launch, repeated", repeated),
        ("torch.multiprocessing.spawn", spawned),
        ("torchrun --standalone", torchrun),
    ]
    print(f"2-rank gloo all_reduce on {os.cpu_count()} cores, torch {torch.__version__}")
    print(f"{'launcher':<32}{'median s':>10}{'min s':>10}{'runs':>6}")
    for name, xs in rows:
        print(f"{name:<32}{statistics.median(xs):>10.3f}{min(xs):>10.3f}{len(xs):>6}")
    rep, tr = statistics.median(repeated), statistics.median(torchrun)
    warm = statistics.median(prewarmed)
    print(f"\nrepeated launch / torchrun = {rep / tr:.2f} "
          f"(target < 0.25); repeated launch {'<' if rep < 0.5 else '>='} 0.5 s; "
          f"first launch 4 s after the import {'<' if warm < 0.5 else '>='} 0.5 s")


if __name__ == "__main__":
    main()
