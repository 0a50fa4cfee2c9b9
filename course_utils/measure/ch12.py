"""Chapter 12's measurements: a large FSDP2 job simulated in one process with the fake backend.

``simulate_fsdp(mesh_shape)`` builds the chapter's model with ``fully_shard`` on a ``DeviceMesh`` of
``prod(mesh_shape)`` ranks, in a process that plays rank 0 of them: the process group is torch's
"fake" backend (``FakeStore``, ``backend="fake"``), whose collectives return at once without moving
a byte.  Shapes, shards and the collectives FSDP2 issues are those of the real job; the values are
not (every all-gather leaves its output as it found it), and nothing is timed.  A 1-D mesh is FSDP
over every rank; a 2-D mesh ``(replicas, shards)`` is HSDP: parameters sharded over the second
dimension and replicated over the first.  With ``tp=2`` (or more), the mesh gains a last dimension for
tensor parallelism (chapter 11): the MLP's two ``Linear`` layers are split column- then row-wise
across it, and FSDP2 shards what each rank holds across the other dimension (FSDP x TP, as in
section 3).  TP's collectives are DTensor's functional ones, which ``CollectiveSpy`` (patching
``torch.distributed``) does not see: ``FunctionalCollectives``, a dispatch mode, records them.

It opens (and closes) the process's default group, so run it in a worker of its own
(``launch(simulate_fsdp, nprocs=1, args=((64,),))``), not in the notebook's kernel.

``ring_seconds(op, nbytes, n, alpha_call, alpha_hop, beta)`` is the α-β time of one ring collective,
with chapter 10's rule for the latency: a fixed cost per call plus one per hop of the ring (an
all-reduce takes 2(N − 1) hops, an all-gather or a reduce-scatter N − 1).  Chapter 10 extrapolates
from N = 2 with ``alpha_call = 0`` and ``alpha_hop = α / 2`` (so that 2(N − 1) hops give its α(N − 1)).
"""

from __future__ import annotations

import math
import os
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from ..checking import CollectiveSpy
from .ch10 import ring_factor

__all__ = ["sim_model", "sim_shapes", "simulate_fsdp", "FSDP_COLLECTIVES", "FunctionalCollectives",
           "ring_seconds"]

# What FSDP2 calls in torch 2.13 (all_gather_single, not all_gather_into_tensor).
FSDP_COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_reduce")


def sim_model(seed: int = 0) -> nn.Sequential:
    """The simulated job's model: an MLP block and a head, 9.4 M parameters (37.7 MB in fp32)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024), nn.GELU(),
                             nn.Linear(1024, 1000))


def sim_shapes() -> list[tuple[int, ...]]:
    """The shapes of ``sim_model``'s parameters, in order."""
    return [tuple(p.shape) for p in sim_model().parameters()]


class FunctionalCollectives(TorchDispatchMode):
    """Records ``(op, bytes of its input)`` for each functional collective (``torch.ops._c10d_functional``:
    what DTensor and tensor parallelism call), in order; everything runs as usual."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor  # here: DTensor takes about a second to import

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor turn the op into local ops and collectives first
        packet = getattr(func, "_overloadpacket", None)
        name = packet.__name__ if packet is not None else ""
        # the collectives themselves: not wait_tensor, nor helpers such as _wrap_tensor_autograd
        collective = name and not name.startswith("_") and name != "wait_tensor"
        if func.namespace == "_c10d_functional" and collective:
            first = args[0]
            if isinstance(first, (list, tuple)):
                nbytes = sum(t.numel() * t.element_size() for t in first)
            else:
                nbytes = first.numel() * first.element_size()
            self.calls.append((name, nbytes))
        return func(*args, **(kwargs or {}))


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def simulate_fsdp(mesh_shape: tuple[int, ...], batch: int = 8, tp: int = 1) -> dict:
    """Rank 0's bytes and collectives for one AdamW step of ``sim_model`` under FSDP2 (see the module doc).

    Returns ``{"world", "mesh", "params", "grads", "optimizer", "local_shapes", "unsharded",
    "collectives", "tp_collectives"}``: bytes of the parameter shards, gradient shards and AdamW
    state this rank keeps, the shape of each parameter's shard, the model's full fp32 size,
    ``(op, bytes)`` for every collective of the step that FSDP2 issued, in order (the first tensor of
    each call: an all-gather's output, a reduce-scatter's output shard), and the same for tensor
    parallelism's functional collectives (empty when ``tp == 1``).  ``tp > 1`` needs a 1-D
    ``mesh_shape``: the mesh is then ``(*mesh_shape, tp)``.
    """
    # Imported here: FSDP takes about a second to import, and importing the checkers should not wait.
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    mesh_shape = tuple(mesh_shape)
    if tp > 1 and len(mesh_shape) != 1:
        raise ValueError(f"tp={tp} needs a 1-D FSDP mesh, got {mesh_shape}")
    world = math.prod(mesh_shape) * tp
    # No store-based barriers (init_process_group, new_group): the other ranks do not exist, and a
    # launcher sets TORCH_DIST_INIT_BARRIER=1.
    barrier = os.environ.pop("TORCH_DIST_INIT_BARRIER", None)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        names = ("shard",) if len(mesh_shape) == 1 else ("replicate", "shard")
        model = sim_model()
        unsharded = sum(p.numel() * p.element_size() for p in model.parameters())
        if tp > 1:
            # Imported here for the same reason as FSDP above.
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            both = init_device_mesh("cpu", (*mesh_shape, tp), mesh_dim_names=("shard", "tp"))
            parallelize_module(model, both["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
            mesh = both["shard"]
        else:
            mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)  # "cpu": see chapter 10
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(batch, 1024)
        with CollectiveSpy(FSDP_COLLECTIVES) as spy, FunctionalCollectives() as functional, \
                warnings.catch_warnings():
            # With TP, FSDP2 warns that a layer returned a view, which an in-place op would
            # break; this step applies none to any layer's output.
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
            model(x).square().mean().backward()
            opt.step()
        state = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
        return {
            "world": world, "mesh": mesh_shape, "unsharded": unsharded,
            "params": sum(_local_bytes(p) for p in model.parameters()),
            "grads": sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None),
            "optimizer": sum(_local_bytes(v) for v in state),
            "local_shapes": {n: tuple(p.to_local().shape) for n, p in model.named_parameters()},
            "collectives": [(c.op, c.nbytes) for c in spy.calls],
            "tp_collectives": functional.calls,
        }
    finally:
        dist.destroy_process_group()
        if barrier is not None:
            os.environ["TORCH_DIST_INIT_BARRIER"] = barrier


def ring_seconds(op: str, nbytes: float, n: int, alpha_call: float, alpha_hop: float, beta: float) -> float:
    """Seconds of one ring collective over ``n`` ranks on a link of ``beta`` bytes/s.

    ``nbytes`` is the full tensor: the all-gather's output, the reduce-scatter's input, the all-reduce's
    tensor.  Each rank sends (N − 1)/N of it per phase, through N − 1 hops; an all-reduce is a
    reduce-scatter and an all-gather (``ring_factor``: 2(N − 1)/N, chapter 10).
    """
    if n <= 1:
        return 0.0
    phases = 2 if op == "all_reduce" else 1
    return alpha_call + phases * (n - 1) * alpha_hop + phases * ring_factor(n) / 2 * nbytes / beta
