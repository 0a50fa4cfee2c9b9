"""Worker functions that live in an importable module (as they would beside a torchrun script)."""

import os

import torch
import torch.distributed as dist


def rank_sum() -> float:
    """All-reduce each rank's number; works unchanged under launch() and under torchrun."""
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


if __name__ == "__main__":  # run by torchrun in the tests
    total = rank_sum()
    print(f"RESULT rank={os.environ['RANK']} total={total}")
