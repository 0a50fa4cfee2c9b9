"""Chapter 16: torchft's DiLoCo on the course model, with a lighthouse, and a replica killed mid-run.

Two ways to run it, each a process of the demo (the notebook starts them with run_commands, through
``course_utils.measure.ch16.run_ft``):

    python ch16_ft.py lighthouse --port P --folder F          # torchft's lighthouse (chapter 13's)
    torchrun --nproc_per_node=1 ... ch16_ft.py diloco --replica R --lighthouse http://127.0.0.1:P --folder F

``diloco``: one replica group (here one process) training the course model with AdamW inside
torchft's ``DiLoCo``: every ``--sync-every`` inner steps the manager asks the lighthouse for a quorum,
the pseudo-gradients (global minus local) are averaged over the replicas in it, and an outer SGD
with Nesterov momentum steps the global copy. ``--kill-at K`` makes replica 1 kill itself with
SIGKILL after its K-th outer step (between outer steps); its torchrun starts a new process, which
joins a later quorum and is healed from the survivor: the model, the inner optimizer and DiLoCo's
global copy arrive from it.

Each process appends one JSON line per outer step to ``F/diloco-r<replica>-a<attempt>.jsonl`` and,
at the end, saves its weights to ``F/final-r<replica>-a<attempt>.pt``. ``simulate`` is the same
algorithm in one process, two models side by side, for the comparison.
"""

import argparse
import datetime
import gc
import json
import os
import time
from pathlib import Path
from unittest import mock

import ch13_ft
import torch
import torch.nn.functional as F

from course_utils.data import make_dataset, make_model, split

BATCH = 64  # samples per inner step, split between the two replicas (32 each)
INNER_LR, OUTER_LR, MOMENTUM = 3e-3, 0.7, 0.9


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("lighthouse", "diloco"))
    p.add_argument("--folder", required=True)
    p.add_argument("--replica", type=int, default=0)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--lighthouse", default="")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--heartbeat-timeout-ms", type=int, default=2000)
    p.add_argument("--sync-every", type=int, default=8, help="inner steps per outer step (H)")
    p.add_argument("--rounds", type=int, default=8, help="outer steps to commit")
    p.add_argument("--kill-at", type=int, default=-1, help="replica 1 is SIGKILLed after this outer step")
    p.add_argument("--rejoin-after", type=int, default=2,
                   help="a replacement waits until the survivor has committed this many outer steps alone")
    p.add_argument("--together", type=int, default=0,
                   help="after --rounds, go on until this many outer steps committed with every replica")
    p.add_argument("--round-time", type=float, default=0.0,
                   help="seconds an outer round lasts at least (a stand-in for a real model's compute)")
    p.add_argument("--stop-by", type=float, default=0.0, help="unix time at which every process stops")
    return p.parse_args(argv)


def batch(data, step, part, parts):
    """Rows ``part::parts`` of the global batch of inner step ``step``: the same on every replica."""
    x, y = data
    idx = torch.arange(step * BATCH, (step + 1) * BATCH) % len(x)
    return x[idx[part::parts]], y[idx[part::parts]]


def wait_for_rounds_alone(folder, me, rounds, stop_by):
    """A replacement that takes a while to come up: it waits until another replica has committed
    ``rounds`` outer steps alone (before its manager exists: a manager heartbeats from its start)."""
    while time.time() < stop_by:
        for f in folder.glob("diloco-r*-a0.jsonl"):
            if f.name != f"diloco-r{me}-a0.jsonl":
                rows = [json.loads(x) for x in f.read_text().splitlines() if x.endswith("}")]
                if sum(1 for r in rows if r.get("committed") and r.get("participants") == 1) >= rounds:
                    return
        time.sleep(0.05)


