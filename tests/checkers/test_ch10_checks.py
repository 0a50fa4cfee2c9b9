"""Chapter 10 checkers: each accepts correct answers written differently and names every misconception
of its catalogue (``CATALOGUE`` in each module of course_utils/checks/ch10/); the measurements beside
them (course_utils/measure/ch10.py) count and decide what they print."""

from __future__ import annotations

import itertools
import re
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from misconceptions import cases  # tests/checkers/misconceptions.py, beside this file
from torch import nn

from course_utils.checking import CheckFailed
from course_utils.checks import check_bucketed_ddp, check_comm_prediction, check_sharded_optimizer
from course_utils.checks.ch10 import a_bucketed_ddp, b_sharded_optimizer, c_cost_model
from course_utils.measure.ch10 import (
    compare_bucketed_speed,
    measure_sharded_memory,
    ring_factor,
    speed_verdict,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "solutions"))
import mini_ddp  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def _names_the_mistake(check, answer, mistake, fragment, **options):
    """``check(answer)`` fails under the exercise's name, with ``fragment`` and the catalogue's words."""
    with pytest.raises(CheckFailed, match=rf"(?s)\[{re.escape(check.exercise)}\].*{fragment}") as info:
        check(answer, **options)
    assert mistake.message in info.value.args[0]


# ------------------------------------------------------------------------------------------
# 10.a bucketed DDP
# ------------------------------------------------------------------------------------------


def bucketed(*, forward=False, start_at_first=False, wait_in_hook=False, average=True,
             copy_back=True, reset=True, start_in_finish=False, broadcast=True, per_param=False,
             wait=True):
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
                if wait:
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


class ViewBucketed(nn.Module):
    """A third right answer: each gradient becomes a view into its bucket's flat buffer (torch DDP's
    gradient_as_bucket_view), so the all-reduce averages .grad in place and nothing is copied
    back; the counters are reset in on_train_batch_start()."""

    def __init__(self, module, bucket_size_mb):
        super().__init__()
        self.module = module
        with torch.no_grad():
            for t in itertools.chain(module.parameters(), module.buffers()):
                dist.broadcast(t, 0)
        self.buckets = []
        for p in reversed([p for p in module.parameters() if p.requires_grad]):
            nbytes = p.numel() * p.element_size()
            if not self.buckets or sum(q.numel() * q.element_size() for q in self.buckets[-1]) + nbytes \
                    > bucket_size_mb * 2**20:
                self.buckets.append([])
            self.buckets[-1].append(p)
        self.flat = [torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype) for b in self.buckets]
        self.slot = {}
        for i, b in enumerate(self.buckets):
            for p, view in zip(b, self.flat[i].split([p.numel() for p in b])):
                self.slot[p] = (i, view.view_as(p))
                p.register_post_accumulate_grad_hook(self._ready)
        self.works = []
        self.on_train_batch_start()

    def on_train_batch_start(self):
        self.missing = [len(b) for b in self.buckets]

    def _ready(self, p):
        i, view = self.slot[p]
        view.copy_(p.grad)  # a no-op when .grad already is the view (zero_grad(set_to_none=False))
        p.grad = view
        self.missing[i] -= 1
        if self.missing[i] == 0:
            self.works.append((i, dist.all_reduce(self.flat[i], async_op=True)))

    def forward(self, *args):
        return self.module(*args)

    def finish_gradient_synchronization(self):
        for i, work in self.works:
            work.wait()
            self.flat[i].div_(dist.get_world_size())
        self.works.clear()


@pytest.mark.parametrize("cls", [mini_ddp.DDPBucketed, BufferBucketed, ViewBucketed],
                         ids=["cat", "buffers", "views"])
def test_bucketed_accepts_right_answers(cls, capsys):
    check_bucketed_ddp(cls)
    assert "[PASS] 10.a" in capsys.readouterr().out


# Each misconception of the catalogue: the switches of the learner's class that make it, and what
# the failure says.
WRONG_BUCKETED = {
    "start_in_finish": ({"start_in_finish": True}, r"no all-reduce started during backward"),
    "wait_in_hook": ({"wait_in_hook": True}, r"during backward your hook waited"),
    "start_at_first": ({"start_at_first": True}, r"all-reduced before all of its gradients were ready"),
    "forward_order": ({"forward": True}, r"filled in forward order"),
    "no_reset": ({"reset": False}, r"not reset after a step"),
    "no_average": ({"average": False}, r"2 times torch DDP's.*not divided by the world size"),
    "no_copy_back": ({"copy_back": False}, r"never copied back into the parameters' \.grad"),
    "no_broadcast": ({"broadcast": False}, r"right after construction.*no broadcast of rank 0's parameters"),
    "per_param": ({"per_param": True}, r"one all-reduce per parameter"),
    "no_wait": ({"wait": False}, r"step 1: \d+ of \d+ asynchronous all-reduces were never waited for: "
                                 r"finish_gradient_synchronization\(\) did not wait"),
}


