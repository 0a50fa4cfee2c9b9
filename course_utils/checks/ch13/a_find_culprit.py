"""13.a find the culprit: the learner's ``find_culprit(dumps)`` reads the flight records of a hung job.

``find_culprit(dumps)`` gets ``{rank: dump}``, each dump what ``pickle.loads(_dump_fr_trace())``
returns on that rank, and answers ``None`` when every rank recorded the same collectives, else a
dict ``{"kind": ..., "seq_id": ..., "ranks": [...]}``:

- ``seq_id``: the first ``collective_seq_id`` at which the ranks disagree;
- ``kind``: ``"missing"`` (some ranks never issued that collective), ``"collective"`` (another
  operation there) or ``"shape"`` (the same operation with other tensor shapes);
- ``ranks``: the culprits: the ranks that lack it, or that differ from the majority there.

The dumps are real: ``tools/record_ch13_dumps.py`` recorded them from six ``torchrun`` jobs of 4
ranks on gloo (the table of failures is in its docstring) and wrote them, as JSON, to ``dumps/``
beside this module; the checker reads them back into what ``_dump_fr_trace`` gave (tuples where
the pickle had tuples).  Recording takes minutes; reading takes milliseconds, so the checker never
launches a job.  A dump file that is missing, empty or not what the recording wrote is the course's
problem, not the learner's: the message names the file and how to restore it.

The learner's ``find_culprit`` runs in one worker process (``run_workers``), not in the notebook's:
an answer that never returns, whatever it does to signals (a bare ``except:`` in a loop, SIGALRM
ignored, the interval timer cancelled), is stopped after ``TIMEOUT`` seconds and reported with
where it was.
"""

from __future__ import annotations

import collections
import copy
import functools
import json
import traceback
from collections.abc import Callable, Iterable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

from ...checking import (
    Catalogue,
    CheckFailed,
    Misconception,
    checker,
    learner_frames,
    require_callable,
    run_workers,
)
from ...workers.errors import RankFailure, indent

__all__ = ["CATALOGUE", "FAILURES", "check_find_culprit", "load_recorded", "reference_culprit"]

DUMPS = Path(__file__).resolve().parent / "dumps"
KINDS = ("missing", "collective", "shape")
TIMEOUT = 30.0  # seconds for all six jobs: a right answer takes milliseconds, the launch about two

# The recorded jobs, in the order the checker tries them, with what went wrong in words.
FAILURES = {
    "healthy": "a healthy job (every rank ran 5 steps)",
    "collective": "the job in which rank 2 called barrier() instead of a bucket's all-reduce at step 3",
    "order": "the job in which rank 0 broadcast a bucket before all-reducing it at step 3 (the others "
             "after)",
    "shape": "the job in which rank 3 all-reduced a bucket as a (6, 2) view instead of (4, 3) at step 3",
    "missing": "the job in which rank 2 never arrived at step 3",
    "missing_wrapped": "the job in which rank 1 never arrived at step 3, recorded with an 8-entry buffer "
                       "(every rank's oldest entries are gone)",
}

CATALOGUE = Catalogue(
    "13.a find culprit",
    Misconception(
        "crashes_on_healthy",
        "there is always a culprit",
        "the function raised on the dumps of a healthy job",
        "return None when every rank recorded the same collectives (a healthy job has no culprit)"),
    Misconception(
        "compares_last_entry",
        "the last collective is where it went wrong",
        "no culprit, or a later sequence id, where the ranks disagree earlier and agree again after",
        "compared only the last entries: the ranks agree again after the collective where they "
        "parted, so go through every sequence id that all ranks recorded, oldest first"),
    Misconception(
        "blames_rank_zero",
        "rank 0 is the one that hangs, so it is the culprit",
        "rank 0 named where another rank is the odd one out",
        "rank 0 is not always the culprit: the culprit is the rank that differs from the others "
        "at that sequence id (or lacks it)"),
    Misconception(
        "ignores_shapes",
        "the same operation on every rank means the same collective",
        "no culprit where one rank all-reduced a tensor of another shape",
        "compare the shapes too (input_sizes): the same all_reduce with another shape is a "
        "mismatch"),
    Misconception(
        "fewer_entries_is_mismatch",
        "a rank whose record is different is mismatched",
        "kind 'collective' or 'shape' for a rank that recorded nothing at that sequence id",
        "a rank that never issued the collective is \"missing\", not mismatched: its record ends "
        "before the others'"),
    Misconception(
        "compares_positions",
        "the k-th entry of every rank is the same collective",
        "the wrong answer where the ranks' records start at different sequence ids",
        "compared the entries by their position in the list: the ring buffer keeps only the last "
        "N entries, so the ranks' lists can start at different sequence ids; match them by "
        "collective_seq_id"),
    Misconception(
        "seq_id_off_by_one",
        "the sequence id is the position of the entry, or the last one that still agreed",
        "the right kind and ranks, and a seq_id one away from the recorded one",
        "report the collective_seq_id that torch recorded for the collective where the ranks part "
        "(not the one before it, not the one after, not a position in the list)"),
    Misconception(
        "blames_waiting_ranks",
        "the ranks stuck in the collective are the culprits",
        "for a missing collective, the ranks that did record it are named",
        "the ranks that recorded the collective are the ones waiting in it; the culprit is the rank "
        "whose record ends before it (it never issued it)"),
)
_hint = CATALOGUE.hint


