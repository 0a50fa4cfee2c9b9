"""Chapter 04's DDP training loop grown into a script for real clusters.

What it adds to ch04_train.py: argument parsing for everything a job needs, logging from rank 0
only, checkpoints every few *steps* (so a crash mid-epoch loses little) written atomically and
read with ``weights_only=True``, ``@record`` so that torchrun reports the root cause of a failure,
``--data-dir`` to prepare the data once per node (local rank 0 writes it, the others wait at a
barrier), a save on a preemption warning (SIGUSR1: every rank stops after the same step, with a
checkpoint of it), and three switches for the lessons: ``--show-env`` (every worker prints what the
launcher gave it), ``--crash-at-step`` (one worker fails on purpose, in the first attempt only) and
``--step-time`` (slow the steps of the first run down, so that a demo can interrupt it mid-run).

The same file runs unchanged:

    python ch06_train.py                                               # one process
    python -m torch.distributed.run --standalone --nproc_per_node=2 ch06_train.py
    python -m torch.distributed.run --nnodes=2 --nproc_per_node=2 --rdzv_backend=c10d \\
        --rdzv_endpoint=HOST:PORT --rdzv_id=JOB ch06_train.py             # on every node
    course_utils.launch(ch06_train.main, 2, args=(["--steps", "30"],))  # from a notebook
    sbatch ch06_slurm.sbatch        # Slurm + torchrun;  sbatch ch06_slurm_srun.sh: Slurm alone
"""

import argparse
import contextlib
import datetime
import gc
import itertools
import json
import os
import signal
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Sampler, SequentialSampler, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import course_utils
from course_utils.data import make_dataset, make_model

# WORKAROUND, not part of the recipe: a torch bug that can abort gloo workers at exit
# (course_utils/workarounds.py names it and links the upstream issue). Delete when fixed.
from course_utils.workarounds import apply_all

apply_all()

# What a launcher tells each worker (torchrun sets them all; see the chapter's table).
ENV_KEYS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
            "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
            "SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURMD_NODENAME", "OMP_NUM_THREADS")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40, help="optimizer steps in total")
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--samples", type=int, default=2048, help="training samples (plus 512 held out)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default="",
                   help="node-local folder: local rank 0 writes the data set there once (else: in memory)")
    p.add_argument("--ckpt", default="", help="checkpoint file; resume from it when it exists")
    p.add_argument("--save-every", type=int, default=10, help="steps between checkpoints")
    p.add_argument("--out", default="", help="rank 0 saves the final model's state_dict here")
    p.add_argument("--log-every", type=int, default=10, help="steps between log lines")
    p.add_argument("--timeout", type=float, default=60.0, help="process group timeout, seconds")
    p.add_argument("--show-env", action="store_true", help="every worker prints its environment")
    p.add_argument("--crash-at-step", type=int, default=-1,
                   help="one worker raises at this step in the first attempt (restart count 0)")
    p.add_argument("--crash-rank", type=int, default=-1, help="which rank crashes (-1: the last)")
    p.add_argument("--step-time", type=float, default=0.0,
                   help="seconds each step of the first run lasts at least (a demo's time to interrupt "
                        "it; a restarted or requeued run goes at full speed)")
    return p.parse_args(argv)


def log(*args):
    """Print from global rank 0 only: one line per event instead of one per process."""
    if int(os.environ.get("RANK", "0")) == 0:
        print("[train]", *args, flush=True)


def setup(timeout):
    """Bind the device from LOCAL_RANK first, then join the group (env:// from the launcher)."""
    if "RANK" not in os.environ:  # plain `python ch06_train.py`: train alone
        return torch.device("cuda" if torch.cuda.is_available() else "cpu"), False
    if slurm_bound_one_gpu() and torch.cuda.is_available():
        # This task sees only its own GPU, as cuda:0: cuda:LOCAL_RANK would name one it lacks.
        torch.cuda.set_device(0)
        backend, device = "nccl", torch.device("cuda", 0)
    else:
        backend, device = course_utils.backend_and_device()  # set_device(LOCAL_RANK)
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None,
                            timeout=datetime.timedelta(seconds=timeout))
    return device, True


def slurm_bound_one_gpu(env=os.environ):
    """True when Slurm gave this task a GPU of its own (srun --gpus-per-task=1, --gpu-bind=...).

    Without binding, every task of a node sees all its GPUs (CUDA_VISIBLE_DEVICES=0,1,2,3) and
    takes cuda:LOCAL_RANK.  With per-task binding Slurm sets CUDA_VISIBLE_DEVICES to the task's
    GPU alone, which CUDA then numbers 0, whatever its index on the node.
    """
    visible = env.get("CUDA_VISIBLE_DEVICES", "")
    return "SLURM_PROCID" in env and visible != "" and "," not in visible


