"""Chapter 14: the lesson's runs of ring attention and Ulysses (``ch14_ring.py``) in worker processes.

Each function runs on every rank of a launch (``launch(equal_to_single_process, nprocs=4)``) and
returns what rank it ran on measured:

- ``equal_to_single_process()``: one attention layer (q/k/v and output projections) trained for one
  step on the sequence split across the ranks, with ring attention (contiguous and zigzag) and with
  Ulysses, against the same layer on the whole sequence in one process: the output, the gradient of
  the input and of the weights (summed over the ranks).
- ``overlap_and_balance(seq)``: ring attention's forward, with each exchange posted before the
  block's compute (overlapped) or after it (blocking), contiguous or zigzag; each rank's compute and
  wait events, and the query-key pairs it scored.
- ``comm_seconds(seqs)``: the communication alone of ring attention (N - 1 exchanges of K and V) and
  of Ulysses (four all-to-alls), timed for each sequence length.
- ``torch_context_parallel()``: torch's own ``context_parallel`` on the same attention, or the error
  it raises.
"""

import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ch14_ring import chunks_of, heads_to_seq, ring_attention, seq_to_heads, ulysses_attention

from course_utils import backend_and_device
from course_utils.devices import process_group_kwargs
from course_utils.workarounds import apply_all

BATCH, HEADS, DIM = 2, 4, 16


def open_group():
    apply_all()  # torch._dynamo imported before the group: see course_utils/workarounds.py
    backend, device = backend_and_device()
    dist.init_process_group(**process_group_kwargs(backend, device))
    return dist.get_rank(), dist.get_world_size(), device


def positions(rank, world, seq, layout):
    """The global positions of the tokens this rank holds."""
    n = len(chunks_of(rank, world, layout))
    size = seq // (n * world)
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks_of(rank, world, layout)])


def attention_layer(x, w_qkv, w_out, attend):
    """x (B, s, E) -> q, k, v (B, H, s, E/H) -> attend -> output projection."""
    b, s, e = x.shape
    q, k, v = (x @ w_qkv.T).view(b, s, 3, HEADS, e // HEADS).permute(2, 0, 3, 1, 4)
    return attend(q, k, v).transpose(1, 2).reshape(b, s, e) @ w_out.T


def sdpa_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def equal_to_single_process(seq=256, width=64):
    rank, world, device = open_group()
    torch.manual_seed(0)
    x = torch.randn(BATCH, seq, width, device=device)
    grad_out = torch.randn(BATCH, seq, width, device=device)
    weights = [torch.randn(3 * width, width, device=device) / width ** 0.5,
               torch.randn(width, width, device=device) / width ** 0.5]
    # the reference: the whole sequence in one process (every rank computes it)
    ref_x, *ref_w = (t.clone().requires_grad_() for t in (x, *weights))
    ref = attention_layer(ref_x, *ref_w, sdpa_causal)
    ref.backward(grad_out)
    results = {}
    runs = {"ring, contiguous": ("contiguous", lambda q, k, v: ring_attention(q, k, v, "contiguous")),
            "ring, zigzag": ("zigzag", lambda q, k, v: ring_attention(q, k, v, "zigzag")),
            "Ulysses": ("contiguous", ulysses_attention)}
    for name, (layout, attend) in runs.items():
        idx = positions(rank, world, seq, layout).to(device)
        xs = x[:, idx].clone().requires_grad_()
        ws = [w.clone().requires_grad_() for w in weights]
        dist.barrier()
        start = time.perf_counter()
        out = attention_layer(xs, *ws, attend)
        out.backward(grad_out[:, idx])
        for w in ws:  # each rank holds the gradient of its own tokens' share of the loss: sum them
            dist.all_reduce(w.grad)
        seconds = time.perf_counter() - start
        results[name] = {
            "out": float((out.detach() - ref.detach()[:, idx]).abs().max()),
            "grad x": float((xs.grad - ref_x.grad[:, idx]).abs().max()),
            "grad weights": max(float((w.grad - r.grad).abs().max()) for w, r in zip(ws, ref_w)),
            "seconds": seconds,
        }
    dist.destroy_process_group()
    return results


def _local_qkv(rank, world, seq, layout, device, dim=DIM, heads=HEADS):
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, heads, seq, dim) for _ in range(3))
    idx = positions(rank, world, seq, layout)
    return [t[:, :, idx].contiguous().to(device) for t in (q, k, v)]


def overlap_and_balance(seq=1536, repeats=3, dim=64):
    """Per configuration, the fastest of ``repeats`` forwards: events, work and step time per rank.

    The configurations take turns within each repeat, after one untimed forward of each, so that
    a change of load on a shared machine touches all of them alike.
    """
    torch.set_num_threads(1)  # the ranks share the machine's cores
    rank, world, device = open_group()
    configs = {"overlapped, contiguous": ("contiguous", True), "blocking, contiguous": ("contiguous", False),
               "overlapped, zigzag": ("zigzag", True)}
    inputs = {lay: _local_qkv(rank, world, seq, lay, device, dim) for lay in ("contiguous", "zigzag")}
    best = {}
    for rep in range(repeats + 1):
        for name, (layout, overlap) in configs.items():
            dist.barrier()
            log = {"t0": time.perf_counter()}
            with torch.no_grad():
                ring_attention(*inputs[layout], layout, overlap, log)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            log["step"] = time.perf_counter() - log["t0"]
            steps = [None] * world
            dist.all_gather_object(steps, log["step"])
            if rep > 0 and (name not in best or max(steps) < best[name]["slowest"]):
                best[name] = {"events": log["events"], "work": log["work"], "step": log["step"],
                              "slowest": max(steps)}
    dist.destroy_process_group()
    return best


