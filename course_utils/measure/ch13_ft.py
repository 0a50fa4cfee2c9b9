"""Chapter 13, section 4: torchft's healing against a torchrun restart, run for real and measured.

``run_torchft(script, folder)`` starts torchft's lighthouse and two replica groups, each under its
own ``torchrun`` (``script`` is the chapter's ``ch13_ft.py``); replica group 1 kills itself with
SIGKILL mid-run, its torchrun starts a replacement, which is healed from the survivor.
``run_restart(script, folder)`` trains the same model as one plain torchrun job with a checkpoint
every few steps, the same SIGKILL, and ``--max-restarts=1``.  Both read the per-step logs that
every process wrote and return a summary computed from them (``FtSummary``, ``RestartSummary``).

While a run lasts, ``ListenWatch`` records every socket that the run's processes listen on.

This module does not import torchft (an optional dependency): the processes it starts do.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

from ..workers.commands import CommandResult, run_commands
from ..workers.netns import LOOPBACK, ListenWatch
from ..workers.startup import free_port

__all__ = ["torchft_missing", "run_torchft", "run_restart", "read_logs", "FtSummary",
           "RestartSummary", "ListenWatch", "LOOPBACK"]

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# One thread per process (torchrun's default, set to silence its banner); gloo on loopback only.
ENV = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}


def torchft_missing() -> str | None:
    """None when torchft can be imported, else the line that says how to install it."""
    if importlib.util.find_spec("torchft") is None:
        return 'torchft is not installed: `pip install -e ".[ft]"` (from the course folder) adds it'
    return None


def read_logs(folder: Path, mode: str) -> dict[tuple[int, int], list[dict]]:
    """``{(replica or rank, attempt): [records]}`` from ``<mode>-r<R>-a<A>.jsonl`` in ``folder``."""
    out = {}
    for f in sorted(Path(folder).glob(f"{mode}-r*-a*.jsonl")):
        r, a = f.stem.split("-")[1:]
        out[int(r[1:]), int(a[1:])] = [json.loads(line) for line in f.read_text().splitlines() if line]
    return out


def _steps(records: list[dict]) -> list[dict]:
    return [r for r in records if "step" in r and "event" not in r]


def _event(records: list[dict], name: str) -> dict | None:
    return next((r for r in records if r.get("event") == name), None)


@dataclasses.dataclass
class FtSummary:
    """What the torchft run's logs say, times in seconds since the kill (``t_kill`` is unix time)."""

    kill_step: int
    t_kill: float
    survivor_steps_alone: int      # steps the survivor committed with 1 participant
    survivor_discarded: int        # steps it ran whose update was thrown away (should_commit False)
    survivor_longest_pause: float  # longest time between two of its committed steps, after the kill
    new_step_after: float          # the survivor commits a step number never committed before
    normal_step: float             # its median time between committed steps before the kill
    replacement_created: float     # the new process exists (torchrun restarted the worker)
    replacement_waited: float      # it stopped waiting for the survivor's steps alone (nan: no wait)
    replacement_ready: float       # its manager is up and has asked the lighthouse to join
    healed: float                  # the survivor's state has arrived and is loaded
    heal_step: int                 # the step it was healed at (the survivor's step then)
    joined_step: int               # first step committed with both replica groups
    shared_steps: int              # steps both logged after the heal
    identical_steps: int           # of those, steps with bit-identical weights on both
    redone_steps: int              # step numbers the survivor committed twice (0 if none)
    logs: dict = dataclasses.field(repr=False, default_factory=dict)

    def lines(self) -> list[str]:
        return [
            f"replica group 1 killed at step {self.kill_step}",
            f"survivor: longest pause {self.survivor_longest_pause:.2f} s (a normal step: "
            f"{self.normal_step * 1000:.0f} ms), {self.survivor_discarded} step(s) discarded, "
            f"{self.survivor_steps_alone} steps committed alone, {self.redone_steps} redone; "
            f"a new step {self.new_step_after:.2f} s after the kill",
            f"replacement: process started {self.replacement_created:.1f} s after the kill, "
            + (f"done waiting for the survivor's steps alone at {self.replacement_waited:.1f} s, "
               if not math.isnan(self.replacement_waited) else "")
            + f"its manager up at {self.replacement_ready:.1f} s, healed at {self.healed:.1f} s "
            f"(step {self.heal_step}), "
            f"stepping with both from step {self.joined_step}",
            f"after the heal: {self.identical_steps} of {self.shared_steps} steps with bit-identical "
            "weights on both replica groups",
        ]


