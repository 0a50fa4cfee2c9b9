"""15.a: expert parallelism's dispatch and combine, ``dispatch_combine(x, routing, experts, group)``.

Rank r of ``group`` holds experts ``r*L .. r*L + L - 1`` (``experts``, an ``nn.ModuleList`` of L), out of
``E = L * world``.  ``routing`` holds ``idx`` (T, k: the chosen experts), ``gates`` (T, k: their
weights, part of the router's graph) and ``keep`` (T, k: False where the expert was full). The
function returns, for this rank's T tokens, sum over kept slots of ``gate * expert(token)``, with
autograd through both exchanges.

``check_dispatch_combine(dispatch_combine)`` runs it on 2 and on 4 ranks for top-1 and top-2 routings
with tokens dropped, each rank with its own tokens, and compares the outputs and every gradient (the
replicated router's, summed over the ranks; each local expert's; the input's) with a one-process
layer computed densely (every expert on every token, masked), which shares no code with a dispatch.
``CollectiveSpy`` watches every collective: the all-to-alls (integer counts, float tokens, forward and
backward, rows received) and anything else.  A first probe, with experts that return their input and
all gates 1, must return the input itself: a permutation of its rows means the order was not undone.

The misconceptions it recognises are ``CATALOGUE`` below (each key names the wrong function in
tests/checkers/test_ch15_checks.py).
"""

from __future__ import annotations

import math
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...checking import (
    Catalogue,
    CheckFailed,
    CollectiveSpy,
    Misconception,
    Outcome,
    checker,
    format_table,
    judge,
    process_group,
    require_callable,
    run_workers,
)
from ...checking.spy import COLLECTIVES
from ...workers.errors import FailureKind, RankFailure

__all__ = ["CATALOGUE", "Routing", "check_dispatch_combine", "route"]

DIM, HIDDEN, EXPERTS, TOKENS, ATOL = 8, 16, 8, 24, 1e-5
CASES = ((1, 1.0), (2, 1.0))  # (k, capacity factor): both drop some assignments at these sizes

CATALOGUE = Catalogue(
    "15.a dispatch and combine",
    Misconception(
        "fixed_buffers", "every rank receives as many tokens as it sends, so no counts are needed",
        "no collective on integer counts before the tokens' all-to-all, and then an error or wrong outputs",
        "the tokens were exchanged without first exchanging the counts: a rank cannot know how many "
        "tokens each peer sends it (the router decides, differently on every rank). Exchange the "
        "per-expert counts with dist.all_to_all_single on an integer tensor first, and use them as "
        "output_split_sizes (or pad every destination to a fixed capacity and send that)"),
    Misconception(
        "no_gates", "the expert's output is the token's new value",
        "the outputs equal the kept experts' outputs summed without the gate weights",
        "the outputs were combined without the gate weights: y = sum over kept slots of "
        "gate * expert(x); without the gates the router gets no gradient and top-2 adds two full outputs"),
    Misconception(
        "not_unpermuted", "the outputs come back in the order of the tokens",
        "with experts that return their input and gates 1, the output is the input's rows in another order",
        "the tokens came back in the wrong order: they were sorted by expert before the all-to-all, and "
        "the returning outputs are in that sorted order. Scatter them back to their tokens (index_add_ "
        "with the sorted token ids, or out[order] = back), i.e. invert the permutation"),
    Misconception(
        "reduces_expert_grads", "every gradient must be all-reduced, as in DDP",
        "expert gradients all-reduced in backward, and different from the one-process layer's",
        "the experts' gradients were all-reduced across the expert-parallel group: each rank holds "
        "different experts, so this adds expert 0's gradient to expert 2's. An expert's gradient is "
        "already complete on its rank (the backward of the all-to-all brought every rank's share); only "
        "copies of the same expert (data parallelism) are reduced together"),
    Misconception(
        "sends_dropped", "capacity is only a buffer size; every choice is still computed",
        "the outputs equal the layer's with no assignment dropped",
        "dropped assignments were still sent and counted: routing.keep is False where the expert was "
        "full; those slots must not be sent and add nothing to the output"),
    Misconception(
        "first_choice_only", "a token goes to one rank, its best expert's",
        "with k = 2 the outputs equal those of the first choice alone",
        "with k = 2 each token was sent once, to its first choice only: a token goes to each of its k "
        "experts (possibly on two different ranks), and the k weighted outputs are added"),
)
_hint = CATALOGUE.hint


@dataclass
class Routing:
    """What the router decided for T tokens (see the module docstring)."""

    probs: torch.Tensor
    idx: torch.Tensor
    gates: torch.Tensor
    keep: torch.Tensor
    capacity: int


