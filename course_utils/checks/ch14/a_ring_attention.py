"""14.a Causal ring attention, forward: ``check_ring_attention(ring_attention)``.

The learner writes, for every rank of the default group::

    ring_attention(q, k, v) -> out

``q``, ``k``, ``v`` are this rank's contiguous slice of the sequence, ``(batch, heads, S / N, head
dim)``: rank r holds positions r·S/N ... (r + 1)·S/N − 1.  ``out`` is the causal attention of these
queries over the whole sequence's keys, as ``F.scaled_dot_product_attention(..., is_causal=True)``
on the whole sequence would give for these rows.  K and V blocks must travel around the ring.

The checker runs it on 2 and on 4 ranks.  It compares ``out`` with SDPA, and, when it differs,
with what each known mistake computes (simulated in one process from the same tensors), to name
it.  ``CollectiveSpy`` records every ``torch.distributed`` call and ``FunctionalCalls`` the
functional ones: only point-to-point messages between ring neighbours are allowed, all sent to one
neighbour and received from the other, N − 1 exchanges of K and V (one message each or one for
both).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...checking import (
    Catalogue,
    CollectiveSpy,
    Misconception,
    Outcome,
    checker,
    judge,
    process_group,
    require_callable,
    run_workers,
)
from ...checking.spy import COLLECTIVES
from .watch import FunctionalCalls

__all__ = ["CATALOGUE", "check_ring_attention", "attention_plan", "simulate"]

CATALOGUE = Catalogue(
    "14.a ring attention",
    Misconception(
        "no_rescale",
        "each block's softmax can be computed on its own and the results added up",
        "the output equals the sum of per-block softmax results, not rescaled to a common maximum",
        "partial softmaxes were combined without rescaling: each block's exponentials were taken "
        "against that block's own maximum (or normalised by that block's own sum). Keep a running "
        "maximum m and sum l per row; when a block raises the maximum, multiply the accumulated "
        "output and l by exp(m_old - m_new) before adding the block (or merge log-sum-exps)",
    ),
    Misconception(
        "local_positions",
        "the causal mask inside a block is the same lower triangle as for one sequence",
        "every block, also those of later ranks, attended with the local lower-triangular mask",
        "the causal mask was built from local positions (0 ... S/N - 1 on every block): a key is "
        "visible when its GLOBAL position src*S/N + j is at most the query's rank*S/N + i. Blocks "
        "of later ranks are entirely in the future and must be skipped",
    ),
    Misconception(
        "diagonal_every_block",
        "every block needs the triangular mask",
        "earlier ranks' blocks attended with the lower triangle instead of in full",
        "the diagonal (triangular) mask belongs only to the rank's own block; a block of an "
        "earlier rank lies wholly in the past and is attended in full, a later rank's wholly in "
        "the future and skipped",
    ),
    Misconception(
        "missing_scale",
        "the scores are q @ k^T",
        "the output equals causal attention with the scores not divided by sqrt(head dim)",
        "the scores must be scaled by 1/sqrt(head dim) (q.shape[-1] ** -0.5), as SDPA does",
    ),
    Misconception(
        "wrong_direction",
        "the block received at step i is rank r + i's",
        "the output equals attention with each block's mask taken for rank r + i while its data "
        "came from rank r - i",
        "the blocks were labelled as coming from the wrong side of the ring: when every rank sends "
        "to rank + 1 and receives from rank - 1, the block held at step i is rank (r - i) % N's, "
        "and its positions (and whether it is masked) are that rank's",
    ),
    Misconception(
        "kv_all_gathered",
        "gather all of K and V on every rank, then attend as usual",
        "a collective other than point-to-point messages between neighbours (all_gather, "
        "broadcast, ...), or messages to ranks that are not neighbours",
        "K and V were gathered in full on each rank: the values come out right but every rank "
        "then holds the whole sequence's K and V, which is the memory context parallelism exists "
        "to split. Pass one block at a time to the next rank of the ring (send to rank + 1, "
        "receive from rank - 1), N - 1 times",
    ),
    Misconception(
        "deadlock",
        "every rank receives the next block, then sends its own",
        "every rank waits in a blocking recv that no rank will ever answer",
        "every rank waited in recv() before any rank had sent: a blocking receive returns only "
        "when the peer's send arrives. Post both at once with dist.batch_isend_irecv (or "
        "isend/irecv and wait on both), or let even ranks send first and odd ranks receive first",
    ),
)

BATCH, HEADS, LOCAL_S, HEAD_DIM = 2, 4, 16, 16
WORLDS = (2, 4)
TIMEOUT = 25.0  # seconds: a right answer takes well under one; a deadlock fails in this time
ATOL = 1e-4
P2P = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
_HARMLESS = ("barrier", "monitored_barrier")  # they move no K or V
_KIND = {"send": "sent", "isend": "sent", "recv": "received", "irecv": "received"}


def _tensors(world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(14)
        shape = (BATCH, HEADS, LOCAL_S * world, HEAD_DIM)
        return tuple(torch.randn(shape) * 2 for _ in range(3))  # * 2: softmax maxima matter


def attention_plan(rank: int, world: int, mistake: str = "") -> list[tuple[int, str]]:
    """The (K/V block, mask) pairs rank ``rank`` attends over: right, or as ``mistake`` would."""
    def kind(label: int) -> str:
        return "full" if label < rank else ("diagonal" if label == rank else "skip")

    arrivals = [(rank - i) % world for i in range(world)]  # the ring's order: own block first
    if mistake == "local_positions":
        plan = [(b, "diagonal") for b in arrivals]
    elif mistake == "diagonal_every_block":
        plan = [(b, "diagonal") for b in arrivals if b <= rank]
    elif mistake == "wrong_direction":  # data from rank - i, mask as if from rank + i
        plan = [(b, kind((rank + i) % world)) for i, b in enumerate(arrivals)]
    else:
        plan = [(b, kind(b)) for b in arrivals]
    return [(b, m) for b, m in plan if m != "skip"]


def simulate(q, k, v, rank, world, mistake: str = "") -> torch.Tensor:
    """Rank ``rank``'s output of ring attention, right (``mistake=""``) or with a known mistake."""
    n = q.shape[2] // world
    qr = q[:, :, rank * n:(rank + 1) * n]
    scale = 1.0 if mistake == "missing_scale" else q.shape[-1] ** -0.5
    scores, values = [], []
    for b, mask in attention_plan(rank, world, mistake):
        s = qr @ k[:, :, b * n:(b + 1) * n].transpose(-2, -1) * scale
        if mask == "diagonal":
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        scores.append(s)
        values.append(v[:, :, b * n:(b + 1) * n])
    if mistake == "no_rescale_normalised":  # each block's softmax output, added up
        return sum(torch.softmax(s, -1) @ x for s, x in zip(scores, values))
    if mistake == "no_rescale":  # exponentials against each block's own maximum, summed
        exps = [torch.exp(s - s.amax(-1, keepdim=True)) for s in scores]
        return sum(e @ x for e, x in zip(exps, values)) / sum(e.sum(-1, keepdim=True) for e in exps)
    if mistake == "no_rescale_running":  # a running maximum, but what was summed before is not rescaled
        m = torch.full(scores[0].shape[:-1] + (1,), float("-inf"))
        acc, total = 0.0, 0.0
        for s, x in zip(scores, values):
            m = torch.maximum(m, s.amax(-1, keepdim=True))
            acc, total = acc + torch.exp(s - m) @ x, total + torch.exp(s - m).sum(-1, keepdim=True)
        return acc / total
    return torch.softmax(torch.cat(scores, -1), -1) @ torch.cat(values, -2)


