"""Chapter 15: expert parallelism with data parallelism on one mesh, and the same loss curve from each layout.

Workers import this file (``from ch15_mesh import mesh_grads, parity, cp_parity``); the first two
need 4 ranks, ``cp_parity`` 2 or 4.

- ``MoENet``: a small classifier around one MoE layer (embed, residual MoE, head).
- ``reduce_grads(model, dp_group, world, expert_group)``: the gradient reduction of dp x ep: every
  dense parameter (embed, head, router) averaged over all ranks, each expert over ``expert_group``.
- ``mesh_grads()``: on a 2 x 2 (dp, ep) mesh, the gradients after one step with experts reduced over
  the dp group (right) and over the ep group (wrong), each against one process.
- ``parity(steps)``: the same model, seed and batches trained by one process, DDP, FSDP2, tensor
  parallelism (embedding and head split), EP over 4 ranks, dp x ep on a 2 x 2 mesh, a pipeline of
  2 stages (``pipeline_rows``: alone, and dp x pp on a 2 x 2 mesh); the losses.  And the pipeline
  whose balancing loss adds its value at the last stage only: its router's gradient, off.
- ``parity_3d(steps)``: 8 ranks, dp x ep x tp on a 2 x 2 x 2 mesh (each expert split over tp), against
  one process (tests/lessons/test_ch15_mesh.py runs it: 8 processes are too many for the lesson).
- ``cp_parity(steps)``: ``AttnMoE``, causal attention and the MoE layer over a sequence, with the
  sequence split over the ranks by chapter 14's ring attention (experts replicated, or spread over
  the same ranks), against one process.
- ``simulate(dp, ep)``: one process plays rank 0 of a dp x ep job with torch's fake backend (a
  simulation: nothing moves); each rank's all-to-all sizes and expert memory, from the routing.

Every rank takes a quarter of each batch. Capacity and the load-balancing loss are computed per
rank's tokens (as GShard does per group of tokens), so the one-process run goes through the same
four quarters in turn and averages their losses: that is the job every layout must reproduce.
"""

import gc
import os
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ch15_moe import EPMoE, MoE, route
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP

from course_utils import backend_and_device
from course_utils.data import make_dataset
from course_utils.devices import process_group_kwargs
from course_utils.workarounds import apply_all

FEATURES, WIDTH, CLASSES, RANKS, BATCH, LR, AUX = 32, 16, 10, 4, 128, 0.2, 0.01
MOE = dict(dim=WIDTH, hidden=32, num_experts=8, k=2, capacity_factor=1.25)


class MoENet(nn.Module):
    def __init__(self, moe):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            self.embed, self.head = nn.Linear(FEATURES, WIDTH), nn.Linear(WIDTH, CLASSES)
        self.moe = moe

    def forward(self, x):
        h = self.embed(x)
        return self.head(h + self.moe(h))


def loss_of(model, x, y):
    moe = model.module.moe if isinstance(model, DDP) else model.moe
    return F.cross_entropy(model(x), y) + AUX * moe.stats["aux"]


def batches(steps):
    x, y = make_dataset(BATCH * steps, seed=15).tensors
    return list(zip(x.split(BATCH), y.split(BATCH)))


def quarter(t, r):
    n = len(t) // RANKS
    return t[r * n:(r + 1) * n]


def is_expert(name):
    return ".experts." in name


def reduce_grads(model, world, expert_group=None, tp=1):
    """dp x ep's reduction: dense gradients over every rank, expert gradients over ``expert_group``.

    Each rank's gradient comes from its own quarter's loss. A dense parameter has a copy on every
    rank: sum over all of them. An expert's gradient already holds the share of every rank of its ep
    group (the all-to-all's backward brought it); its copies on the other dp ranks hold the rest:
    sum over ``expert_group``, the ranks that hold this expert (None: no other copy).  Then divide
    by the number of quarters each sum holds, for the mean over the batch: ``world`` for the dense
    ones; with experts split over ``tp`` ranks (each pair sees the same quarter), ``world / tp``.
    """
    for name, p in model.named_parameters():
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad  # a TP shard: its local part
        if not is_expert(name):
            dist.all_reduce(grad)
            grad /= world
        else:
            if expert_group is not None:
                dist.all_reduce(grad, group=expert_group)
            grad /= world // tp


