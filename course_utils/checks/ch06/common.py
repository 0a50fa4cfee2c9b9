"""What chapter 06's resumable-training checks are built on: the training set-up they save and
restore, and the checkpoint files they plant (one that crashes while saved, one that runs code when
loaded, one written on a GPU machine).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ...data import make_dataset, make_model

__all__ = ["LR", "LR_EVERY", "LR_GAMMA", "ExplodesWhenSaved", "planted_checkpoint", "saved_on_a_gpu",
           "setup_training", "train_some", "opt_tensors"]

LR, LR_EVERY, LR_GAMMA = 3e-3, 5, 0.5


class ExplodesWhenSaved:
    """Put into the state being saved: pickling it fails, like a crash in the middle of a save."""

    def __reduce__(self):
        raise RuntimeError("simulated crash in the middle of writing the checkpoint")


class _RunsCodeWhenLoaded:
    """Unpickling this calls open(marker, "w"): it proves that a loader ran pickled code."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def planted_checkpoint(path: str, marker: str) -> None:
    """A checkpoint that creates ``marker`` when loaded with weights_only=False."""
    torch.save({"model": {}, "optimizer": {}, "scheduler": {}, "epoch": 0, "step_in_epoch": 0,
                "extra": _RunsCodeWhenLoaded(marker)}, path)


def saved_on_a_gpu(src: str, dst: str) -> None:
    """Rewrite the checkpoint ``src`` as a GPU machine would have written it, into ``dst``.

    Every storage is tagged with a GPU this machine lacks (``cuda:0`` without CUDA, else the GPU
    one past the last): ``torch.load`` without ``map_location`` fails on it, as it does on a CPU
    machine given a checkpoint saved from GPU tensors.  The old (non-zip) format keeps the tag as
    one short pickled string, so it can be replaced in place.
    """
    state = torch.load(src, map_location="cpu", weights_only=True)
    buf = io.BytesIO()
    torch.save(state, buf, _use_new_zipfile_serialization=False)
    tag = f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}".encode()
    raw = buf.getvalue().replace(b"X\x03\x00\x00\x00cpu", b"X" + len(tag).to_bytes(4, "little") + tag)
    Path(dst).write_bytes(raw)


def setup_training(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    model = make_model(seed=seed)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=LR_EVERY, gamma=LR_GAMMA)


def train_some(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: int,
                seed: int) -> None:
    x, y = make_dataset(256, seed=seed).tensors
    for s in range(steps):
        rows = slice(32 * s, 32 * (s + 1))
        opt.zero_grad()
        F.cross_entropy(model(x[rows]), y[rows]).backward()
        opt.step()
        sched.step()


def opt_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of an optimizer's state, by a readable name ('param 0 exp_avg', ...)."""
    out = {}
    for i, (_, state) in enumerate(sorted(opt.state_dict()["state"].items())):
        for k, v in state.items():
            out[f"param {i} {k}"] = torch.as_tensor(v).detach().cpu().clone()
    return out
