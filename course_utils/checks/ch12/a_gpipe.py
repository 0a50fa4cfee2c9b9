"""12.a A GPipe schedule with send/recv: ``check_gpipe(gpipe_step)``.

The learner writes one training step of a model cut into stages, one stage per rank::

    gpipe_step(stage, inputs, targets, loss_fn, n_micro, act_shape) -> loss (last rank) or None

- ``stage``     this rank's slice of the model (an ``nn.Module``);
- ``inputs``    the whole batch on rank 0, ``None`` elsewhere;
- ``targets``   the whole batch's targets on the last rank, ``None`` elsewhere;
- ``loss_fn``   ``loss_fn(output, target)``, a mean over the micro-batch;
- ``n_micro``   how many micro-batches the batch is cut into;
- ``act_shape`` the shape of one micro-batch's activation between two stages (to allocate receives).

After the call every stage's parameters hold the gradient of the whole batch's loss, as the
single-process model would have them.  The checker runs it on 2 and 4 ranks with stage modules that
record every forward and every backward (a hook on each output), and counts the point-to-point
messages with ``CollectiveSpy``: each stage must run all its forwards before its first backward
(GPipe), send one activation forward and one gradient back per micro-batch, and end with the
reference gradients.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from ...checking import (
    Call,
    Catalogue,
    CheckFailed,
    CollectiveSpy,
    Misconception,
    Outcome,
    checker,
    diff_table,
    format_table,
    learner_frames,
    process_group,
    require_callable,
    run_workers,
)
from ...workers.errors import RankFailure, indent

__all__ = ["CATALOGUE", "check_gpipe", "RecordingStage", "pipeline_model", "P2P_OPS"]

CATALOGUE = Catalogue(
    "12.a GPipe schedule",
    Misconception(
        "backward_before_all_forwards",
        "each micro-batch can go forward and backward before the next one starts",
        "a stage's backward hook fires before its last forward",
        "GPipe runs every micro-batch's forward on a stage before the first backward "
        "(all forwards, then all backwards)",
    ),
    Misconception(
        "loss_not_scaled",
        "each micro-batch's mean loss can be backpropagated as it is",
        "every gradient is n_micro times the reference",
        "divide each micro-batch's loss by the number of micro-batches",
    ),
    Misconception(
        "no_gradients_returned",
        "autograd follows an activation across dist.send, so the last stage's backward reaches every stage",
        "a stage before the last ends with no gradient, and no gradient message goes back",
        "send() copies bytes and cuts the graph: the receiving stage must send the gradient of "
        "each activation it received back to the stage before, which calls output.backward(grad)",
    ),
    Misconception(
        "no_saved_activations",
        "a stage can forget a micro-batch once its activation has been sent on",
        "backward through a freed graph (or a tensor without grad_fn), or a forward count that is off",
        "keep every micro-batch's input and output on each stage until its backward "
        "(a list indexed by micro-batch, not one variable overwritten in the loop)",
    ),
    Misconception(
        "split_not_chunk",
        "inputs.split(n_micro) cuts the batch into n_micro micro-batches",
        "stage 0 sends a tensor of n_micro rows where the receiver's buffer is act_shape",
        "split(k) makes pieces of k rows, chunk(k) makes k pieces: cut the batch with "
        "inputs.chunk(n_micro) (or torch.tensor_split(inputs, n_micro))",
    ),
    Misconception(
        "input_not_requiring_grad",
        "autograd fills in the gradient of any tensor the stage ran on",
        "a stage sends None back (x.grad of a received tensor that never required a gradient)",
        "call x.requires_grad_() on each received activation before the stage runs on it: "
        "autograd computes .grad only for tensors that require it",
    ),
    Misconception(
        "reused_receive_buffer",
        "one receive buffer can serve every micro-batch",
        "the activations from the previous stage were received into the same tensor each time, "
        "and the gradients differ",
        "each micro-batch's received activation must live until its backward: allocate a new "
        "buffer for every recv (torch.empty(act_shape) inside the loop); a reused one is "
        "overwritten by the next micro-batch, and so is the input its graph saved",
    ),
    Misconception(
        "backward_order_mismatch",
        "each stage may run its backwards in whatever order it likes",
        "two neighbouring stages ran their micro-batches' backwards in different orders",
        "messages between two ranks arrive in the order they were sent: stage r receives the "
        "gradients in the order stage r+1 runs its backwards, so every stage must take the "
        "micro-batches in the same backward order (all reversed, or all in order)",
    ),
    Misconception(
        "zero_grad_between_micro_batches",
        "gradients are cleared after each micro-batch, as after each step",
        "stage.zero_grad() ran between two micro-batches' backwards",
        "the micro-batches' gradients must add up to the batch's: do not zero them between "
        "micro-batches (zero_grad belongs before the step, or after the optimizer step)",
    ),
    Misconception(
        "both_ranks_send",
        "a send returns at once, whatever the peer does",
        "the ranks hang, each in a blocking send to the other",
        "a blocking send() waits until the peer receives; two stages that send to each other at "
        "the same moment both wait forever. In the backward, stage r receives the gradient of its "
        "output from stage r+1 (recv) and sends the gradient of its input to stage r-1 (send): "
        "check which of the two each call should be",
    ),
    Misconception(
        "receive_order_deadlock",
        "post every receive a micro-batch needs first, then the sends",
        "the ranks hang, each in a blocking recv the other has not sent for",
        "a blocking recv() waits until the peer sends; when stage r waits for the gradient "
        "from stage r+1 before sending it the activation that stage r+1 waits for, both wait "
        "forever. Receive the activation, compute, send it on, and only in the backward phase "
        "receive the gradient (or post the receives with irecv and wait later)",
    ),
)

WIDTH = 16
LAYERS = 8
BATCH = 12
CASES = ((2, 4), (4, 6))  # (stages, micro-batches)
TIMEOUT = 20.0  # seconds: a correct step takes well under one; a deadlock fails in this time
ATOL = 1e-5
P2P_OPS = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
_KIND = {"send": "sent", "isend": "sent", "recv": "received", "irecv": "received"}


def pipeline_model(seed: int = 0, width: int = WIDTH, layers: int = LAYERS) -> nn.Sequential:
    """The model the checker cuts into stages: ``layers`` Linear+Tanh blocks of equal width."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        blocks: list[nn.Module] = []
        for _ in range(layers):
            blocks += [nn.Linear(width, width), nn.Tanh()]
        return nn.Sequential(*blocks)