def route(logits: torch.Tensor, k: int, capacity_factor: float) -> Routing:
    """Top-k routing, capacity ceil(cf * T * k / E) per expert, first choices served first."""
    T, E = logits.shape
    probs = logits.softmax(-1)
    top, idx = probs.topk(k, dim=-1)
    gates = top / top.sum(-1, keepdim=True) if k > 1 else top
    capacity = math.ceil(capacity_factor * T * k / E)
    seen = torch.zeros(E, dtype=torch.long)
    keep = torch.zeros(T, k, dtype=torch.bool)
    for j in range(k):  # written as a loop on purpose: another route to the same drops as the lesson's
        for t in range(T):
            e = int(idx[t, j])
            keep[t, j] = bool(seen[e] < capacity)
            seen[e] += 1
    return Routing(probs, idx, gates, keep, capacity)


def _routing(logits: torch.Tensor, k: int, cf: float) -> Routing:
    """``route`` on the logits' values, with gates that are part of the router's graph."""
    r = route(logits.detach().cpu(), k, cf)
    idx, keep = r.idx.to(logits.device), r.keep.to(logits.device)
    top = logits.softmax(-1).gather(1, idx)
    gates = top / top.sum(-1, keepdim=True) if k > 1 else top
    return Routing(logits.softmax(-1), idx, gates, keep, r.capacity)


def _build(seed: int = 15) -> tuple[nn.Linear, nn.ModuleList]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        router = nn.Linear(DIM, EXPERTS, bias=False)
        experts = nn.ModuleList(nn.Sequential(nn.Linear(DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, DIM))
                                for _ in range(EXPERTS))
    return router, experts


def _data(rank: int, case: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1500 + 10 * case + rank)
    return torch.randn(TOKENS, DIM, generator=g), torch.randn(TOKENS, DIM, generator=g)


def dense(x: torch.Tensor, r: Routing, experts: nn.ModuleList, *, gates: bool = True,
          keep: torch.Tensor | None = None) -> torch.Tensor:
    """The layer computed densely: every expert on every token, weighted by its kept gates."""
    keep = r.keep if keep is None else keep
    g = r.gates if gates else torch.ones_like(r.gates)
    y = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        w = (g * ((r.idx == e) & keep)).sum(1, keepdim=True)
        y = y + w * expert(x)
    return y


def _calls(spy: CollectiveSpy) -> list[dict]:
    return [{"op": c.op, "float": c.tensor is not None and c.tensor.is_floating_point(),
             "rows": c.shape[0] if c.shape else 0, "shape": c.shape, "backward": c.in_backward}
            for c in spy.calls]


def _counts_exchanged(calls: list[dict]) -> bool:
    """A collective on an integer tensor came before the first one on floats (the tokens)."""
    for c in calls:
        if c["float"]:
            return False
        if c["op"] != "barrier":
            return True
    return False


def _tokens_without_counts(calls: list[dict]) -> bool:
    """Tokens (floats) were exchanged, and no counts before them."""
    return any(c["float"] for c in calls) and not _counts_exchanged(calls)


class _NoCounts(RuntimeError):
    """The learner's exchange failed, and no counts had been exchanged before it."""


def _probe(fn: Callable, rank: int, world: int, device: torch.device) -> dict:
    """Identity experts, all gates 1, nothing dropped, top-1: the output must be the input."""
    L = EXPERTS // world
    g = torch.Generator().manual_seed(77 + rank)
    x = torch.randn(TOKENS, DIM, generator=g).to(device)
    idx = torch.randint(0, EXPERTS, (TOKENS, 1), generator=g).to(device)
    r = Routing(torch.full((TOKENS, EXPERTS), 1 / EXPERTS, device=device), idx,
                torch.ones(TOKENS, 1, device=device), torch.ones(TOKENS, 1, dtype=torch.bool, device=device),
                TOKENS)
    experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(L)).to(device)
    with torch.no_grad():
        for e in experts:
            e.weight.copy_(torch.eye(DIM))
            e.bias.zero_()
    with CollectiveSpy(COLLECTIVES) as spy:
        try:
            y = fn(x, r, experts, None)
        except NotImplementedError:
            raise
        except Exception as e:
            if _tokens_without_counts(_calls(spy)):
                raise _NoCounts(f"{type(e).__name__}: {e}") from e
            raise
    y = y.detach()
    if y.shape != x.shape:
        return {"identity": False, "permuted": False, "shape": tuple(y.shape)}
    same = torch.allclose(y, x, atol=ATOL)
    match = torch.cdist(y.cpu(), x.cpu()).min(1).values.max().item() < 1e-4
    return {"identity": same, "permuted": (not same) and match, "shape": tuple(y.shape),
            "counts": _counts_exchanged(_calls(spy))}


