"""Checkers of chapter 14 (context parallelism: ring attention, zigzag, Ulysses).

- ``check_ring_attention(ring_attention)`` (14.a, ``a_ring_attention.py``): causal ring attention's
  forward on 2 and 4 ranks against SDPA on the whole sequence, with every message recorded: only
  neighbours exchange K and V, N - 1 times, nothing is gathered.
- ``check_zigzag(zigzag_chunks, chunk_mask)`` (14.b, ``b_zigzag.py``): which chunks each rank holds
  (each once, equal causal work) on N = 2, 3, 4, 8, and the mask between any two chunks.
- ``check_ulysses(seq_to_heads, heads_to_seq)`` (14.c, ``c_ulysses.py``): Ulysses' two all-to-alls,
  attention through them against SDPA, forward and backward, on 2 and 4 ranks.
- ``watch.py``: ``FunctionalCalls``, which records torch's functional collectives.

Each exercise's module declares its ``CATALOGUE`` of misconceptions; ``tests/checkers/test_ch14_checks.py``
gives each one to the checker, written as a learner would write it.
"""

from .a_ring_attention import check_ring_attention
from .b_zigzag import check_zigzag
from .c_ulysses import check_ulysses

__all__ = ["check_ring_attention", "check_zigzag", "check_ulysses"]
