"""Checkers of chapter 10 (beyond DDP): bucketed DDP, a sharded optimizer, the α-β cost model.

- ``check_bucketed_ddp(DDPBucketed)`` (10.a, ``a_bucketed_ddp.py``) runs the learner's class of
  ``mini_ddp.py`` on 2 ranks beside torch DDP, three models, three AdamW steps each, and watches the
  communication itself: the size of every all-reduce, when it starts (which gradients were ready by
  then), whether anything waits during backward.
- ``check_sharded_optimizer(ShardedOptimizer)`` (10.b, ``b_sharded_optimizer.py``) steps the
  learner's ZeRO-1 optimizer and plain AdamW side by side on 2 ranks, and looks at where the
  optimizer state lives.
- ``check_comm_prediction(predict)`` (10.c, ``c_cost_model.py``) checks the learner's α-β
  prediction on made-up numbers, then against all-reduces timed on this machine.

The measurements printed beside these exercises (the speed of ``DDPBucketed``, the memory of
``ShardedOptimizer``, the α-β fit) judge nothing: they are in ``course_utils.measure.ch10``.

Each exercise's module declares its ``CATALOGUE`` of misconceptions;
``tests/checkers/test_ch10_checks.py`` gives each one to the checker, written as a learner would write it.
"""

from .a_bucketed_ddp import check_bucketed_ddp
from .b_sharded_optimizer import check_sharded_optimizer
from .c_cost_model import check_comm_prediction

__all__ = ["check_bucketed_ddp", "check_sharded_optimizer", "check_comm_prediction"]