def _worker(fn: Any) -> Outcome:
    with process_group() as pg:
        rank, world, dev = pg.rank, pg.world, pg.device
        L = EXPERTS // world
        first = rank * L
        data: dict[str, Any] = {"probe": _probe(fn, rank, world, dev), "cases": []}
        if not data["probe"]["identity"]:
            return Outcome(rank, data=data)
        for case, (k, cf) in enumerate(CASES):
            router, experts = _build()
            router, experts = router.to(dev), experts.to(dev)
            local = nn.ModuleList(list(experts)[first:first + L])
            x, w = (t.to(dev) for t in _data(rank, case))
            x.requires_grad_(True)
            r = _routing(router(x), k, cf)
            with CollectiveSpy(COLLECTIVES) as spy:
                try:
                    y = fn(x, r, local, None)
                except NotImplementedError:
                    raise
                except Exception as e:
                    if _tokens_without_counts(_calls(spy)):
                        raise _NoCounts(f"{type(e).__name__}: {e}") from e
                    raise
                if not isinstance(y, torch.Tensor) or y.shape != x.shape:
                    raise CheckFailed(f"dispatch_combine returned {type(y).__name__} "
                                      f"{tuple(getattr(y, 'shape', ()))}, expected a tensor of the input's "
                                      f"shape {tuple(x.shape)}")
                spy.phase = "backward"
                (y * w).sum().backward()
                if router.weight.grad is None:  # no gate used: the router is not in the graph
                    router.weight.grad = torch.zeros_like(router.weight)
                with spy.paused():
                    dist.all_reduce(router.weight.grad)  # the replicated router: every rank's share
                calls = _calls(spy)
            # the reference: one process, all experts, every rank's tokens in turn
            ref_router, ref_experts = _build()
            ref_router, ref_experts = ref_router.to(dev), ref_experts.to(dev)
            for s in range(world):
                xs, ws = (t.to(dev) for t in _data(s, case))
                xs.requires_grad_(True)
                rs = _routing(ref_router(xs), k, cf)
                ys = dense(xs, rs, ref_experts)
                (ys * ws).sum().backward()
                if s == rank:
                    ref_x, ref_y, ref_r = xs, ys, rs
            with torch.no_grad():
                alt = {"no_gates": dense(ref_x, ref_r, ref_experts, gates=False),
                       "sends_dropped": dense(ref_x, ref_r, ref_experts, keep=torch.ones_like(ref_r.keep))}
                if k > 1:
                    one = ref_r.keep.clone()
                    one[:, 1:] = False
                    alt["first_choice_only"] = dense(ref_x, ref_r, ref_experts, keep=one)
                    alt["first_choice_only_1"] = dense(ref_x, ref_r, ref_experts, keep=one, gates=False)
            got = {"output": y.detach(), "input grad": x.grad, "router grad": router.weight.grad}
            want = {"output": ref_y.detach(), "input grad": ref_x.grad, "router grad": ref_router.weight.grad}
            for j in range(L):
                for name, p in local[j].named_parameters():
                    got[f"expert {first + j} {name} grad"] = p.grad
                    want[f"expert {first + j} {name} grad"] = ref_experts[first + j].get_parameter(name).grad
            rows = []
            for name, want_t in want.items():
                got_t = got[name]
                a = torch.zeros_like(want_t) if want_t is None else want_t
                b = torch.zeros_like(a) if got_t is None else got_t
                d = (a.detach().cpu() - b.detach().cpu()).abs().max().item() if a.numel() else 0.0
                rows.append((name, d, d == 0.0))
            alike = [key for key, v in alt.items() if torch.allclose(y.detach(), v, atol=ATOL)]
            expert_shapes = {tuple(p.shape) for p in local.parameters()}
            data["cases"].append({"k": k, "cf": cf, "rows": rows, "alike": alike, "calls": calls,
                                  "expert_reduce": any(c["backward"] and "all_to_all" not in c["op"]
                                                       and c["shape"] in expert_shapes for c in calls),
                                  "dropped": int((~r.keep).sum()), "expected_rows": int(r.keep.sum())})
        return Outcome(rank, data=data)


