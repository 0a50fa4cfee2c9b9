"""Checkers of chapter 08: an AMP training step with GradScaler and gradient clipping under DDP."""

from __future__ import annotations

import gc
import math
import traceback

import torch

from ..checking import CheckFailed, checker, diff_table, format_table, require_callable

__all__ = ["check_amp_step"]

WORLD, BATCH, STEPS = 2, 16, 3
OVERFLOW_STEP, OVERFLOW_RANK = 1, 1  # rank 1 gets an inf in its input at the second step
INIT_SCALE, MAX_NORM, LR = 2.0**12, 0.05, 0.2
ATOL = 1e-5


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    from ..data import make_dataset

    X, Y = make_dataset(STEPS * WORLD * BATCH, seed=11).tensors
    start = (step * WORLD + rank) * BATCH
    x, y = X[start:start + BATCH].clone(), Y[start:start + BATCH]
    if step == OVERFLOW_STEP and rank == OVERFLOW_RANK:
        x[0, 0] = float("inf")  # its loss and gradients become NaN; the all-reduce spreads them
    return x, y


def _amp_step(model, optimizer, scaler, x, y, *, max_norm, amp_dtype, mistake=None):
    """The reference step; ``mistake`` reproduces a usual error, to recognise it."""
    with torch.autocast(x.device.type, dtype=amp_dtype):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    if mistake != "clip_before_unscale" and mistake != "no_unscale":
        scaler.unscale_(optimizer)
    if mistake != "no_clip" and mistake != "no_unscale":
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if mistake == "no_unscale":
        optimizer.step()  # (scaler.update() would now raise: no inf check was recorded)
    else:
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def _params(model) -> dict:
    return {n: p.detach().cpu().clone() for n, p in model.module.named_parameters()}


