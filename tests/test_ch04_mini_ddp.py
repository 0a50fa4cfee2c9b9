"""Chapter 04.b: mini DDP (``DDPIndividualParameters`` in solutions/mini_ddp.py).

The checker runs the class on 3 gloo ranks next to torch DDP, on the course model (BatchNorm
buffers) and on a model with a frozen layer and shared parameters.  It must accept the solution
and name each usual mistake.  Each wrong answer below is the right one with a single change.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from torch import nn

from course_utils.checking import CheckFailed
from course_utils.checks import check_mini_ddp

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)  # the workers need no import path
    return module


solution = _load("mini_ddp_solution", ROOT / "solutions" / "mini_ddp.py")
exercise = _load("mini_ddp_exercise", ROOT / "exercises" / "mini_ddp.py")
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Right(nn.Module):
    """A compact right answer that the wrong ones below change in one place each."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.world = dist.get_world_size()
        self.pending = []
        self.broadcast_state()
        self.register_hooks()

    def broadcast_state(self):
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                dist.broadcast(t, src=0)

    def trainable(self):
        return [p for p in self.module.parameters() if p.requires_grad]

    def register_hooks(self):
        for p in self.trainable():
            p.register_post_accumulate_grad_hook(self.on_grad_ready)

    def on_grad_ready(self, p):
        self.pending.append((p.grad, dist.all_reduce(p.grad, async_op=True)))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for grad, work in self.pending:
            work.wait()
            grad /= self.world
        self.pending.clear()


class NoBroadcast(Right):
    def broadcast_state(self):
        pass


class ParametersOnlyBroadcast(Right):
    def broadcast_state(self):
        with torch.no_grad():
            for p in self.module.parameters():
                dist.broadcast(p, src=0)


class Sums(Right):
    def finish_gradient_synchronization(self):
        for _, work in self.pending:
            work.wait()
        self.pending.clear()


class HooksOnFrozen(Right):
    def register_hooks(self):
        for p in self.module.parameters():  # including requires_grad=False
            p.register_post_accumulate_grad_hook(self.on_grad_ready)


class WaitsInHook(Right):
    def on_grad_ready(self, p):
        dist.all_reduce(p.grad)  # blocking: backward stops here until the gradient has travelled
        self.pending.append((p.grad, _Done()))


class _Done:
    def wait(self):
        return True


class AllReduceAfterBackward(Right):
    def register_hooks(self):
        pass

    def finish_gradient_synchronization(self):
        for p in self.trainable():
            self.pending.append((p.grad, dist.all_reduce(p.grad, async_op=True)))
        super().finish_gradient_synchronization()


class SharedTwice(Right):
    def register_hooks(self):
        seen = [p for _, p in self.module.named_parameters(remove_duplicate=False) if p.requires_grad]
        for p in seen:  # block.weight is listed twice (block and tied): two hooks, two all-reduces
            p.register_post_accumulate_grad_hook(self.on_grad_ready)


class KeepsOldHandles(Right):
    def finish_gradient_synchronization(self):
        for grad, work in self.pending:
            work.wait()
            grad /= self.world
        # never cleared: the next step divides last step's gradients again


class NoModuleAttribute(Right):
    def __init__(self, module):
        super().__init__(module)
        self.inner = self.module
        del self.module

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


def test_accepts_the_solution(capsys):
    check_mini_ddp(solution.DDPIndividualParameters)
    assert "[PASS] 04.b mini DDP" in capsys.readouterr().out


def test_accepts_the_compact_right_answer(capsys):
    check_mini_ddp(Right)
    assert "[PASS] 04.b mini DDP" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (NoBroadcast, r"right after construction the parameters .* differ from rank 0's.*"
                  r"not broadcasting the initial parameters"),
    (ParametersOnlyBroadcast, r"right after construction the buffers net\.1\.running_mean.*"
                              r"not broadcasting the initial buffers"),
    (Sums, r"gradients are 3 times torch DDP's: you summed them"),
    (HooksOnFrozen, r"frozen \+ shared parameters.*registering a hook on a parameter with "
                    r"requires_grad=False"),
    (WaitsInHook, r"during backward your hook waited for communication \(a blocking dist\.all_reduce"),
    (AllReduceAfterBackward, r"no all-reduce started during backward"),
    (SharedTwice, r"frozen \+ shared parameters.*all-reduce calls for 7 trainable parameters.*"
                  r"a parameter shared by two layers got two hooks"),
    (KeepsOldHandles, r"at step 1 .*handles of the previous step"),
    (NoModuleAttribute, r"the wrapper's `\.module` is NoneType"),
])
def test_rejects_usual_mistakes(wrong, message):
    with pytest.raises(CheckFailed, match="(?s)" + message) as info:
        check_mini_ddp(wrong)
    assert info.value.args[0].startswith("[04.b mini DDP]")


def test_exercise_stub_is_not_done():
    with pytest.raises(CheckFailed, match=r"not done yet.*04\.b mini DDP"):
        check_mini_ddp(exercise.DDPIndividualParameters)


def test_none_is_rejected_clearly():
    with pytest.raises(CheckFailed, match=r"expected the class DDPIndividualParameters\(module\), got None"):
        check_mini_ddp(None)
