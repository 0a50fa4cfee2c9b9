"""Two "hosts" on one Linux machine: network namespaces joined by a virtual cable.

A network namespace has its own interfaces, addresses, routes and ports, like the network stack
of a separate machine. A veth pair is a cable between two namespaces: what enters one end leaves
the other. Everything else is shared with this machine (files, the Python environment, the
process table), so the same command runs in either "host" with ``ip netns exec NAME ...``.

The two addresses exist only inside the two namespaces, which have no route to anything else:
the only traffic possible is between them. Needs Linux, root and the ``ip`` tool (iproute2);
``unavailable_reason()`` says what is missing.

    with two_hosts() as (a, b):
        subprocess.run(a.cmd("python", "-c", "print('hello from', 'A')"))
"""

import contextlib
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys

PREFIX = "dpcourse06"   # every namespace made here is PREFIX-<owner pid>-<a|b>
VETH = "dpc6"           # veth ends are VETH<owner pid><a|b> (interface names: 15 characters)
SUBNET = "10.206.0"     # host A is .1, host B is .2; nothing answers at .3


@dataclasses.dataclass
class Host:
    name: str     # "A" or "B"
    netns: str    # the namespace
    ifname: str   # its end of the cable
    addr: str     # its address on the cable

    def cmd(self, *argv):
        """``argv`` to run inside this host."""
        return ["ip", "netns", "exec", self.netns, *map(str, argv)]

    def traffic(self):
        """Bytes (received, sent) on this host's end of the cable so far."""
        out = _ip("-n", self.netns, "-s", "-j", "link", "show", "dev", self.ifname).stdout
        stats = json.loads(out)[0]["stats64"]
        return stats["rx"]["bytes"], stats["tx"]["bytes"]


def _ip(*args, check=True):
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


def unavailable_reason():
    """None when two hosts can be made here, else why not (in words for the learner)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are a Linux feature"
    if os.geteuid() != 0:
        return (f"creating network namespaces needs root and this notebook runs as uid "
                f"{os.geteuid()}; run it as root in a virtual machine or container of your own "
                "to see this section")
    if shutil.which("ip") is None:
        return "the `ip` tool (package iproute2) is not installed"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode:
        return (f"`ip netns add` failed: {r.stderr.strip()} (a container started without "
                "CAP_SYS_ADMIN and CAP_NET_ADMIN cannot make namespaces)")
    try:
        r = subprocess.run(["ip", "netns", "exec", probe, "true"], capture_output=True, text=True)
        if r.returncode:
            return f"`ip netns exec` failed: {r.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers():
    """Delete namespaces and cable ends left by a run of this module that died before cleaning
    up (its owner pid, part of the name, is no longer running). Returns what was removed."""
    removed = []
    for line in _ip("netns", "list").stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(rf"{PREFIX}-(\d+)-\w+", name)
        if m and not _alive(int(m.group(1))):
            _ip("netns", "del", name, check=False)
            removed.append(name)
    for line in _ip("-o", "link", "show").stdout.splitlines():
        m = re.match(rf"\d+: ({VETH}(\d+)[ab])[@:]", line)
        if m and not _alive(int(m.group(2))):
            _ip("link", "del", m.group(1), check=False)
            removed.append(m.group(1))
    return removed


@contextlib.contextmanager
def two_hosts():
    """Make hosts A and B, yield them, and always delete them again (also after an error)."""
    remove_leftovers()
    pid = os.getpid()
    hosts = [Host(n, f"{PREFIX}-{pid}-{n.lower()}", f"{VETH}{pid}{n.lower()}", f"{SUBNET}.{i}")
             for i, n in ((1, "A"), (2, "B"))]
    a, b = hosts
    try:
        for h in hosts:
            _ip("netns", "add", h.netns)
        _ip("link", "add", a.ifname, "type", "veth", "peer", "name", b.ifname)
        for h in hosts:
            _ip("link", "set", h.ifname, "netns", h.netns)
            _ip("-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", h.ifname)
            _ip("-n", h.netns, "link", "set", h.ifname, "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")
        yield a, b
    finally:
        for h in hosts:  # deleting a namespace destroys its cable end, and with it the pair
            _ip("netns", "del", h.netns, check=False)
        _ip("link", "del", a.ifname, check=False)  # only exists if setup failed half-way


def ours():
    """Namespaces of this module that exist right now (for checking the clean-up)."""
    names = [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.split()]
    return [n for n in names if n.startswith(PREFIX + "-")]
