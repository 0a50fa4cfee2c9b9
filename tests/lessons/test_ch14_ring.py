"""Chapter 14's ring attention and Ulysses (notebooks/ch14_ring.py) beyond what the lesson runs:
an odd number of ranks, both layouts, the blocking ring, and each rank's work under zigzag."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_utils import launch

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
sys.path.insert(0, str(NOTEBOOKS))  # the workers import ch14_ring by name, as the lesson's do
import ch14_ring  # noqa: E402
from ch14_runs import open_group, positions  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def _against_sdpa(seq: int = 96, heads: int = 6) -> dict:
    """Every rank: max differences of ring attention (both layouts, overlapped and blocking) and of
    Ulysses from SDPA on the whole sequence, output and gradients of q, k and v; and the work."""
    rank, world, device = open_group()
    torch.manual_seed(3)
    full = [torch.randn(2, heads, seq, 8, requires_grad=True) for _ in range(3)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    out = {}
    runs = [("contiguous", True), ("contiguous", False), ("zigzag", True), ("zigzag", False),
            ("ulysses", None)]
    for layout, overlap in runs:
        idx = positions(rank, world, seq, "contiguous" if layout == "ulysses" else layout)
        local = [t.detach()[:, :, idx].clone().requires_grad_() for t in full]
        log = {}
        if layout == "ulysses":
            o = ch14_ring.ulysses_attention(*local)
        else:
            o = ch14_ring.ring_attention(*local, layout, overlap, log)
        o.backward(grad[:, :, idx])
        diffs = [float((o.detach() - ref.detach()[:, :, idx]).abs().max())]
        diffs += [float((a.grad - b.grad[:, :, idx]).abs().max()) for a, b in zip(local, full)]
        out[f"{layout} {overlap}"] = {"diff": max(diffs), "work": log.get("work")}
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("world", [3])
def test_ring_and_ulysses_equal_sdpa_forward_and_backward_on_an_odd_world(world):
    results = launch(_against_sdpa, nprocs=world, timeout=120)
    for rank, r in enumerate(results):
        for name, got in r.items():
            assert got["diff"] < 1e-5, (rank, name, got)
    zig = {r["zigzag True"]["work"] for r in results}
    contiguous = [r["contiguous True"]["work"] for r in results]
    assert len(zig) == 1, zig  # zigzag: the same work on every rank
    assert contiguous == sorted(contiguous) and contiguous[-1] == world * contiguous[0], contiguous


def test_chunks_and_pair_kinds():
    assert [ch14_ring.chunks_of(r, 4, "zigzag") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert ch14_ring.chunks_of(2, 4) == [2]
    assert [ch14_ring.pair_kind(2, k) for k in (1, 2, 3)] == ["full", "diagonal", "skip"]
    with pytest.raises(ValueError):
        ch14_ring.chunks_of(0, 2, "striped")
