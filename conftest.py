"""The order of `make test`: the longest files first, so that the workers finish together.

`make test` runs the unit tests and the notebooks (nbval) in one pytest session on four workers
(``JOBS`` in the Makefile), one file at a time per worker (``--dist loadfile``).  Files are handed
out in collection order; if a long file came last, one worker would run it alone while the others
sat idle.  So the collection is sorted by each file's expected time, longest first:

- a test file or notebook: its seconds in ``tests/seconds.json`` (``tools/test_seconds.py`` writes
  it from a ``make test PYTEST_ARGS=--durations=0`` run, so that both were timed alike);
- a file not in it: ``UNKNOWN_SECONDS_PER_TEST`` per test (a notebook: per code cell).

Within a file the order is kept (a notebook's cells run in order in one kernel).  A notebook's
cells are never rerun: ``--reruns`` is for the unit tests, and a cell run twice in the same kernel
proves nothing.

One thread for torch in every process of the run (``OMP_NUM_THREADS=1``, unless already set):
several test processes share the two cores, and the kernels they start would otherwise each run torch's
CPU operations on two OpenMP threads that wait for each other whenever another process holds a
core (measured: chapter 02's DataParallel cell took 36 s instead of 3 s next to one busy core).
The launcher gives its workers their own thread budget either way, and ``make notebooks``, which
writes the committed outputs, does not run under pytest.

The collected modules (torch, Jupyter's clients, the tests) live as long as the pytest process: once
collected, they are frozen (``gc.freeze()``), so that the garbage collector, which runs often in a
long test session, no longer walks them (measured on three in-process test files: 1.0 instead of 1.9
seconds of collection).
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
TEST_TIMES = ROOT / "tests" / "seconds.json"
UNKNOWN_SECONDS_PER_TEST = 2.0

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before any test imports torch (see above)

# Every kernel the suite starts talks over Unix sockets, not TCP ports (tests/kernel_sockets.py says why).
pytest_plugins = ["tests.kernel_sockets"]


def expected_seconds() -> dict[str, float]:
    """Seconds per file (paths relative to the repository); empty when the file is missing."""
    try:
        return {k: float(v) for k, v in json.loads(TEST_TIMES.read_text()).items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}  # no measurements: every file counts by its number of tests


def _relative(item: pytest.Item) -> str:
    try:
        return item.path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return item.path.as_posix()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    known = expected_seconds()
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(_relative(item), []).append(item)
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.flaky(reruns=0))

    def cost(path: str) -> float:
        return known.get(path, UNKNOWN_SECONDS_PER_TEST * len(files[path]))

    items[:] = [item for path in sorted(files, key=cost, reverse=True) for item in files[path]]


def pytest_collection_finish(session: pytest.Session) -> None:
    gc.freeze()  # see the module's docstring


# A unit test that failed once and passed on its retry is listed at the end (-rR), but its first
# failure would not be shown: these keep each one and print it, so that a rare flake can be studied
# from the log of the run in which it happened.
_RERUN_REPORTS: list[pytest.TestReport] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.outcome == "rerun":
        _RERUN_REPORTS.append(report)


def pytest_terminal_summary(terminalreporter) -> None:
    for report in _RERUN_REPORTS:
        terminalreporter.write_sep("-", f"first failure of {report.nodeid} (then retried)")
        terminalreporter.write_line(report.longreprtext[-4000:])