class RecordingStage(nn.Module):
    """A stage that notes each forward ("F", or "F no_grad") and each backward ("B") in ``log``.

    The backward is seen by a hook on the output: it fires when the gradient of that output is
    computed, which is when this stage's backward of that micro-batch starts.
    """

    def __init__(self, inner: nn.Module, log: list[str]):
        super().__init__()
        self.inner = inner
        self.log = log
        self.backward_order: list[int] = []  # the micro-batches (by forward index), as their backward ran
        self._forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        self.log.append("F" if torch.is_grad_enabled() else "F no_grad")
        if out.requires_grad:
            k = self._forwards
            out.register_hook(lambda grad: self._backward_seen(k))
        self._forwards += 1
        return out

    def _backward_seen(self, k: int) -> None:
        self.log.append("B")
        self.backward_order.append(k)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.log.append("Z")
        super().zero_grad(set_to_none=set_to_none)


def _data(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        return torch.randn(BATCH, WIDTH).to(device), torch.randn(BATCH, WIDTH).to(device)


def _worker(learner_fn, n_micro: int) -> Outcome:
    with process_group() as pg:
        rank, world, dev = pg.rank, pg.world, pg.device
        first, last = rank == 0, rank == world - 1
        x, y = _data(dev)
        full = pipeline_model().to(dev)
        F.mse_loss(full(x), y).backward()  # the single-process reference, on every rank
        per = len(full) // world
        mine = full[rank * per:(rank + 1) * per]
        ref = {n: p.grad.detach().clone() for n, p in mine.named_parameters()}
        with torch.no_grad():
            ref_loss = F.mse_loss(full(x), y).item()
        inner = pipeline_model().to(dev)[rank * per:(rank + 1) * per]
        log: list[str] = []
        stage = RecordingStage(inner, log)

        act_shape = (BATCH // n_micro, WIDTH)

        def note(op: str, tensor: torch.Tensor | None) -> dict:
            log.append(op)  # interleaved with the stage's forwards and backwards
            _check_message(op, tensor, rank, n_micro, act_shape)  # before it is sent: no crash in gloo
            return {}

        with CollectiveSpy(P2P_OPS, annotate=note) as spy:
            result = learner_fn(stage, x if first else None, y if last else None, F.mse_loss,
                                n_micro, act_shape)
        got = {n: (p.grad.detach().clone() if p.grad is not None else None)
               for n, p in inner.named_parameters()}
        messages = _messages(spy.calls, rank)
        received = [c.tensor.data_ptr() for c in spy.calls
                    if c.op in ("recv", "irecv") and c.peer == rank - 1 and c.tensor is not None]
        backs = [i for i, e in enumerate(log) if e == "B"]
        data = {"log": log, "messages": messages, "backward_order": stage.backward_order,
                "reused_buffer": len(set(received)) < len(received),
                "zero_grad_between": bool(backs) and any(e == "Z" for e in log[backs[0]:backs[-1]])}
        problem = _judge_rank(rank, world, n_micro, log, messages, ref, got, result, ref_loss)
        return Outcome(rank, problem=problem, data=data)


class BadMessage(Exception):
    """A message the checker stopped before it was sent or received (its shape would crash gloo)."""


def _check_message(op: str, tensor: torch.Tensor | None, rank: int, n_micro: int,
                   act_shape: tuple[int, int]) -> None:
    if op not in ("send", "recv", "isend", "irecv"):
        return
    if tensor is None:
        if op in ("send", "isend"):
            hint = CATALOGUE.hint("input_not_requiring_grad")
            raise BadMessage(f"stage {rank} sent None: x.grad of a received activation is None "
                             f"after the backward. Usual mistake: {hint}.")
        return
    if tuple(tensor.shape) == act_shape:
        return
    shape = tuple(tensor.shape)
    if op in ("send", "isend"):
        head = (f"stage {rank} was about to send a tensor of shape {shape}, while the receiving stage's "
                f"buffer has act_shape {act_shape} (gloo aborts the receiving process on such a message; "
                f"the checker stopped it first).")
        if rank == 0 and shape[0] == n_micro and act_shape[0] != n_micro:
            return_hint = f" Usual mistake: {CATALOGUE.hint('split_not_chunk')}."
        else:
            return_hint = " Every activation and gradient between two stages has the shape act_shape."
        raise BadMessage(head + return_hint)
    raise BadMessage(f"stage {rank} posted a receive into a buffer of shape {shape}; the activations and "
                     f"their gradients have act_shape {act_shape}: allocate it with "
                     f"torch.empty(act_shape, device=...) (or torch.empty_like(output) for a gradient).")


def _messages(calls: list[Call], rank: int) -> dict[str, int]:
    """Messages this rank sent and received, by direction: ``{"sent to 1": 4, "received from 1": 4}``."""
    out: dict[str, int] = {}
    for c in calls:
        ops = c.extra.get("p2p", []) if c.op == "batch_isend_irecv" else [(c.op, c.peer)]
        for op, peer in ops:
            key = f"{_KIND[op]} {'to' if _KIND[op] == 'sent' else 'from'} {peer}"
            out[key] = out.get(key, 0) + 1
    return out


def _shown(counts: dict[str, int]) -> str:
    return ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "none"


def _judge_rank(rank, world, n_micro, log, messages, ref, got, result, ref_loss) -> str:
    first, last = rank == 0, rank == world - 1
    where = f"stage {rank} of {world}, {n_micro} micro-batches"
    forwards = [i for i, e in enumerate(log) if e == "F"]
    backwards = [i for i, e in enumerate(log) if e == "B"]
    if len(forwards) != n_micro:
        extra = " (some ran under torch.no_grad())" if "F no_grad" in log else ""
        return (f"{where}: the stage ran {len(forwards)} forward(s) with autograd on{extra}, "
                f"expected one per micro-batch ({n_micro}). Cut the batch with inputs.chunk(n_micro) "
                f"(or torch.tensor_split) and run each piece through the stage once. "
                f"Usual mistake: {CATALOGUE.hint('no_saved_activations')}")
    if backwards and backwards[0] < forwards[-1]:
        order = " ".join(e for e in log if e in ("F", "B"))
        return (f"{where}: forwards and backwards ran in the order {order}. "
                f"{CATALOGUE.hint('backward_before_all_forwards')}.")
    if not last and all(g is None for g in got.values()):
        back = messages.get(f"received from {rank + 1}", 0)
        return (f"{where}: the stage's parameters have no gradient after the step (it received "
                f"{back} message(s) from stage {rank + 1}). "
                f"Usual mistake: {CATALOGUE.hint('no_gradients_returned')}.")
    want = {}
    if not first:
        want |= {f"received from {rank - 1}": n_micro, f"sent to {rank - 1}": n_micro}
    if not last:
        want |= {f"sent to {rank + 1}": n_micro, f"received from {rank + 1}": n_micro}
    if messages != want:
        return (f"{where}: the stage's messages were: {_shown(messages)}; expected {_shown(want)} "
                f"(one activation forward and one gradient back per micro-batch and neighbour).")
    missing = [n for n, g in got.items() if g is None]
    if missing:
        return f"{where}: no gradient for {', '.join(missing)} after the step."
    rows = diff_table(ref, got)
    worst = max(d for _, d, _ in rows)
    if worst > ATOL:
        ratios = [float((got[n] * ref[n]).sum() / (ref[n] * ref[n]).sum()) for n in ref
                  if float(ref[n].abs().max()) > 1e-6]
        hint = ""
        if ratios and all(abs(r - n_micro) < 1e-3 * n_micro for r in ratios):
            hint = (f"\nEvery gradient is {n_micro} times the reference. Usual mistake: "
                    f"{CATALOGUE.hint('loss_not_scaled')}.")
        return (f"{where}: gradients differ from the single-process model by up to {worst:.3g}:\n"
                f"{format_table(rows, ATOL)}{hint}")
    if last:
        try:
            loss = float(result)
        except (TypeError, ValueError):
            return (f"{where}: the last stage returned {type(result).__name__}; expected the "
                    f"batch's loss (a number: the sum of the scaled micro-batch losses).")
        if abs(loss - ref_loss) > 1e-4 * max(1.0, abs(ref_loss)):
            return (f"{where}: the last stage returned the loss {loss:.6g}, the single-process "
                    f"model's loss is {ref_loss:.6g}. Return the sum of the scaled micro-batch losses.")
    return ""


def _without_torch(frames: str) -> str:
    """The learner's frames without autograd's own (torch/_tensor.py, torch/autograd/...)."""
    out, skip = [], False
    for line in frames.splitlines():
        if line.strip().startswith("File "):
            skip = "site-packages/torch/" in line
        elif not line.startswith(("    ", "\t")):
            skip = False
        if not skip:
            out.append(line)
    return "\n".join(out)


def _explain_error(f: RankFailure) -> str | None:
    if f.kind == "exception" and f.exc_type == "BadMessage":
        frames = [line for line in _without_torch(learner_frames(f.traceback)).splitlines()
                  if "BadMessage" not in line]  # the message itself is said above them
        return f"rank {f.rank}: {f.message}\n" + indent("\n".join(frames))
    freed = ("backward through the graph a second time", "does not require grad",
             "Trying to backward")
    if f.kind == "exception" and any(s in f.message for s in freed):
        return (f"rank {f.rank}: your code raised {f.exc_type}: {f.message.splitlines()[0]}\n"
                f"{indent(_without_torch(learner_frames(f.traceback)))}\n"
                f"The graph of a micro-batch was gone when its backward came. "
                f"Usual mistake: {CATALOGUE.hint('no_saved_activations')}.")
    return None


_FRAME = re.compile(r'File "([^"]+)", line (\d+) in (\w+)')
_P2P_FRAMES = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}


def _stuck_in(stack: str) -> str:
    """"send", "recv" or "" (elsewhere): where a hung rank waits, from its stack (innermost first)."""
    lines = stack.splitlines()
    for i, line in enumerate(lines):
        m = _FRAME.search(line)
        if not m:
            continue
        if "torch/distributed" in m.group(1) and m.group(3) in _P2P_FRAMES:
            return _P2P_FRAMES[m.group(3)]
        if "torch/" not in m.group(1) and "course_utils/" not in m.group(1):
            code = lines[i + 1] if i + 1 < len(lines) else ""  # the learner's line: irecv(...).wait()
            for name in ("irecv", "isend", "recv", "send"):
                if name in code:
                    return _P2P_FRAMES[name]
            return ""
    return ""


def _explain_hang(stacks: dict[int, str]) -> str | None:
    """Name the deadlock from where each stuck rank waits: all in send, all in recv, or a mix."""
    where = {r: _stuck_in(s) for r, s in sorted(stacks.items())}
    shown = "\n".join(f"rank {r} waits in {w or 'something other than send/recv'}:\n"
                      f"{indent(_without_torch(learner_frames(stacks[r])) or '(no stack)')}"
                      for r, w in where.items())
    if where and all(w == "send" for w in where.values()):
        return (f"your step hung: rank(s) {', '.join(map(str, where))} all wait in a blocking send, "
                f"none in a receive.\n{shown}\nUsual mistake: {CATALOGUE.hint('both_ranks_send')}")
    if where and all(w == "recv" for w in where.values()):
        return (f"your step hung: rank(s) {', '.join(map(str, where))} all wait in a blocking recv, "
                f"none is sending.\n{shown}\nUsual mistake: {CATALOGUE.hint('receive_order_deadlock')}")
    if where and all(where.values()):
        return (f"your step hung: the ranks wait in sends and receives that do not pair up (a send to "
                f"stage r+1 must meet a recv from stage r there, in the same order, the same number "
                f"of times).\n{shown}")
    return (f"your step hung: after the time limit rank(s) {', '.join(map(str, where))} were still "
            f"running, not all in a send or a receive (a loop that never ends?).\n{shown}")


def _cross_rank_hint(outcomes: list[Outcome]) -> str:
    """A cause seen across ranks or in the stage's record, for gradients that differ."""
    data = {o.rank: o.data for o in outcomes}
    for r in sorted(data):
        if data[r].get("zero_grad_between"):
            return (f"stage {r} ran zero_grad() between two backwards.\nUsual mistake: "
                    + CATALOGUE.hint("zero_grad_between_micro_batches"))
    for r in sorted(data):
        if data[r].get("reused_buffer"):
            return (f"stage {r} received every activation from stage {r - 1} into the same tensor.\n"
                    f"Usual mistake: " + CATALOGUE.hint("reused_receive_buffer"))
    for r in sorted(data):
        nxt = data.get(r + 1)
        if nxt and data[r].get("backward_order") and nxt.get("backward_order") and \
                data[r]["backward_order"] != nxt["backward_order"]:
            return (f"stage {r} ran the backwards of micro-batches {data[r]['backward_order']}, stage "
                    f"{r + 1} in the order {nxt['backward_order']}, so stage {r} applied each gradient it "
                    f"received to another micro-batch.\nUsual mistake: "
                    + CATALOGUE.hint("backward_order_mismatch"))
    return ""


@checker("12.a GPipe schedule")
def check_gpipe(gpipe_step, *, cases=CASES, timeout: float = TIMEOUT) -> None:
    """Run ``gpipe_step`` on 2 and 4 stages; see the module docstring for what is watched."""
    require_callable(gpipe_step, "gpipe_step(stage, inputs, targets, loss_fn, n_micro, act_shape)")
    for world, n_micro in cases:
        results = run_workers(_worker, world, args=(gpipe_step, n_micro), timeout=timeout,
                              explain_hang=_explain_hang, explain_error=_explain_error)
        ended = [r for r, o in enumerate(results) if not isinstance(o, Outcome)]
        if ended:
            raise CheckFailed(f"on {world} stages, rank(s) {', '.join(map(str, ended))} ended the process "
                              f"without returning from gpipe_step (the worker exited with no result: "
                              f"os._exit() or sys.exit(0) in your code?); return from it instead.")
        outcomes = sorted(results, key=lambda o: o.rank)
        for o in outcomes:
            if o.problem:
                hint = _cross_rank_hint(outcomes) if "gradients differ" in o.problem else ""
                seen = f"\nWhat the checker saw: {hint}." if hint else ""
                raise CheckFailed(f"rank {o.rank}: {o.problem}{seen}")
