"""What the learner's AMP step did, in order: the calls 08.a's checker records while the step runs.

- ``deprecated_amp_calls(log)`` notes each use of the deprecated ``torch.cuda.amp.autocast`` /
  ``GradScaler`` (the calls still run);
- ``Recorder(model, optimizer, scaler)`` turns one step into a list of events: ``('autocast',
  device, dtype)``, ``'scale'``, ``'get_scale'``, ``'unscale_'``, ``'clip'``, ``'scaler.step'``,
  ``'optimizer.step'``, ``'update'``, ``'zero_grad'``, and ``'allreduce'`` when this rank's backward
  reached DDP's all-reduce.  The ``unscale_`` and ``optimizer.step`` that ``scaler.step`` calls
  itself are not events: the list holds the learner's own calls.

Both are context managers that put back everything they replaced, also when the step raised.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

__all__ = ["deprecated_amp_calls", "Recorder"]


@contextlib.contextmanager
def deprecated_amp_calls(log: list[str]) -> Iterator[list[str]]:
    """Record, in ``log``, each use of the deprecated ``torch.cuda.amp.autocast`` / ``GradScaler``.

    The calls still run (they are torch's own classes); only their use is noted, on CPU as on GPU.
    """

    def recording(name: str, cls: type) -> Any:
        def make(*args: Any, **kwargs: Any) -> Any:
            log.append(f"torch.cuda.amp.{name}")
            return cls(*args, **kwargs)
        return make

    with contextlib.ExitStack() as stack:
        for name in ("autocast", "GradScaler"):
            stack.enter_context(mock.patch.object(torch.cuda.amp, name,
                                                  recording(name, getattr(torch.cuda.amp, name))))
        yield log


class Recorder:
    """The learner's step as a list of events (see the module doc); ``events`` is cleared by the
    checker before each step, ``deprecated`` lists the deprecated calls."""

    def __init__(self, model, opt, scaler):
        self.events: list[Any] = []
        self.deprecated: list[str] = []
        self.in_scaler_step = False
        self.model, self.opt, self.scaler = model, opt, scaler
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Recorder:
        model, opt, scaler, ev = self.model, self.opt, self.scaler, self.events
        with contextlib.ExitStack() as stack:  # undone at once if installing fails half-way
            def wrap(owner: Any, name: str, tag: Any, *, guard: bool = False) -> None:
                real = getattr(owner, name)

                def f(*args: Any, **kwargs: Any) -> Any:
                    if guard and self.in_scaler_step:
                        return real(*args, **kwargs)
                    ev.append(tag)
                    if tag == "scaler.step":
                        self.in_scaler_step = True
                        try:
                            return real(*args, **kwargs)
                        finally:
                            self.in_scaler_step = False
                    return real(*args, **kwargs)

                stack.enter_context(mock.patch.object(owner, name, f))

            wrap(scaler, "scale", "scale")
            wrap(scaler, "get_scale", "get_scale")
            wrap(scaler, "unscale_", "unscale_", guard=True)
            wrap(scaler, "step", "scaler.step")
            wrap(scaler, "update", "update")
            wrap(opt, "step", "optimizer.step", guard=True)
            wrap(opt, "zero_grad", "zero_grad")
            wrap(model, "zero_grad", "zero_grad")
            wrap(torch.nn.utils, "clip_grad_norm_", "clip")
            wrap(torch.nn.utils.clip_grad, "clip_grad_norm_", "clip")
            wrap(torch.nn.utils, "clip_grads_with_norm_", "clip")
            real_autocast = torch.autocast

            class autocast(real_autocast):  # records the device and dtype it is entered with
                def __enter__(inner):
                    ev.append(("autocast", inner.device, str(inner.fast_dtype).replace("torch.", "")))
                    return super().__enter__()

            for owner in (torch, torch.amp):
                stack.enter_context(mock.patch.object(owner, "autocast", autocast))
            stack.enter_context(deprecated_amp_calls(self.deprecated))
            model.register_comm_hook(None, self._hook)  # the model is this recorder's alone
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.__exit__(*exc)

    def _hook(self, state, bucket):  # no annotations: DDP would compare them as strings here
        self.events.append("allreduce")
        buf = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])
