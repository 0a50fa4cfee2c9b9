"""Chapter 15: a mixture of experts in one process, and the same layer with its experts spread over ranks.

Workers import this file (``from ch15_moe import MoE, EPMoE, ep_parity``).

- ``route(logits, k, capacity_factor)``: softmax, top-k, each expert's capacity and the assignments
  it drops; ``load_balancing_loss`` (Switch/GShard) and ``z_loss``.
- ``MoE``: the one-process layer (a linear router and ``num_experts`` two-layer MLPs).
- ``dispatch_combine(x, routing, experts, group)``: expert parallelism's two all-to-alls: the counts
  exchanged, the tokens sent to the ranks that hold their experts, the local experts run, the outputs
  sent back, put back in token order and combined with the gate weights.
- ``EPMoE``: the same layer with ``num_experts / world`` experts on each rank and the router on all.
- ``ep_parity(k)``: worker: EP against the one-process layer (outputs, loss, drops, every gradient).
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_utils import backend_and_device
from course_utils.devices import process_group_kwargs
from course_utils.workarounds import apply_all

DIM, HIDDEN, EXPERTS = 16, 32, 8


@dataclass
class Routing:
    probs: torch.Tensor   # (T, E) the router's softmax
    idx: torch.Tensor     # (T, k) the chosen experts, best first
    gates: torch.Tensor   # (T, k) their weights in the combine
    keep: torch.Tensor    # (T, k) False where the expert was full: the assignment is dropped
    capacity: int


def route(logits, k, capacity_factor):
    """Top-k routing with a capacity per expert of ceil(capacity_factor * T * k / E).

    Each expert takes assignments in order, all first choices before any second choice (GShard's
    priority); those past its capacity are dropped (their slot adds nothing to the output).
    """
    T, E = logits.shape
    probs = logits.softmax(-1)
    top, idx = probs.topk(k, dim=-1)
    gates = top / top.sum(-1, keepdim=True) if k > 1 else top  # top-1 keeps the raw probability
    capacity = math.ceil(capacity_factor * T * k / E)
    order = idx.t().reshape(-1)                                # slot-major: choice 1 of every token first
    position = F.one_hot(order, E).cumsum(0)[torch.arange(T * k), order] - 1
    keep = (position < capacity).view(k, T).t()
    return Routing(probs, idx, gates, keep, capacity)


def load_balancing_loss(logits, idx, num_experts):
    """E * sum_e f_e * P_e: f_e the fraction of assignments sent to expert e, P_e its mean probability.

    1 when the router spreads its tokens evenly, E when it sends all of them to one expert.
    """
    f = torch.bincount(idx.reshape(-1), minlength=num_experts).float() / idx.numel()
    return num_experts * (f * logits.softmax(-1).mean(0)).sum()


def z_loss(logits):
    """ST-MoE's router z-loss: keeps the router's logits small (their log-sum-exp, squared)."""
    return torch.logsumexp(logits, dim=-1).pow(2).mean()


class Expert(nn.Module):
    def __init__(self, dim=DIM, hidden=HIDDEN):
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class MoE(nn.Module):
    """A mixture-of-experts layer in one process; ``stats`` holds the last call's losses and counts."""

    def __init__(self, dim=DIM, hidden=HIDDEN, num_experts=EXPERTS, k=2, capacity_factor=1.25, seed=0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.router = nn.Linear(dim, num_experts, bias=False)
            self.experts = nn.ModuleList(Expert(dim, hidden) for _ in range(num_experts))
        self.k, self.capacity_factor, self.num_experts = k, capacity_factor, num_experts
        self.stats = {}

    def _stats(self, logits, r):
        kept = r.idx[r.keep]
        self.stats = {"aux": load_balancing_loss(logits, r.idx, self.num_experts), "z": z_loss(logits),
                      "dropped": int((~r.keep).sum()),
                      "routed": torch.bincount(r.idx.reshape(-1), minlength=self.num_experts),
                      "per_expert": torch.bincount(kept, minlength=self.num_experts)}

    def forward(self, x):
        logits = self.router(x)
        r = route(logits, self.k, self.capacity_factor)
        self._stats(logits, r)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = ((r.idx == e) & r.keep).nonzero(as_tuple=True)
            # also with no token: every expert stays in the graph (DDP expects a gradient for each)
            y = y.index_add(0, token, r.gates[token, slot, None] * expert(x[token]))
        return y


class AllToAll(torch.autograd.Function):
    """An uneven all-to-all that autograd goes back through: row blocks of ``send`` sizes leave for
    ranks 0, 1, ...; blocks of ``recv`` sizes arrive from them.  Its backward is the same exchange
    with the sizes swapped: each gradient row returns to the rank its token came from."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


def dispatch_combine(x, routing, experts, group=None):
    """Expert parallelism: rank r holds experts r*L .. r*L + L - 1 (L = len(experts)) of E = L * world.

    1. sort the kept assignments by expert; count them per expert;
    2. exchange the counts (every rank learns how many tokens it will receive from each rank);
    3. all-to-all the tokens, uneven splits (``AllToAll``: its backward is the reverse all-to-all);
    4. run the local experts on what arrived, grouped by (source rank, local expert);
    5. all-to-all the outputs back, with the splits reversed;
    6. un-permute (scatter back into token order) and combine with the gate weights.
    """
    world, L = dist.get_world_size(group), len(experts)
    token, slot = routing.keep.nonzero(as_tuple=True)          # the kept assignments
    expert = routing.idx[token, slot]
    order = torch.argsort(expert, stable=True)                 # grouped by expert, hence by rank
    token, slot, expert = token[order], slot[order], expert[order]
    counts = torch.bincount(expert, minlength=L * world)      # per destination expert
    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts, group=group)         # got[s*L + j]: from rank s, for my expert j
    send = counts.view(world, L).sum(1).tolist()
    recv_counts = got.view(world, L)
    recv = recv_counts.sum(1).tolist()
    inbox = AllToAll.apply(x[token], send, recv, group)
    chunks = inbox.split(recv_counts.reshape(-1).tolist())     # (rank 0, expert 0), (rank 0, expert 1), ...
    done = torch.cat([experts[i % L](c) for i, c in enumerate(chunks)])  # also when all are empty
    back = AllToAll.apply(done, recv, send, group)
    weighted = routing.gates[token, slot, None] * back
    return torch.zeros_like(x).index_add(0, token, weighted)  # token ids scatter: the inverse permutation


class EPMoE(MoE):
    """``MoE`` with its experts spread over the ranks of ``group``: this rank keeps its own ``E / world``."""

    def __init__(self, group=None, dispatch=dispatch_combine, **kwargs):
        super().__init__(**kwargs)
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        L = self.num_experts // world
        self.first = rank * L
        self.experts = nn.ModuleList(list(self.experts)[self.first:self.first + L])
        self.group, self.dispatch = group, dispatch

    def forward(self, x):
        logits = self.router(x)
        r = route(logits, self.k, self.capacity_factor)
        self._stats(logits, r)
        return self.dispatch(x, r, self.experts, self.group)


def batch(rank, tokens=24, seed=15):
    """Rank ``rank``'s tokens and targets (every rank can make everyone's)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(tokens, DIM, generator=g), torch.randn(tokens, DIM, generator=g)


