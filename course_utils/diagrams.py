"""Drawn diagrams for the lessons: what moves where, and when, in pictures made with matplotlib.

The plots elsewhere in the course show measurements; these show mechanisms. Each function draws one
diagram and returns the figure; ``show(fig, alt)`` puts it in the notebook as an image with alt text (a
screen reader reads the text; a saved notebook keeps both):

- ``ring_allreduce(n)``: the 2(n-1) steps of a ring all-reduce, chunk by chunk (chapter 03)
- ``process_group(nodes, per_node)``: ranks, local ranks and nodes of one job (chapter 03)
- ``ddp_overlap(buckets)``: DDP's bucket all-reduces overlapping the backward pass (chapter 04)
- ``column_row_parallel()``: a column-parallel then a row-parallel linear layer (chapter 11)
- ``pipeline_schedules(stages, micro)``: GPipe against 1F1B, stage by stage (chapter 12)
- ``mesh_groups(rows, cols, names)``: the process groups of a 2-D device mesh (chapter 12)
"""

from __future__ import annotations

import base64
import html
import io

import matplotlib.pyplot as plt
from IPython.display import HTML, display
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

__all__ = ["show", "ring_allreduce", "process_group", "ddp_overlap", "column_row_parallel",
           "pipeline_schedules", "mesh_groups"]

_RANK_COLOURS = plt.get_cmap("tab10").colors


