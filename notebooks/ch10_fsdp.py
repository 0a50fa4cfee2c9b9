"""Chapter 10: memory per rank and communication of DDP, ZeRO stage 1 and FSDP2, side by side.

Workers import this file (``from ch10_fsdp import memory_and_comm``).  All three train the same model
on the same data with AdamW; the worker measures the bytes each rank holds for parameters,
gradients and optimizer state, counts FSDP2's collectives, and compares the trained weights.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_collectives as fsdp_coll
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from course_utils import backend_and_device
from course_utils.data import make_dataset, make_model

KW = {"lr": 1e-3, "weight_decay": 0.1}


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(tensors):
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors if t is not None)


def _state_bytes(opt):
    inner = opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt  # this rank's shard
    return sum(_nbytes([v]) for st in inner.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def _train(model, opt, batches):
    for x, y in batches:
        opt.zero_grad(set_to_none=False)  # keep the gradients allocated, to measure them
        F.cross_entropy(model(x), y).backward()
        opt.step()


def memory_and_comm(hidden=512, steps=3, batch=32):
    backend, device = backend_and_device()
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = make_dataset(batch * world * steps, seed=4).tensors
    batches = [(x[s * batch * world:(s + 1) * batch * world][rank::world].to(device),
                y[s * batch * world:(s + 1) * batch * world][rank::world].to(device)) for s in range(steps)]
    base = make_model(0, hidden=hidden).to(device)
    ids = [device.index] if device.type == "cuda" else None
    out = {}

    ddp = DDP(copy.deepcopy(base), device_ids=ids)
    opt = torch.optim.AdamW(ddp.parameters(), **KW)
    _train(ddp, opt, batches)
    params = list(ddp.module.parameters())
    out["DDP"] = (_nbytes(params), _nbytes([p.grad for p in params]), _state_bytes(opt))
    reference = {n: p.detach().cpu().clone() for n, p in ddp.module.named_parameters()}
    # DDP's reducer also keeps flat bucket buffers, as large as all gradients together: a second
    # copy, since .grad are tensors of their own unless gradient_as_bucket_view=True
    bucket_bytes = sum(int(b) for b in ddp._get_ddp_logging_data()["bucket_sizes"].split(","))
    own_storages = len({p.grad.untyped_storage().data_ptr() for p in params})
    del ddp, opt

    ddp = DDP(copy.deepcopy(base), device_ids=ids, gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(ddp.parameters(), **KW)
    _train(ddp, opt, batches)  # the gradients become views after the first step
    storages = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
                for g in (p.grad for p in ddp.module.parameters())}
    views = {"grads": len(params), "own_storages": own_storages, "view_storages": len(storages),
             "view_bytes": sum(storages.values())}
    del ddp, opt, storages

    ddp = DDP(copy.deepcopy(base), device_ids=ids)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, **KW)
    _train(ddp, opt, batches)
    params = list(ddp.module.parameters())
    out["ZeRO-1"] = (_nbytes(params), _nbytes([p.grad for p in params]), _state_bytes(opt))
    zero_diff = max((p.detach().cpu() - reference[n]).abs().max().item()
                    for n, p in ddp.module.named_parameters())
    del ddp, opt

    counts = {"all_gather": [0, 0], "reduce_scatter": [0, 0]}  # calls, bytes received / sent
    real_ag, real_rs = fsdp_coll.DefaultAllGather.__call__, fsdp_coll.DefaultReduceScatter.__call__

    def all_gather(self, output_tensor, input_tensor, *args, **kwargs):
        counts["all_gather"][0] += 1
        counts["all_gather"][1] += output_tensor.numel() * output_tensor.element_size()
        return real_ag(self, output_tensor, input_tensor, *args, **kwargs)

    def reduce_scatter(self, output_tensor, input_tensor, *args, **kwargs):
        counts["reduce_scatter"][0] += 1
        counts["reduce_scatter"][1] += input_tensor.numel() * input_tensor.element_size()
        return real_rs(self, output_tensor, input_tensor, *args, **kwargs)

    fsdp_coll.DefaultAllGather.__call__ = all_gather
    fsdp_coll.DefaultReduceScatter.__call__ = reduce_scatter
    # The mesh on the device the ranks use: without one, fully_shard builds its mesh on the
    # machine's accelerator (torch._C._get_accelerator()), a GPU even where these ranks run on CPU
    mesh = init_device_mesh(device.type, (world,))
    model = copy.deepcopy(base)
    for layer in model.net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)  # one unit per layer: gathered just before it runs
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), **KW)
    _train(model, opt, batches)
    params = list(model.parameters())
    out["FSDP2"] = (_nbytes(params), _nbytes([p.grad for p in params]), _state_bytes(opt))
    fsdp_diff = max((p.full_tensor().detach().cpu() - reference[n]).abs().max().item()
                    for n, p in model.named_parameters())
    del model, opt
    dist.destroy_process_group()
    return {"memory": out, "zero_diff": zero_diff, "fsdp_diff": fsdp_diff, "steps": steps,
            "fsdp_comm": {k: (c // steps, b // steps) for k, (c, b) in counts.items()},
            "param_bytes": _nbytes(base.parameters()), "bucket_bytes": bucket_bytes, "views": views}
