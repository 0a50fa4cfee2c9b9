"""Chapter 06: the cluster templates, the two-host network namespaces, and the helper files.

- the Slurm templates and the two-machine recipe parse (``bash -n``) and their dry runs print the
  commands a cluster needs (tests/system/test_slurm.py submits the templates to a real, local cluster);
- the namespaces are made and always removed, also when the code inside fails (root only); what
  gloo does across them, with and without GLOO_SOCKET_IFNAME, the lesson's cells assert (section 4);
- the lesson writes every ``ch06_*`` helper file (that each equals its cell: test_helper_files.py).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest
from test_helper_files import writefile_cells

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
LESSON = NOTEBOOKS / "06_multi_node.ipynb"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, NOTEBOOKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


dryrun = _load("ch06_dryrun")
netns = _load("ch06_netns")


@pytest.mark.parametrize("script", ["ch06_slurm.sbatch", "ch06_slurm_srun.sh", "ch06_two_machines.sh"])
def test_templates_parse(script):
    r = subprocess.run(["bash", "-n", str(NOTEBOOKS / script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_nodelist_expansion_matches_scontrol():
    assert dryrun.expand_nodelist("gpu-[07-08,11],login1,n[9-10]") == [
        "gpu-07", "gpu-08", "gpu-11", "login1", "n9", "n10"]


def test_sbatch_dry_run_gives_every_node_the_same_rendezvous():
    srun, *lines = dryrun.dry_run_sbatch(str(NOTEBOOKS / "ch06_slurm.sbatch"), nodelist="gpu-[07-09]",
                                         job_id=918273, args=["--steps", "5000"], env={"IFNAME": "ib0"})
    # Since Slurm 22.05 srun does not take --cpus-per-task from the job: the template passes it.
    assert srun == "srun --kill-on-bad-exit=1 --cpus-per-task=32"
    assert [line.split("]")[0] for line in lines] == ["[gpu-07", "[gpu-08", "[gpu-09"]
    # Only the first node hosts the rendezvous store, said explicitly (torchrun's host-name guess
    # fails with several network cards).
    hosts = [line.split("--rdzv_conf=is_host=")[1].split()[0] for line in lines]
    assert hosts == ["1", "0", "0"], hosts
    # Otherwise every node runs the same command, except the address it announces on IFNAME.
    commands = {line.split("] ", 1)[1].replace(f"--local-addr=10.1.1.{20 + i}", "--local-addr=X")
                .replace(f"--rdzv_conf=is_host={hosts[i]}", "--rdzv_conf=is_host=X")
                for i, line in enumerate(lines)}
    assert len(commands) == 1, commands
    (cmd,) = commands
    for expected in ("--nnodes=3", "--nproc_per_node=4", "--rdzv_backend=c10d",
                     "--rdzv_endpoint=gpu-07:28273", "--rdzv_id=918273", "--max-restarts=2",
                     "--local-addr=X", "NCCL_SOCKET_IFNAME=ib0", "GLOO_SOCKET_IFNAME=ib0",
                     "NCCL_DEBUG=WARN", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", "OMP_NUM_THREADS=8",
                     # named after the job and its id: a requeued job (same id) finds its
                     # checkpoint, a new submission of the same job name starts a new run
                     "ch06_train.py --ckpt $SUBMIT_DIR/checkpoints/ch06-ddp-918273.pt"):
        assert expected in cmd, (expected, cmd)
    assert cmd.endswith("--steps 5000")


def test_sbatch_rendezvous_port_is_below_the_ephemeral_range():
    # Linux hands out ephemeral ports from 32768 by default (net.ipv4.ip_local_port_range); the
    # lesson compares the template's range with this machine's own setting.
    for job_id in (0, 9999, 10000, 987654321):
        srun, first, *_ = dryrun.dry_run_sbatch(str(NOTEBOOKS / "ch06_slurm.sbatch"), job_id=job_id)
        port = int(first.split("--rdzv_endpoint=")[1].split()[0].split(":")[1])
        assert 20000 <= port < 30000 < 32768, port


def test_srun_only_dry_run_gives_every_task_its_rank_from_slurm():
    srun, *lines = dryrun.dry_run_sbatch(str(NOTEBOOKS / "ch06_slurm_srun.sh"), nodelist="gpu-[07-08]",
                                         job_id=4242, cpus_per_task=8, env={"SLURM_NTASKS_PER_NODE": "4"})
    assert srun == "srun --kill-on-bad-exit=1 --cpus-per-task=8"
    assert len(lines) == 8 and not any("torch.distributed.run" in line for line in lines)
    for rank, line in enumerate(lines):
        node, local = ("gpu-07", "gpu-08")[rank // 4], rank % 4
        assert line.startswith(f"[{node}] LOCAL_RANK={local} MASTER_ADDR=gpu-07 MASTER_PORT=24242 "), line
        assert f" RANK={rank} WORLD_SIZE=8 python ch06_train.py" in line, line


def test_sbatch_without_ifname_leaves_nccl_to_choose():
    (_, first, _) = dryrun.dry_run_sbatch(str(NOTEBOOKS / "ch06_slurm.sbatch"))
    assert "SOCKET_IFNAME" not in first and "--local-addr" not in first


def test_two_machine_recipe_differs_only_in_host_and_address():
    machine = dict(RDZV_HOST="10.1.1.20", RDZV_PORT=29400, IFNAME="eth1", JOB_ID="run-42")
    a, b = dryrun.dry_run_machines(str(NOTEBOOKS / "ch06_two_machines.sh"), {
        "m1": dict(machine, LOCAL_ADDR="10.1.1.20"), "m2": dict(machine, LOCAL_ADDR="10.1.1.21")})
    assert "--rdzv_conf=is_host=1 --local-addr=10.1.1.20" in a
    assert "--rdzv_conf=is_host=0 --local-addr=10.1.1.21" in b
    for line in (a, b):
        assert "--rdzv_endpoint=10.1.1.20:29400 --rdzv_id=run-42" in line
        assert "NCCL_SOCKET_IFNAME=eth1 GLOO_SOCKET_IFNAME=eth1" in line


def test_two_machine_recipe_resolves_a_host_name_before_choosing_the_host():
    machine = dict(RDZV_HOST="localhost", RDZV_PORT=29400, IFNAME="eth1", JOB_ID="run-42")
    a, b = dryrun.dry_run_machines(str(NOTEBOOKS / "ch06_two_machines.sh"), {
        "m1": dict(machine, LOCAL_ADDR="127.0.0.1"), "m2": dict(machine, LOCAL_ADDR="10.1.1.21")})
    assert "--rdzv_conf=is_host=1" in a and "--rdzv_conf=is_host=0" in b


def test_two_machine_recipe_refuses_missing_settings():
    env = {k: v for k, v in os.environ.items() if k not in ("RDZV_HOST", "IFNAME")}
    r = subprocess.run(["bash", str(NOTEBOOKS / "ch06_two_machines.sh")], capture_output=True,
                       text=True, env=dict(env, DRY_RUN="1"))
    assert r.returncode != 0 and "RDZV_HOST" in r.stderr


# --------------------------------------------------------------------------------------------
# Network namespaces (need root; skipped with the reason otherwise)
# --------------------------------------------------------------------------------------------

REASON = netns.unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"network namespaces: {REASON}")


@needs_netns
def test_two_hosts_are_removed_after_an_error():
    mine = f"{netns.PREFIX}-{os.getpid()}-"
    with pytest.raises(RuntimeError, match="inside"):
        with netns.two_hosts() as (a, b):
            assert {a.netns, b.netns} <= set(netns.ours())
            raise RuntimeError("a failure inside the block")
    assert not [n for n in netns.ours() if n.startswith(mine)]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert f"{netns.VETH}{os.getpid()}" not in links


@needs_netns
def test_leftovers_of_a_dead_owner_are_removed():
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is now free: a namespace "owned" by it is a leftover
    name = f"{netns.PREFIX}-{dead.pid}-a"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in netns.remove_leftovers()
        assert name not in netns.ours()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@needs_netns
# --------------------------------------------------------------------------------------------
# The committed helper files are the lesson's %%writefile cells
# --------------------------------------------------------------------------------------------


def test_the_lesson_writes_every_helper_file():
    # that each file equals its cell is checked for every lesson in test_helper_files.py
    assert set(writefile_cells(LESSON)) == {"ch06_train.py", "ch06_pair.py", "ch06_netns.py",
                                            "ch06_two_machines.sh", "ch06_slurm.sbatch",
                                            "ch06_slurm_srun.sh", "ch06_dryrun.py"}
