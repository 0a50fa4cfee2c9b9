"""report() and the live display: the channel from workers, the displays, the headless fallback."""

from __future__ import annotations

import base64
import fcntl
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from course_utils import RankFailure, WorkerError, WorkerTimeout, launch, monitor, report
from course_utils.monitor import choice, reporting
from course_utils.workers import reports

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class Recorder:
    """A display that keeps every report it is given, optionally slowly."""

    def __init__(self, delay: float = 0.0, first_delay: float = 0.0):
        self.delay, self.first_delay = delay, first_delay
        self.got: dict[int, list[dict]] = {}
        self.failures = None
        self.calls = 0

    def update(self, rank, metrics):
        if self.calls == 0 and self.first_delay:
            time.sleep(self.first_delay)  # a notebook that froze for a while
        self.calls += 1
        if self.delay:
            time.sleep(self.delay)
        self.got.setdefault(rank, []).append(metrics)

    def finish(self, failures):
        self.failures = dict(failures)

    def steps(self, rank):
        return [m["step"] for m in self.got.get(rank, [])]


# --------------------------------------------------------------------------------------------
# Worker functions (module level: shipped to the workers by value with cloudpickle)
# --------------------------------------------------------------------------------------------


def paced_reports(n: int, rate: float) -> int:
    """``n`` reports at ``rate`` per second."""
    t0 = time.perf_counter()
    for i in range(n):
        report(step=i + 1, total=n, loss=1.0 / (i + 1))
        wait = t0 + (i + 1) / rate - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
    return n


def burst_then_wait(n: int, pad: int, wait: float) -> dict:
    """``n`` large reports as fast as possible, then stay alive ``wait`` seconds."""
    note = "x" * pad
    t0 = time.perf_counter()
    for i in range(n):
        report(step=i + 1, total=n, loss=float(i), note=note)
    loop_s = time.perf_counter() - t0
    time.sleep(wait)
    return {"loop_s": loop_s, "dropped": reports.stats()["dropped"], "in_worker": reports.in_worker()}


def dies_at(step_to_die: int, how: str, n: int = 100, flag: str = "") -> None:
    """Rank 1 dies after ``step_to_die`` steps (once rank 0 has reported, when ``flag`` is a path)."""
    rank = int(os.environ["RANK"])
    for i in range(n):
        if rank == 0 and flag and i == 3:
            Path(flag).touch()
        if rank == 1 and i == step_to_die:
            while flag and not os.path.exists(flag):
                time.sleep(0.01)
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "raise":
                raise RuntimeError("injected failure")
            if how == "hang":
                time.sleep(600)
        report(step=i + 1, total=n, loss=1.0)
        time.sleep(0.01 if rank == 1 else 0.02)


def train_then_fail(fail_rank: int, reported: str, n: int = 50) -> int:
    """Every rank reports n steps; ``fail_rank`` raises at step 37, once the file ``reported``
    says that another rank has sent its first report (on a loaded machine a rank can start
    seconds after the others: without the wait, rank 0 was once stopped before any report)."""
    rank = int(os.environ["RANK"])
    for i in range(n):
        report(step=i + 1, total=n, loss=1.0 / (i + 1) + rank, samples_per_s=1000.0)
        if rank != fail_rank and i == 0:
            Path(reported).touch()
        if rank == fail_rank and i + 1 == 37:
            deadline = time.monotonic() + 60
            while not os.path.exists(reported) and time.monotonic() < deadline:
                time.sleep(0.01)
            raise RuntimeError("boom")
        time.sleep(0.002)
    return rank


# --------------------------------------------------------------------------------------------
# report() outside launch
# --------------------------------------------------------------------------------------------


def test_report_outside_launch_is_a_rank0_log_line(monkeypatch, capsys):
    monkeypatch.setattr(reporting, "_logged_any", False)
    monkeypatch.setattr(reporting, "_last_log", 0.0)
    monkeypatch.delenv("RANK", raising=False)
    report(step=1, total=3, loss=0.5)
    report(step=2, total=3, loss=0.4)  # within LOG_EVERY_S of the first: not printed
    report(step=3, total=3, loss=0.3)  # the last step is always printed
    err = capsys.readouterr().err.splitlines()
    assert err == ["[report] step=1 total=3 loss=0.5", "[report] step=3 total=3 loss=0.3"]
    monkeypatch.setenv("RANK", "1")
    report(step=3, total=3, loss=0.3)
    assert capsys.readouterr().err == ""


