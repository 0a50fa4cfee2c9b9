"""Checker of chapter 08: an AMP training step with GradScaler and gradient clipping under DDP.

- ``a_amp_step``  ``check_amp_step(fn)``: the step on 2 DDP ranks in float16 and bfloat16, an
  overflow on one rank at the second step, compared with torch's own step and observed call by
  call; ``amp_verdicts(fns)`` judges several answers in one launch;
- ``recorder``    what the learner's step did, in order (``Recorder``), and which deprecated
  ``torch.cuda.amp`` calls it made (``deprecated_amp_calls``).
"""

from .a_amp_step import amp_verdicts, check_amp_step
from .recorder import deprecated_amp_calls

__all__ = ["check_amp_step", "amp_verdicts", "deprecated_amp_calls"]
