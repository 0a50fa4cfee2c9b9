"""Chapter 13 checker: 13.a accepts right answers written three ways and rejects each misconception of
its catalogue with its message; the recorded dumps are what the recording script's table says."""

from __future__ import annotations

import collections
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
from misconceptions import cases  # tests/checkers/misconceptions.py, beside this file

from course_utils.checking import CheckFailed
from course_utils.checks import check_find_culprit
from course_utils.checks.ch13 import a_find_culprit
from course_utils.checks.ch13.a_find_culprit import FAILURES, load_recorded, reference_culprit
from course_utils.measure.ch13 import (
    PY_SPY,
    DumpSkipped,
    collectives,
    learner_frame,
    load_dumps,
    main_thread,
    print_records,
    py_spy_dump,
    stuck_frame,
)

# ---- the recorded dumps --------------------------------------------------------------------------


def test_the_recorded_jobs_are_what_the_recording_script_provoked():
    # tools/record_ch13_dumps.py: the rank that misbehaves, at step 3 (three collectives a step, or
    # four in `order`: sequence ids 10, or 13).
    expected = {
        "healthy": None,
        "collective": {"kind": "collective", "seq_id": 10, "ranks": [2]},
        "order": {"kind": "collective", "seq_id": 13, "ranks": [0]},
        "shape": {"kind": "shape", "seq_id": 10, "ranks": [3]},
        "missing": {"kind": "missing", "seq_id": 10, "ranks": [2]},
        "missing_wrapped": {"kind": "missing", "seq_id": 10, "ranks": [1]},
    }
    assert list(FAILURES) == list(expected)
    for failure, want in expected.items():
        dumps = load_recorded(failure)
        assert sorted(dumps) == [0, 1, 2, 3], failure
        assert reference_culprit(dumps) == want, failure
    wrapped = load_recorded("missing_wrapped")
    assert {r: len(d["entries"]) for r, d in wrapped.items()} == {0: 8, 1: 8, 2: 8, 3: 8}
    assert {r: d["entries"][0]["collective_seq_id"] for r, d in wrapped.items()} == {0: 5, 1: 2, 2: 5, 3: 5}
    # Each entry's frames lead back to the recording script, as the lesson's table shows them.
    first = collectives(load_recorded("collective")[2])[-3]
    assert (first.seq, first.op, first.shapes) == (10, "barrier", ())
    assert first.frame.startswith("record_ch13_dumps.py:") and first.frame.endswith(" in _step")
    assert learner_frame([{"name": "all_reduce", "filename": "torch/distributed/x.py", "line": 1}]) == \
        "(no frame outside torch)"


def test_the_learner_gets_a_copy_of_the_dumps(capsys):
    def mutates(dumps):
        answer = reference_culprit(dumps)
        for d in dumps.values():
            d["entries"].clear()
        return answer

    check_find_culprit(mutates)
    assert "[PASS] 13.a find culprit" in capsys.readouterr().out


# ---- right answers -------------------------------------------------------------------------------


def culprit_by_majority(dumps):  # the solution's way: every sequence id from the newest start
    seqs = {}
    for rank, dump in dumps.items():
        seqs[rank] = {e["collective_seq_id"]: (e["profiling_name"], [list(s) for s in e["input_sizes"]])
                      for e in dump["entries"]}
    start = max(min(s) for s in seqs.values())
    for seq in sorted(set().union(*seqs.values())):
        if seq < start:
            continue
        absent = [r for r in seqs if seq not in seqs[r]]
        if absent:
            return {"kind": "missing", "seq_id": seq, "ranks": absent}
        calls = {r: repr(seqs[r][seq]) for r in seqs}
        common, _ = collections.Counter(calls.values()).most_common(1)[0]
        odd = [r for r in calls if calls[r] != common]
        if odd:
            same_op = all(seqs[r][seq][0] == eval(common)[0] for r in odd)
            return {"kind": "shape" if same_op else "collective", "seq_id": seq, "ranks": odd}
    return None


def culprit_last_ids_first(dumps):  # a missing rank first (its last id is behind), then mismatches
    last = {r: max(e["collective_seq_id"] for e in d["entries"]) for r, d in dumps.items()}
    if len(set(last.values())) > 1:
        behind = min(last.values())
        return {"kind": "missing", "seq_id": behind + 1, "ranks": {r for r in last if last[r] == behind}}
    tables = {r: {e["collective_seq_id"]: e for e in d["entries"]} for r, d in dumps.items()}
    shared = set.intersection(*(set(t) for t in tables.values()))
    for seq in sorted(shared):
        ops = {r: t[seq]["profiling_name"] for r, t in tables.items()}
        sizes = {r: str(t[seq]["input_sizes"]) for r, t in tables.items()}
        for values, kind in ((ops, "collective"), (sizes, "shape")):
            counts = collections.Counter(values.values())
            if len(counts) > 1:
                usual = counts.most_common(1)[0][0]
                return {"kind": kind, "seq_id": seq, "ranks": sorted(r for r in values if values[r] != usual)}
    return None