def summarize_torchft(logs: dict[tuple[int, int], list[dict]]) -> FtSummary:
    survivor, dead, new = logs[0, 0], logs[1, 0], logs[1, 1]
    kill = _event(dead, "kill")
    assert kill is not None, "replica group 1 never reached its kill step"
    t_kill = kill["t"]
    steps = _steps(survivor)
    committed = [r for r in steps if r["committed"]]
    before = [b["t"] - a["t"] for a, b in zip(committed, committed[1:]) if b["t"] < t_kill]
    after = [r for r in committed if r["t"] >= t_kill]
    gaps = [b["t"] - a["t"] for a, b in zip(committed, committed[1:]) if b["t"] >= t_kill]
    numbers = [r["step"] for r in committed]
    healed, start, waited = _event(new, "healed"), _event(new, "start"), _event(new, "waited")
    new_steps = _steps(new)
    digests = {r["step"]: r["digest"] for r in committed}
    shared = [r for r in new_steps if r["committed"] and r["step"] in digests]
    joined = next((r["step"] for r in new_steps if r["committed"] and r["participants"] == 2), -1)
    return FtSummary(
        kill_step=kill["step"], t_kill=t_kill,
        survivor_steps_alone=sum(1 for r in after if r["participants"] == 1),
        survivor_discarded=sum(1 for r in steps if not r["committed"]),
        survivor_longest_pause=max(gaps, default=float("nan")),
        new_step_after=next((r["t"] for r in after if r["step"] > kill["step"]), float("nan")) - t_kill,
        normal_step=sorted(before)[len(before) // 2] if before else float("nan"),
        replacement_created=(start["created"] - t_kill) if start else float("nan"),
        replacement_waited=(waited["t"] - t_kill) if waited else float("nan"),
        replacement_ready=(start["t"] - t_kill) if start else float("nan"),
        healed=(healed["t"] - t_kill) if healed else float("nan"),
        heal_step=new_steps[0]["step"] - 1 if healed and new_steps else -1,
        joined_step=joined,
        shared_steps=len(shared),
        identical_steps=sum(1 for r in shared if digests[r["step"]] == r["digest"]),
        redone_steps=len(numbers) - len(set(numbers)),
        logs=logs)


@dataclasses.dataclass
class RestartSummary:
    """What the restart run's logs say (rank 0's view), times in seconds since the kill."""

    kill_step: int
    t_kill: float
    checkpoint_step: int   # the step attempt 1 resumed from
    redone_steps: int      # steps committed again after the restart
    first_step_after: float  # the first step of attempt 1 is done
    new_step_after: float  # attempt 1 commits a step number never committed before: the time lost
    normal_step: float
    logs: dict = dataclasses.field(repr=False, default_factory=dict)

    def lines(self) -> list[str]:
        return [
            f"rank 1 killed at step {self.kill_step}; the last checkpoint was at step {self.checkpoint_step}",
            f"restart: every worker stopped; the first step after the restart {self.first_step_after:.1f} s "
            f"after the kill; a new step (after {self.kill_step}) {self.new_step_after:.1f} s after it, "
            f"{self.redone_steps} steps done twice (a normal step: {self.normal_step * 1000:.0f} ms)",
        ]


def summarize_restart(logs: dict[tuple[int, int], list[dict]]) -> RestartSummary:
    kill = _event(logs[1, 0], "kill")
    assert kill is not None, "rank 1 never reached its kill step"
    t_kill = kill["t"]
    first, second = _steps(logs[0, 0]), _steps(logs[0, 1])
    resumed = _event(logs[0, 1], "resumed")
    gaps = [b["t"] - a["t"] for a, b in zip(first, first[1:])]
    done_before = {r["step"] for r in first}
    new = next((r for r in second if r["step"] > kill["step"]), None)
    return RestartSummary(
        kill_step=kill["step"], t_kill=t_kill,
        checkpoint_step=resumed["step"] if resumed else 0,
        redone_steps=sum(1 for r in second if r["step"] in done_before),
        first_step_after=second[0]["t"] - t_kill if second else float("nan"),
        new_step_after=new["t"] - t_kill if new else float("nan"),
        normal_step=sorted(gaps)[len(gaps) // 2] if gaps else float("nan"),
        logs=logs)


def _check_outputs(results: list[CommandResult]) -> None:
    failed = [r for r in results if not r.ok]
    if failed:
        tails = "\n".join(f"[{r.name}] {'timed out' if r.timed_out else f'exit code {r.returncode}'}:\n"
                          + "\n".join(r.output.splitlines()[-12:]) for r in failed)
        raise RuntimeError(f"the demo did not finish cleanly:\n{tails}")


def run_torchft(script: Path, folder: Path, *, kill_at: int = 60, steps: int = 120,
                step_time: float = 0.02, heartbeat_timeout_ms: int = 2000, rejoin_after: int = 50,
                limit: float = 90.0,
                watch: ListenWatch | None = None) -> tuple[FtSummary, list[CommandResult]]:
    """The lighthouse and two replica groups (each its own torchrun); group 1 dies at ``kill_at``.

    Its replacement waits until the survivor has committed ``rejoin_after`` steps alone (on a fast
    machine it could otherwise be back before the lighthouse has declared group 1 dead).

    Every process stops by itself within ``limit`` seconds (``--stop-by``); run_commands stops
    whatever is left 15 s later.  Returns the summary and each command's result (its output).
    """
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    common = ["--folder", str(folder), "--stop-by", f"{time.time() + limit:.3f}", "--steps", str(steps),
              "--step-time", str(step_time)]

    def replica(r: int) -> list[str]:
        return TORCHRUN + ["--standalone", "--nproc_per_node=1", f"--max-restarts={r}",
                           "--monitor-interval=0.1", script.name, "ft", "--replica", str(r),
                           "--lighthouse", f"http://127.0.0.1:{port}", "--kill-at",
                           str(kill_at if r == 1 else -1), "--rejoin-after", str(rejoin_after)] + common

    commands = {"lighthouse": [sys.executable, script.name, "lighthouse", "--port", str(port),
                               "--heartbeat-timeout-ms", str(heartbeat_timeout_ms)] + common,
                "replica0": replica(0), "replica1": replica(1)}
    with watch if watch is not None else ListenWatch():
        results = run_commands(commands, cwd=str(script.parent), timeout=limit + 15, echo=False, env=ENV)
    _check_outputs(results)
    return summarize_torchft(read_logs(folder, "ft")), results


def run_restart(script: Path, folder: Path, *, kill_at: int = 60, steps: int = 120,
                save_every: int = 25, step_time: float = 0.02,
                limit: float = 90.0) -> tuple[RestartSummary, list[CommandResult]]:
    """The same training as one torchrun job of 2 workers, a checkpoint every ``save_every`` steps."""
    folder.mkdir(parents=True, exist_ok=True)
    cmd = TORCHRUN + ["--standalone", "--nproc_per_node=2", "--max-restarts=1", "--monitor-interval=0.1",
                      script.name, "restart", "--folder", str(folder), "--kill-at", str(kill_at),
                      "--steps", str(steps), "--save-every", str(save_every), "--step-time", str(step_time)]
    # A fresh store for the restarted workers (chapter 06, section 5.1)
    env = dict(ENV, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    results = run_commands({"job": cmd}, cwd=str(script.parent), timeout=limit + 15, echo=False, env=env)
    _check_outputs(results)
    return summarize_restart(read_logs(folder, "restart")), results
