"""Checkers of chapter 03 (process groups and collectives), one module per exercise.

Both checkers run the learner's function in real worker processes (gloo on CPU, NCCL when there is
a GPU per rank), on several world sizes, shapes and dtypes, and compare each rank's tensor with
what ``dist.all_reduce`` gives on the same inputs.  While the learner's code runs, the collectives
it may not use raise ``ForbiddenCollective`` where they are called, and point-to-point calls are
recorded (peers, messages and bytes sent): ``common.py``.

- ``a_all_reduce_mean``  ``check_all_reduce_mean(all_reduce_mean)``: the mean across ranks, in
  place, without ``dist.all_reduce``;
- ``b_ring_all_reduce``  ``check_ring_all_reduce(ring_all_reduce)``: the sum across ranks as a
  ring of ``send`` / ``recv`` / ``isend`` / ``irecv``.
"""

from .a_all_reduce_mean import check_all_reduce_mean
from .b_ring_all_reduce import check_ring_all_reduce
from .common import ForbiddenCollective

__all__ = ["check_all_reduce_mean", "check_ring_all_reduce", "ForbiddenCollective"]
