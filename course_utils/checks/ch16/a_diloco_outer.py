"""16.a: DiLoCo's outer step, ``DiLoCoOuter(params, outer_lr, momentum, group=None)`` with ``sync()``.

The learner's class keeps the global copy of ``params`` (the replica's model parameters, which an
inner optimizer trains between syncs) and, at each ``sync()``: averages the pseudo-gradient
(global minus local) over ``group``, steps the global copy with SGD and Nesterov momentum (the
momentum kept from round to round), and writes the new global copy into ``params``.

``check_diloco_outer(DiLoCoOuter)`` runs it for several rounds on 2 ranks (the default group) and
on 4 ranks split into two replica groups, {0, 2} and {1, 3} (as the replicate dimension of a
2 x 2 mesh: each rank averages with the rank that holds the same part of the model). Before each
sync every rank moves its parameters by its own made-up "inner steps"; after each sync the checker
compares every rank's parameters with a reference computed here, in the notebook's process. The
outer settings are the paper's (learning rate 0.7, Nesterov momentum 0.9), where averaging the
parameters and stepping with the averaged pseudo-gradient give different results.

The misconceptions it recognises are ``CATALOGUE`` below (each key names the wrong class in
tests/checkers/test_ch16_checks.py): each is recognised by simulating it and finding the learner's
parameters equal to the simulation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ...checking import (
    Catalogue,
    CheckFailed,
    Misconception,
    Outcome,
    checker,
    judge,
    process_group,
    require_callable,
    run_workers,
)

__all__ = ["CATALOGUE", "check_diloco_outer", "reference_rounds"]

OUTER_LR, MOMENTUM, ROUNDS = 0.7, 0.9, 3
SHAPES = [(6, 4), (4,), (3, 6)]
ATOL = 1e-5
# 4 ranks as a 2 x 2 mesh: the replica groups are the columns (each holds one part of the model)
GROUPS_OF_4 = [[0, 2], [1, 3]]

CATALOGUE = Catalogue(
    "16.a DiLoCo outer step",
    Misconception(
        "one_rank_only", "rank 0 keeps the global copy and steps it; the others follow somehow",
        "the ranks of one replica group hold different parameters after sync()",
        "the replicas disagree after sync(): every replica must compute the same outer step on "
        "its own global copy (the averaged pseudo-gradient is the same on all), or one rank steps "
        "and broadcasts the result. Updating the global copy on one rank only leaves the others behind"),
    Misconception(
        "no_restart", "the outer step updates the global copy; the model's parameters are the inner loop's",
        "the parameters after sync() are the local ones from before it",
        "after sync() the model's parameters are still the local ones: every replica must start the "
        "next round from the new global copy (copy it into params)"),
    Misconception(
        "sign_flipped", "the pseudo-gradient is how far the replica moved: local minus global",
        "the parameters equal an outer step with local - global as the gradient",
        "the pseudo-gradient's sign is flipped: it is global minus local (as a gradient points "
        "uphill, opposite to where the inner steps went); local minus global makes the outer step "
        "undo the inner steps"),
    Misconception(
        "averages_parameters", "DiLoCo averages the replicas' parameters, as local SGD does",
        "the parameters equal the average of the local parameters",
        "the parameters were averaged (local SGD), not stepped by the outer optimizer: average "
        "the pseudo-gradients (global - local), then take the outer SGD step with them. The two agree "
        "only for plain SGD with learning rate 1; here lr=0.7 with Nesterov momentum 0.9"),
    Misconception(
        "momentum_recreated", "a new outer optimizer each round is fine",
        "round 1 is right, later rounds equal an outer step whose momentum starts from zero each time",
        "the outer momentum is re-created every round: round 1 is right, later rounds are not. "
        "Create the outer optimizer (or the momentum buffers) once, in __init__, and keep it"),
    Misconception(
        "no_nesterov", "momentum is momentum",
        "the parameters equal an outer step with heavy-ball (non-Nesterov) momentum",
        "the outer step uses plain momentum, not Nesterov's: SGD(..., momentum=m, nesterov=True) "
        "steps along g + m·buf, not buf"),
    Misconception(
        "wrong_group", "all_reduce averages over the replicas",
        "on 4 ranks in two replica groups, the pseudo-gradient is averaged over all 4 ranks, or "
        "summed over the group and divided by 4",
        "the average is taken over the wrong group: pass group=self.group to all_reduce and divide "
        "by dist.get_world_size(group), the number of replicas in it (on 4 ranks in two replica "
        "groups, the average spanned all 4 ranks or divided by 4)"),
)
_hint = CATALOGUE.hint


def _start(shapes=SHAPES) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(16)
    return [torch.randn(s, generator=g) for s in shapes]


def _inner_moves(rank: int, rnd: int, shapes=SHAPES) -> list[torch.Tensor]:
    """What rank ``rank``'s inner steps change in round ``rnd`` (made up, different per rank)."""
    g = torch.Generator().manual_seed(1000 * rnd + rank + 1)
    return [0.2 * torch.randn(s, generator=g) for s in shapes]


