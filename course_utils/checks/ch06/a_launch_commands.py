"""06.a launch commands: the torchrun command of each machine of a two-node cluster.

``check_launch_commands(make_commands)``: ``make_commands(master_addr, port, job_id, script,
script_args)`` returns ``{"node0": argv, "node1": argv}``.  The arguments are first read with
torchrun's own parser (fast, precise messages), then both commands run for real as two simulated
nodes on this machine, with one worker failing in the first attempt so that the restart is tried,
and every worker's environment after the restart is compared with what the cluster needs.
The simulated workers run ``_PROBE``, a script of their own under torchrun (not a checker's worker).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.run import get_args_parser

from ...checking import Catalogue, CheckFailed, Misconception, checker, require_callable
from ...workers.commands import run_commands
from ...workers.supervisor import free_port

__all__ = ["CATALOGUE", "check_launch_commands"]

CATALOGUE = Catalogue(
    "06.a launch commands",
    Misconception(
        "commands_one_string",
        "a command is one line of shell",
        "a node's command is a str",
        "give a list of arguments, as subprocess does: [sys.executable, '-m', "
        "'torch.distributed.run', '--nnodes=2', ...]"),
    Misconception(
        "commands_bare_torchrun",
        "`torchrun` on the PATH is as good as this Python's",
        "the command does not start with [sys.executable, '-m', 'torch.distributed.run']",
        "start it with [sys.executable, '-m', 'torch.distributed.run'] (torchrun itself, run by "
        "this notebook's Python, so that every node uses the same torch)"),
    Misconception(
        "commands_args_before_script",
        "the script's arguments can go anywhere",
        "torchrun's parser rejects them as unrecognized arguments",
        "the script's own arguments go after the script's name; before it, torchrun takes them "
        "for its options"),
    Misconception(
        "commands_standalone",
        "--standalone works on a cluster too",
        "a node's command uses --standalone",
        "that makes a private rendezvous on a random local port, for one machine only; the two "
        "nodes would never find each other. Use --rdzv_backend=c10d with --rdzv_endpoint on node0"),
    Misconception(
        "commands_nnodes_is_gpus",
        "--nnodes counts GPUs",
        "--nnodes is not 2",
        "the cluster has 2 machines (--nnodes counts machines, that is torchrun agents, not GPUs)"),
    Misconception(
        "commands_total_gpus",
        "--nproc_per_node is the number of GPUs in the cluster",
        "--nproc_per_node is not the GPUs of one machine",
        "it counts the worker processes on ONE machine, one per GPU"),
    Misconception(
        "commands_nproc_cpu",
        "the checker runs on CPUs, so --nproc_per_node=cpu",
        "--nproc_per_node is 'cpu'",
        "'cpu' starts one worker per CPU core of the machine, not one per GPU; write 2, or 'gpu' "
        "(one worker per GPU the machine has)"),
    Misconception(
        "commands_localhost_everywhere",
        "localhost is the endpoint on every node",
        "a node's --rdzv_endpoint is not node0's address and port",
        "Every node points at the same place, node0's address and the agreed port (on node1, "
        "'localhost' would be node1 itself)"),
    Misconception(
        "commands_no_restart",
        "a job restarts by itself",
        "--max-restarts is not 1",
        "the job must survive one failure: --max-restarts=1"),
    Misconception(
        "commands_shared_store",
        "--max-restarts=1 is all a restart needs",
        "with --max-restarts=1 the command does not set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
        "a restarted attempt reuses node0's store, where the dead workers' addresses are still "
        "published, and fails or hangs (lesson 06, section 5.1: 4 tries in 6). Let the command "
        "carry its environment: start it with 'env', 'TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1' (a "
        "variable set in this notebook would not travel to a cluster's machines)"),
    Misconception(
        "commands_id_per_node",
        "each node needs its own rendezvous id",
        "the nodes' --rdzv_id differ",
        "the agents would each wait in a rendezvous of their own until the join timeout (600 s by "
        "default). Use the same job id on every node"),
)
_hint = CATALOGUE.hint


NODES = ("node0", "node1")
GPUS_PER_NODE = 2
# torchrun reads --nproc_per_node as a count or as a device kind (determine_local_world_size in
# torch/distributed/run.py accepts an int, "cpu", "gpu", "xpu" and "auto"): "gpu" starts one
# worker per GPU the machine has, and "auto" does the same on a machine with an accelerator. On
# the exercise's cluster (2 GPUs a machine) both mean 2 workers a machine, so both are right.
# This machine has no 2 GPUs to count: the simulated nodes run them as the number they mean.
ONE_PER_GPU = ("gpu", "auto")
RUN_TIMEOUT = 90.0

# What every simulated worker prints: its environment and the result of one all_reduce. Global
# rank 3 fails at once in the first attempt (the marker file says it has), so that the job must
# survive one failure for real; only the workers of the attempt after it print.
_PROBE = r'''
import json, os, sys
marker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "failed-once")
if not os.path.exists(marker):
    if os.environ["RANK"] == "3":  # before importing torch: the failure comes a second earlier
        open(marker, "w").close()
        sys.exit("rank 3 fails on purpose in the first attempt")
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
keys = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
        "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID")
info = {k: os.environ.get(k) for k in keys}
info["sum"] = t.item()
if os.path.exists(marker):
    sys.stdout.write("PROBE " + json.dumps(info) + "\n")  # one write: lines of two workers never mix
sys.stdout.flush()
dist.barrier()
dist.destroy_process_group()
'''


def _torchrun_parser():

    return get_args_parser()


def _environment(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """``env NAME=VALUE ... program ...``: the variables it sets, and the command after them."""
    if not argv or argv[0] not in ("env", "/usr/bin/env"):
        return {}, argv
    found, rest = {}, argv[1:]
    while rest and "=" in rest[0] and not rest[0].startswith("-"):
        name, _, value = rest.pop(0).partition("=")
        found[name] = value
    return found, rest


def _parse(name: str, argv: Any, script: str) -> Any:
    """torchrun's own reading of one node's command (with ``.env``, what an ``env`` prefix sets),
    or CheckFailed saying what is wrong."""
    if argv is None:
        raise CheckFailed(f"the command for {name} is None (a missing `return`?)")
    if isinstance(argv, str):
        raise CheckFailed(
            f"the command for {name} is one string ({argv[:60]!r}...); " + _hint("commands_one_string"))
    if not isinstance(argv, (list, tuple)) or not all(isinstance(a, (str, int)) for a in argv):
        raise CheckFailed(f"the command for {name} must be a list of strings, got "
                          f"{type(argv).__name__}")
    env, argv = _environment([str(a) for a in argv])
    head = [sys.executable, "-m", "torch.distributed.run"]
    if argv[:3] != head:
        raise CheckFailed(
            f"the command for {name} starts with {shlex.join(argv[:3])!r}; "
            + _hint("commands_bare_torchrun"))
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = _torchrun_parser().parse_args(argv[3:])
    except SystemExit:
        msg = err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "?"
        hint = (f" ({_hint('commands_args_before_script')})" if "unrecognized arguments" in msg
                else "")
        raise CheckFailed(f"torchrun cannot read the command for {name}: {msg}{hint}") from None
    if args.training_script != script:
        raise CheckFailed(
            f"{name} runs {args.training_script!r} as the training script; expected the "
            f"`script` argument ({script!r}) after all of torchrun's options")
    args.env = env
    return args


def _static_checks(cmds: Any, master_addr: str, port: int, job_id: str, script: str,
                   script_args: list[str]) -> dict[str, Any]:
    if not isinstance(cmds, dict):
        raise CheckFailed(f"expected a dict {{'node0': [...], 'node1': [...]}}, got "
                          f"{type(cmds).__name__}")
    if sorted(cmds) != list(NODES):
        raise CheckFailed(f"expected the keys {list(NODES)}, got {sorted(map(str, cmds))}")
    parsed = {n: _parse(n, cmds[n], script) for n in NODES}
    endpoint = f"{master_addr}:{port}"
    for n, a in parsed.items():
        if a.standalone:
            raise CheckFailed(
                f"{n} uses --standalone: " + _hint("commands_standalone"))
        if str(a.nnodes) not in ("2", "2:2"):
            raise CheckFailed(
                f"{n} has --nnodes={a.nnodes}; " + _hint("commands_nnodes_is_gpus"))
        if str(a.nproc_per_node) == "cpu":
            raise CheckFailed(f"{n} has --nproc_per_node=cpu; " + _hint("commands_nproc_cpu"))
        if str(a.nproc_per_node) not in (str(GPUS_PER_NODE), *ONE_PER_GPU):
            raise CheckFailed(
                f"{n} has --nproc_per_node={a.nproc_per_node}; {_hint('commands_total_gpus')}: "
                f"{GPUS_PER_NODE}. torchrun computes the world size (nnodes x nproc_per_node) itself")
        if a.rdzv_backend != "c10d":
            raise CheckFailed(f"{n} has --rdzv_backend={a.rdzv_backend}; the exercise asks for "
                              "the c10d rendezvous (no extra service, hosted by node0's agent)")
        if a.rdzv_endpoint != endpoint:
            raise CheckFailed(
                f"{n} has --rdzv_endpoint={a.rdzv_endpoint!r}; expected {endpoint!r}. "
                + _hint("commands_localhost_everywhere"))
        if a.max_restarts != 1:
            raise CheckFailed(f"{n} has --max-restarts={a.max_restarts}; " + _hint("commands_no_restart"))
        if list(a.training_script_args) != [str(s) for s in script_args]:
            raise CheckFailed(
                f"{n} passes {a.training_script_args} to the script; expected script_args "
                f"{list(script_args)} after the script (arguments before it go to torchrun)")
    ids = {n: a.rdzv_id for n, a in parsed.items()}
    if len(set(ids.values())) != 1:
        raise CheckFailed(
            f"the nodes use different --rdzv_id ({ids}); " + _hint("commands_id_per_node"))
    if ids["node0"] != job_id:
        raise CheckFailed(f"--rdzv_id is {ids['node0']!r}; use the job id given ({job_id!r}), "
                          "so that two jobs on the same machines never join each other")
    for n, a in parsed.items():
        if a.env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1":
            raise CheckFailed(f"{n} has --max-restarts=1, but {_hint('commands_shared_store')}")
    return parsed


def _as_simulated(argv: list[Any], parsed: Any, n_script_args: int) -> list[str]:
    """One node's command as this machine runs it: a per-GPU --nproc_per_node becomes the
    cluster's count, given again just before the script (argparse keeps the last value)."""
    argv = [str(a) for a in argv]
    if str(parsed.nproc_per_node) in ONE_PER_GPU:
        at = len(argv) - n_script_args - 1  # the script: everything after it is its arguments
        argv.insert(at, f"--nproc_per_node={GPUS_PER_NODE}")
    return argv


@checker("06.a launch commands")
def check_launch_commands(make_commands: Callable[..., dict]) -> None:
    require_callable(make_commands, "make_commands(master_addr, port, job_id, script, script_args)")

    # 1. The cluster of the exercise, read by torchrun's parser.
    args = ["--steps", "100"]
    cmds = make_commands("10.1.1.20", 29400, "bert-run-7", "train.py", list(args))
    _static_checks(cmds, "10.1.1.20", 29400, "bert-run-7", "train.py", args)

    # 2. The same function for two simulated nodes on this machine, run for real.
    with tempfile.TemporaryDirectory(prefix="check-06a-") as tmp:
        probe = os.path.join(tmp, "probe.py")
        Path(probe).write_text(_PROBE)
        port, job = free_port(), f"check-06a-{os.getpid()}"
        args = ["--steps", "4"]
        cmds = make_commands("127.0.0.1", port, job, probe, list(args))
        parsed = _static_checks(cmds, "127.0.0.1", port, job, probe, args)
        per_gpu = sorted({str(a.nproc_per_node) for a in parsed.values()} & set(ONE_PER_GPU))
        if per_gpu:
            print(f"  --nproc_per_node={per_gpu[0]}: one worker per GPU, {GPUS_PER_NODE} on each "
                  f"machine of the cluster; run here as --nproc_per_node={GPUS_PER_NODE}")
        results = run_commands({n: _as_simulated(cmds[n], parsed[n], len(args)) for n in NODES},
                               timeout=RUN_TIMEOUT, echo=False, cwd=tmp,
                               env={"OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"})
        failed_once = os.path.exists(os.path.join(tmp, "failed-once"))
    for r in results:
        if not r.ok:
            why = "timed out" if r.timed_out else f"exited with code {r.returncode}"
            tail = "\n".join("    " + line for line in r.output.strip().splitlines()[-12:])
            raise CheckFailed(f"running the two nodes: {r.name} {why}; its last lines:\n{tail}")
    seen: dict[str, list[dict]] = {}
    for r in results:
        seen[r.name] = [json.loads(line[6:]) for line in r.output.splitlines()
                        if line.startswith("PROBE ")]
    if not failed_once:
        raise CheckFailed("checker bug: the first attempt's rank 3 never failed, so no restart was tried")
    workers = [w for ws in seen.values() for w in ws]
    if sorted(int(w["RANK"]) for w in workers) != [0, 1, 2, 3]:
        raise CheckFailed(f"expected 4 workers with RANK 0..3, got ranks "
                          f"{sorted(w['RANK'] for w in workers)}")
    for name, ws in seen.items():
        if len(ws) != GPUS_PER_NODE:
            raise CheckFailed(f"{name} started {len(ws)} workers, expected {GPUS_PER_NODE}")
        groups = {w["GROUP_RANK"] for w in ws}
        if len(groups) != 1:
            raise CheckFailed(f"the workers of {name} report different node ranks {groups}")
        for w in ws:
            if (w["WORLD_SIZE"], w["LOCAL_WORLD_SIZE"], w["TORCHELASTIC_MAX_RESTARTS"]) != ("4", "2", "1"):
                raise CheckFailed(
                    f"rank {w['RANK']} on {name} got WORLD_SIZE={w['WORLD_SIZE']}, "
                    f"LOCAL_WORLD_SIZE={w['LOCAL_WORLD_SIZE']}, TORCHELASTIC_MAX_RESTARTS="
                    f"{w['TORCHELASTIC_MAX_RESTARTS']}; expected 4, 2 and 1")
            if w["sum"] != 6.0:
                raise CheckFailed(f"rank {w['RANK']}: all_reduce of the ranks gave {w['sum']}, "
                                  "expected 0+1+2+3 = 6")
    if len({ws[0]["GROUP_RANK"] for ws in seen.values()}) != 2:
        raise CheckFailed("both nodes got the same node rank")
    print("  both nodes met in one rendezvous: 4 workers, RANK 0..3, WORLD_SIZE 4, 2 per node; "
          "rank 3 failed on purpose in the first attempt and the restarted job finished")