class Culprit(collections.namedtuple("Culprit", "kind seq_id ranks")):
    """An answer as a named tuple instead of a dict."""


def culprit_as_named_tuple(dumps):
    found = reference_culprit(dumps)
    return None if found is None else Culprit(found["kind"], found["seq_id"], tuple(found["ranks"]))


@pytest.mark.parametrize("right", [culprit_by_majority, culprit_last_ids_first, culprit_as_named_tuple],
                         ids=lambda f: f.__name__)
def test_accepts_right_answers_written_differently(right, capsys):
    check_find_culprit(right)
    assert "[PASS] 13.a find culprit" in capsys.readouterr().out


# ---- wrong answers, one per misconception ---------------------------------------------------------


def crashes_on_healthy(dumps):
    found = reference_culprit(dumps)
    return {"kind": found["kind"], "seq_id": found["seq_id"], "ranks": found["ranks"]}  # None[...]


def compares_last_entry(dumps):
    last = {r: d["entries"][-1] for r, d in dumps.items()}
    ids = {r: e["collective_seq_id"] for r, e in last.items()}
    if len(set(ids.values())) > 1:
        behind = min(ids.values())
        return {"kind": "missing", "seq_id": behind + 1, "ranks": [r for r in ids if ids[r] == behind]}
    calls = {r: (e["profiling_name"], str(e["input_sizes"])) for r, e in last.items()}
    usual = collections.Counter(calls.values()).most_common(1)[0][0]
    odd = [r for r in calls if calls[r] != usual]
    return {"kind": "collective", "seq_id": max(ids.values()), "ranks": odd} if odd else None


def blames_rank_zero(dumps):
    found = reference_culprit(dumps)
    return None if found is None else dict(found, ranks=[0])


def ignores_shapes(dumps):
    stripped = {r: dict(d, entries=[dict(e, input_sizes=[]) for e in d["entries"]]) for r, d in dumps.items()}
    return reference_culprit(stripped)


def fewer_entries_is_mismatch(dumps):
    found = reference_culprit(dumps)
    return dict(found, kind="collective") if found and found["kind"] == "missing" else found


def compares_positions(dumps):
    lists = {r: d["entries"] for r, d in dumps.items()}
    for i in range(max(len(v) for v in lists.values())):
        absent = [r for r, v in lists.items() if i >= len(v)]
        here = {r: v[i] for r, v in lists.items() if i < len(v)}
        seq = max(e["collective_seq_id"] for e in here.values())
        if absent:
            return {"kind": "missing", "seq_id": seq, "ranks": absent}
        calls = {r: (e["profiling_name"], str(e["input_sizes"])) for r, e in here.items()}
        usual = collections.Counter(calls.values()).most_common(1)[0][0]
        odd = [r for r in calls if calls[r] != usual]
        if odd:
            same_op = all(calls[r][0] == usual[0] for r in odd)
            return {"kind": "shape" if same_op else "collective", "seq_id": seq, "ranks": odd}
    return None


def seq_id_off_by_one(dumps):
    found = reference_culprit(dumps)
    return None if found is None else dict(found, seq_id=found["seq_id"] - 1)  # the last one that agreed


def blames_waiting_ranks(dumps):
    found = reference_culprit(dumps)
    if found and found["kind"] == "missing":
        return dict(found, ranks=sorted(set(dumps) - set(found["ranks"])))
    return found


WRONG = {f.__name__: (f, message) for f, message in [
    (crashes_on_healthy, r"on a healthy job .*find_culprit raised TypeError"),
    (compares_last_entry, r"rank 2 called barrier\(\).*returned None"),
    (blames_rank_zero, r"rank 2 called barrier\(\).*ranks=\[0\], expected .*ranks=\[2\]"),
    (ignores_shapes, r"\(6, 2\) view.*returned None \(no culprit\), expected kind='shape', seq_id=10"),
    (fewer_entries_is_mismatch, r"rank 2 never arrived.*kind='collective'.*expected kind='missing'"),
    (compares_positions, r"8-entry buffer.*returned None"),
    (seq_id_off_by_one, r"rank 2 called barrier\(\).*seq_id=9, ranks=\[2\], expected .*seq_id=10"),
    (blames_waiting_ranks, r"rank 2 never arrived.*ranks=\[0, 1, 3\], expected .*ranks=\[2\]"),
]}


