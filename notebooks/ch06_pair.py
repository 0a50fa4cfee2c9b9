"""The articles' ``init_method="tcp://..."`` form: one process per host, ranks given by hand.

    python ch06_pair.py --addr 10.1.1.20 --port PORT --rank 0   # on the master, 10.1.1.20
    python ch06_pair.py --addr 10.1.1.20 --port PORT --rank 1   # on the other host

No launcher is involved: every process is told its global rank and the world size, and rank 0
hosts the store at ADDR:PORT. The script prints what this host would tell its peers about
itself, joins the group, all-reduces one number and says how long that took, or which error
came after how long.
"""

import argparse
import datetime
import os
import socket
import sys
import time

import torch
import torch.distributed as dist


def probe(addr, port, timeout=2.0):
    """What a bare TCP connection attempt says, and how fast."""
    t0 = time.monotonic()
    try:
        socket.create_connection((addr, port), timeout=timeout).close()
        return "open (something accepts connections there)"
    except ConnectionRefusedError:
        return (f"refused after {time.monotonic() - t0:.3f} s: the host answered, but nothing "
                "listens on that port (or a firewall rejects it)")
    except TimeoutError:
        return (f"no answer within {timeout:g} s: a wrong address, a host that is down, or a "
                "firewall that drops packets")
    except OSError as e:
        return f"{e.strerror} after {time.monotonic() - t0:.1f} s"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--addr", required=True, help="address of the host that runs rank 0")
    p.add_argument("--port", type=int, required=True, help="a free port on that host")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds before giving up")
    p.add_argument("--probe", action="store_true",
                   help="first try a bare TCP connection to ADDR:PORT, as `telnet ADDR PORT` would")
    a = p.parse_args()

    name = socket.gethostname()
    try:
        resolved = socket.gethostbyname(name)
    except OSError as e:
        resolved = f"nothing ({e})"
    print(f"rank {a.rank}: hostname {name!r} resolves to {resolved}; "
          f"GLOO_SOCKET_IFNAME={os.environ.get('GLOO_SOCKET_IFNAME', '(not set)')}", flush=True)
    if a.probe:
        print(f"rank {a.rank}: TCP probe of {a.addr}:{a.port}: {probe(a.addr, a.port)}", flush=True)
    t0 = time.monotonic()
    try:
        dist.init_process_group("gloo", init_method=f"tcp://{a.addr}:{a.port}", rank=a.rank,
                                world_size=a.world_size,
                                timeout=datetime.timedelta(seconds=a.timeout))
        x = torch.tensor([float(a.rank + 1)])
        dist.all_reduce(x)  # 1 + 2 + ... + world_size
        dist.barrier()
        print(f"rank {a.rank}: joined, all_reduce gave {x.item():g} "
              f"({time.monotonic() - t0:.2f} s)", flush=True)
        dist.destroy_process_group()
    except Exception as e:  # show the first line of the error and when it came
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"rank {a.rank}: {type(e).__name__} after {time.monotonic() - t0:.1f} s: "
              f"{first[:300]}", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
