"""A small DistributedDataParallel of your own: one asynchronous all-reduce per parameter.

Exercise 04.b.  Workers import this file (``from mini_ddp import DDPIndividualParameters``), exactly
as a training script run by ``torchrun`` would, so edit it here and rerun the check cell.

What it must do, as ``torch.nn.parallel.DistributedDataParallel`` does, minus the buckets:

1. At construction, make every rank's module equal to rank 0's: broadcast each parameter and each
   buffer from rank 0.
2. During backward, as soon as a parameter's gradient is ready (it has been accumulated into
   ``.grad``), start an **asynchronous** all-reduce of that gradient (``async_op=True``) and keep
   the handle.  ``Tensor.register_post_accumulate_grad_hook`` calls a function at exactly that
   moment.  Do not wait inside the hook: backward must go on computing the earlier layers while
   the gradient travels.
3. ``finish_gradient_synchronization()``, called after ``loss.backward()`` and before
   ``optimizer.step()``, waits for every outstanding all-reduce and divides each gradient by the
   world size, so that ``.grad`` holds the average over ranks.

It must work for any module torch DDP accepts, including parameters with ``requires_grad=False``
(frozen: no gradient, no hook) and a parameter shared by two layers (it appears once in
``module.parameters()`` and must be all-reduced once per backward).

Teardown: keep each finished handle until the next ``finish_gradient_synchronization()`` (or until
the model dies), instead of dropping it as soon as ``wait()`` returns.  A collective started during
backward snapshots the thread's state, which then holds a Python object (torch stashes one there for
every backward), so whoever drops the last reference to the handle must take the GIL.  After
``wait()`` returns, gloo's worker thread still holds a reference for a moment; if ours goes first,
that thread releases the last one, and if the interpreter is exiting by then, Python stops the
thread inside a C++ destructor and the process aborts ("terminate called without an active
exception").  Gloo's threads outlive ``destroy_process_group()`` whenever something still holds the
group, as ``torch.distributed.nn`` does when it is first imported after ``init_process_group``
(``torch._dynamo`` imports it, and any optimizer's constructor imports ``torch._dynamo``).  Handles
kept here are released by the training thread, which holds the GIL.  And this file imports
``torch.distributed.nn`` itself, so that a script importing it before ``init_process_group`` (as
scripts and test files do) leaves no such reference: its group is freed, and gloo's threads
joined, by ``destroy_process_group()``.  That also covers ``ShardedOptimizer``, whose broadcasts'
work items hold the parameters (a core dump of an abort shows gloo's thread releasing one).

Usage, in every rank::

    model = DDPIndividualParameters(make_model())
    for x, y in batches:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        model.finish_gradient_synchronization()
        optimizer.step()
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  (imported before the script's init_process_group: "Teardown")
from torch import nn


class DDPIndividualParameters(nn.Module):
    """Wrap ``module``; average its gradients over all ranks, overlapping backward."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        raise NotImplementedError("Exercise 04.b mini DDP: replace this line with your code")

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Wait for the all-reduces started during backward; leave the average in ``.grad``."""
        raise NotImplementedError("Exercise 04.b mini DDP: replace this line with your code")


# ================================================================================================
# Chapter 10: buckets, and an optimizer whose state is split across the ranks
# ================================================================================================


class DDPBucketed(nn.Module):
    """Exercise 10.a: average gradients over all ranks with one all-reduce per *bucket*.

    ``DDPIndividualParameters`` pays the fixed cost of a collective (the latency α of chapter 10's
    cost model) once per parameter.  Torch DDP groups gradients into buckets of about
    ``bucket_cap_mb`` and all-reduces each bucket as one flat tensor.  This class does the same:

    1. At construction, broadcast rank 0's parameters and buffers (as in 04.b).
    2. Put the trainable parameters into buckets of at most ``bucket_size_mb`` MiB
       (``numel() * element_size()`` bytes each), walking ``module.parameters()`` in *reverse*:
       backward computes the last layer's gradients first, so the first bucket fills first.  A
       parameter larger than the cap gets a bucket of its own.
    3. From each parameter's post-accumulate-grad hook, count the ready gradients of its bucket;
       when the last one arrives, flatten the bucket's gradients into one tensor and start
       ``dist.all_reduce(flat, async_op=True)``.  Never wait in the hook.
    4. ``finish_gradient_synchronization()`` waits for every bucket, divides by the world size and
       copies each slice of the result back into its parameter's ``.grad``.  Leave everything
       ready for the next backward, and keep the finished handles until the next call, as in 04.b
       (the module docstring's "Teardown").
    5. ``on_train_batch_start()`` (optional, called before each forward) may reset per-step state.

    All gradients of the module must have one dtype (flattening needs it).

    Two things torch DDP does that this design leaves out (chapter 04, section 3.2): DDP launches
    its buckets in index order, so the k-th all-reduce is the same bucket on every rank even where
    autograd finishes gradients in a different order on different ranks; launching in completion
    order, as here, relies on every rank running the same graph.  And DDP raises an error at the
    next forward when a parameter got no gradient (unless ``find_unused_parameters=True``); here a
    bucket with such a parameter never fills, is never all-reduced, and its gradients silently stay
    those of this rank alone.
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float):
        super().__init__()
        self.module = module
        raise NotImplementedError("Exercise 10.a bucketed DDP: replace this line with your code")

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def on_train_batch_start(self) -> None:
        """Called before each forward pass: reset per-step state here if your design needs it."""

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's all-reduce; leave the average in each ``.grad``."""
        raise NotImplementedError("Exercise 10.a bucketed DDP: replace this line with your code")


