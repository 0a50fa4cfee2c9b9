"""The exercise checkers, one line per checker: ``from course_utils.checks import check_ring_all_reduce``.

Each chapter (a module ``ch02.py``, or a package ``ch03/`` with a module per exercise) declares
its misconception catalogues and its checkers; measurements the lessons use live in
``course_utils.measure``.
"""

from .ch01 import check_evaluate, check_shard_gradients, check_train_step
from .ch02 import check_dp_step
from .ch03 import ForbiddenCollective, check_all_reduce_mean, check_ring_all_reduce
from .ch04 import check_hand_allreduce, check_mini_ddp
from .ch05 import check_bucket_sampler
from .ch06 import check_launch_commands, check_resumable
from .ch07 import check_accumulation_step, check_scaled_lr
from .ch08 import check_amp_step
from .ch09 import (
    check_checkpoint_collective,
    check_distributed_loader,
    check_eval_no_leak,
    check_metrics_sync,
    check_nan_skip_step,
    check_uneven_join,
)
from .ch10 import check_bucketed_ddp, check_comm_prediction, check_sharded_optimizer
from .ch11 import check_checkpoint_memory, check_tp_linears
from .ch12 import check_gpipe, check_rank_memory, check_resharding
from .ch13 import check_find_culprit
from .ch14 import check_ring_attention, check_ulysses, check_zigzag
from .ch15 import check_dispatch_combine, check_load_balancing_loss
from .ch16 import check_diloco_outer, check_local_sgd_sync

__all__ = [
    "check_train_step",
    "check_evaluate",
    "check_shard_gradients",
    "check_dp_step",
    "check_all_reduce_mean",
    "check_ring_all_reduce",
    "ForbiddenCollective",
    "check_hand_allreduce",
    "check_mini_ddp",
    "check_bucket_sampler",
    "check_launch_commands",
    "check_resumable",
    "check_accumulation_step",
    "check_scaled_lr",
    "check_amp_step",
    "check_checkpoint_collective",
    "check_distributed_loader",
    "check_metrics_sync",
    "check_nan_skip_step",
    "check_uneven_join",
    "check_eval_no_leak",
    "check_bucketed_ddp",
    "check_sharded_optimizer",
    "check_comm_prediction",
    "check_tp_linears",
    "check_checkpoint_memory",
    "check_gpipe",
    "check_resharding",
    "check_rank_memory",
    "check_find_culprit",
    "check_ring_attention",
    "check_zigzag",
    "check_ulysses",
    "check_dispatch_combine",
    "check_load_balancing_loss",
    "check_diloco_outer",
    "check_local_sgd_sync",
]