def show(fig: Figure, alt: str) -> None:
    """Display ``fig`` as a PNG image with ``alt`` as its alt text, then close it."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    data = base64.b64encode(buf.getvalue()).decode()
    tag = f'<img src="data:image/png;base64,{data}" alt="{html.escape(alt, quote=True)}"/>'
    display(HTML(tag), metadata={"alt": alt})


def _box(ax, x, y, w, h, text="", *, face="white", edge="black", fontsize=9, **kw) -> None:
    ax.add_patch(Rectangle((x, y), w, h, facecolor=face, edgecolor=edge, **kw))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)


def _arrow(ax, start, end, colour="black", **kw) -> None:
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=10, color=colour, lw=1.2,
                                 **kw))


def ring_state(n: int) -> list[tuple[str, list[list[set[int]]], list[tuple[int, int]]]]:
    """The ring all-reduce step by step: for each step its name, which ranks' contributions every
    chunk of every rank holds (``state[rank][chunk]`` is a set of ranks) *before* the step, and the
    (sender, chunk) pairs sent in it. Rank r sends to rank (r + 1) % n."""
    state = [[{r} for _ in range(n)] for r in range(n)]
    steps = []
    for s in range(n - 1):  # reduce-scatter: receive and add
        sends = [(r, (r - s) % n) for r in range(n)]
        steps.append((f"reduce-scatter {s + 1}", [[set(c) for c in row] for row in state], sends))
        for r, c in sends:
            state[(r + 1) % n][c] = state[(r + 1) % n][c] | state[r][c]
    for s in range(n - 1):  # all-gather: receive and replace
        sends = [(r, (r + 1 - s) % n) for r in range(n)]
        steps.append((f"all-gather {s + 1}", [[set(c) for c in row] for row in state], sends))
        for r, c in sends:
            state[(r + 1) % n][c] = set(state[r][c])
    steps.append(("done", [[set(c) for c in row] for row in state], []))
    return steps


def ring_allreduce(n: int = 4) -> Figure:
    """Each rank's buffer cut into n chunks; a row per step. A chunk's shade is how many ranks'
    contributions it holds (dark: all n); the outlined chunk is the one each rank sends to its right
    neighbour in that step."""
    steps = ring_state(n)
    fig, ax = plt.subplots(figsize=(1.9 * n + 1.5, 0.55 * len(steps) + 0.8))
    cmap = plt.get_cmap("Blues")
    for row, (name, state, sends) in enumerate(steps):
        y = len(steps) - 1 - row
        ax.text(-0.3, y + 0.4, name, ha="right", va="center", fontsize=9)
        sent = dict(sends)
        for r in range(n):
            x0 = r * (n + 1.2)
            for c in range(n):
                k = len(state[r][c])
                edge_lw = 2.5 if sent.get(r) == c else 0.6
                _box(ax, x0 + c, y, 1, 0.8, "", face=cmap(0.15 + 0.8 * k / n), lw=edge_lw)
                ax.text(x0 + c + 0.5, y + 0.4, str(k), ha="center", va="center", fontsize=8,
                        color="white" if k > n / 2 else "black")
            if r in sent:
                dst = (r + 1) % n
                if dst > r:
                    _arrow(ax, (x0 + sent[r] + 0.5, y + 0.8), (dst * (n + 1.2) + sent[r] + 0.5, y + 0.8),
                           colour=_RANK_COLOURS[r], connectionstyle="arc3,rad=-0.25")
                else:
                    ax.text(x0 + n + 0.1, y + 0.4, f"→ rank {dst}", fontsize=8, color=_RANK_COLOURS[r],
                            va="center")
    for r in range(n):
        ax.text(r * (n + 1.2) + n / 2, len(steps) + 0.1, f"rank {r}", ha="center", fontsize=10,
                color=_RANK_COLOURS[r], weight="bold")
    ax.set_xlim(-4.2, n * (n + 1.2) + 0.8)
    ax.set_ylim(-0.3, len(steps) + 0.6)
    ax.axis("off")
    ax.set_title(f"Ring all-reduce on {n} ranks: numbers = how many ranks' values a chunk holds; "
                 f"thick edge = the chunk sent right", fontsize=10)
    return fig


def process_group(nodes: int = 2, per_node: int = 4) -> Figure:
    """Nodes as boxes, one square per process with its RANK and LOCAL_RANK; the store's host."""
    fig, ax = plt.subplots(figsize=(2.2 * per_node * nodes / 2 + 2, 2.6))
    width = per_node * 1.2 + 0.4
    for node in range(nodes):
        x0 = node * (width + 0.8)
        _box(ax, x0, 0, width, 2.2, face="#f3f3f3", edge="grey")
        ax.text(x0 + width / 2, 2.0, f"node {node}  (NODE_RANK={node})", ha="center", fontsize=9)
        for local in range(per_node):
            rank = node * per_node + local
            _box(ax, x0 + 0.3 + local * 1.2, 0.5, 1.0, 1.1, f"RANK {rank}\nLOCAL {local}\ncuda:{local}",
                 face=_RANK_COLOURS[rank % 10], alpha=0.35, fontsize=7.5)
    ax.text(0.3, 0.15, "the store (MASTER_ADDR:MASTER_PORT) lives on the rendezvous host, here node 0",
            fontsize=8, style="italic")
    ax.set_xlim(-0.2, nodes * (width + 0.8))
    ax.set_ylim(-0.1, 2.4)
    ax.axis("off")
    ax.set_title(f"One process group: WORLD_SIZE = {nodes} x {per_node} = {nodes * per_node}", fontsize=10)
    return fig


def ddp_overlap(buckets: int = 3, layers: int = 6) -> Figure:
    """Backward runs from the last layer to the first; a bucket's all-reduce starts as soon as all its
    gradients are ready, while backward goes on. Below: the same step with one all-reduce at the end."""
    fig, ax = plt.subplots(figsize=(10, 2.8))
    per_layer, comm = 1.0, 1.4 * layers / buckets
    per_bucket = layers // buckets
    for y, overlap in ((2.2, True), (0.2, False)):
        for i in range(layers):
            _box(ax, i * per_layer, y + 0.6, per_layer, 0.5, f"L{layers - i}", face="#9ecae1",
                 fontsize=7.5)
        t_free = 0.0
        for b in range(buckets):
            ready = (b + 1) * per_bucket * per_layer if overlap else layers * per_layer
            start = max(ready, t_free)
            _box(ax, start, y, comm, 0.5, f"bucket {b}", face="#fdae6b", fontsize=7.5)
            t_free = start + comm
        ax.text(-0.2, y + 0.85, "backward (layer L)", ha="right", fontsize=8)
        ax.text(-0.2, y + 0.25, "all-reduce", ha="right", fontsize=8)
        ax.text(t_free + 0.2, y + 0.25, f"step ends at t = {t_free:.1f} (time units)", fontsize=8,
                va="center", weight="bold")
        title = ("DDP: buckets overlap backward" if overlap
                 else "no overlap: every bucket waits for the end of backward")
        ax.text(-3.2, y + 1.25, title, fontsize=9, weight="bold")
    ax.set_xlim(-3.4, layers * per_layer + buckets * comm + 2.5)
    ax.set_ylim(0, 3.7)
    ax.axis("off")
    return fig


