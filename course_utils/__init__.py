"""Helpers for the PyTorch distributed data-parallel course.

One module per job:

- ``launching``   ``launch``: the workers' launcher (``workers.supervisor``) with the monitor's display
- ``workers``     real worker processes, knowing nothing of displays: the launcher (``workers.supervisor``),
                  ``run_commands`` (``workers.commands``), the errors they raise, the report channel,
                  stack trimming (``workers.stacks``), the thread budget
- ``devices``     pick gloo or NCCL and this rank's device
- ``checking``    the checker skeleton: ``@checker``, ``run_workers``, ``process_group``, ``Outcome``,
                  ``CollectiveSpy``, misconception catalogues, comparators
- ``checks``      the exercise checkers, one module per chapter
- ``measure``     the lessons' measurements (timings, fits, verdicts), one module per chapter
- ``data``        the course's synthetic data sets and models
- ``monitor``     ``report()`` from workers and the displays that show it, one module per job (see its
                  ``__init__``)
- ``explore``     ``explore()``: re-run a measurement with widgets to change its parameters
- ``diagrams``    drawn pictures of mechanisms (a ring all-reduce, DDP's overlap, pipeline schedules...)
- ``progress``    the learner's pass/fail table (``show_progress()``; ``python -m course_utils.progress``)
- ``diagnose``    tools of the troubleshooting chapter (reachability, stragglers, duplicates, stacks)
- ``resources``   CPU/GPU memory and utilisation samplers
- ``doctor``      the environment self-check (``python -m course_utils.doctor``)
- ``slurm_cluster`` a throwaway two-node Slurm cluster on this machine (chapter 06 and its tests)
- ``workarounds`` workarounds for bugs of the installed torch, each with its upstream issue

The maintainers' tools are not part of it: ``tools/`` beside it holds the exercise generator
(``make exercises``) and the GPU check (``make gpu-check``), ``benchmarks/`` the measurement scripts.
"""

import importlib as _importlib
import importlib.util as _util
import sys as _sys
from typing import TYPE_CHECKING

# The public names and the module each comes from. They are imported when first used, so that the
# command-line tools that need no torch (`python -m course_utils.progress`, the room table, the
# doctor before the install) start in a fraction of a second instead of importing torch first; in a
# notebook, `from course_utils import launch` imports what it names, as usual.
_EXPORTS = {  # name: (module, name there)
    "launch": ("launching", "launch"),
    "WorkerError": ("workers.errors", "WorkerError"),
    "WorkerTimeout": ("workers.errors", "WorkerTimeout"),
    "RankFailure": ("workers.errors", "RankFailure"),
    "free_port": ("workers.startup", "free_port"),
    "run_commands": ("workers.commands", "run_commands"),
    "CommandResult": ("workers.commands", "CommandResult"),
    "CommandFailed": ("workers.commands", "CommandFailed"),
    "CheckFailed": ("checking", "CheckFailed"),
    "backend_and_device": ("devices", "backend_and_device"),
    "choose_backend": ("devices", "choose_backend"),
    "report": ("monitor", "report"),
    "show_progress": ("progress", "show"),
}
__all__ = ["launch", "WorkerError", "WorkerTimeout", "RankFailure", "free_port", "run_commands",
           "CommandResult", "CommandFailed", "CheckFailed", "backend_and_device", "choose_backend",
           "report", "show_progress"]
assert __all__ == list(_EXPORTS)

if TYPE_CHECKING:  # for editors and type checkers: where each name comes from
    from .checking import CheckFailed
    from .devices import backend_and_device, choose_backend
    from .launching import launch
    from .monitor import report
    from .progress import show as show_progress
    from .workers.commands import CommandFailed, CommandResult, run_commands
    from .workers.errors import RankFailure, WorkerError, WorkerTimeout
    from .workers.startup import free_port

# Without these, only the doctor runs (`python -m course_utils.doctor` says what to install and how).
_MISSING = [m for m in ("torch", "numpy", "cloudpickle", "psutil") if _util.find_spec(m) is None]


def __getattr__(name: str):
    where = _EXPORTS.get(name)
    if where is None:
        raise AttributeError(f"module 'course_utils' has no attribute {name!r}")
    if _MISSING:
        raise ImportError(f"course_utils needs {', '.join(_MISSING)}, which {_sys.executable} does not "
                          "have: `python -m course_utils.doctor` says how to fix it")
    module, attribute = where
    value = getattr(_importlib.import_module(f".{module}", __name__), attribute)
    globals()[name] = value  # the next use finds it directly
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


# In a notebook kernel, import what a lesson uses and start the fork server now, in the background:
# the first launch is then as quick as the following ones (see workers/prewarm.py; elsewhere this
# does nothing).
if not _MISSING:
    from .workers.prewarm import should_prewarm as _should_prewarm
    from .workers.prewarm import start_in_background as _prewarm

    if _should_prewarm():
        for _name in __all__:
            __getattr__(_name)
        _prewarm()
