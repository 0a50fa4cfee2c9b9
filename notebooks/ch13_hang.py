"""A data-parallel job that goes wrong on purpose at step 3, and leaves its flight records behind.

    torchrun --standalone --nproc_per_node=2 ch13_hang.py --fault mismatch --dumps DIR
    torchrun --standalone --nproc_per_node=2 ch13_hang.py --fault missing --dumps DIR

Every rank runs a toy training loop whose steps all-reduce the gradient (4 x 3 floats) and the
loss (one float), as DDP does.  At step 3:

- ``mismatch``: rank 0 all-reduces its gradient, rank 1 calls ``barrier()`` instead;
- ``missing``: rank 1 never arrives: it waits in ``load_batch()`` for data that does not come,
  until the file DIR/release appears (written by whoever looks at the job; at most --timeout s).

At step 3 each rank writes its process id to DIR/pid<rank> (for ``py-spy dump --pid``).  When the
collective fails (the group's timeout, or a peer that closed its connection), or once released,
each rank dumps its flight record, ``torch._C._distributed_c10d._dump_fr_trace()`` (a pickle of a
dict), to DIR/rank<rank>.pkl.  The recorder must be on (``TORCH_FR_BUFFER_SIZE`` > 0, which is
this torch's default: 2000 entries).  A process's first dump with Python frames imports
``torch._dynamo`` (and with it ``torch._inductor``), which takes seconds: each rank starts that import
in a thread at step 3, while it waits, and prints how long its dump took.
"""

import argparse
import datetime
import importlib
import os
import re
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

BAD_STEP = 3


def load_batch(dumps, timeout):
    """Rank 1's data loader in the ``missing`` job: it waits for a file that never comes."""
    deadline = time.monotonic() + timeout
    while not (dumps / "release").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def train_step(grad, loss):
    dist.all_reduce(grad)
    dist.all_reduce(loss)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fault", choices=["mismatch", "missing"], required=True)
    p.add_argument("--dumps", type=Path, required=True, help="folder for the pids and the dumps")
    p.add_argument("--timeout", type=float, default=3.0, help="the process group's timeout (s)")
    a = p.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.timeout))
    rank = dist.get_rank()
    grad, loss = torch.ones(4, 3), torch.ones(1)
    try:
        for _ in range(BAD_STEP):
            train_step(grad, loss)
        (a.dumps / f"pid{rank}").write_text(str(os.getpid()))
        threading.Thread(target=importlib.import_module, args=("torch._dynamo",), daemon=True).start()
        if a.fault == "mismatch":
            dist.all_reduce(grad) if rank == 0 else dist.barrier()
        elif rank == 1:
            load_batch(a.dumps, a.timeout)
        else:
            train_step(grad, loss)
    except RuntimeError as e:  # gloo's timeout, or the peer's connection closed
        why = re.sub(r"^\[[^\]]*\]\s*", "", str(e).splitlines()[0])  # without gloo's source file
        print(f"rank {rank}: {type(e).__name__}: {why[:100]}", flush=True)
    t0 = time.perf_counter()
    (a.dumps / f"rank{rank}.pkl").write_bytes(torch._C._distributed_c10d._dump_fr_trace())
    print(f"rank {rank}: flight record dumped in {time.perf_counter() - t0:.1f} s", flush=True)
    # A group whose collective failed cannot be torn down cleanly (destroy_process_group can block
    # on the broken connection): leave at once, the dump is written.
    os._exit(0)


if __name__ == "__main__":
    main()
