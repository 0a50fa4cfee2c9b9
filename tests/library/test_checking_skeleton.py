"""The checker skeleton: ``process_group`` and ``CollectiveSpy``, also when the learner's code raises."""

from __future__ import annotations

import signal
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from course_utils.checking import (
    Catalogue,
    CheckFailed,
    CollectiveSpy,
    Misconception,
    Outcome,
    checker,
    judge,
    process_group,
    run_workers,
    time_limit,
)

REAL = {op: (getattr(dist, op), getattr(c10d, op)) for op in ("all_reduce", "broadcast", "barrier")}


def _raising() -> dict:
    """The body communicates, then raises; the group must be gone afterwards."""
    total = 0.0
    try:
        with process_group("gloo") as pg:
            t = torch.ones(1) * (pg.rank + 1)
            dist.all_reduce(t)
            total = float(t)
            raise ValueError("learner bug")
    except ValueError:
        pass
    return {"closed_after_error": not dist.is_initialized(), "total": total}


def test_process_group_closes_after_the_body_raises():
    assert run_workers(_raising, 2, timeout=60) == [{"closed_after_error": True, "total": 3.0}] * 2


def _destroys_itself() -> bool:
    with process_group("gloo"):
        dist.destroy_process_group()  # the learner's code tore it down already
    return dist.is_initialized()


def test_process_group_tolerates_a_body_that_destroyed_the_group():
    assert run_workers(_destroys_itself, 2, timeout=60) == [False, False]


def _spied() -> dict:
    with process_group("gloo") as pg:
        w = torch.nn.Parameter(torch.ones(4))
        handles = []

        def hook(p: torch.Tensor) -> None:
            handles.append(dist.all_reduce(p.grad, async_op=True))

        w.register_post_accumulate_grad_hook(hook)
        def is_grad(op: str, t: torch.Tensor | None) -> dict:
            return {"is_grad": t is w.grad}

        with CollectiveSpy(("all_reduce", "broadcast"), annotate=is_grad) as spy:
            spy.phase = "backward"
            (w * (pg.rank + 1)).sum().backward()
            spy.phase = "after"
            dist.all_reduce(torch.zeros(2))           # blocking, outside backward
            with spy.paused():
                dist.broadcast(torch.zeros(1), 0)     # the checker's own: not recorded
            dist.broadcast(torch.zeros(3), 0)
            handles[0].wait()
            try:
                with CollectiveSpy(("all_reduce",)):
                    raise RuntimeError("learner bug inside a spy")
            except RuntimeError:
                pass
            # the inner spy put back the outer spy's functions, not torch's
            nested_restored = dist.all_reduce is not REAL["all_reduce"][0]
        calls = [(c.op, c.in_backward, c.async_op, c.waited, c.waited_in_phase, c.phase, c.nbytes,
                  c.extra.get("is_grad")) for c in spy.calls]
        restored = all(getattr(dist, op) is a and getattr(c10d, op) is b for op, (a, b) in REAL.items())
        return {"calls": calls, "restored": restored, "nested": nested_restored, "grad": w.grad.tolist()}


def test_spy_records_op_timing_and_waits_and_restores_everything():
    out = run_workers(_spied, 2, timeout=60)
    for o in out:
        assert o["calls"] == [
            ("all_reduce", True, True, True, "after", "backward", 16, True),
            ("all_reduce", False, False, False, None, "after", 8, False),
            ("broadcast", False, False, False, None, "after", 12, False),
        ]
        assert o["restored"] and o["nested"]
        assert o["grad"] == [3.0] * 4


def test_spy_restores_the_functions_when_the_body_raises():
    with pytest.raises(ZeroDivisionError):
        with CollectiveSpy(("all_reduce", "broadcast", "barrier")):
            assert dist.all_reduce is not REAL["all_reduce"][0]
            assert c10d.all_reduce is not REAL["all_reduce"][1]
            raise ZeroDivisionError("learner bug")
    assert all(getattr(dist, op) is a and getattr(c10d, op) is b for op, (a, b) in REAL.items())


def _reports(problem_on: int) -> Outcome:
    with process_group("gloo") as pg:
        return Outcome(pg.rank, problem="it went wrong" if pg.rank == problem_on else "",
                       data={"rank": pg.rank})


def test_judge_names_the_lowest_rank_with_a_problem_and_returns_outcomes_in_rank_order():
    ok = judge(run_workers(_reports, 2, args=(5,), timeout=60), world=2)
    assert [o.data["rank"] for o in ok] == [0, 1]
    with pytest.raises(CheckFailed, match="rank 1: it went wrong"):
        judge(run_workers(_reports, 2, args=(1,), timeout=60), world=2)
    with pytest.raises(RuntimeError, match="checker bug"):
        judge([Outcome(0), {"not": "an outcome"}], world=2)


def test_catalogue_refuses_duplicates_and_gives_hints():
    m = Misconception("sums", "summing is enough", "gradients twice as large", "divide by the world size")
    cat = Catalogue("00.x demo", m)
    assert cat.hint("sums") == "divide by the world size" and cat.keys() == ["sums"]
    assert "[sums]" in cat.markdown()
    with pytest.raises(ValueError, match="duplicate"):
        Catalogue("00.x demo", m, m)


class _Refused(RuntimeError):
    pass


