"""Checkers of chapter 06 (multi-node training with torchrun), one module per exercise.

- ``a_launch_commands``: ``check_launch_commands(make_commands)``, the torchrun command of each
  machine of a two-node cluster, read by torchrun's own parser and then run as two simulated nodes;
- ``b_resumable``: ``check_resumable(save_checkpoint, load_checkpoint, epoch_batches)``, a training
  loop that survives a worker killed in the middle of an epoch, checked in one process and in a
  killed-and-resumed run of two DDP workers;
- ``common``: the training set-up and the planted checkpoint files 06.b's checks are built on.

Each exercise module declares its ``CATALOGUE`` of misconceptions: an entry's key names the wrong
answer written with it in tests/checkers/test_ch06_checks.py, its message is what the failure says.
"""

from .a_launch_commands import check_launch_commands
from .b_resumable import check_resumable

__all__ = ["check_launch_commands", "check_resumable"]
