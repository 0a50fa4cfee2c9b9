"""11.b The activation peak of a checkpointed stack: ``check_checkpoint_memory(predict)``.

The learner writes ``predict_peak_activation_bytes(batch, seq, hidden, layers, segment)``: the peak
bytes of activations during one training step (forward and backward) of ``layers`` fp32
``MLPBlock``s (``x + fc2(gelu(fc1(x)))``, ``fc1: hidden -> 4*hidden``), where every ``segment``
consecutive blocks form one checkpoint (``segment=None``: no checkpointing).

The checker measures each configuration with ``course_utils.measure.ch11.peak_activation_bytes``
(a dispatch mode that counts the bytes of every tensor created while autograd records, until it is
freed) and accepts a prediction within ``TOLERANCE`` of the measurement.  The formula of the
lesson, ``(layers/segment + 9*segment) * batch*seq*hidden * 4`` bytes, is within 10% on every
configuration here: what it leaves out (the model's input is not an activation, the last block of a
segment is not recomputed, the loss) is one or two ``batch*seq*hidden`` tensors.
"""

from __future__ import annotations

from collections.abc import Callable

from ...checking import Catalogue, CheckFailed, Misconception, as_float, checker, require_callable
from ...measure.ch11 import peak_activation_bytes

__all__ = ["CATALOGUE", "check_checkpoint_memory", "CONFIGS", "TOLERANCE"]

CATALOGUE = Catalogue(
    "11.b checkpoint memory",
    Misconception(
        "ignores_recomputation",
        "with checkpointing only the segment inputs are ever held",
        "the prediction is layers/segment x batch*seq*hidden*4 bytes",
        "during backward each segment is run again before its gradients are computed: its "
        "activations (9 x batch*seq*hidden numbers per block) are alive at the same time as "
        "the segment inputs still waiting",
    ),
    Misconception(
        "recomputes_one_block",
        "backward recomputes one block at a time",
        "the prediction adds one block's activations, whatever the segment length",
        "a checkpointed segment is recomputed as a whole before backward goes through it: "
        "segment blocks' activations at once, not one block's",
    ),
    Misconception(
        "no_checkpoint_formula",
        "checkpointing does not change the peak, it only costs time",
        "the prediction is 9 x layers x batch*seq*hidden*4 bytes for every segment length",
        "that is the peak without checkpointing: with segments of k blocks only layers/k "
        "segment inputs are kept through the forward, plus one segment recomputed",
    ),
    Misconception(
        "elements_not_bytes",
        "memory is counted in numbers",
        "the prediction is the measurement divided by 4",
        "return bytes: every fp32 number takes 4 bytes",
    ),
    Misconception(
        "forgets_expansion",
        "every activation of a block is hidden wide",
        "the prediction counts 3 x batch*seq*hidden numbers per block instead of 9",
        "fc1 widens to 4*hidden: a block keeps its input (hidden wide), fc1's output (4*hidden, "
        "for GELU's backward) and GELU's output (4*hidden, for fc2's backward)",
    ),
)

# (batch, seq, hidden, layers, segment): small enough to measure in a fraction of a second.
CONFIGS = ((2, 32, 64, 4, None), (2, 32, 64, 12, 3), (4, 16, 32, 16, 4), (1, 64, 48, 12, 2),
           (2, 16, 64, 9, 3))
TOLERANCE = 0.15

# What each misconception predicts, in units of batch*seq*hidden numbers (x4 bytes unless said).
_WRONG: dict[str, Callable[[int, int | None], float]] = {
    "ignores_recomputation": lambda L, k: L / k if k else 9 * L,
    "recomputes_one_block": lambda L, k: L / k + 9 if k else 9 * L,
    "no_checkpoint_formula": lambda L, k: 9 * L,
    "elements_not_bytes": lambda L, k: (L / k + 9 * k if k else 9 * L) / 4,
    "forgets_expansion": lambda L, k: L / k + 3 * k if k else 3 * L,
}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / b


@checker("11.b checkpoint memory")
def check_checkpoint_memory(predict_peak_activation_bytes: Callable) -> None:
    """The learner's prediction against the measured peak on each of ``CONFIGS``."""
    require_callable(predict_peak_activation_bytes,
                     "predict_peak_activation_bytes(batch, seq, hidden, layers, segment)")
    rows, bad = [], []
    predicted, measured = [], []
    for b, s, h, L, k in CONFIGS:
        got = as_float(predict_peak_activation_bytes(b, s, h, L, k))
        if isinstance(got, tuple):
            raise CheckFailed(f"predict_peak_activation_bytes({b}, {s}, {h}, {L}, {k}) returned a "
                              f"{got[1]}, expected a number of bytes")
        want = peak_activation_bytes(L, k, batch=b, seq=s, hidden=h)
        predicted.append(got)
        measured.append(want)
        ok = _rel(got, want) <= TOLERANCE
        rows.append(f"  batch={b:<2} seq={s:<3} hidden={h:<3} layers={L:<3} segment={str(k):<5}"
                    f" predicted {got / 2**10:9.1f} KiB  measured {want / 2**10:9.1f} KiB  "
                    f"{'ok' if ok else 'OFF'} ({(got - want) / want:+.0%})")
        if not ok:
            bad.append((b, s, h, L, k))
    if not bad:
        return
    table = "\n".join(rows)
    hint = ""
    for key, formula in _WRONG.items():
        guesses = [formula(L, k) * b * s * h * 4 for b, s, h, L, k in CONFIGS]
        if all(_rel(p, g) <= 0.02 for p, g in zip(predicted, guesses)):
            hint = CATALOGUE.hint(key)
            break
    raise CheckFailed(
        f"the prediction is off by more than {TOLERANCE:.0%} of the measured peak on "
        f"{len(bad)} of {len(CONFIGS)} configurations:\n{table}"
        + (f"\nUsual mistake: {hint}" if hint else
           "\nCount per block the tensors autograd keeps (its input, fc1's and GELU's outputs), the "
           "segment inputs kept through the forward, and one segment recomputed during backward."))
