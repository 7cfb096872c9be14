"""Per-token losses: PPO clip (decoupled, dual clip), GSPO, CISPO, GMPO, SAPO, clipped value
loss, entropy.

Pure tensor functions over ``[B, T]`` tokens. Every function takes a ``loss_mask`` (true on
policy-sampled tokens; false on prompt, tool output and padding) and masks with
``torch.where``, never by multiplying: ``0 * inf`` and ``0 * nan`` are NaN, so a multiplied
mask lets a bad value in a masked slot leak into the loss or its gradient. Inputs are
sanitised with ``where`` before any arithmetic that could turn a masked value into a NaN
gradient (the "double where"), and results are masked again at the end. Definitions and
test vectors: docs/algorithms.md, "Policy losses".

Not here: the reductions that turn per-token losses into one number (``reductions``), KL
estimators (``kl``) and off-policy weights (``off_policy``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from turnrl.algorithms.reductions import _bool_mask, masked_mean

__all__ = [
    "PolicyLossOutput",
    "ValueLossOutput",
    "cispo_policy_loss",
    "clip_fraction",
    "clipped_policy_loss",
    "clipped_value_loss",
    "entropy_from_logits",
    "gmpo_policy_loss",
    "gspo_policy_loss",
    "policy_ratio",
    "sapo_policy_loss",
    "sequence_ratio",
]

# Bound on |log pi - log pi_old| before exponentiating: exp(20) ~ 5e8 is already far past
# any clip range, and the bound keeps the ratio finite (docs/algorithms.md, "PPO clip").
_MAX_LOG_RATIO = 20.0


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


def clip_fraction(out: PolicyLossOutput | ValueLossOutput, loss_mask: Tensor) -> Tensor:
    """Fraction of valid tokens whose clip was active (0-dim float tensor; 0 if none).

    A rising clip fraction means the policy is moving far from the sampler within a step;
    the "Echo Trap" monitors watch it (docs/algorithms.md, "Monitors"). Works for the value
    loss's clip too.
    """
    return masked_mean(out.clipped.to(out.per_token_loss.dtype), loss_mask)


def sequence_ratio(logprobs: Tensor, old_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """GSPO's sequence importance ratio, ``[B, T] -> [B]``.

    s_i = exp(mean over the sampled tokens of log(pi_theta / pi_old)): the geometric mean
    of the token ratios, so its scale does not depend on the length (GSPO, Zheng et al.
    2025, arXiv:2507.18071, eq. 7). The mean log-ratio is clamped to [-20, 20] like the
    token ratio. A sequence with no sampled token has ratio 1.
    """
    mask = _bool_mask(loss_mask, logprobs)
    log_ratio = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))
    mean_log_ratio = masked_mean(log_ratio, mask, dim=1)  # [B]
    return torch.exp(mean_log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))


def gspo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> PolicyLossOutput:
    """GSPO: the clipped surrogate on one ratio per sequence, spread over its tokens.

    ``logprobs``, ``old_logprobs`` and ``loss_mask`` are ``[B, T]``; ``advantages`` is
    ``[B, 1]`` (one per sequence). GSPO (Zheng et al. 2025, arXiv:2507.18071, eq. 5) clips
    the sequence ratio ``s_i`` (``sequence_ratio``) instead of each token's:
        loss_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i),
    with ranges of order 1e-4 (3e-4 / 4e-4 in the paper) because s_i is a geometric mean.

    The returned ``per_token_loss`` holds loss_i on every sampled token of sequence i, so
    ``seq_mean_token_mean`` gives GSPO's objective (the mean of loss_i over sequences)
    exactly, value and gradient; other reductions weight sequences by their length.
    ``clipped`` and ``ratio`` hold the sequence's flag and s_i on its sampled tokens
    (False and 1.0 elsewhere).
    """
    if logprobs.ndim != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    if old_logprobs.shape != logprobs.shape or loss_mask.shape != logprobs.shape:
        raise ValueError(
            "logprobs, old_logprobs and loss_mask must share one [B, T] shape, got "
            f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(loss_mask.shape)}"
        )
    batch_size = logprobs.shape[0]
    if advantages.shape != (batch_size, 1):
        raise ValueError(
            f"advantages must be [B, 1] = {(batch_size, 1)} (one per sequence), got shape "
            f"{tuple(advantages.shape)}"
        )
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"clip ranges must be >= 0, got eps_low={eps_low}, eps_high={eps_high}")

    mask = _bool_mask(loss_mask, logprobs)  # [B, T]
    has_tokens = mask.any(dim=1)  # [B]
    seq_ratio = sequence_ratio(logprobs, old_logprobs, mask)  # [B]
    adv = torch.where(has_tokens, advantages[:, 0], torch.zeros_like(advantages[:, 0]))  # [B]

    unclipped_loss = -seq_ratio * adv  # [B]
    clipped_loss = -seq_ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv  # [B]
    loss = torch.maximum(unclipped_loss, clipped_loss)  # = -min(s A, clip(s) A)
    clipped = clipped_loss > unclipped_loss  # [B]

    return PolicyLossOutput(
        per_token_loss=torch.where(mask, loss[:, None], torch.zeros_like(logprobs)),
        clipped=clipped[:, None] & mask,
        ratio=torch.where(mask, seq_ratio[:, None], torch.ones_like(logprobs)),
    )


def _check_policy_inputs(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    per_token: bool,
) -> None:
    """Shapes: ``[B, T]`` log-probs and mask; advantages ``[B, T]`` or ``[B, 1]``
    (``per_token``), else ``[B, 1]`` only."""
    if logprobs.ndim != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    if old_logprobs.shape != logprobs.shape or loss_mask.shape != logprobs.shape:
        raise ValueError(
            "logprobs, old_logprobs and loss_mask must share one [B, T] shape, got "
            f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(loss_mask.shape)}"
        )
    batch_size, num_tokens = logprobs.shape
    allowed = {(batch_size, 1), (batch_size, num_tokens)} if per_token else {(batch_size, 1)}
    if advantages.shape not in allowed:
        raise ValueError(
            f"advantages must be one of {sorted(allowed)}, got shape {tuple(advantages.shape)}"
        )


def cispo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    eps_low: float | None = None,
    eps_high: float = 0.28,
) -> PolicyLossOutput:
    """CISPO: REINFORCE weighted by the clipped, detached importance ratio, per token.

    ``logprobs``, ``old_logprobs`` and ``loss_mask`` are ``[B, T]``; ``advantages`` is
    ``[B, T]`` or ``[B, 1]``. MiniMax-M1 (MiniMax 2025, arXiv:2506.13585, eq. 4), as a loss:
        loss_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_t * log pi_theta(o_t),
    sg = stop-gradient. PPO's clip zeroes the gradient of a token whose ratio left the range
    (often a rare, decisive token such as "However" or "Wait", after the first update);
    CISPO bounds the token's *weight* instead and always keeps its gradient,
    -clip(r) A grad log pi. The paper sets no lower bound (``eps_low`` None) and tunes only
    ``eps_high``. The value is the paper's objective (it includes log pi, so it is not a
    surrogate of the return; its gradient is). ``clipped`` marks the tokens whose weight was
    bounded (they still get a gradient); ``ratio`` is r.
    """
    _check_policy_inputs(logprobs, old_logprobs, advantages, loss_mask, per_token=True)
    if (eps_low is not None and eps_low < 0) or eps_high < 0:
        raise ValueError(f"clip ranges must be >= 0, got eps_low={eps_low}, eps_high={eps_high}")
    mask = _bool_mask(loss_mask, logprobs)
    ratio = policy_ratio(logprobs, old_logprobs, mask)  # [B, T], 1 where masked
    low = 1.0 - eps_low if eps_low is not None else None
    weight = ratio.detach().clamp(min=low, max=1.0 + eps_high)  # [B, T]
    adv = torch.where(mask, advantages.expand_as(logprobs), 0.0)
    safe_logprobs = torch.where(mask, logprobs, 0.0)
    loss = -weight * adv * safe_logprobs
    return PolicyLossOutput(
        per_token_loss=torch.where(mask, loss, 0.0),
        clipped=(weight != ratio.detach()) & mask,
        ratio=ratio,
    )


def gmpo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    eps_low: float = 0.4,
    eps_high: float = 0.4,
) -> PolicyLossOutput:
    """GMPO: the clipped objective on the geometric mean of the token ratios, per sequence.

    ``logprobs``, ``old_logprobs`` and ``loss_mask`` are ``[B, T]``; ``advantages`` is
    ``[B, 1]`` (one per sequence). Geometric-Mean Policy Optimization (Zhao et al. 2025,
    arXiv:2507.20673, eq. 4), as a loss:
        loss_i = -A_i * exp(mean_t sgn(A_i) min(sgn(A_i) log r_t,
                                                sgn(A_i) clip(log r_t, -eps_low, eps_high))).
    GRPO maximises the arithmetic mean of the token terms r_t A, which one token with an
    extreme ratio can dominate; the geometric mean is far less sensitive to it, which lets
    GMPO clip each token's ratio in a wider range, (e^-0.4, e^0.4) in the paper, instead of
    (0.8, 1.2). The clip and the min act token by token on log r, in the pessimistic
    direction of the sign of A, as PPO's min does.

    The returned ``per_token_loss`` holds loss_i on every sampled token of sequence i, so
    ``seq_mean_token_mean`` gives GMPO's objective (the mean of loss_i over sequences)
    exactly, value and gradient. ``clipped`` marks the tokens whose clipped log-ratio was
    chosen (they get no gradient); ``ratio`` holds the sequence's geometric-mean ratio on its
    sampled tokens (1.0 elsewhere).
    """
    _check_policy_inputs(logprobs, old_logprobs, advantages, loss_mask, per_token=False)
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"clip ranges must be >= 0, got eps_low={eps_low}, eps_high={eps_high}")
    mask = _bool_mask(loss_mask, logprobs)  # [B, T]
    has_tokens = mask.any(dim=1)  # [B]
    adv = torch.where(has_tokens, advantages[:, 0], 0.0)  # [B]
    sign = torch.sign(adv)[:, None]  # [B, 1]
    log_ratio = torch.where(mask, logprobs - old_logprobs, 0.0)  # [B, T]
    clipped_log_ratio = log_ratio.clamp(-eps_low, eps_high)
    chosen = sign * torch.minimum(sign * log_ratio, sign * clipped_log_ratio)  # [B, T]
    mean_log_ratio = masked_mean(chosen, mask, dim=1)  # [B]
    geo_ratio = torch.exp(mean_log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))  # [B]
    loss = -adv * geo_ratio  # [B]
    clipped = (sign * clipped_log_ratio < sign * log_ratio) & mask
    return PolicyLossOutput(
        per_token_loss=torch.where(mask, loss[:, None], 0.0),
        clipped=clipped,
        ratio=torch.where(mask, geo_ratio[:, None], 1.0),
    )


def sapo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> PolicyLossOutput:
    """SAPO: a soft, temperature-controlled gate on the token ratio instead of a hard clip.

    ``logprobs``, ``old_logprobs`` and ``loss_mask`` are ``[B, T]``; ``advantages`` is
    ``[B, T]`` or ``[B, 1]``. Soft Adaptive Policy Optimization (Gao et al. 2025, Qwen,
    arXiv:2511.20347, eqs. 5-6), as a loss:
        loss_t = -f(r_t, tau_t) A_t,  f(r, tau) = sigmoid(tau (r - 1)) * 4 / tau,
        tau_t = tau_pos if A_t > 0 else tau_neg.
    The gradient is f'(r) r grad log pi = 4 s (1 - s) r grad log pi with s = sigmoid(tau (r -
    1)): exactly the policy gradient on-policy (r = 1) and fading smoothly as r leaves 1, so
    an off-policy token is attenuated rather than cut off, and a sequence with a few such
    tokens keeps the gradient of the others. tau_neg > tau_pos makes tokens with negative
    advantages fade faster (they raise the probability of many other tokens, which
    destabilises training); the paper uses 1.0 and 1.05. No clip is active, so ``clipped``
    is all False; ``ratio`` is r.
    """
    _check_policy_inputs(logprobs, old_logprobs, advantages, loss_mask, per_token=True)
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"temperatures must be > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}")
    mask = _bool_mask(loss_mask, logprobs)
    ratio = policy_ratio(logprobs, old_logprobs, mask)  # [B, T], 1 where masked
    adv = torch.where(mask, advantages.expand_as(logprobs), 0.0)
    tau = torch.where(adv > 0, tau_pos, tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return PolicyLossOutput(
        per_token_loss=torch.where(mask, -gate * adv, 0.0),
        clipped=torch.zeros_like(mask),
        ratio=ratio,
    )


@dataclass(frozen=True, eq=False)
class ValueLossOutput:
    """What ``clipped_value_loss`` returns; both tensors are ``[B, T]``."""

    per_token_loss: Tensor
    """Loss of each token, exactly 0 at masked positions."""
    clipped: Tensor
    """Bool: the clipped error was the larger one, so the max chose it and the token gets no
    gradient. False where masked."""


def clipped_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    loss_mask: Tensor,
    *,
    clip_range: float | None,
) -> ValueLossOutput:
    """PPO's clipped value loss per token, ``[B, T]`` inputs (docs/algorithms.md, "Value loss").

        loss = 0.5 * max((V - R)^2, (clip(V, V_old - eps_v, V_old + eps_v) - R)^2)

    The critic's prediction may not move further than ``clip_range`` from the value it had
    when the rollout was scored, unless doing so reduces the error (the PPO2 baselines
    implementation; see Engstrom et al. 2020, arXiv:2005.12729, on its effect). ``returns``
    are the targets (e.g. GAE's ``returns``, which carry no gradient). ``clip_range=None``
    gives the plain 0.5 * (V - R)^2.
    """
    if values.ndim != 2 or not (values.shape == old_values.shape == returns.shape):
        raise ValueError(
            "values, old_values and returns must share one [B, T] shape, got "
            f"{tuple(values.shape)}, {tuple(old_values.shape)}, {tuple(returns.shape)}"
        )
    if loss_mask.shape != values.shape:
        raise ValueError(f"loss_mask must be {tuple(values.shape)}, got {tuple(loss_mask.shape)}")
    if clip_range is not None and clip_range < 0:
        raise ValueError(f"clip_range must be >= 0, got {clip_range}")

    mask = _bool_mask(loss_mask, values)
    zeros = torch.zeros_like(values)
    v = torch.where(mask, values, zeros)
    v_old = torch.where(mask, old_values, zeros)
    target = torch.where(mask, returns, zeros)

    unclipped_loss = 0.5 * (v - target).square()
    if clip_range is None:
        loss, clipped = unclipped_loss, torch.zeros_like(mask)
    else:
        v_clipped = v_old + (v - v_old).clamp(-clip_range, clip_range)
        clipped_loss = 0.5 * (v_clipped - target).square()
        loss = torch.maximum(unclipped_loss, clipped_loss)
        clipped = clipped_loss > unclipped_loss
    return ValueLossOutput(
        per_token_loss=torch.where(mask, loss, zeros),
        clipped=clipped & mask,
    )


def entropy_from_logits(logits: Tensor, loss_mask: Tensor | None = None) -> Tensor:
    """Entropy of softmax(logits) at each position, ``[..., V] -> [...]``.

    H = -sum_v p_v log p_v, computed from ``log_softmax`` for stability. Logits of -inf
    (a vocabulary mask) contribute exactly 0, not NaN, to the value and the gradient. With a
    ``loss_mask`` of shape ``logits.shape[:-1]``, masked positions give exactly 0 with 0
    gradient whatever their logits hold, so the entropy bonus covers sampled tokens only
    (docs/algorithms.md, "Entropy bonus"); reduce it like a loss (e.g. ``token_mean``) and
    subtract coef * that from the loss. Divide the logits by the sampling temperature first
    if the entropy should be that of the sampler.
    """
    if loss_mask is not None:
        if loss_mask.shape != logits.shape[:-1]:
            raise ValueError(
                f"loss_mask must be logits.shape[:-1] = {tuple(logits.shape[:-1])}, got "
                f"{tuple(loss_mask.shape)}"
            )
        valid = _bool_mask(loss_mask, loss_mask)
        logits = torch.where(valid[..., None], logits, torch.zeros_like(logits))
    logp = torch.log_softmax(logits, dim=-1)  # [..., V]
    p = logp.exp()
    # p * log p is 0 at p = 0, but 0 * -inf is NaN and so is its gradient: sanitise first.
    positive = p > 0
    safe_logp = torch.where(positive, logp, torch.zeros_like(logp))
    entropy = -torch.where(positive, p * safe_logp, torch.zeros_like(p)).sum(dim=-1)
    if loss_mask is None:
        return entropy
    return torch.where(valid, entropy, torch.zeros_like(entropy))
