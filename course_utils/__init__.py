"""Helpers for the PyTorch distributed data-parallel course.

One module per job:

- ``launcher``   run a function in real worker processes from a notebook (``launch``, errors)
- ``devices``    pick gloo or NCCL and this rank's device
- ``checking``   ``CheckFailed`` and the comparison helpers every checker uses
- ``checks``     the exercise checkers, one module per chapter
- ``data``       the course's synthetic data set and model
- ``monitor``    ``report()`` from workers, the live display, GPU/CPU samplers
- ``plotting``   the course's plots
- ``exercises``  generate ``exercises/`` from ``solutions/``
- ``progress``   the learner's pass/fail table
- ``doctor``     the environment self-check (``python -m course_utils.doctor``)
"""

# `course_utils.progress()` shows the learner's table; the module itself is callable for that.
from . import progress  # noqa: E402
from .checking import CheckFailed
from .devices import backend_and_device, choose_backend
from .launcher import CommandFailed, WorkerError, WorkerTimeout, free_port, launch, run_commands
from .monitor import report

__all__ = [
    "launch",
    "WorkerError",
    "WorkerTimeout",
    "free_port",
    "run_commands",
    "CommandFailed",
    "CheckFailed",
    "backend_and_device",
    "choose_backend",
    "report",
    "progress",
]

