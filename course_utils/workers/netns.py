"""A network of their own for the commands of one ``run_commands`` call: loopback, nothing else.

torchrun's stores listen on every interface of the machine (in torch 2.13 a ``TCPStore`` binds
one address only when the program hands it a socket it bound itself, ``master_listen_fd``, and
torchrun does not), and they have no authentication.  On a laptop in a café that is a port anyone
on the network can write to.  So ``run_commands`` starts its commands in a *network namespace*
made for them: a Linux network stack of their own whose only interface is ``lo``.  Inside, a
store may listen on ``*:PORT``; nothing outside the namespace can reach it, and the commands of
the same call still reach each other on 127.0.0.1 (or 127.0.0.2, ...).

How: a small *holder* process (this file, run as a script) calls ``unshare`` for a new network
namespace, brings ``lo`` up, says ``ready`` and waits until its standard input closes.  Each
command is started as a child of the notebook, as before, and joins the holder's namespace with
``setns`` between ``fork`` and ``exec``.  As root that is all; as any other user the holder first
makes a user namespace that maps the user to itself (unprivileged user namespaces: most Linux
distributions allow them), which is what lets it own a network namespace.  Where neither works
(macOS, Windows, a kernel or a security policy that forbids user namespaces) ``start`` says why,
and ``run_commands`` runs the commands on the machine's own network.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import ipaddress
import os
import select
import socket
import struct
import subprocess
import sys
import threading

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
READY = "ready"
RTM_NEWADDR, NLMSG_ERROR, NETLINK_ROUTE, IFA_ADDRESS, IFA_LOCAL, RT_SCOPE_HOST = 20, 2, 0, 1, 2, 254
NLM_F_REQUEST, NLM_F_ACK, NLM_F_EXCL, NLM_F_CREATE = 0x1, 0x4, 0x200, 0x400


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH22x", b"lo", 0))
        flags = struct.unpack("16sH22x", ifreq)[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))


def _nameservers(path: str = "/etc/resolv.conf") -> list[str]:
    """The name servers the C library asks (127.0.0.1 when the file names none, as glibc does)."""
    found = []
    with contextlib.suppress(OSError):
        with open(path) as f:
            for line in f:
                words = line.split()
                if len(words) >= 2 and words[0] == "nameserver" and "%" not in words[1]:
                    with contextlib.suppress(ValueError):
                        found.append(str(ipaddress.ip_address(words[1])))
    return found or ["127.0.0.1"]


def _add_to_loopback(ip: str) -> None:
    """Give ``lo`` the address ``ip`` (a /32 or /128), by one rtnetlink request (no ``ip`` needed)."""
    addr = ipaddress.ip_address(ip)
    family = socket.AF_INET if addr.version == 4 else socket.AF_INET6
    packed, prefix = addr.packed, 32 if addr.version == 4 else 128
    attr = b"".join(struct.pack("HH", 4 + len(packed), kind) + packed for kind in (IFA_LOCAL, IFA_ADDRESS))
    body = struct.pack("BBBBI", family, prefix, 0, RT_SCOPE_HOST, socket.if_nametoindex("lo")) + attr
    flags = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE) as nl:
        nl.sendall(struct.pack("IHHII", 16 + len(body), RTM_NEWADDR, flags, 1, 0) + body)
        reply = nl.recv(4096)
    kind, error = struct.unpack_from("H", reply, 4)[0], struct.unpack_from("i", reply, 16)[0]
    if kind == NLMSG_ERROR and error not in (0, -errno.EEXIST):
        raise OSError(-error, f"adding {ip} to lo: {os.strerror(-error)}")


def _no_such_name(query: bytes) -> bytes:
    """The answer of a server that knows no name: NXDOMAIN, the question echoed, nothing else."""
    end = 12
    with contextlib.suppress(IndexError):
        while query[end]:
            end += 1 + query[end]
        end += 5  # the root label, then QTYPE and QCLASS
    if len(query) < 12 or end > len(query):
        return query[:2] + struct.pack(">HHHHH", 0x8081, 0, 0, 0, 0)  # FORMERR
    opcode_rd = struct.unpack(">H", query[2:4])[0] & 0x7900
    return query[:2] + struct.pack(">HHHHH", 0x8083 | opcode_rd, 1, 0, 0, 0) + query[12:end]


def _answer_no_such_name(servers: list[str]) -> None:
    """Inside the namespace, answer the C library's name queries at once: no such name.

    The namespace has no route to the machine's name servers, so every lookup that ``/etc/hosts``
    cannot answer would fail as *temporary* (``EAI_AGAIN``): even ``getnameinfo`` of a peer's
    address, which on the machine's network falls back to the numeric address, fails, and
    c10d prints "The hostname of the client socket cannot be retrieved. err=-3" for every
    connection its stores accept.  Each name server's address is added to ``lo`` and a thread of
    the holder answers there, so a lookup ends as on a network whose servers know no such name.
    """
    socks = []
    for ip in servers:
        try:
            if not ipaddress.ip_address(ip).is_loopback:
                _add_to_loopback(ip)
            s = socket.socket(socket.AF_INET if ":" not in ip else socket.AF_INET6, socket.SOCK_DGRAM)
            s.bind((ip, 53))
            socks.append(s)
        except OSError:  # lookups then fail as before (slowly, as temporary): nothing else changes
            continue

    def serve() -> None:
        while True:
            for s in select.select(socks, [], [])[0]:
                with contextlib.suppress(OSError):
                    query, peer = s.recvfrom(4096)
                    s.sendto(_no_such_name(query), peer)

    if socks:
        threading.Thread(target=serve, daemon=True).start()


def _hold() -> None:
    """The holder: a new network namespace (and user namespace unless root), lo up, then wait."""
    libc = _libc()
    uid, gid = os.getuid(), os.getgid()
    try:
        if os.geteuid() == 0:
            _check(libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")
        else:
            _check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNET), "unshare(CLONE_NEWUSER | CLONE_NEWNET)")
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                               ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        try:
            _loopback_up()
        except OSError as e:
            raise OSError(e.errno, f"bringing up lo in the new namespace: {e.strerror}") from e
        _answer_no_such_name(_nameservers())
    except OSError as e:
        print(f"{e.strerror or e}", flush=True)
        sys.exit(1)
    print(READY, flush=True)
    sys.stdin.read()  # until the notebook closes the pipe (or dies: then the read ends too)


class PrivateNetwork:
    """One holder process and the namespace files the commands join (see the module docstring)."""

    def __init__(self) -> None:
        self.holder: subprocess.Popen | None = None
        self.fds: list[tuple[int, int]] = []  # (fd of /proc/HOLDER/ns/..., CLONE_NEW...)
        # Loaded here, in the notebook: ``join`` runs between fork and exec, where loading a
        # library (dlopen takes locks another thread of the parent may have held) is not safe.
        self._setns = _libc().setns

    def start(self, timeout: float = 10.0) -> str | None:
        """Make the namespace.  None when it is ready, else why it could not be made."""
        if not sys.platform.startswith("linux"):
            return f"network namespaces are a Linux feature; this is {sys.platform}"
        self.holder = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, text=True)
        ready, _, _ = select.select([self.holder.stdout], [], [], timeout)
        said = self.holder.stdout.readline().strip() if ready else ""  # type: ignore[union-attr]
        if said != READY:
            self.close()
            return said or f"the namespace's holder did not answer within {timeout:g} s"
        kinds = [("net", CLONE_NEWNET)] if os.geteuid() == 0 else [("user", CLONE_NEWUSER),
                                                                   ("net", CLONE_NEWNET)]
        try:
            for name, flag in kinds:  # the user namespace first: it is what grants joining the other
                self.fds.append((os.open(f"/proc/{self.holder.pid}/ns/{name}", os.O_RDONLY), flag))
        except OSError as e:
            self.close()
            return f"cannot open the holder's namespace: {e}"
        return None

    def join(self) -> None:
        """Enter the namespace: runs in a command's child process, between fork and exec."""
        for fd, flag in self.fds:
            _check(self._setns(fd, flag), "setns")

    def close(self) -> None:
        """Stop the holder; the namespace goes once the last command in it has exited."""
        for fd, _ in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []
        if self.holder is not None:
            with contextlib.suppress(Exception):
                self.holder.stdin.close()  # type: ignore[union-attr]
            try:
                self.holder.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.holder.kill()
                self.holder.wait()
            self.holder.stdout.close()  # type: ignore[union-attr]
            self.holder = None


