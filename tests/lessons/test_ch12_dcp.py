"""Chapter 12, section 4: a checkpoint saved with the lesson's recipe (``ch12_dcp.save_atomic``) is
whole or absent, also when a rank is SIGKILLed in the middle of a save.

The kill is real: rank 1 dies of SIGKILL when it opens its shard file for writing, once rank 0 has
written its own shards of the same save (an audit hook sees the ``open``; nothing of torch is
replaced).  Written over the previous checkpoint's folder, that leaves rank 0's rows from the new save
beside rank 1's from the old one, and the old ``.metadata`` loads both without a word (shown first,
as the reason); with ``save_atomic`` the load sees the earlier checkpoint, and a folder whose only
save was killed refuses to load, saying why.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from course_utils import launch
from course_utils.workers.errors import WorkerError

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


@pytest.fixture(autouse=True)
def _lesson_folder(monkeypatch):
    monkeypatch.chdir(NOTEBOOKS)  # workers get this cwd and path: they import ch12_dcp and ch12_mesh
    monkeypatch.syspath_prepend(str(NOTEBOOKS))


def _save(root: str, seed: int, atomic: bool, kill_rank1: bool):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from ch12_dcp import build, full_state, save_atomic, step
    from torch.distributed.checkpoint.state_dict import get_state_dict

    with _group():
        model, opt = build(seed=seed)
        step(model, opt, 0)
        msd, osd = get_state_dict(model, opt)
        if kill_rank1 and dist.get_rank() == 1:
            _SAVE_STARTED.append(time.time())  # rank 0's file of *this* save is newer than this
            sys.addaudithook(_kill_when_rank0_has_written)
        if atomic:
            save_atomic({"model": msd, "optim": osd}, root)
        else:
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=root)
        return full_state(model, opt)["model"]


_SAVE_STARTED: list[float] = []


def _kill_when_rank0_has_written(event, args):
    """On the open of this rank's shard file: wait until rank 0 has written its file of the same save
    (newer than this save's start, and no longer changing), then die."""
    if event != "open" or not str(args[0]).endswith(".distcp") or "w" not in str(args[1]):
        return
    theirs = Path(str(args[0])).with_name("__0_0.distcp")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            st = theirs.stat()
        except FileNotFoundError:
            st = None
        if st is not None and st.st_mtime > _SAVE_STARTED[0] and st.st_size > 0:
            time.sleep(0.3)
            if theirs.stat().st_mtime_ns == st.st_mtime_ns:
                break
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)


def _load(root: str, atomic: bool):
    import torch.distributed.checkpoint as dcp
    from ch12_dcp import build, full_state, load_latest
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    with _group():
        model, opt = build(seed=7)
        msd, osd = get_state_dict(model, opt)
        if atomic:
            load_latest({"model": msd, "optim": osd}, root)
        else:
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=root)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        return full_state(model, opt)["model"]


def _group():
    import warnings

    from ch12_mesh import group

    warnings.filterwarnings("ignore")  # FSDP2's view warning, dcp's "overwriting" warning
    return group()


def _killed_save(root: str, atomic: bool) -> None:
    with pytest.raises(WorkerError) as e:
        launch(_save, nprocs=2, args=(root, 1, atomic, True), timeout=120)
    assert "rank 1 was killed by SIGKILL" in str(e.value), str(e.value)


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_a_save_written_in_place_and_killed_loads_as_a_silent_mix(tmp_path):
    root = str(tmp_path / "in_place")
    new = launch(_save, nprocs=2, args=(str(tmp_path / "scratch"), 1, False, False), timeout=120)[0]
    old = launch(_save, nprocs=2, args=(root, 0, False, False), timeout=120)[0]
    _killed_save(root, atomic=False)
    got = launch(_load, nprocs=2, args=(root, False), timeout=120)[0]
    w = got["0.weight"]
    half = len(w) // 2
    assert torch.equal(w[:half], new["0.weight"][:half]) and torch.equal(w[half:], old["0.weight"][half:])


def test_save_atomic_killed_mid_save_loads_the_previous_checkpoint_or_refuses(tmp_path):
    root = str(tmp_path / "atomic")
    old = launch(_save, nprocs=2, args=(root, 0, True, False), timeout=120)[0]
    _killed_save(root, atomic=True)
    got = launch(_load, nprocs=2, args=(root, True), timeout=120)[0]
    assert _same(got, old)

    fresh = str(tmp_path / "fresh")
    os.makedirs(fresh)
    _killed_save(fresh, atomic=True)
    refused = "no complete checkpoint in .*a save that was interrupted leaves none"
    with pytest.raises(WorkerError, match=refused):
        launch(_load, nprocs=2, args=(fresh, True), timeout=120)
