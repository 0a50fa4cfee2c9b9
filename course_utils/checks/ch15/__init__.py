"""Checkers of chapter 15 (expert parallelism).

- ``check_dispatch_combine(dispatch_combine)`` (15.a, ``a_dispatch.py``): expert parallelism's two
  all-to-alls on 2 and 4 ranks, top-1 and top-2 with dropped tokens, against a one-process layer
  (outputs and every gradient), every collective watched with ``CollectiveSpy``.
- ``check_load_balancing_loss(load_balancing_loss)`` (15.b, ``b_balance_loss.py``): the Switch/GShard
  loss on balanced, collapsed and random routings, its value and its gradient, in this process.

Each exercise's module declares its ``CATALOGUE`` of misconceptions;
``tests/checkers/test_ch15_checks.py`` gives each one to the checker, written as a learner would write it.
"""

from .a_dispatch import check_dispatch_combine
from .b_balance_loss import check_load_balancing_loss

__all__ = ["check_dispatch_combine", "check_load_balancing_loss"]