def test_report_converts_tensors_and_rejects_vectors(monkeypatch):
    import torch

    seen = []
    monkeypatch.setattr(reporting, "_sink", type("S", (), {"update": lambda self, r, m: seen.append(m)})())
    report(loss=torch.tensor(0.25), step=torch.tensor(3))
    assert seen == [{"loss": 0.25, "step": 3}]
    with pytest.raises(TypeError, match="takes a number; got a Tensor with 4 elements"):
        report(loss=torch.ones(4))


# --------------------------------------------------------------------------------------------
# The channel, worker side, in this process
# --------------------------------------------------------------------------------------------


def _frames(data: bytes) -> list[dict]:
    out = []
    while len(data) >= 4:
        (n,) = struct.unpack("<I", data[:4])
        out.append(pickle.loads(data[4:4 + n]))
        data = data[4 + n:]
    assert data == b""
    return out


def test_send_report_never_blocks_and_keeps_the_last_report(monkeypatch):
    r, w = os.pipe()
    try:
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)  # the smallest pipe: fills after ~60 reports
        os.set_blocking(w, False)
        monkeypatch.setattr(reports, "PIPE_SIZES", (4096,))
        reports.open_channel(w)
        n = 2000
        # nobody reads: a blocking write would hang here for ever
        written = [reports.send_report({"step": i + 1, "loss": 0.5}) for i in range(n)]
        assert written[0] and not all(written), "the pipe never filled: the test proves nothing"
        assert reports.stats()["dropped"] > 0
        # now the notebook reads: everything it gets is in order, and the last report arrives
        # (written by the flusher thread once there is room)
        got, data, deadline = [], b"", time.monotonic() + 10
        while (not got or got[-1]["step"] != n) and time.monotonic() < deadline:
            try:
                data += os.read(r, 65536) if _readable(r) else b""
            except BlockingIOError:
                pass
            cut = _complete_prefix(data)
            got += _frames(data[:cut])
            data = data[cut:]
        steps = [m["step"] for m in got]
        assert steps[-1] == n
        assert steps == sorted(set(steps)), "reports out of order or repeated"
        assert reports.wait_flushed(5), "the flusher thread did not end once its report was written"
    finally:
        reports.close_channel()
        os.close(r)
        os.close(w)


def _readable(fd: int) -> bool:
    import select

    return bool(select.select([fd], [], [], 0.05)[0])


def _complete_prefix(data: bytes) -> int:
    i = 0
    while len(data) - i >= 4:
        (n,) = struct.unpack("<I", data[i:i + 4])
        if len(data) - i < 4 + n:
            break
        i += 4 + n
    return i


# --------------------------------------------------------------------------------------------
# The channel through launch
# --------------------------------------------------------------------------------------------


def test_1000_reports_per_second_per_rank_arrive_complete_and_in_order():
    n = 2000  # 2 s at 1 kHz on each of 2 ranks
    disp = Recorder()
    assert launch(paced_reports, 2, args=(n, 1000.0), timeout=60, display=disp) == [n, n]
    for rank in (0, 1):
        assert disp.steps(rank) == list(range(1, n + 1))
    assert disp.failures == {}


def test_a_frozen_notebook_never_blocks_a_worker_and_the_last_report_arrives():
    # The display freezes the launcher for 2 s on its first report: meanwhile each rank writes
    # 3000 reports of ~450 bytes (1.3 MB, more than the pipe holds) and then stays alive.
    freeze = 2.0
    disp = Recorder(first_delay=freeze)
    results = launch(burst_then_wait, 2, args=(3000, 400, freeze + 1.0), timeout=60, display=disp)
    for rank, res in enumerate(results):
        assert res["in_worker"] is True
        assert res["dropped"] > 0, "the pipe never filled: the test proves nothing"
        # a blocking write would have waited for the frozen notebook
        assert res["loop_s"] < freeze, f"rank {rank}'s report() calls waited for the notebook"
        steps = disp.steps(rank)
        assert steps[-1] == 3000, "the last report was lost"
        assert steps == sorted(set(steps)), "reports out of order or repeated"
        assert len(steps) < 3000  # intermediate reports were dropped, by design


