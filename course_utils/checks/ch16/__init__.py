"""Checkers of chapter 16 (training over slow links): DiLoCo's outer step and local SGD's sync.

- ``check_diloco_outer(DiLoCoOuter)`` (16.a, ``a_diloco_outer.py``) runs the learner's outer step
  for several rounds on 2 ranks and on 4 ranks in two replica groups, against a reference.
- ``check_local_sgd_sync(local_sgd_sync)`` (16.b, ``b_local_sgd.py``) trains on 2 ranks with the
  learner's sync every H steps and watches its collectives with ``CollectiveSpy``.

Each exercise's module declares its ``CATALOGUE`` of misconceptions;
``tests/checkers/test_ch16_checks.py`` gives each one to the checker, written as a learner would write it.
"""

from .a_diloco_outer import check_diloco_outer
from .b_local_sgd import check_local_sgd_sync

__all__ = ["check_diloco_outer", "check_local_sgd_sync"]
