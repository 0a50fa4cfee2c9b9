"""Chapter 06's Slurm templates, submitted for real to a two-node cluster started on this machine.

``course_utils.slurm_cluster`` starts munged, slurmctld and two slurmd, each node in a network
namespace of its own (see the module). On it:

- ``ch06_slurm.sbatch`` (torchrun on every node): the agents rendezvous across the link, training
  ends with the expected result, and every worker may use the CPUs its task asked for;
- a preemption warning (``scancel --signal=USR1 --batch``, what ``--signal=B:USR1@300`` sends before
  the time limit) makes every worker stop after the same step with its checkpoint; the batch shell
  requeues the job, which resumes there and ends equal to the uninterrupted run;
- two clusters started at once get subnets of their own and both run a job;
- ``ch06_slurm_srun.sh`` (srun alone, no torchrun), requeued mid-run (``scontrol requeue``),
  resumes from its checkpoint and ends with the same model as the uninterrupted torchrun job;
- the cluster leaves no process, namespace or file behind, also when the code using it fails, and
  also (its reaper) when the process that started it is killed;
- the controller listens in a namespace of its own, not on this machine's addresses.

Needs root, Linux and the packages slurm-wlm and munge (``.ci/run`` installs them when it runs as
root); elsewhere every test here is skipped and says why. The jobs are tiny (a few seconds each).
"""

from __future__ import annotations

import glob
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

import course_utils.workers
from course_utils import slurm_cluster

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
LINE_BUFFERED = str(Path(course_utils.workers.__file__).resolve().parent / "line_buffered")
REASON = slurm_cluster.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no local Slurm cluster: {REASON}")

CPUS = slurm_cluster.CPUS_PER_NODE
STEPS = ["--steps", "20", "--save-every", "5", "--log-every", "10"]


def _left_by(cluster) -> dict:
    """What the cluster has on the machine right now: names, files, links, processes."""
    name = f"{slurm_cluster.PREFIX}-{cluster.tag}-"
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    processes = [p.pid for p in psutil.process_iter(["cmdline", "environ"])
                 if cluster.folder in " ".join(p.info["cmdline"] or [])
                 or (p.info["environ"] or {}).get("SLURM_CONF") == cluster.conf]
    return {"namespaces": [n for n in netns.split() if n.startswith(name)],
            "folders": glob.glob(f"{cluster.folder}*") + glob.glob(f"/etc/netns/{name}*"),
            "links": [w for w in links.split() if w.startswith(f"{slurm_cluster.PREFIX}{cluster.tag}")],
            "processes": processes}


@pytest.fixture(scope="module")
def cluster():
    with slurm_cluster.local_cluster() as c:
        yield c


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    folder = tmp_path_factory.mktemp("slurm-jobs")
    os.chmod(folder, 0o755)
    return folder


def _submit(cluster, work, script, name, *args, options=()):
    """Submit one of the chapter's templates as a reader would, with CPU-only settings."""
    env = {"PYTHON": sys.executable, "NPROC_PER_NODE": "1", "CKPT_DIR": str(work),
           "DATA_DIR": str(work / f"data-{name}"), "TORCH_CPP_LOG_LEVEL": "ERROR",
           # The job's Pythons start as the lessons' commands do (run_commands): whole lines in the
           # shared log, and torch's import frozen (0.4 to 1 CPU-second less for each process).
           "PYTHONPATH": os.pathsep.join(p for p in (LINE_BUFFERED, os.environ.get("PYTHONPATH")) if p)}
    return cluster.sbatch(script, "--show-env", *STEPS, "--out", str(work / f"{name}.pt"), *args,
                          options=["--job-name", name, "--gpus-per-node=0", f"--cpus-per-task={CPUS}",
                                   # 10 minutes: the template's warning comes 300 s (and up
                                   # to 60 s more) before the limit, long after these jobs end
                                   "--time=10", f"--output={work}/%x-%j.out", *options],
                          env=env, cwd=NOTEBOOKS)


