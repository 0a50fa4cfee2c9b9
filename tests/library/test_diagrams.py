"""The lessons' diagrams draw what their docstrings say: checked on the data behind each picture."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest

from course_utils import diagrams


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_the_ring_ends_with_every_chunk_reduced_on_every_rank_after_2_n_minus_1_steps(n):
    steps = diagrams.ring_state(n)
    assert len(steps) == 2 * (n - 1) + 1
    name, final, sends = steps[-1]
    assert name == "done" and not sends
    assert all(chunk == set(range(n)) for row in final for chunk in row)
    # after the reduce-scatter, rank r holds chunk (r + 1) % n fully reduced, and nothing else is
    _, after_rs, _ = steps[n - 1]
    for r in range(n):
        assert after_rs[r][(r + 1) % n] == set(range(n))
        assert all(len(c) < n for i, c in enumerate(after_rs[r]) if i != (r + 1) % n)


@pytest.mark.parametrize("stages, micro", [(2, 4), (4, 4), (4, 8), (3, 5)])
def test_both_schedules_run_every_forward_before_its_backward_and_1f1b_keeps_fewer_in_flight(stages, micro):
    peaks = {}
    for one_f_one_b in (False, True):
        grid = diagrams._schedule(stages, micro, one_f_one_b)
        peak = 0
        for s, row in enumerate(grid):
            ops = [op for op in row if op]
            assert sorted(ops) == sorted([f"F{m}" for m in range(micro)] + [f"B{m}" for m in range(micro)])
            when = {op: t for t, op in enumerate(row) if op}
            for m in range(micro):
                assert when[f"F{m}"] < when[f"B{m}"]
                if s > 0:  # a stage's forward needs the previous stage's
                    assert grid[s - 1].index(f"F{m}") < when[f"F{m}"]
            live = 0
            for op in row:
                live += 1 if op.startswith("F") else -1 if op else 0
                peak = max(peak, live) if s == 0 else peak
        peaks[one_f_one_b] = peak
    assert peaks[False] == micro
    assert peaks[True] == min(stages, micro)


def test_every_diagram_draws_and_shows_with_its_alt_text(monkeypatch):
    shown = []
    monkeypatch.setattr(diagrams, "display", lambda obj, metadata=None: shown.append((obj, metadata)))
    for fig in (diagrams.ring_allreduce(4), diagrams.process_group(2, 4), diagrams.ddp_overlap(),
                diagrams.column_row_parallel(), diagrams.pipeline_schedules(), diagrams.mesh_groups()):
        assert fig.axes
        diagrams.show(fig, 'a "quoted" description')
    assert len(shown) == 6
    html, meta = shown[0]
    assert 'alt="a &quot;quoted&quot; description"' in html.data and meta == {"alt": 'a "quoted" description'}