@pytest.mark.parametrize("mistake, wrong", cases(a_bucketed_ddp.CATALOGUE, WRONG_BUCKETED))
def test_bucketed_names_each_misconception(mistake, wrong):
    flags, fragment = wrong
    _names_the_mistake(check_bucketed_ddp, bucketed(**flags), mistake, fragment)


def test_bucketed_stub_is_not_done():
    class Stub(nn.Module):
        def __init__(self, module, bucket_size_mb):
            raise NotImplementedError("Exercise 10.a bucketed DDP: replace this line with your code")

    with pytest.raises(CheckFailed, match=r"not done yet.*10\.a bucketed DDP"):
        check_bucketed_ddp(Stub)



def test_speed_comparison_counts_all_reduces_and_decides(capsys):
    r = compare_bucketed_speed(mini_ddp.DDPBucketed, mini_ddp.DDPIndividualParameters, steps=3, repeats=3)
    assert r["calls"] == {"torch DDP": 1, "DDPBucketed": 1, "DDPIndividualParameters": 6}
    assert all(len(v) == 3 and min(v) > 0 for v in r["steps_per_s"].values())
    out = capsys.readouterr().out
    assert re.search(r"DDPBucketed runs at \d+% of torch DDP's steps per second", out)
    assert ("not within 10%" in out) == (not r["within"])


def test_speed_comparison_leaves_out_a_stub_and_refuses_to_time_one():
    class Stub(nn.Module):
        def __init__(self, *args):
            super().__init__()
            raise NotImplementedError("Exercise 04.b mini DDP: replace this line with your code")

    r = compare_bucketed_speed(mini_ddp.DDPBucketed, Stub, steps=2, repeats=2)
    assert r["calls"]["DDPIndividualParameters"] is None and "DDPIndividualParameters" not in r["steps_per_s"]
    with pytest.raises(CheckFailed, match=r"DDPBucketed is not done yet \(exercise 10\.a\)"):
        compare_bucketed_speed(Stub, mini_ddp.DDPIndividualParameters)


@pytest.mark.parametrize("ratios, within, firm, fragment", [
    ([0.97, 1.0, 1.02, 1.05, 0.99], True, True, r"at 100% .*: within 10% of torch DDP on this machine\.$"),
    ([0.6, 0.7, 0.75, 0.8, 0.85], False, True, r"at 75% .*: not within 10%"),
    ([0.5, 0.8, 0.95, 1.1, 1.3], True, False, r"within 10%.*this run cannot settle it"),
    ([0.5, 0.7, 0.85, 0.95, 1.3], False, False, r"not within 10%.*cannot settle it"),
])
def test_speed_verdict_follows_the_median_and_the_quartiles(ratios, within, firm, fragment):
    text, w, f = speed_verdict(ratios)
    assert (w, f) == (within, firm)
    assert re.search(fragment, text), text


# ------------------------------------------------------------------------------------------
# 10.b sharded optimizer
# ------------------------------------------------------------------------------------------


def sharded(*, shard=True, sync=True, from_owner=True, override_add=True, reread=False, kwargs=True,
            owner_sends=True, by_kind=False):
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
                # by_kind: "weights on rank 0, biases on rank 1"
                self.owners[p] = int(p.dim() == 1) if by_kind else (n + j) % dist.get_world_size()
            mine = [p for p in g["params"] if not shard or self.owners[p] == dist.get_rank()]
            opts = {k: v for k, v in g.items() if k != "params"} if kwargs else {"lr": g["lr"]}
            self.inner.append(self.cls([{"params": mine, **opts}]))

        def step(self, closure=None):
            for o in self.inner:
                o.step()
            if sync:
                with torch.no_grad():
                    for p, owner in self.owners.items():
                        if owner_sends or owner != dist.get_rank():  # "the owner has them already"
                            dist.broadcast(p, src=owner if from_owner else 0)

    return Sharded