def split_experts(moe, tp_mesh):
    """Tensor parallelism inside every expert (chapter 11's pair): up split by columns, down by rows."""
    for expert in moe.experts:
        parallelize_module(expert, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return moe


def _all_quarters(model, data):
    """One process's run: the four quarters of each batch in turn, their mean loss's gradient."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in data:
        opt.zero_grad()
        total = 0.0
        for r in range(RANKS):
            loss = loss_of(model, quarter(x, r), quarter(y, r)) / RANKS
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return losses


def _one_process(data):
    model = MoENet(MoE(**MOE))
    return _all_quarters(model, data), model


def _train(model, data, rank, after_backward=None):
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = loss_of(model, quarter(x, rank), quarter(y, rank))
        loss.backward()
        if after_backward is not None:
            after_backward()
        opt.step()
        seen = loss.detach().clone()
        dist.all_reduce(seen)
        losses.append(seen.item() / RANKS)
    return losses


def _expert_holders(mesh):
    """The group of ranks that hold copies of this rank's experts: the dp group (same ep coordinate)."""
    return mesh.get_group("dp")


def mesh_grads():
    """Worker: one step's gradients on a 2 x 2 (dp, ep) mesh, expert gradients reduced two ways."""
    apply_all()  # WORKAROUND for a torch bug at exit (pytorch/pytorch#56297), not part of the algorithm
    backend, device = backend_and_device()
    dist.init_process_group(**process_group_kwargs(backend, device))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("dp", "ep"))
    x, y = batches(1)[0]
    _, ref = _one_process([(x, y)])  # ref's .grad: the job's gradients (the optimizer step changed only p)
    out = {"rank": rank, "coordinate": mesh.get_coordinate(),
           "dp group": dist.get_process_group_ranks(mesh.get_group("dp")),
           "ep group": dist.get_process_group_ranks(mesh.get_group("ep"))}
    for label, experts_over in (("experts over dp (right)", "dp"), ("experts over ep (wrong)", "ep")):
        model = MoENet(EPMoE(group=mesh.get_group("ep"), **MOE)).to(device)
        loss = loss_of(model, quarter(x, rank).to(device), quarter(y, rank).to(device))
        loss.backward()
        reduce_grads(model, world, mesh.get_group(experts_over))
        worst = {"dense": 0.0, "experts": 0.0}
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            if is_expert(name):  # local expert j is expert first + j of the full layer
                j = int(name.split(".")[2])
                name = name.replace(f"experts.{j}.", f"experts.{model.moe.first + j}.")
            d = (p.grad.cpu() - ref_params[name].grad).abs().max().item()
            kind = "experts" if is_expert(name) else "dense"
            worst[kind] = max(worst[kind], d)
        out[label] = worst
    gc.collect()
    dist.destroy_process_group()
    return out


def parity(steps=6):
    """Worker: the same MoE classifier trained by 8 layouts; rank 0 returns the curves and the PP check."""
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    apply_all()  # WORKAROUND for a torch bug at exit (pytorch/pytorch#56297), not part of the algorithm
    backend, device = backend_and_device()
    dist.init_process_group(**process_group_kwargs(backend, device))
    rank, world = dist.get_rank(), dist.get_world_size()
    data = [(x.to(device), y.to(device)) for x, y in batches(steps)]
    curves = {"one process": _one_process([(x.cpu(), y.cpu()) for x, y in data])[0]}

    ddp = DDP(MoENet(MoE(**MOE)).to(device))
    curves["DDP"] = _train(ddp, data, rank)
    del ddp
    gc.collect()

    mesh1 = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    m = MoENet(MoE(**MOE)).to(device)
    fully_shard(m, mesh=mesh1)
    curves["FSDP2"] = _train(m, data, rank)

    tp1 = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
    gathered = ColwiseParallel(output_layouts=Replicate())  # each rank computes a quarter of the columns
    tp_model = parallelize_module(MoENet(MoE(**MOE)).to(device), tp1, {"embed": gathered, "head": gathered})
    curves["TP (4)"] = _all_quarters(tp_model, data)  # every rank sees the whole batch

    ep = MoENet(EPMoE(**MOE)).to(device)  # experts over all 4 ranks: each expert has one copy
    curves["EP (4)"] = _train(ep, data, rank, lambda: reduce_grads(ep, world))

    mesh2 = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("dp", "ep"))
    m2 = MoENet(EPMoE(group=mesh2.get_group("ep"), **MOE)).to(device)
    curves["dp x ep (2 x 2)"] = _train(m2, data, rank,
                                       lambda: reduce_grads(m2, world, _expert_holders(mesh2)))
    pipelined, router = pipeline_rows(data, rank, device)  # defined below, with the pipeline
    curves.update(pipelined)
    gc.collect()
    dist.destroy_process_group()
    return {"curves": curves, "PP router gradient": router} if rank == 0 else None


