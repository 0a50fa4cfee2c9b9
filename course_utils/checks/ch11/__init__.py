"""Checkers of chapter 11 (when one model does not fit: memory, checkpointing, tensor parallelism).

- ``check_tp_linears(ColumnParallelLinear, RowParallelLinear)`` (11.a, ``a_tp_linears.py``):
  Megatron's two linears on 2 and 4 ranks against ``nn.Linear``, outputs and every gradient, with
  each layer's collectives recorded (which one, forward or backward, on which tensor).
- ``check_checkpoint_memory(predict_peak_activation_bytes)`` (11.b, ``b_checkpoint_memory.py``):
  the learner's formula for the activation peak of a checkpointed stack of MLP blocks, against the
  measurement of ``course_utils.measure.ch11.ActivationMeter``: its value within 15%, and its growth
  per block, per recomputed block and per segment.

Each exercise's module declares its ``CATALOGUE`` of misconceptions; ``tests/checkers/test_ch11_checks.py``
gives each one to the checker, written as a learner would write it.
"""

from .a_tp_linears import check_tp_linears
from .b_checkpoint_memory import check_checkpoint_memory

__all__ = ["check_tp_linears", "check_checkpoint_memory"]
