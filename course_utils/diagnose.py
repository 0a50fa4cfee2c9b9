"""Diagnosis helpers for the classic distributed-training failures (chapter 09).

Grouped by symptom:

- **Hang at start-up.**  ``check_address`` and ``check_port_open`` are the articles' "ping the
  master" and "telnet master_ip port" done with Python sockets, so they run anywhere, need no
  privileges and say *why* a connection fails (refused, timed out, name unknown).
  ``check_rendezvous`` runs both on ``MASTER_ADDR`` / ``MASTER_PORT``; ``port_in_use`` tells whether
  a port can still be bound (EADDRINUSE).
- **Same samples on several ranks.**  ``IndexedDataset`` makes every item carry its index;
  ``check_duplicates`` gathers the indices that every rank saw and reports samples seen on more
  than one rank, seen twice on one rank, or never seen (``find_duplicates`` is the same analysis
  on lists you already have).
- **NaN / Inf.**  ``NaNWatcher`` (forward hooks) names the first module whose output is not
  finite; ``grad_status`` and ``nonfinite_grads`` inspect gradients by *name* and cope with
  parameters whose ``.grad`` is None (frozen, or unused in this step).
- **Stragglers.**  ``barrier_waits`` times a barrier on every rank: the rank that waited least
  arrived last, so it is the slow one.
- **Reading failures.**  ``explain`` prints the few lines that matter from a ``WorkerError`` or
  ``WorkerTimeout``; ``quiet_cpp_logs`` keeps PyTorch's C++ warnings readable (it drops the C++
  frame lists that follow them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import re
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .workers.errors import FailureKind, WorkerError
from .workers.stacks import stuck_where

__all__ = [
    "Check",
    "check_address",
    "check_port_open",
    "check_rendezvous",
    "port_in_use",
    "IndexedDataset",
    "sample_ids",
    "gather_sample_ids",
    "DuplicateReport",
    "find_duplicates",
    "check_duplicates",
    "grad_status",
    "nonfinite_grads",
    "NaNWatcher",
    "timed_barrier",
    "barrier_waits",
    "explain",
    "stuck_where",
    "short_mismatch",
    "quiet_cpp_logs",
]


# --------------------------------------------------------------------------------------------
# Hang at start-up: is the master reachable, does anything listen on its port?
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Check:
    """The outcome of one check: ``ok``, what was checked, and what was found."""

    ok: bool
    what: str
    detail: str

    def __str__(self) -> str:
        return f"[{'OK' if self.ok else 'FAIL'}] {self.what}: {self.detail}"

    def __bool__(self) -> bool:
        return self.ok


def check_address(host: str) -> Check:
    """Can ``host`` be resolved to an IP address?  (The part of "ping the master" that Python can
    do without privileges; whether the host *answers* is what ``check_port_open`` finds out.)"""
    what = f"address {host!r}"
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as e:
        return Check(False, what, f"does not resolve ({e.strerror}): a typo in MASTER_ADDR, or a "
                     "host name that only some nodes know (check /etc/hosts and DNS on every node)")
    addrs = sorted({i[4][0] for i in infos})
    return Check(True, what, f"resolves to {', '.join(addrs)}")


def check_port_open(host: str, port: int, timeout: float = 1.0) -> Check:
    """Does anything accept TCP connections on ``host:port``?  (What ``telnet host port`` tests.)

    The failure says which of the three usual stories it is: *refused* (the host answered, but
    nothing listens there: a wrong port, or rank 0 has not started or has died), *timed out*
    (no answer at all: a wrong address, a host that is down, or a firewall dropping packets), or
    a name that does not resolve.
    """
    what = f"TCP {host}:{port}"
    start = time.monotonic()
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except ConnectionRefusedError:
        return Check(False, what, "connection refused: the host answered but nothing listens on "
                     "this port (wrong MASTER_PORT, or rank 0 is not running yet / any more)")
    except TimeoutError:
        return Check(False, what, f"no answer within {timeout:g} s: wrong MASTER_ADDR, the host "
                     "is down, or a firewall drops the packets")
    except socket.gaierror as e:
        return Check(False, what, f"the name does not resolve ({e.strerror})")
    except OSError as e:
        why = {errno.ENETUNREACH: "no route to that network (wrong MASTER_ADDR?)",
               errno.EHOSTUNREACH: "no route to that host (wrong MASTER_ADDR, or host down)"}
        return Check(False, what, why.get(e.errno, f"{type(e).__name__}: {e}"))
    ms = (time.monotonic() - start) * 1000
    return Check(True, what, f"something accepts connections (connected in {ms:.1f} ms)")


def check_rendezvous(addr: str | None = None, port: int | str | None = None, *,
                     timeout: float = 1.0, show: bool = True) -> list[Check]:
    """Run the start-up checks on ``MASTER_ADDR`` / ``MASTER_PORT`` (or the values given)."""
    addr = addr if addr is not None else os.environ.get("MASTER_ADDR")
    port = port if port is not None else os.environ.get("MASTER_PORT")
    checks: list[Check] = []
    if not addr or not port:
        checks.append(Check(False, "environment", "MASTER_ADDR and MASTER_PORT must both be set "
                            f"(got {addr!r}, {port!r}); torchrun and launch set them"))
    else:
        try:
            port_no = int(port)
        except ValueError:
            port_no = -1
        if not 0 < port_no < 65536:
            checks.append(Check(False, "MASTER_PORT", f"{port!r} is not a TCP port number"))
        else:
            a = check_address(str(addr))
            checks.append(a)
            if a.ok:
                checks.append(check_port_open(str(addr), port_no, timeout))
    if show:
        for c in checks:
            print(c)
    return checks


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True when ``port`` cannot be bound on ``host`` right now (EADDRINUSE)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, int(port)))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
            raise
    return False


# --------------------------------------------------------------------------------------------
# Duplicated data across ranks
# --------------------------------------------------------------------------------------------


class IndexedDataset(torch.utils.data.Dataset):
    """Wrap a data set so that every item also carries its index: ``(*item, index)``.

    The index is the sample's identity: collect the indices a rank trained on and compare ranks.
    """

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        item = self.dataset[i]
        if not isinstance(item, tuple):
            item = (item,)
        return (*item, i)


def sample_ids(batches: Iterable[Any], position: int = -1) -> list[int]:
    """The sample indices in a loader's batches (the ``position``-th element of each batch)."""
    ids: list[int] = []
    for batch in batches:
        idx = batch[position]
        ids += [int(i) for i in (idx.tolist() if torch.is_tensor(idx) else idx)]
    return ids


