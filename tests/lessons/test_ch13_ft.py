"""Chapter 13, section 4: torchft heals a replica group without stopping the other, for real.

One run of the lesson's demo (``course_utils.measure.ch13_ft.run_torchft``): the lighthouse and two
replica groups, each under its own torchrun; group 1 is SIGKILLed mid-run, the survivor goes on
alone, torchrun starts a replacement, which is healed from the survivor's state and then steps
with it. Skipped where torchft is not installed (``pip install -e ".[ft]"``).

The restart it is compared with is plain torchrun (chapter 06 tests that for real); its summary
is checked here on a small log written by hand.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import psutil
import pytest

from course_utils.measure.ch13_ft import (
    ListenWatch,
    read_logs,
    run_torchft,
    summarize_restart,
    torchft_missing,
)
from course_utils.workers.netns import listening

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def _mentioning(text: str) -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"]) if text in " ".join(p.info["cmdline"] or [])]


@pytest.mark.skipif(torchft_missing() is not None, reason=str(torchft_missing()))
def test_the_survivor_keeps_stepping_and_the_replacement_is_healed_from_it(tmp_path, no_leftover_processes):
    folder = tmp_path / f"t13-{uuid.uuid4().hex[:8]}"
    watch = ListenWatch(every=0.2)
    s, results = run_torchft(NOTEBOOKS / "ch13_ft.py", folder, kill_at=40, steps=80, watch=watch)
    out = {r.name: r.output for r in results}
    survivor = [r for r in s.logs[0, 0] if "step" in r and "event" not in r]

    # The kill was real and torchrun started a new process for replica group 1.
    assert "exitcode: -9" in out["replica1"], out["replica1"][-2000:]
    assert s.kill_step == 40 and s.replacement_created > 0
    # The survivor went on through the kill: committed steps alone, while group 1 was gone, with
    # no step done twice; the step in flight when its peer died was discarded, not applied.
    alone = [r for r in survivor if r["committed"] and r["participants"] == 1
             and s.t_kill < r["t"] < s.t_kill + s.replacement_ready]
    assert alone, "the survivor committed no step between the kill and the replacement's start"
    assert s.redone_steps == 0
    assert s.survivor_discarded >= 1
    assert [r["participants"] for r in survivor if r["committed"]][0] == 2  # both, before the kill

    # The replacement was healed from replica group 0, at the survivor's step, then stepped with
    # it: bit-identical weights on both at every step they both logged.
    assert "healing is required" in out["replica1"] and "recover_src_replica_rank=0" in out["replica1"]
    assert s.heal_step > s.kill_step and s.joined_step > s.heal_step
    assert s.shared_steps >= 40
    assert s.identical_steps == s.shared_steps

    # What listened, and where: torchft's servers, the lighthouse and gloo on loopback only;
    # torchrun's agents host TCPStores, which bind every interface (torch 2.13's TCPStore server
    # listens on [::] whatever host it is given), but inside the run's own network namespace,
    # which run_commands makes where the system allows: then nothing is reachable from outside.
    assert watch.polls >= 5, "the socket watch hardly ran: the test proves little"
    cmds = set(watch.seen.values())
    assert any("ch13_ft.py lighthouse" in c for (_, ip, _), c in watch.seen.items() if ip == "127.0.0.1")
    assert any("ch13_ft.py ft" in c and "torch.distributed.run" not in c for c in cmds)
    agents = [k for k, c in watch.seen.items() if "torch.distributed.run" in c]
    assert agents and all(ip == "::" for _, ip, _ in agents), agents
    private = results[0].network == "private"
    outside = [x for x in watch.reachable() if private or "torch.distributed.run" not in x[3]]
    assert not outside, f"reachable from another machine (pid, address, port, command): {outside}"

    # Nothing of the run is left: no process that names its folder, no socket it listened on.
    assert _mentioning(str(folder)) == []
    pids = {pid for pid, _, _ in watch.seen}
    still = listening(pids)
    assert not still, f"still listening: {still}"


def _write(folder: Path, name: str, records: list[dict]) -> None:
    (folder / name).write_text("".join(json.dumps(r) + "\n" for r in records))


def test_the_restart_summary_counts_the_time_lost_and_the_steps_redone(tmp_path):
    # Rank 0: steps 1..6 at 1 s intervals in attempt 0; rank 1 dies at step 6 (t = 6.5); attempt 1
    # resumes from the checkpoint of step 4 and commits 5, 6, 7 at t = 20, 21, 22.
    step = [{"t": float(i), "step": i, "loss": 1.0, "participants": 2, "committed": True, "digest": "x"}
            for i in range(1, 7)]
    _write(tmp_path, "restart-r0-a0.jsonl", [{"t": 0.0, "event": "start"}, *step])
    _write(tmp_path, "restart-r1-a0.jsonl",
           [{"t": 0.0, "event": "start"}, {"t": 6.5, "event": "kill", "step": 6}])
    again = [{"t": 15.0 + i, "step": i, "loss": 1.0, "participants": 2, "committed": True, "digest": "x"}
             for i in (5, 6, 7)]
    _write(tmp_path, "restart-r0-a1.jsonl", [{"t": 19.0, "event": "resumed", "step": 4}, *again])
    s = summarize_restart(read_logs(tmp_path, "restart"))
    assert (s.kill_step, s.checkpoint_step, s.redone_steps) == (6, 4, 2)
    assert s.first_step_after == pytest.approx(13.5)
    assert s.new_step_after == pytest.approx(15.5)
    assert s.normal_step == pytest.approx(1.0)
