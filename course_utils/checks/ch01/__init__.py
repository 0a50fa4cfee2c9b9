"""Checkers for chapter 01 (one device), one module per exercise: a training step with gradient
clipping (``a_train_step``), an evaluation loop that weighs every sample equally (``b_evaluate``),
and the gradient of a batch rebuilt from the gradients of its shards, data parallelism on one
process (``c_shard_gradients``).

Each module declares its ``CATALOGUE`` of misconceptions: an entry's key names the answer written
with that misconception in tests/checkers/test_ch01_checks.py, its message is what the failure says.
"""

from .a_train_step import check_train_step
from .b_evaluate import check_evaluate
from .c_shard_gradients import check_shard_gradients

__all__ = ["check_train_step", "check_evaluate", "check_shard_gradients"]
