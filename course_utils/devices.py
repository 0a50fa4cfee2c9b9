"""Pick the backend and device for a worker: NCCL with one GPU per local rank, else gloo on CPU.

Used in the same way inside ``launch`` workers, under ``torchrun`` and in a plain process::

    backend, device = course_utils.backend_and_device()
    dist.init_process_group(**process_group_kwargs(backend, device))

``process_group_kwargs`` adds ``device_id=device`` when this rank owns a GPU.  That binds the
process group to the rank's GPU: NCCL forms its communicator at once (a wrong set-up fails at
``init_process_group``, not at the first collective), and ``dist.barrier()`` knows which GPU to
use instead of guessing from the global rank.  On CPU it passes no ``device_id``:
``init_process_group`` rejects a CPU ``device_id``.

The three set-ups the course meets:

- no GPU (a laptop, CI): gloo on CPU everywhere;
- one GPU (Colab, most laptops with a GPU): a cell with two ranks cannot give each rank a GPU, so
  its workers use gloo on CPU, and ``choose_backend`` says so once; single-process cells may still
  use the GPU (``torch.cuda.is_available()``);
- a GPU per rank (Kaggle's 2xT4, a GPU server): NCCL, rank ``LOCAL_RANK`` on ``cuda:LOCAL_RANK``.

With ``COURSE_DEVICE_LOG=/path/file.jsonl`` in the environment every choice is also appended to
that file, one JSON line per call, from the notebook kernel and from every worker: that is how the
GPU check (``tools/gpu_check.py``, ``make gpu-check``) reports which backend and devices each
notebook used.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch

__all__ = ["BackendChoice", "choose_backend", "backend_and_device", "process_group_kwargs"]


@dataclasses.dataclass(frozen=True)
class BackendChoice:
    backend: str  # "nccl" or "gloo"
    device_type: str  # "cuda" or "cpu"
    reason: str


_announced: set[tuple[str, str]] = set()


def _record(**fields: Any) -> None:
    """Append one JSON line to ``$COURSE_DEVICE_LOG`` (if set); never fails the caller."""
    path = os.environ.get("COURSE_DEVICE_LOG")
    if not path:
        return
    fields.update(pid=os.getpid(), rank=os.environ.get("RANK"))
    line = (json.dumps(fields, sort_keys=True) + "\n").encode()
    try:
        # One write of a short line with O_APPEND: lines from concurrent ranks do not interleave.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError:
        pass


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
    elif gpus and not nccl:
        choice = BackendChoice("gloo", "cpu", f"{gpus} CUDA GPU(s), but this torch has no NCCL: "
                               "gloo on CPU")
    elif gpus:
        choice = BackendChoice("gloo", "cpu", f"only {gpus} GPU(s) for {local_world_size} local "
                               "rank(s): NCCL needs one GPU per rank, so these ranks use gloo on "
                               "CPU (single-process cells still use the GPU)")
    else:
        choice = BackendChoice("gloo", "cpu", "no CUDA GPU: gloo on CPU (everything in the course "
                               "runs; GPU-only cells say so)")
    _record(event="choose_backend", backend=choice.backend, device_type=choice.device_type,
            local_world_size=local_world_size, gpus=gpus)
    key = (choice.backend, choice.reason)
    if announce and key not in _announced and os.environ.get("RANK", "0") == "0":
        _announced.add(key)
        print(f"backend: {choice.backend} ({choice.reason})")
    return choice


def backend_and_device(*, announce: bool = False) -> tuple[str, torch.device]:
    """For a worker: the backend to pass to ``init_process_group`` and this rank's device.

    On GPU it binds the device from ``LOCAL_RANK`` (the *local* rank, not the global rank: on
    the second node of two, global rank 2 is local rank 0 and owns ``cuda:0``) with
    ``torch.cuda.set_device`` *before* any other CUDA call, which is the order NCCL needs.
    ``announce=True`` prints the choice once (rank 0), as ``choose_backend`` does.
    Pass the result to ``process_group_kwargs`` for ``init_process_group``.
    """
    choice = choose_backend(announce=announce)
    if choice.device_type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    _record(event="backend_and_device", backend=choice.backend, device=str(device))
    return choice.backend, device


def process_group_kwargs(backend: str | None = None,
                         device: torch.device | str | None = None) -> dict[str, Any]:
    """Keyword arguments for ``dist.init_process_group``: the backend, and ``device_id`` when this
    rank owns a GPU::

        backend, device = course_utils.backend_and_device()
        dist.init_process_group(**process_group_kwargs(backend, device))

    Without arguments it calls ``backend_and_device()`` itself.  ``device_id`` is left out on
    CPU, where ``init_process_group`` would reject it.
    """
    if backend is None:
        backend, auto_device = backend_and_device()
        device = auto_device if device is None else device
    kwargs: dict[str, Any] = {"backend": backend}
    if device is not None:
        device = torch.device(device)
        if device.type != "cpu":
            if device.index is None:
                raise ValueError(f"device_id needs a device with an index (cuda:0), got {device}")
            kwargs["device_id"] = device
    return kwargs
