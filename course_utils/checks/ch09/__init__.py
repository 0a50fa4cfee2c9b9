"""Checkers for chapter 09 (troubleshooting lab): six broken scripts, fixed by the learner.

Each checker runs the learner's function in real worker processes (two ranks, gloo on CPU) with a
timeout, so a fix that still hangs fails with the stuck ranks' positions instead of freezing the
notebook.  Then it checks that the symptom is gone *and* that the result is right, against a
reference computed in the same workers.

| exercise | the learner writes | the symptom that must be gone |
| --- | --- | --- |
| 09.a | ``end_of_epoch(model, local_val_loss, path) -> float`` | hang: a collective inside ``if rank == 0`` |
| 09.b | ``make_loader(dataset, batch_size, epoch) -> DataLoader`` | duplicates; one order every epoch |
| 09.c | ``sync_metrics(metrics) -> dict`` | collectives in different orders (wrong totals, hang) |
| 09.d | ``train_step(model, optimizer, x, y) -> bool`` | NaN on one rank: NaN weights, or a hang |
| 09.e | ``train_uneven(model, optimizer, batches) -> int`` | uneven inputs: hang at the last batch |
| 09.f | ``evaluate(model, batches) -> float`` | evaluation that builds graphs (memory leak) |

One module per exercise (``a_checkpoint_collective`` ... ``f_eval_leak``), each with its
``CATALOGUE`` of misconceptions: an entry's key names the wrong answer written with it in
tests/checkers/test_ch09_checks.py, its message is what the failure says.  ``common`` holds what
they share.

Right answers written differently pass:
- 09.a: ``all_gather`` of the losses; ``all_gather_object`` with a broadcast from rank 0 after the
  save instead of a barrier.
- 09.b: ``DistributedSampler(seed=epoch)`` without ``set_epoch``; a shard cut by hand from a
  permutation that every rank draws with the same seed.
- 09.c: one all-reduce per key in an agreed order; ``all_gather_object`` of the whole dicts summed
  locally.
- 09.d: a flag all-reduced before backward; the gradients' total norm (``get_total_norm``); an
  ``all_gather`` of the ranks' flags.
- 09.e: ``with model.join():``; padding (every rank runs the longest rank's number of steps, the
  extra ones with the loss multiplied by 0).
- 09.f: ``inference_mode`` with the all-reduce inside it; a ``@torch.no_grad()`` function with two
  all-reduces (sum and count); the previous mode restored with ``model.train(was_training)``.
"""

from .a_checkpoint_collective import check_checkpoint_collective
from .b_distributed_loader import check_distributed_loader
from .c_metrics_order import check_metrics_sync
from .d_nan_skip import check_nan_skip_step
from .e_uneven_join import check_uneven_join
from .f_eval_leak import check_eval_no_leak

__all__ = [
    "check_checkpoint_collective",
    "check_distributed_loader",
    "check_metrics_sync",
    "check_nan_skip_step",
    "check_uneven_join",
    "check_eval_no_leak",
]
