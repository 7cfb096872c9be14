"""Sample selection and length shaping as pure functions (docs/algorithms.md, "Sample
selection and shaping").

Each function answers one question about a batch (which groups to keep, how much to
penalise a length, which tokens still count); acting on the answer (resampling, dropping
rows) is the rollout's or trainer's job. Not here: the DAPO loop that keeps sampling until
the batch is full, which is effectful.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from turnrl.algorithms.advantages import group_reward_std, zero_variance_groups
from turnrl.algorithms.reductions import _bool_mask

__all__ = [
    "informative_groups",
    "overlong_filter_mask",
    "overlong_penalty",
    "top_variance_groups",
]


def informative_groups(rewards: Tensor) -> Tensor:
    """DAPO dynamic sampling: the groups to keep, ``[P, G] -> [P]`` bool.

    Yu et al. 2025 (DAPO, arXiv:2503.14476, Sec. 3.2, eq. 11): a group whose rewards are all
    equal has zero group-relative advantage everywhere and contributes no gradient, only
    dilution; keep the groups with non-zero reward variance (exact inequality, as in
    ``zero_variance_groups``) and sample more prompts until the batch is full.
    """
    return ~zero_variance_groups(rewards)


def overlong_penalty(lengths: Tensor, *, max_length: int, cache_length: int) -> Tensor:
    """DAPO soft overlong punishment added to the reward, ``[B] -> [B]`` float.

    Yu et al. 2025 (DAPO, arXiv:2503.14476, Sec. 3.4, eq. 13), with L_max = ``max_length``
    and L_cache = ``cache_length``:
        0                                    if |y| <= L_max - L_cache,
        ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max,
        -1                                   if |y| > L_max.
    The penalty ramps linearly from 0 to -1 over the last ``cache_length`` tokens, so the
    policy learns to stop before truncation without a cliff in the reward.
    """
    if not 0 < cache_length <= max_length:
        raise ValueError(
            f"need 0 < cache_length <= max_length, got {cache_length} and {max_length}"
        )
    soft_limit = max_length - cache_length
    if not lengths.is_floating_point():
        lengths = lengths.to(torch.get_default_dtype())
    ramp = (soft_limit - lengths) / cache_length
    penalty = torch.where(lengths <= soft_limit, torch.zeros_like(ramp), ramp)
    return torch.where(lengths > max_length, torch.full_like(ramp, -1.0), penalty)


def overlong_filter_mask(loss_mask: Tensor, truncated: Tensor) -> Tensor:
    """DAPO overlong filtering: ``loss_mask`` with every token of truncated samples removed.

    ``loss_mask`` is ``[B, T]``, ``truncated`` ``[B]`` bool (the rollout hit its length
    limit before the episode ended, Gymnasium's ``truncated``). A truncated sample's reward
    says nothing about its answer, so its tokens are left out of the loss (Yu et al. 2025,
    Sec. 3.4). Returns a bool mask.
    """
    mask = _bool_mask(loss_mask, loss_mask)
    if mask.ndim != 2 or truncated.shape != (mask.shape[0],):
        raise ValueError(
            f"loss_mask must be [B, T] and truncated [B], got {tuple(loss_mask.shape)} and "
            f"{tuple(truncated.shape)}"
        )
    return mask & ~truncated.bool()[:, None]


def top_variance_groups(rewards: Tensor, keep_fraction: float = 0.25) -> Tensor:
    """StarPO-S variance filter: the groups to keep, ``[P, G] -> [P]`` bool.

    RAGEN (Wang et al. 2025, arXiv:2504.20073, Sec. 4): rank groups by the unbiased std of
    their raw rewards (``group_reward_std``) and keep the top ``keep_fraction`` of them
    (0.25 by default), ceil(keep_fraction * P) groups and at least one. High-variance
    groups are where the policy is uncertain and the learning signal is; dropping the rest
    delays the "Echo Trap" collapse. Ties are broken by position (earlier groups first).
    """
    if not 0.0 < keep_fraction <= 1.0:
        raise ValueError(f"keep_fraction must be in (0, 1], got {keep_fraction}")
    std = group_reward_std(rewards)  # [P]
    num_groups = std.shape[0]
    # The small slack keeps e.g. 0.3 * 10 = 3.0000000000000004 from rounding up to 4.
    num_kept = min(num_groups, max(1, math.ceil(keep_fraction * num_groups - 1e-9)))
    order = torch.sort(std, descending=True, stable=True).indices
    keep = torch.zeros(num_groups, dtype=torch.bool, device=std.device)
    keep[order[:num_kept]] = True
    return keep