def _messages(calls, rank: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in calls:
        ops = c.extra.get("p2p", []) if c.op == "batch_isend_irecv" else [(c.op, c.peer)]
        for op, peer in ops:
            key = f"{_KIND[op]} {'to' if _KIND[op] == 'sent' else 'from'} {peer}"
            out[key] = out.get(key, 0) + 1
    return out


def _judge_traffic(rank: int, world: int, spy: CollectiveSpy, functional: list) -> str:
    others = {c.op for c in spy.calls if c.op not in P2P + _HARMLESS} | {name for name, _ in functional}
    others = sorted(others)
    if others:
        return (f"your code called {', '.join(others)}. {CATALOGUE.hint('kv_all_gathered')}.")
    messages = _messages([c for c in spy.calls if c.op in P2P], rank)
    left, right = (rank - 1) % world, (rank + 1) % world
    # a peer the spy could not read (passed as group_dst=...) is left out of this check
    peers = {int(key.rsplit(" ", 1)[1]) for key in messages if not key.endswith("None")}
    if peers - {left, right}:
        return (f"rank {rank} exchanged messages with: {_shown(messages)}; in a ring a rank talks "
                f"only to its neighbours {left} and {right}. {CATALOGUE.hint('kv_all_gathered')}.")
    sent = {k: n for k, n in messages.items() if k.startswith("sent")}
    got = {k: n for k, n in messages.items() if k.startswith("received")}
    ways = ({f"sent to {right}", f"received from {left}"}, {f"sent to {left}", f"received from {right}"})
    if world > 2 and set(sent) | set(got) not in ways:
        return (f"rank {rank}'s messages were: {_shown(messages)}. A ring passes blocks one way: "
                f"send every block to one neighbour and receive from the other.")
    n_sent, n_got = sum(sent.values()), sum(got.values())
    allowed = (world - 1, 2 * (world - 1))
    if n_sent not in allowed or n_got != n_sent:
        return (f"rank {rank} sent {n_sent} and received {n_got} message(s) on {world} ranks; "
                f"expected {world - 1} exchanges of K and V (one message for both, or one each: "
                f"{allowed[0]} or {allowed[1]} messages each way). After N - 1 exchanges every "
                f"rank has seen every block; an N-th brings its own block back for nothing.")
    return ""


def _shown(counts: dict[str, int]) -> str:
    return ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "none"


def _judge_output(rank: int, world: int, out, q, k, v) -> str:
    where = f"on {world} ranks, rank {rank}"
    n = LOCAL_S
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, :, rank * n:(rank + 1) * n]
    if not isinstance(out, torch.Tensor):
        return f"{where}: ring_attention returned {type(out).__name__}; expected a tensor (no return?)."
    if tuple(out.shape) != tuple(want.shape):
        return (f"{where}: the output has shape {tuple(out.shape)}; expected {tuple(want.shape)}, the "
                f"shape of this rank's queries.")
    out = out.detach().cpu().double()
    diff = float((out - want.double()).abs().max())
    if diff <= ATOL:
        return ""
    for key, variants in (("no_rescale", ("no_rescale", "no_rescale_running", "no_rescale_normalised")),
                          # on the last rank both mask mistakes agree: the narrower one first
                          ("diagonal_every_block", ("diagonal_every_block",)),
                          ("local_positions", ("local_positions",)),
                          ("missing_scale", ("missing_scale",)),
                          ("wrong_direction", ("wrong_direction",))):
        for name in variants:
            guess = simulate(q, k, v, rank, world, name).double()
            if float((guess - want.double()).abs().max()) > ATOL and float((out - guess).abs().max()) <= ATOL:
                return (f"{where}: the output differs from causal SDPA on the whole sequence by up to "
                        f"{diff:.3g}. Usual mistake: {CATALOGUE.hint(key)}.")
    return (f"{where}: the output differs from causal SDPA on the whole sequence by up to {diff:.3g} "
            f"(rows {rank * n} to {(rank + 1) * n - 1} of the sequence). Check the running maximum and "
            f"sum, the 1/sqrt(d) scale, and which rank's block (global positions) you hold at each step.")


def _worker(learner_fn) -> Outcome:
    with process_group() as pg:
        rank, world = pg.rank, pg.world
        q, k, v = _tensors(world)
        n = LOCAL_S
        local = [t[:, :, rank * n:(rank + 1) * n].clone().to(pg.device) for t in (q, k, v)]
        functional = FunctionalCalls()
        with CollectiveSpy(COLLECTIVES) as spy, functional:
            out = learner_fn(*local)
        problem = (_judge_traffic(rank, world, spy, functional.calls)
                   or _judge_output(rank, world, out, q, k, v))
        return Outcome(rank, problem=problem)


@checker("14.a ring attention")
def check_ring_attention(ring_attention, *, worlds=WORLDS, timeout: float = TIMEOUT) -> None:
    """Run ``ring_attention`` on 2 and 4 ranks; see the module docstring for what is watched."""
    require_callable(ring_attention, "ring_attention(q, k, v)")
    for world in worlds:
        judge(run_workers(_worker, world, args=(ring_attention,), timeout=timeout,
                          hang_hint=CATALOGUE.hint("deadlock")), world=world)
    print(f"ring attention equal to causal SDPA on {' and '.join(map(str, worlds))} ranks, "
          f"only neighbours exchanged K/V, N - 1 times")