def _explain(f: RankFailure) -> str | None:
    if f.exc_type.endswith("_NoCounts"):
        return (f"rank {f.rank}: the exchange of tokens failed ({f.message}), and no counts had been "
                f"exchanged before it. {_hint('fixed_buffers')}.")
    if f.kind is FailureKind.SIGNAL and f.exitcode is not None and abs(f.exitcode) == signal.SIGABRT:
        # gloo aborts the process (no exception) when a peer sends a size other than the one expected
        return (f"rank {f.rank} was killed by SIGABRT: gloo aborts a process whose all-to-all receives "
                f"a size other than the one it allocated. {_hint('fixed_buffers')}.")
    return None


def _judge_case(rank: int, c: dict) -> None:
    where = f"rank {rank}, top-{c['k']} with capacity factor {c['cf']} ({c['dropped']} assignments dropped)"
    table = format_table(c["rows"], ATOL)
    out_bad = dict((n, d) for n, d, _ in c["rows"])["output"] > ATOL
    if out_bad:
        for key in ("first_choice_only", "no_gates", "sends_dropped"):
            if key in c["alike"] or (key == "first_choice_only" and "first_choice_only_1" in c["alike"]):
                raise CheckFailed(f"{where}: the outputs differ from the one-process layer's:\n{table}\n"
                                  f"{_hint(key)}.")
        if not _counts_exchanged(c["calls"]):
            raise CheckFailed(f"{where}: the outputs differ from the one-process layer's:\n{table}\n"
                              f"{_hint('fixed_buffers')}.")
        raise CheckFailed(f"{where}: the outputs differ from the one-process layer's:\n{table}")
    if any(d > ATOL for _, d, _ in c["rows"]):
        if c["expert_reduce"]:
            raise CheckFailed(f"{where}: the outputs are right but the gradients differ:\n{table}\n"
                              f"{_hint('reduces_expert_grads')}.")
        raise CheckFailed(f"{where}: the outputs are right but the gradients differ from the one-process "
                          f"layer's (the autograd graph must go through both all-to-alls: "
                          f"torch.distributed.nn.functional.all_to_all_single or an autograd.Function "
                          f"whose backward sends the gradients back with the splits swapped):\n{table}")


@checker("15.a dispatch and combine")
def check_dispatch_combine(dispatch_combine: Callable, *, worlds: tuple[int, ...] = (2, 4),
                           timeout: float = 90.0) -> None:
    """``dispatch_combine(x, routing, experts, group)`` on 2 and 4 ranks, top-1 and top-2, against one
    process."""
    require_callable(dispatch_combine, "a function dispatch_combine(x, routing, experts, group)")
    summary = []
    for world in worlds:
        outcomes = judge(run_workers(
            _worker, world, args=(dispatch_combine,), timeout=timeout, explain_error=_explain,
            hang_hint="the ranks did not run the same collectives: every rank must take part in every "
                      "all-to-all, also one that sends or receives no token (splits of 0); and the "
                      "receiving sizes must come from the counts each peer sends"), world=world)
        for o in outcomes:
            p = o.data["probe"]
            if not p["identity"]:
                if p["permuted"]:
                    raise CheckFailed(f"rank {o.rank}, with experts that return their input and all gates 1: "
                                      f"the output holds the input's rows, in another order. "
                                      f"{_hint('not_unpermuted')}.")
                if p["shape"] != (TOKENS, DIM):
                    raise CheckFailed(f"rank {o.rank}: dispatch_combine returned shape {p['shape']}, "
                                      f"expected the input's ({TOKENS}, {DIM})")
                hint = "" if p["counts"] else f" {_hint('fixed_buffers')}."
                raise CheckFailed(f"rank {o.rank}, with experts that return their input, all gates 1 and "
                                  f"nothing dropped: the output is not the input.{hint}")
        for o in outcomes:
            for c in o.data["cases"]:
                _judge_case(o.rank, c)
        c = outcomes[0].data["cases"][-1]
        fwd = [x for x in c["calls"] if not x["backward"] and x["op"] in ("all_to_all_single", "all_to_all")]
        bwd = [x for x in c["calls"] if x["backward"] and x["op"] in ("all_to_all_single", "all_to_all")]
        toks = [x["rows"] for x in fwd if x["float"]]
        summary.append(f"{world} ranks: rank 0 ran {len(fwd)} all-to-all(s) forward "
                       f"({len(fwd) - len(toks)} of counts, {len(toks)} of tokens, rows received {toks}) "
                       f"and {len(bwd)} in backward")
    print("outputs and every gradient equal the one-process layer's (top-1 and top-2, with drops); "
          + "; ".join(summary))
