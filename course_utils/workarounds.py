"""Workarounds for bugs of the installed torch, kept in one place and out of the lesson scripts.

Each function names the bug, the torch versions it was seen with, and the upstream report, so that
it can be deleted when torch fixes it.  The launcher applies them in its workers; a script run
under ``torchrun`` calls :func:`apply_all` once, before ``init_process_group``.
"""

from __future__ import annotations

__all__ = ["apply_all", "import_dynamo_before_init"]


def import_dynamo_before_init() -> None:
    """Import ``torch._dynamo`` before the process group exists.

    ``DistributedDataParallel``'s constructor imports ``torch._dynamo``.  When that first import
    happens after a gloo process group was created, workers under ``torchrun`` (torch 2.13, CPU)
    sometimes abort at interpreter exit while the group is torn down: 7 of 16 runs of chapter 04's
    script, 0 of 16 with the import done first.  Gloo's shutdown ordering problems are tracked
    upstream in https://github.com/pytorch/pytorch/issues/56297.
    """
    import torch._dynamo  # noqa: F401  (the import itself is the workaround)


def apply_all() -> None:
    """Apply every workaround this torch needs; cheap to call more than once."""
    import_dynamo_before_init()