def column_row_parallel(ranks: int = 2) -> Figure:
    """Y = X A split by columns of A (no communication), then Z = Y B split by rows of B: each rank
    holds a partial Z and an all-reduce sums them."""
    fig, ax = plt.subplots(figsize=(10, 2.8))
    _box(ax, 0, 0.5, 1.2, 1.5, "X\n(whole)", face="#eeeeee")
    ax.text(1.45, 1.25, "@", fontsize=14, ha="center", va="center")
    for r in range(ranks):
        _box(ax, 1.8 + r * 0.9, 0.5, 0.9, 1.5, f"A[:, {r}]", face=_RANK_COLOURS[r], alpha=0.4, fontsize=8)
    ax.text(1.8 + ranks * 0.45, 2.15, "column-parallel: A split by columns", ha="center", fontsize=8)
    x = 2.1 + ranks * 0.9
    ax.text(x, 1.25, "=", fontsize=14, ha="center", va="center")
    for r in range(ranks):
        _box(ax, x + 0.3 + r * 0.9, 0.5, 0.9, 1.5, f"Y_{r}", face=_RANK_COLOURS[r], alpha=0.4, fontsize=8)
    x += 0.5 + ranks * 0.9
    ax.text(x, 1.25, "@", fontsize=14, ha="center", va="center")
    for r in range(ranks):
        _box(ax, x + 0.3, 0.5 + (ranks - 1 - r) * 1.5 / ranks, 1.2, 1.5 / ranks, f"B[{r}, :]",
             face=_RANK_COLOURS[r], alpha=0.4, fontsize=8)
    ax.text(x + 0.9, 2.15, "row-parallel: B split by rows", ha="center", fontsize=8)
    x += 1.8
    ax.text(x, 1.25, "=", fontsize=14, ha="center", va="center")
    parts = " + ".join(f"Y_{r} B[{r}]" for r in range(ranks))
    _box(ax, x + 0.3, 0.5, 2.6, 1.5, f"Z = {parts}\n(all-reduce of\nthe partial sums)", face="#fdd0a2",
         fontsize=8)
    ax.text(0, 0.1, f"each colour: what one of {ranks} ranks holds; the only communication is the "
            "all-reduce at the end (and its mirror in backward, for X's gradient)", fontsize=8)
    ax.set_xlim(-0.2, x + 3.2)
    ax.set_ylim(0, 2.4)
    ax.axis("off")
    return fig


def _schedule(stages: int, micro: int, one_f_one_b: bool) -> list[list[str]]:
    """What each stage does at each time slot ('F3', 'B0' or ''), a backward taking one slot."""
    todo = []
    for s in range(stages):
        if not one_f_one_b:
            todo.append([f"F{m}" for m in range(micro)] + [f"B{m}" for m in range(micro)])
        else:
            warm = min(stages - s - 1, micro)
            seq = [f"F{m}" for m in range(warm)]
            f, b = warm, 0
            while b < micro:
                if f < micro:
                    seq.append(f"F{f}")
                    f += 1
                seq.append(f"B{b}")
                b += 1
            todo.append(seq)
    done: set[tuple[int, str]] = set()
    grid: list[list[str]] = [[] for _ in range(stages)]
    pos = [0] * stages
    while any(pos[s] < len(todo[s]) for s in range(stages)):
        slot_done = []
        for s in range(stages):
            if pos[s] >= len(todo[s]):
                grid[s].append("")
                continue
            op = todo[s][pos[s]]
            kind, m = op[0], op[1:]
            dep = (s - 1, f"F{m}") if kind == "F" else (s + 1, f"B{m}") if s < stages - 1 else (s, f"F{m}")
            ready = (kind == "F" and s == 0) or dep in done
            if ready:
                grid[s].append(op)
                slot_done.append((s, op))
                pos[s] += 1
            else:
                grid[s].append("")
        done.update(slot_done)
    return grid


