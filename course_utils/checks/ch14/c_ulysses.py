"""14.c Ulysses' all-to-alls: ``check_ulysses(seq_to_heads, heads_to_seq)``.

The learner writes the two reshapes of Ulysses, each one all-to-all over the default group:

- ``seq_to_heads(x)``: ``(B, H, S/N, D)``, this rank's slice of the sequence for every head, to
  ``(B, H/N, S, D)``: the whole sequence for H/N of the heads;
- ``heads_to_seq(y)``: the inverse.

The checker runs them on 2 and 4 ranks (8 heads) and checks, in order: ``seq_to_heads`` gives each
rank whole heads of the full sequence, positions in order, and the ranks' heads together are every
head once; ``heads_to_seq(seq_to_heads(x))`` is ``x``; attention built from them,
``heads_to_seq(SDPA(seq_to_heads(q), seq_to_heads(k), seq_to_heads(v), is_causal=True))``, equals
causal SDPA on the whole sequence, and so do the gradients of q, k and v.  ``CollectiveSpy`` and
``FunctionalCalls`` record the communication: all-to-alls only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...checking import (
    Catalogue,
    CheckFailed,
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

__all__ = ["CATALOGUE", "check_ulysses"]

CATALOGUE = Catalogue(
    "14.c Ulysses",
    Misconception(
        "reshape_without_permute",
        "a reshape of x to (N, ...) before the all-to-all puts each head group in its own piece",
        "a rank's heads after seq_to_heads are not heads of the input: their values are mixed",
        "all_to_all_single sends piece j of dim 0 to rank j, so the head groups must be on dim 0 "
        "before the call: reshape (B, H, s, D) to (B, N, H/N, s, D), move dim 1 to the front "
        "(transpose(0, 1) or permute) and make it contiguous. A reshape alone to (N, ...) cuts "
        "the memory in N pieces across batch and heads, not by head group",
    ),
    Misconception(
        "sequence_order",
        "the received pieces can be concatenated along the sequence in any layout",
        "a rank's heads hold the right positions in the wrong order",
        "after the all-to-all, piece j is rank j's slice of the sequence (positions j*S/N ... "
        "(j+1)*S/N - 1): put the piece dimension just before the local sequence dimension "
        "(B, H/N, N, S/N, D) before merging the two into S",
    ),
    Misconception(
        "no_autograd",
        "dist.all_to_all_single into a new tensor is enough, autograd will follow",
        "the forward is right but the gradients of q, k, v are missing or zero",
        "dist.all_to_all_single writes into a tensor autograd knows nothing about, so no gradient "
        "flows back through it. Use all_to_all_single_autograd from "
        "torch.distributed._functional_collectives (its backward is the inverse all-to-all)",
    ),
    Misconception(
        "all_gathered",
        "gather the whole sequence on every rank and keep my heads",
        "an all_gather (or another collective than all-to-all) in the learner's code",
        "the whole sequence of every head was gathered on each rank: the values are right but "
        "each rank receives N times the bytes it needs and briefly holds all of q, k and v. One "
        "all-to-all sends each rank only its own heads",
    ),
)

BATCH, HEADS, LOCAL_S, HEAD_DIM = 2, 8, 8, 8
WORLDS = (2, 4)
TIMEOUT = 30.0
ATOL = 1e-4
_ALLOWED = {"all_to_all_single", "all_to_all", "barrier", "monitored_barrier"}


def _tensors(world: int):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(15)
        shape = (BATCH, HEADS, LOCAL_S * world, HEAD_DIM)
        return [torch.randn(shape) for _ in range(4)]  # q, k, v and the output's gradient


def _which_heads(got: torch.Tensor, full: torch.Tensor) -> tuple[list[int], str]:
    """Which head of ``full`` each of ``got``'s heads is; "" or how the heads differ."""
    heads = []
    for i in range(got.shape[1]):
        match = [h for h in range(full.shape[1]) if torch.allclose(got[:, i], full[:, h], atol=ATOL)]
        if match:
            heads.append(match[0])
            continue
        nearest = full[:, _nearest(got[:, i], full)]
        same_values = torch.allclose(got[:, i].reshape(-1).sort().values, nearest.reshape(-1).sort().values,
                                     atol=ATOL)
        return heads, "sequence_order" if same_values else "reshape_without_permute"
    return heads, ""


def _nearest(head: torch.Tensor, full: torch.Tensor) -> int:
    """The head of ``full`` whose values are closest to ``head``'s as sets (sorted)."""
    key = head.reshape(-1).sort().values

    def distance(h: int) -> float:
        return float((full[:, h].reshape(-1).sort().values - key).abs().max())

    return min(range(full.shape[1]), key=distance)


