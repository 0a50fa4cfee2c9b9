"""Chapter 15: what expert parallelism's all-to-alls cost, and what a skewed router does to a step.

Workers import this file (``from ch15_cost import ep_cost``); it needs 2 ranks.

``ep_cost(tokens, rounds)``:
1. times ``all_to_all_single`` of float32 tensors of several sizes (even splits) and fits chapter
   03's alpha-beta line t = alpha + S / beta, S the bytes that leave each rank (the fastest of
   ``rounds`` rounds of each size, as for the replays below);
2. runs one EP layer (top-2, 8 experts, 4 per rank) forward and backward with the router as it
   is (balanced) and with a router that sends every token to rank 0's experts (skewed), the
   capacity large enough that nothing is dropped: step time (the slowest rank's), the processor
   time each rank spends in its experts' forward and in the whole step (the thread that runs
   forward and backward; gloo's own threads not counted), and the rows its token all-to-alls send;
   (On a GPU the processor time counts only the kernel launches: read the wall-clock step there.)
3. replays those four exchanges with the same split sizes, timed, beside the fit's prediction
   (an exchange lasts about alpha + (the larger of the bytes out and the bytes in) / beta).
"""

import gc
import statistics
import time

import torch
import torch.distributed as dist
from ch15_moe import EPMoE

from course_utils import backend_and_device
from course_utils.devices import process_group_kwargs
from course_utils.measure.ch10 import fit_alpha_beta
from course_utils.workarounds import apply_all

DIM, HIDDEN = 64, 2048
FIT_ROWS = [256, 1024, 4096, 16384]  # 32 KiB to 2 MiB leaving a rank: around one layer's


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest(seconds, device):
    t = torch.tensor(seconds, dtype=torch.float64, device=device)  # on the GPU with NCCL
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a collective ends when its slowest rank does
    return t.tolist()


def _time_exchange(rows_out, rows_in, device, calls=3):
    x = torch.randn(sum(rows_out), DIM, device=device)
    out = torch.empty(sum(rows_in), DIM, device=device)
    dist.all_to_all_single(out, x, rows_in, rows_out)  # warm-up
    dist.barrier()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        dist.all_to_all_single(out, x, rows_in, rows_out)
    _sync(device)
    return (time.perf_counter() - t0) / calls


class _Timed(torch.nn.Module):
    """An expert wrapped so that the processor time spent in it is added up (forward only).

    ``time.thread_time``: the seconds this thread computed, not counting the time it waited for a
    core (on a machine shared with other work the wall clock mostly measures the waiting)."""

    def __init__(self, inner, clock):
        super().__init__()
        self.inner, self.clock = inner, clock

    def forward(self, x):
        t0 = time.thread_time()
        y = self.inner(x)
        self.clock[0] += time.thread_time() - t0
        return y


def ep_cost(tokens=1024, rounds=7):
    apply_all()  # WORKAROUND for a torch bug at exit (pytorch/pytorch#56297), not part of the algorithm
    backend, device = backend_and_device()
    dist.init_process_group(**process_group_kwargs(backend, device))
    rank, world = dist.get_rank(), dist.get_world_size()
    other = 1 - rank

    # 1. the alpha-beta fit: even splits, half of each tensor leaves the rank
    fit = {r: [] for r in FIT_ROWS}
    for _ in range(rounds):
        for r in FIT_ROWS:
            fit[r].append(_time_exchange([r // 2, r // 2], [r // 2, r // 2], device))
    leaving = [r // 2 * DIM * 4 for r in FIT_ROWS]
    # the fastest round: on a machine shared with other work, waiting for a core only adds time
    med = _slowest([min(fit[r]) for r in FIT_ROWS], device)
    alpha, beta = fit_alpha_beta(leaving, med, world=2)  # ring_factor(2) = 1: the line t = alpha + S / beta

    # 2. one EP layer, balanced and skewed router; nothing dropped (capacity = every token)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(tokens, DIM, generator=g).to(device)
    x[:, 0] = 1.0  # a constant feature, so that one column of the router's weights acts as a bias
    layers = {}
    for label in ("balanced", "skewed"):
        clock = [0.0]
        layer = EPMoE(dim=DIM, hidden=HIDDEN, k=2, capacity_factor=4.0, seed=3).to(device)
        layer.experts = torch.nn.ModuleList(_Timed(e, clock) for e in layer.experts)
        with torch.no_grad():
            layer.router.weight[:, 0] = 0.0
            if label == "skewed":
                layer.router.weight[4:, 0] = -20.0  # experts 4-7 (rank 1's) never win
        layers[label] = (layer, clock)
    steps = {lab: [] for lab in layers}
    expert_s = {lab: [] for lab in layers}
    cpu_s = {lab: [] for lab in layers}
    sent_rows = {}
    for _ in range(rounds):
        for label, (layer, clock) in layers.items():  # in turn, so that a change of load hits both
            layer.zero_grad()
            clock[0] = 0.0
            dist.barrier()
            _sync(device)
            t0, c0 = time.perf_counter(), time.thread_time()
            layer(x).square().mean().backward()
            _sync(device)
            steps[label].append(time.perf_counter() - t0)
            cpu_s[label].append(time.thread_time() - c0)
            expert_s[label].append(clock[0])
            counts = layer.stats["per_expert"].view(world, -1).sum(1)
            sent_rows[label] = int(counts[other])
    step_med = {lab: _slowest([statistics.median(v)], device)[0] for lab, v in steps.items()}
    expert_med = {lab: statistics.median(v) for lab, v in expert_s.items()}
    cpu_med = {lab: statistics.median(v) for lab, v in cpu_s.items()}
    both = torch.tensor([[expert_med["balanced"], expert_med["skewed"]],
                         [cpu_med["balanced"], cpu_med["skewed"]]], dtype=torch.float64, device=device)
    everyone = [torch.zeros_like(both) for _ in range(world)]
    dist.all_gather(everyone, both)

    # 3. the same four exchanges replayed: rows out to the other rank, rows in from it
    out_rows = torch.tensor([sent_rows["balanced"], sent_rows["skewed"]], device=device)
    peer = [torch.zeros_like(out_rows) for _ in range(world)]
    dist.all_gather(peer, out_rows)
    replay = {}
    for i, label in enumerate(("balanced", "skewed")):
        mine, theirs = int(out_rows[i]), int(peer[other][i])
        send, recv = [0, 0], [0, 0]
        send[other], recv[other] = mine, theirs
        # forward: tokens out (mine), outputs back (theirs); backward: the same two, reversed
        there = _slowest([min(_time_exchange(send, recv, device) for _ in range(rounds))], device)[0]
        back = _slowest([min(_time_exchange(recv, send, device) for _ in range(rounds))], device)[0]
        # both directions at once: an exchange lasts as long as its larger direction
        pred = 4 * (alpha + max(mine, theirs) * DIM * 4 / beta)
        replay[label] = {"measured_s": 2 * (there + back), "predicted_s": pred,
                         "bytes_out": 2 * (mine + theirs) * DIM * 4, "rows_out": mine, "rows_in": theirs}
    result = {"alpha": alpha, "beta": beta, "fit": list(zip(leaving, med)), "step_s": step_med,
              "expert_s": [e[0].tolist() for e in everyone],
              "step_cpu_s": [e[1].tolist() for e in everyone], "replay": replay, "backend": backend,
              "tokens": tokens}
    gc.collect()
    dist.destroy_process_group()
    return result if rank == 0 else None
