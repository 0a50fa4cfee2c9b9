"""Chapter 04.b: mini DDP (``DDPIndividualParameters`` in solutions/mini_ddp.py).

The checker runs the class on 3 gloo ranks next to torch DDP (SGD with momentum, 4 steps), on the
course model (BatchNorm buffers) and on a model with a frozen layer and a shared parameter, and
watches the communication.  It must accept right answers written in different ways and name the
misconception behind each wrong one.  Every answer below is written whole, as a learner would
write it (the catalogue is ``CATALOGUE`` in course_utils/checks/ch04/b_mini_ddp.py).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from misconceptions import cases  # tests/checkers/misconceptions.py, beside this file
from torch import nn

from course_utils.checking import CheckFailed
from course_utils.checks import check_mini_ddp
from course_utils.checks.ch04 import b_mini_ddp
from course_utils.checks.ch04.b_mini_ddp import CATALOGUE

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

ROOT = Path(__file__).resolve().parents[2]


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


# --------------------------------------------------------------------------------------------
# Right answers, written in different ways
# --------------------------------------------------------------------------------------------


class HandlesInADict(nn.Module):
    """Post-accumulate-grad hooks; one handle per parameter in a dict; `/=` after waiting."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.handles = {}
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, 0)
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._ready)

    def _ready(self, p):
        self.handles[p] = dist.all_reduce(p.grad, async_op=True)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        n = dist.get_world_size()
        for p, handle in self.handles.items():
            handle.wait()
            p.grad /= n
        self.handles = {}


class AccumulateGradNodeHooks(nn.Module):
    """As torch DDP's mixed-precision path hooks gradients (torch/nn/parallel/distributed.py): a
    post-hook on each parameter's AccumulateGrad node (it runs once .grad holds the gradient), the
    node kept alive in a list; the gradient divided by the world size before it is summed."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.world = dist.get_world_size()
        self.works = []
        self.grad_accs = []
        for p in module.parameters():
            dist.broadcast(p.data, src=0)
        for b in module.buffers():
            dist.broadcast(b, src=0)
        for p in module.parameters():
            if not p.requires_grad:
                continue
            acc = p.view_as(p).grad_fn.next_functions[0][0]
            acc.register_hook(self._hook_for(p))
            self.grad_accs.append(acc)  # without a reference the node, and its hook, go away

    def _hook_for(self, p):
        def hook(*unused):
            p.grad.div_(self.world)  # sum of (g / N) over the ranks = the mean
            self.works.append(dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, async_op=True))
        return hook

    def forward(self, x):
        return self.module(x)

    def finish_gradient_synchronization(self):
        while self.works:
            self.works.pop().wait()


class ReducesACopy(nn.Module):
    """Each gradient copied into a buffer of its own, the buffer all-reduced, and the average
    copied back into .grad after waiting."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.pending = []
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, src=0)
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self.hook)

    def hook(self, p):
        buf = p.grad.detach().clone()
        self.pending.append((p, buf, dist.all_reduce(buf, async_op=True)))

    def forward(self, x):
        return self.module(x)

    def finish_gradient_synchronization(self):
        for p, buf, work in self.pending:
            work.wait()
            p.grad.copy_(buf / dist.get_world_size())
        self.pending.clear()


def test_accepts_the_solution(capsys):
    check_mini_ddp(solution.DDPIndividualParameters)
    out = capsys.readouterr().out
    assert "[PASS] 04.b mini DDP" in out and "momentum" in out


@pytest.mark.parametrize("right", [HandlesInADict, AccumulateGradNodeHooks, ReducesACopy],
                         ids=lambda c: c.__name__)
def test_accepts_other_right_answers(right, capsys):
    check_mini_ddp(right)
    assert "[PASS] 04.b mini DDP" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# What learners write when they hold a misconception
# --------------------------------------------------------------------------------------------


class AllReduceLoopAfterBackward(nn.Module):
    """"Hooks are an optimisation; a loop after backward does the same": right numbers, no overlap."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, 0)

    def forward(self, x):
        return self.module(x)

    def finish_gradient_synchronization(self):
        handles = []
        for p in self.module.parameters():
            if p.grad is not None:
                handles.append((p, dist.all_reduce(p.grad, async_op=True)))
        for p, h in handles:
            h.wait()
            p.grad /= dist.get_world_size()


class BlockingAllReduceInHook(nn.Module):
    """"The hook is where the gradient is ready, so reduce it there": a blocking all-reduce."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, 0)
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self.average)

    def average(self, p):
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()

    def forward(self, x):
        return self.module(x)

    def finish_gradient_synchronization(self):
        pass  # already done in the hooks


class AveragesWithOtherCollectives(BlockingAllReduceInHook):
    """"Any collectives that average will do": a reduce to rank 0, then a broadcast back."""

    def average(self, p):
        dist.reduce(p.grad, 0)
        dist.broadcast(p.grad, 0)
        p.grad /= dist.get_world_size()


