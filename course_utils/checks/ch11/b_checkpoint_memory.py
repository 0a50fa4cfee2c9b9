"""11.b The activation peak of a checkpointed stack: ``check_checkpoint_memory(predict)``.

The learner writes ``predict_peak_activation_bytes(batch, seq, hidden, layers, segment)``: the peak
bytes of activations during one training step (forward and backward) of ``layers`` fp32
``MLPBlock``s (``x + fc2(gelu(fc1(x)))``, ``fc1: hidden -> 4*hidden``), where every ``segment``
consecutive blocks form one checkpoint (``segment=None``: no checkpointing).

The checker measures each configuration with ``course_utils.measure.ch11.peak_activation_bytes``
(a dispatch mode that counts the bytes of every tensor created while autograd records, until it is
freed) and accepts a prediction that is within ``TOLERANCE`` of the measurement on every
configuration **and** grows as the measurement does: three pairs of configurations of the same
batch, sequence and hidden size differ only in the number of blocks without checkpointing, in the
number of blocks of the segment recomputed during backward, and in the number of segments, and the
differences (in fp32 tensors of batch x seq x hidden numbers) must match the measured 9 per block,
9 per recomputed block and 1 per segment within ``SLOPE_TOLERANCE``.  So a formula may leave out a
constant (the model's input is not an activation, the last block of a segment is not recomputed:
the measurement is exactly ``layers/segment + 9*segment - 2`` tensors, ``9*layers + 1`` without
checkpointing) but not a tensor of every block: counting 8 per block instead of 9 is within 15% of
most configurations and still rejected.

Each verdict says what was observed: the ratio of prediction to measurement when it is the same on
every configuration (0.5: 2 bytes a number), or how much the prediction grows per block, per
recomputed block and per segment against the measurement.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable

from ...checking import Catalogue, CheckFailed, Misconception, checker, require_callable
from ...measure.ch11 import peak_activation_bytes

__all__ = ["CATALOGUE", "check_checkpoint_memory", "CONFIGS", "TOLERANCE", "SLOPE_TOLERANCE"]

CATALOGUE = Catalogue(
    "11.b checkpoint memory",
    Misconception(
        "ignores_recomputation",
        "with checkpointing only the segment inputs are ever held",
        "the prediction does not grow with the length of the segment recomputed in backward, and "
        "equals layers/segment x batch*seq*hidden*4 bytes",
        "during backward each segment is run again before its gradients are computed: its "
        "activations (9 x batch*seq*hidden numbers per block) are alive at the same time as "
        "the segment inputs still waiting",
    ),
    Misconception(
        "recomputes_one_block",
        "backward recomputes one block at a time",
        "the prediction does not grow with the length of the recomputed segment, and holds one "
        "block's 9 tensors beside the segment inputs",
        "a checkpointed segment is recomputed as a whole before backward goes through it: "
        "segment blocks' activations at once, not one block's",
    ),
    Misconception(
        "no_checkpoint_formula",
        "checkpointing does not change the peak, it only costs time",
        "the prediction for 12 blocks is the same with and without segments",
        "that is the peak without checkpointing: with segments of k blocks only layers/k "
        "segment inputs are kept through the forward, plus one segment recomputed",
    ),
    Misconception(
        "elements_not_bytes",
        "memory is counted in numbers",
        "the prediction is exactly 1/4 of a right one: 4 times it passes",
        "return bytes: every fp32 number takes 4 bytes",
    ),
    Misconception(
        "two_bytes_per_number",
        "an activation takes 2 bytes a number, as in bf16 training",
        "the prediction is exactly 1/2 of a right one: twice it passes",
        "2 bytes a number is bf16 or fp16; this stack runs in fp32: 4 bytes a number",
    ),
    Misconception(
        "forgets_expansion",
        "every activation of a block is hidden wide",
        "each block adds 3 x batch*seq*hidden numbers to the prediction instead of 9",
        "fc1 widens to 4*hidden: a block keeps its input (hidden wide), fc1's output (4*hidden, "
        "for GELU's backward) and GELU's output (4*hidden, for fc2's backward)",
    ),
    Misconception(
        "forgets_block_input",
        "a block keeps only what fc1 and GELU produce",
        "each block adds 8 x batch*seq*hidden numbers to the prediction instead of 9",
        "each block also keeps its input, hidden wide: fc1 saves it to compute its weight's "
        "gradient (grad_W = grad_out^T x), so 1 + 4 + 4 = 9 hidden-wide tensors per block",
    ),
)

# (batch, seq, hidden, layers, segment).  The first six come in pairs that differ in one count only
# (see _SLOPES); the last three vary batch, sequence and hidden size.  Small enough to measure in a
# fraction of a second each.
CONFIGS = ((2, 16, 64, 4, None), (2, 16, 64, 12, None),
           (2, 16, 64, 8, 4), (2, 16, 64, 16, 8),
           (2, 16, 64, 12, 4), (2, 16, 64, 24, 4),
           (4, 16, 32, 16, 4), (1, 64, 48, 12, 2), (2, 32, 64, 12, 3))
TOLERANCE = 0.15
SLOPE_TOLERANCE = 0.5  # tensors of batch*seq*hidden numbers, per unit

# name: (index of the smaller config, of the larger one, units added between them, what a unit is,
#        the measured growth per unit in batch*seq*hidden fp32 tensors)
_SLOPES = {
    "block": (0, 1, 8, "block without checkpointing", 9),
    "recomputed block": (2, 3, 4, "block of the segment recomputed in backward", 9),
    "segment": (4, 5, 3, "segment (its input kept through the forward)", 1),
}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / b


def _number(value: object) -> float | None:
    """A returned number as a float (int, float, numpy or 0-d tensor), None for anything else."""
    if hasattr(value, "numel") and hasattr(value, "item") and value.numel() == 1:
        value = value.item()
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


def _slopes(values: list[float]) -> dict[str, float]:
    """Growth per unit of each pair, in batch*seq*hidden fp32 tensors."""
    out = {}
    for name, (i, j, units, _, _) in _SLOPES.items():
        b, s, h = CONFIGS[i][:3]
        out[name] = (values[j] - values[i]) / units / (b * s * h * 4)
    return out


def _fits(predicted: list[float], measured: list[float]) -> bool:
    slopes = _slopes(predicted)
    return (all(_rel(p, m) <= TOLERANCE for p, m in zip(predicted, measured))
            and all(abs(slopes[n] - want) <= SLOPE_TOLERANCE for n, (*_, want) in _SLOPES.items()))


def _verdict(predicted: list[float], measured: list[float]) -> str:
    """What the checker observed, and the misconception it points to ("" when the answer fits)."""
    if _fits(predicted, measured):
        return ""
    ratios = [p / m for p, m in zip(predicted, measured)]
    for factor, key in ((4, "elements_not_bytes"), (2, "two_bytes_per_number")):
        if _fits([p * factor for p in predicted], measured):
            return (f"your predictions are {min(ratios):.2f} to {max(ratios):.2f} of the measured peaks "
                    f"(about 1/{factor}), and exactly {factor} times them would pass, in value and in "
                    "growth per block: " + CATALOGUE.hint(key))
    slopes = _slopes(predicted)
    b, s, h, L, _ = CONFIGS[1]
    same = CONFIGS.index((b, s, h, L, 4))
    if _rel(predicted[same], predicted[1]) <= 0.02:
        return (f"your prediction for {L} blocks is the same with segments of 4 "
                f"({predicted[same] / 2**10:.1f} KiB) as without checkpointing "
                f"({predicted[1] / 2**10:.1f} KiB); measured: "
                f"{measured[same] / 2**10:.1f} and {measured[1] / 2**10:.1f} KiB: "
                + CATALOGUE.hint("no_checkpoint_formula"))
    for name, (*_, unit, want) in _SLOPES.items():
        got = slopes[name]
        if abs(got - want) <= SLOPE_TOLERANCE:
            continue
        seen = (f"your prediction grows by {got:.2f} tensors of batch x seq x hidden fp32 numbers per "
                f"{unit}; the measurement by {want}")
        if name == "block" and abs(got - 8) <= SLOPE_TOLERANCE:
            return seen + ": " + CATALOGUE.hint("forgets_block_input")
        if name == "block" and abs(got - 3) <= SLOPE_TOLERANCE:
            return seen + ": " + CATALOGUE.hint("forgets_expansion")
        if name == "recomputed block" and abs(got) <= SLOPE_TOLERANCE:
            i = _SLOPES["recomputed block"][0]
            bsh = 4 * CONFIGS[i][0] * CONFIGS[i][1] * CONFIGS[i][2]
            beside = predicted[i] / bsh - CONFIGS[i][3] / CONFIGS[i][4]  # beyond the segment inputs
            key = "recomputes_one_block" if abs(beside - 9) <= 1.5 else "ignores_recomputation"
            return seen + ": " + CATALOGUE.hint(key)
        if name == "recomputed block" and abs(got - 8) <= SLOPE_TOLERANCE:
            return seen + ": " + CATALOGUE.hint("forgets_block_input")
        if name == "recomputed block" and abs(got - 3) <= SLOPE_TOLERANCE:
            return seen + ": " + CATALOGUE.hint("forgets_expansion")
        return seen + (": count again what autograd keeps per block (its input, fc1's and GELU's "
                       "outputs), the segment inputs kept through the forward, and the one segment "
                       "recomputed during backward")
    return ("the counts per block and per segment are right, but the total is off: check the terms "
            "that do not grow with the stack (what is counted once)")


@checker("11.b checkpoint memory", in_process=True)
def check_checkpoint_memory(predict_peak_activation_bytes: Callable) -> None:
    """The learner's prediction against the measured peak on each of ``CONFIGS``, value and growth."""
    require_callable(predict_peak_activation_bytes,
                     "predict_peak_activation_bytes(batch, seq, hidden, layers, segment)")
    predicted, measured = [], []
    for b, s, h, L, k in CONFIGS:
        value = predict_peak_activation_bytes(b, s, h, L, k)
        got = _number(value)
        if got is None:
            raise CheckFailed(f"predict_peak_activation_bytes({b}, {s}, {h}, {L}, {k}) returned a "
                              f"{type(value).__name__}, expected a number of bytes")
        predicted.append(got)
        measured.append(peak_activation_bytes(L, k, batch=b, seq=s, hidden=h))
    verdict = _verdict(predicted, measured)
    if not verdict:
        return
    rows = []
    for (b, s, h, L, k), got, want in zip(CONFIGS, predicted, measured):
        ok = _rel(got, want) <= TOLERANCE
        rows.append(f"  batch={b:<2} seq={s:<3} hidden={h:<3} layers={L:<3} segment={str(k):<5}"
                    f" predicted {got / 2**10:9.1f} KiB  measured {want / 2**10:9.1f} KiB  "
                    f"{'within 15%' if ok else 'OFF':>10} ({(got - want) / want:+.0%})")
    raise CheckFailed("the prediction does not match the measured peaks:\n" + "\n".join(rows)
                      + f"\n{verdict}")
