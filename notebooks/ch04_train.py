"""Train the course model with DistributedDataParallel: the articles' script, corrected.

The same file runs three ways, unchanged:

    python ch04_train.py                                                    # one process
    python -m torch.distributed.run --standalone --nproc_per_node=2 ch04_train.py --epochs 3
    course_utils.launch(ch04_train.main, 2, args=(["--epochs", "3"],))      # from a notebook

``--batch-size`` is per process, as in the articles: the global batch is batch_size x world size.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import course_utils
from course_utils.data import make_dataset, make_model, split
from course_utils.workarounds import apply_all


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64, help="per process")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--samples", type=int, default=4096, help="training samples (plus 1024 held out)")
    p.add_argument("--checkpoint", default="ch04_checkpoint.pt")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint if it exists")
    p.add_argument("--seed", type=int, default=0, help="model initialisation and shuffling")
    return p.parse_args(argv)


def setup():
    """Bind this process to its device, then join the process group.

    Returns (device, distributed).  Without RANK in the environment (plain ``python``) there is
    no process group: the script trains alone, like chapter 01.
    """
    if "RANK" not in os.environ:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu"), False
    apply_all()  # WORKAROUND for a torch bug at process exit (pytorch/pytorch#56297); see its docstring
    choice = course_utils.choose_backend()  # nccl if every local rank has a GPU, else gloo
    local_rank = int(os.environ["LOCAL_RANK"])  # the rank on *this node*, not the global RANK
    # init_method defaults to env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT come from the launcher.
    if choice.device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # bare "cuda" tensors and object collectives use this GPU
        dist.init_process_group(choice.backend, device_id=device)  # NCCL communicator created now
    else:
        device = torch.device("cpu")
        dist.init_process_group(choice.backend)
    return device, True


def unwrap(model):
    """The plain module inside DDP: its state_dict keys have no 'module.' prefix."""
    return model.module if isinstance(model, DDP) else model


def save_checkpoint(path, model, optimizer, epoch):
    """Rank 0 writes the file; every rank waits at the barrier until it is complete."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        state = {"model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
                 "epoch": epoch}
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)  # atomic: a reader sees the old file or the new one
    if dist.is_initialized():
        dist.barrier()


def load_checkpoint(path, model, optimizer, device):
    """Every rank reads the same file onto *its own* device; weights_only refuses pickled code."""
    state = torch.load(path, map_location=device, weights_only=True)
    unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["epoch"] + 1


@torch.no_grad()
def evaluate(model, x, y, device, rank, world):
    """Accuracy over the whole held-out set: each rank scores every world-th sample, no padding."""
    model.eval()
    x, y = x[rank::world], y[rank::world]
    correct = (model(x.to(device)).argmax(1) == y.to(device)).sum().float()
    counts = torch.stack([correct, torch.tensor(float(len(y)), device=device)])
    if dist.is_initialized():
        dist.all_reduce(counts)
    model.train()
    return (counts[0] / counts[1]).item()


def main(argv=None):
    args = parse_args(argv)
    device, distributed = setup()
    try:
        return train(args, device, distributed)
    finally:
        if distributed:
            # Only now, with the DDP model gone (it lived inside train()): destroying the process
            # group while a DDP model still holds it can hang on gloo (chapter 09 shows it).
            dist.destroy_process_group()


def train(args, device, distributed):
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1

    # Every rank builds the same data from the same seed; the last 1024 samples are held out.
    train_set, val_set = split(make_dataset(args.samples + 1024), n_val=1024)
    x_val, y_val = val_set.tensors

    torch.manual_seed(args.seed)  # the single-process DataLoader's shuffling
    model = make_model(seed=args.seed).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    start = 0
    if args.resume and os.path.exists(args.checkpoint):
        start = load_checkpoint(args.checkpoint, model, optimizer, device)
        if rank == 0:
            print(f"resumed from {args.checkpoint}: continuing at epoch {start}")
    if distributed:
        # Wrapping broadcasts rank 0's parameters and buffers to every rank.
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    # Each rank reads a disjoint 1/world of the training set; shuffling uses seed + epoch.
    sampler = (DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
               if distributed else None)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                        shuffle=sampler is None, drop_last=True,
                        pin_memory=device.type == "cuda")
    if rank == 0:
        print(f"world size {world}, {len(loader)} steps per epoch, global batch "
              f"{args.batch_size * world}, device {device}")

    step, acc = start * len(loader), None
    steps_in_run = args.epochs * len(loader)  # gives the notebook's progress bar its length
    for epoch in range(start, args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)  # a new permutation each epoch, the same on every rank
        total, n = 0.0, 0
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()  # DDP averages the gradients across ranks during backward
            optimizer.step()
            step += 1
            total, n = total + loss.item(), n + 1
            course_utils.report(step=step, total=steps_in_run, epoch=epoch, loss=loss.item())
        save_checkpoint(args.checkpoint, model, optimizer, epoch)
        acc = evaluate(model, x_val, y_val, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch}: mean train loss on rank 0 {total / n:.4f}, "
                  f"held-out accuracy {acc:.3f}, checkpoint saved")

    return {"rank": rank, "steps": step, "accuracy": acc}


if __name__ == "__main__":
    main()
