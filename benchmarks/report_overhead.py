"""What ``course_utils.report()`` every step costs the chapter 01 training loop, in 2 workers.

    python benchmarks/report_overhead.py [--steps 2000] [--repeats 9]

Each worker runs chapter 01's training (``make_model`` on the training split of
``make_dataset``, SGD with momentum, batch 64, consecutive batches) through ``course_utils.launch``
and times its own loop.  Three variants, interleaved so that a noisy neighbour hurts them alike:

- ``never``: no ``report()`` call (the loss is still read with ``.item()`` every step, as the
  chapter does to keep its loss curve);
- ``every step, text``: ``report(step, total, loss, samples_per_s)`` every step, shown by the
  text display (what nbval, nbconvert and a terminal get);
- ``every step, widgets``: the same reports feeding the live widget display, whose progress bars
  and plot redraws run in the launching process, on the same cores as the workers.

Printed: the median loop time per variant (slowest rank), its spread, the overhead against
``never``, the CPU time the launching process used (it shares the cores with the workers), and
the time spent inside ``report()`` itself per call.  On a shared machine the loop times are
noisy: compare the spread, and rerun with more ``--repeats``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import time


def train(steps: int, reporting: bool) -> dict:
    """Chapter 01's loop; returns the loop's wall time and the time spent inside report()."""
    import torch
    from torch import nn

    from course_utils import report
    from course_utils.data import make_dataset, make_model, split

    train_set, _ = split(make_dataset())
    x, y = train_set.tensors
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    n, bs = len(x), 64
    losses = []
    in_report = []
    t0 = time.perf_counter()
    for s in range(steps):
        idx = torch.arange(s * bs, (s + 1) * bs) % n
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if reporting:
            r0 = time.perf_counter()
            report(step=s + 1, total=steps, loss=losses[-1],
                   samples_per_s=bs * (s + 1) / (r0 - t0))
            in_report.append(time.perf_counter() - r0)
    loop_s = time.perf_counter() - t0
    in_report.sort()
    return {"loop_s": loop_s, "report_mean_s": sum(in_report) / max(1, len(in_report)),
            "report_median_s": in_report[len(in_report) // 2] if in_report else 0.0}


def run(variant: str, steps: int) -> dict:
    from course_utils import launch, monitor

    # Outside a kernel the widgets have no front end and display() prints their text form, and
    # the text display prints one line per rank: keep both out of the benchmark's output (the
    # drawing and widget updates still happen).
    with contextlib.redirect_stdout(io.StringIO()):
        if variant == "never":
            disp = None
        elif variant == "every step, text":
            disp = monitor.make_display(2, mode="text")
        else:
            disp = monitor.WidgetDisplay(2)
        cpu0 = time.process_time()
        res = launch(train, 2, args=(steps, variant != "never"), timeout=600, display=disp)
        cpu = time.process_time() - cpu0
    return {"loop_s": max(r["loop_s"] for r in res), "launcher_cpu_s": cpu,
            "report_mean_s": max(r["report_mean_s"] for r in res),
            "report_median_s": max(r["report_median_s"] for r in res),
            "redraws": getattr(disp, "redraws", 0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000, help="training steps per rank (default 2000)")
    ap.add_argument("--repeats", type=int, default=9, help="runs of each variant (default 9)")
    args = ap.parse_args()

    import torch

    from course_utils import launch
    from course_utils.workers.budget import cpu_threads_per_worker

    variants = ["never", "every step, text", "every step, widgets"]
    print(f"chapter 01 training in 2 workers: {args.steps} steps of batch 64 per rank, "
          f"{cpu_threads_per_worker(2)} thread(s) each, torch {torch.__version__}, "
          f"{args.repeats} repeats, variants interleaved")
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    launch(train, 2, args=(5, True), display=None)  # start the fork server, warm up
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for rep in range(args.repeats):
        order = variants[rep % 3:] + variants[:rep % 3]
        for v in order:
            results[v].append(run(v, args.steps))

    base = statistics.median(r["loop_s"] for r in results["never"])
    best = min(r["loop_s"] for r in results["never"])
    print(f"\n{'variant':<22} {'loop: median':>12} {'best':>8} {'worst':>8} {'steps/s':>8} "
          f"{'overhead: median':>16} {'best':>6} {'notebook CPU':>13}")
    for v in variants:
        loops = [r["loop_s"] for r in results[v]]
        med = statistics.median(loops)
        over = "" if v == "never" else f"{100 * (med / base - 1):+.1f}%"
        over_best = "" if v == "never" else f"{100 * (min(loops) / best - 1):+.1f}%"
        cpu = statistics.median(r["launcher_cpu_s"] for r in results[v])
        print(f"{v:<22} {med:>10.3f} s {min(loops):>6.3f} s {max(loops):>6.3f} s "
              f"{args.steps / med:>8.0f} {over:>16} {over_best:>6} {cpu * 1e3:>10.0f} ms")
    print("(loop: the slowest rank's training loop; best: the fastest of the repeats, the least "
          "disturbed by other programs; notebook CPU: what the launching process used during the "
          "launch, on the same cores)")
    reporting = [r for v in variants[1:] for r in results[v]]
    median_call = statistics.median(r["report_median_s"] for r in reporting)
    mean_call = statistics.median(r["report_mean_s"] for r in reporting)
    step = base / args.steps
    redraws = statistics.median(r["redraws"] for r in results["every step, widgets"])
    print(f"\ntime inside report(): median call {median_call * 1e6:.1f} us, mean {mean_call * 1e6:.1f} us "
          f"(the mean includes the times the worker lost its core while in the call); "
          f"a training step takes {step * 1e3:.2f} ms, so report() is "
          f"{100 * median_call / step:.2f}% (median) / {100 * mean_call / step:.2f}% (mean) of a step")
    print(f"widget display: {redraws:.0f} live plot redraws per run (median)")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print("The rest of any overhead is the launching process reading and displaying the reports "
          "on the same cores as the workers; on a machine with spare cores it disappears.")


if __name__ == "__main__":
    main()
