"""A two-node Slurm cluster on this Linux machine, for running batch scripts for real.

Chapter 06's batch template is meant for a real cluster. This module builds a small one here, in a
temporary folder, so that the template can be submitted unchanged:

    python -m course_utils.slurm_cluster        # start it, print how to use it; Ctrl-C stops it

    with local_cluster() as cluster:            # from Python (a test, a notebook)
        job = cluster.sbatch("ch06_slurm.sbatch", "--steps", "20")
        cluster.wait(job)

What it starts, all of it private to this cluster:

* ``munged`` with a throwaway key and its own socket (Slurm authenticates every message with it);
* ``slurmctld``, the controller, at ``10.207.K.254`` (K: the first of these subnets that is free,
  so that several clusters can run at once), in a network namespace of its own: it listens on
  every address it has, and there it has only that one, behind the cluster's switch; this machine
  reaches it from ``10.207.K.253``, so Slurm's commands (``sbatch``, ``squeue``) run here as usual;
* two ``slurmd``, the nodes ``node1`` and ``node2``, each in a network namespace of its own (its
  own interfaces, addresses and ports, like a separate machine) with its own host name (a UTS
  namespace) and an ``/etc/hosts`` in which every node name resolves (``ip netns exec`` mounts
  ``/etc/netns/NAMESPACE/hosts`` over ``/etc/hosts``; there is no DNS server). Each node reaches
  the others through its interface ``eth1``, plugged into a virtual switch (a bridge in a third
  namespace) to which this machine is also connected: traffic between the nodes crosses that
  link, as on a real cluster.

It reads only its own ``slurm.conf`` (``SLURM_CONF`` in :attr:`LocalCluster.env`), listens on its
own ports and keeps its state, spool and logs in its own folder, so a Slurm installation the
machine already has is left alone; its jobs' temporary files go there too (``TMPDIR``).
:meth:`LocalCluster.stop` (run by the ``with`` block, also on an error or Ctrl-C, and at
interpreter exit) cancels the jobs, stops every daemon, kills whatever is left in the node
namespaces, deletes the namespaces and the folder. If the process that started the
cluster is killed outright (``kill -9``, the OOM killer), its daemons get SIGTERM from the kernel (a
parent-death signal), and the cluster's reaper, a small process of its own that waits for nothing
else, removes the jobs' processes, the namespaces and the folder within a second or so.

Needs Linux, root, the ``ip`` tool, ``unshare``, and the Debian packages ``slurm-wlm`` and
``munge`` (Slurm 22.05 was used to write this); :func:`unavailable_reason` says what is missing.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import dataclasses
import fcntl
import glob
import os
import re
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

__all__ = ["LocalCluster", "local_cluster", "start", "unavailable_reason", "remove_leftovers",
           "PREFIX", "NODES"]

PREFIX = "cslurm"       # every name: PREFIX-<owner pid>-<K>-..., the link PREFIX<pid>-<K>
NETWORK = "10.207"      # cluster K uses NETWORK.K.0/24: node1 .1, node2 .2, the controller .254
NODES = ("node1", "node2")
CPUS_PER_NODE = 2                  # what slurm.conf declares; the nodes share this machine's CPUs
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "ip", "unshare")


def _run(argv, check=True, **kw):
    r = subprocess.run([str(a) for a in argv], capture_output=True, text=True, **kw)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(map(str, argv))}: {(r.stderr or r.stdout).strip()}")
    return r


def unavailable_reason() -> str | None:
    """None when a local cluster can be started here, else why not (in words for the learner)."""
    if not sys.platform.startswith("linux"):
        return "the local cluster needs Linux (network namespaces)"
    missing = [p for p in PROGRAMS if shutil.which(p) is None
               and not os.path.exists(f"/usr/sbin/{p}")]
    if missing:
        return (f"{', '.join(missing)} not installed (Debian/Ubuntu: `apt-get install slurm-wlm munge "
                "iproute2`)")
    if os.geteuid() != 0:
        return (f"the local cluster needs root (namespaces, daemons) and this runs as uid {os.geteuid()}; "
                "use a virtual machine or container of your own")
    probe = f"{PREFIX}-{os.getpid()}-probe"
    r = _run(["ip", "netns", "add", probe], check=False)
    if r.returncode:
        return f"`ip netns add` failed: {r.stderr.strip()} (a container without CAP_SYS_ADMIN/CAP_NET_ADMIN)"
    try:
        r = _run(["ip", "netns", "exec", probe, "unshare", "--uts", "true"], check=False)
        if r.returncode:
            return f"`ip netns exec ... unshare --uts` failed: {r.stderr.strip()}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    if _free_subnet() is None:
        return f"every subnet {NETWORK}.K.0/24 that the local cluster could use is taken on this machine"
    return None


def _subnet_lock() -> int:
    """A descriptor holding the lock under which a cluster picks its subnet and puts its first
    address on it (close it to release): two clusters started at once, say by two learners on one
    machine, would otherwise both see K free and both take it. An flock, which a killed owner
    releases with its last descriptor."""
    folder = "/run/lock" if os.access("/run/lock", os.W_OK) else tempfile.gettempdir()
    fd = os.open(os.path.join(folder, f"{PREFIX}-subnets.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _free_subnet():
    """The first K for which this machine has no address in NETWORK.K.0/24."""
    taken = _run(["ip", "-4", "-o", "addr", "show"], check=False).stdout
    return next((k for k in range(100) if f" {NETWORK}.{k}." not in taken), None)


_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


def _die_with_us():
    """Runs in each daemon between fork and exec: the kernel sends it SIGTERM when the process that
    started it dies, even by SIGKILL, so that no daemon outlives a killed notebook or test."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _sbin(name):
    return shutil.which(name) or f"/usr/sbin/{name}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(netns: str) -> None:
    """SIGKILL every process inside a network namespace (slurmd, slurmstepd, job processes)."""
    for _ in range(20):
        pids = [int(p) for p in _run(["ip", "netns", "pids", netns], check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def _delete_network(tag: str) -> list[str]:
    """Delete the namespaces, hosts files and link of cluster ``tag`` ("<pid>-<K>", or "<pid>" for
    all clusters of that process), killing what still runs inside."""
    removed = []
    for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(f"{PREFIX}-{tag}-"):
            _kill_namespace_processes(name)
            _run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    for folder in glob.glob(f"/etc/netns/{PREFIX}-{tag}-*"):
        shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError, OSError):
        if not os.listdir("/etc/netns"):
            os.rmdir("/etc/netns")
    for line in _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines():
        m = re.match(rf"\d+: ({PREFIX}{tag}(-\d+)?)[@:]", line)
        if m:
            _run(["ip", "link", "del", m.group(1)], check=False)
            removed.append(m.group(1))
    return removed


def _stop_daemons(folder: str) -> None:
    """SIGTERM, then SIGKILL, the daemons whose pid files are in ``folder``."""
    pids = []
    for pidfile in glob.glob(os.path.join(folder, "*.pid")):
        with contextlib.suppress(OSError, ValueError):
            pids.append(int(open(pidfile).read().split()[0]))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 3
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)


