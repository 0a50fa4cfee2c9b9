"""Chapter 16's arithmetic on measured runs (training over slow links): steps to a target loss, the
α-β model's step time for an algorithm that communicates every ``H`` steps, and the link rate at
which two algorithms reach a target loss in the same time.  They compute; they judge nothing.

- ``steps_to``: the first evaluated step at which a run's held-out loss reached a target;
- ``step_seconds``: compute + (α + 2(N-1)/N · S / β) / H, one sync of S bytes every H steps;
- ``crossover_bps``: the link rate where two algorithms' times to the target are equal;
- ``run_ft``: torchft's lighthouse and two replica groups running the chapter's ``ch16_ft.py``
  (torchft is imported by those processes only, not here), and their logs.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ..workers.commands import CommandResult, run_commands
from ..workers.startup import free_port
from .ch10 import ring_factor
from .ch13_ft import ENV, TORCHRUN, read_logs

__all__ = ["steps_to", "step_seconds", "crossover_bps", "run_ft"]


def steps_to(evals: list[tuple[int, float, float]], target: float) -> int | None:
    """The first step whose held-out loss is at most ``target`` (``evals``: (step, bytes, loss)),
    or None when the run never got there."""
    return next((step for step, _, loss in evals if loss <= target), None)


def step_seconds(compute_s: float, payload_bytes: float, every: int, rate_bps: float, alpha: float,
                 world: int = 2) -> float:
    """Predicted seconds per step: the compute, plus one all-reduce of ``payload_bytes`` every
    ``every`` steps on a link of ``rate_bps`` bits/s (α + 2(N-1)/N · S / β, β = rate / 8), with no
    overlap."""
    return compute_s + (alpha + ring_factor(world) * payload_bytes / (rate_bps / 8)) / every


def crossover_bps(compute_s: float, a: tuple[int, float, int], b: tuple[int, float, int], alpha: float,
                  world: int = 2) -> float | None:
    """The link rate (bits/s) at which algorithms ``a`` and ``b`` reach the target in the same time,
    each given as (steps to the target, bytes per sync, steps per sync); None when one is faster
    at every rate.  Time = steps · (compute + (α + f·S·8/rate) / H) is linear in 1/rate."""
    def parts(steps: int, payload: float, every: int) -> tuple[float, float]:
        return steps * (compute_s + alpha / every), steps * ring_factor(world) * payload * 8 / every
    (ka, la), (kb, lb) = parts(*a), parts(*b)
    if la == lb:
        return None
    inv_rate = (kb - ka) / (la - lb)
    return 1 / inv_rate if inv_rate > 0 else None


def run_ft(script: Path, folder: Path, *, rounds: int = 6, sync_every: int = 8, kill_at: int = -1,
           together: int = 0, round_time: float = 0.0, rejoin_after: int = 2, limit: float = 60.0
           ) -> tuple[dict[tuple[int, int], list[dict]], list[CommandResult]]:
    """The lighthouse and two replica groups of ``ch16_ft.py``, each under its own torchrun (one
    process per group); with ``kill_at``, group 1 kills itself after that outer step and its torchrun
    starts a replacement, which waits until the survivor has committed ``rejoin_after`` outer steps
    alone.  Every process stops by itself within ``limit`` seconds.  Returns the
    per-outer-step logs (``{(replica, attempt): [records]}``) and each command's result."""
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    common = ["--folder", str(folder), "--stop-by", f"{time.time() + limit:.3f}"]

    def replica(r: int) -> list[str]:
        restarts = int(kill_at >= 0 and r == 1)
        return TORCHRUN + ["--standalone", "--nproc_per_node=1", f"--max-restarts={restarts}",
                           "--monitor-interval=0.1", script.name, "diloco", "--replica", str(r),
                           "--lighthouse", f"http://127.0.0.1:{port}", "--rounds", str(rounds),
                           "--sync-every", str(sync_every), "--kill-at", str(kill_at if r == 1 else -1),
                           "--together", str(together), "--round-time", str(round_time),
                           "--rejoin-after", str(rejoin_after)] + common

    commands = {"lighthouse": [sys.executable, script.name, "lighthouse", "--port", str(port)] + common,
                "replica0": replica(0), "replica1": replica(1)}
    results = run_commands(commands, cwd=str(script.parent), timeout=limit + 15, echo=False, env=ENV)
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError("the torchft run did not finish cleanly:\n" + "\n".join(
            f"[{r.name}] " + "\n".join(r.output.splitlines()[-12:]) for r in failed))
    return read_logs(folder, "diloco"), results
