"""Chapter 10: DDP on a slow network, made on this machine with two namespaces and ``tc``.

Two "hosts" (network namespaces joined by a veth cable, from ``ch06_netns.py``) each run one rank.
Each host limits what it sends with a token-bucket filter (``tc qdisc ... tbf rate R``), as a
slower network card would, and measures, for each rate:

* the link: the best time of an all-reduce sized to take about 50 ms at that rate, and the time of
  a 4-byte one (the fixed cost of a call);
* DDP's step time for the course model, plain and with ``fp16_compress_hook`` (gradients sent as
  float16: half the bytes), and a step inside ``no_sync()`` (compute only), the three in turn.

Run from the notebook (``slow_links(...)``), which makes the hosts and starts one copy of this
script in each; by hand, inside two hosts of your own:

    python ch10_slownet.py --addr ADDR_OF_RANK0 --port PORT --rank 0 --dev IFNAME --rates 1e9,1e8
    python ch10_slownet.py --addr ADDR_OF_RANK0 --port PORT --rank 1 --dev IFNAME --rates 1e9,1e8

Shaping an interface needs root inside its namespace; the qdisc is removed on exit, and deleting
the namespace (``two_hosts`` always does) removes it in any case.
"""

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import ch06_netns
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook, fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from course_utils import free_port, run_commands
from course_utils.data import make_dataset, make_model
from course_utils.workarounds import apply_all

HOOKS = {"none": (allreduce_hook, 4), "fp16": (fp16_compress_hook, 2)}  # hook, bytes per element sent
RESULT = "RESULT "  # rank 0 prints its measurements as one JSON line after this marker


# ---- inside a host: shape the link, measure -------------------------------------------------------