def gather_sample_ids(ids: Sequence[int], group: Any = None) -> list[list[int]]:
    """Every rank's list of sample ids, on every rank (``all_gather_object``; a collective)."""

    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, [int(i) for i in ids], group=group)
    return out


@dataclasses.dataclass
class DuplicateReport:
    """What ``find_duplicates`` found.

    ``shared`` maps each sample seen on more than one rank to those ranks; ``repeated`` maps a
    rank to the number of extra copies of samples it saw more than once itself; ``missing`` lists
    the indices ``0 .. dataset_size-1`` no rank saw (only when ``dataset_size`` was given).
    """

    counts: list[int]
    unique: int
    shared: dict[int, list[int]]
    repeated: dict[int, int]
    missing: list[int]
    dataset_size: int | None = None

    @property
    def total(self) -> int:
        return sum(self.counts)

    @property
    def ok(self) -> bool:
        """Every sample seen exactly once by exactly one rank (and none missing)."""
        return not self.shared and not self.repeated and not self.missing

    def summary(self) -> str:
        lines = [f"samples per rank: {self.counts} (total {self.total}, unique {self.unique}"
                 + (f", data set {self.dataset_size})" if self.dataset_size is not None else ")")]
        if self.shared:
            pairs = Counter(tuple(r) for r in self.shared.values())
            worst = ", ".join(f"ranks {list(k)}: {v}" for k, v in pairs.most_common(3))
            ex = sorted(self.shared)[:5]
            lines.append(f"DUPLICATES: {len(self.shared)} samples seen on more than one rank "
                         f"({worst}); e.g. ids {ex}")
        if self.repeated:
            lines.append("REPEATS: extra copies within one rank: "
                         + ", ".join(f"rank {r}: {n}" for r, n in sorted(self.repeated.items())))
        if self.missing:
            lines.append(f"MISSING: {len(self.missing)} samples seen by no rank; e.g. ids "
                         f"{self.missing[:5]}")
        if self.ok:
            lines.append("OK: every sample seen exactly once, on exactly one rank")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def find_duplicates(ids_per_rank: Sequence[Sequence[int]],
                    dataset_size: int | None = None) -> DuplicateReport:
    """Analyse the sample ids each rank saw (a list per rank); no communication."""
    seen_by: dict[int, set[int]] = {}
    repeated: dict[int, int] = {}
    for rank, ids in enumerate(ids_per_rank):
        c = Counter(int(i) for i in ids)
        extra = sum(n - 1 for n in c.values() if n > 1)
        if extra:
            repeated[rank] = extra
        for i in c:
            seen_by.setdefault(i, set()).add(rank)
    shared = {i: sorted(r) for i, r in seen_by.items() if len(r) > 1}
    missing = [i for i in range(dataset_size) if i not in seen_by] if dataset_size is not None else []
    return DuplicateReport([len(ids) for ids in ids_per_rank], len(seen_by), shared, repeated,
                           missing, dataset_size)