def remove_leftovers() -> list[str]:
    """Remove what a cluster of this module left behind when its owner died before cleaning up:
    its daemons, namespaces, link and folder (the owner's pid is part of every name)."""
    owners = set()
    for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines():
        m = re.match(rf"{PREFIX}-(\d+)-", line)
        if m:
            owners.add(int(m.group(1)))
    for folder in glob.glob(os.path.join(tempfile.gettempdir(), f"{PREFIX}-*-*")):
        m = re.match(rf"{PREFIX}-(\d+)-", os.path.basename(folder))
        if m:
            owners.add(int(m.group(1)))
    removed = []
    for owner in sorted(o for o in owners if not _alive(o)):
        for folder in glob.glob(os.path.join(tempfile.gettempdir(), f"{PREFIX}-{owner}-*")):
            _stop_daemons(folder)
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        removed += _delete_network(str(owner))
    return removed


def _reap(owner: int, tag: str, folder: str) -> None:
    """The cluster's reaper, a process of its own (``python slurm_cluster.py --reap ...``): it waits
    for the cluster's owner to die, by any signal, then removes what the cluster left: the jobs'
    processes and the daemons (killed with their namespaces), the namespaces, link and folder.
    ``LocalCluster.stop`` ends it first, so it acts only when the owner could not clean up."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the owner's terminal
    try:
        fd = os.pidfd_open(owner)   # readable once the owner has exited (even before it is reaped)
    except (OSError, AttributeError):
        fd = None
    if fd is not None:
        select.select([fd], [], [])
    else:
        while _alive(owner):
            time.sleep(0.5)
    _delete_network(tag)            # kills every process in the namespaces first: jobs, slurmd, slurmctld
    _stop_daemons(folder)           # munged (outside the namespaces), if its parent-death signal missed
    shutil.rmtree(folder, ignore_errors=True)


def _start_reaper(tag: str, folder: str) -> subprocess.Popen:
    """This module's file run by this Python, without importing course_utils (nor torch): quick."""
    return subprocess.Popen([sys.executable, "-S", os.path.abspath(__file__), "--reap",
                             str(os.getpid()), tag, folder],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


@dataclasses.dataclass
class LocalCluster:
    folder: str        # everything of this cluster: slurm.conf, keys, state, spool, logs
    conf: str          # its slurm.conf
    env: dict          # the environment for Slurm commands (SLURM_CONF and PATH)
    nodes: dict        # node name -> its network namespace
    controller: str = ""  # the network namespace slurmctld runs in
    tag: str = ""      # "<owner pid>-<K>": part of every name the cluster gives
    subnet: str = ""   # NETWORK.K: node1 is .1, node2 .2, the controller .254
    _procs: list = dataclasses.field(default_factory=list)
    _reaper: subprocess.Popen | None = None
    _stopped: bool = False

    # ---- commands ---------------------------------------------------------------------------
    def run(self, *argv, check=True, timeout=30, **kw):
        """Run a Slurm command (``squeue``, ``scontrol``, ...) against this cluster."""
        r = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout,
                           env={**self.env, **kw.pop("env", {})}, **kw)
        if check and r.returncode:
            raise RuntimeError(f"{' '.join(map(str, argv))} (exit {r.returncode}): "
                               f"{(r.stderr or r.stdout).strip()}")
        return r.stdout

    def sbatch(self, script, *args, options=(), env=None, cwd=None) -> int:
        """Submit ``script`` with ``args`` for it; ``options`` go to sbatch before the script."""
        out = self.run("sbatch", "--parsable", *options, script, *args, env=env or {}, cwd=cwd)
        return int(out.strip().split(";")[0])

    def job(self, job_id) -> dict:
        """``scontrol show job`` as a dict (JobState, Restarts, NodeList, ExitCode, StdOut, ...)."""
        out = self.run("scontrol", "show", "job", "-o", job_id, check=False)
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def release(self, job_id, timeout=60.0) -> None:
        """Start a requeued job now instead of after Slurm's hold (``Reason=BeginTime``).

        Waits first until the job is PENDING and both nodes are idle again (the old run has
        ended there), and until the second of the requeue has passed: slurmd refuses a job
        credential made no later than the second in which the old one was revoked ("Killing
        non-startable batch job: Job credential revoked"), and Slurm's own hold exists for that.
        """
        deadline = time.monotonic() + timeout
        while (self.job(job_id).get("JobState") != "PENDING"
               or set(self.run("sinfo", "-h", "-N", "-o", "%T").split()) != {"idle"}):
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not pending on idle nodes after {timeout:g} s: "
                                   f"{self.job(job_id)}\n{self.logs()}")
            time.sleep(0.2)
        time.sleep(1.5)
        self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")

    def wait(self, job_id, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                   "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"),
             timeout=120.0, poll=0.2) -> dict:
        """Wait until the job is in one of ``states``; return its record."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {info.get('JobState')} after {timeout:g} s: "
                                   f"{info.get('Reason')}\n{self.logs()}")
            time.sleep(poll)

    def logs(self, tail=15) -> str:
        """The last lines of every daemon's log (what to read when a job does not start)."""
        out = []
        for path in sorted(glob.glob(os.path.join(self.folder, "log", "*.log"))):
            lines = open(path, errors="replace").read().splitlines()[-tail:]
            out.append(f"--- {os.path.basename(path)}\n" + "\n".join(lines))
        return "\n".join(out)

    # ---- life cycle -------------------------------------------------------------------------
    def stop(self) -> None:
        """Cancel the jobs, stop every daemon, delete the namespaces and the folder. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        with contextlib.suppress(Exception):
            self.run("scancel", "--full", "--user", "root", check=False, timeout=10)
        for netns in self.nodes.values():   # slurmd, slurmstepd and every job process
            _kill_namespace_processes(netns)
        for p in self._procs:                # munged, slurmctld (and the slurmd wrappers)
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
        for p in self._procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        _stop_daemons(self.folder)
        _delete_network(self.tag)
        shutil.rmtree(self.folder, ignore_errors=True)
        if self._reaper is not None:  # last: if this clean-up is interrupted, the reaper finishes
            # it once this process has exited
            self._reaper.kill()
            self._reaper.wait()
        with contextlib.suppress(ValueError):
            atexit.unregister(self.stop)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _slurm_conf(folder, subnet, ctl_port, node_ports, user):
    nodes = "\n".join(
        f"NodeName={n} NodeAddr={subnet}.{i} Port={p} CPUs={CPUS_PER_NODE} Sockets=1 "
        f"CoresPerSocket={CPUS_PER_NODE} ThreadsPerCore=1 State=UNKNOWN"
        for i, (n, p) in enumerate(zip(NODES, node_ports), 1))
    return f"""# A two-node cluster on one machine (course_utils.slurm_cluster); deleted when it stops.