def parity_3d(steps=4):
    """Worker (8 ranks): dp x ep x tp on a 2 x 2 x 2 mesh against one process; rank 0 returns both curves.

    The two ranks of a tp pair hold halves of the same experts and see the same quarter of the batch;
    the ep group (same dp and tp coordinates) exchanges tokens; the dp group holds copies.
    """
    apply_all()  # WORKAROUND for a torch bug at exit (pytorch/pytorch#56297), not part of the algorithm
    backend, device = backend_and_device()
    dist.init_process_group(**process_group_kwargs(backend, device))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (2, 2, 2), mesh_dim_names=("dp", "ep", "tp"))
    data = [(x.to(device), y.to(device)) for x, y in batches(steps)]
    dp, ep = mesh.get_local_rank("dp"), mesh.get_local_rank("ep")
    moe = split_experts(EPMoE(group=mesh.get_group("ep"), **MOE), mesh["tp"])
    model = MoENet(moe).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in data:
        opt.zero_grad()
        q = 2 * dp + ep  # this rank's quarter: the same for both ranks of a tp pair
        loss = loss_of(model, quarter(x, q), quarter(y, q))
        loss.backward()
        reduce_grads(model, world, mesh.get_group("dp"), tp=2)
        opt.step()
        seen = loss.detach().clone()
        dist.all_reduce(seen)
        losses.append(seen.item() / world)
    curves = {"one process": _one_process([(x.cpu(), y.cpu()) for x, y in data])[0],
              "dp x ep x tp (2 x 2 x 2)": losses}
    gc.collect()
    dist.destroy_process_group()
    return curves if rank == 0 else None