def _worker(seq_to_heads, heads_to_seq) -> Outcome:
    with process_group() as pg:
        rank, world, dev = pg.rank, pg.world, pg.device
        q, k, v, g = _tensors(world)
        n = LOCAL_S
        mine = slice(rank * n, (rank + 1) * n)
        where = f"on {world} ranks, rank {rank}"
        functional = FunctionalCalls()
        with CollectiveSpy(COLLECTIVES) as spy, functional:
            x = q[:, :, mine].clone().to(dev)
            y = seq_to_heads(x)
            back = heads_to_seq(y) if isinstance(y, torch.Tensor) else None
        others = sorted(({c.op for c in spy.calls} | {name for name, _ in functional.calls}) - _ALLOWED)
        if others:
            return Outcome(rank, f"{where}: your code called {', '.join(others)}. "
                                 f"Usual mistake: {CATALOGUE.hint('all_gathered')}.")
        want_shape = (BATCH, HEADS // world, LOCAL_S * world, HEAD_DIM)
        if not isinstance(y, torch.Tensor) or tuple(y.shape) != want_shape:
            shape = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            return Outcome(rank, f"{where}: seq_to_heads returned {shape}; expected {want_shape} "
                                 f"(batch, heads / N, whole sequence, head dim).")
        heads, mistake = _which_heads(y.detach().cpu(), q)
        if mistake:
            return Outcome(rank, f"{where}: head {len(heads)} of seq_to_heads' output is not one of "
                                 f"the input's heads over the whole sequence in order. "
                                 f"Usual mistake: {CATALOGUE.hint(mistake)}.")
        if not isinstance(back, torch.Tensor) or tuple(back.shape) != tuple(x.shape) or not torch.allclose(
                back.detach().cpu(), q[:, :, mine], atol=ATOL):
            shape = tuple(back.shape) if isinstance(back, torch.Tensor) else type(back).__name__
            return Outcome(rank, f"{where}: heads_to_seq(seq_to_heads(x)) is not x (shape {shape}, "
                                 f"expected {tuple(x.shape)}): heads_to_seq must undo seq_to_heads, "
                                 f"the same all-to-all with the roles of heads and sequence swapped.")
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*full, is_causal=True)
        ref.backward(g)
        local = [t[:, :, mine].clone().to(dev).requires_grad_() for t in (q, k, v)]
        out = heads_to_seq(F.scaled_dot_product_attention(*(seq_to_heads(t) for t in local), is_causal=True))
        diff = float((out.detach().cpu() - ref.detach()[:, :, mine]).abs().max())
        if diff > ATOL:
            return Outcome(rank, f"{where}: attention through seq_to_heads and heads_to_seq differs from "
                                 f"causal SDPA on the whole sequence by up to {diff:.3g}.")
        if not out.requires_grad:
            return Outcome(rank, f"{where}: the output does not require grad. Usual mistake: "
                                 f"{CATALOGUE.hint('no_autograd')}.")
        out.backward(g[:, :, mine].to(dev))
        for name, mine_t, ref_t in zip("qkv", local, full):
            grad = mine_t.grad
            if grad is None or float(grad.abs().max()) == 0.0:
                return Outcome(rank, f"{where}: {name} has no gradient after backward. Usual mistake: "
                                     f"{CATALOGUE.hint('no_autograd')}.")
            gdiff = float((grad.cpu() - ref_t.grad[:, :, mine]).abs().max())
            if gdiff > ATOL:
                return Outcome(rank, f"{where}: the gradient of {name} differs from SDPA's on the whole "
                                     f"sequence by up to {gdiff:.3g}.")
        return Outcome(rank, data={"heads": heads})


@checker("14.c Ulysses")
def check_ulysses(seq_to_heads, heads_to_seq, *, worlds=WORLDS, timeout: float = TIMEOUT) -> None:
    """Run both reshapes on 2 and 4 ranks; see the module docstring for what is checked."""
    require_callable(seq_to_heads, "seq_to_heads(x)")
    require_callable(heads_to_seq, "heads_to_seq(y)")
    for world in worlds:
        outcomes = judge(run_workers(_worker, world, args=(seq_to_heads, heads_to_seq), timeout=timeout),
                         world=world)
        held = sorted(h for o in outcomes for h in o.data["heads"])
        if held != list(range(HEADS)):
            raise CheckFailed(f"on {world} ranks the ranks' heads after seq_to_heads are "
                              f"{[o.data['heads'] for o in outcomes]}: every one of the {HEADS} heads "
                              f"must be on exactly one rank.")
    print(f"Ulysses: seq_to_heads and heads_to_seq give causal SDPA, forward and backward, on "
          f"{' and '.join(map(str, worlds))} ranks, with all-to-alls only")