class ShardedOptimizer(torch.optim.Optimizer):
    """Exercise 10.b: ZeRO stage 1, an optimizer whose state is split across the ranks.

    ``ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.1)`` behaves
    like ``torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)`` on every rank, given
    the same (already averaged) gradients on every rank, but each parameter's optimizer state
    (AdamW: two tensors the size of the parameter) lives on one rank only:

    1. Every parameter is owned by exactly one rank, the same on all ranks (decide it from the
       order of the parameters, never from anything that differs between ranks).
    2. An inner ``optimizer_cls`` on this rank gets only the parameters this rank owns, with the
       hyperparameters of their group.
    3. ``step()`` steps the inner optimizer, then brings every rank up to date: each parameter is
       broadcast from its owner.
    4. ``params`` may be a generator (it can be read only once); ``add_param_group()`` (which
       ``torch.optim.Optimizer.__init__`` itself calls for each group) must shard the new group
       too; ``zero_grad()`` clears every parameter's gradient, owned or not.

    Checkpoints (given, not part of the exercise): the inherited ``Optimizer.state_dict()`` would
    read this object's own ``state``, which stays empty, and so save no Adam moment at all.
    ``state_dict()`` below is a collective: every rank calls it, and every rank gets the whole
    state, in the format of the unsharded optimizer's ``state_dict()``, so rank 0 saves it as it
    would save AdamW's.  ``load_state_dict(full)``, called on every rank with that whole dict, keeps
    this rank's share.  They find the inner optimizers wherever your class keeps them, one attribute
    (or one list or dict) away.
    """

    def __init__(self, params, optimizer_cls: type[torch.optim.Optimizer], **kwargs):
        raise NotImplementedError("Exercise 10.b sharded optimizer: replace this line with your code")

    def add_param_group(self, param_group: dict) -> None:
        raise NotImplementedError("Exercise 10.b sharded optimizer: replace this line with your code")

    @torch.no_grad()
    def step(self, closure=None):
        raise NotImplementedError("Exercise 10.b sharded optimizer: replace this line with your code")

    # Given: checkpoints.  torch's ZeroRedundancyOptimizer gathers the shards on one rank instead
    # (consolidate_state_dict(to=0), then state_dict() on that rank only, which raises elsewhere).
    # Here every rank gets the whole state from one call: the ordinary recipe (every rank calls
    # state_dict(), rank 0 writes the file) keeps its shape, and the dict loads into a plain AdamW
    # too.  The price: while it is saved, every rank holds the whole state for a moment.

    def _inner_optimizers(self) -> list[torch.optim.Optimizer]:
        found = []
        for value in vars(self).values():
            items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) \
                else [value]
            found += [o for o in items if isinstance(o, torch.optim.Optimizer) and o is not self]
        if not found:
            raise RuntimeError("state_dict() looks for the inner optimizer in the attributes of the "
                               "ShardedOptimizer (one attribute, or one list or dict, away): none found")
        return found

    def state_dict(self) -> dict:
        """Every rank's optimizer state, numbered as ``torch.optim.Optimizer.state_dict()`` numbers
        it (parameters in the order of ``param_groups``).  A collective: call it on every rank."""
        ordered = [p for group in self.param_groups for p in group["params"]]
        index = {p: i for i, p in enumerate(ordered)}
        mine = {}
        for inner in self._inner_optimizers():
            for p, state in inner.state.items():
                if p in index:  # tensors go to the CPU: gathered as Python objects, then saved
                    mine[index[p]] = {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
                                      for k, v in state.items()}
        shares: list[dict | None] = [None] * dist.get_world_size()
        dist.all_gather_object(shares, mine)
        state = {i: st for share in shares for i, st in share.items()}
        groups = [{**{k: v for k, v in group.items() if k != "params"},
                   "params": [index[p] for p in group["params"]]} for group in self.param_groups]
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load the whole state that ``state_dict()`` returned (on any rank): this rank keeps the
        state of the parameters its inner optimizers hold, and every group's hyperparameters."""
        saved_groups = state_dict["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("the saved state has groups of other sizes than this optimizer's: "
                             f"{[len(g['params']) for g in saved_groups]} parameters per group, "
                             f"here {[len(g['params']) for g in self.param_groups]}")
        group_of = {}
        for group, saved in zip(self.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
            for p, i in zip(group["params"], saved["params"]):
                group_of[p] = (group, i)
        saved_state = state_dict["state"]
        for inner in self._inner_optimizers():
            inner.state.clear()
            for inner_group in inner.param_groups:
                for p in inner_group["params"]:
                    group, i = group_of[p]
                    inner_group.update({k: v for k, v in group.items() if k != "params"})
                    if i in saved_state:  # the step counter keeps its device and dtype, as torch's does
                        inner.state[p] = {
                            k: v.to(p.device, p.dtype if v.is_floating_point() else v.dtype).clone()
                            if isinstance(v, torch.Tensor) and k != "step" else
                            v.clone() if isinstance(v, torch.Tensor) else v
                            for k, v in saved_state[i].items()}