def comm_seconds(seqs, repeats=5, dim=DIM):
    """Median seconds of ring attention's exchanges and of Ulysses' all-to-alls, per sequence length."""
    rank, world, device = open_group()
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    out = {}
    for seq in seqs:
        q, k, v = _local_qkv(rank, world, seq, "contiguous", device, dim)
        kv = torch.stack([k, v])

        def ring(kv=kv):
            block = kv
            for _ in range(world - 1):
                got = torch.empty_like(block)
                ops = [dist.P2POp(dist.isend, block, (rank + 1) % world),
                       dist.P2POp(dist.irecv, got, (rank - 1) % world)]
                for r in dist.batch_isend_irecv(ops):
                    r.wait()
                block = got

        def ulysses(q=q, k=k, v=v):
            heads = [seq_to_heads(t) for t in (q, k, v)]  # three all-to-alls in
            back = heads_to_seq(heads[0])  # and one of the output's size back
            return float(back.sum())  # waits for the functional collectives

        times = {"ring": [], "ulysses": []}
        for fn in (ring, ulysses):
            fn()  # warm-up
        for _ in range(repeats):
            for name, fn in (("ring", ring), ("ulysses", ulysses)):
                dist.barrier()
                sync()
                start = time.perf_counter()
                fn()
                sync()
                times[name].append(time.perf_counter() - start)
        out[seq] = {name: statistics.median(t) for name, t in times.items()}
    dist.destroy_process_group()
    return out


def torch_context_parallel(seq=256):
    """torch's context_parallel around SDPA on this rank's device: equal to SDPA, or its error."""
    rank, world, device = open_group()
    from torch.distributed.device_mesh import init_device_mesh  # here: DTensor takes a second to import
    from torch.distributed.tensor.experimental import context_parallel

    torch.manual_seed(0)
    q, k, v = (torch.randn(BATCH, HEADS, seq, DIM, device=device) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mesh = init_device_mesh(device.type, (world,))
    result = {"device": str(device)}
    try:
        qs, ks, vs, refs = (t.clone() for t in (q, k, v, ref))
        with context_parallel(mesh, buffers=[qs, ks, vs, refs], buffer_seq_dims=[2, 2, 2, 2]):
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
            result["max diff"] = float((out - refs).abs().max())  # refs: this rank's shard, as torch cut it
    except Exception as e:  # on CPU: the missing sharding rule, recorded as the result
        result["error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    dist.destroy_process_group()
    return result



class AttentionLayer(torch.nn.Module):
    """q/k/v projection, ``attend`` (ring attention over a group, say), output projection."""

    def __init__(self, width, heads, attend):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.heads, self.attend = heads, attend

    def forward(self, x):
        b, s, e = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, e // self.heads).permute(2, 0, 3, 1, 4)
        return self.out(self.attend(q, k, v).transpose(1, 2).reshape(b, s, e))


def simulate_cp_fsdp(dp=16, cp=4, seq=4096, width=512, heads=8):
    """SIMULATION with torch's fake backend: rank 0 of a dp x cp job, one attention layer's training step.

    The weights are sharded with FSDP2 over all dp * cp ranks (CP ranks hold the same weights, so
    their shards fold into one group); the sequence of ``seq`` tokens is split over the ``cp`` ranks
    of rank 0's CP group, and ring attention passes K and V inside that group.  Returns rank 0's
    parameter bytes, the FSDP2 collectives ``(op, bytes)`` and the ring's exchanges (their peers,
    global ranks) with the bytes of one K/V block.  Nothing is timed: the fake backend moves no data.
    """
    import os

    from torch.distributed.device_mesh import init_device_mesh  # here: a second to import
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    from course_utils.checking import CollectiveSpy

    barrier = os.environ.pop("TORCH_DIST_INIT_BARRIER", None)  # the other ranks do not exist
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dp * cp)
    try:
        cp_group = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp")).get_group("cp")
        fsdp_mesh = init_device_mesh("cpu", (dp * cp,))
        torch.manual_seed(0)
        model = AttentionLayer(width, heads, lambda q, k, v: ring_attention(q, k, v, group=cp_group))
        fully_shard(model.qkv, mesh=fsdp_mesh)
        fully_shard(model.out, mesh=fsdp_mesh)
        fully_shard(model, mesh=fsdp_mesh)
        x = torch.randn(1, seq // cp, width)  # this rank's slice of the sequence
        with CollectiveSpy(("all_gather_single", "reduce_scatter_single", "batch_isend_irecv")) as spy, \
                warnings.catch_warnings():
            # FSDP2 warns that a Linear on a 3-d input returns a view; no in-place op follows here
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
            model(x).square().mean().backward()
        calls = [("ring", [peer for _, peer in c.extra["p2p"]]) if c.op == "batch_isend_irecv"
                 else (c.op, c.nbytes) for c in spy.calls]
        return {"params": sum(p.to_local().numel() * p.element_size() for p in model.parameters()),
                "unsharded": sum(p.numel() * p.element_size() for p in model.parameters()),
                "calls": calls, "kv_block": 2 * (seq // cp) * width * 4,
                "cp_ranks": dist.get_process_group_ranks(cp_group)}
    finally:
        dist.destroy_process_group()
        if barrier is not None:
            os.environ["TORCH_DIST_INIT_BARRIER"] = barrier