_RESTORE = ("they come with the course: restore them with `git checkout -- course_utils/checks/ch13/dumps/` "
            "(or reinstall the course); `python tools/record_ch13_dumps.py` records them anew (minutes)")


@cache
def _recorded_json(failure: str) -> str:
    return (DUMPS / f"{failure}.json").read_text()


def load_recorded(failure: str) -> dict[int, dict]:
    """The dumps of one recorded job, ``{rank: dump}``, as ``_dump_fr_trace`` gave them (a fresh copy).

    A file that is missing or not what the recording script wrote raises ``CheckFailed`` naming it."""
    path = DUMPS / f"{failure}.json"
    try:
        dumps = {int(rank): dump for rank, dump in json.loads(_recorded_json(failure)).items()}
        for dump in dumps.values():
            for e in dump["entries"]:
                e["process_group"] = tuple(e["process_group"])
                _by_seq({"entries": [e]})  # the fields the checker reads are there
    except OSError as e:
        _recorded_json.cache_clear()
        raise CheckFailed(f"the course's recorded dumps {path} cannot be read ({e.strerror or e}): "
                          f"{_RESTORE}. Your code was not run.") from None
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        _recorded_json.cache_clear()
        what = ("is empty" if not path.stat().st_size
                else f"is not what the recording wrote ({type(e).__name__}: {e})")
        raise CheckFailed(f"the course's recorded dumps {path} {what}: {_RESTORE}. "
                          "Your code was not run.") from None
    if not dumps:
        raise CheckFailed(f"the course's recorded dumps {path} hold no rank: {_RESTORE}. "
                          "Your code was not run.")
    return dumps


def _by_seq(dump: Mapping[str, Any]) -> dict[int, tuple[str, tuple]]:
    return {int(e["collective_seq_id"]): (str(e["profiling_name"]).split(":")[-1],
                                          tuple(tuple(s) for s in e["input_sizes"]))
            for e in dump["entries"] if not e.get("is_p2p")}


def reference_culprit(dumps: Mapping[int, Mapping[str, Any]]) -> dict | None:
    """The checker's own answer: the first sequence id every rank could have recorded where they
    disagree, oldest first, from the newest start of the ranks' buffers."""
    seqs = {rank: _by_seq(d) for rank, d in dumps.items()}
    start = max(min(s, default=0) for s in seqs.values())
    for seq in sorted({s for per_rank in seqs.values() for s in per_rank if s >= start}):
        absent = sorted(r for r in seqs if seq not in seqs[r])
        if absent:
            return {"kind": "missing", "seq_id": seq, "ranks": absent}
        calls = {r: seqs[r][seq] for r in seqs}
        majority, _ = collections.Counter(calls.values()).most_common(1)[0]
        odd = sorted(r for r, c in calls.items() if c != majority)
        if odd:
            kind = "collective" if any(calls[r][0] != majority[0] for r in odd) else "shape"
            return {"kind": kind, "seq_id": seq, "ranks": odd}
    return None


def _field(answer: Any, key: str) -> tuple[Any, str]:
    if isinstance(answer, Mapping):
        if key not in answer:
            return None, (f"find_culprit returned a dict without the key {key!r}: {answer!r}; "
                          "expected {'kind': ..., 'seq_id': ..., 'ranks': [...]}")
        return answer[key], ""
    if hasattr(answer, key):
        return getattr(answer, key), ""
    return None, (f"find_culprit returned a {type(answer).__name__} ({answer!r}); expected None or a "
                  "dict {'kind': ..., 'seq_id': ..., 'ranks': [...]}")


def _normalised(answer: Any) -> tuple[dict | None, str]:
    """The learner's answer as ``{"kind", "seq_id", "ranks"}`` (ranks sorted), or why it is not one."""
    if answer is None:
        return None, ""
    fields = {}
    for k in ("kind", "seq_id", "ranks"):
        fields[k], problem = _field(answer, k)
        if problem:
            return None, problem
    kind, seq, ranks = fields["kind"], fields["seq_id"], fields["ranks"]
    if kind not in KINDS:
        return None, f"find_culprit returned kind={kind!r}; expected one of {KINDS}"
    if isinstance(ranks, int):
        ranks = [ranks]
    if not isinstance(ranks, Iterable) or isinstance(ranks, (str, bytes)):
        return None, f"find_culprit returned ranks={ranks!r}; expected a list of ranks"
    try:
        return {"kind": str(kind), "seq_id": int(seq), "ranks": sorted(int(r) for r in ranks)}, ""
    except (TypeError, ValueError):
        return None, (f"find_culprit returned seq_id={seq!r}, ranks={ranks!r}; expected an int and "
                      "a list of ints")


