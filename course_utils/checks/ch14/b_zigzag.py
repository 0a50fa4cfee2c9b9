"""14.b Zigzag load balancing: ``check_zigzag(zigzag_chunks, chunk_mask)``.

The sequence is cut into 2N chunks of ``chunk_len`` positions (chunk c holds positions
c·chunk_len ... (c + 1)·chunk_len − 1).  The learner writes two plain functions:

- ``zigzag_chunks(rank, world) -> (a, b)``: the two chunks rank ``rank`` of ``world`` holds;
- ``chunk_mask(q_chunk, k_chunk, chunk_len) -> BoolTensor (chunk_len, chunk_len)``: True where a
  query of chunk ``q_chunk`` may attend to a key of chunk ``k_chunk`` under the causal mask.

Checked in this process on N = 2, 3, 4 and 8: the chunks of all ranks are each of the 2N chunks
exactly once, every rank has the same causal work (query-key pairs its queries may see), and the
mask of every pair of chunks equals the causal mask of the whole sequence at those positions.
Any split into pairs with equal work passes (rank r holding chunks N − 1 − r and N + r is as
balanced as r and 2N − 1 − r).
"""

from __future__ import annotations

import torch

from ...checking import Catalogue, CheckFailed, Misconception, checker, require_callable, time_limit

__all__ = ["CATALOGUE", "check_zigzag", "causal_work"]

CATALOGUE = Catalogue(
    "14.b zigzag",
    Misconception(
        "contiguous_pairs",
        "two neighbouring chunks per rank are as good as any two",
        "every chunk is held once, but the last rank's causal work is several times the first's",
        "the ranks hold neighbouring chunks, so the last rank's queries see almost the whole "
        "sequence and the first rank's almost nothing. Pair an early chunk with a late one: rank "
        "r holds chunks r and 2N - 1 - r",
    ),
    Misconception(
        "mirror_off_by_one",
        "the mirror of chunk r is chunk 2N - r",
        "a chunk index of 2N (past the end) or a chunk held twice",
        "the chunks are numbered 0 ... 2N - 1: the mirror of chunk r is 2N - 1 - r",
    ),
    Misconception(
        "local_mask",
        "every pair of chunks gets the lower-triangular mask",
        "the mask of a pair of different chunks is triangular",
        "only a chunk against itself needs the triangle; compare global positions: a query of "
        "chunk a sees all of an earlier chunk b < a and none of a later one b > a",
    ),
    Misconception(
        "diagonal_full",
        "a chunk may attend to itself in full",
        "the mask of a chunk against itself lets queries see later keys",
        "a chunk against itself is the diagonal block: query i sees keys 0 ... i only (the "
        "lower triangle, torch.ones(n, n, dtype=torch.bool).tril())",
    ),
    Misconception(
        "future_visible",
        "the causal mask is key position >= query position",
        "queries attend to later chunks and not to earlier ones",
        "the causal mask lets a query see keys at its own position or EARLIER (key position <= "
        "query position); the mask was the wrong way round",
    ),
)

WORLDS = (2, 3, 4, 8)
CHUNK = 3


def causal_work(chunks, world: int, chunk_len: int = 1) -> int:
    """Query-key pairs the causal mask lets the queries of ``chunks`` see (diagonal chunks half and a bit)."""
    return sum(c * chunk_len * chunk_len + chunk_len * (chunk_len + 1) // 2 for c in chunks)


def _chunks(zigzag_chunks, world: int) -> list[tuple[int, int]]:
    out = []
    for rank in range(world):
        with time_limit(10, f"zigzag_chunks({rank}, {world})"):
            got = zigzag_chunks(rank, world)
        try:
            pair = tuple(int(c) for c in got)
        except TypeError:
            raise CheckFailed(f"zigzag_chunks({rank}, {world}) returned {got!r}; expected two chunk "
                              f"indices, like (0, 3)") from None
        if len(pair) != 2:
            raise CheckFailed(f"zigzag_chunks({rank}, {world}) returned {got!r}; expected two chunk indices")
        out.append(pair)
    return out


def _check_layout(zigzag_chunks, world: int) -> None:
    layout = _chunks(zigzag_chunks, world)
    shown = ", ".join(f"rank {r}: {p}" for r, p in enumerate(layout))
    held = [c for p in layout for c in p]
    outside = sorted({c for c in held if not 0 <= c < 2 * world})
    twice = sorted({c for c in held if held.count(c) > 1})
    if outside or twice:
        what = (f"chunk(s) {outside} outside 0 ... {2 * world - 1}" if outside
                else f"chunk(s) {twice} held more than once")
        raise CheckFailed(f"on {world} ranks ({2 * world} chunks) the ranks hold {shown}: {what}. "
                          f"Usual mistake: {CATALOGUE.hint('mirror_off_by_one')}.")
    work = [causal_work(p, world) for p in layout]
    if len(set(work)) > 1:
        raise CheckFailed(f"on {world} ranks the ranks hold {shown}; the causal work per rank (pairs "
                          f"of positions its queries see, chunks of 1) is {work}: not balanced. "
                          f"Usual mistake: {CATALOGUE.hint('contiguous_pairs')}.")


def _check_masks(chunk_mask, chunks: int, n: int) -> None:
    pos = torch.arange(chunks * n)
    full = pos[:, None] >= pos[None, :]
    for a in range(chunks):
        for b in range(chunks):
            with time_limit(10, f"chunk_mask({a}, {b}, {n})"):
                got = chunk_mask(a, b, n)
            if not isinstance(got, torch.Tensor) or tuple(got.shape) != (n, n):
                shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                raise CheckFailed(f"chunk_mask({a}, {b}, {n}) returned {shape}; expected a boolean "
                                  f"tensor of shape ({n}, {n}), True where the query may see the key")
            got = got.bool().cpu()
            want = full[a * n:(a + 1) * n, b * n:(b + 1) * n]
            if torch.equal(got, want):
                continue
            tri = torch.ones(n, n, dtype=torch.bool).tril()
            if a != b and torch.equal(got, tri):
                key = "local_mask"
            elif a == b and bool(got.triu(1).any()) and bool(got[tri].all()):
                key = "diagonal_full"
            elif (a < b and bool(got.any())) or (a == b and torch.equal(got, tri.T)):
                key = "future_visible"
            else:
                key = ""
            hint = f" Usual mistake: {CATALOGUE.hint(key)}." if key else ""
            raise CheckFailed(f"chunk_mask({a}, {b}, {n}) (query chunk {a}, key chunk {b}, chunks of "
                              f"{n}) returned\n{got.int().tolist()}\nexpected\n{want.int().tolist()}.{hint}")


@checker("14.b zigzag", in_process=True)
def check_zigzag(zigzag_chunks, chunk_mask, *, worlds=WORLDS) -> None:
    """Check the chunks of every rank on several N, and the mask of every pair of chunks."""
    require_callable(zigzag_chunks, "zigzag_chunks(rank, world)")
    require_callable(chunk_mask, "chunk_mask(q_chunk, k_chunk, chunk_len)")
    for world in worlds:
        _check_layout(zigzag_chunks, world)
    _check_masks(chunk_mask, 2 * 4, CHUNK)
    print(f"zigzag: every chunk held once and equal causal work per rank on N = "
          f"{', '.join(map(str, worlds))}; every chunk pair's mask equals the causal mask")