def test_spy_with_refuse_raises_at_a_forbidden_call_without_running_it_and_restores():
    t = torch.ones(3)
    with pytest.raises(_Refused, match=r"dist\.all_reduce is not allowed in this exercise"):
        with CollectiveSpy(("broadcast",), forbid=("all_reduce",), refuse=_Refused) as spy:
            dist.all_reduce(t)  # no process group: only a call that never runs can get past this
    assert spy.forbidden == ["all_reduce"] and spy.calls == [] and t.tolist() == [1.0] * 3
    assert all(getattr(dist, op) is a and getattr(c10d, op) is b for op, (a, b) in REAL.items())
    with CollectiveSpy(forbid=("all_reduce",)) as spy:  # without refuse: noted, and it runs
        with pytest.raises(ValueError, match="Default process group has not been initialized"):
            dist.all_reduce(t)
    assert spy.forbidden == ["all_reduce"]


def _exchanges() -> list:
    with process_group("gloo") as pg:
        other = 1 - pg.rank
        with CollectiveSpy(("send", "recv", "isend", "irecv")) as spy:
            buf = torch.zeros(2)
            if pg.rank == 0:
                dist.send(torch.ones(2), other)
                dist.irecv(buf, src=other).wait()
            else:
                dist.recv(buf)  # from any source
                dist.isend(torch.ones(2), dst=other).wait()
        return [(c.op, c.peer, c.nbytes) for c in spy.calls]


def test_spy_records_the_peer_of_point_to_point_calls_not_torchs_calls_inside_them():
    # dist.send runs isend and dist.recv runs irecv: one call each, as the learner wrote it
    assert run_workers(_exchanges, 2, timeout=60) == [
        [("send", 1, 8), ("irecv", 1, 8)],
        [("recv", None, 8), ("isend", 0, 8)],
    ]


# ---- time_limit: learner code a checker runs in the notebook's own process -------------------


def _never_returns(*args):
    """A learner's answer that waits forever and swallows ordinary exceptions on the way."""
    while True:
        try:
            time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the point: a bare "except Exception" cannot keep it alive
            pass


def test_time_limit_interrupts_a_loop_that_catches_exceptions_and_names_its_line():
    before, armed = signal.getsignal(signal.SIGALRM), signal.getitimer(signal.ITIMER_REAL)[0]
    t = time.monotonic()
    with pytest.raises(CheckFailed) as e:
        with time_limit(0.5, "answer(x)"):
            _never_returns()
    assert time.monotonic() - t < 5
    msg = str(e.value)
    assert "answer(x) did not return within 0.5 s" in msg and "in _never_returns" in msg
    assert "course_utils" not in msg  # only the learner's frames
    # The handler and timer that were there before (pytest-timeout's, here) are back.
    assert signal.getsignal(signal.SIGALRM) is before
    assert (signal.getitimer(signal.ITIMER_REAL)[0] > 0) == (armed > 0)


def test_time_limit_inside_another_keeps_the_outer_one():
    with pytest.raises(CheckFailed, match="outer did not return within 1 s"):
        with time_limit(1, "outer"):
            with time_limit(30, "inner"):
                pass
            assert 0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 1
            _never_returns()


def test_an_outer_limit_that_comes_first_is_the_one_reported():
    with pytest.raises(CheckFailed, match="outer did not return within 1 s"):
        with time_limit(1, "outer"):
            with time_limit(30, "inner"):
                _never_returns()


def test_in_process_checkers_stop_an_answer_that_never_returns(monkeypatch):
    from course_utils.checking import limits
    from course_utils.checks import ch10, check_comm_prediction, check_train_step

    for check in (check_train_step, check_comm_prediction):  # first, what a first check imports
        with pytest.raises(CheckFailed):
            check(lambda *args: None)
    monkeypatch.setattr(limits, "IN_PROCESS_LIMIT", 2.0)
    monkeypatch.setattr(ch10.c_cost_model, "PREDICT_LIMIT", 2.0)
    for check in (check_train_step, check_comm_prediction):
        t = time.monotonic()
        with pytest.raises(CheckFailed, match="did not return within 2 s") as e:
            check(_never_returns)
        assert time.monotonic() - t < 10, str(e.value)
        assert "_never_returns" in str(e.value), str(e.value)


def test_a_failed_check_shows_its_message_in_jupyter_and_the_whole_traceback_on_request(monkeypatch):
    """IPython renders an exception with ``_render_traceback_`` by that method's lines alone."""
    e = CheckFailed("[01.a training step] not done yet")
    monkeypatch.delenv("COURSE_TRACEBACKS", raising=False)
    (line,) = e._render_traceback_()
    assert line.endswith("CheckFailed\x1b[0m: [01.a training step] not done yet")
    monkeypatch.setenv("COURSE_TRACEBACKS", "full")
    assert not hasattr(e, "_render_traceback_")  # IPython then shows its usual traceback


def _clips_the_method_not_its_parameters(model: torch.nn.Module) -> None:
    model(torch.ones(2, 3)).sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters, 1.0)  # the learner's slip: no call


def test_an_in_process_check_shows_the_learners_own_line_and_no_other_frame():
    @checker("01.z in-process", in_process=True)
    def check(step):
        step(torch.nn.Linear(3, 1))

    with pytest.raises(CheckFailed) as ei:
        check(_clips_the_method_not_its_parameters)
    text = str(ei.value)
    assert "your code raised TypeError: 'method' object is not iterable" in text, text
    assert f"{__file__}\", line" in text and "in _clips_the_method_not_its_parameters" in text, text
    assert "clip_grad_norm_(model.parameters, 1.0)" in text, text
    assert "course_utils" not in text and "torch/nn/utils" not in text and "harness.py" not in text, text