def check_duplicates(ids: Sequence[int], dataset_size: int | None = None,
                     group: Any = None) -> DuplicateReport:
    """Gather every rank's sample ids and analyse them; the same report on every rank.

    A collective: call it on every rank, at the same point (after an epoch, say).
    """
    return find_duplicates(gather_sample_ids(ids, group), dataset_size)


# --------------------------------------------------------------------------------------------
# NaN / Inf
# --------------------------------------------------------------------------------------------


def grad_status(model: torch.nn.Module) -> dict[str, str]:
    """For every parameter, by name: ``"none"`` (no gradient: frozen or unused), ``"finite"``,
    ``"nan"`` or ``"inf"``.

    Written the way the articles' check should have been: ``named_parameters()`` gives the names
    (a parameter has no ``.name``), and ``.grad is None`` is a normal state, not an error.
    """
    out: dict[str, str] = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            out[name] = "none"
        elif torch.isnan(g).any():
            out[name] = "nan"
        elif torch.isinf(g).any():
            out[name] = "inf"
        else:
            out[name] = "finite"
    return out


def nonfinite_grads(model: torch.nn.Module) -> list[str]:
    """Names of the parameters whose gradient holds a NaN or an Inf (None gradients are skipped)."""
    return [n for n, s in grad_status(model).items() if s in ("nan", "inf")]


class NaNWatcher:
    """Forward hooks that name the first module producing a NaN or Inf.

    ::

        with NaNWatcher(model) as w:
            loss = model(x).sum()
        print(w.first)       # ("net.0", "Linear", "output") or None

    The hooks check every module's floating-point outputs (and, with ``inputs=True``, what came
    in), so the first module listed is where the bad value appeared.  ``raise_error=True`` raises
    ``FloatingPointError`` at that point instead of continuing.  Checking costs a reduction per
    module output: use it while debugging, not in every production step.
    """

    def __init__(self, model: torch.nn.Module, *, inputs: bool = True, raise_error: bool = False):
        self.model = model
        self.inputs = inputs
        self.raise_error = raise_error
        self.found: list[tuple[str, str, str]] = []
        self._handles: list[Any] = []

    @property
    def first(self) -> tuple[str, str, str] | None:
        return self.found[0] if self.found else None

    def _bad(self, value: Any) -> bool:
        if torch.is_tensor(value):
            return value.is_floating_point() and not bool(torch.isfinite(value).all())
        if isinstance(value, (tuple, list)):
            return any(self._bad(v) for v in value)
        if isinstance(value, dict):
            return any(self._bad(v) for v in value.values())
        return False

    def _hook(self, name: str):
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            where = None
            if self.inputs and self._bad(args):
                where = "input"
            elif self._bad(output):
                where = "output"
            if where is None:
                return
            entry = (name or "(model)", type(module).__name__, where)
            self.found.append(entry)
            if self.raise_error and len(self.found) == 1:
                rank = os.environ.get("RANK", "0")
                raise FloatingPointError(f"non-finite {where} at module {entry[0]!r} "
                                         f"({entry[1]}) on rank {rank}")
        return hook

    def __enter__(self) -> NaNWatcher:
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


# --------------------------------------------------------------------------------------------
# Stragglers
# --------------------------------------------------------------------------------------------


