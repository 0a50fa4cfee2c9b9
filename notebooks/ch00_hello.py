"""The smallest torch.distributed program, started by torchrun or by mp.spawn.

    torchrun --standalone --nproc_per_node=2 ch00_hello.py   # torchrun sets RANK, WORLD_SIZE, ...
    python ch00_hello.py --spawn                             # mp.spawn, the official tutorials' pattern
"""
import os
import sys

import torch
import torch.distributed as dist


def work():
    """The distributed part: the same whichever launcher started this process."""
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)                                   # every rank gets 1 + 2 + ... + world
    print(f"rank {rank} of {world} (LOCAL_RANK {os.environ.get('LOCAL_RANK')}, "
          f"OMP_NUM_THREADS {os.environ.get('OMP_NUM_THREADS')}): all_reduce(rank + 1) = {t.item():g}",
          flush=True)


def torchrun_main():
    dist.init_process_group("gloo")                      # env://: everything comes from torchrun's variables
    work()
    dist.destroy_process_group()


def spawn_main(rank, world_size, port):
    """mp.spawn calls this in each child with its index 0 ... nprocs-1 as `rank`."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    work()
    dist.destroy_process_group()


def spawn_on_a_free_port(world_size, attempts=3):
    """free_port() only asks: another program can take the port before rank 0's store binds it."""
    import torch.multiprocessing as mp

    from course_utils import free_port

    for attempt in range(1, attempts + 1):
        port = free_port()
        try:
            mp.spawn(spawn_main, args=(world_size, port), nprocs=world_size, join=True)
            return
        except mp.ProcessRaisedException as e:   # mp.spawn has stopped the other processes
            if "EADDRINUSE" not in str(e) or attempt == attempts:
                raise
            print(f"port {port} was taken before rank 0 could listen on it; trying another", flush=True)


if __name__ == "__main__":
    if "--spawn" in sys.argv:
        spawn_on_a_free_port(world_size=2)
    else:
        torchrun_main()
