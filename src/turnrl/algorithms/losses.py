"""Policy losses and masked reductions: pure tensor functions over ``[B, T]`` tokens.

Every function takes a ``loss_mask`` (true on policy-sampled tokens; false on prompt, tool
output and padding) and masks with ``torch.where``, never by multiplying: ``0 * inf`` and
``0 * nan`` are NaN, so a multiplied mask lets a bad value in a masked slot leak into the
loss or its gradient. Inputs are sanitised with ``where`` before any arithmetic that could
turn a masked value into a NaN gradient (the "double where"), and results are masked again
at the end. Definitions and test vectors: ALGORITHMS.md, "Policy losses" and "Loss
aggregation".

Not here: value, KL and entropy terms, and the other reductions (seq-mean-token-mean and
friends); they are further named functions of this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "PolicyLossOutput",
    "clip_fraction",
    "clipped_policy_loss",
    "masked_mean",
    "masked_sum",
    "policy_ratio",
    "token_mean",
]

# Bound on |log pi - log pi_old| before exponentiating: exp(20) ~ 5e8 is already far past
# any clip range, and the bound keeps the ratio finite (ALGORITHMS.md, "PPO clip").
_MAX_LOG_RATIO = 20.0


def _bool_mask(mask: Tensor, like: Tensor) -> Tensor:
    """The mask as bool (nonzero = valid), broadcast to ``like``'s shape."""
    mask = mask if mask.dtype == torch.bool else mask != 0
    return mask.expand_as(like)


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` over positions where ``mask`` is true (over ``dim``, or all of it).

    Masked positions contribute exactly 0 to the value and receive exactly 0 gradient,
    whatever they hold (inf and NaN included).
    """
    kept = torch.where(_bool_mask(mask, x), x, torch.zeros_like(x))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is true (over ``dim``, or all of it).

    An empty mask gives 0, not NaN, so a batch (or row) with no sampled tokens contributes
    nothing instead of poisoning the step.
    """
    bool_mask = _bool_mask(mask, x)
    total = masked_sum(x, bool_mask, dim)
    count = bool_mask.sum() if dim is None else bool_mask.sum(dim=dim)
    return total / count.clamp(min=1).to(total.dtype)


def policy_ratio(logprobs: Tensor, old_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """Token importance ratio pi_theta / pi_old, ``[B, T]``; exactly 1.0 where masked.

    Computed as exp(clamp(logp - old_logp, -20, 20)) so the ratio stays finite. Masked
    log-ratios are replaced by 0 before the exp, so their gradient is 0 rather than
    ``0 * exp(inf)`` = NaN.
    """
    mask = _bool_mask(loss_mask, logprobs)
    log_ratio = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))
    return torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))


@dataclass(frozen=True, eq=False)
class PolicyLossOutput:
    """What ``clipped_policy_loss`` returns; all tensors are ``[B, T]``."""

    per_token_loss: Tensor
    """Loss of each token, exactly 0 at masked positions; reduce it with ``token_mean``."""
    clipped: Tensor
    """Bool: a clip was active, i.e. the chosen term is a clipped one and differs from the
    unclipped r * A (such a token gets no gradient). Covers the dual clip too. False where
    masked."""
    ratio: Tensor
    """pi_theta / pi_old per token (``policy_ratio``), 1.0 where masked; carries the graph,
    so detach it before logging."""


def clipped_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate per token, with decoupled clip ranges and optional dual clip.

    ``logprobs``, ``old_logprobs`` and ``loss_mask`` are ``[B, T]``; ``advantages`` is
    ``[B, T]`` (per token) or ``[B, 1]`` (per sequence, broadcast over its tokens).

    PPO (Schulman et al. 2017, arXiv:1707.06347, eq. 7), as a loss to minimise:
        loss = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A).
    Separate ``eps_low`` / ``eps_high`` is DAPO's "clip-higher" (Yu et al. 2025,
    arXiv:2503.14476, Sec. 3.1; 0.2 / 0.28 there). With ``dual_clip = c`` (Ye et al. 2020,
    arXiv:1912.09729), tokens with A < 0 are further bounded,
        loss = min(-A c, max(-A r, -A clip(r))),
    so a huge ratio on a bad token cannot produce an unbounded loss.
    """
    if logprobs.ndim != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    if old_logprobs.shape != logprobs.shape or loss_mask.shape != logprobs.shape:
        raise ValueError(
            "logprobs, old_logprobs and loss_mask must share one [B, T] shape, got "
            f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(loss_mask.shape)}"
        )
    batch_size, num_tokens = logprobs.shape
    if advantages.shape not in {(batch_size, num_tokens), (batch_size, 1)}:
        raise ValueError(
            f"advantages must be [B, T] or [B, 1] = {(batch_size, num_tokens)} or "
            f"{(batch_size, 1)}, got shape {tuple(advantages.shape)}"
        )
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"clip ranges must be >= 0, got eps_low={eps_low}, eps_high={eps_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")

    mask = _bool_mask(loss_mask, logprobs)  # [B, T]
    ratio = policy_ratio(logprobs, old_logprobs, mask)  # [B, T], 1 where masked
    # Zero masked advantages before multiplying: the gradient of r * nan with respect to r is
    # NaN even when the product is masked out afterwards, and no backward step should make
    # one (anomaly detection would flag it; a later change to the ratio path could leak it).
    adv = advantages.expand_as(logprobs)  # [B, T]
    adv = torch.where(mask, adv, torch.zeros_like(adv))

    unclipped_loss = -ratio * adv  # [B, T]
    clipped_loss = -ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv  # [B, T]
    loss = torch.maximum(unclipped_loss, clipped_loss)  # = -min(r A, clip(r) A)
    clipped = clipped_loss > unclipped_loss
    if dual_clip is not None:
        dual_loss = -adv * dual_clip  # [B, T]
        dual_active = (adv < 0) & (dual_loss < loss)
        loss = torch.where(dual_active, dual_loss, loss)
        clipped = clipped | dual_active

    return PolicyLossOutput(
        per_token_loss=torch.where(mask, loss, torch.zeros_like(loss)),
        clipped=clipped & mask,
        ratio=ratio,
    )


def token_mean(
    per_token_loss: Tensor,
    loss_mask: Tensor,
    num_tokens: float | Tensor | None = None,
) -> Tensor:
    """Token-mean loss: sum over valid tokens divided by ``num_tokens``.

    The DAPO reduction (Yu et al. 2025, arXiv:2503.14476, Sec. 3.3): every sampled token
    weighs the same, however long its sequence. ``num_tokens`` defaults to this batch's
    valid-token count. Under gradient accumulation pass the GLOBAL count (valid tokens over
    all micro-batches of the step): summing the micro-batch losses then gives exactly the
    one-batch gradient, where per-micro-batch means would not (ALGORITHMS.md, "Loss
    aggregation"). A count of 0 gives a loss of 0 whose gradient is defined (all zeros).
    """
    mask = _bool_mask(loss_mask, per_token_loss)
    total = masked_sum(per_token_loss, mask)
    if num_tokens is None:
        count = mask.sum().to(total.dtype)
    elif isinstance(num_tokens, Tensor):
        count = num_tokens.to(dtype=total.dtype, device=total.device)
    else:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        count = torch.tensor(num_tokens, dtype=total.dtype, device=total.device)
    has_tokens = count > 0
    safe_count = torch.where(has_tokens, count, torch.ones_like(count))
    return torch.where(has_tokens, total / safe_count, torch.zeros_like(total))


def clip_fraction(out: PolicyLossOutput, loss_mask: Tensor) -> Tensor:
    """Fraction of valid tokens whose clip was active (0-dim float tensor; 0 if none).

    A rising clip fraction means the policy is moving far from the sampler within a step;
    the "Echo Trap" monitors watch it (ALGORITHMS.md, "Monitors").
    """
    return masked_mean(out.clipped.to(out.ratio.dtype), loss_mask)


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """Schulman's k3 estimate of KL(pi || pi_ref) per token: exp(d) - 1 - d, d = ref - logp.

    Unbiased, non-negative and low-variance (ALGORITHMS.md, "KL to a reference policy").
    Exactly 0 where ``loss_mask`` is False; masking uses torch.where, so inf/NaN there
    cannot leak into the value or the gradient.
    """
    mask = loss_mask.bool()
    d = torch.where(mask, ref_logprobs, 0.0) - torch.where(mask, logprobs, 0.0)
    return torch.where(mask, torch.exp(d) - 1.0 - d, 0.0)