def _group_device(group: Any = None) -> torch.device:
    """The device that collectives of ``group`` need their tensors on: this rank's GPU under
    NCCL (which has no CPU tensors), the CPU under gloo."""

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def timed_barrier(group: Any = None) -> float:
    """Seconds this rank waited in ``dist.barrier()``: long for early ranks, ~0 for the last one.

    On a GPU, work is queued and runs later: the Python line of a training step returns long
    before the GPU has done it.  So the clock starts only after ``torch.cuda.synchronize()``, when
    this rank's own queued GPU work has finished; a rank with a slow GPU then "arrives" late, as it
    should, instead of arriving early and waiting for its own kernels inside the barrier.
    """

    device = _group_device(group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    dist.barrier(group=group)
    return time.perf_counter() - start


def barrier_waits(group: Any = None) -> list[float]:
    """Every rank's wait at a barrier, on every rank.  The smallest wait is the straggler's.

    A collective.  Call it right after the work you suspect (a training step, a data load).
    The waits are gathered in a tensor on the group's device (the rank's GPU under NCCL).
    """

    device = _group_device(group)
    wait = torch.tensor([timed_barrier(group)], dtype=torch.float64, device=device)
    out = [torch.zeros_like(wait) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, wait, group=group)
    return [float(t) for t in out]


# --------------------------------------------------------------------------------------------
# Reading failures
# --------------------------------------------------------------------------------------------

def short_mismatch(message: str) -> str:
    """``TORCH_DISTRIBUTED_DEBUG=DETAIL``'s mismatch report without the long ``TensorOptions(...)``
    blocks, so that the op types, shapes and sequence numbers of each rank stand out."""
    out, i, key = [], 0, "TensorDeviceTypes="
    while True:
        j = message.find(key, i)
        if j < 0:
            out.append(message[i:])
            break
        out.append(message[i:j].rstrip(", "))
        k = message.find("(", j)
        if k < 0:
            out.append(message[j:])
            break
        depth, end = 0, k
        for end in range(k, len(message)):
            depth += {"(": 1, ")": -1}.get(message[end], 0)
            if depth == 0:
                break
        i = end + 1
    text = "".join(out)
    text = re.sub(r"\s*Tensor Tensor devices:.*?(?=\s{2}\S|$)", "", text)
    return re.sub(r"[ \t]+", " ", text).strip()


def _first_lines(text: str, n: int, width: int = 300) -> list[str]:
    if "Detected mismatch between collectives" in text:
        text = (short_mismatch(text).replace(", but Rank", ",\nbut Rank")
                .replace("Collectives differ", "\nCollectives differ"))
    out = []
    for ln in text.strip().splitlines():
        ln = ln.rstrip()
        if ln:
            out.append(ln if len(ln) <= width else ln[: width - 3] + "...")
        if len(out) >= n:
            break
    return out


def explain(exc: BaseException, *, lines: int = 2, show: bool = True) -> str:
    """The essential lines of a launch failure: the summary, then per rank what happened.

    For a rank that raised: its exception type and the first ``lines`` lines of the message.
    For a rank that was stuck at the timeout: where it was stuck (see ``stuck_where``).
    """

    if not isinstance(exc, WorkerError):
        text = f"{type(exc).__name__}: " + "\n".join(_first_lines(str(exc), lines))
    else:
        out = [exc.summary]
        for rank in sorted(exc.failures):
            f = exc.failures[rank]
            if f.kind == FailureKind.EXCEPTION:
                msg = _first_lines(f.message, lines) or [""]
                out.append(f"  rank {rank}: {f.exc_type}: {msg[0]}")
                out += [f"           {m}" for m in msg[1:]]
            elif f.kind == FailureKind.TIMEOUT:
                out.append(f"  rank {rank}: stuck {stuck_where(f.stack)}")
            else:
                out.append("  " + f.describe().splitlines()[0])
        text = "\n".join(out)
    if show:
        print(text)
    return text


_LOG_PREFIX = re.compile(r"^\[[A-Z]\d{4} [\d:.]+ [^\]]*\] ")
_NOISE = re.compile(r"^\s*(frame #\d+:|Exception raised from |<omitting python frames>|$)")


@contextlib.contextmanager
def quiet_cpp_logs(keep: int = 6):
    """Keep PyTorch's C++ warnings readable: drop the lists of C++ frames that follow them.

    Inside the block, everything written to file descriptor 2 (where C++ logs go, and this
    process's ``sys.stderr``) passes through a filter as it is written: C++ frame lines and
    repeats of the same message are dropped, and after ``keep`` lines the rest is counted
    instead of shown.  Lines appear at once, so a process killed inside the block (a hung rank
    stopped by the launcher) has still shown what it logged.  Exceptions propagate as usual.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    read_fd, write_fd = os.pipe()
    out = os.fdopen(os.dup(saved), "w", buffering=1, errors="replace")
    state = {"shown": 0, "hidden": 0}

    def pump() -> None:
        seen: set[str] = set()
        with os.fdopen(read_fd, "r", errors="replace") as pipe:
            for raw in pipe:
                line = raw.rstrip("\n")
                body = _LOG_PREFIX.sub("", line)  # "[W1130 01:17:06.71 socket.cpp:764] " varies
                if _NOISE.match(line) or body in seen:
                    continue
                seen.add(body)
                if state["shown"] < keep:
                    out.write(line + "\n")
                    state["shown"] += 1
                else:
                    state["hidden"] += 1

    reader = threading.Thread(target=pump, name="quiet-cpp-logs", daemon=True)
    reader.start()
    os.dup2(write_fd, 2)
    os.close(write_fd)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # closes the pipe's last write end (unless a child inherited it)
        os.close(saved)
        reader.join(timeout=2.0)
        if state["hidden"]:
            out.write(f"... ({state['hidden']} more log line(s) hidden)\n")
        out.close()
