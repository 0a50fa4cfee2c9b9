"""15.b: the load-balancing loss, ``load_balancing_loss(logits, idx, num_experts)``.

``logits`` (T, E) are the router's outputs, ``idx`` (T, k) the experts chosen for each token. The loss is
``E * sum_e f_e * P_e``: ``f_e`` the fraction of the T * k assignments that went to expert e (counts,
no gradient), ``P_e`` the mean over the tokens of the router's softmax probability of e (the gradient
flows through it). It is 1 when the router spreads tokens evenly, E when all go to one expert.

``check_load_balancing_loss(load_balancing_loss)`` runs in this process: a balanced routing, a
collapsed one, and random ones with k = 1 and k = 2, comparing the value and the gradient with
respect to the logits with a reference.  The misconceptions it recognises are ``CATALOGUE`` below.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...checking import Catalogue, CheckFailed, Misconception, as_tensor, checker, require_callable

__all__ = ["CATALOGUE", "check_load_balancing_loss", "reference_loss"]

E, T, TOL = 4, 12, 1e-5

CATALOGUE = Catalogue(
    "15.b load-balancing loss",
    Misconception(
        "no_factor_e", "the loss is the sum of fraction times probability",
        "the value is the reference divided by E",
        "the loss is E times too small: a balanced routing must give 1 (Switch multiplies "
        "sum_e f_e * P_e by the number of experts, so that the loss's size does not depend on E)"),
    Misconception(
        "softmax_over_tokens", "softmax over the logits' first dimension",
        "the value equals the loss with the softmax taken over the tokens",
        "the softmax was taken over the tokens (dim 0): each token's probabilities over the experts are "
        "logits.softmax(dim=-1), and P_e is their mean over the tokens"),
    Misconception(
        "per_token_fraction", "f_e is the tokens' share, counted over T",
        "right with k = 1, k times the reference with k = 2",
        "with k = 2 the loss came out twice the reference: f_e was divided by the T tokens instead of "
        "the T * k assignments, so the fractions add up to k (balanced routing must give 1 for any k; "
        "libraries that use this scaling change the loss's coefficient with it)"),
    Misconception(
        "probabilities_for_both", "f_e can be the mean probability too",
        "the value equals E * sum_e P_e ** 2",
        "the fractions came from the probabilities, not from the assignments: f_e counts the "
        "tokens actually sent to expert e (idx), which is what must be balanced"),
    Misconception(
        "no_gradient", "the loss is a statistic, so it can be computed without autograd",
        "the value is right and the logits receive no gradient",
        "the value is right but the router gets no gradient: P_e must be computed from the logits "
        "inside autograd (no .detach(), no torch.no_grad(), no .item()); only f_e carries none"),
    Misconception(
        "uses_logits", "the router's output is the probability",
        "the value equals the loss computed with raw logits in place of probabilities",
        "the mean of the raw logits was used for P_e: take the softmax over the experts first"),
)
_hint = CATALOGUE.hint


def reference_loss(logits: torch.Tensor, idx: torch.Tensor, num_experts: int, *, f_over: int | None = None,
                   probs: torch.Tensor | None = None) -> torch.Tensor:
    """E * sum f * P; ``f_over`` replaces the T*k denominator, ``probs`` the softmax (for the mistakes)."""
    counts = torch.zeros(num_experts).index_add_(0, idx.reshape(-1), torch.ones(idx.numel()))
    f = counts / (f_over or idx.numel())
    p = logits.softmax(-1) if probs is None else probs
    return num_experts * (f * p.mean(0)).sum()


def _cases() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(15)
    balanced_idx = torch.arange(T).remainder(E).view(T, 1)
    collapsed = torch.zeros(T, E)
    collapsed[:, 0] = 8.0
    out = [("balanced (all logits 0, tokens spread evenly)", torch.zeros(T, E), balanced_idx),
           ("collapsed (every token to expert 0)", collapsed, torch.zeros(T, 1, dtype=torch.long))]
    for k in (1, 2):
        logits = torch.randn(T, E, generator=g) * 2
        out.append((f"random logits, top-{k}", logits, logits.topk(k, dim=-1).indices))
    return out


@checker("15.b load-balancing loss", in_process=True)
def check_load_balancing_loss(load_balancing_loss: Callable) -> None:
    """``load_balancing_loss(logits, idx, num_experts)`` on four routings: value and gradient."""
    require_callable(load_balancing_loss, "a function load_balancing_loss(logits, idx, num_experts)")
    seen = []
    for name, logits, idx in _cases():
        mine = logits.clone().requires_grad_(True)
        got = load_balancing_loss(mine, idx.clone(), E)
        # a float (.item()) is a value without a graph: judged as such below
        got_t = torch.tensor(got) if isinstance(got, float) else as_tensor(got, "the loss")
        if got_t.numel() != 1:
            raise CheckFailed(f"{name}: the loss has shape {tuple(got_t.shape)}, expected a scalar")
        ref_logits = logits.clone().requires_grad_(True)
        want = reference_loss(ref_logits, idx, E)
        want.backward()
        value, target = float(got_t.detach().reshape(())), want.item()
        where = f"{name}, E = {E}, T = {T}: the loss is {value:.6g}, expected {target:.6g}"
        if abs(value - target) > TOL * max(1.0, abs(target)):
            k = idx.shape[1]
            alternatives = {
                "no_factor_e": target / E,
                "softmax_over_tokens": reference_loss(logits, idx, E, probs=logits.softmax(0)).item(),
                "per_token_fraction": reference_loss(logits, idx, E, f_over=T).item() if k > 1 else None,
                "probabilities_for_both": E * (logits.softmax(-1).mean(0) ** 2).sum().item(),
                "uses_logits": reference_loss(logits, idx, E, probs=logits).item(),
            }
            for key, alt in alternatives.items():
                if alt is not None and abs(value - alt) <= TOL * max(1.0, abs(alt)):
                    raise CheckFailed(f"{where}. {_hint(key)}.")
            raise CheckFailed(f"{where}.")
        if not got_t.requires_grad:
            raise CheckFailed(f"{name}: {_hint('no_gradient')}.")
        got_t.reshape(()).backward()
        grad = mine.grad
        if grad is None:
            raise CheckFailed(f"{name}: {_hint('no_gradient')}.")
        diff = (grad - ref_logits.grad).abs().max().item()
        if diff > TOL:
            raise CheckFailed(f"{name}: the value is right, but the gradient with respect to the logits "
                              f"differs from the reference by up to {diff:.3g}: f_e must be counts (no "
                              "gradient), P_e the mean softmax probability (with its gradient)")
        seen.append(f"{value:.3f}")
    print(f"value and gradient right on 4 routings (balanced, collapsed, top-1, top-2): losses "
          f"{', '.join(seen)} "
          f"(1 is balanced, {E} is one expert for everything)")