ClusterName=course
SlurmctldHost={socket.gethostname()}({subnet}.254)
SlurmctldPort={ctl_port}
SlurmUser={user}
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={folder}/munge/munge.socket
CredType=cred/munge
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool/%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/log/slurmctld.log
SlurmdLogFile={folder}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
TaskPluginParam=Cores
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={folder}/jobcomp.txt
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=5
MinJobAge=600
InactiveLimit=0
MessageTimeout=10
MailProg=/bin/true
PlugStackConfig={folder}/plugstack.conf
{nodes}
PartitionName=course Nodes={",".join(NODES)} Default=YES MaxTime=30 State=UP
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _make_network(tag: str, subnet: str) -> dict:
    """The switch, the controller's namespace and this machine's links to it, and one namespace per
    node, plugged in. Returns the namespaces by name: the nodes', and "ctl" for the controller's."""
    lan = f"{PREFIX}-{tag}-lan"
    nodes = {n: f"{PREFIX}-{tag}-{n}" for n in NODES}
    ctl = f"{PREFIX}-{tag}-ctl"
    _run(["ip", "netns", "add", lan])
    _run(["ip", "-n", lan, "link", "add", "br0", "type", "bridge"])
    _run(["ip", "-n", lan, "link", "set", "br0", "up"])
    _run(["ip", "-n", lan, "link", "set", "lo", "up"])
    # This machine gets one link to the switch, at .253: Slurm's commands run here and reach the
    # controller across it. The controller (slurmctld listens on every address of its network
    # stack, and Slurm has no setting to bind it to one) lives in a namespace of its own at .254,
    # so that it can be reached through the switch only, not on this machine's own addresses.
    host_end = f"{PREFIX}{tag}"  # at most 15 characters: cslurm + pid (7 digits) + -K
    _run(["ip", "link", "add", host_end, "type", "veth", "peer", "name", "host", "netns", lan])
    _run(["ip", "addr", "add", f"{subnet}.253/24", "dev", host_end])
    _run(["ip", "link", "set", host_end, "up"])
    _run(["ip", "-n", lan, "link", "set", "host", "master", "br0", "up"])
    hosts = ["127.0.0.1 localhost", f"{subnet}.254 {socket.gethostname()}"]
    hosts += [f"{subnet}.{i} {n}" for i, n in enumerate(NODES, 1)]
    plugged = {**nodes, "ctl": ctl}
    addresses = {**{n: i for i, n in enumerate(NODES, 1)}, "ctl": 254}
    for name, netns in plugged.items():
        _run(["ip", "netns", "add", netns])
        _run(["ip", "-n", lan, "link", "add", f"p{name}", "type", "veth", "peer", "name", "eth1",
              "netns", netns])
        _run(["ip", "-n", lan, "link", "set", f"p{name}", "master", "br0", "up"])
        _run(["ip", "-n", netns, "addr", "add", f"{subnet}.{addresses[name]}/24", "dev", "eth1"])
        _run(["ip", "-n", netns, "link", "set", "eth1", "up"])
        _run(["ip", "-n", netns, "link", "set", "lo", "up"])
        os.makedirs(f"/etc/netns/{netns}", exist_ok=True)
        with open(f"/etc/netns/{netns}/hosts", "w") as f:
            f.write("\n".join(hosts) + "\n")
        with open(f"/etc/netns/{netns}/resolv.conf", "w") as f:
            # No name server on this network: a lookup that /etc/hosts cannot answer (torch asks
            # for the name of every peer's address) fails at once instead of timing out.
            f.write("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
    return plugged


# `ip netns exec` gives the node a mount namespace of its own and mounts a fresh /sys there (so
# that /sys/class/net shows the node's interfaces), which hides the cgroup file systems slurmd
# needs at start-up: mount them again, inside that private mount namespace only.
_MOUNT_CGROUPS = ("mount -t tmpfs cgroup_root /sys/fs/cgroup && for c in cpuset memory freezer devices; "
                  "do mkdir -p /sys/fs/cgroup/$c && mount -t cgroup -o $c cgroup /sys/fs/cgroup/$c; done")


def _wait_for(predicate, what, timeout, cluster_folder):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            logs = []
            for path in sorted(glob.glob(os.path.join(cluster_folder, "log", "*"))):
                logs.append(f"--- {path}\n" + open(path, errors="replace").read()[-1500:])
            raise RuntimeError(f"{what} did not happen within {timeout:g} s\n" + "\n".join(logs))
        time.sleep(0.1)


def start(timeout: float = 30.0) -> LocalCluster:
    """Start the cluster and return it once both nodes are idle. Call ``.stop()`` when done
    (``local_cluster()`` does it for you); interpreter exit stops it too."""
    reason = unavailable_reason()
    if reason:
        raise RuntimeError(f"cannot start a local Slurm cluster: {reason}")
    remove_leftovers()
    lock = _subnet_lock()  # held until this cluster's address is on its subnet (or the start failed)
    k = _free_subnet()
    if k is None:
        os.close(lock)
        raise RuntimeError(f"cannot start a local Slurm cluster: every subnet {NETWORK}.K.0/24 is taken "
                           "on this machine (by other clusters of this course, or by its networks)")
    tag, subnet = f"{os.getpid()}-{k}", f"{NETWORK}.{k}"
    folder = tempfile.mkdtemp(prefix=f"{PREFIX}-{tag}-")
    os.chmod(folder, 0o755)  # job processes (any user) read slurm.conf from here
    for sub in ("munge", "state", "spool", "log", "tmp"):
        os.makedirs(os.path.join(folder, sub), mode=0o700 if sub == "munge" else 0o755)
    os.chmod(os.path.join(folder, "tmp"), 0o1777)  # like /tmp: any job's user may write, each its own
    conf = os.path.join(folder, "slurm.conf")
    # TMPDIR: the jobs inherit it (sbatch exports the environment), so their temporary files go with
    # the cluster's folder: torchrun's log folders (torchelastic_*) stayed in /tmp, one per node and job.
    env = {**os.environ, "SLURM_CONF": conf, "TMPDIR": os.path.join(folder, "tmp"),
           "PATH": os.pathsep.join(["/usr/sbin", os.environ.get("PATH", "/usr/bin:/bin")])}
    cluster = LocalCluster(folder=folder, conf=conf, env=env, nodes={}, tag=tag, subnet=subnet)
    atexit.register(cluster.stop)
    try:
        cluster._reaper = _start_reaper(tag, folder)
        try:
            plugged = _make_network(tag, subnet)
        finally:
            os.close(lock)
        cluster.controller = plugged.pop("ctl")
        cluster.nodes = plugged
        with open(conf, "w") as f:
            f.write(_slurm_conf(folder, subnet, _free_port(), [_free_port() for _ in NODES], "root"))
        open(os.path.join(folder, "plugstack.conf"), "w").close()
        with open(os.path.join(folder, "cgroup.conf"), "w") as f:
            f.write("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")
        for name in NODES:
            os.makedirs(os.path.join(folder, "spool", name))
        key = os.path.join(folder, "munge", "munge.key")
        with open(key, "wb") as f:            # a throwaway key, readable by root only
            f.write(secrets.token_bytes(1024))
        os.chmod(key, 0o400)
        log = open(os.path.join(folder, "log", "daemons.out"), "ab")
        m = os.path.join(folder, "munge")
        cluster._procs.append(subprocess.Popen(
            [_sbin("munged"), "--foreground", "--force", f"--key-file={key}",
             f"--socket={m}/munge.socket", f"--pid-file={folder}/munged.pid",
             f"--log-file={folder}/log/munged.log", f"--seed-file={m}/munged.seed"],
            stdout=log, stderr=log, start_new_session=True, preexec_fn=_die_with_us))
        _wait_for(lambda: os.path.exists(f"{m}/munge.socket"), "munged listening", timeout, folder)
        cluster._procs.append(subprocess.Popen(  # in its own namespace: see _make_network
            ["ip", "netns", "exec", cluster.controller, _sbin("slurmctld"), "-D", "-i", "-f", conf],
            stdout=log, stderr=log, env=env, start_new_session=True, preexec_fn=_die_with_us))
        for name, netns in cluster.nodes.items():
            # Own network (ip netns exec, which also mounts the node's /etc/hosts) and own host
            # name (unshare --uts): the node looks like a machine called `name`.
            cluster._procs.append(subprocess.Popen(
                ["ip", "netns", "exec", netns, "unshare", "--uts", "sh", "-c",
                 f"hostname {name} && {_MOUNT_CGROUPS} && "
                 f'exec {_sbin("slurmd")} -D -N {name} -f "$SLURM_CONF"'],
                stdout=log, stderr=log, env=env, start_new_session=True,
                preexec_fn=_die_with_us))

        def idle():
            r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True,
                               env=env)
            states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
            return r.returncode == 0 and all(states.get(n) == "idle" for n in NODES)

        _wait_for(idle, "both nodes idle", timeout, folder)
        return cluster
    except BaseException:
        cluster.stop()
        raise