def show_env():
    """One JSON line per worker: what the launcher told it, and where it runs."""
    info = {k: os.environ.get(k) for k in ENV_KEYS}
    info.update(host=socket.gethostname(), pid=os.getpid(), torch=torch.__version__,
                cpus=sorted(os.sched_getaffinity(0)))  # the CPUs this process may run on
    # One write call: the workers of a node share the agent's output, and print() would write
    # the text and the newline separately, so that two workers' lines could interleave.
    sys.stdout.write("ENV " + json.dumps(info) + "\n")
    sys.stdout.flush()


def prepare_data(folder, samples, seed):
    """The data set as a file in ``folder``, made once per node (if the folder is node-local).

    The usual pattern for downloading or unpacking a data set: local rank 0 of each node writes
    it (to a temporary name, then renames it, so that nobody can read half a file), and everyone
    waits at a barrier before reading it. Here the "download" is the course's synthetic data.
    """
    path = os.path.join(folder, f"ch06-data-{samples}-{seed}.pt")
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        x, y = make_dataset(samples, seed=seed).tensors
        tmp = f"{path}.{socket.gethostname()}.{os.getpid()}.tmp"
        torch.save({"x": x, "y": y}, tmp)
        os.replace(tmp, path)
    if dist.is_initialized():
        dist.barrier()  # the other ranks read only after local rank 0 has finished writing
    data = torch.load(path, weights_only=True)
    return TensorDataset(data["x"], data["y"])


def save_checkpoint(path, model, optimizer, step):
    """Write the checkpoint so that a crash at any moment leaves the previous one intact.

    The bytes go to a temporary file in the same directory (same file system, so the rename
    cannot turn into a copy), are forced to disk, and only then replace ``path`` with
    ``os.replace``, which is atomic: a reader sees the old file or the new one, never half.
    The rename itself is a change to the directory, forced to disk last: without that, a power
    failure just after the save can bring back the old name's entry although the new bytes
    were written.
    """
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    directory = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def load_checkpoint(path, model, optimizer, device):
    """Read tensors and plain containers only (``weights_only=True`` runs no pickled code).

    A file that is not a whole checkpoint (cut short, or written by a save that did not finish
    in place) is refused with a message that says so, instead of torch's zip-reader error.
    """
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except (RuntimeError, EOFError) as e:
        if "PytorchStreamReader" not in str(e) and not isinstance(e, EOFError):
            raise
        what = (str(e).splitlines() or [type(e).__name__])[0]
        raise RuntimeError(f"{path} is not a whole checkpoint: it ends before its last record ({what}). "
                           "A save stopped half-way wrote it in place; save_checkpoint never does (it "
                           "renames a finished file). Delete it to start over, or put the previous "
                           "checkpoint back.") from e
    if not isinstance(state, dict) or not {"model", "optimizer", "step"} <= state.keys():
        raise RuntimeError(f"{path} is not a checkpoint of this script: it has no model, optimizer "
                           "and step entries")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


@torch.no_grad()
def evaluate(model, x, y, device, rank, world):
    """Held-out accuracy: each rank scores every world-th sample, then one all_reduce."""
    model.eval()
    x, y = x[rank::world], y[rank::world]
    counts = torch.stack([(model(x.to(device)).argmax(1) == y.to(device)).sum().float(),
                          torch.tensor(float(len(y)), device=device)])
    if dist.is_initialized():
        dist.all_reduce(counts)
    model.train()
    return (counts[0] / counts[1]).item()


class PreemptionWarning:
    """SIGUSR1 sets a flag, nothing else; ``agreed()`` tells every rank whether anyone got it.

    A signal handler runs between two bytecodes of the main thread, in the middle of whatever
    it was doing (a collective, a save); it only records the wish. At the end of each step all
    ranks all-reduce the flag (MAX), so they agree on the step to stop after, even if the signal
    reached the nodes a step apart, and rank 0 saves that step before anyone leaves.
    """

    def __init__(self):
        self.requested = False
        # Only in the main thread (signal.signal's condition) and only where nobody else handles
        # SIGUSR1 already (a handler installed from C gives None here, an unknown one).
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, signal.SIG_IGN)):
            signal.signal(signal.SIGUSR1, self._set)

    def _set(self, signum, frame):
        self.requested = True

    def agreed(self, device, distributed):
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        if distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