def _diagnose(failure: str, got: dict | None, want: dict | None) -> str:
    """Which misconception explains a wrong answer on this job (the usual-mistake sentence)."""
    if want is None:
        return ""
    if failure == "missing_wrapped" and (got is None or got["seq_id"] != want["seq_id"]) and \
            not (got and abs(got["seq_id"] - want["seq_id"]) == 1 and got["ranks"] == want["ranks"]):
        return _hint("compares_positions")
    if got is not None and abs(got["seq_id"] - want["seq_id"]) == 1 and got["kind"] == want["kind"] \
            and got["ranks"] == want["ranks"]:
        return _hint("seq_id_off_by_one")
    if failure in ("collective", "order") and (got is None or got["seq_id"] > want["seq_id"]):
        return _hint("compares_last_entry")
    if failure == "shape" and (got is None or got["seq_id"] != want["seq_id"]):
        return _hint("ignores_shapes")
    if got is None:
        return ""
    if want["kind"] == "missing" and got["ranks"] and not set(got["ranks"]) & set(want["ranks"]):
        return _hint("blames_waiting_ranks")
    if want["kind"] == "missing" and got["kind"] != "missing":
        return _hint("fewer_entries_is_mismatch")
    if got["ranks"] == [0] and want["ranks"] != [0]:
        return _hint("blames_rank_zero")
    return ""


def _describe(answer: dict | None) -> str:
    if answer is None:
        return "None (no culprit)"
    return f"kind={answer['kind']!r}, seq_id={answer['seq_id']}, ranks={answer['ranks']}"


def _worker(find_culprit: Callable, jobs: dict[str, dict[int, dict]]) -> list[dict]:
    """In a worker process: the learner's answer on each job, normalised, until the first that fails."""
    out = []
    for failure, dumps in jobs.items():
        try:
            raw = find_culprit(copy.deepcopy(dumps))
        except NotImplementedError:
            raise
        except Exception as e:
            frames = "".join(traceback.format_exception(e)[1:-1])
            out.append({"failure": failure, "raised": f"{type(e).__name__}: {e}", "frames": frames})
            break
        got, problem = _normalised(raw)
        out.append({"failure": failure, "got": got, "problem": problem})
        if problem:
            break
    return out


def _hang_hint(timeout: float, stacks: dict[int, str]) -> str | None:
    stack = learner_frames(next(iter(stacks.values()), "")) or "(no stack)"
    return (f"find_culprit did not return within {timeout:g} s (it ran in a worker process, which was "
            f"then stopped); it was here:\n{indent(stack)}\nLook for a loop whose exit is never "
            "reached: a `while` over sequence ids that never advances, or a bare `except:` that "
            "retries forever (it also catches the stop).")


def _error(f: RankFailure) -> str | None:
    if f.kind.name == "EXCEPTION":
        return None
    return (f"find_culprit ended its process without returning ({f.describe().split(' ', 2)[2]}): "
            "it must return None or a dict, not exit")


@checker("13.a find culprit")
def check_find_culprit(find_culprit: Callable, *, timeout: float = TIMEOUT) -> None:
    """The learner's ``find_culprit`` on the recorded dumps of six jobs, one of them healthy."""
    require_callable(find_culprit, "find_culprit(dumps)")
    jobs = {failure: load_recorded(failure) for failure in FAILURES}  # the course's files, checked
    results = run_workers(_worker, 1, args=(find_culprit, jobs), timeout=timeout,
                          explain_hang=functools.partial(_hang_hint, timeout), explain_error=_error)[0]
    if not isinstance(results, list):
        raise CheckFailed("find_culprit ended its process without returning (the worker exited with "
                          "no result: os._exit() in your code?); it must return None or a dict, not exit")
    for r in results:
        failure = r["failure"]
        what, want = FAILURES[failure], reference_culprit(jobs[failure])
        if "raised" in r:
            crash = _hint("crashes_on_healthy") if failure == "healthy" else ""
            raise CheckFailed(f"on {what}, find_culprit raised {r['raised']}\n{indent(r['frames'].rstrip())}"
                              + (f"\nUsual mistake: {crash}" if crash else ""))
        if r["problem"]:
            raise CheckFailed(r["problem"])
        got = r["got"]
        if got == want:
            continue
        hint = _diagnose(failure, got, want)
        if want is None:
            hint = _hint("crashes_on_healthy").replace("return None", "it must return None")
        raise CheckFailed(f"on {what}: find_culprit returned {_describe(got)}, expected {_describe(want)}."
                          + (f"\nUsual mistake: {hint}" if hint else ""))
