"""Pick the backend and device for a worker: NCCL with one GPU per local rank, else gloo on CPU.

Used in the same way inside ``launch`` workers, under ``torchrun`` and in a plain process::

    backend, device = course_utils.backend_and_device()
    dist.init_process_group(backend)
"""

from __future__ import annotations

import dataclasses
import os

import torch

__all__ = ["BackendChoice", "choose_backend", "backend_and_device"]


@dataclasses.dataclass(frozen=True)
class BackendChoice:
    backend: str  # "nccl" or "gloo"
    device_type: str  # "cuda" or "cpu"
    reason: str


_announced: set[tuple[str, str]] = set()


def choose_backend(local_world_size: int | None = None, *, announce: bool = True) -> BackendChoice:
    """NCCL when this node has a GPU for each of its local ranks, otherwise gloo on CPU.

    ``local_world_size`` defaults to ``LOCAL_WORLD_SIZE`` (set by ``launch`` and ``torchrun``), or 1.
    The choice and the reason are printed once per process (on rank 0 inside workers).
    """
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nccl = torch.distributed.is_available() and torch.distributed.is_nccl_available()
    if gpus >= local_world_size and nccl:
        choice = BackendChoice("nccl", "cuda", f"{gpus} CUDA GPU(s) for {local_world_size} local "
                               "rank(s): NCCL, one GPU per rank")
    elif gpus:
        choice = BackendChoice("gloo", "cpu", f"only {gpus} GPU(s) for {local_world_size} local "
                               "rank(s): NCCL needs one GPU per rank, so gloo on CPU")
    else:
        choice = BackendChoice("gloo", "cpu", "no CUDA GPU: gloo on CPU (everything in the course "
                               "runs; GPU-only cells say so)")
    key = (choice.backend, choice.reason)
    if announce and key not in _announced and os.environ.get("RANK", "0") == "0":
        _announced.add(key)
        print(f"backend: {choice.backend} ({choice.reason})")
    return choice


def backend_and_device(*, announce: bool = True) -> tuple[str, torch.device]:
    """For a worker: the backend to pass to ``init_process_group`` and this rank's device.

    On GPU it binds the device from ``LOCAL_RANK`` (the *local* rank, not the global rank) with
    ``torch.cuda.set_device`` *before* any other CUDA call, which is the order NCCL needs.
    """
    choice = choose_backend(announce=announce)
    if choice.device_type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return choice.backend, torch.device("cuda", local_rank)
    return choice.backend, torch.device("cpu")