def layer_loss(layer, x, y, aux_weight=0.01):
    out = layer(x)
    return F.mse_loss(out, y) + aux_weight * layer.stats["aux"] + 1e-3 * layer.stats["z"], out


def ep_parity(k=2, capacity_factor=1.0):
    """Worker: the EP layer on every rank against the one-process layer run on each rank's tokens.

    The loss of the job is the mean over the ranks of each rank's loss; the router is replicated, so
    its gradient is summed over the ranks (each rank saw its own tokens); each expert's gradient
    arrives complete on the rank that holds it, through the backward of the all-to-alls.
    """
    apply_all()  # WORKAROUND for a torch bug at exit (pytorch/pytorch#56297), not part of the algorithm
    backend, device = backend_and_device()
    dist.init_process_group(**process_group_kwargs(backend, device))
    rank, world = dist.get_rank(), dist.get_world_size()
    kw = dict(k=k, capacity_factor=capacity_factor)
    ep = EPMoE(**kw).to(device)
    x, y = (t.to(device) for t in batch(rank))
    x.requires_grad_(True)
    loss, out = layer_loss(ep, x, y)
    (loss / world).backward()
    dist.all_reduce(ep.router.weight.grad)  # the replicated router: sum of every rank's share
    dropped = torch.tensor([ep.stats["dropped"]], device=device)
    dist.all_reduce(dropped)
    job_loss = loss.detach().clone()
    dist.all_reduce(job_loss)

    ref = MoE(**kw).to(device)  # one process, all experts, each rank's tokens in turn
    total, ref_dropped, ref_x = 0.0, 0, None
    for r in range(world):
        xr, yr = (t.to(device) for t in batch(r))
        xr.requires_grad_(True)
        lr, outr = layer_loss(ref, xr, yr)
        (lr / world).backward()
        total, ref_dropped = total + lr.item(), ref_dropped + ref.stats["dropped"]
        if r == rank:
            ref_x, ref_out = xr, outr
    grads = {"router": (ep.router.weight.grad, ref.router.weight.grad), "input": (x.grad, ref_x.grad)}
    for j, e in enumerate(ep.experts):
        for name, p in e.named_parameters():
            twin = ref.experts[ep.first + j].get_parameter(name)
            grads[f"expert {ep.first + j} {name}"] = (p.grad, twin.grad)
    diffs = {n: (a.cpu() - b.cpu()).abs().max().item() for n, (a, b) in grads.items()}
    diffs["output"] = (out - ref_out).abs().max().item()
    result = {"rank": rank, "diffs": diffs, "loss": (job_loss.item() / world, total / world),
              "dropped": (int(dropped.item()), ref_dropped), "backend": backend}
    dist.destroy_process_group()
    return result