def _simulate(members: list[int], world: int, kind: str) -> list[list[torch.Tensor]]:
    """The global copy after each round, for the replicas ``members`` (one replica group) on
    ``world`` ranks, for the right answer (``kind="right"``) or one mistake."""
    glob = _start()
    buf: list[torch.Tensor] | None = None
    out = []
    for rnd in range(ROUNDS):
        everyone = members if kind != "wrong_group_all" else list(range(world))
        locals_ = {r: [g + m for g, m in zip(glob, _inner_moves(r, rnd))] for r in everyone}
        if kind == "averages_parameters":
            glob = [torch.stack([locals_[r][i] for r in members]).mean(0) for i in range(len(glob))]
            out.append([g.clone() for g in glob])
            continue
        sign = -1.0 if kind == "sign_flipped" else 1.0
        divisor = world if kind == "wrong_group_divisor" else len(everyone)
        pseudo = [sign * sum(glob[i] - locals_[r][i] for r in everyone) / divisor for i in range(len(glob))]
        if buf is None or kind == "momentum_recreated":
            buf = [d.clone() for d in pseudo]
        else:
            buf = [MOMENTUM * b + d for b, d in zip(buf, pseudo)]
        step = buf if kind == "no_nesterov" else [d + MOMENTUM * b for d, b in zip(pseudo, buf)]
        glob = [g - OUTER_LR * s for g, s in zip(glob, step)]
        out.append([g.clone() for g in glob])
    return out


def reference_rounds(world: int, rank: int, kind: str = "right") -> list[list[torch.Tensor]]:
    """The parameters rank ``rank`` must hold after each sync (its replica group's global copy)."""
    members = next(g for g in GROUPS_OF_4 if rank in g) if world == 4 else list(range(world))
    return _simulate(members, world, kind)


def _worker(cls: Any, split: bool) -> Outcome:
    with process_group() as pg:
        groups = [dist.new_group(g) for g in GROUPS_OF_4] if split else None  # every rank makes both
        group = groups[pg.rank % 2] if split else None
        params = [t.to(pg.device) for t in _start()]
        outer = cls(params, outer_lr=OUTER_LR, momentum=MOMENTUM, group=group)
        before, after = [], []
        for rnd in range(ROUNDS):
            with torch.no_grad():
                for p, m in zip(params, _inner_moves(pg.rank, rnd)):
                    p.add_(m.to(pg.device))  # this replica's inner steps
            before.append([p.detach().cpu().clone() for p in params])
            outer.sync()
            after.append([p.detach().cpu().clone() for p in params])
        if split:
            dist.barrier()
        return Outcome(pg.rank, data={"before": before, "after": after})


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(x.shape == y.shape and torch.allclose(x, y, atol=ATOL, rtol=0) for x, y in zip(a, b))


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _judge(world: int, outcomes: list[Outcome]) -> None:
    where = (f"on {world} ranks (one replica group)" if world == 2 else
             f"on {world} ranks in replica groups {GROUPS_OF_4}")
    for rank, o in enumerate(outcomes):
        if _same(o.data["after"][0], o.data["before"][0]):
            raise CheckFailed(f"{where}, rank {rank}, after sync() number 1: {_hint('no_restart')}")
    for members in ([list(range(world))] if world == 2 else GROUPS_OF_4):
        for rnd in range(ROUNDS):
            got = [outcomes[r].data["after"][rnd] for r in members]
            if not all(_same(got[0], g) for g in got[1:]):
                raise CheckFailed(f"{where}, after sync() number {rnd + 1}, ranks {members} hold parameters "
                                  f"that differ by up to {max(_max_diff(got[0], g) for g in got[1:]):.3g}: "
                                  + _hint("one_rank_only"))
    for rank, o in enumerate(outcomes):
        right = reference_rounds(world, rank)
        for rnd in range(ROUNDS):
            got = o.data["after"][rnd]
            if _same(got, right[rnd]):
                continue
            lead = (f"{where}, rank {rank}, after sync() number {rnd + 1} of {ROUNDS}: the parameters differ "
                    f"from the reference by up to {_max_diff(got, right[rnd]):.3g}")
            if _same(got, o.data["before"][rnd]):
                raise CheckFailed(f"{lead}; {_hint('no_restart')}")
            for kind, key in _SIMULATED:
                if _same(got, reference_rounds(world, rank, kind)[rnd]):
                    raise CheckFailed(f"{lead}. Usual mistake: {_hint(key)}.")
            raise CheckFailed(f"{lead} (pseudo-gradient = global - local, averaged over the group; outer "
                              f"SGD lr={OUTER_LR}, Nesterov momentum {MOMENTUM}, kept across rounds; every "
                              "replica restarts from the new global copy)")


# each simulated mistake and the catalogue entry that names it
_SIMULATED = [("sign_flipped", "sign_flipped"), ("averages_parameters", "averages_parameters"),
              ("momentum_recreated", "momentum_recreated"), ("no_nesterov", "no_nesterov"),
              ("wrong_group_all", "wrong_group"), ("wrong_group_divisor", "wrong_group")]
_HANG = ("the ranks did not make the same collectives: every replica must take part in every sync's "
         "all-reduce (over the group it was given)")


@checker("16.a DiLoCo outer step")
def check_diloco_outer(DiLoCoOuter: Callable, *, timeout: float = 60.0) -> None:
    """``DiLoCoOuter(params, outer_lr, momentum, group=None)``; ``sync()`` after the inner steps."""
    require_callable(DiLoCoOuter, "the class DiLoCoOuter(params, outer_lr, momentum, group=None)")
    for world, split in ((2, False), (4, True)):
        outcomes = judge(run_workers(_worker, world, args=(DiLoCoOuter, split), timeout=timeout,
                                     hang_hint=_HANG), world=world)
        _judge(world, outcomes)
    print(f"{ROUNDS} rounds on 2 ranks and on 4 ranks in replica groups {GROUPS_OF_4}: every rank's "
          f"parameters equal the reference (outer SGD lr {OUTER_LR}, Nesterov momentum {MOMENTUM}) within "
          f"{ATOL:g}")