def diloco(args):
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.local_sgd import DiLoCo

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    folder = Path(args.folder)
    if time.time() > args.stop_by:
        return
    log = ch13_ft.StepLog(folder / f"diloco-r{args.replica}-a{attempt}.jsonl")
    if attempt > 0:
        wait_for_rounds_alone(folder, args.replica, args.rejoin_after, args.stop_by)
        log(event="waited")
    data = split(make_dataset())[0].tensors
    model = make_model(0)
    inner = torch.optim.AdamW(model.parameters(), lr=INNER_LR, weight_decay=0.0)
    outer = torch.optim.SGD(model.parameters(), lr=OUTER_LR, momentum=MOMENTUM, nesterov=True)

    def load_state_dict(state):  # on the replica being healed: the survivor's model and optimizers
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])
        outer.load_state_dict(state["outer"])
        log(event="healed")

    def state_dict():
        return {"model": model.state_dict(), "inner": inner.state_dict(), "outer": outer.state_dict()}

    timeout = datetime.timedelta(seconds=10)
    pg = ProcessGroupGloo(timeout=timeout)
    with mock.patch("torchft.manager.ManagerServer", ch13_ft.loopback_manager_server):
        manager = Manager(
            pg=pg, min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
            replica_id=f"replica{args.replica}", lighthouse_addr=args.lighthouse, hostname="127.0.0.1",
            checkpoint_transport=PGTransport(pg, timeout=timeout, device=torch.device("cpu")),
            use_async_quorum=False,  # DiLoCo refuses an asynchronous quorum
            timeout=timeout, quorum_timeout=datetime.timedelta(seconds=30), connect_timeout=timeout,
            init_sync=False)
    log(event="start", pid=os.getpid())
    if attempt == 0:  # the first replicas start together
        (folder / f"diloco-r{args.replica}.ready").touch()
        while len(list(folder.glob("diloco-r*.ready"))) < args.replicas and time.time() < args.stop_by:
            time.sleep(0.05)
    H = args.sync_every
    try:
        with DiLoCo(manager, [model], inner, outer, sync_every=H) as algo:
            k, together, started = 0, 0, time.monotonic()  # k: inner steps since the last outer step
            while time.time() < args.stop_by and (manager.current_step() < args.rounds
                                                  or together < args.together):
                before = manager.current_step()
                x, y = batch(data, before * H + k, args.replica, args.replicas)
                inner.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                inner.step()  # DiLoCo's hook: after the H-th inner step, the outer step
                k += 1
                if k == H:
                    k = 0
                    committed = manager.current_step() > before
                    everyone = manager.num_participants() == args.replicas
                    together = together + 1 if committed and everyone else 0
                    log(step=manager.current_step(), loss=loss.item(),
                        participants=manager.num_participants(), committed=committed,
                        digest=ch13_ft.digest(model))
                    ch13_ft.pace(started, args.round_time)
                    started = time.monotonic()
                    if manager.current_step() == args.kill_at and attempt == 0 and args.replica == 1:
                        ch13_ft.kill_myself(log, manager.current_step())
            del algo
        torch.save(model.state_dict(), folder / f"final-r{args.replica}-a{attempt}.pt")
    finally:
        (folder / f"ft-r{args.replica}.done").touch()  # the name chapter 13's lighthouse waits for
        log(event="done")
        manager.shutdown(wait=True)
        pg.shutdown()
        gc.collect()


def simulate(rounds, sync_every, replicas=2):
    """DiLoCo in one process: ``replicas`` models, each with AdamW, the same batches as ``diloco``;
    every ``sync_every`` steps the averaged pseudo-gradient steps one global copy with SGD and
    Nesterov momentum, and every model restarts from it. Returns the final weights."""
    data = split(make_dataset())[0].tensors
    models = [make_model(0) for _ in range(replicas)]
    inners = [torch.optim.AdamW(m.parameters(), lr=INNER_LR, weight_decay=0.0) for m in models]
    glob = make_model(0)
    outer = torch.optim.SGD(glob.parameters(), lr=OUTER_LR, momentum=MOMENTUM, nesterov=True)
    for step in range(rounds * sync_every):
        for r, (m, opt) in enumerate(zip(models, inners)):
            x, y = batch(data, step, r, replicas)
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
        if (step + 1) % sync_every == 0:
            with torch.no_grad():
                for g, *local in zip(glob.parameters(), *(m.parameters() for m in models)):
                    g.grad = sum(g - p for p in local) / replicas
            outer.step()
            with torch.no_grad():
                for m in models:
                    for p, g in zip(m.parameters(), glob.parameters()):
                        p.copy_(g)
    return glob.state_dict()


if __name__ == "__main__":
    args = parse_args()
    # chapter 13's lighthouse; it stops once every replica has written its ft-r<R>.done file
    (ch13_ft.lighthouse if args.mode == "lighthouse" else diloco)(args)