def _finish(cluster, work, job, name, timeout=120):
    info = cluster.wait(job, timeout=timeout)
    log = (work / f"{name}-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED", f"{info}\n{log}\n{cluster.logs()}"
    return info, log


def _env_lines(log):
    return [json.loads(line[4:]) for line in log.splitlines() if line.startswith("ENV ")]


def _same_model(a, b, atol=1e-5):
    """The same parameters up to ``atol``.  Two runs of this job are usually bit-identical, but one
    run of a CI suite ended 4e-7 away from two others that agreed bit for bit (same environment,
    same losses to four decimals): with two threads per worker on a loaded machine, the math
    library's reductions are the likely cause.  One step more or less moves the parameters by 3e-3
    (measured with ch06_train.py alone: 19 or 21 steps against 20)."""
    sa, sb = (torch.load(p, weights_only=True) for p in (a, b))
    return sa.keys() == sb.keys() and all(torch.allclose(sa[k], sb[k], rtol=0, atol=atol) for k in sa)


@pytest.fixture(scope="module")
def uninterrupted(cluster, work):
    job = _submit(cluster, work, "ch06_slurm.sbatch", "plain")
    return _finish(cluster, work, job, "plain")[1]


def test_torchrun_template_trains_on_two_nodes_with_the_cpus_it_asked_for(uninterrupted):
    workers = _env_lines(uninterrupted)
    assert sorted((w["SLURMD_NODENAME"], w["GROUP_RANK"], w["RANK"]) for w in workers) == [
        ("node1", "0", "0"), ("node2", "1", "1")], workers
    # Node 0's agent announced its host name, which the other node resolves across the link.
    assert {w["MASTER_ADDR"] for w in workers} == {"node1"}
    assert {w["host"] for w in workers} == {"node1", "node2"}
    # --cpus-per-task reached srun: every worker may run on all the CPUs its task asked for,
    # and OpenMP uses that many threads (one worker per node here).
    for w in workers:
        assert len(w["cpus"]) == CPUS and w["OMP_NUM_THREADS"] == str(CPUS), w
    assert "done: 20 steps" in uninterrupted


def _log_of(path):
    return path.read_text() if path.exists() else ""


def _wait_for_line(cluster, job, log_path, line, timeout=90):
    """Wait until the job's log shows ``line``, while the job is still pending or running."""
    deadline = time.monotonic() + timeout
    while line not in _log_of(log_path):
        assert cluster.job(job).get("JobState") in ("PENDING", "RUNNING"), cluster.job(job)
        assert time.monotonic() < deadline, _log_of(log_path) or "no log"
        time.sleep(0.1)


def test_a_preemption_warning_saves_requeues_and_resumes_equal(cluster, work, uninterrupted):
    # 0.4 s a step in the first run: 6 s of training left after step 5 for the warning to arrive
    # (it took less than one 0.2 s step at a load of 12); the run stops early, so it costs little.
    job = _submit(cluster, work, "ch06_slurm.sbatch", "warned", "--step-time", "0.4")
    log_path = work / f"warned-{job}.out"
    _wait_for_line(cluster, job, log_path, "step   5  checkpoint saved")
    deadline = time.monotonic() + 150
    cluster.run("scancel", "--signal=USR1", "--batch", job)  # to the batch shell only, as B: does
    # The shell passes it on and, once the workers have saved and stopped, requeues the job.
    while "requeueing job" not in _log_of(log_path) or cluster.job(job).get("JobState") != "PENDING":
        assert cluster.job(job).get("JobState") in ("RUNNING", "PENDING", "REQUEUED", "COMPLETING"), \
            f"{cluster.job(job)}\n{_log_of(log_path)}"
        assert time.monotonic() < deadline, _log_of(log_path)
        time.sleep(0.2)
    cluster.release(job)
    info, log = _finish(cluster, work, job, "warned")
    assert info["Restarts"] == "1", info
    stopped = [line for line in log.splitlines() if "preemption warning: stopped after step" in line]
    assert len(stopped) == 1 and "its checkpoint saved" in stopped[0], log
    step = int(stopped[0].split("stopped after step ")[1].split(",")[0])
    assert 5 <= step < 20, log
    # Every rank stopped after the same step: the one whose checkpoint the second run resumed.
    assert f"step {step:3d}  checkpoint saved" in log
    assert f"resumed from warned-{job}.pt at step {step}" in log, log
    assert "done: 20 steps" in log and log.count("done: 20 steps") == 1
    assert _same_model(work / "plain.pt", work / "warned.pt"), "the warned and requeued run differs"


_TWO_AT_ONCE = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("slurm_cluster", sys.argv[1])
sc = sys.modules["slurm_cluster"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sc)
sys.stdin.readline()  # both processes start their clusters at the same moment
with sc.local_cluster() as c:
    job = c.sbatch("--wrap", "srun hostname", options=["-N", "2", "--output=/dev/null"])
    print(c.subnet, c.wait(job, timeout=60)["JobState"], flush=True)
"""


def test_two_clusters_started_at_once_both_run():
    owners = [subprocess.Popen([sys.executable, "-c", _TWO_AT_ONCE, slurm_cluster.__file__],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True) for _ in range(2)]
    try:
        for o in owners:
            o.stdin.write("go\n")
            o.stdin.flush()
        outs = [o.communicate(timeout=120) for o in owners]
    finally:
        for o in owners:
            if o.poll() is None:
                o.kill()
                o.wait()
    said = [out.split() for out, _ in outs]
    assert [o.returncode for o in owners] == [0, 0], outs
    assert [s[1] for s in said] == ["COMPLETED", "COMPLETED"], outs
    assert said[0][0] != said[1][0], f"both took {said[0][0]}"


def test_srun_only_template_trains_the_same_model_and_a_requeued_job_resumes(cluster, work, uninterrupted):
    """The template without torchrun, requeued mid-run (``scontrol requeue``: Slurm ends every task
    and queues the job again): the second run resumes from the checkpoint the first one saved, and
    the job ends with the same model as the torchrun template's uninterrupted run."""
    job = _submit(cluster, work, "ch06_slurm_srun.sh", "sruntasks", "--step-time", "0.4",
                  options=["--ntasks-per-node=1"])
    log_path = work / f"sruntasks-{job}.out"
    _wait_for_line(cluster, job, log_path, "step  10  checkpoint saved")
    cluster.run("scontrol", "requeue", job)
    # Slurm holds a requeued job back for a while (Reason=BeginTime); let it start at once.
    cluster.release(job)
    info, log = _finish(cluster, work, job, "sruntasks")
    assert info["Restarts"] == "1", info
    assert f"Slurm job {job} run 0" in log and f"Slurm job {job} run 1" in log, log
    workers = _env_lines(log)  # both runs' workers
    assert sorted({(w["SLURMD_NODENAME"], w["RANK"], w["LOCAL_RANK"], w["WORLD_SIZE"]) for w in workers}) == [
        ("node1", "0", "0", "2"), ("node2", "1", "0", "2")], workers
    assert all(w["TORCHELASTIC_RESTART_COUNT"] is None for w in workers)  # no torchrun involved
    for w in workers:
        assert len(w["cpus"]) == CPUS, w
    # The checkpoint is named after the job (RUN_ID = name-jobid): a requeued job keeps its id.
    resumed = [line for line in log.splitlines() if f"resumed from sruntasks-{job}.pt at step" in line]
    assert resumed and int(resumed[0].split()[-1]) >= 10, log
    assert log.count("done: 20 steps") == 1, log
    assert _same_model(work / "plain.pt", work / "sruntasks.pt"), "the requeued srun-only run differs"


def test_a_failing_block_leaves_nothing_behind():
    with pytest.raises(RuntimeError, match="inside"):
        with slurm_cluster.local_cluster() as c:
            job = c.sbatch("--wrap", "srun sleep 60", options=["-N", "2", "--output=/dev/null"])
            c.wait(job, states=("RUNNING",), timeout=30)
            running = _left_by(c)
            assert all(running.values()), running  # the check below can see each kind of thing
            raise RuntimeError("a failure inside the block")
    left = _left_by(c)
    assert not any(left.values()), left


def _listening_ports(netns: str | None = None) -> set[int]:
    """The TCP ports something listens on, in this machine's network stack or in ``netns``."""
    argv = ["ss", "-Hltn"] if netns is None else ["ip", "netns", "exec", netns, "ss", "-Hltn"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return {int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if line.strip()}


def test_the_controller_listens_in_its_own_namespace_only(cluster):
    port = int(next(line.split("=", 1)[1] for line in Path(cluster.conf).read_text().splitlines()
                    if line.startswith("SlurmctldPort=")))
    assert port in _listening_ports(cluster.controller)
    assert port not in _listening_ports()  # nothing on this machine's own addresses
    with pytest.raises(OSError):  # refused: loopback here is not the controller's
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    # ...while Slurm's commands on this machine reach it across the switch
    assert "node1" in cluster.run("sinfo", "-h", "-N", "-o", "%N")


_OWNER = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("slurm_cluster", sys.argv[1])
sc = sys.modules["slurm_cluster"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sc)  # the module alone, without course_utils (nor torch): a quick start
c = sc.start()
job = c.sbatch("--wrap", f"srun sleep {sys.argv[2]}", options=["-N", "2", "--output=/dev/null"])
c.wait(job, states=("RUNNING",), timeout=30)
print(c.tag, c.folder, c.conf, flush=True)
time.sleep(600)
"""


def test_a_cluster_whose_owner_is_killed_is_removed_jobs_included():
    token = str(600 + os.getpid() % 300)  # `sleep <token>`: this test's job processes
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, slurm_cluster.__file__, token],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        tag, folder, conf = owner.stdout.readline().split()
        fake = type("C", (), {"tag": tag, "folder": folder, "conf": conf})
        running = _left_by(fake)
        assert all(running.values()), running
        # RUNNING is the controller's word: srun starts the step's `sleep` on the nodes a moment
        # later (seconds on a loaded machine).
        deadline = time.monotonic() + 30
        while not any((p.info["cmdline"] or [])[-2:] == ["sleep", token]
                      for p in psutil.process_iter(["cmdline"])):
            assert time.monotonic() < deadline, "the job's srun never started its step"
            time.sleep(0.2)
        owner.kill()  # no clean-up of its own: no atexit, no finally
        owner.wait()
        deadline = time.monotonic() + 30  # what cleans up is itself started under this load
        while any(_left_by(fake).values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_left_by(fake).values()), _left_by(fake)
        assert not [p for p in psutil.process_iter(["cmdline"])
                    if (p.info["cmdline"] or [])[-2:] == ["sleep", token]]
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        slurm_cluster.remove_leftovers()