class AsyncButWaitsInHook(BlockingAllReduceInHook):
    """async_op=True, then wait at once: as blocking as the synchronous call."""

    def average(self, p):
        dist.all_reduce(p.grad, async_op=True).wait()
        p.grad /= dist.get_world_size()


class SumsWithoutDividing(nn.Module):
    """"DDP all-reduces the gradients", and all_reduce sums: no division by the world size."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.works = []
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, src=0)
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(
                    lambda p: self.works.append(dist.all_reduce(p.grad, async_op=True)))

    def forward(self, x):
        return self.module(x)

    def finish_gradient_synchronization(self):
        for w in self.works:
            w.wait()
        self.works.clear()


class HooksOnEveryParameter(SumsWithoutDividing):
    """"Every parameter gets a hook", frozen ones included."""

    def __init__(self, module):
        nn.Module.__init__(self)
        self.module = module
        self.works = []
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, src=0)
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(
                lambda p: self.works.append((p, dist.all_reduce(p.grad, async_op=True))))

    def finish_gradient_synchronization(self):
        for p, w in self.works:
            w.wait()
            p.grad /= dist.get_world_size()
        self.works.clear()


class DividesEveryParameter(nn.Module):
    """Hooks on the trainable parameters, but the division loops over all of them (frozen too)."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.works = []
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, src=0)
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(
                    lambda p: self.works.append(dist.all_reduce(p.grad, async_op=True)))

    def forward(self, x):
        return self.module(x)

    def finish_gradient_synchronization(self):
        for w in self.works:
            w.wait()
        self.works.clear()
        for p in self.module.parameters():
            p.grad /= dist.get_world_size()


class HookPerModule(nn.Module):
    """A hook for each module's own parameters: a parameter shared by two layers gets two."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.pending = []
        with torch.no_grad():
            for m in module.modules():
                for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
                    dist.broadcast(t, src=0)
        for m in module.modules():
            for p in m.parameters(recurse=False):
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self.hook)

    def hook(self, p):
        self.pending.append((p, dist.all_reduce(p.grad, async_op=True)))

    def forward(self, x):
        return self.module(x)

    def finish_gradient_synchronization(self):
        for p, work in self.pending:
            work.wait()
            p.grad /= dist.get_world_size()
        self.pending = []


class NoBroadcast(nn.Module):
    """"The ranks build the same model anyway": no broadcast at construction."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.pending = []
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self.hook)

    def hook(self, p):
        self.pending.append((p, dist.all_reduce(p.grad, async_op=True)))

    def forward(self, x):
        return self.module(x)

    def finish_gradient_synchronization(self):
        for p, work in self.pending:
            work.wait()
            p.grad /= dist.get_world_size()
        self.pending = []


class BroadcastsParametersOnly(NoBroadcast):
    """The parameters broadcast, the buffers (BatchNorm's running statistics) forgotten."""

    def __init__(self, module):
        super().__init__(module)
        with torch.no_grad():
            for p in module.parameters():
                dist.broadcast(p, src=0)


class NeverClearsHandles(nn.Module):
    """The handles waited for and divided, but the list is never emptied: from the second step on,
    last step's gradients are divided again (the same tensors when .grad is zeroed in place)."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.handles = []
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, src=0)
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self.on_grad)

    def on_grad(self, p):
        self.handles.append((dist.all_reduce(p.grad, async_op=True), p.grad))

    def forward(self, x):
        return self.module(x)

    def finish_gradient_synchronization(self):
        for handle, grad in self.handles:
            handle.wait()
            grad /= dist.get_world_size()


class NeverWaits(NeverClearsHandles):
    """"async_op=True returns when it is done": the handles are never waited for."""

    def finish_gradient_synchronization(self):
        for _, grad in self.handles:
            grad /= dist.get_world_size()
        self.handles.clear()


class TensorRegisterHook(nn.Module):
    """Tensor.register_hook instead of register_post_accumulate_grad_hook: the hook's argument is
    the gradient before it is accumulated into .grad, and the hook must not modify it."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.pending = []
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, src=0)
        for p in module.parameters():
            if p.requires_grad:
                p.register_hook(self.hook)

    def hook(self, grad):
        self.pending.append((grad, dist.all_reduce(grad, async_op=True)))
        return grad

    def forward(self, x):
        return self.module(x)

    def finish_gradient_synchronization(self):
        for grad, work in self.pending:
            work.wait()
            grad /= dist.get_world_size()
        self.pending.clear()


class TensorRegisterHookReadsGrad(TensorRegisterHook):
    """Tensor.register_hook, all-reducing p.grad: it is not there yet when the hook runs."""

    def __init__(self, module):
        nn.Module.__init__(self)
        self.module = module
        self.pending = []
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, src=0)
        for p in module.parameters():
            if p.requires_grad:
                p.register_hook(lambda grad, p=p: self.pending.append(
                    (p, dist.all_reduce(p.grad, async_op=True))))

    def finish_gradient_synchronization(self):
        for p, work in self.pending:
            work.wait()
            p.grad /= dist.get_world_size()
        self.pending.clear()


