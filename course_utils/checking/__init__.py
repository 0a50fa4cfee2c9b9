"""What every checker shares, one module per job.

- ``harness``    the skeleton: ``@checker``, ``run_workers``, ``process_group``, ``Outcome``, ``judge``
- ``spy``        ``CollectiveSpy``: which collectives the learner's code runs, when, waited or not
- ``catalogue``  ``Misconception`` and ``Catalogue``: each exercise's known mistakes as data
- ``compare``    ``close``, ``compare_tensors``, ``diff_table``, ``state_to_cpu``, ``wrap_ddp``...
- ``fixtures``   the test models and data several chapters' checkers share
- ``errors``     ``CheckFailed``
- ``limits``     ``time_limit``: a bound on learner code a checker runs in the notebook's process

CONTRIBUTING.md ("Adding an exercise") shows a whole checker built from these.
"""

from .catalogue import Catalogue, Misconception
from .compare import (
    as_float,
    as_tensor,
    close,
    compare_tensors,
    diff_table,
    format_table,
    require_callable,
    state_to_cpu,
    wrap_ddp,
)
from .errors import CheckFailed
from .harness import Group, Outcome, checker, first_problem, judge, learner_frames, process_group, run_workers
from .limits import time_limit
from .spy import Call, CollectiveSpy

__all__ = [
    "CheckFailed", "checker", "run_workers", "process_group", "Group", "Outcome", "first_problem",
    "judge", "learner_frames", "CollectiveSpy", "Call", "Catalogue", "Misconception", "close",
    "compare_tensors", "diff_table", "format_table", "state_to_cpu", "wrap_ddp", "as_tensor",
    "as_float", "require_callable", "time_limit",
]
