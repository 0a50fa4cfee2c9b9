"""Workarounds for bugs of the installed torch, kept in one place and out of the lesson scripts.

Each function names the bug, the torch versions it was seen with, and the upstream report, so that
it can be deleted when torch fixes it.  The launcher applies them in its workers; a script run
under ``torchrun`` calls :func:`apply_all` once, before ``init_process_group``.
"""

from __future__ import annotations

__all__ = ["apply_all", "import_dynamo_before_init"]


def import_dynamo_before_init() -> None:
    """Import ``torch._dynamo`` before the process group exists.

    ``DistributedDataParallel``'s constructor imports ``torch._dynamo`` (so does every
    ``torch.optim`` constructor, through ``torch._disable_dynamo``), and ``torch._dynamo`` imports
    ``torch.distributed.nn.functional``, which binds ``group.WORLD`` as the default argument of ten
    functions.  Imported after a gloo group was created, those defaults hold that group forever:
    ``destroy_process_group()`` cannot free it, gloo's worker threads run on until the interpreter
    exits, and one of them may then drop the last reference to a work object started during
    backward, whose destructor needs the GIL; Python ends the thread inside that destructor and the
    process aborts ("terminate called without an active exception").  Workers under ``torchrun``
    (torch 2.13, CPU): 7 of 16 runs of chapter 04's script aborted, 0 of 16 with the import done
    first.  ``benchmarks/ddp_teardown.py --cls none`` shows it with torch's DDP alone.  Gloo's shutdown
    ordering problems are tracked upstream in https://github.com/pytorch/pytorch/issues/56297.
    """
    import torch._dynamo  # noqa: F401  (the import itself is the workaround)


def apply_all() -> None:
    """Apply every workaround this torch needs; cheap to call more than once."""
    import_dynamo_before_init()
