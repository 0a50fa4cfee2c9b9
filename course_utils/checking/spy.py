"""``CollectiveSpy``: watch the collectives the learner's code runs, and put everything back after.

::

    with CollectiveSpy(("all_reduce",)) as spy:
        loss.backward()
        learner.finish()
    [c.op for c in spy.calls]            # which collectives ran
    spy.calls[0].in_backward             # started while autograd ran backward (a hook), or not
    spy.calls[0].async_op, .waited       # asynchronous, and whether its handle was waited for

Each call is recorded with the tensor it was given (a live reference: compare it with ``p.grad``
by ``data_ptr``), its size, whether it started inside backward (autograd's graph task is running
on this thread), the ``phase`` and ``step`` labels the checker set, and for an asynchronous call a
wrapped handle that notes ``wait()``.  The functions are replaced in ``torch.distributed`` and in
``torch.distributed.distributed_c10d`` (what ``torch.distributed.nn`` and DDP's Python call), and
restored on the way out, also when the learner's code raised.  This is the one place of the course
that replaces ``dist.all_reduce``.

``annotate(op, tensor)`` (optional) adds a checker's own observations to each call (which
parameter's gradient the tensor is, say); ``record=False`` pauses recording while the checker runs
its own reference with the spy installed.

``forbid`` names functions whose calls are noted in ``spy.forbidden``; with ``refuse`` (an
exception type) a forbidden call raises ``refuse("dist.<op> is not allowed in this exercise")``
instead of running, so that the learner's code stops at the line that called it.  A
point-to-point call records its peer (``Call.peer``: the ``dst`` of a send, the ``src`` of a recv).
Calls that torch makes inside a watched call (``dist.send`` runs ``isend``) are not recorded.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["Call", "CollectiveSpy", "COLLECTIVES"]

# Every collective and point-to-point function a learner may call from torch.distributed.
COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather",
    "all_gather_into_tensor", "all_gather_object", "all_gather_coalesced", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter",
    "broadcast_object_list", "barrier", "monitored_barrier", "send", "recv", "isend", "irecv",
    "batch_isend_irecv",
)
_ASYNC_BY_NATURE = {"isend", "irecv", "batch_isend_irecv"}
_PEER = {"send": "dst", "isend": "dst", "recv": "src", "irecv": "src"}


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor):
            return v
        if isinstance(v, (list, tuple)) and v and isinstance(v[0], torch.Tensor):
            return v[0]
    return None


@dataclasses.dataclass
class Call:
    """One collective the learner's code started."""

    op: str
    tensor: torch.Tensor | None
    async_op: bool
    in_backward: bool
    phase: str | None
    step: int
    extra: dict = dataclasses.field(default_factory=dict)
    peer: int | None = None  # send/isend: the destination; recv/irecv: the source (None: any)
    # Every time its handle was waited for: (phase, step) labels of the spy at that moment.  A
    # handle kept and waited for again in a later step shows up as a second entry.
    waits: list[tuple[str | None, int]] = dataclasses.field(default_factory=list)

    @property
    def waited(self) -> bool:
        return bool(self.waits)

    @property
    def waited_in_phase(self) -> str | None:
        """The phase of the first wait (None when never waited for)."""
        return self.waits[0][0] if self.waits else None

    @property
    def waited_at_step(self) -> int | None:
        return self.waits[0][1] if self.waits else None

    def waited_during(self, step: int, phase: str | None = None) -> bool:
        """Whether its handle was waited for in ``step`` (and in ``phase``, when given)."""
        return any(s == step and (phase is None or ph == phase) for ph, s in self.waits)

    @property
    def nbytes(self) -> int:
        t = self.tensor
        return 0 if t is None else t.numel() * t.element_size()

    @property
    def shape(self) -> tuple[int, ...]:
        return () if self.tensor is None else tuple(self.tensor.shape)


