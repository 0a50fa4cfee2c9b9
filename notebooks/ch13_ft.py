"""Chapter 13: training that heals without a restart (torchft), and the restart it replaces.

Three ways to run it, each a process of the demo (the notebook starts them with run_commands):

    python ch13_ft.py lighthouse --port P --folder F        # torchft's lighthouse, on 127.0.0.1
    torchrun --nproc_per_node=1 ... ch13_ft.py ft --replica R --lighthouse http://127.0.0.1:P --folder F
    torchrun --nproc_per_node=2 --max-restarts=1 ... ch13_ft.py restart --folder F

``ft``: one replica group (here one process) of a torchft job. Every step asks the lighthouse for
a quorum, all-reduces the gradients across the replica groups in it, and steps the optimizer only
if the manager says the step may commit. ``--kill-at K`` makes the replica kill itself with SIGKILL
at step K of its first attempt; its torchrun starts a new process, which joins the next quorum and
is healed: the manager copies the model and optimizer state from a replica that is up to date.
``--rejoin-after N`` makes that replacement wait until the survivor has committed N steps alone.

``restart``: the same training as plain DDP in one torchrun job, a checkpoint every
``--save-every`` steps; the same SIGKILL at step K, after which torchrun restarts every worker and
they resume from the last checkpoint.

Each process appends one JSON line per step to ``F/<mode>-r<replica or rank>-a<attempt>.jsonl``:
time, step, loss, participants, whether the step committed, and a digest of the weights.
"""

import argparse
import datetime
import gc
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

from course_utils.data import make_dataset, make_model, split

BATCH = 64  # samples per step, split among the replica groups (or ranks) taking part
LR, MOMENTUM = 0.05, 0.9


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("lighthouse", "ft", "restart"))
    p.add_argument("--folder", required=True, help="where the logs go (and the checkpoint)")
    p.add_argument("--replica", type=int, default=0, help="ft: this replica group's index")
    p.add_argument("--replicas", type=int, default=2, help="replica groups the demo starts")
    p.add_argument("--lighthouse", default="", help="ft: the lighthouse's address")
    p.add_argument("--port", type=int, default=0, help="lighthouse: the port to listen on")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=2000,
                   help="lighthouse: silence after which a replica counts as dead (torchft: 5000)")
    p.add_argument("--steps", type=int, default=300, help="steps at least")
    p.add_argument("--together", type=int, default=40,
                   help="ft: after a kill, go on until this many steps committed with all replicas")
    p.add_argument("--kill-at", type=int, default=-1, help="this replica (restart: rank 1) is SIGKILLed "
                   "at this step of its first attempt")
    p.add_argument("--rejoin-after", type=int, default=0,
                   help="ft: a replacement waits until another group has committed this many steps alone")
    p.add_argument("--save-every", type=int, default=25, help="restart: steps between checkpoints")
    p.add_argument("--step-time", type=float, default=0.02,
                   help="seconds a step lasts at least (a stand-in for a real model's compute)")
    p.add_argument("--stop-by", type=float, default=0.0, help="unix time at which every process stops")
    return p.parse_args(argv)


class StepLog:
    """One JSON line per event, written through at once: a SIGKILL loses nothing already logged."""

    def __init__(self, path):
        self.file = open(path, "a", buffering=1)

    def __call__(self, **record):
        self.file.write(json.dumps(dict(t=time.time(), **record)) + "\n")


def digest(model):
    """A short fingerprint of the weights: equal digests mean bit-identical parameters."""
    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:12]


def batch(data, step, part, parts):
    """Rows ``part::parts`` of the global batch of ``step``: the same on every replica group."""
    x, y = data
    idx = torch.arange(step * BATCH, (step + 1) * BATCH) % len(x)
    idx = idx[part::parts]
    return x[idx], y[idx]


def created():
    """When this process was created, in unix time, to the clock tick (10 ms).

    ``psutil.Process().create_time()`` adds the start to the boot time, which Linux gives in
    whole seconds, so it can be up to a second early; the time since boot is exact.
    """
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age


def kill_myself(log, step):
    log(event="kill", step=step)
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)  # no clean-up, no goodbye: as when a machine dies


def pace(started, step_time):
    time.sleep(max(0.0, step_time - (time.monotonic() - started)))


# --------------------------------------------------------------------------------------- lighthouse

