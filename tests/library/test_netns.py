"""``run_commands`` gives the commands of one call a network of their own: loopback, nothing else.

Provoked for real: a server that listens on every interface inside the call is reached by the
call's other command and refused to this process; the same with ``network="host"`` is reached;
a system that cannot make a namespace runs the commands on the host's network and says so; the
death of the caller still ends the commands and the holder; ``listening`` sees inside.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from course_utils import free_port, run_commands
from course_utils.workers import commands, netns

LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces are Linux's")


def _server(port: int, seconds: float = 4.0) -> list[str]:
    code = (f"import socket, time; s = socket.socket(socket.AF_INET6); "
            f"s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('::', {port})); "
            f"s.listen(); print('listening', flush=True); time.sleep({seconds})")
    return [sys.executable, "-c", code]


def _client(port: int, addr: str = "127.0.0.2") -> list[str]:
    code = (f"import socket, time\nfor _ in range(40):\n    try:\n"
            f"        socket.create_connection(('{addr}', {port}), timeout=1).close(); break\n"
            f"    except OSError: time.sleep(0.1)\nelse:\n    raise SystemExit('never connected')\n"
            f"print('connected')")
    return [sys.executable, "-c", code]


def _from_here(port: int) -> str:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return "accepted"
    except OSError:
        return "refused"


def _run_and_probe(network: str) -> tuple[list, str, dict]:
    """Run server and client in one call; meanwhile try the server's port from this process.

    Returns the results, what this process got, and the server's socket as the watch saw it
    (``{(pid, address, port): private}``)."""
    port = free_port()
    watch = netns.ListenWatch(every=0.1)
    got = []

    def probe() -> None:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and not any(p == port for _, _, p in watch.seen):
            time.sleep(0.05)
        got.append(_from_here(port))

    t = threading.Thread(target=probe)
    with watch:
        t.start()
        res = run_commands({"server": _server(port), "client": _client(port)}, timeout=30,
                           echo=False, network=network)
        t.join()
    return res, got[0], {k: k in watch.private for k in list(watch.seen) if k[2] == port}


@LINUX
def test_the_commands_of_one_call_share_a_network_nobody_else_reaches():
    res, outside, sockets = _run_and_probe("private")
    if res[0].network != "private":
        pytest.skip("this system cannot make a network namespace")
    assert [r.returncode for r in res] == [0, 0] and "connected" in res[1].output, res
    assert outside == "refused"
    # The server listened on every interface, in a namespace of its own, which the watch saw.
    ((key, private),) = sockets.items()
    assert key[1] == "::" and private


def test_on_the_host_network_the_same_port_is_reached():
    res, outside, sockets = _run_and_probe("host")
    assert [r.network for r in res] == ["host", "host"]
    assert [r.returncode for r in res] == [0, 0]
    assert outside == "accepted" and list(sockets.values()) == [False]


def test_private_sockets_are_told_apart_from_the_host_ones():
    port = free_port()
    with netns.ListenWatch(every=0.1) as watch:
        res = run_commands({"server": _server(port, 1.5)}, timeout=30, echo=False)
    (key,) = [k for k in watch.seen if k[2] == port]
    assert (key in watch.private) == (res[0].network == "private")
    assert watch.reachable() == ([] if res[0].network == "private" else [(*key, watch.seen[key])])


STORE_AND_LOOKUPS = """
import datetime, socket, time
import torch.distributed as dist
t = datetime.timedelta(seconds=20)
server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=t)
dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=t).set("k", "v")
print("store", server.get("k").decode())
start = time.monotonic()
print("peer", socket.getnameinfo(("::ffff:127.0.0.1", 0, 0, 0), 0)[0])
try:
    socket.getaddrinfo("no-such-host.invalid", 0)
except socket.gaierror as e:
    print("lookup", e.errno, round(time.monotonic() - start, 1))
"""


def test_a_loop_over_what_the_watch_saw_may_run_while_it_watches(monkeypatch):
    """Another thread reads ``seen`` and ``private`` while the watch adds to them (the probe above
    does): a loop over the dict being filled raised "dictionary changed size during iteration" in
    one run of the suite.  Here a socket appears at every poll, every half millisecond."""
    found = iter(range(10**9))

    def one_more(pids):
        n = next(found)
        return [(1000 + n, "0.0.0.0", 20000 + n, n % 2 == 0)]  # every other one in a private network

    monkeypatch.setattr(netns, "_descendants", lambda pid: [])
    monkeypatch.setattr(netns, "listening", one_more)
    monkeypatch.setattr(netns, "_command_line", lambda pid: f"command of {pid}")
    raced = 0  # loops during which the watch polled
    with netns.ListenWatch(every=0.0005) as watch:
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            polls = watch.polls
            for pid, _, _ in watch.seen:
                time.sleep(0.0002)
                assert ((pid, "0.0.0.0", pid + 19000) in watch.private) == (pid % 2 == 0)
            raced += watch.polls > polls
    assert raced >= 1, watch.polls
    assert len(watch.seen) == watch.polls and len(watch.private) == (watch.polls + 1) // 2


@LINUX
def test_a_store_in_the_private_network_names_its_peers_without_warnings():
    """c10d formats every accepted peer with ``getnameinfo``; with no name server reachable the C
    library calls that a temporary failure and c10d prints a warning per connection (``err=-3``).
    The holder answers the namespace's name queries itself, so a lookup ends as on the host."""
    (res,) = run_commands({"store": [sys.executable, "-c", STORE_AND_LOOKUPS]}, timeout=60, echo=False,
                          env={"TORCH_CPP_LOG_LEVEL": "WARNING"})
    if res.network != "private":
        pytest.skip("this system cannot make a network namespace")
    assert res.returncode == 0, res.output
    assert "store v" in res.output and "peer ::ffff:127.0.0.1" in res.output, res.output
    assert "cannot be retrieved" not in res.output and "socket.cpp" not in res.output, res.output
    (lookup,) = [line.split() for line in res.output.splitlines() if line.startswith("lookup")]
    assert int(lookup[1]) == socket.EAI_NONAME, res.output  # "not known", not "temporary" (EAI_AGAIN)


