"""Dry runs of the cluster templates: the exact command each node would run, with no cluster.

``dry_run_sbatch`` runs an sbatch script with the variables SLURM would set for the job and with
stand-ins for ``scontrol`` (expands the node list) and ``srun`` (prints, for every node, the
command and the network variables it would start there, instead of starting it).
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
"""Stand-in for srun: print what every node would run, run nothing."""
import os, shlex, subprocess, sys
args = sys.argv[1:]
while args and args[0].startswith("-"):  # srun's own options
    args.pop(0)
nodes = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                       capture_output=True, text=True, check=True).stdout.split()
net = " ".join(f"{{k}}={{v}}" for k, v in sorted(os.environ.items())
               if k.startswith(("NCCL_", "GLOO_", "OMP_", "TORCH_DISABLE")))
for node in nodes:
    print(f"[{{node}}] {{net}} {{shlex.join(args)}}")
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
                   env=None):
    """Lines printed by the stand-in srun: one per node, ``[node] VARIABLES command``."""
    with tempfile.TemporaryDirectory(prefix="ch06-dryrun-") as tools:
        for name, text in (("scontrol", _SCONTROL), ("srun", _SRUN)):
            path = os.path.join(tools, name)
            with open(path, "w") as f:
                f.write(text.format(python=sys.executable))
            os.chmod(path, 0o755)
        run_env = {k: v for k, v in os.environ.items()
                   if not k.startswith(("SLURM_", "NCCL_", "GLOO_", "IFNAME"))}
        run_env.update(PATH=tools + os.pathsep + os.environ.get("PATH", ""),
                       SLURM_JOB_ID=str(job_id), SLURM_JOB_NODELIST=nodelist,
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
