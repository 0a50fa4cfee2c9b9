"""Checkers for chapter 13 (debugging at scale): reading the flight records of a hung job.

| exercise | the learner writes | judged on |
| --- | --- | --- |
| 13.a | ``find_culprit(dumps) -> dict | None`` | the recorded dumps of six 4-rank jobs (below) |

The six jobs: a missing rank (twice, once with a wrapped ring buffer), a wrong collective, a
wrong order, a wrong shape, and a healthy job.

The exercise has its module (``a_find_culprit``) with its ``CATALOGUE`` of misconceptions: an
entry's key names the wrong answer written with it in tests/checkers/test_ch13_checks.py, its
message is what the failure says.  Right answers written differently pass: a majority vote per
sequence id with ``collections.Counter``; the ranks' last sequence ids compared first (a missing
rank) and then each sequence id's (operation, shapes) pairs.
"""

from .a_find_culprit import FAILURES, check_find_culprit, load_recorded

__all__ = ["check_find_culprit", "FAILURES", "load_recorded"]
