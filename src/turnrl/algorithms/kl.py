"""Per-token estimators of KL(pi_theta || pi_ref) from samples of pi_theta.

Schulman, "Approximating KL divergence" (2020, http://joschu.net/blog/kl-approx.html); the
definitions and test vectors are docs/algorithms.md, "KL to a reference policy". With
``log_ratio = ref_logprobs - logprobs`` on sampled tokens:

- ``kl_k1`` = -log_ratio: unbiased, can be negative; the usual per-token penalty in the reward;
- ``kl_k2`` = log_ratio^2 / 2: biased, >= 0; its gradient is that of the reverse KL;
- ``kl_k3`` = exp(log_ratio) - 1 - log_ratio: unbiased, >= 0, low variance (GRPO's loss term);
- ``kl_k3_plus``: the value of k3 with the gradient of k2.

As a loss term, k1 has zero expected gradient, and k3's gradient is that of the forward KL
rather than the reverse KL the estimate is of; k3+ keeps k3's value (for logging, and for
the loss scale) and takes k2's gradient.

Every function returns ``[B, T]``, exactly 0 with exactly 0 gradient where ``loss_mask`` is
false, whatever the masked slots hold. Placing the result in the reward (detach it) or in
the loss, and its coefficient, is the caller's choice.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch
from torch import Tensor

__all__ = ["KL_ESTIMATORS", "kl_k1", "kl_k2", "kl_k3", "kl_k3_plus"]


def _log_ratio(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor) -> Tensor:
    """log pi_ref - log pi_theta where valid, 0 where masked (sanitised before arithmetic)."""
    return torch.where(mask, ref_logprobs, 0.0) - torch.where(mask, logprobs, 0.0)


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """k1 = log pi_theta - log pi_ref per token: unbiased, can be negative."""
    mask = loss_mask.bool()
    return torch.where(mask, -_log_ratio(logprobs, ref_logprobs, mask), 0.0)


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """k2 = (log pi_ref - log pi_theta)^2 / 2 per token: biased, >= 0, reverse-KL gradient."""
    mask = loss_mask.bool()
    d = _log_ratio(logprobs, ref_logprobs, mask)
    return torch.where(mask, 0.5 * d.square(), 0.0)


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """Schulman's k3 estimate of KL(pi || pi_ref) per token: exp(d) - 1 - d, d = ref - logp.

    Unbiased, non-negative and low-variance (docs/algorithms.md, "KL to a reference policy").
    Computed as expm1(d) - d: exp(d) - 1 - d cancels catastrophically for small d and can
    come out negative (d = 1e-197 gives -1e-197). Exactly 0 where ``loss_mask`` is False;
    masking uses torch.where, so inf/NaN there cannot leak into the value or the gradient.

    Not clamped, deliberately (verl clamps k3 to [-10, 10]): a clamp hides exactly the tokens
    where the policy has run far from the reference, and zeroes their gradient; turnrl keeps
    the estimator as defined and lets the KL metrics and alarms show a blow-up.
    """
    mask = loss_mask.bool()
    d = _log_ratio(logprobs, ref_logprobs, mask)
    return torch.where(mask, torch.expm1(d) - d, 0.0)


def kl_k3_plus(logprobs: Tensor, ref_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """The "k3+" estimator: the value of ``kl_k3`` with the gradient of ``kl_k2``, per token.

    A straight-through combination, k2 + stop_gradient(k3 - k2): the loss reads as the
    unbiased, non-negative k3, while its gradient is k2's, which is the gradient of the
    reverse KL(pi_theta || pi_ref) that the penalty is meant to be (docs/algorithms.md).
    """
    k2 = kl_k2(logprobs, ref_logprobs, loss_mask)
    k3 = kl_k3(logprobs, ref_logprobs, loss_mask)
    return k2 + (k3 - k2).detach()


KL_ESTIMATORS: Mapping[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = MappingProxyType(
    {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3, "k3+": kl_k3_plus}
)
"""The estimators by the names docs/algorithms.md uses, for configs that pick one by name."""
