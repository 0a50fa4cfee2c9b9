"""``launch``: run a function in worker processes from a notebook cell, with a live display.

The workers' launcher (``workers.supervisor.launch``) knows nothing of displays: this function
gives it the monitor's (``monitor.display_factory``), so that ``report()`` calls in the workers
show up in the cell.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .monitor import display_factory
from .workers import supervisor
from .workers.errors import LaunchInterrupted

__all__ = ["launch"]


def launch(
    fn: Callable[..., Any],
    nprocs: int = 2,
    *,
    args: Sequence[Any] = (),
    kwargs: dict | None = None,
    timeout: float = 120.0,
    nnodes: int = 1,
    env: dict[str, str] | None = None,
    display: Any = "auto",
    finish_within: float | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` in ``nnodes * nprocs`` worker processes; return their results.

    Parameters
    ----------
    fn:
        Any function, including one defined in a notebook cell.  It runs once per rank and can
        call ``torch.distributed.init_process_group(backend)`` with no other arguments.
    nprocs:
        Worker processes per (simulated) node, like ``torchrun --nproc_per_node``.
    args, kwargs:
        Passed to ``fn``; notebook-defined classes and closures are fine.
    timeout:
        Seconds the function may run, counted once every rank has started it, before the launch
        is declared hung: the stuck ranks' stacks are shown and the workers are killed
        (``WorkerTimeout``).  Starting the workers (which may import modules, slow on a busy
        machine) is not counted, up to ``workers.supervisor.STARTUP_GRACE`` seconds.
    nnodes:
        Simulated nodes.  Ranks are laid out node by node: node ``g`` holds global ranks
        ``g*nprocs ... g*nprocs + nprocs - 1`` with ``GROUP_RANK=g``.
    env:
        Extra environment variables for every worker (for example ``{"TORCH_DISTRIBUTED_DEBUG":
        "DETAIL"}``).
    display:
        Where progress reports sent with ``course_utils.report`` go: ``"auto"`` (a live display
        created on the first report, see ``course_utils.monitor``), ``None`` (ignored), or an
        object with ``update(rank, metrics)`` and ``finish(failures)`` methods.
    finish_within:
        When set, once a rank has returned the others must return within this many seconds;
        otherwise they are declared stuck (``WorkerTimeout`` with ``early_finish`` set).  A rank
        that returns early while its peers wait for it in a collective is then named in seconds
        instead of after the whole ``timeout``.

    Returns
    -------
    list
        ``fn``'s return value on each rank, indexed by global rank.

    Raises
    ------
    WorkerError
        A rank raised, exited non-zero or was killed; the message names each rank and why.
    WorkerTimeout
        Some ranks were still running after ``timeout`` seconds.
    """
    try:
        return supervisor.launch(fn, nprocs, args=args, kwargs=kwargs, timeout=timeout, nnodes=nnodes,
                                 env=env, display=display_factory(display), finish_within=finish_within)
    except LaunchInterrupted:
        raise
    except KeyboardInterrupt:
        # The workers are stopped and the display says so: one line, no frames of the launcher.
        raise LaunchInterrupted("the launch was interrupted; every worker was stopped") from None