def test_a_slow_display_gets_coalesced_reports_and_every_last_one():
    disp = Recorder(delay=0.004)  # each update takes 4 ms; reports come at 2 x 1000/s
    launch(paced_reports, 2, args=(1500, 1000.0), timeout=60, display=disp)
    assert disp.calls < 3000, "the slow display was called for every report"
    for rank in (0, 1):
        steps = disp.steps(rank)
        assert steps[-1] == 1500 and steps == sorted(set(steps))


def test_a_dead_worker_does_not_hang_the_display(capsys, tmp_path):
    disp = monitor.make_display(2, mode="text")
    with pytest.raises(WorkerError) as info:
        launch(dies_at, 2, args=(10, "kill", 100, str(tmp_path / "flag")), timeout=120, display=disp)
    assert not isinstance(info.value, WorkerTimeout)
    lines = capsys.readouterr().out.splitlines()
    # in a terminal each line ends with the last metrics ("; loss=1")
    assert lines[1] == "rank 1: stopped at step 10/100: killed by SIGKILL; loss=1", lines
    assert lines[0].startswith("rank 0: stopped at step ") and \
        lines[0].endswith("/100: killed after rank 1 failed; loss=1"), lines


def test_a_hung_worker_is_shown_where_it_stopped(capsys):
    with pytest.raises(WorkerTimeout):
        launch(dies_at, 2, args=(3, "hang", 20), timeout=4)  # display="auto": text here
    out = capsys.readouterr().out
    assert "rank 0: step 20/20, done; loss=1" in out
    assert "rank 1: stopped at step 3/20: still running when the launch timed out; loss=1" in out


def test_no_thread_or_process_is_left_behind():
    import psutil

    launch(paced_reports, 2, args=(5, 1000.0), display=Recorder())  # the fork server starts once
    me = psutil.Process()
    threads = set(threading.enumerate())
    children = {p.pid for p in me.children(recursive=True)}
    launch(burst_then_wait, 2, args=(3000, 400, 0.5), display=Recorder(first_delay=0.5))
    with pytest.raises(WorkerError):
        launch(dies_at, 2, args=(5, "raise"), display=Recorder())
    time.sleep(0.2)
    assert set(threading.enumerate()) == threads
    assert {p.pid for p in me.children(recursive=True)} == children


# --------------------------------------------------------------------------------------------
# The display guard between the launcher and a display
# --------------------------------------------------------------------------------------------