@contextlib.contextmanager
def local_cluster(timeout: float = 30.0):
    """``with local_cluster() as cluster:`` a running two-node cluster, always stopped afterwards."""
    cluster = start(timeout)
    try:
        yield cluster
    finally:
        cluster.stop()


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(
        prog="python -m course_utils.slurm_cluster",
        description="Start a throwaway two-node Slurm cluster on this machine (root, slurm-wlm and "
                    "munge needed); Ctrl-C stops it and removes everything it made.").parse_args(argv)
    reason = unavailable_reason()
    if reason:
        sys.exit(f"cannot start a local Slurm cluster: {reason}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # `kill` stops it as cleanly as Ctrl-C
    with local_cluster() as cluster:
        print(f"A two-node Slurm cluster is running (its files: {cluster.folder}).\n"
              "In another shell, point Slurm's commands at it and submit chapter 06's template:\n\n"
              f"    export SLURM_CONF={cluster.conf}\n"
              "    sinfo -N\n"
              "    cd notebooks && NPROC_PER_NODE=1 sbatch --gpus-per-node=0 --cpus-per-task=2 "
              "ch06_slurm.sbatch --steps 40\n"
              "    squeue; cat ch06-ddp-*.out\n\n"
              "Ctrl-C here stops it and removes everything it made.", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--reap"]:  # the reaper (see _start_reaper): owner pid, tag, folder
        _reap(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    else:
        main()
