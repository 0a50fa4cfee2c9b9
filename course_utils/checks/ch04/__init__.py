"""Checkers of chapter 04 (DistributedDataParallel).

Both run the learner's code in real worker processes (``run_workers``; gloo on CPU, NCCL with a GPU
per rank) next to torch's own ``DistributedDataParallel`` on the same data, and compare, rank by rank.

- ``check_hand_allreduce(train_data_parallel)`` (04.a, ``a_hand_allreduce.py``): SGD with the
  gradients averaged by hand, on 2 and 3 ranks from a different initialisation on each;
- ``check_mini_ddp(DDPIndividualParameters)`` (04.b, ``b_mini_ddp.py``): the wrapper of
  ``mini_ddp.py`` on 3 ranks, its gradients, parameters and momentum after every step, and its
  communication watched (which gradient each all-reduce carries, during backward, asynchronously,
  waited for in ``finish_gradient_synchronization()``).

Each exercise's module declares its ``CATALOGUE`` of misconceptions; the tests
(``tests/checkers/test_ch04_*.py``) give each one to the checker, written as a learner would write it.
"""

from .a_hand_allreduce import check_hand_allreduce
from .b_mini_ddp import check_mini_ddp

__all__ = ["check_hand_allreduce", "check_mini_ddp"]