class Skipping(Sampler):
    """The indices of ``sampler`` after its first ``n``: a run resumed at batch k of an epoch
    starts from index k x batch size, and loads nothing of the batches before it."""

    def __init__(self, sampler, n):
        self.sampler, self.n = sampler, n

    def __iter__(self):
        return itertools.islice(iter(self.sampler), self.n, None)

    def __len__(self):
        return max(0, len(self.sampler) - self.n)


def train(args):
    if args.show_env:
        show_env()  # before joining the group: shows what a worker got even if joining fails
    warning = PreemptionWarning()  # before the slow start: a warning may come at any time
    device, distributed = setup(args.timeout)
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    full = (prepare_data(args.data_dir, args.samples + 512, args.seed) if args.data_dir
            else make_dataset(args.samples + 512, seed=args.seed))  # the same data on every rank
    train_set = Subset(full, range(args.samples))
    x_val, y_val = (t[args.samples:] for t in full.tensors)
    model = make_model(seed=args.seed).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    step = 0
    if args.ckpt and os.path.exists(args.ckpt):
        step = load_checkpoint(args.ckpt, model, optimizer, device)
        log(f"attempt {attempt}: resumed from {os.path.basename(args.ckpt)} at step {step}")
    if distributed:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    plain = model.module if distributed else model

    sampler = (DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
               if distributed else SequentialSampler(train_set))
    per_epoch = len(sampler) // args.batch_size  # full batches only (drop_last)
    slurm = (f", Slurm job {os.environ['SLURM_JOB_ID']} run {os.environ.get('SLURM_RESTART_COUNT', '0')}"
             if "SLURM_JOB_ID" in os.environ else "")  # a requeued job runs again, same job id
    log(f"attempt {attempt}: world size {world}, global batch {args.batch_size * world}, "
        f"{per_epoch} steps per epoch, device {device}{slurm}")
    crash_rank = world - 1 if args.crash_rank < 0 else args.crash_rank
    first_run = attempt == 0 and os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
    step_time = args.step_time if first_run else 0.0

    stop = False
    while step < args.steps and not stop:
        # The data order depends on the step alone: a resumed run reads exactly the batches
        # that the lost attempt would have read (set_epoch, then skip the finished ones). The
        # skip happens in the sampler, among indices: no sample of a finished batch is loaded,
        # as itertools.islice over the loader would do (it loads each batch, then drops it).
        epoch, done = divmod(step, per_epoch)
        if distributed:
            sampler.set_epoch(epoch)
        loader = DataLoader(train_set, batch_size=args.batch_size, drop_last=True,
                            sampler=Skipping(sampler, done * args.batch_size),
                            pin_memory=device.type == "cuda")
        for x, y in loader:
            if step >= args.steps:
                break
            if step == args.crash_at_step and attempt == 0 and rank == crash_rank:
                raise RuntimeError(f"simulated failure on rank {rank} at step {step}")
            started = time.monotonic()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()  # DDP averages the gradients across all ranks of all nodes
            optimizer.step()
            step += 1
            course_utils.report(step=step, loss=loss.item())
            time.sleep(max(0.0, step_time - (time.monotonic() - started)))
            if args.log_every and step % args.log_every == 0:
                log(f"step {step:3d}  loss on rank 0 {loss.item():.4f}")
            stop = warning.agreed(device, distributed)  # every rank the same answer, every step
            if args.ckpt and rank == 0 and (stop or step % args.save_every == 0 or step == args.steps):
                save_checkpoint(args.ckpt, plain, optimizer, step)
                log(f"step {step:3d}  checkpoint saved")
            if stop:
                break

    final = None
    if stop:  # a requeued run resumes from this step's checkpoint
        log(f"preemption warning: stopped after step {step}, "
            f"{'its checkpoint saved' if args.ckpt else 'nothing saved (no --ckpt)'}")
    else:
        acc = evaluate(model, x_val, y_val, device, rank, world)
        log(f"done: {step} steps, held-out accuracy {acc:.3f}")
        final = {k: v.detach().cpu().clone() for k, v in plain.state_dict().items()}
        if args.out and rank == 0:
            tmp = args.out + ".tmp"
            torch.save(final, tmp)
            os.replace(tmp, args.out)
    if distributed:
        dist.barrier()  # nobody leaves while another rank may still be talking to it
        # DDP's reducer holds the process group: release it first (gc: DDP has reference
        # cycles), so that destroy_process_group really stops gloo's threads while Python is
        # fully alive; left to interpreter shutdown, that clean-up can crash the process.
        del model
        gc.collect()
        dist.destroy_process_group()
    return final


@record  # on an uncaught exception: the traceback goes to TORCHELASTIC_ERROR_FILE for torchrun
def main(argv=None):
    return train(parse_args(argv))


if __name__ == "__main__":
    main()
