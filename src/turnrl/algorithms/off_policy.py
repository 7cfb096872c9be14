"""Off-policy correction for sampler/learner mismatch and stale (asynchronous) rollouts.

The sampler (e.g. vLLM) and the learner compute different probabilities for the same tokens
(kernels, precision, a policy version or more of lag). PPO's ratio is taken against the
learner's ``old_logprobs``; these functions correct for the tokens having been drawn from
the sampler, with per-token probabilities ``sampler_logprobs`` (docs/algorithms.md, "Off-policy
correction"). rho = pi_learner_old / pi_sampler throughout.

- ``token_tis_weights``: truncated importance sampling per token, min(rho_t, C);
- ``sequence_tis_weights``: min(prod_t rho_t, C) per sequence;
- ``sequence_ratio_mask``: drop sequences whose prod_t rho_t falls outside a bound;
- ``token_mis_weights``, ``sequence_mis_weights``: masked importance sampling, the weight
  rho inside a ratio band and 0 outside (the token or sequence is dropped, not truncated);
- ``icepop_weights``: IcePop's two-sided token mask, token MIS with its band [0.5, 5];
- ``geometric_sequence_mask``: drop sequences whose geometric-mean ratio leaves a band;
- ``decoupled_policy_loss``: AReaL's decoupled PPO objective;
- ``policy_lag_metrics``: how stale the trajectories of a batch are.

Weights are detached (they re-weight the gradient, they are not optimised) and each function
also returns the metrics to log as 0-dim tensors. A metric's name says how the learner folds
it over micro-batches (``trainer.learner.fold_off_policy``): ``_max`` / ``_min`` are extremes,
a ``seq_`` mean is over sequences with a sampled token, any other mean is over sampled
tokens. The masks report their masked share by reason: ``_high`` (the ratio above the band)
and ``_low`` (below it). Not here: producing the log-probs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from turnrl.algorithms.losses import PolicyLossOutput, clipped_policy_loss
from turnrl.algorithms.reductions import _bool_mask, masked_mean, masked_sum

__all__ = [
    "ImportanceWeights",
    "MaskedWeights",
    "SequenceMask",
    "decoupled_policy_loss",
    "geometric_sequence_mask",
    "icepop_weights",
    "policy_lag_metrics",
    "sequence_mis_weights",
    "sequence_ratio_mask",
    "sequence_tis_weights",
    "token_mis_weights",
    "token_tis_weights",
]

# Bound on a token log-ratio before exponentiating, as for the PPO ratio.
_MAX_LOG_RATIO = 20.0


@dataclass(frozen=True, eq=False)
class ImportanceWeights:
    """Detached importance weights and the metrics to log."""

    weights: Tensor
    """``[B, T]`` per token or ``[B, 1]`` per sequence; 1.0 where nothing is sampled.
    Multiply a per-token loss by it (broadcast) before reducing."""
    metrics: dict[str, Tensor]
    """0-dim detached tensors, keyed by metric name."""


@dataclass(frozen=True, eq=False)
class SequenceMask:
    """Which sequences survive ``sequence_ratio_mask``, and the metrics to log."""

    keep: Tensor
    """``[B]`` bool; combine as ``loss_mask & keep[:, None]``."""
    metrics: dict[str, Tensor]
    """0-dim detached tensors, keyed by metric name."""


@dataclass(frozen=True, eq=False)
class MaskedWeights:
    """Detached masked importance weights, which tokens survive, and the metrics to log."""

    weights: Tensor
    """``[B, T]`` per token or ``[B, 1]`` per sequence: the ratio where it lies inside the
    band, 0 where it was masked, 1.0 where nothing is sampled. Multiply a per-token loss by
    it (broadcast) before reducing."""
    keep: Tensor
    """``[B, T]`` bool: the sampled tokens that survive; combine as ``loss_mask & keep``."""
    metrics: dict[str, Tensor]
    """0-dim detached tensors, keyed by metric name."""


def _token_log_rho(old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> Tensor:
    """log(pi_learner_old / pi_sampler) per token, detached, 0 where masked."""
    if old_logprobs.ndim != 2 or not (old_logprobs.shape == sampler_logprobs.shape == mask.shape):
        raise ValueError(
            "old_logprobs, sampler_logprobs and loss_mask must share one [B, T] shape, got "
            f"{tuple(old_logprobs.shape)}, {tuple(sampler_logprobs.shape)}, {tuple(mask.shape)}"
        )
    old = torch.where(mask, old_logprobs.detach(), 0.0)
    sampler = torch.where(mask, sampler_logprobs.detach(), 0.0)
    return old - sampler


def _mismatch_metrics(log_rho: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """KL(sampler || learner) estimates over the sampled tokens (samples come from the
    sampler, so with d = log rho, k1 = -d and k3 = exp(d) - 1 - d are unbiased)."""
    d = log_rho.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return {
        "mismatch_kl_k1": masked_mean(-d, mask),
        "mismatch_kl_k3": masked_mean(torch.expm1(d) - d, mask),
    }


def _masked_extreme(x: Tensor, mask: Tensor, largest: bool) -> Tensor:
    """Max (or min) of x over the mask; 0 if the mask is empty."""
    fill = -torch.inf if largest else torch.inf
    kept = torch.where(mask, x, fill)
    value = kept.amax() if largest else kept.amin()
    return torch.where(mask.any(), value, torch.zeros_like(value))


def token_tis_weights(
    old_logprobs: Tensor,
    sampler_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    cap: float | None = 2.0,
) -> ImportanceWeights:
    """Token-level truncated importance sampling, ``[B, T]`` -> weights ``[B, T]``.

    w_t = min(rho_t, C), rho_t = exp(old_logprobs - sampler_logprobs), C = ``cap`` (2 by
    default, docs/algorithms.md; ``None`` = no truncation). Only the upper side is truncated: a
    token the sampler over-weighted (rho < 1) keeps its small weight (Yao et al. 2025, "Your
    efficient RL framework secretly brings you off-policy RL training"). Masked positions
    get 1. Metrics: ``tis_ratio_mean/max/min`` of rho over sampled tokens,
    ``tis_truncated_fraction`` (rho > C), ``mismatch_kl_k1/k3``.
    """
    mask = _bool_mask(loss_mask, loss_mask)
    log_rho = _token_log_rho(old_logprobs, sampler_logprobs, mask)
    rho = torch.exp(log_rho.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))  # [B, T], 1 where masked
    if cap is None:
        weights, truncated = rho, torch.zeros_like(mask)
    else:
        if cap <= 0:
            raise ValueError(f"cap must be > 0, got {cap}")
        weights, truncated = rho.clamp(max=cap), mask & (rho > cap)
    metrics = {
        "tis_ratio_mean": masked_mean(rho, mask),
        "tis_ratio_max": _masked_extreme(rho, mask, largest=True),
        "tis_ratio_min": _masked_extreme(rho, mask, largest=False),
        "tis_truncated_fraction": masked_mean(truncated.to(rho.dtype), mask),
        **_mismatch_metrics(log_rho, mask),
    }
    return ImportanceWeights(weights=torch.where(mask, weights, 1.0), metrics=metrics)


def _sequence_log_rho(
    old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sequence log prod_t rho_t ``[B]``, token log-rho ``[B, T]``, has-tokens ``[B]``."""
    log_rho = _token_log_rho(old_logprobs, sampler_logprobs, mask)
    return masked_sum(log_rho, mask, dim=1), log_rho, mask.any(dim=1)


def sequence_tis_weights(
    old_logprobs: Tensor,
    sampler_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    cap: float = 2.0,
) -> ImportanceWeights:
    """Sequence-level truncated importance sampling, ``[B, T]`` -> weights ``[B, 1]``.

    w_i = min(prod_t rho_{i,t}, C), computed in log space as exp(min(sum_t log rho, log C))
    so a long sequence cannot overflow. Every token of sequence i gets the same weight: the
    unbiased correction for a sequence-level objective, with higher variance than per-token
    weights. Metrics: ``seq_tis_log_ratio_mean/max/min`` (log prod rho over sequences with
    sampled tokens), ``seq_tis_truncated_fraction``, ``mismatch_kl_k1/k3``.
    """
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    mask = _bool_mask(loss_mask, loss_mask)
    seq_log_rho, log_rho, has_tokens = _sequence_log_rho(old_logprobs, sampler_logprobs, mask)
    weights = torch.exp(seq_log_rho.clamp(max=math.log(cap)))  # [B], 1 for empty rows
    truncated = has_tokens & (seq_log_rho > math.log(cap))
    metrics = {
        "seq_tis_log_ratio_mean": masked_mean(seq_log_rho, has_tokens),
        "seq_tis_log_ratio_max": _masked_extreme(seq_log_rho, has_tokens, largest=True),
        "seq_tis_log_ratio_min": _masked_extreme(seq_log_rho, has_tokens, largest=False),
        "seq_tis_truncated_fraction": masked_mean(truncated.to(weights.dtype), has_tokens),
        **_mismatch_metrics(log_rho, mask),
    }
    return ImportanceWeights(weights=weights[:, None], metrics=metrics)


def sequence_ratio_mask(
    old_logprobs: Tensor,
    sampler_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    max_ratio: float = 2.0,
    min_ratio: float | None = None,
) -> SequenceMask:
    """Sequence masking: keep a sequence only if prod_t rho_t <= ``max_ratio`` (``[B]``).

    docs/algorithms.md: drop sequences with rho > C instead of down-weighting them, so a badly
    mismatched sequence contributes nothing rather than a truncated, biased gradient. ``min_ratio`` (default none) also drops sequences with rho < min_ratio.
    Sequences without sampled tokens are kept (they contribute nothing anyway). Metrics:
    ``seq_mask_masked_fraction`` over sequences with sampled tokens, ``mismatch_kl_k1/k3``.
    """
    if max_ratio <= 0 or (min_ratio is not None and not 0 < min_ratio <= max_ratio):
        raise ValueError(f"need 0 < min_ratio <= max_ratio, got {min_ratio} and {max_ratio}")
    mask = _bool_mask(loss_mask, loss_mask)
    seq_log_rho, log_rho, has_tokens = _sequence_log_rho(old_logprobs, sampler_logprobs, mask)
    keep = seq_log_rho <= math.log(max_ratio)
    if min_ratio is not None:
        keep = keep & (seq_log_rho >= math.log(min_ratio))
    keep = keep | ~has_tokens
    metrics = {
        "seq_mask_masked_fraction": masked_mean((~keep).to(seq_log_rho.dtype), has_tokens),
        **_mismatch_metrics(log_rho, mask),
    }
    return SequenceMask(keep=keep, metrics=metrics)


def _check_band(min_ratio: float | None, max_ratio: float) -> None:
    if max_ratio <= 0 or (min_ratio is not None and not 0 < min_ratio <= max_ratio):
        raise ValueError(f"need 0 < min_ratio <= max_ratio, got {min_ratio} and {max_ratio}")


def _outside_band(
    log_ratio: Tensor, min_ratio: float | None, max_ratio: float
) -> tuple[Tensor, Tensor]:
    """(above the band, below it), compared in log space so that a ratio too large to
    exponentiate is still compared exactly."""
    high = log_ratio > math.log(max_ratio)
    low = log_ratio < math.log(min_ratio) if min_ratio is not None else torch.zeros_like(high)
    return high, low


def _token_band_weights(
    old_logprobs: Tensor,
    sampler_logprobs: Tensor,
    loss_mask: Tensor,
    min_ratio: float | None,
    max_ratio: float,
    prefix: str,
) -> MaskedWeights:
    """Token MIS with the metrics under ``prefix`` (``token_mis_weights``)."""
    _check_band(min_ratio, max_ratio)
    mask = _bool_mask(loss_mask, loss_mask)
    log_rho = _token_log_rho(old_logprobs, sampler_logprobs, mask)  # [B, T], 0 where masked
    rho = torch.exp(log_rho.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    high, low = _outside_band(log_rho, min_ratio, max_ratio)
    high, low = high & mask, low & mask
    keep = mask & ~high & ~low
    dtype = rho.dtype
    metrics = {
        f"{prefix}_ratio_mean": masked_mean(rho, mask),
        f"{prefix}_ratio_max": _masked_extreme(rho, mask, largest=True),
        f"{prefix}_ratio_min": _masked_extreme(rho, mask, largest=False),
        f"{prefix}_masked_fraction": masked_mean((high | low).to(dtype), mask),
        f"{prefix}_masked_high_fraction": masked_mean(high.to(dtype), mask),
        f"{prefix}_masked_low_fraction": masked_mean(low.to(dtype), mask),
        **_mismatch_metrics(log_rho, mask),
    }
    weights = torch.where(keep, rho, torch.where(mask, 0.0, 1.0))
    return MaskedWeights(weights=weights, keep=keep, metrics=metrics)


def token_mis_weights(
    old_logprobs: Tensor,
    sampler_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    max_ratio: float = 2.0,
    min_ratio: float | None = None,
) -> MaskedWeights:
    """Token-level masked importance sampling (MIS), ``[B, T]`` -> weights ``[B, T]``.

        w_t = rho_t * 1[min_ratio <= rho_t <= max_ratio],  rho_t = pi_learner_old / pi_sampler

    Where TIS truncates a token the sampler under-weighted (rho > C) to C, MIS drops it: its
    gradient is far from the learner's and a truncated one is still biased, so it contributes
    nothing (Liu, Li et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from
    the Training-Inference Mismatch", the token-level "MIS"; TRL's ``token_mask``). Inside the
    band the weight is the full ratio. ``min_ratio`` None: one-sided, rho <= C only. A
    dropped token keeps its place in the loss's normaliser (its loss is 0), so the kept
    tokens' scale does not depend on how many were dropped. Masked positions get 1.

    Metrics: ``mis_ratio_mean/max/min`` of rho over sampled tokens, ``mis_masked_fraction``
    (the share of sampled tokens dropped), ``mis_masked_high_fraction`` (rho > max_ratio),
    ``mis_masked_low_fraction`` (rho < min_ratio), ``mismatch_kl_k1/k3``.
    """
    return _token_band_weights(
        old_logprobs, sampler_logprobs, loss_mask, min_ratio, max_ratio, prefix="mis"
    )


def icepop_weights(
    old_logprobs: Tensor,
    sampler_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    min_ratio: float | None = 0.5,
    max_ratio: float = 5.0,
) -> MaskedWeights:
    """IcePop: two-sided token masking of the training/inference mismatch, ``[B, T]``.

        w_t = M(rho_t),  M(k) = k if alpha <= k <= beta else 0,  rho_t = pi_train / pi_infer

    with alpha = 0.5 and beta = 5 (Ling Team 2025, "Every Step Evolves: Scaling Reinforcement
    Learning for Trillion-Scale Thinking Model", Ring-1T, arXiv:2510.18855, Sec. "IcePop").
    Tokens whose probability the two engines disagree on by more than the band, in either
    direction, are dropped from the gradient; the others are weighted by their ratio. It is
    token MIS (``token_mis_weights``) with a two-sided band. Metrics as there, named
    ``icepop_*``.
    """
    return _token_band_weights(
        old_logprobs, sampler_logprobs, loss_mask, min_ratio, max_ratio, prefix="icepop"
    )


def _sequence_band(
    seq_log_ratio: Tensor,
    has_tokens: Tensor,
    mask: Tensor,
    min_ratio: float | None,
    max_ratio: float,
    prefix: str,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Which sequences keep (``[B]``; empty ones do) and the masked shares by reason."""
    _check_band(min_ratio, max_ratio)
    high, low = _outside_band(seq_log_ratio, min_ratio, max_ratio)
    high, low = high & has_tokens, low & has_tokens
    keep = ~high & ~low
    dtype = seq_log_ratio.dtype
    metrics = {
        f"seq_{prefix}_masked_fraction": masked_mean((high | low).to(dtype), has_tokens),
        f"seq_{prefix}_masked_high_fraction": masked_mean(high.to(dtype), has_tokens),
        f"seq_{prefix}_masked_low_fraction": masked_mean(low.to(dtype), has_tokens),
        # The share of sampled tokens the dropped sequences held: a mean over tokens.
        "masked_token_fraction": masked_mean((~keep[:, None]).expand_as(mask).to(dtype), mask),
    }
    return keep, metrics


def sequence_mis_weights(
    old_logprobs: Tensor,
    sampler_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    max_ratio: float = 2.0,
    min_ratio: float | None = None,
) -> MaskedWeights:
    """Sequence-level masked importance sampling, ``[B, T]`` -> weights ``[B, 1]``.

        w_i = rho_i * 1[min_ratio <= rho_i <= max_ratio],  rho_i = prod_t rho_{i,t}

    The unbiased sequence-level weight where it is trustworthy, and the whole sequence
    dropped where it is not (Liu, Li et al. 2025, "When Speed Kills Stability", "Seq-MIS"):
    rejection instead of TIS's truncation, which keeps a biased gradient from the
    sequences whose mismatch is largest. The band is compared in log space (sum_t log
    rho_t), so a long sequence cannot overflow. ``min_ratio`` None: one-sided. Sequences
    without sampled tokens are kept (they contribute nothing).

    Metrics: ``seq_mis_log_ratio_mean/max/min`` (log rho_i over sequences with sampled
    tokens), ``seq_mis_masked_fraction`` (the share of those sequences dropped),
    ``seq_mis_masked_high_fraction`` / ``seq_mis_masked_low_fraction`` (by reason),
    ``masked_token_fraction`` (the share of sampled tokens they held), ``mismatch_kl_k1/k3``.
    """
    mask = _bool_mask(loss_mask, loss_mask)
    seq_log_rho, log_rho, has_tokens = _sequence_log_rho(old_logprobs, sampler_logprobs, mask)
    keep, metrics = _sequence_band(seq_log_rho, has_tokens, mask, min_ratio, max_ratio, "mis")
    rho = torch.exp(seq_log_rho.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))  # [B], 1 if empty
    weights = torch.where(keep, rho, 0.0)
    metrics = {
        "seq_mis_log_ratio_mean": masked_mean(seq_log_rho, has_tokens),
        "seq_mis_log_ratio_max": _masked_extreme(seq_log_rho, has_tokens, largest=True),
        "seq_mis_log_ratio_min": _masked_extreme(seq_log_rho, has_tokens, largest=False),
        **metrics,
        **_mismatch_metrics(log_rho, mask),
    }
    return MaskedWeights(weights=weights[:, None], keep=mask & keep[:, None], metrics=metrics)


def geometric_sequence_mask(
    old_logprobs: Tensor,
    sampler_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    min_ratio: float | None = 0.999,
    max_ratio: float = 1.001,
) -> SequenceMask:
    """Geometric-mean sequence rejection: keep sequence i only if its per-token geometric
    mean ratio lies in the band, ``[B, T]`` -> keep ``[B]``.

        g_i = exp(mean_t log rho_{i,t}),  keep_i = min_ratio <= g_i <= max_ratio

    The product of token ratios grows with the length, so a band on it rejects long
    sequences for being long; the geometric mean is length-normalised, and a tight band
    around 1 (0.999 / 1.001, +-0.1% per token) rejects the sequences whose tokens drift
    systematically (Liu, Li et al. 2025, "When Speed Kills Stability", part 3, "Geo-RS").
    A mask only: the kept sequences are not re-weighted. Sequences without sampled tokens
    are kept. ``min_ratio`` None: one-sided.

    Metrics: ``seq_geo_log_ratio_mean/max/min`` (log g_i over sequences with sampled
    tokens), ``seq_geo_masked_fraction``, ``seq_geo_masked_high_fraction`` /
    ``seq_geo_masked_low_fraction`` (by reason), ``masked_token_fraction``,
    ``mismatch_kl_k1/k3``.
    """
    mask = _bool_mask(loss_mask, loss_mask)
    log_rho = _token_log_rho(old_logprobs, sampler_logprobs, mask)
    has_tokens = mask.any(dim=1)
    mean_log_rho = masked_mean(log_rho, mask, dim=1)  # [B], 0 if empty
    keep, metrics = _sequence_band(mean_log_rho, has_tokens, mask, min_ratio, max_ratio, "geo")
    metrics = {
        "seq_geo_log_ratio_mean": masked_mean(mean_log_rho, has_tokens),
        "seq_geo_log_ratio_max": _masked_extreme(mean_log_rho, has_tokens, largest=True),
        "seq_geo_log_ratio_min": _masked_extreme(mean_log_rho, has_tokens, largest=False),
        **metrics,
        **_mismatch_metrics(log_rho, mask),
    }
    return SequenceMask(keep=keep, metrics=metrics)


def decoupled_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    sampler_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    max_weight: float | None = None,
    dual_clip: float | None = None,
) -> PolicyLossOutput:
    """Decoupled PPO (AReaL, Fu et al. 2025, arXiv:2505.24298, eq. 5), per token ``[B, T]``.

        loss_t = -(pi_prox / pi_behav) * min(u A, clip(u, 1 - eps_low, 1 + eps_high) A),
        u = pi_theta / pi_prox,
    with pi_behav = the sampler that generated the tokens (``sampler_logprobs``, possibly
    several versions stale) and pi_prox = the recent anchor the trust region is taken
    around (``old_logprobs``, recomputed by the learner). The clip then bounds the update
    relative to pi_prox, not to the stale sampler, and the detached weight pi_prox /
    pi_behav corrects for where the tokens came from. ``max_weight`` truncates that weight
    (None: not truncated; AReaL leaves it optional); ``dual_clip`` is
    ``clipped_policy_loss``'s. ``ratio`` and ``clipped`` are u's.
    """
    out = clipped_policy_loss(
        logprobs, old_logprobs, advantages, loss_mask, eps_low=eps_low, eps_high=eps_high,
        dual_clip=dual_clip,
    )  # fmt: skip
    weights = token_tis_weights(old_logprobs, sampler_logprobs, loss_mask, cap=max_weight)
    mask = _bool_mask(loss_mask, logprobs)
    weighted = torch.where(mask, out.per_token_loss * weights.weights, 0.0)
    return PolicyLossOutput(per_token_loss=weighted, clipped=out.clipped, ratio=out.ratio)


def policy_lag_metrics(sampler_versions: Tensor, learner_version: int) -> dict[str, Tensor]:
    """How many policy versions behind the learner each trajectory was sampled, ``[B]``.

    Every trajectory carries the version of the policy that sampled it (docs/algorithms.md);
    ``lag = learner_version - sampler_version``. Returns ``policy_lag_mean`` and
    ``policy_lag_max`` (0 for an empty batch). A negative lag means versions were mixed up
    and raises.
    """
    if sampler_versions.ndim != 1:
        raise ValueError(f"sampler_versions must be [B], got {tuple(sampler_versions.shape)}")
    lag = (learner_version - sampler_versions).to(torch.get_default_dtype())
    if sampler_versions.numel() == 0:
        zero = torch.zeros((), dtype=lag.dtype, device=lag.device)
        return {"policy_lag_mean": zero, "policy_lag_max": zero}
    if bool((lag < 0).any()):
        raise ValueError("a trajectory was sampled by a newer policy than the learner's")
    return {"policy_lag_mean": lag.mean(), "policy_lag_max": lag.amax()}