def _address(hex_addr: str) -> str:
    """An address of ``/proc/net/tcp`` (little-endian hex words) in the usual notation."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return f"::ffff:{ip.ipv4_mapped}"
    return str(ip)


def listening(pids: set[int]) -> list[tuple[int, str, int, bool]]:
    """``(pid, address, port, private)`` of every TCP socket that one of ``pids`` listens on.

    Read from each process's own ``/proc/PID/net/tcp`` and ``tcp6``, so that sockets inside a
    network namespace are seen too (``psutil.net_connections`` sees only the caller's namespace);
    ``private`` says the process is in another network namespace than the caller.
    """
    ours = os.readlink("/proc/self/ns/net")
    found = []
    for pid in pids:
        try:
            netns = os.readlink(f"/proc/{pid}/ns/net")
            inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] for fd in os.listdir(f"/proc/{pid}/fd")
                      if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")}
            tables = [open(f"/proc/{pid}/net/{t}").read().splitlines()[1:] for t in ("tcp", "tcp6")]
        except OSError:  # the process has exited meanwhile
            continue
        for line in (x for table in tables for x in table):
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                addr, port = fields[1].split(":")
                found.append((pid, _address(addr), int(port, 16), netns != ours))
    return found


LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid``, from each process's parent in ``/proc`` (standard library only,
    like the rest of this module, which the holder runs as a script)."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - found
        found |= frontier
    return found


def _command_line(pid: int) -> str:
    """Its arguments after the program (``?`` once it has exited)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return " ".join(a.decode(errors="replace") for a in f.read().split(b"\0")[1:] if a)
    except OSError:
        return "?"


class ListenWatch:
    """Every (pid, command, address, port) that a descendant of this process listens on, while open.

    A thread polls the descendants' sockets every ``every`` seconds (``workers.netns.listening``,
    which sees into the private network ``run_commands`` gives its commands): a socket that lives
    shorter than that can be missed, which is why ``polls`` is kept (a test can ask that it saw
    several).  ``private`` holds the sockets that were inside such a network.

    Another thread may read ``seen`` and ``private`` while the watch runs: each poll that finds
    something new replaces them with new objects instead of changing them, so a loop over either
    never sees it change under it (a loop over the dict being filled raised "dictionary changed size
    during iteration" in one run of the suite).
    """

    def __init__(self, every: float = 0.2):
        self.every = every
        self.seen: dict[tuple[int, str, int], str] = {}
        self.private: set[tuple[int, str, int]] = set()
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            seen, private_ones = dict(self.seen), set(self.private)
            for pid, ip, port, private in listening(_descendants(os.getpid())):
                if (pid, ip, port) not in seen:
                    seen[pid, ip, port] = _command_line(pid)
                if private:
                    private_ones.add((pid, ip, port))
            if len(private_ones) != len(self.private):  # first: a socket in seen is in private if it is
                self.private = private_ones
            if len(seen) != len(self.seen):
                self.seen = seen
            self.polls += 1
            self._stop.wait(self.every)

    def __enter__(self) -> ListenWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def reachable(self) -> list[tuple[int, str, int, str]]:
        """The sockets another machine could connect to: beyond loopback, on this machine's network."""
        return [(pid, ip, port, cmd) for (pid, ip, port), cmd in sorted(self.seen.items())
                if ip not in LOOPBACK and (pid, ip, port) not in self.private]


if __name__ == "__main__":
    _hold()
