"""Checkers of chapter 07: gradient accumulation with ``no_sync``, and the scaled learning rate.

- ``a_accumulation``  ``check_accumulation_step(fn)``: ``fn(model, optimizer, micro_batches)`` on 2
  DDP ranks, observed (all-reduces per micro-step, ``no_sync``, the gradients at
  ``optimizer.step()``) and compared with a single process on the global batch;
  ``accumulation_verdicts(fns)`` judges several answers in one launch;
- ``b_scaled_lr``     ``check_scaled_lr(fn)``: the linear scaling rule with a warm-up from
  ``base_lr``.
"""

from .a_accumulation import accumulation_verdicts, check_accumulation_step
from .b_scaled_lr import check_scaled_lr

__all__ = ["check_accumulation_step", "accumulation_verdicts", "check_scaled_lr"]