@pytest.mark.parametrize("mistake, wrong", cases(a_find_culprit.CATALOGUE, WRONG))
def test_rejects_typical_mistakes(mistake, wrong):
    answer, message = wrong
    with pytest.raises(CheckFailed, match=message) as info:
        check_find_culprit(answer)
    assert mistake.message in info.value.args[0]


def test_rejects_stub_none_and_bad_returns():
    def stub(dumps):
        raise NotImplementedError("Exercise 13.a find culprit: replace this line with your code")

    with pytest.raises(CheckFailed, match="not done yet"):
        check_find_culprit(stub)
    with pytest.raises(CheckFailed, match="got None"):
        check_find_culprit(None)
    healthy = r"(?s)healthy job .*: find_culprit returned kind='missing'.*must return None"
    with pytest.raises(CheckFailed, match=healthy):
        check_find_culprit(lambda dumps: {"kind": "missing", "seq_id": 1, "ranks": [0]})
    with pytest.raises(CheckFailed, match="expected None or a dict"):
        check_find_culprit(lambda dumps: reference_culprit(dumps) and "rank 2")
    with pytest.raises(CheckFailed, match=r"kind='mismatch'; expected one of"):
        check_find_culprit(lambda dumps: reference_culprit(dumps) and dict(reference_culprit(dumps),
                                                                          kind="mismatch"))
    with pytest.raises(CheckFailed, match="without the key 'ranks'"):
        check_find_culprit(lambda dumps: reference_culprit(dumps) and {"kind": "collective", "seq_id": 10})


# ---- the lesson's readers -------------------------------------------------------------------------

PY_SPY_OUTPUT = """Process 4242: python -u ch13_hang.py --fault missing
Python v3.11.7 (/usr/bin/python3.11)

Thread 4250 (active): "Thread-1 (import_module)"
    _find_and_load (<frozen importlib._bootstrap>:1176)
    import_module (/usr/lib/python3.11/importlib/__init__.py:126)
Thread 4242 (idle): "MainThread"
    all_reduce (/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py:3245)
    wrapper (/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py:83)
    train_step (/work/notebooks/ch13_hang.py:45)
    main (/work/notebooks/ch13_hang.py:69)
"""


def test_the_main_thread_and_its_stuck_frame_are_read_from_py_spy():
    assert main_thread(PY_SPY_OUTPUT).startswith('Thread 4242 (idle): "MainThread"')
    assert stuck_frame(PY_SPY_OUTPUT) == "ch13_hang.py:45 in train_step"
    only_torch = "Thread 1 (idle)\n    all_reduce (/venv/lib/python3.11/site-packages/torch/x.py:1)\n"
    assert stuck_frame(only_torch) == "(no frame outside torch)"


def test_load_dumps_reads_every_rank_file_and_nothing_else(tmp_path, capsys):
    for rank, dump in load_recorded("missing").items():
        (tmp_path / f"rank{rank}.pkl").write_bytes(pickle.dumps(dump))
    (tmp_path / "rank_notes.pkl").write_bytes(b"")
    (tmp_path / "pid0").write_text("1")
    dumps = load_dumps(tmp_path)
    assert list(dumps) == [0, 1, 2, 3]
    print_records(dumps, last=2)
    out = capsys.readouterr().out
    assert "rank 2: 9 collective(s) recorded, the last 2:" in out
    assert "  12  all_reduce  1            scheduled  record_ch13_dumps.py:" in out


def test_load_dumps_names_a_bad_rank_file_keeps_the_good_ranks_and_runs_no_code(tmp_path):
    good = load_recorded("missing")
    for rank in (0, 1):
        (tmp_path / f"rank{rank}.pkl").write_bytes(pickle.dumps(good[rank]))
    (tmp_path / "rank2.pkl").write_bytes(pickle.dumps(good[2])[:200])  # cut short
    (tmp_path / "rank3.pkl").write_bytes(os.urandom(4096))
    (tmp_path / "rank4.pkl").write_bytes(b"")
    (tmp_path / "rank5.pkl").write_bytes(pickle.dumps([1, 2, 3]))
    marker = tmp_path / "ran"
    (tmp_path / "rank6.pkl").write_bytes(pickle.dumps(_Payload(str(marker))))  # would touch `marker`
    os.mkfifo(tmp_path / "rank7.pkl")  # opened for reading, a pipe would block
    with open(tmp_path / "rank8.pkl", "wb") as f:
        f.truncate(200 * 2**20)  # huge (sparse)
    with pytest.warns(DumpSkipped) as caught:
        dumps = load_dumps(tmp_path)
    assert list(dumps) == [0, 1]
    said = "\n".join(str(w.message) for w in caught)
    for rank, why in [(2, "not a readable pickle"), (3, "not a readable pickle"), (4, "empty"),
                      (5, "holds a list, not a dump"), (6, "asks for"), (7, "not a regular file"),
                      (8, "more than a dump holds")]:
        assert f"rank{rank}.pkl: skipped, " in said and why in said, (rank, said)
    assert not marker.exists()