class HooksInForward(NoBroadcast):
    """Hooks registered in forward(): every step adds one more hook to every parameter."""

    def __init__(self, module):
        nn.Module.__init__(self)
        self.module = module
        self.pending = []
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, src=0)

    def forward(self, x):
        for p in self.module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self.hook)
        return self.module(x)


class StoresModelElsewhere(NoBroadcast):
    """The wrapped module kept as .model: code written for DDP reads .module."""

    def __init__(self, module):
        nn.Module.__init__(self)
        self.model = module
        self.pending = []
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, src=0)
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self.hook)

    def forward(self, x):
        return self.model(x)


# Each misconception of the catalogue: the wrong class of the same name, and what the failure says.
WRONG = {
    "AllReduceLoopAfterBackward": (
        AllReduceLoopAfterBackward, r"step 0: no all-reduce started during backward.*cannot overlap "
                                    r"backward"),
    "BlockingAllReduceInHook": (
        BlockingAllReduceInHook, r"during backward your hook waited for communication \(a blocking "
                                 r"dist\.all_reduce.*async_op=True"),
    "AsyncButWaitsInHook": (
        AsyncButWaitsInHook, r"during backward your hook waited for communication \(work\.wait\(\)\)"),
    "SumsWithoutDividing": (
        SumsWithoutDividing, r"gradients are 3 times torch DDP's: you summed them.*did not divide by "
                             r"the world size"),
    "HooksOnEveryParameter": (
        HooksOnEveryParameter, r"frozen \+ shared parameters.*registering a hook on a parameter with "
                               r"requires_grad=False.*skip those"),
    "DividesEveryParameter": (
        DividesEveryParameter, r"frozen \+ shared parameters.*NoneType.*a frozen parameter "
                               r"\(requires_grad=False\) never gets a gradient"),
    "HookPerModule": (
        HookPerModule, r"frozen \+ shared parameters.*step 0: the gradient of block\.weight was "
                       r"all-reduced 2 times.*a parameter shared by two layers got two hooks"),
    "NoBroadcast": (
        NoBroadcast, r"right after construction the parameters on course model.*net\.0\.weight +[\d.e-]+ "
                     r"+DIFFERENT.*not broadcasting the initial parameters from rank 0"),
    "BroadcastsParametersOnly": (
        BroadcastsParametersOnly, r"right after construction the buffers on course model.*"
                                  r"net\.1\.running_mean +[\d.e-]+ +DIFFERENT.*not broadcasting the "
                                  r"initial buffers"),
    "NeverClearsHandles": (
        NeverClearsHandles, r"step 1: finish_gradient_synchronization\(\) waited again for \d+ handle\(s\) "
                            r"of an earlier step.*Empty the list"),
    "NeverWaits": (
        NeverWaits, r"step 0: finish_gradient_synchronization\(\) returned without waiting for \d+ of "
                    r"the \d+ asynchronous all-reduces.*work\.wait\(\)"),
    "TensorRegisterHook": (
        TensorRegisterHook, r"all-reduced the gradient passed to a Tensor\.register_hook hook.*\*before\* "
                            r"that gradient is accumulated.*register_post_accumulate_grad_hook"),
    "TensorRegisterHookReadsGrad": (
        TensorRegisterHookReadsGrad, r"step 0 raised .*NoneType.*Tensor\.register_hook\(hook\) calls "
                                     r"hook\(grad\) \*before\*"),
    "HooksInForward": (
        HooksInForward, r"step 1: every gradient was all-reduced 2 times in one step: the hooks were "
                        r"registered again.*Register them once, in __init__"),
    "StoresModelElsewhere": (StoresModelElsewhere, r"the wrapper's `\.module` is NoneType"),
    "AveragesWithOtherCollectives": (
        AveragesWithOtherCollectives, r"step 0: the gradients were averaged without dist\.all_reduce "
                                      r"\(a reduce then a broadcast"),
}


@pytest.mark.parametrize("mistake, wrong", cases(CATALOGUE, WRONG))
def test_rejects_usual_mistakes(mistake, wrong):
    cls, message = wrong
    with pytest.raises(CheckFailed, match="(?s)" + message) as info:
        check_mini_ddp(cls)
    assert info.value.args[0].startswith("[04.b mini DDP]")
    assert mistake.message in info.value.args[0]


def test_exercise_stub_is_not_done():
    with pytest.raises(CheckFailed, match=r"not done yet.*04\.b mini DDP"):
        check_mini_ddp(exercise.DDPIndividualParameters)


def test_none_is_rejected_clearly():
    with pytest.raises(CheckFailed, match=r"expected the class DDPIndividualParameters\(module\), got None"):
        check_mini_ddp(None)


def test_the_tensor_hook_wrapper_puts_register_hook_back_also_after_an_error():
    real = torch.Tensor.register_hook
    with pytest.raises(RuntimeError, match="the learner's code"), b_mini_ddp._Watch().tensor_hooks_wrapped():
        assert torch.Tensor.register_hook is not real
        raise RuntimeError("the learner's code")
    assert torch.Tensor.register_hook is real
