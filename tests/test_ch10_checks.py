"""Chapter 10 checkers: each accepts two correct answers and names every misconception it lists."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from course_utils.checking import CheckFailed
from course_utils.checks import check_bucketed_ddp, check_comm_prediction, check_sharded_optimizer
from course_utils.checks.ch10 import ring_factor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "solutions"))
import mini_ddp  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


# ------------------------------------------------------------------------------------------
# 10.a bucketed DDP
# ------------------------------------------------------------------------------------------


def bucketed(*, forward=False, start_at_first=False, wait_in_hook=False, average=True,
             copy_back=True, reset=True, start_in_finish=False, broadcast=True, per_param=False):
    """A learner's DDPBucketed, with switches that reproduce the usual mistakes."""

    class Bucketed(nn.Module):
        def __init__(self, module, bucket_size_mb):
            super().__init__()
            self.module = module
            self.world = dist.get_world_size()
            with torch.no_grad():
                for t in list(module.parameters()) + list(module.buffers()) if broadcast else []:
                    dist.broadcast(t, src=0)
            params = [p for p in module.parameters() if p.requires_grad]
            if not forward:
                params = params[::-1]
            self.buckets, size = [], None
            for p in params:
                n = p.numel() * p.element_size()
                if size is None or per_param or size + n > bucket_size_mb * 2**20:
                    self.buckets.append([])
                    size = 0
                self.buckets[-1].append(p)
                size += n
            self.where = {p: i for i, b in enumerate(self.buckets) for p in b}
            self.count = [0] * len(self.buckets)
            self.works = []
            for p in params:
                p.register_post_accumulate_grad_hook(self.hook)

        def launch(self, i):
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                              for p in self.buckets[i]])
            work = dist.all_reduce(flat, async_op=True)
            if wait_in_hook:
                work.wait()
            self.works.append((i, flat, work))

        def hook(self, p):
            i = self.where[p]
            self.count[i] += 1
            if not start_in_finish and self.count[i] == (1 if start_at_first else len(self.buckets[i])):
                self.launch(i)

        def forward(self, *args):
            return self.module(*args)

        def finish_gradient_synchronization(self):
            if start_in_finish:
                for i in range(len(self.buckets)):
                    self.launch(i)
            for i, flat, work in self.works:
                work.wait()
                if average:
                    flat /= self.world
                if copy_back:
                    for p, g in zip(self.buckets[i], flat.split([p.numel() for p in self.buckets[i]])):
                        p.grad.copy_(g.view_as(p))
            self.works = []
            if reset:
                self.count = [0] * len(self.buckets)

    return Bucketed