def lighthouse(args):
    """The lighthouse: forms a quorum of replica groups for every step; stops when they are done."""
    from torchft._torchft import LighthouseServer  # torchft where it is used: `restart` runs without it

    server = LighthouseServer(bind=f"127.0.0.1:{args.port}", min_replicas=1, join_timeout_ms=10000,
                              quorum_tick_ms=50, heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    print(f"lighthouse listening on 127.0.0.1:{args.port}", flush=True)
    folder = Path(args.folder)
    try:
        while time.time() < args.stop_by:
            if len(list(folder.glob("ft-r*.done"))) >= args.replicas:
                break
            time.sleep(0.1)
    finally:
        server.shutdown()
    print("lighthouse stopped", flush=True)


# ----------------------------------------------------------------------------------------- torchft

def average_gradients(manager, model):
    """All-reduce every gradient at once (one flat buffer), averaged over the step's participants.

    torchft's DistributedDataParallel does this in a DDP communication hook, but in torchft 0.2.0
    that hook fails with an AssertionError when a peer dies during the all-reduce (``ddp.py``,
    ``assert fut._fut``), which kills the survivor too. ``manager.allreduce`` itself records the
    error instead, and ``should_commit()`` then says no: the step is discarded, not the process.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    manager.allreduce(flat).wait()  # a replica being healed sends zeros: it takes no part yet
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


def wait_for_steps_alone(folder, me, steps, stop_by):
    """A stand-in for a replacement machine that takes a while to come up.

    It waits before its manager exists: a manager heartbeats from its start, and a replica group
    that heartbeats without asking for a quorum counts as alive, so the lighthouse would refuse a
    quorum without it (the rule of more than half of the living).
    """
    while time.time() < stop_by:
        for f in folder.glob("ft-r*-a0.jsonl"):
            if f.name != f"ft-r{me}-a0.jsonl":
                records = [json.loads(line) for line in f.read_text().splitlines() if line.endswith("}")]
                if sum(1 for r in records if r.get("committed") and r["participants"] == 1) >= steps:
                    return
        time.sleep(0.05)


def loopback_manager_server(**kwargs):
    """torchft 0.2.0's Manager binds its server to [::] (every interface): keep it on loopback."""
    from torchft._torchft import ManagerServer

    return ManagerServer(**dict(kwargs, bind="127.0.0.1:0"))


def ft(args):
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    folder = Path(args.folder)
    if time.time() > args.stop_by:  # a replacement that comes too late: the others have finished
        return
    log = StepLog(folder / f"ft-r{args.replica}-a{attempt}.jsonl")
    if attempt > 0 and args.rejoin_after > 0:
        wait_for_steps_alone(folder, args.replica, args.rejoin_after, args.stop_by)
        log(event="waited")
    data = split(make_dataset())[0].tensors
    model = make_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

    def load_state_dict(state):  # called on the replica being healed, with a peer's state
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        log(event="healed")

    def state_dict():  # called on the replica that heals another
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    timeout = datetime.timedelta(seconds=10)
    pg = ProcessGroupGloo(timeout=timeout)
    with mock.patch("torchft.manager.ManagerServer", loopback_manager_server):
        manager = Manager(
            pg=pg, min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
            replica_id=f"replica{args.replica}", lighthouse_addr=args.lighthouse, hostname="127.0.0.1",
            # the state travels over the replicas' gloo group, not a HTTP server on every interface
            checkpoint_transport=PGTransport(pg, timeout=timeout, device=torch.device("cpu")),
            timeout=timeout, quorum_timeout=datetime.timedelta(seconds=30),
            connect_timeout=timeout, init_sync=False)
    log(event="start", pid=os.getpid(), created=created())
    if attempt == 0:  # the first replicas start together (a replacement just joins)
        (folder / f"ft-r{args.replica}.ready").touch()
        while len(list(folder.glob("ft-r*.ready"))) < args.replicas and time.time() < args.stop_by:
            time.sleep(0.05)

    together = 0
    try:
        while time.time() < args.stop_by:
            started = time.monotonic()
            step = manager.current_step()
            manager.start_quorum()  # asynchronous: the lighthouse answers during the forward pass
            if step == args.kill_at and attempt == 0:
                manager.wait_quorum()  # it is in this step's quorum: the others count on its gradients
                kill_myself(log, step)
            optimizer.zero_grad()
            x, y = batch(data, step, args.replica, args.replicas)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            average_gradients(manager, model)
            committed = manager.should_commit()
            if committed:
                optimizer.step()
            participants = manager.num_participants()
            log(step=manager.current_step(), loss=loss.item(), participants=participants,
                committed=committed, digest=digest(model))
            together = together + 1 if committed and participants == args.replicas else 0
            if manager.current_step() >= args.steps and together >= args.together:
                break
            pace(started, args.step_time)
    finally:
        (folder / f"ft-r{args.replica}.done").touch()
        log(event="done")
        manager.shutdown(wait=True)
        pg.shutdown()
        gc.collect()


# ----------------------------------------------------------------------- torchrun restart from a checkpoint

def save_checkpoint(path, model, optimizer, step):
    """Atomically: the bytes go to a temporary file that then replaces the old checkpoint."""
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)


def restart(args):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    folder = Path(args.folder)
    log = StepLog(folder / f"restart-r{rank}-a{attempt}.jsonl")
    log(event="start", pid=os.getpid(), created=created())
    data = split(make_dataset())[0].tensors
    model = make_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    ckpt = folder / "restart.pt"
    step = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        step = state["step"]
        log(event="resumed", step=step)
    ddp = DDP(model)
    while step < args.steps:
        started = time.monotonic()
        if step == args.kill_at and attempt == 0 and rank == 1:
            kill_myself(log, step)
        optimizer.zero_grad()
        x, y = batch(data, step, rank, world)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        optimizer.step()
        step += 1
        log(step=step, loss=loss.item(), participants=world, committed=True, digest=digest(model))
        if step % args.save_every == 0 and rank == 0:
            save_checkpoint(ckpt, model, optimizer, step)
            log(event="saved", step=step)
        pace(started, args.step_time)
    log(event="done")
    dist.barrier()  # rank 0 hosts the store: nobody leaves while another rank may still use it
    del ddp
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    {"lighthouse": lighthouse, "ft": ft, "restart": restart}[args.mode](args)
