"""The course's data and model, generated locally (nothing is downloaded).

Every chapter trains the same small classifier on the same synthetic data set, so that numbers can
be compared across chapters: chapter 01's single-process run is the reference for all of them.

- ``make_dataset``: 10-class points in 32 dimensions; the classes are curved clusters that a small
  MLP learns within a few epochs.
- ``CourseModel``: a 3-layer MLP (45,322 parameters), optionally with BatchNorm.
- ``make_sequences``: variable-length token sequences for the data-loading chapter.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

__all__ = ["make_dataset", "split", "train_reference", "CourseModel", "make_model",
           "make_sequences", "SequenceDataset",
           "collate_pad", "seed_everything"]

DIM = 32
CLASSES = 10


def seed_everything(seed: int) -> None:
    """Seed torch's generators (CPU and every GPU)."""
    torch.manual_seed(seed)


def make_dataset(n: int = 8192, *, dim: int = DIM, classes: int = CLASSES, seed: int = 0,
                 noise: float = 1.0) -> TensorDataset:
    """A deterministic classification data set: ``(features float32 [n, dim], labels int64 [n])``.

    The same ``seed`` gives bit-identical data on every machine and in every process, which is
    what lets each rank build the data set itself instead of receiving it.
    """
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, dim, generator=g) * 0.5
    labels = torch.randint(0, classes, (n,), generator=g)
    t = torch.rand(n, 1, generator=g) * 2 - 1
    bend = torch.randn(classes, dim, generator=g)
    x = centers[labels] + t * bend[labels] + (t**2) * bend.roll(1, 0)[labels]
    x = x + noise * torch.randn(n, dim, generator=g)
    x = (x - x.mean(0)) / x.std(0)
    return TensorDataset(x.float(), labels)


class CourseModel(nn.Module):
    """MLP ``dim -> hidden -> hidden -> classes`` with GELU; ``norm=True`` adds BatchNorm1d."""

    def __init__(self, dim: int = DIM, hidden: int = 192, classes: int = CLASSES, *,
                 norm: bool = False):
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(dim, hidden)]
        if norm:
            layers.append(nn.BatchNorm1d(hidden))
        layers += [nn.GELU(), nn.Linear(hidden, hidden)]
        if norm:
            layers.append(nn.BatchNorm1d(hidden))
        layers += [nn.GELU(), nn.Linear(hidden, classes)]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_model(seed: int = 0, **kwargs) -> CourseModel:
    """A ``CourseModel`` whose initial weights depend only on ``seed``."""
    with torch.random.fork_rng(devices=[]):  # built on CPU: no GPU's generator is touched
        torch.manual_seed(seed)
        return CourseModel(**kwargs)


class SequenceDataset(torch.utils.data.Dataset):
    """Token sequences of varying length (like sentences), each with a class label."""

    def __init__(self, n: int = 4096, *, min_len: int = 4, max_len: int = 128, vocab: int = 1000,
                 seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        # Lengths skewed towards short, as in real text.
        u = torch.rand(n, generator=g)
        self.lengths = (min_len + (max_len - min_len) * u**2).long().tolist()
        self.tokens = [torch.randint(1, vocab, (L,), generator=g) for L in self.lengths]
        self.labels = torch.tensor([int(t.sum()) % 2 for t in self.tokens])

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int):
        return self.tokens[i], self.labels[i]


def make_sequences(n: int = 4096, **kwargs) -> SequenceDataset:
    """Shorthand for ``SequenceDataset(n, ...)``."""
    return SequenceDataset(n, **kwargs)


def collate_pad(batch):
    """Pad a list of ``(tokens, label)`` to the longest sequence (pad id 0).

    Returns ``(tokens [B, L], labels [B], lengths [B])``.
    """
    seqs, labels = zip(*batch)
    lengths = torch.tensor([len(s) for s in seqs])
    out = torch.zeros(len(seqs), int(lengths.max()), dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out, torch.stack(list(labels)), lengths


def split(dataset: TensorDataset, n_val: int = 2048) -> tuple[TensorDataset, TensorDataset]:
    """Deterministic train / validation split: the last ``n_val`` samples are for validation."""
    x, y = dataset.tensors
    return TensorDataset(x[:-n_val], y[:-n_val]), TensorDataset(x[-n_val:], y[-n_val:])


def train_reference(
    steps: int,
    *,
    batch_size: int = 64,
    lr: float = 0.05,
    momentum: float = 0.9,
    seed: int = 0,
    model: nn.Module | None = None,
    dataset: TensorDataset | None = None,
) -> tuple[nn.Module, list[float]]:
    """The single-process reference that later chapters compare distributed runs against.

    Trains ``make_model(seed)`` (or ``model``) with SGD for ``steps`` steps on consecutive
    batches of ``batch_size`` from the training split, in a fixed order (sample ``i`` of step
    ``s`` is ``(s * batch_size + i) % n``).  A data-parallel run on ``N`` ranks that gives rank
    ``r`` the rows ``r::N`` of each global batch, divides by the right counts and averages
    gradients must end with the same parameters, up to float rounding.  Returns the model and
    the per-step losses.
    """
    if dataset is None:
        dataset, _ = split(make_dataset())
    model = model if model is not None else make_model(seed)
    x, y = dataset.tensors
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    losses = []
    n = len(x)
    for s in range(steps):
        idx = torch.arange(s * batch_size, (s + 1) * batch_size) % n
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses
