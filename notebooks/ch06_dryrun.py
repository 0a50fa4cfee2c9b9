"""Dry runs of the cluster templates: the exact command each node would run, with no cluster.

``dry_run_sbatch`` runs an sbatch script with the variables Slurm would set for the job and with
stand-ins for ``scontrol`` (expands the node list), ``srun`` (runs each task here, with the
variables Slurm would give it on its node), ``python`` (prints the command and the variables that
matter instead of running it) and ``ip`` (invents an address per node).
``dry_run_machines`` runs ch06_two_machines.sh with ``DRY_RUN=1`` once per machine.
"""

import os
import re
import subprocess
import sys
import tempfile

_SCONTROL = r'''#!{python}
"""Stand-in for `scontrol show hostnames LIST`: one host name per line."""
import re, sys
if sys.argv[1:3] != ["show", "hostnames"]:
    sys.exit("this stand-in only knows `scontrol show hostnames LIST`")
names = []
for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", sys.argv[3]):
    m = re.fullmatch(r"(.*)\[(.*)\]", part)
    if not m:
        names.append(part)
        continue
    for rng in m.group(2).split(","):
        lo, _, hi = rng.partition("-")
        names += [f"{{m.group(1)}}{{i:0{{len(lo)}}d}}" for i in range(int(lo), int(hi or lo) + 1)]
sys.stdout.write("\n".join(names) + "\n")
'''

_SRUN = r'''#!{python}
"""Stand-in for srun: run the task on every "node" here, with the variables Slurm would set."""
import os, subprocess, sys
args, opts = sys.argv[1:], {{}}
while args and args[0].startswith("-"):  # srun's own options
    key, _, value = args.pop(0).partition("=")
    opts[key] = value
print("srun", " ".join(f"{{k}}={{v}}" if v else k for k, v in opts.items()))
nodes = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                       capture_output=True, text=True, check=True).stdout.split()
per_node = int(opts.get("--ntasks-per-node") or os.environ.get("SLURM_NTASKS_PER_NODE", "1"))
for i, node in enumerate(nodes):
    for local in range(per_node):
        env = dict(os.environ, SLURMD_NODENAME=node, SLURM_NODEID=str(i), SLURM_LOCALID=str(local),
                   SLURM_PROCID=str(i * per_node + local), SLURM_NTASKS=str(len(nodes) * per_node),
                   SLURM_NTASKS_PER_NODE=str(per_node),
                   SLURM_CPUS_PER_TASK=opts.get("--cpus-per-task", "1"))
        out = subprocess.run(args, capture_output=True, text=True, env=env)
        sys.stdout.write("".join(f"[{{node}}] {{line}}\n" for line in out.stdout.splitlines()))
        sys.stderr.write(out.stderr)
'''

_PYTHON = r'''#!{python}
"""Stand-in for the job's python: print the variables that matter and the command, run nothing."""
import os, shlex, sys
keep = ("NCCL_", "GLOO_", "OMP_", "TORCH_DISABLE", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_")
net = " ".join(f"{{k}}={{v}}" for k, v in sorted(os.environ.items()) if k.startswith(keep))
print(net, "python", shlex.join(sys.argv[1:]))
'''

_IP = r'''#!/bin/bash
# Stand-in for `ip -4 -o addr show dev IF`: node N has the address 10.1.1.(20+N) on every interface.
echo "2: ${{@: -1}}    inet 10.1.1.$((20 + SLURM_NODEID))/24 brd 10.1.1.255 scope global"
'''


def expand_nodelist(spec):
    """'gpu-[01-02],cpu7' -> ['gpu-01', 'gpu-02', 'cpu7'] (what `scontrol show hostnames` does)."""
    out = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", spec):
        m = re.fullmatch(r"(.*)\[(.*)\]", part)
        if not m:
            out.append(part)
            continue
        for rng in m.group(2).split(","):
            lo, _, hi = rng.partition("-")
            out += [f"{m.group(1)}{i:0{len(lo)}d}" for i in range(int(lo), int(hi or lo) + 1)]
    return out


def dry_run_sbatch(script, nodelist="gpu-[01-02]", job_id=4242, cpus_per_task=32, args=(),
                   env=None, job_name="ch06-ddp"):
    """Lines printed by the stand-in srun: one per node, ``[node] VARIABLES command``."""
    with tempfile.TemporaryDirectory(prefix="ch06-dryrun-") as tools:
        for name, text in (("scontrol", _SCONTROL), ("srun", _SRUN), ("python", _PYTHON), ("ip", _IP)):
            path = os.path.join(tools, name)
            with open(path, "w") as f:
                f.write(text.format(python=sys.executable))
            os.chmod(path, 0o755)
        # Nothing of this machine's environment that the scripts read: the same output everywhere.
        run_env = {k: v for k, v in os.environ.items()
                   if not k.startswith(("SLURM_", "NCCL_", "GLOO_", "IFNAME", "PYTHON", "OMP_", "TMPDIR",
                                        "CKPT_DIR", "DATA_DIR", "RUN_ID", "TRAIN", "NPROC_PER_NODE"))}
        run_env.update(PATH=tools + os.pathsep + os.environ.get("PATH", ""),
                       SLURM_JOB_ID=str(job_id), SLURM_JOB_NODELIST=nodelist, SLURM_JOB_NAME=job_name,
                       SLURM_NNODES=str(len(expand_nodelist(nodelist))),
                       SLURM_CPUS_PER_TASK=str(cpus_per_task))
        run_env.update(env or {})
        # The job starts in the directory sbatch was called from; here a throwaway one.
        r = subprocess.run(["bash", os.path.abspath(script), *map(str, args)],
                           capture_output=True, text=True, env=run_env, cwd=tools)
    if r.returncode:
        raise RuntimeError(f"{script} failed with exit code {r.returncode}: {r.stderr.strip()}")
    return [line.replace(tools, "$SUBMIT_DIR") for line in r.stdout.splitlines()]


def dry_run_machines(script, machines, args=()):
    """``machines`` maps a machine name to its variables; returns one line per machine."""
    lines = []
    for name, variables in machines.items():
        run_env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "GLOO_"))}
        run_env.update({k: str(v) for k, v in variables.items()}, DRY_RUN="1")
        r = subprocess.run(["bash", script, *map(str, args)], capture_output=True, text=True,
                           env=run_env)
        if r.returncode:
            raise RuntimeError(f"{script} on {name} failed: {r.stderr.strip()}")
        lines += [f"[{name}] {line}" for line in r.stdout.splitlines()]
    return lines