def pipeline_schedules(stages: int = 4, micro: int = 8) -> Figure:
    """GPipe (all forwards, then all backwards) against 1F1B (one forward, one backward in turn once
    the pipeline is full), one slot per micro-batch step; white slots are the bubble."""
    fig, axes = plt.subplots(2, 1, figsize=(10, 1.0 + 0.9 * stages), sharex=True)
    for ax, (name, one_f_one_b) in zip(axes, (("GPipe", False), ("1F1B", True))):
        grid = _schedule(stages, micro, one_f_one_b)
        in_flight = 0
        for s, row in enumerate(grid):
            live = peak = 0
            for t, op in enumerate(row):
                if op:
                    face = "#9ecae1" if op[0] == "F" else "#fdae6b"
                    _box(ax, t, stages - 1 - s, 1, 0.9, op, face=face, fontsize=7.5)
                    live += 1 if op[0] == "F" else -1
                    peak = max(peak, live)
            in_flight = max(in_flight, peak)
        ax.set_yticks([stages - 1 - s + 0.45 for s in range(stages)], [f"stage {s}" for s in range(stages)])
        ax.set_xlim(0, max(len(r) for r in grid))
        ax.set_ylim(-0.1, stages)
        ax.set_title(f"{name}: {len(grid[0])} slots; at most {in_flight} micro-batches' activations kept "
                     "on a stage", fontsize=9)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[-1].set_xlabel("time slot (blue F: forward of micro-batch m, orange B: its backward)")
    fig.tight_layout()
    return fig


def mesh_groups(rows: int = 2, cols: int = 4, names: tuple[str, str] = ("dp", "tp")) -> Figure:
    """A rows x cols mesh of ranks, dimensions named ``names``: each row is one group of the second
    dimension (``names[1]``, e.g. tensor parallelism), each column one group of the first (``names[0]``,
    e.g. data parallelism or FSDP)."""
    fig, ax = plt.subplots(figsize=(1.3 * cols + 3.0, 1.2 * rows + 1.2))
    for i in range(rows):
        y = rows - 1 - i
        ax.add_patch(Rectangle((-0.1, y - 0.05), cols, 0.9, facecolor=_RANK_COLOURS[i], alpha=0.15,
                               edgecolor="none"))
        ax.text(cols + 0.05, y + 0.4, f"{names[1]} group: ranks {[i * cols + j for j in range(cols)]}",
                fontsize=8, va="center")
        for j in range(cols):
            _box(ax, j, y, 0.8, 0.8, f"{i * cols + j}", face="white", fontsize=10)
    for j in range(cols):
        ax.add_patch(Rectangle((j - 0.06, -0.06), 0.92, rows - 0.2 + 0.12, fill=False, ls="--",
                               edgecolor="grey"))
    ax.text(0, -0.45, f"dashed: the {names[0]} groups, one per column, e.g. ranks "
            f"{[i * cols for i in range(rows)]}", fontsize=8)
    ax.set_xlim(-0.3, cols + 3.4)
    ax.set_ylim(-0.7, rows + 0.1)
    ax.axis("off")
    ax.set_title(f"A {rows} x {cols} device mesh ({names[0]}, {names[1]}): rank = {names[0]} index x {cols} "
                 f"+ {names[1]} index", fontsize=10)
    return fig