def simulate(dp=8, ep=8, experts=64, tokens=4096, dim=1024, hidden=2816, k=2, capacity_factor=1.25,
             skew=0.0):
    """Worker (1 process): rank 0 of a dp x ep job, simulated with torch's fake backend.

    The fake backend (``FakeStore``, as in chapter 12) gives this process a world of dp * ep ranks,
    so the mesh and its groups are the real job's; its collectives move nothing.  The sizes come
    from routing: the router is replicated, so this process can route the tokens of every rank of
    rank 0's ep group (random activations stand in for the model's; ``skew`` adds to the logits
    of the first expert-parallel rank's experts).  Rows in bf16 (2 bytes per value).
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    barrier = os.environ.pop("TORCH_DIST_INIT_BARRIER", None)  # the other ranks do not exist
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dp * ep)
    try:
        mesh = init_device_mesh("cpu", (dp, ep), mesh_dim_names=("dp", "ep"))
        groups = {n: dist.get_process_group_ranks(mesh.get_group(n)) for n in ("dp", "ep")}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            router = nn.Linear(dim, experts, bias=False)
        local = experts // ep
        rows = torch.zeros(ep, ep, dtype=torch.long)  # rows[i, j]: ep rank i sends to ep rank j
        dropped = 0
        with torch.no_grad():
            for i in range(ep):
                g = torch.Generator().manual_seed(i)
                logits = router(torch.randn(tokens, dim, generator=g))
                logits[:, :local] += skew
                r = route(logits, k, capacity_factor)
                rows[i] = torch.bincount(r.idx[r.keep] // local, minlength=ep)
                dropped += int((~r.keep).sum())
        out_bytes = [(int(rows[i].sum()) - int(rows[i, i])) * dim * 2 for i in range(ep)]
        in_bytes = [(int(rows[:, i].sum()) - int(rows[i, i])) * dim * 2 for i in range(ep)]
        per_expert = 2 * dim * hidden + hidden + dim  # up and down weights and biases
        expert_params = local * per_expert
        # counts exchange of rank 0, through the fake backend (returns at once, nothing received)
        counts = torch.zeros(experts, dtype=torch.long)
        dist.all_to_all_single(torch.empty_like(counts), counts, group=mesh.get_group("ep"))
        return {"groups": groups, "rows": rows.tolist(), "out_bytes": out_bytes, "in_bytes": in_bytes,
                "expert_params": expert_params, "all_experts_params": experts * per_expert,
                "router_params": dim * experts, "dropped": dropped, "assignments": ep * tokens * k,
                "world": dist.get_world_size()}
    finally:
        dist.destroy_process_group()
        if barrier is not None:
            os.environ["TORCH_DIST_INIT_BARRIER"] = barrier



# ---- section 4: a pipeline of two stages, and context parallelism with an MoE block ----------


def _pipeline(data, rank, stages, quarters, dp_group=None, aux_grad=True):
    """Hand GPipe steps (chapter 12) over the ranks ``stages`` = (first, last), ``quarters`` as micro-batches.

    Stage 0 holds the embedding and the MoE layer, so the router and its balancing loss live there;
    stage 1 holds the head and the cross-entropy.  The balancing loss's gradient joins stage 0's
    backward beside the gradient that comes back from stage 1; its value travels forward with the
    activations, so the last stage can report the whole loss.  ``aux_grad=False`` is the mistake of
    adding only that value at the last stage: the loss reads the same, the router gets no gradient
    from it.  Ranks outside ``stages`` only join the sum of the losses.  Returns the losses and, on
    stage 0, the router's gradient of the first step (None elsewhere).
    """
    device = data[0][0].device
    net = MoENet(MoE(**MOE)).to(device)
    stage = stages.index(rank) if rank in stages else None
    params = [p for m in {0: [net.embed, net.moe], 1: [net.head]}.get(stage, []) for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=LR) if params else None
    losses, router_grad = [], None
    for x, y in data:
        total = torch.zeros((), device=device)
        if stage is not None:
            opt.zero_grad()
            saved = []
            for q in quarters:  # every micro-batch's forward ...
                if stage == 0:
                    h = net.embed(quarter(x, q))
                    out = h + net.moe(h)
                    aux = AUX * net.moe.stats["aux"] / RANKS
                    dist.send(out.detach(), dst=stages[1])
                    dist.send(aux.detach().reshape(1), dst=stages[1])  # its value, for the loss
                    saved.append((out, aux))
                else:
                    inp = torch.empty(len(quarter(x, q)), WIDTH, device=device)
                    aux = torch.empty(1, device=device)
                    dist.recv(inp, src=stages[0])
                    dist.recv(aux, src=stages[0])
                    inp.requires_grad_()
                    ce = F.cross_entropy(net.head(inp), quarter(y, q)) / RANKS
                    total += ce.detach() + aux[0]
                    saved.append((inp, ce))
            for a, b in reversed(saved):  # ... then every backward, the last micro-batch first
                if stage == 1:
                    b.backward()
                    dist.send(a.grad, dst=stages[0])
                else:
                    grad = torch.empty_like(a)
                    dist.recv(grad, src=stages[1])
                    if aux_grad:  # one backward from both: the activations' gradient and the balancing loss
                        torch.autograd.backward([a, b], [grad, None])
                    else:
                        a.backward(grad)
            if dp_group is not None:  # dp x pp: the copies of this stage each saw half the quarters
                for p in params:
                    dist.all_reduce(p.grad, group=dp_group)
            if stage == 0 and router_grad is None:
                router_grad = net.moe.router.weight.grad.cpu()
            opt.step()
        dist.all_reduce(total)
        losses.append(total.item())
    return losses, router_grad


def pipeline_rows(data, rank, device):
    """parity's pipeline rows: PP on ranks 0 and 1 (2 and 3 wait) and dp x pp on a 2 x 2 mesh; and
    the mistake, against the right pipeline: the router's first gradient's distance from one process's.
    """
    rows, router = {}, {}
    rows["PP (2 stages)"], router["right"] = _pipeline(data, rank, (0, 1), range(RANKS))
    mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("dp", "pp"))
    dp = mesh.get_local_rank("dp")
    stages = tuple(dist.get_process_group_ranks(mesh.get_group("pp")))
    rows["dp x pp (2 x 2)"], _ = _pipeline(data, rank, stages, (2 * dp, 2 * dp + 1), mesh.get_group("dp"))
    wrong, router["wrong"] = _pipeline(data, rank, (0, 1), range(RANKS), aux_grad=False)
    if rank == 0:  # stage 0 of both: the router is here
        ref = _one_process([tuple(t.cpu() for t in data[0])])[1].moe.router.weight.grad
        router = {k: (g - ref).abs().max().item() for k, g in router.items()}
        router["wrong, max loss difference"] = max(abs(a - b) for a, b in zip(wrong, rows["PP (2 stages)"]))
    return rows, router


SEQ, HEADS, CP_LR = 16, 2, 0.5


class AttnMoE(nn.Module):
    """A transformer block over a sequence: causal self-attention, then the MoE layer, both residual."""

    def __init__(self, moe):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(2)
            self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.moe = moe

    def attention(self, x, attend):
        """x: (batch, this rank's positions, WIDTH); ``attend(q, k, v)`` on (batch, heads, positions, dim)."""
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, HEADS, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return x + self.proj(attend(q, k, v).transpose(1, 2).reshape(b, s, WIDTH))

    def loss(self, h, y):
        """The MoE layer on one routing group (one rank's positions); the output's error + balancing loss."""
        out = h + self.moe(h.reshape(-1, WIDTH)).view(h.shape)
        return F.mse_loss(out, y) + AUX * self.moe.stats["aux"]


def sequences(steps, batch=8):
    """Random sequences; the target at each position is the mean of the inputs up to it (causal)."""
    g = torch.Generator().manual_seed(14)
    x = torch.randn(steps, batch, SEQ, WIDTH, generator=g)
    return list(zip(x, x.cumsum(2) / torch.arange(1, SEQ + 1).view(SEQ, 1)))


def cp_parity(steps=6):
    """Worker: the attention + MoE block with its sequence split over every rank (chapter 14's ring).

    Rank r holds positions r * SEQ / N onwards (contiguous chunks); its queries attend over every
    earlier position through ``ring_attention``; the MoE layer routes this rank's tokens.  Two ways:
    the experts replicated (every gradient summed over the ranks) and the experts spread over the
    same ranks (EP: the all-to-alls' backward delivers each expert's gradient; the rest is summed).
    One process: full-sequence attention, the MoE layer on each rank's positions in turn (the same
    routing groups), the mean of their losses.  Rank 0 returns the loss curves and the largest
    difference of any parameter from the one-process model's after the last step.
    """
    from ch14_ring import ring_attention  # chapter 14's file, beside this one

    apply_all()  # WORKAROUND for a torch bug at exit (pytorch/pytorch#56297), not part of the algorithm
    backend, device = backend_and_device()
    dist.init_process_group(**process_group_kwargs(backend, device))
    rank, world = dist.get_rank(), dist.get_world_size()
    data = [(x.to(device), y.to(device)) for x, y in sequences(steps)]

    def causal(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    ref = AttnMoE(MoE(**MOE)).to(device)
    opt = torch.optim.SGD(ref.parameters(), lr=CP_LR)
    curves = {"one process": []}
    for x, y in data:
        opt.zero_grad()
        h = ref.attention(x, causal)
        loss = sum(ref.loss(hc, yc) for hc, yc in zip(h.chunk(world, 1), y.chunk(world, 1))) / world
        loss.backward()
        opt.step()
        curves["one process"].append(loss.item())
    twin = dict(ref.named_parameters())

    out = {}
    for label, moe in ((f"CP ({world}), experts replicated", MoE(**MOE)),
                       (f"CP ({world}) + EP on the same ranks", EPMoE(**MOE))):
        model = AttnMoE(moe).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=CP_LR)
        losses = []
        for x, y in data:
            opt.zero_grad()
            mine = slice(rank * SEQ // world, (rank + 1) * SEQ // world)
            loss = model.loss(model.attention(x[:, mine], ring_attention), y[:, mine]) / world
            loss.backward()
            for name, p in model.named_parameters():
                if not (is_expert(name) and isinstance(moe, EPMoE)):
                    dist.all_reduce(p.grad)  # replicated: each copy saw this rank's positions only
            opt.step()
            seen = loss.detach().clone()
            dist.all_reduce(seen)
            losses.append(seen.item())
        worst = 0.0
        for name, p in model.named_parameters():
            if is_expert(name) and isinstance(moe, EPMoE):  # local expert j is expert first + j
                j = int(name.split(".")[2])
                name = name.replace(f"experts.{j}.", f"experts.{moe.first + j}.")
            worst = max(worst, (p.detach() - twin[name].detach()).abs().max().item())
        gone = torch.tensor(worst, device=device)
        dist.all_reduce(gone, op=dist.ReduceOp.MAX)
        curves[label] = losses
        out[label] = gone.item()
    gc.collect()
    dist.destroy_process_group()
    return {"curves": curves, "max parameter difference": out} if rank == 0 else None