class _WatchedWork:
    """A collective's handle that notes when it is waited for (or completion is asked about)."""

    def __init__(self, work: Any, call: Call, spy: CollectiveSpy):
        self._work, self._call, self._spy = work, call, spy

    def _note(self) -> None:
        now = (self._spy.phase, self._spy.step)
        if not self._call.waits or self._call.waits[-1] != now:  # polling notes a wait once
            self._call.waits.append(now)

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self._note()
        return self._work.wait(*args, **kwargs)

    def get_future(self) -> Any:
        self._note()  # torch.futures.wait_all(...) and .then(...) chains
        return self._work.get_future()

    def is_completed(self) -> bool:
        done = self._work.is_completed()
        if done:
            self._note()
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class CollectiveSpy:
    """Record calls of ``ops`` (names in ``torch.distributed``) while installed; see the module doc."""

    def __init__(self, ops: Iterable[str] = ("all_reduce",), *,
                 annotate: Callable[[str, torch.Tensor | None], dict] | None = None,
                 forbid: Iterable[str] = (),
                 refuse: Callable[[str], BaseException] | None = None):
        self.ops = tuple(ops)
        self.forbid = tuple(forbid)
        self.annotate = annotate
        self.calls: list[Call] = []
        self.forbidden: list[str] = []
        self.refuse = refuse
        self._inside = threading.local()  # per thread: inside a watched call
        self.phase: str | None = None
        self.step = 0
        self.recording = True
        self._saved: list[tuple[Any, str, Any]] = []

    # -- what the checker reads ------------------------------------------------------------
    def of(self, op: str) -> list[Call]:
        return [c for c in self.calls if c.op == op]

    def in_phase(self, phase: str) -> list[Call]:
        return [c for c in self.calls if c.phase == phase]

    def unwaited(self) -> list[Call]:
        return [c for c in self.calls if c.async_op and not c.waited]

    def clear(self) -> None:
        self.calls.clear()
        self.forbidden.clear()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Let the checker's own reference communicate without being recorded."""
        before, self.recording = self.recording, False
        try:
            yield
        finally:
            self.recording = before

    # -- installing and restoring ----------------------------------------------------------
    def _wrap(self, op: str, real: Callable) -> Callable:
        spy = self

        @functools.wraps(real)
        def watched(*args: Any, **kwargs: Any) -> Any:
            if not spy.recording or getattr(spy._inside, "call", False):
                # torch's own calls inside a watched one (dist.send runs isend) are not the learner's
                return real(*args, **kwargs)
            if op in spy.forbid:
                spy.forbidden.append(op)
                if spy.refuse is not None:  # the call does not run: the learner's code stops here
                    raise spy.refuse(f"dist.{op} is not allowed in this exercise")
            tensor = _first_tensor(args, kwargs)
            async_op = bool(kwargs.get("async_op", False)) or op in _ASYNC_BY_NATURE
            call = Call(op, tensor, async_op, torch._C._current_graph_task_id() != -1,
                        spy.phase, spy.step)
            if op in _PEER:
                call.peer = args[1] if len(args) > 1 else kwargs.get(_PEER[op])
            if spy.annotate is not None:
                call.extra = spy.annotate(op, tensor)
            if op == "batch_isend_irecv":  # what the batch holds: [("isend", peer), ("irecv", peer)...]
                ops = args[0] if args else kwargs["p2p_op_list"]
                call.extra = {**call.extra, "p2p": [(p.op.__name__, p.peer) for p in ops]}
            spy.calls.append(call)
            spy._inside.call = True
            try:
                work = real(*args, **kwargs)
            finally:
                spy._inside.call = False
            if async_op and work is not None and op != "batch_isend_irecv":
                return _WatchedWork(work, call, spy)
            if op == "batch_isend_irecv" and isinstance(work, list):
                return [_WatchedWork(w, call, spy) for w in work]
            return work

        return watched

    def __enter__(self) -> CollectiveSpy:
        for op in dict.fromkeys(self.ops + self.forbid):
            real = getattr(c10d, op, None) or getattr(dist, op)
            watched = self._wrap(op, real)
            for module in (dist, c10d):
                if hasattr(module, op):
                    self._saved.append((module, op, getattr(module, op)))
                    setattr(module, op, watched)
        return self

    def __exit__(self, *exc: Any) -> None:
        while self._saved:
            module, op, real = self._saved.pop()
            setattr(module, op, real)