def tbf_args(rate_bps):
    """``tc`` arguments of a token bucket at ``rate_bps`` bits/s.  The bucket (burst) must hold what
    the link sends in a few timer ticks, or the rate is not reached; the queue holds 50 ms."""
    burst = max(64 * 1024, int(rate_bps / 8 / 250))
    return ["tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst), "latency", "50ms"]


def shape(dev, rate_bps):
    """Limit what this host sends on ``dev`` to ``rate_bps`` (replacing an earlier limit)."""
    subprocess.run(["tc", "qdisc", "replace", "dev", dev, "root", *tbf_args(rate_bps)],
                   check=True, capture_output=True, text=True)


def unshape(dev):
    subprocess.run(["tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)


def _step(model, x, y):
    """Seconds of one training step (forward, backward and DDP's all-reduces), started together."""
    dist.barrier()
    t0 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    return time.perf_counter() - t0


def _timed_all_reduce(t):
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_reduce(t)
    return time.perf_counter() - t0


def _link_probe(rate_bps, rounds=3):
    """(bytes, best seconds) of an all-reduce sized to take about 50 ms at ``rate_bps``, and the
    median seconds of a 4-byte all-reduce (the fixed cost of one call on this link)."""
    nbytes = min(16 << 20, max(256 << 10, int(rate_bps / 8 * 0.05)))
    big = torch.ones(nbytes // 4)
    best = min(_timed_all_reduce(big) for _ in range(rounds))
    small = statistics.median(_timed_all_reduce(torch.ones(1)) for _ in range(9))
    return nbytes, best, small


def measure(dev, rates_bps, steps=7, hidden=512, batch=64, fail_after_shaping=False):
    """One rank's measurements (the process group is already up)."""
    rank = dist.get_rank()
    x, y = make_dataset(batch * 2, seed=3).tensors
    x, y = x[rank::2][:batch], y[rank::2][:batch]
    models, sent = {}, {}
    for name, (hook, elem_bytes) in HOOKS.items():
        ddp = DDP(make_model(0, hidden=hidden))
        sizes = []

        def recording(state, bucket, sizes=sizes, hook=hook, elem_bytes=elem_bytes):  # no annotations
            sizes.append(bucket.buffer().numel() * elem_bytes)
            return hook(None, bucket)

        ddp.register_comm_hook(None, recording)
        for _ in range(2):  # unshaped warm-up; DDP rebuilds its buckets after the first step
            _step(ddp, x, y)
        sizes.clear()
        _step(ddp, x, y)
        sent[name] = sizes[:]  # bytes sent per bucket in one step
        models[name] = ddp
    rows = []
    try:
        for rate in rates_bps:
            shape(dev, rate)
            if fail_after_shaping:
                raise RuntimeError("failing on purpose after shaping the link (--fail-after-shaping)")
            nbytes, probe_s, small_s = _link_probe(rate)
            # plain, compressed and compute-only steps taken in turn, so that a change in the
            # machine's load during the run touches all three alike; the medians are kept
            times = {name: [] for name in [*models, "compute"]}
            for _ in range(steps):
                for name, m in models.items():
                    times[name].append(_step(m, x, y))
                with models["none"].no_sync():
                    times["compute"].append(_step(models["none"], x, y))
            med = {k: statistics.median(v) for k, v in times.items()}
            # the spread of the steps (third minus first quartile), to tell a difference from noise
            spread = {k: (lambda q: q[2] - q[0])(statistics.quantiles(v, n=4)) for k, v in times.items()
                      if k != "compute"}
            rows.append({"rate_bps": rate, "probe_bytes": nbytes, "probe_s": probe_s, "small_s": small_s,
                         "compute_s": med.pop("compute"), "step_s": med, "spread_s": spread})
    finally:
        unshape(dev)
    del models
    return {"buckets": sent, "rows": rows}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--addr", required=True, help="address of the host that runs rank 0")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--dev", required=True, help="this host's end of the link, to shape")
    p.add_argument("--rates", required=True, help="link rates in bits/s, comma-separated")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--fail-after-shaping", action="store_true",
                   help="exit with an error once the link is shaped (to test the clean-up)")
    a = p.parse_args()
    # gloo connects the ranks on the address its host name resolves to, by default 127.0.0.1: in a
    # namespace that is the namespace's own loopback, which the peer cannot reach. Name the link.
    os.environ["GLOO_SOCKET_IFNAME"] = a.dev
    apply_all()  # WORKAROUND for a torch bug at process exit (pytorch/pytorch#56297), not part of DDP
    dist.init_process_group("gloo", init_method=f"tcp://{a.addr}:{a.port}", rank=a.rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    out = measure(a.dev, [float(r) for r in a.rates.split(",")], a.steps,
                  fail_after_shaping=a.fail_after_shaping)
    dist.barrier()
    if a.rank == 0:
        print(RESULT + json.dumps(out), flush=True)
    dist.destroy_process_group()


# ---- on this machine: make the hosts, run both ranks, clean up -----------------------------------

def unavailable_reason():
    """None when the shaped links can be made here, else why not."""
    reason = ch06_netns.unavailable_reason()
    if reason is None and shutil.which("tc") is None:
        reason = "the `tc` tool (package iproute2) is not installed"
    return reason


def qdisc_support(host):
    """Which of tbf (rate limit) and netem (added delay, loss) this kernel offers: {kind: None if
    usable, else the error}.  Each is tried on host's interface and removed at once."""
    out = {}
    for kind, args in (("tbf", tbf_args(1e9)), ("netem", ["netem", "delay", "1ms"])):
        r = subprocess.run(host.cmd("tc", "qdisc", "add", "dev", host.ifname, "root", *args),
                           capture_output=True, text=True)
        out[kind] = None if r.returncode == 0 else (r.stderr.strip() or f"exit code {r.returncode}")
        subprocess.run(host.cmd("tc", "qdisc", "del", "dev", host.ifname, "root"), capture_output=True)
    return out


def slow_links(rates_bps, steps=7, timeout=120, fail_after_shaping=False):
    """Run both ranks on links shaped to each rate.  Returns ``{"skipped": reason}`` where this
    machine cannot (not root, no ``ip``/``tc``), else rank 0's measurements plus ``"qdiscs"``.
    The namespaces, and with them the qdiscs, are deleted on every path (also on an error)."""
    reason = unavailable_reason()
    if reason is not None:
        return {"skipped": reason}
    script = os.path.abspath(__file__)
    with ch06_netns.two_hosts() as hosts:
        try:
            support = qdisc_support(hosts[0])
            port = free_port()  # any port is free inside a new namespace; this keeps to the habit
            cmds = {}
            for rank, h in enumerate(hosts):
                argv = [sys.executable, script, "--addr", hosts[0].addr, "--port", port, "--rank", rank,
                        "--dev", h.ifname, "--rates", ",".join(f"{r:g}" for r in rates_bps),
                        "--steps", steps] + (["--fail-after-shaping"] if fail_after_shaping else [])
                cmds[f"host{h.name}"] = h.cmd(*argv)
            results = run_commands(cmds, timeout=timeout, env={"OMP_NUM_THREADS": "1"}, echo=False,
                                   check=True)
        finally:
            for h in hosts:  # the namespaces' deletion removes them too; this says it explicitly
                subprocess.run(h.cmd("tc", "qdisc", "del", "dev", h.ifname, "root"), capture_output=True)
    line = next(x for x in results[0].output.splitlines() if x.startswith(RESULT))
    return dict(json.loads(line[len(RESULT):]), qdiscs=support)


if __name__ == "__main__":
    main()
