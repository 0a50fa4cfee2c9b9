"""Chapter 16: step times of DDP, DDP + fp16, DiLoCo and Streaming DiLoCo on a shaped link.

Chapter 10's two "hosts" (network namespaces joined by a veth cable, ``ch06_netns.py``), each with
one rank, each limiting what it sends with ``tc``'s token bucket (``ch10_slownet.shape``). For each
rate, both ranks time, in turn, steps of the same course model with AdamW:

* ``ddp``, ``ddp_fp16``: torch DDP (gradients all-reduced every step; fp16: half the bytes);
* ``diloco``: ``H`` inner steps, then one all-reduce of the whole pseudo-gradient (``ch16_diloco``);
* ``streaming``: the same with the model in ``FRAGMENTS`` fragments synchronised at staggered
  steps, each all-reduce running in the background during the next ``OVERLAP`` inner steps;
  ``streaming_no_overlap``: the same fragments, each all-reduce waited for at once;
* ``compute``: the inner step alone, no communication;
* ``small_s``: the median time of a 4-byte all-reduce, the fixed cost α of one call on this link.

Each step is timed on its own (so the slowest step, a sync, shows); a step's time is rank 0's.
Run from the notebook (``slow_steps(...)``), or by hand inside two hosts of your own:

    python ch16_slownet.py --addr ADDR_OF_RANK0 --port PORT --rank 0 --dev IFNAME --rates 1e9,1e8
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import ch06_netns
import ch10_slownet
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ch16_diloco import DiLoCo
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from course_utils import free_port, run_commands
from course_utils.data import make_dataset, make_model
from course_utils.workarounds import apply_all

FRAGMENTS, OVERLAP = 4, 4  # the overlap: until the next fragment's sync
RESULT = "RESULT "  # rank 0 prints its measurements as one JSON line after this marker


def _timed(step_fn, steps):
    """Seconds of each of ``steps`` calls of ``step_fn(k)``, the ranks starting together."""
    dist.barrier()
    out = []
    for k in range(1, steps + 1):
        t0 = time.perf_counter()
        step_fn(k)
        out.append(time.perf_counter() - t0)
    return out


def measure(dev, rates_bps, H=16, ddp_steps=8, rounds=2, batch=32):
    rank = dist.get_rank()
    x, y = make_dataset(batch * 2, seed=3).tensors
    x, y = x[rank::2], y[rank::2]
    ddp = {name: DDP(make_model(0)) for name in ("ddp", "ddp_fp16")}
    ddp["ddp_fp16"].register_comm_hook(None, fp16_compress_hook)
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in ddp.items()}
    local = {name: make_model(0) for name in ("diloco", "streaming", "streaming_no_overlap", "compute")}
    inner = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in local.items()}
    outer = {"diloco": DiLoCo(local["diloco"], H),
             "streaming": DiLoCo(local["streaming"], H, fragments=FRAGMENTS, overlap=OVERLAP),
             "streaming_no_overlap": DiLoCo(local["streaming_no_overlap"], H, fragments=FRAGMENTS)}

    def step(model, opt):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    runs = {"ddp": lambda k: step(ddp["ddp"], opts["ddp"]),
            "ddp_fp16": lambda k: step(ddp["ddp_fp16"], opts["ddp_fp16"]),
            "diloco": lambda k: (step(local["diloco"], inner["diloco"]), outer["diloco"].after_step(k)),
            **{name: (lambda k, name=name: (step(local[name], inner[name]), outer[name].after_step(k)))
               for name in ("streaming", "streaming_no_overlap")},
            "compute": lambda k: step(local["compute"], inner["compute"])}
    for name, fn in runs.items():  # unshaped warm-up; DDP rebuilds its buckets after the first step
        _timed(fn, 2 if name.startswith("ddp") or name == "compute" else H)
    rows = []
    try:
        for rate in rates_bps:
            ch10_slownet.shape(dev, rate)
            small = statistics.median(_timed(lambda k: dist.all_reduce(torch.ones(1)), 9))
            times = {}
            for name, fn in runs.items():
                n = ddp_steps if name.startswith("ddp") or name == "compute" else rounds * H
                times[name] = _timed(fn, n)
            rows.append({"rate_bps": rate, "times": times, "small_s": small})
    finally:
        ch10_slownet.unshape(dev)
    for o in outer.values():
        o.flush()  # the overlapped exchange still under way, if any
    params = sum(p.numel() for p in local["compute"].parameters())
    return {"rows": rows, "H": H, "params": params, "fragments": FRAGMENTS, "overlap": OVERLAP}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--addr", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--dev", required=True)
    p.add_argument("--rates", required=True, help="link rates in bits/s, comma-separated")
    p.add_argument("--H", type=int, default=16)
    a = p.parse_args()
    os.environ["GLOO_SOCKET_IFNAME"] = a.dev  # gloo must use the shaped link, not the namespace's loopback
    apply_all()  # WORKAROUND for a torch bug at exit (pytorch/pytorch#56297), not part of the measurement
    dist.init_process_group("gloo", init_method=f"tcp://{a.addr}:{a.port}", rank=a.rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    out = measure(a.dev, [float(r) for r in a.rates.split(",")], a.H)
    dist.barrier()
    if a.rank == 0:
        print(RESULT + json.dumps(out), flush=True)
    dist.destroy_process_group()


def slow_steps(rates_bps, H=16, timeout=120):
    """Both ranks on links shaped to each rate.  ``{"skipped": reason}`` where this machine cannot
    (not root, no ``ip``/``tc``), else rank 0's measurements.  The namespaces, and with them the
    qdiscs, are deleted on every path."""
    reason = ch10_slownet.unavailable_reason()
    if reason is not None:
        return {"skipped": reason}
    script = os.path.abspath(__file__)
    with ch06_netns.two_hosts() as hosts:
        try:
            port = free_port()
            cmds = {f"host{h.name}": h.cmd(sys.executable, script, "--addr", hosts[0].addr, "--port", port,
                                           "--rank", rank, "--dev", h.ifname, "--H", H,
                                           "--rates", ",".join(f"{r:g}" for r in rates_bps))
                    for rank, h in enumerate(hosts)}
            results = run_commands(cmds, timeout=timeout, env={"OMP_NUM_THREADS": "1"}, echo=False,
                                   check=True)
        finally:
            for h in hosts:
                subprocess.run(h.cmd("tc", "qdisc", "del", "dev", h.ifname, "root"), capture_output=True)
    line = next(x for x in results[0].output.splitlines() if x.startswith(RESULT))
    return json.loads(line[len(RESULT):])


if __name__ == "__main__":
    main()