class GatherSharded(torch.optim.Optimizer):
    """A third right answer: each rank owns a contiguous run of each group's parameters (about 1/N
    of its elements); after the step every rank packs its parameters into one flat tensor, padded
    to the longest shard, and one all_gather hands every shard to every rank."""

    def __init__(self, params, optimizer_cls, **kwargs):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.cls, self.kw, self.inner = optimizer_cls, kwargs, None
        self.shards = [[] for _ in range(self.world)]  # the parameters each rank owns
        super().__init__(params, kwargs)

    def add_param_group(self, group):
        super().add_param_group(group)
        g = self.param_groups[-1]
        total, done, mine = sum(p.numel() for p in g["params"]), 0, []
        for p in g["params"]:
            owner = min(int((done + p.numel() / 2) * self.world // total), self.world - 1)
            self.shards[owner].append(p)
            if owner == self.rank:
                mine.append(p)
            done += p.numel()
        if self.inner is None:
            self.inner = self.cls([{**g, "params": mine}], **self.kw)
        else:
            self.inner.add_param_group({**g, "params": mine})

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.inner.step(closure)
        sizes = [sum(p.numel() for p in shard) for shard in self.shards]
        flat = torch.zeros(max(sizes))
        if self.shards[self.rank]:
            flat[:sizes[self.rank]] = torch.cat([p.flatten() for p in self.shards[self.rank]])
        gathered = [torch.empty_like(flat) for _ in range(self.world)]
        dist.all_gather(gathered, flat)
        for shard, size, got in zip(self.shards, sizes, gathered):
            for p, piece in zip(shard, got[:size].split([p.numel() for p in shard])):
                p.copy_(piece.view_as(p))
        return loss


@pytest.mark.parametrize("cls", [mini_ddp.ShardedOptimizer, sharded(), GatherSharded],
                         ids=["balanced", "round-robin", "all-gather"])
def test_sharded_accepts_right_answers(cls, capsys):
    check_sharded_optimizer(cls)
    assert "[PASS] 10.b" in capsys.readouterr().out


WRONG_SHARDED = {
    "no_sharding": ({"shard": False}, r"state on both ranks.*not sharded"),
    "no_sync": ({"sync": False}, r"rank 1's parameters differ from rank 0's.*broadcast every parameter "
                                 r"from its owner"),
    "broadcast_from_rank0": ({"from_owner": False},
                             r"broadcast from rank 0 instead of from the rank that owns"),
    "no_add_param_group": ({"override_add": False}, r"add_param_group\(\) not overridden"),
    "generator_read_twice": ({"reread": True}, r"generator.*read once"),
    "no_kwargs": ({"kwargs": False}, r"keyword arguments.*not passed on"),
    # A hang: the checker's timeout (30 s for a learner) shortened to 8 s here.
    "owner_skips_broadcast": ({"owner_sends": False},
                              r"after 8 s rank\(s\) 0, 1 were still running.*broadcast.*Usual mistake: "
                              r"dist\.broadcast is a collective: the source rank calls it too"),
}


@pytest.mark.parametrize("mistake, wrong", cases(b_sharded_optimizer.CATALOGUE, WRONG_SHARDED))
def test_sharded_names_each_misconception(mistake, wrong):
    flags, fragment = wrong
    options = {"timeout": 8} if mistake.key == "owner_skips_broadcast" else {}
    _names_the_mistake(check_sharded_optimizer, sharded(**flags), mistake, fragment, **options)



def test_memory_measurement_adds_up_and_explains_the_floor(capsys):
    course, equal = measure_sharded_memory(mini_ddp.ShardedOptimizer)
    for case in (course, equal):
        assert sum(case["per_rank"]) == case["unsharded"]
        assert not set(case["owners"][0]) & set(case["owners"][1])
        assert max(case["per_rank"]) >= case["lower_bound"] >= case["unsharded"] / 2
    assert course["lower_bound"] > 0.75 * course["unsharded"]  # one 192x192 weight dominates
    out = capsys.readouterr().out
    assert "net.2.weight (36,864 elements)" in out and "close to it" in out


def test_memory_measurement_refuses_at_once_what_the_check_saw_hang():
    hangs = sharded(owner_sends=False)
    with pytest.raises(CheckFailed, match=r"still running"):
        check_sharded_optimizer(hangs, timeout=5)
    start = time.monotonic()
    with pytest.raises(CheckFailed, match=r"not measured: check_sharded_optimizer rejected this "
                                          r"ShardedOptimizer \(your code hung: after 5 s"):
        measure_sharded_memory(hangs)
    assert time.monotonic() - start < 1.0


def test_memory_measurement_blames_an_uneven_assignment_on_the_assignment(capsys):
    by_kind = sharded(by_kind=True)  # weights on rank 0, biases on rank 1: right, but lopsided
    check_sharded_optimizer(by_kind)
    course, equal = measure_sharded_memory(by_kind)
    assert max(equal["per_rank"]) > 0.95 * equal["unsharded"]
    assert equal["largest_first"] < 0.55 * equal["unsharded"]
    out = capsys.readouterr().out
    assert re.search(r"The fullest rank holds 9\d%, against the ideal 50%, because of how the parameters "
                     r"were assigned to ranks, not because whole tensors are: dealing them out largest "
                     r"first.*leaves the fullest rank 5\d% here", " ".join(out.split())), out


def test_memory_measurement_says_when_nothing_is_sharded(capsys):
    course, _ = measure_sharded_memory(sharded(shard=False))
    assert course["per_rank"] == [course["unsharded"]] * 2
    assert "not sharded: 6 of 6 tensors have state on every rank" in capsys.readouterr().out


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


def _slow_group_measurement(slowdowns):
    """A measurement that obeys the model in its single all-reduces while the group of buckets takes
    ``slowdowns[i]`` times the model's time at the i-th call (a machine busy during the groups)."""
    calls = []

    def fake(sizes, groups, world=2, **_):
        a, b = 1e-4, 1e9
        slow = slowdowns[min(len(calls), len(slowdowns) - 1)]
        calls.append(slow)
        t = [a + ring_factor(world) * s / b for s in sizes]
        return [t] * 7, [[slow * sum(a + ring_factor(world) * s / b for s in g) for g in groups]] * 7

    return fake, calls


@pytest.mark.parametrize("fn", [predict_loop, predict_vector])
def test_prediction_right_answers_pass_the_exact_part(fn, monkeypatch):
    # The measured part is replaced by a measurement that obeys the model exactly.
    fake, _ = _slow_group_measurement([1.0])
    monkeypatch.setattr(c_cost_model, "measured_rounds", fake)
    check_comm_prediction(fn)


def test_prediction_measures_again_when_a_busy_machine_moved_the_median(monkeypatch, capsys):
    fake, calls = _slow_group_measurement([4.0, 1.0, 1.0])
    monkeypatch.setattr(c_cost_model, "measured_rounds", fake)
    check_comm_prediction(predict_loop)  # 7 rounds at ratio 0.25, 14 at 1.0: the median is 1.0
    assert calls == [4.0, 1.0]
    assert "measuring 7 more rounds" in capsys.readouterr().out


def test_prediction_fails_when_every_attempt_is_off(monkeypatch):
    fake, calls = _slow_group_measurement([4.0])
    monkeypatch.setattr(c_cost_model, "measured_rounds", fake)
    with pytest.raises(CheckFailed, match=r"0\.25 times the measured time.*after 21 rounds.*rerun"):
        check_comm_prediction(predict_loop)
    assert len(calls) == c_cost_model.ATTEMPTS


WRONG_PREDICTION = {
    "no_ring_factor": (lambda b, n, a, beta: sum(a + x / beta for x in b),
                       r"ring factor 2\(N-1\)/N is missing"),
    "one_reduce_scatter": (lambda b, n, a, beta: sum(a + (n - 1) / n * x / beta for x in b),
                           r"one reduce-scatter"),
    "alpha_once_per_step": (lambda b, n, a, beta: a + sum(2 * (n - 1) / n * x / beta for x in b),
                            r"α counted once per step"),
    "bits_for_bytes": (lambda b, n, a, beta: sum(a + 2 * (n - 1) / n * 8 * x / beta for x in b),
                       r"bits and bytes"),
    "milliseconds": (lambda b, n, a, beta: 1e3 * sum(a + 2 * (n - 1) / n * x / beta for x in b),
                     r"milliseconds"),
    "forgets_return": (lambda b, n, a, beta: None, r"expected a number of seconds"),
}


@pytest.mark.parametrize("mistake, wrong", cases(c_cost_model.CATALOGUE, WRONG_PREDICTION))
def test_prediction_names_each_misconception(mistake, wrong):
    fn, fragment = wrong
    _names_the_mistake(check_comm_prediction, fn, mistake, fragment)



def test_10b_counts_the_state_of_a_one_element_parameter():
    """Which parameters hold optimizer state is found by key (all but AdamW's scalar "step"), so a
    parameter of one element, whose moments have one element too, is seen as holding state."""
    from course_utils.checks.ch10.b_sharded_optimizer import _state_of

    params = [torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(3)),
              torch.nn.Parameter(torch.ones(2))]
    opt = torch.optim.AdamW(params[:2])
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    held, nbytes = _state_of(opt, params)
    assert held == [0, 1]
    assert nbytes == 2 * (1 + 3) * 4  # exp_avg and exp_avg_sq in fp32, no step counter


def _checkpoint_worker(cls, split_at: int, steps: int):
    """Train ``steps`` AdamW steps with ``cls`` on 2 ranks: once straight through, once saved after
    ``split_at`` steps (``state_dict()`` on every rank, through bytes as a file would be), rebuilt
    from scratch, loaded and continued.  Returns both end states and the saved dict's shape."""
    import io

    from course_utils.checking import Outcome, process_group
    from course_utils.data import make_dataset, make_model

    def build(params_from=None):
        model = make_model(seed=700)
        if params_from is not None:
            model.load_state_dict(params_from)
        params = list(model.parameters())
        opt = cls((p for p in params[:3]), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
        opt.add_param_group({"params": params[3:], "lr": 5e-3})
        return model, opt

    def train(model, opt, batches):
        for x, y in batches:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

    with process_group("gloo") as pg:
        x, y = make_dataset(64, seed=12).tensors
        batches = [(x[i::steps], y[i::steps]) for i in range(steps)]
        model, opt = build()
        train(model, opt, batches)
        straight = {k: v.clone() for k, v in model.state_dict().items()}

        model, opt = build()
        train(model, opt, batches[:split_at])
        full = opt.state_dict()  # a collective: every rank calls it
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": full}, buffer)
        del model, opt
        saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
        model, opt = build(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        train(model, opt, batches[split_at:])
        params = list(make_model(seed=700).parameters())
        plain = torch.optim.AdamW(params[:3])
        plain.add_param_group({"params": params[3:]})
        plain.load_state_dict(full)  # the whole state, in the unsharded optimizer's format
        return Outcome(pg.rank, data={
            "straight": straight, "resumed": {k: v.clone() for k, v in model.state_dict().items()},
            "saved": sorted(full["state"]), "moments": sorted(full["state"][0]),
            "groups": [g["params"] for g in full["param_groups"]]})


def test_sharded_optimizer_checkpoint_resumes_where_it_stopped():
    from course_utils.checking import judge, run_workers

    outcomes = judge(run_workers(_checkpoint_worker, 2, args=(mini_ddp.ShardedOptimizer, 2, 4), timeout=60),
                     world=2)
    n = len(outcomes[0].data["straight"])
    for o in outcomes:
        d = o.data
        assert d["saved"] == list(range(n)), "every parameter's state, whichever rank held it"
        assert d["moments"] == ["exp_avg", "exp_avg_sq", "step"]
        assert d["groups"] == [[0, 1, 2], list(range(3, n))]
        for name, want in d["straight"].items():
            assert torch.equal(d["resumed"][name], want), name



def test_relative_fit_keeps_alpha_near_a_small_calls_cost():
    """One large call 0.4 ms slow (a busy moment): the plain least-squares line follows it and its
    intercept lands far from the small calls' cost; the fit on relative error barely moves."""
    from course_utils.measure.ch10 import fit_alpha_beta, fit_alpha_beta_relative

    sizes = [2**k for k in range(12, 23, 2)]
    alpha, beta = 100e-6, 2e9
    seconds = [alpha + ring_factor(2) * s / beta + (400e-6 if s == 2**20 else 0.0) for s in sizes]
    plain_alpha, _ = fit_alpha_beta(sizes, seconds, 2)
    relative_alpha, _ = fit_alpha_beta_relative(sizes, seconds, 2)
    assert abs(relative_alpha - alpha) < 0.1 * alpha
    assert abs(plain_alpha - alpha) > 0.5 * alpha  # 163 us
    exact = [alpha + ring_factor(2) * s / beta for s in sizes]
    a, b = fit_alpha_beta_relative(sizes, exact, 2)
    assert a == pytest.approx(alpha, rel=1e-9) and b == pytest.approx(beta, rel=1e-9)
