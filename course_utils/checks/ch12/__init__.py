"""Checkers of chapter 12 (pipeline parallelism, 2D meshes, sharded checkpoints, a simulated large job).

- ``check_gpipe(gpipe_step)`` (12.a, ``a_gpipe.py``): a GPipe step with send/recv on 2 and 4
  stages, against the single-process model's gradients, with every forward, backward and message
  of each stage recorded.
- ``check_resharding(shard, save_checkpoint, load_checkpoint)`` (12.b, ``b_resharding.py``): an
  FSDP2 model and its AdamW state saved with DCP on 2 ranks and loaded into 4, against the saved state.
- ``check_rank_memory(predict_rank_bytes)`` (12.c, ``c_memory.py``): rank 0's parameter, gradient
  and optimizer bytes of an FSDP2 job at 64 and 256 ranks (and HSDP 8 x 8 and 4 x 16), predicted from the
  shapes and compared with the fake backend's simulation.

Each exercise's module declares its ``CATALOGUE`` of misconceptions; ``tests/checkers/test_ch12_checks.py``
gives each one to the checker, written as a learner would write it.
"""

from .a_gpipe import check_gpipe
from .b_resharding import check_resharding
from .c_memory import check_rank_memory

__all__ = ["check_gpipe", "check_resharding", "check_rank_memory"]
