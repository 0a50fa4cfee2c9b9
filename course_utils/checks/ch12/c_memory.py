"""12.c Per-rank memory at 64 ranks: ``check_rank_memory(predict_rank_bytes)``.

The learner predicts, from the parameter shapes alone, what rank 0 of a large FSDP2 job keeps
between steps::

    predict_rank_bytes(shapes, mesh_shape) -> {"params": bytes, "grads": bytes, "optimizer": bytes}

for fp32 parameters, ``fully_shard`` on every Linear and on the root, and AdamW.  ``mesh_shape`` is
``(64,)`` (FSDP over 64 ranks), ``(8, 8)`` (HSDP: 8 replicas of 8 shards), ``(256,)`` or ``(4, 16)``
(HSDP: 4 replicas of 16 shards, not square, so that dividing by the replica dimension shows).
Any real number is accepted (``numbers.Real``: numpy's integers and floats too).  The checker
compares each number with what the fake backend's simulation of the same job reports
(``course_utils.measure.ch12.simulate_fsdp``: the shards torch really allocates, padding included)
within ``RTOL``; ``shapes`` are those of ``course_utils.measure.ch12.sim_model``.
"""

from __future__ import annotations

import math
import numbers

from ...checking import (
    Catalogue,
    CheckFailed,
    Misconception,
    checker,
    require_callable,
    run_workers,
)
from ...measure.ch12 import sim_shapes, simulate_fsdp

__all__ = ["CATALOGUE", "check_rank_memory", "MESHES", "RTOL"]

CATALOGUE = Catalogue(
    "12.c per-rank memory",
    Misconception(
        "params_unsharded",
        "FSDP gathers the parameters, so each rank holds all of them",
        "the parameter bytes are the shard size times the full model",
        "between steps each rank keeps only its shard of every parameter (1/shards of it); the "
        "all-gathered copy of a layer exists only while that layer runs",
    ),
    Misconception(
        "grads_unsharded",
        "gradients are all-reduced as in DDP, so every rank has the full gradient",
        "the gradient bytes are the shard size times the full model",
        "FSDP reduce-scatters the gradients: each rank ends the backward with the gradient of "
        "its own shard only",
    ),
    Misconception(
        "one_optimizer_state",
        "the optimizer state is as large as the parameters",
        "the optimizer bytes are half the simulated ones",
        "AdamW keeps two tensors per parameter (exp_avg and exp_avg_sq), each the size of the "
        "parameter shard",
    ),
    Misconception(
        "two_bytes_per_number",
        "a number takes 2 bytes (the bf16 habit of mixed-precision training)",
        "every number is exactly half the simulated one",
        "the parameters here are fp32: 4 bytes per number (param.element_size()), and so are "
        "their gradients and AdamW's two states",
    ),
    Misconception(
        "shards_over_replicas",
        "HSDP shards over the first mesh dimension",
        "on the (4, 16) mesh every number is 4 times the simulated one (divided by 4, not by 16)",
        "a 2-D mesh is (replicas, shards): fully_shard shards over the last dimension "
        "(mesh_shape[-1]) and replicates over the first; dividing by mesh_shape[0] works only "
        "when the two are equal",
    ),
    Misconception(
        "replicas_also_shard",
        "HSDP on 8 x 8 splits the model 64 ways, like FSDP on 64",
        "on the (8, 8) mesh every number is an eighth of the simulated one",
        "on a 2-D mesh (replicas, shards) fully_shard shards over the second dimension only and "
        "keeps a full replica of the shards in each group of the first: divide by the shard "
        "dimension, not by the world size",
    ),
)

MESHES = ((64,), (8, 8), (256,), (4, 16))
RTOL = 0.05  # the simulation pads each parameter's first dimension to a multiple of the shards
KEYS = ("params", "grads", "optimizer")


def _simulate(meshes: tuple[tuple[int, ...], ...]) -> list[dict]:
    return [simulate_fsdp(m) for m in meshes]


def _hint(key: str, mesh: tuple[int, ...], ratio: float, ratios: dict[str, float]) -> str:
    shards = mesh[-1]

    def near(x: float, r: float = ratio) -> bool:
        return abs(r - x) < RTOL * x

    if all(near(0.5, r) for r in ratios.values()):
        return CATALOGUE.hint("two_bytes_per_number")
    if len(mesh) == 2 and mesh[0] != mesh[1] and near(mesh[1] / mesh[0]):
        return CATALOGUE.hint("shards_over_replicas")
    if len(mesh) == 2 and near(1 / mesh[0]):
        return CATALOGUE.hint("replicas_also_shard")
    if key == "params" and near(shards):
        return CATALOGUE.hint("params_unsharded")
    if key == "grads" and near(shards):
        return CATALOGUE.hint("grads_unsharded")
    if key == "optimizer" and near(0.5):
        return CATALOGUE.hint("one_optimizer_state")
    return ""


@checker("12.c per-rank memory")
def check_rank_memory(predict_rank_bytes, *, meshes=MESHES) -> None:
    """Compare ``predict_rank_bytes`` with the fake-backend simulation; see the module docstring."""
    require_callable(predict_rank_bytes, "predict_rank_bytes(shapes, mesh_shape)")
    shapes = sim_shapes()
    predictions = [predict_rank_bytes(list(shapes), tuple(m)) for m in meshes]
    for mesh, got in zip(meshes, predictions):
        if not isinstance(got, dict) or any(k not in got for k in KEYS):
            raise CheckFailed(f"for mesh {mesh} your function returned {got!r}; expected a dict with "
                              f"the keys {', '.join(KEYS)} (bytes on rank 0)")
    simulated = run_workers(_simulate, 1, args=(tuple(meshes),), timeout=120)[0]
    rows, problems = [], []
    for mesh, got, sim in zip(meshes, predictions, simulated):
        for key in KEYS:
            value = got[key]
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or math.isnan(float(value)):
                raise CheckFailed(f"for mesh {mesh}, {key!r} is {value!r}; expected a number of bytes")
        ratios = {key: float(got[key]) / sim[key] for key in KEYS}
        for key in KEYS:
            want, value, ratio = sim[key], float(got[key]), ratios[key]
            rows.append(f"  {str(mesh):<8} {key:<10} {value:>14,.0f} {want:>14,} {ratio:>7.3f}")
            if abs(ratio - 1) > RTOL and not problems:
                hint = _hint(key, mesh, ratio, ratios)
                problems.append(f"for mesh {mesh} ({sim['world']} ranks) you predicted {value:,.0f} "
                                f"bytes of {key}, the simulation keeps {want:,} (ratio {ratio:.3g})."
                                + (f" Usual mistake: {hint}." if hint else ""))
    if problems:
        table = f"  {'mesh':<8} {'what':<10} {'predicted':>14} {'simulated':>14} {'ratio':>7}\n"
        raise CheckFailed(problems[0] + "\n" + table + "\n".join(rows))
