"""Record the flight-recorder dumps that exercise 13.a's checker feeds the learner's ``find_culprit``.

``python tools/record_ch13_dumps.py [failure ...]`` runs one real ``torchrun`` job per failure
(4 ranks, gloo on CPU, the recorder on): every rank trains a few steps of a toy data-parallel loop,
then one rank misbehaves.  When the group times out (2 s) or a peer's connection closes, every rank
dumps its record with ``torch._C._distributed_c10d._dump_fr_trace()`` and the dumps of one job are
written, as JSON, to ``course_utils/checks/ch13/dumps/<failure>.json`` (``{rank: dump}``).

Each step of the loop issues, like DDP, one asynchronous all-reduce per gradient bucket (shapes
(4, 3) and (3,)) and then the all-reduce of the loss (one float), and waits for them all (in
``order``, every step also broadcasts the first bucket after its all-reduce):

| failure | the rank that misbehaves, at step 3 |
| --- | --- |
| ``healthy`` | none: every rank runs 5 steps |
| ``missing`` | rank 2 sleeps 3 s instead (longer than the group's timeout), then dumps |
| ``missing_wrapped`` | rank 1 sleeps instead; the buffer holds 8 entries, so older ones are gone |
| ``collective`` | rank 2 calls ``barrier()`` instead of the first bucket's all-reduce |
| ``order`` | rank 0 issues the broadcast of the first bucket before its all-reduce, not after |
| ``shape`` | rank 3 all-reduces its first bucket as a (6, 2) view: the same 12 floats, another shape |

In ``shape`` the job goes on: gloo sees 12 floats on every rank.  A bucket of another size (tried:
(2, 3)) makes gloo's thread abort the culprit's process (SIGABRT), which then leaves no dump.

The paths of the frames are cut to the file's name (``record_ch13_dumps.py``) and to what follows
``site-packages/``, so that the files do not carry the recording machine's folders.  Rerun it after
a torch upgrade that changes the dump's format; the checker's tests say what they expect.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
OUT = HERE.parent.parent / "course_utils" / "checks" / "ch13" / "dumps"
WORLD = 4
FAILURES = {  # failure -> (the rank that misbehaves, TORCH_FR_BUFFER_SIZE)
    "healthy": (None, 64),
    "missing": (2, 64),
    "missing_wrapped": (1, 8),
    "collective": (2, 64),
    "order": (0, 64),
    "shape": (3, 64),
}
BAD_STEP = 3


def _step(dist, torch, failure: str, odd: bool) -> None:
    """One step's collectives: two bucket all-reduces and the loss, asynchronous, then waited for."""
    bucket0, bucket1, loss = torch.ones(4, 3), torch.ones(3), torch.ones(1)
    works = []
    if odd and failure == "collective":
        works.append(dist.barrier(async_op=True))
    elif odd and failure == "shape":
        works.append(dist.all_reduce(bucket0.view(6, 2), async_op=True))
    elif odd and failure == "order":  # the broadcast first, then the all-reduce
        works.append(dist.broadcast(bucket0, 0, async_op=True))
        works.append(dist.all_reduce(bucket0, async_op=True))
    else:
        works.append(dist.all_reduce(bucket0, async_op=True))
        if failure == "order":  # everyone else: the all-reduce, then the broadcast
            works.append(dist.broadcast(bucket0, 0, async_op=True))
    works.append(dist.all_reduce(bucket1, async_op=True))
    works.append(dist.all_reduce(loss, async_op=True))
    for w in works:
        w.wait()


def worker(failure: str, folder: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=2))
    rank = dist.get_rank()
    culprit, _ = FAILURES[failure]
    steps = 5 if failure == "healthy" else BAD_STEP + 1
    try:
        for step in range(steps):
            odd = rank == culprit and step == BAD_STEP
            if odd and failure.startswith("missing"):
                time.sleep(3)  # somewhere else: never arrives at this step's collectives
                break
            _step(dist, torch, failure, odd)
    except RuntimeError as e:  # the group timed out, or a peer closed its connection
        print(f"rank {rank}: {str(e).splitlines()[0][:120]}", flush=True)
    dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    Path(folder, f"{rank}.pkl").write_bytes(pickle.dumps(dump))
    os._exit(0)  # a timed-out gloo group can block its own teardown


def _portable(value):
    """The dump with tuples as lists and frame paths without this machine's folders."""
    if isinstance(value, dict):
        out = {k: _portable(v) for k, v in value.items()}
        if "filename" in out and isinstance(out["filename"], str):
            name = out["filename"]
            out["filename"] = (name.split("site-packages/", 1)[1] if "site-packages/" in name
                               else Path(name).name)
        return out
    if isinstance(value, (list, tuple)):
        return [_portable(v) for v in value]
    return value


def _json(dumps: dict) -> str:
    """Compact JSON with one line per entry, so that a new recording reads as a diff."""
    ranks = []
    for rank, dump in dumps.items():
        head = {k: v for k, v in dump.items() if k != "entries"}
        entries = ",\n".join(json.dumps(e, separators=(",", ":")) for e in dump["entries"])
        ranks.append(f'"{rank}":{json.dumps(head, separators=(",", ":"))[:-1]},"entries":[\n{entries}]}}')
    return "{" + ",\n".join(ranks) + "}\n"


def main() -> None:
    sys.path.insert(0, str(HERE.parent.parent))
    from course_utils import run_commands

    OUT.mkdir(parents=True, exist_ok=True)
    for failure, (_, size) in FAILURES.items():
        if sys.argv[1:] and failure not in sys.argv[1:]:
            continue
        with tempfile.TemporaryDirectory() as folder:
            run_commands({failure: [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                    f"--nproc_per_node={WORLD}", str(HERE), "--worker", failure, folder]},
                         timeout=120, env={"OMP_NUM_THREADS": "1", "TORCH_FR_BUFFER_SIZE": size,
                                           "TORCH_CPP_LOG_LEVEL": "FATAL"}, check=True)
            # Unpickled as they are: files this script's own job wrote, a moment ago, into a private
            # temporary folder (a learner's dumps are read as data only: measure.ch13.load_dumps).
            dumps = {r: pickle.loads(Path(folder, f"{r}.pkl").read_bytes()) for r in range(WORLD)}
        path = OUT / f"{failure}.json"
        path.write_text(_json(_portable(dumps)))
        print(f"{path}: {path.stat().st_size:,} bytes")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3])
    else:
        main()