def test_display_holder_coalesces_a_slow_display_and_finish_delivers_the_last():
    disp = Recorder(delay=0.005)
    holder = monitor.DisplayGuard(disp, 2)
    t0 = time.monotonic()
    for i in range(1500):
        holder.update(i % 2, {"step": i // 2 + 1})
    elapsed = time.monotonic() - t0
    assert disp.calls < 1500 and holder.coalesced > 0
    # the display got at most its share of the time (plus the one hand-over that crossed it)
    assert holder.spent_s <= holder.BUDGET * max(1.0, elapsed) + 0.1
    holder.finish({})
    assert disp.steps(0)[-1] == 750 and disp.steps(1)[-1] == 750
    assert disp.failures == {}


def test_display_holder_tells_an_unfinished_display_it_was_interrupted():
    disp = Recorder()
    holder = monitor.DisplayGuard(disp, 2)
    holder.update(0, {"step": 1})
    holder.close()
    assert sorted(disp.failures) == [0, 1]
    assert disp.failures[0].kind == "stopped" and "interrupted" in disp.failures[0].message


def test_a_broken_display_does_not_break_the_launch():
    class Broken:
        def update(self, rank, metrics):
            raise RuntimeError("display bug")

        def finish(self, failures):
            raise RuntimeError("display bug")

    assert launch(paced_reports, 2, args=(20, 1000.0), display=Broken()) == [20, 20]


# --------------------------------------------------------------------------------------------
# What the displays show
# --------------------------------------------------------------------------------------------


def test_status_lines_name_the_rank_the_step_and_the_failure():
    st = monitor.RankState()
    assert monitor.status_line(0, st) == "rank 0: no reports, done"
    st.add({"loss": 1.0}, "loss")
    assert monitor.status_line(0, st) == "rank 0: 1 report, done"
    st.add({"step": 37, "total": 50, "loss": 0.5}, "loss")
    assert monitor.status_line(2, st) == "rank 2: step 37/50, done"
    cases = [
        (RankFailure(2, "exception", exc_type="ValueError"), "raised ValueError"),
        (RankFailure(2, "signal", exitcode=-9), "killed by SIGKILL"),
        (RankFailure(2, "exit", exitcode=3), "exited with code 3"),
        (RankFailure(2, "timeout"), "still running when the launch timed out"),
        (RankFailure(2, "stopped", message="killed after rank 1 failed"), "killed after rank 1 failed"),
    ]
    for failure, why in cases:
        assert monitor.status_line(2, st, failure) == f"rank 2: stopped at step 37/50: {why}"
    done = RankFailure(2, "stopped", message="finished, but rank 1 failed", finished_anyway=True)
    assert monitor.status_line(2, st, done) == "rank 2: step 37/50, finished, but rank 1 failed"
    assert monitor.status_line(3, monitor.RankState(), RankFailure(3, "signal", exitcode=-9)) == \
        "rank 3: stopped before its first report: killed by SIGKILL"


def test_the_curve_keeps_its_shape_and_its_last_point_when_decimated(monkeypatch):
    monkeypatch.setattr(monitor.SETTINGS, "MAX_POINTS", 100)
    st = monitor.RankState()
    for i in range(1001):
        st.add({"step": i + 1, "loss": float(i)}, "loss")
    xs, ys = st.points()
    assert len(xs) <= 101 and xs[0] == 1 and xs[-1] == 1001 and ys[-1] == 1000.0
    assert xs == sorted(xs)


def test_widget_display_state_after_a_run(capsys, tmp_path):
    disp = monitor.WidgetDisplay(2)
    with pytest.raises(WorkerError):
        launch(train_then_fail, 2, args=(1, str(tmp_path / "reported")), timeout=60, display=disp)
    capsys.readouterr()  # outside a kernel, display() prints reprs
    bar0, bar1 = disp.bars
    # Rank 0 had reported before rank 1 raised. It then finished while the launcher gathered the
    # last output, or was stopped (its last report may be its last step): red, at its length.
    assert (bar0.max, bar0.bar_style) == (50, "danger"), (bar0.value, bar0.max, bar0.bar_style)
    label0 = disp.labels[0].value
    assert (bar0.value == 50 and "step 50/50, finished, but rank 1 failed" in label0) or \
        (f"stopped at step {bar0.value}/50: killed after rank 1 failed" in label0), label0
    assert (bar1.value, bar1.max, bar1.bar_style) == (37, 50, "danger")
    assert "stopped at step 37/50: raised RuntimeError" in disp.labels[1].value
    assert "samples_per_s 1000" in disp.labels[1].value
    assert "rank(s) 1 failed" in disp.header.value
    assert disp.plot.value[:8] == PNG_MAGIC  # the final figure
    assert disp.closed and bar0.comm is None  # the widget models were released


def test_widget_display_while_running_without_total(monkeypatch):
    monkeypatch.setattr(monitor.SETTINGS, "PLOT_FIRST_S", 0.0)
    disp = monitor.WidgetDisplay(1)
    disp.update(0, {"step": 5, "loss": 0.5, "phase": "warm-up"})
    assert disp.bars[0].layout.visibility == "hidden"  # no total: a step counter, no bar
    assert disp.labels[0].value == "step 5 · loss 0.5 · phase warm-up"
    assert disp.plot.value[:8] == PNG_MAGIC and disp.plot.layout.display is None
    first = disp.plot.value
    disp.update(0, {"step": 6, "loss": 0.45})
    assert disp.redraws == 1 and disp.plot.value == first  # redraws are throttled
    disp.update(0, {"step": 6, "total": 10, "loss": 0.4})
    disp._refresh()
    assert (disp.bars[0].value, disp.bars[0].max, disp.bars[0].layout.visibility) == (6, 10, "visible")
    disp.finish({})
    assert disp.bars[0].value == 10 and disp.bars[0].bar_style == "success"


def test_display_mode_rules(monkeypatch):
    monkeypatch.setattr(monitor.SETTINGS, "DISPLAY", None)
    monkeypatch.delenv("COURSE_DISPLAY", raising=False)
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    monkeypatch.setattr(choice, "in_kernel", lambda: True)
    assert monitor.display_mode() == "text"  # a kernel that no Jupyter server started: nbval
    monkeypatch.setenv("JPY_SESSION_NAME", "/course/notebooks/01.ipynb")
    assert monitor.display_mode() == "widgets"  # JupyterLab
    monkeypatch.setenv("COURSE_DISPLAY", "text")
    assert monitor.display_mode() == "text"
    monkeypatch.setattr(monitor.SETTINGS, "DISPLAY", "none")
    assert monitor.display_mode() == "none"
    monkeypatch.setattr(monitor.SETTINGS, "DISPLAY", "loud")
    with pytest.raises(ValueError, match="widgets, text, none"):
        monitor.display_mode()
    monkeypatch.setattr(monitor.SETTINGS, "DISPLAY", "widgets")
    monkeypatch.setattr(choice, "in_kernel", lambda: False)
    assert monitor.display_mode() == "text"  # no widgets in a terminal


def test_live_shows_reports_made_in_this_process():
    disp = monitor.NullDisplay(1)
    with monitor.live(display=disp):
        report(step=1, total=2, loss=0.7)
        report(step=2, total=2, loss=0.6)
    assert disp.failures == {} and disp.states[0].where() == "step 2/2"
    disp = monitor.NullDisplay(1)
    with pytest.raises(KeyError):
        with monitor.live(display=disp):
            report(step=1, total=2, loss=0.7)
            raise KeyError("x")
    assert monitor.status_line(0, disp.states[0], disp.failures[0]) == \
        "rank 0: stopped at step 1/2: raised KeyError"
    assert reporting._sink is None


# --------------------------------------------------------------------------------------------
# In a real kernel: the widget path's saved output, and the headless fallback under nbval
# --------------------------------------------------------------------------------------------

WORKER_CELL = '''\
import os, time
import course_utils
from course_utils import launch, report

def work(n, fail_at=None, flag=None):
    rank = int(os.environ["RANK"])
    for i in range(n):
        if fail_at and i + 1 > fail_at[rank]:
            if rank == 1:
                # rank 1 fails once rank 0 has sent its report of step 5 (the flag file): on a
                # loaded machine rank 0 can start seconds after rank 1 (seen: "step 4/10" here once,
                # and a rank 0 stopped before its first report in another test of this file)
                while not os.path.exists(flag):
                    time.sleep(0.01)
                raise ValueError("bad batch")
            open(flag, "w").close()
            time.sleep(60)  # rank 0 waits here until the launcher stops it
        report(step=i + 1, total=n, loss=1.0 / (i + 1) + 0.1 * rank)
        time.sleep(0.003)
'''

LAUNCH_CELL = "# NBVAL_CHECK_OUTPUT\nresults = launch(work, 2, args=(30,), timeout=60)"

FAIL_CELL = '''\
# NBVAL_CHECK_OUTPUT
try:
    launch(work, 2, args=(10, {0: 5, 1: 7}, os.path.abspath(f"reported-{time.time_ns()}")), timeout=60)
except course_utils.WorkerError as e:
    print(e.summary)
'''


def _notebook(env_mode: str | None):
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(WORKER_CELL), nbformat.v4.new_code_cell(LAUNCH_CELL),
                nbformat.v4.new_code_cell(FAIL_CELL)]
    if env_mode:
        nb.cells.insert(0, nbformat.v4.new_code_cell(
            f"import course_utils.monitor\ncourse_utils.monitor.SETTINGS.DISPLAY = {env_mode!r}"))
    return nb


def _execute(nb, cwd: Path):
    from nbclient import NotebookClient

    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(cwd)}}).execute()
    return nb