def test_the_name_server_answer_is_no_such_name_with_the_question_echoed():
    query = bytes.fromhex("abcd0120000100000000000103777777076578616d706c6503636f6d0000010001"
                          "0000291000000000000000")  # www.example.com A, with an EDNS record
    answer = netns._no_such_name(query)
    assert answer[:2] == b"\xab\xcd" and answer[3] & 0x0F == 3  # same id, NXDOMAIN
    assert answer[4:12] == bytes.fromhex("0001000000000000") and answer[12:] == query[12:33]
    assert netns._no_such_name(b"\x01\x02\x03")[3] & 0x0F == 1  # too short: FORMERR


def test_a_system_without_namespaces_runs_on_the_host_and_says_why_once(monkeypatch, capsys):
    monkeypatch.setattr(netns.PrivateNetwork, "start", lambda self, timeout=10.0: "no namespaces here")
    monkeypatch.setattr(commands, "_noted", set())
    for _ in range(2):
        (res,) = run_commands({"n": ["true"]}, timeout=10)
        assert res.network == "host" and res.ok
    out = capsys.readouterr().out
    assert out.count("no namespaces here") == 1 and "listen on every interface" in out


def test_network_takes_private_or_host_only():
    with pytest.raises(ValueError, match="private.*host"):
        run_commands({"n": ["true"]}, network="none")


DRIVER = """
import sys
from course_utils import run_commands
run_commands({"a": ["sleep", "300"], "b": ["sleep", "301"]}, timeout=600, echo=False)
"""


@LINUX
def test_the_callers_death_ends_the_commands_and_the_holder(tmp_path):
    """The death signal is armed after joining the namespace (joining a user namespace clears it)."""
    driver = subprocess.Popen([sys.executable, "-c", textwrap.dedent(DRIVER)], cwd=os.getcwd())
    try:
        deadline = time.monotonic() + 30
        kids: list[psutil.Process] = []
        while time.monotonic() < deadline and len(kids) < 3:  # the holder and the two sleeps
            kids = psutil.Process(driver.pid).children()
            time.sleep(0.1)
        assert len(kids) == 3, [k.cmdline() for k in kids]
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        _, alive = psutil.wait_procs(kids, timeout=10)
        assert not alive, [k.cmdline() for k in alive]
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()


PROBE = """
import importlib.util, subprocess, sys
spec = importlib.util.spec_from_file_location("netns", sys.argv[1])
netns = importlib.util.module_from_spec(spec)
spec.loader.exec_module(netns)
net = netns.PrivateNetwork()
why = net.start()
if why is not None:
    print("NO", why)
    raise SystemExit
inside = subprocess.run(["cat", "/proc/self/net/dev"], preexec_fn=net.join, capture_output=True, text=True)
peer = "import socket; print(socket.getnameinfo(('::1', 0, 0, 0), 0)[0])"
lookup = subprocess.run([sys.executable, "-c", peer],
                        preexec_fn=net.join, capture_output=True, text=True)
net.close()
print("INTERFACES", sorted(line.split(":")[0].strip() for line in inside.stdout.splitlines()[2:]))
print("PEER", lookup.stdout.strip() or lookup.stderr.strip()[-120:])
"""


SYSTEM_PYTHON = "/usr/bin/python3"


@LINUX
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists(SYSTEM_PYTHON),
                    reason="needs root (to try it as another user), setpriv and /usr/bin/python3")
def test_an_ordinary_user_gets_a_private_network_too():
    """Without root the holder makes a user namespace first: tried as user nobody, with the
    system's Python (the module needs only the standard library)."""
    with tempfile.TemporaryDirectory(prefix="course-netns-") as tmp:
        os.chmod(tmp, 0o755)  # pytest's own folders are private to root
        run = _probe_as_nobody(Path(tmp))
    if "Permission denied" in run.stderr:
        pytest.skip(f"user nobody cannot read the probe: {run.stderr.strip()[-200:]}")
    if run.stdout.startswith("NO "):
        pytest.skip(f"this kernel refuses unprivileged user namespaces: {run.stdout.strip()}")
    # lo only, and a peer's address is named (numerically) as on the host, not a temporary failure
    assert run.stdout.split("\n")[:2] == ["INTERFACES ['lo']", "PEER ::1"], run.stdout + run.stderr


def _probe_as_nobody(folder: Path) -> subprocess.CompletedProcess:
    for name, text in (("probe.py", PROBE), ("netns.py", open(netns.__file__).read())):
        (folder / name).write_text(text)
        (folder / name).chmod(0o644)
    return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", SYSTEM_PYTHON,
                           str(folder / "probe.py"), str(folder / "netns.py")],
                          capture_output=True, text=True, timeout=60, cwd="/")