class _Payload:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_load_dumps_names_a_folder_that_does_not_exist(tmp_path):
    with pytest.raises(FileNotFoundError, match="no folder .*dumsp"):
        load_dumps(tmp_path / "dumsp")
    with pytest.warns(DumpSkipped, match="no rank<N>.pkl"):
        assert load_dumps(tmp_path) == {}


# ---- the checker is bounded, and the course's files are not the learner's fault ---------------------


def loops_with_bare_except(dumps):
    while True:
        try:  # computes a little, then sleeps: the timer's exception lands in either, and is caught
            sum(range(10**4))
            time.sleep(0.005)
        except:  # noqa: E722 - the learner's habit under test: it catches everything
            pass


# These wait without using the CPU either: what they do to signals is the point, and a busy loop
# would take a core from the rest of the suite for the whole 10 s.
def ignores_sigalrm(dumps):
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    while True:
        time.sleep(0.01)


def cancels_the_timer(dumps):
    signal.setitimer(signal.ITIMER_REAL, 0)
    while True:
        time.sleep(0.01)


@pytest.mark.parametrize("answer", [loops_with_bare_except, ignores_sigalrm, cancels_the_timer],
                         ids=lambda f: f.__name__)
def test_an_answer_that_never_returns_is_stopped_whatever_it_does_to_signals(answer):
    # 10 s: the worker must have started and reached the loop on a loaded machine
    stopped = r"(?s)did not return within 10 s.*was here:.*in " + answer.__name__
    with pytest.raises(CheckFailed, match=stopped):
        check_find_culprit(answer, timeout=10)


def test_an_answer_that_exits_its_process_is_named():
    with pytest.raises(CheckFailed, match="ended its process without returning"):
        check_find_culprit(lambda dumps: os._exit(0))


@pytest.mark.parametrize("damage", ["missing", "empty", "truncated"])
def test_damaged_recorded_dumps_name_the_file_not_the_learner(damage, tmp_path, monkeypatch):
    folder = tmp_path / "dumps"
    shutil.copytree(a_find_culprit.DUMPS, folder)
    target = folder / "shape.json"
    if damage == "missing":
        target.unlink()
    elif damage == "empty":
        target.write_text("")
    else:
        target.write_text(target.read_text()[:1000])
    monkeypatch.setattr(a_find_culprit, "DUMPS", folder)
    a_find_culprit._recorded_json.cache_clear()
    try:
        with pytest.raises(CheckFailed) as e:
            check_find_culprit(reference_culprit)
    finally:
        a_find_culprit._recorded_json.cache_clear()
    message = str(e.value)
    assert f"recorded dumps {target}" in message
    assert "git checkout -- course_utils/checks/ch13/dumps/" in message
    assert "your code raised" not in message and "Your code was not run" in message


@pytest.mark.skipif(PY_SPY is None, reason="py-spy is not installed")
def test_py_spy_dump_of_a_process_that_ends_mid_dump_says_so_in_one_line():
    said = collections.Counter()
    for i in range(20):
        child = subprocess.Popen([sys.executable, "-c", "while True: sum(range(1000))"])
        try:
            time.sleep(0.3)
            killer = threading.Timer(0.001 * i, child.kill)  # during py-spy's read, or before it
            killer.start()
            try:
                stack = py_spy_dump(child.pid)
                assert stack.startswith("Process "), stack[:300]
                said["stack"] += 1
            except ProcessLookupError as e:
                assert f"process {child.pid} ended while py-spy read its stack" in str(e)
                said["ended"] += 1
            except RuntimeError as e:
                message = str(e)
                assert message.startswith(f"py-spy dump --pid {child.pid} failed: ") and "\n" not in message
                assert "backtrace" not in message and "panicked" not in message, message
                said["failed"] += 1
            killer.join()
        finally:
            child.kill()
            child.wait()
    assert said["ended"] > 0, said  # the race was provoked
