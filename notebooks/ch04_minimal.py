"""Chapter 01's training loop made data-parallel: the five changes DDP needs, and nothing else
(besides one marked line that works around a bug of torch itself).

    python ch04_minimal.py                                        # starts 2 processes itself (mp.spawn)
    torchrun --standalone --nproc_per_node=2 ch04_minimal.py      # torchrun starts them

Each change is marked (1) to (5).  The file tells the two launchers apart by RANK, which torchrun
sets in every worker's environment and a plain ``python`` run does not.
"""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import course_utils
from course_utils.data import make_dataset, make_model, split
from course_utils.workarounds import apply_all


def train(rank, world_size, epochs=2, batch_size=32, lr=0.05):
    apply_all()  # WORKAROUND for a torch bug at process exit (pytorch/pytorch#56297), not part of DDP
    # (1) Join the process group, with one device per process.  LOCAL_RANK (the rank on this
    #     machine) picks the GPU: on a second machine, RANK would name a GPU that machine lacks.
    #     mp.spawn sets no LOCAL_RANK, but it starts every process on this one machine, where the
    #     rank it passes is the local rank.
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))  # processes on this machine
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)  # bare "cuda" tensors and object collectives use this GPU
        dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world_size)

    train_set, val_set = split(make_dataset(4096), n_val=1024)
    # (2) Each rank reads its own 1/world_size of the data, batch_size samples at a time:
    #     the global batch, what one optimizer step averages over, is batch_size * world_size.
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=0,
                                 drop_last=True)
    loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler, drop_last=True)

    # (3) Wrap the model: DDP copies rank 0's weights to every rank, then averages gradients in backward.
    model = make_model(seed=0).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)

    for epoch in range(epochs):
        sampler.set_epoch(epoch)  # (4) a new shuffle every epoch, the same permutation on every rank
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()  # the gradient all-reduce happens in here
            opt.step()
        # One write per line (end="" with the newline inside), so lines of two ranks never mix.
        print(f"rank {rank} of {world_size}: epoch {epoch}, {len(loader)} steps of {batch_size} samples, "
              f"last loss {loss.item():.4f}\n", end="", flush=True)

    if rank == 0:
        xv, yv = (t.to(device) for t in val_set.tensors)
        with torch.no_grad():
            # model.module, not model: where the module has buffers (BatchNorm's running
            # statistics), DDP's forward is itself a collective, a broadcast of rank 0's buffers,
            # so model(xv) on rank 0 alone would wait forever for the other ranks (section 3.5).
            accuracy = (model.module(xv).argmax(1) == yv).float().mean().item()
        print(f"held-out accuracy (rank 0, all {len(yv)} samples): {accuracy:.3f}\n", end="", flush=True)

    # (5) Tear down: the DDP model first, then the process group.
    del model, opt
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" in os.environ:  # started by torchrun: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are set
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    else:  # plain python: start the processes here; mp.spawn passes each its index as first argument
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(course_utils.free_port())  # a free port, never a fixed one
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per process, as torchrun sets it
        mp.spawn(train, args=(2,), nprocs=2)