def _texts(cell) -> str:
    out = []
    for o in cell.outputs:
        if o.output_type == "stream":
            out.append(o.text)
        elif "data" in o:
            out.append(o.data.get("text/plain", "") + "\n")
    return "".join(out)


def test_widget_path_in_a_kernel_leaves_a_static_summary_and_figure(tmp_path):
    nb = _execute(_notebook("widgets"), tmp_path)
    launch_cell, fail_cell = nb.cells[2], nb.cells[3]
    for cell in (launch_cell, fail_cell):
        mimes = [m for o in cell.outputs for m in o.get("data", {})]
        assert "application/vnd.jupyter.widget-view+json" not in mimes, "a live widget was left behind"
        assert "text/html" in mimes and "image/png" in mimes
    assert _texts(launch_cell).startswith("rank 0: step 30/30, done\nrank 1: step 30/30, done\n")
    assert "rank 1: stopped at step 7/10: raised ValueError" in _texts(fail_cell)


def test_headless_fallback_is_deterministic_under_nbval(tmp_path):
    import nbformat

    nb = _execute(_notebook(None), tmp_path)
    launch_cell, fail_cell = nb.cells[1], nb.cells[2]
    assert _texts(launch_cell) == ("rank 0: step 30/30, done\nrank 1: step 30/30, done\n"
                                   "<IPython.core.display.Image object>\n")
    png = [o.data["image/png"] for o in launch_cell.outputs if "data" in o][0]
    assert base64.b64decode(png)[:8] == PNG_MAGIC
    assert _texts(fail_cell).startswith(
        "rank 0: stopped at step 5/10: killed after rank 1 failed\n"
        "rank 1: stopped at step 7/10: raised ValueError\n")
    # nbval (strict, not lax) re-runs the notebook and compares the tagged cells' output
    path = tmp_path / "fallback.ipynb"
    nbformat.write(nb, path)
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
         "-p", "tests.kernel_sockets",  # its kernel over Unix sockets, as in the suite
         "--nbval", "--nbval-sanitize-with", str(ROOT / "tests" / "nbval_sanitize.cfg"), str(path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=180,
        env=dict(os.environ, PYTHONPATH=str(ROOT)))  # where -p finds tests/kernel_sockets.py
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "3 passed" in res.stdout