def _amp_worker(fn, amp_dtype_name: str) -> dict:
    """Runs on every rank: the learner's step and the reference, side by side, on DDP models."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ..data import make_model
    from ..devices import backend_and_device

    backend, device = backend_and_device(announce=False)
    dist.init_process_group(backend)
    rank = dist.get_rank()
    amp_dtype = getattr(torch, amp_dtype_name)
    ids = [device.index] if device.type == "cuda" else None

    def setup():
        model = DDP(make_model(0).to(device), device_ids=ids)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        scaler = torch.amp.GradScaler(device.type, init_scale=INIT_SCALE, growth_interval=2000)
        return model, opt, scaler

    out: dict = {"rank": rank, "steps": [], "ref": [], "mistakes": {}}
    model = opt = scaler = None
    try:
        model, opt, scaler = setup()
        seen_dtypes: list = []
        model.module.net[0].register_forward_hook(lambda m, i, o: seen_dtypes.append(o.dtype))
        for s in range(STEPS):
            x, y = (t.to(device) for t in _data(s, rank))
            seen_dtypes.clear()
            try:
                ret = fn(model, opt, scaler, x, y, max_norm=MAX_NORM, amp_dtype=amp_dtype)
            except NotImplementedError as e:  # the stub: reported as "not done" by the checker
                out["not_done"] = str(e)
                break
            except Exception as e:
                out["error"] = (s, type(e).__name__, str(e), traceback.format_exc(limit=-3))
                break
            if isinstance(ret, torch.Tensor) and ret.numel() == 1:
                ret = float(ret.detach().cpu())
            elif not (isinstance(ret, (int, float)) and not isinstance(ret, bool)):
                ret = ("not a number", type(ret).__name__)
            out["steps"].append({"params": _params(model), "scale": scaler.get_scale(),
                                 "returned": ret,
                                 "dtypes": [str(d).replace("torch.", "") for d in seen_dtypes]})
        if "not_done" in out or "error" in out:
            return out

        model, opt, scaler = setup()
        for s in range(STEPS):
            x, y = (t.to(device) for t in _data(s, rank))
            loss = _amp_step(model, opt, scaler, x, y, max_norm=MAX_NORM, amp_dtype=amp_dtype)
            out["ref"].append({"params": _params(model), "scale": scaler.get_scale(), "loss": loss})
        del model, opt, scaler

        for mistake in ("clip_before_unscale", "no_clip", "no_unscale"):
            model, opt, scaler = setup()
            x, y = (t.to(device) for t in _data(0, rank))
            _amp_step(model, opt, scaler, x, y, max_norm=MAX_NORM, amp_dtype=amp_dtype,
                      mistake=mistake)
            out["mistakes"][mistake] = _params(model)
            del model, opt, scaler
    finally:
        # Free every DDP model before its process group: a DDP model that outlives the group
        # can hang or abort the worker when it is freed (torch 2.13, gloo).
        model = opt = scaler = None
        gc.collect()  # in case a reference cycle still holds one
        dist.destroy_process_group()
    return out


def _close(a: dict, b: dict, atol: float = ATOL) -> bool:
    return max((d for _, d, _ in diff_table(a, b)), default=0.0) <= atol


_MISTAKE_TEXT = {
    "clip_before_unscale": "clipping before scaler.unscale_(optimizer): clip_grad_norm_ then sees "
                           "gradients multiplied by the scale and shrinks them far too much. Call "
                           "scaler.unscale_(optimizer) first, then clip, then scaler.step(optimizer).",
    "no_clip": "the gradients were not clipped: call torch.nn.utils.clip_grad_norm_(model."
               "parameters(), max_norm) after scaler.unscale_(optimizer).",
    "no_unscale": "optimizer.step() on gradients still multiplied by the scale: use "
                  "scaler.unscale_(optimizer) and scaler.step(optimizer), not optimizer.step().",
}


@checker("08.a AMP step under DDP")
def check_amp_step(fn, *, amp_dtype: torch.dtype = torch.float16, timeout: float = 120) -> None:
    """Run ``fn(model, optimizer, scaler, x, y, max_norm=..., amp_dtype=...)`` on 2 DDP ranks.

    Three steps; at the second, rank 1's input holds an inf.  Expected: the forward under
    autocast in ``amp_dtype``; parameters equal to the reference AMP step (unscale_, clip, step,
    update) on every rank; the overflow step skipped on *both* ranks and the scale halved once.
    """
    require_callable(fn, "a function amp_step(model, optimizer, scaler, x, y, *, max_norm, amp_dtype)")
    from ..workers.supervisor import launch

    name = str(amp_dtype).replace("torch.", "")
    results = launch(_amp_worker, nprocs=WORLD, args=(fn, name), timeout=timeout, display=None)
    for r in results:
        if "not_done" in r:
            raise NotImplementedError(r["not_done"])
    for r in results:
        if "error" in r:
            s, etype, msg, tb = r["error"]
            hint = ""
            if ("has already been called" in msg and "update()" in msg) or "called after step()" in msg:
                hint = ("\nUsual mistake: scaler.step(optimizer) without scaler.update() afterwards; "
                        "update() closes the step and is needed every iteration.")
            elif "No inf checks were recorded" in msg:
                hint = ("\nUsual mistake: optimizer.step() instead of scaler.step(optimizer); "
                        "scaler.update() needs the inf/NaN check that scaler.step (or unscale_) makes.")
            elif "unexpected keyword" in msg or "positional argument" in msg:
                hint = ("\nThe checker calls fn(model, optimizer, scaler, x, y, max_norm=..., "
                        "amp_dtype=...).")
            raise CheckFailed(f"on rank {r['rank']}, step {s + 1}: your function raised "
                              f"{etype}: {msg}{hint}\n{tb}")
    for r in results:
        dts = r["steps"][0]["dtypes"]
        if not dts:
            raise CheckFailed(f"on rank {r['rank']}: the model was never called; run the forward "
                              "pass through the model you were given")
        if dts[0] != name:
            raise CheckFailed(
                f"on rank {r['rank']}: the first Linear layer produced {dts[0]}, expected {name}. "
                f"Usual mistake: the forward pass is not inside torch.autocast(x.device.type, "
                f"dtype=amp_dtype)" + (" (or a different dtype was used)" if dts[0] != "float32" else ""))
    for r in results:
        got, ref = r["steps"][0]["returned"], r["ref"][0]["loss"]
        if isinstance(got, tuple):
            raise CheckFailed(f"on rank {r['rank']}, step 1: expected the loss as a float, got "
                              f"{got[1]}" + (" (a missing `return`?)" if got[1] == "NoneType" else ""))
        if not math.isclose(got, ref, rel_tol=1e-4, abs_tol=1e-6):
            scaled = math.isclose(got, ref * INIT_SCALE, rel_tol=1e-3)
            raise CheckFailed(
                f"on rank {r['rank']}, step 1: returned loss {got:.6g}, expected {ref:.6g}"
                + (": that is the scaled loss; return the unscaled loss.item()." if scaled else "."))
    r0 = results[0]
    got, ref = r0["steps"][0]["params"], r0["ref"][0]["params"]
    if not _close(ref, got):
        table = format_table(diff_table(ref, got), ATOL)
        head = (f"parameters after step 1 (rank 0) differ from the reference AMP step "
                f"(autocast, scale, backward, unscale_, clip_grad_norm_, step, update):\n{table}\n")
        for mistake, params in r0["mistakes"].items():
            if _close(params, got):
                raise CheckFailed(head + "Usual mistake: " + _MISTAKE_TEXT[mistake])
        raise CheckFailed(head + "Usual mistake: clipping with a max_norm other than the one "
                          "given, a different loss, or no optimizer.zero_grad().")
    before = r0["steps"][OVERFLOW_STEP - 1]
    after = r0["steps"][OVERFLOW_STEP]
    flat = torch.cat([p.flatten() for p in after["params"].values()])
    if not torch.isfinite(flat).all():
        raise CheckFailed(
            f"step {OVERFLOW_STEP + 1} had NaN gradients (rank {OVERFLOW_RANK}'s input held an inf) "
            "and your step applied them: the parameters are now NaN on every rank. Usual mistake: "
            "optimizer.step() instead of scaler.step(optimizer), which skips a step whose "
            "gradients contain inf or NaN.")
    for s in range(STEPS):
        a, b = results[0]["steps"][s]["params"], results[1]["steps"][s]["params"]
        if not _close(a, b, 0.0):
            raise CheckFailed(
                f"after step {s + 1}, rank 1's parameters differ from rank 0's:\n"
                f"{format_table(diff_table(a, b), 0.0)}\nUsual mistake: ranks stepping differently "
                "(a skip decided by something other than scaler.step on the all-reduced gradients).")
    if not _close(before["params"], after["params"], 0.0):
        raise CheckFailed(
            f"step {OVERFLOW_STEP + 1} had NaN gradients but the parameters changed; it should "
            "have been skipped. Usual mistake: calling optimizer.step() yourself, or stepping "
            "twice.")
    want_scale = before["scale"] * 0.5
    if after["scale"] != want_scale:
        if after["scale"] == before["scale"]:
            why = ("the scale did not change: call scaler.update() after scaler.step(optimizer) "
                   "every step; it halves the scale after a skipped step.")
        elif after["scale"] == before["scale"] * 0.25:
            why = ("the scale was halved twice: do not call scaler.update(new_scale) or adjust "
                   "the scale yourself; GradScaler already halves it on inf/NaN.")
        else:
            why = "let GradScaler manage the scale: one scaler.update() per step, no argument."
        raise CheckFailed(f"after the overflow at step {OVERFLOW_STEP + 1} the scale is "
                          f"{after['scale']:g}, expected {want_scale:g} (half of {before['scale']:g}). "
                          f"Usual mistake: {why}")
    for s in range(STEPS):
        got, ref = r0["steps"][s]["params"], r0["ref"][s]["params"]
        if not _close(ref, got):
            raise CheckFailed(
                f"parameters after step {s + 1} (rank 0) differ from the reference AMP step:\n"
                f"{format_table(diff_table(ref, got), ATOL)}\nUsual mistake: gradients left over "
                "from the skipped step (call optimizer.zero_grad() every step, skipped or not).")