class BufferBucketed(nn.Module):
    """Another right answer: one preallocated flat buffer per bucket, reset per batch."""

    def __init__(self, module, bucket_size_mb):
        super().__init__()
        self.module = module
        for t in [*module.parameters(), *module.buffers()]:
            with torch.no_grad():
                dist.broadcast(t, src=0)
        self.groups, cur, size = [], [], 0
        for p in reversed([p for p in module.parameters() if p.requires_grad]):
            n = p.numel() * p.element_size()
            if cur and size + n > bucket_size_mb * 2**20:
                self.groups.append(cur)
                cur, size = [], 0
            cur.append(p)
            size += n
        self.groups.append(cur)
        self.buffers_ = [torch.zeros(sum(p.numel() for p in g)) for g in self.groups]
        self.left, self.handles = {}, []
        for gi, g in enumerate(self.groups):
            offset = 0
            for p in g:
                p.register_post_accumulate_grad_hook(self._make_hook(gi, offset))
                offset += p.numel()
        self.on_train_batch_start()

    def _make_hook(self, gi, offset):
        def hook(p):
            self.buffers_[gi][offset:offset + p.numel()].copy_(p.grad.flatten())
            self.left[gi] -= 1
            if self.left[gi] == 0:
                self.handles.append((gi, dist.all_reduce(self.buffers_[gi], async_op=True)))
        return hook

    def on_train_batch_start(self):
        self.left = {gi: len(g) for gi, g in enumerate(self.groups)}

    def forward(self, *args):
        return self.module(*args)

    def finish_gradient_synchronization(self):
        for gi, h in self.handles:
            h.wait()
            buf = self.buffers_[gi] / dist.get_world_size()
            offset = 0
            for p in self.groups[gi]:
                p.grad.copy_(buf[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        self.handles = []


@pytest.mark.parametrize("cls", [mini_ddp.DDPBucketed, BufferBucketed], ids=["cat", "buffers"])
def test_bucketed_accepts_right_answers(cls, capsys):
    check_bucketed_ddp(cls)
    assert "[PASS] 10.a" in capsys.readouterr().out


@pytest.mark.parametrize("flags, fragment", [
    ({"start_in_finish": True}, r"no all-reduce started during backward"),
    ({"wait_in_hook": True}, r"during backward your hook waited"),
    ({"start_at_first": True}, r"all-reduced before all of its gradients were ready"),
    ({"forward": True}, r"filled in forward order"),
    ({"reset": False}, r"not reset after a step"),
    ({"average": False}, r"2 times torch DDP's.*not divided by the world size"),
    ({"copy_back": False}, r"never copied back into the parameters' \.grad"),
    ({"broadcast": False}, r"right after construction.*no broadcast of rank 0's parameters"),
    ({"per_param": True}, r"one all-reduce per parameter"),
], ids=lambda v: "-".join(v) if isinstance(v, dict) else None)
def test_bucketed_names_each_misconception(flags, fragment):
    with pytest.raises(CheckFailed, match=rf"(?s)\[10\.a bucketed DDP\].*{fragment}"):
        check_bucketed_ddp(bucketed(**flags))


def test_bucketed_stub_is_not_done():
    class Stub(nn.Module):
        def __init__(self, module, bucket_size_mb):
            raise NotImplementedError("Exercise 10.a bucketed DDP: replace this line with your code")

    with pytest.raises(CheckFailed, match=r"not done yet.*10\.a bucketed DDP"):
        check_bucketed_ddp(Stub)


# ------------------------------------------------------------------------------------------
# 10.b sharded optimizer
# ------------------------------------------------------------------------------------------


def sharded(*, shard=True, sync=True, from_owner=True, override_add=True, reread=False, kwargs=True):
    """A learner's ShardedOptimizer (round-robin owners), with switches for the usual mistakes."""

    class Sharded(torch.optim.Optimizer):
        def __init__(self, params, optimizer_cls, **kw):
            self.cls, self.kw, self.inner, self.owners = optimizer_cls, kw, [], {}
            if reread:
                params = list(params)  # fine ...
                gen = iter(params)
                super().__init__(gen, kw)
                self.inner = [optimizer_cls(gen, **kw)]  # ... but the generator is read twice
                return
            super().__init__(params, kw)

        def add_param_group(self, group):
            super().add_param_group(group)
            if not override_add and self.inner:
                return
            g = self.param_groups[-1]
            n = sum(len(x["params"]) for x in self.param_groups[:-1])
            for j, p in enumerate(g["params"]):
                self.owners[p] = (n + j) % dist.get_world_size()
            mine = [p for p in g["params"] if not shard or self.owners[p] == dist.get_rank()]
            opts = {k: v for k, v in g.items() if k != "params"} if kwargs else {"lr": g["lr"]}
            self.inner.append(self.cls([{"params": mine, **opts}]))

        def step(self, closure=None):
            for o in self.inner:
                o.step()
            if sync:
                with torch.no_grad():
                    for p, owner in self.owners.items():
                        dist.broadcast(p, src=owner if from_owner else 0)

    return Sharded


@pytest.mark.parametrize("cls", [mini_ddp.ShardedOptimizer, sharded()], ids=["balanced", "round-robin"])
def test_sharded_accepts_right_answers(cls, capsys):
    check_sharded_optimizer(cls)
    assert "[PASS] 10.b" in capsys.readouterr().out


@pytest.mark.parametrize("flags, fragment", [
    ({"shard": False}, r"state on both ranks.*not sharded"),
    ({"sync": False}, r"rank 1's parameters differ from rank 0's.*broadcast every parameter from its owner"),
    ({"from_owner": False}, r"broadcast from rank 0 instead of from the rank that owns"),
    ({"override_add": False}, r"add_param_group\(\) not overridden"),
    ({"reread": True}, r"generator.*read once"),
    ({"kwargs": False}, r"keyword arguments.*not passed on"),
], ids=lambda v: "-".join(v) if isinstance(v, dict) else None)
def test_sharded_names_each_misconception(flags, fragment):
    with pytest.raises(CheckFailed, match=rf"(?s)\[10\.b sharded optimizer\].*{fragment}"):
        check_sharded_optimizer(sharded(**flags))


# ------------------------------------------------------------------------------------------
# 10.c cost-model prediction (only the exact part: the measured part is timed by the notebook)
# ------------------------------------------------------------------------------------------


def predict_loop(bucket_bytes, world, alpha, beta):
    total = 0.0
    for b in bucket_bytes:
        total += alpha + 2 * (world - 1) / world * b / beta
    return total


def predict_vector(bucket_bytes, world, alpha, beta):
    return len(bucket_bytes) * alpha + ring_factor(world) * sum(bucket_bytes) / beta


@pytest.mark.parametrize("fn", [predict_loop, predict_vector])
def test_prediction_right_answers_pass_the_exact_part(fn, monkeypatch):
    import course_utils.checks.ch10 as ch10

    # The measured part is replaced by a measurement that obeys the model exactly.
    def fake(sizes, groups, world=2, **_):
        a, b = 1e-4, 1e9
        t = [a + ring_factor(world) * s / b for s in sizes]
        return [t], [[sum(a + ring_factor(world) * s / b for s in g) for g in groups]]

    monkeypatch.setattr(ch10, "measured_rounds", fake)
    check_comm_prediction(fn)


@pytest.mark.parametrize("fn, fragment", [
    (lambda b, n, a, beta: sum(a + x / beta for x in b), r"ring factor 2\(N-1\)/N is missing"),
    (lambda b, n, a, beta: sum(a + (n - 1) / n * x / beta for x in b), r"one reduce-scatter"),
    (lambda b, n, a, beta: a + sum(2 * (n - 1) / n * x / beta for x in b), r"α counted once per step"),
    (lambda b, n, a, beta: sum(a + 2 * (n - 1) / n * 8 * x / beta for x in b), r"bits and bytes"),
    (lambda b, n, a, beta: 1e3 * sum(a + 2 * (n - 1) / n * x / beta for x in b), r"milliseconds"),
    (lambda b, n, a, beta: None, r"expected a number of seconds"),
])
def test_prediction_names_each_misconception(fn, fragment):
    with pytest.raises(CheckFailed, match=rf"(?s)\[10\.c cost-model prediction\].*{fragment}"):
        check_comm_prediction(fn)