def test_the_live_pace_is_the_rate_between_the_first_and_latest_step_and_gives_the_time_left(monkeypatch):
    from course_utils.monitor import state

    clock = iter([100.0, 100.1, 102.0])
    monkeypatch.setattr(state.time, "monotonic", lambda: next(clock))
    st = state.RankState()
    st.add({"step": 1, "total": 41, "loss": 2.0}, "loss")
    assert st.pace() == ""  # one report: no rate yet
    st.add({"step": 2, "total": 41}, "loss")
    assert st.pace() == ""  # 0.1 s apart: too short to say
    st.add({"step": 21, "total": 41}, "loss")
    assert st.pace() == "10 steps/s, about 2 s left"  # 20 steps in 2 s, 20 to go


def test_the_widget_header_says_so_by_itself_when_the_kernel_stops_redrawing_it(monkeypatch):
    """After a kernel restart during a launch the widget stayed at 'running ... 44 s left': the
    header carries a notice that the browser shows by itself (a CSS animation, delayed STALE_S)
    unless the kernel redraws the header first, every BEAT_S seconds while the launch runs."""
    from course_utils.monitor import widget

    monkeypatch.setattr(widget, "BEAT_S", 0.05)
    disp = monitor.WidgetDisplay(1)
    first = disp.header.value
    assert "animation: course-stale 0.01s 20s forwards" in first and "visibility: hidden" in first
    assert "if it was restarted or stopped, this launch was stopped with it" in first
    deadline = time.monotonic() + 30
    while disp.beats < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert disp.beats >= 3 and disp.header.value != first  # a new value: the browser restarts the delay
    disp.finish({})
    beats = disp.beats
    time.sleep(0.3)
    assert disp.beats == beats and not disp._beater.is_alive()
    assert "course-stale" not in disp.header.value and "finished" in disp.header.value
