"""Chapter 12: two kinds of parallelism on one DeviceMesh, and the same loss curve from each.

Workers import this file (``from ch12_mesh import mesh_groups, parity``); both need 4 ranks.

- ``mesh_groups()``: the process groups a 2 x 2 mesh creates, as lists of global ranks.
- ``parity(steps)``: the same model, seed and batches trained by one process, DDP, FSDP2, tensor
  parallelism, a two-stage pipeline (GPipe, ranks 0 and 1), FSDP2 x TP on a 2 x 2 mesh and HSDP;
  each configuration's loss per step.

Meshes are built on "cpu": FSDP2 over gloo on a machine with GPUs segfaults (pytorch/pytorch#132471).
With NCCL and one GPU per rank, build them on "cuda" instead.
"""

import contextlib
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP

BATCH, DIM, HIDDEN, LR = 32, 16, 64, 0.2


@contextlib.contextmanager
def group():
    dist.init_process_group("gloo")
    try:
        yield dist.get_rank(), dist.get_world_size()
    finally:
        dist.destroy_process_group()


def mesh_groups():
    with group() as (rank, world):
        out = {}
        for names in (("dp", "tp"), ("replicate", "shard")):
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=names)
            out[names] = {n: dist.get_process_group_ranks(mesh.get_group(n)) for n in names}
            out[names]["coordinate"] = mesh.get_coordinate()
        return out


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return self.down(F.relu(self.up(x)))


def make_model():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return MLP()


def batches(steps):
    """One fixed batch, seen ``steps`` times: the loss falls, and every configuration must follow it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        x, y = torch.randn(BATCH, DIM), torch.randn(BATCH, DIM)
    return [(x, y)] * steps


TP_PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}  # chapter 11's pair of linears


def _train(model, data, dp_rank, dp_size, dp_group):
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in data:
        per = BATCH // dp_size
        x, y = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        seen = loss.detach().clone()
        if dp_size > 1:  # the whole batch's loss: the mean over the data-parallel ranks
            dist.all_reduce(seen, group=dp_group)
            seen /= dp_size
        losses.append(seen.item())
    return losses


def _train_pipeline(data, rank, micro=4):
    """GPipe over two stages on ranks 0 and 1 (up + ReLU, then down); ranks 2 and 3 wait.

    The schedule divides the gradients by the number of micro-batches, so that the sum over the
    micro-batches' mean losses gives the whole batch's mean loss's gradient.  The loss exists on
    the last stage only: rank 1 broadcasts it to every rank.
    """
    pair = dist.new_group([0, 1])  # every rank calls new_group, also those not in it
    losses = torch.zeros(len(data))
    if rank < 2:
        full = make_model()
        part = nn.Sequential(full.up, nn.ReLU()) if rank == 0 else full.down
        stage = PipelineStage(part, rank, 2, torch.device("cpu"), group=pair)
        schedule = ScheduleGPipe(stage, n_microbatches=micro, loss_fn=F.mse_loss)
        opt = torch.optim.SGD(part.parameters(), lr=LR)
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            micro_losses = []
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=micro_losses)
                losses[i] = torch.stack(micro_losses).mean()
            opt.step()
    dist.broadcast(losses, src=1)
    return losses.tolist()


def parity(steps=8):
    # FSDP2 warns that the root's output is a view; nothing here writes into it in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    with group() as (rank, world):
        data = batches(steps)
        curves = {"one process": _train(make_model(), data, 0, 1, None)}
        everyone = dist.group.WORLD
        curves["DDP"] = _train(DDP(make_model()), data, rank, world, everyone)

        mesh1 = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        m = make_model()
        fully_shard(m.up, mesh=mesh1)
        fully_shard(m.down, mesh=mesh1)
        fully_shard(m, mesh=mesh1)
        curves["FSDP2"] = _train(m, data, rank, world, everyone)

        tp1 = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        curves["TP"] = _train(parallelize_module(make_model(), tp1, TP_PLAN), data, 0, 1, None)
        curves["PP"] = _train_pipeline(data, rank)

        mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        m = parallelize_module(make_model(), mesh2["tp"], TP_PLAN)
        fully_shard(m.up, mesh=mesh2["dp"])
        fully_shard(m.down, mesh=mesh2["dp"])
        fully_shard(m, mesh=mesh2["dp"])
        dp_rank = mesh2.get_local_rank("dp")
        curves["FSDP2 x TP"] = _train(m, data, dp_rank, 2, mesh2.get_group("dp"))

        hsdp = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        m = make_model()
        fully_shard(m, mesh=hsdp)
        curves["HSDP"] = _train(m, data, rank, world, everyone)
        return curves
