"""Advantage estimators: pure tensor functions from rewards to advantages.

Each estimator is a function named by what it returns and takes rewards laid out as
``[P, G]`` (P prompts, each with a group of G sampled trajectories). Group statistics used by
monitors (reward std, zero-variance groups) live here too, so the metrics and the estimators
agree on one definition. Definitions and test vectors: ALGORITHMS.md, "Advantages".

Not here: token-level estimators that need values or per-token rewards (GAE, REINFORCE++,
GiGPO); they are further functions of this module with their own signatures.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "group_reward_std",
    "grpo_advantages",
    "rloo_advantages",
    "zero_variance_groups",
]


def _as_groups(rewards: Tensor) -> Tensor:
    """Check the ``[P, G]`` layout and return rewards as a floating tensor."""
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [P, G], got shape {tuple(rewards.shape)}")
    if rewards.shape[1] < 1:
        raise ValueError("rewards must have a group size G >= 1")
    return rewards if rewards.is_floating_point() else rewards.to(torch.get_default_dtype())


def zero_variance_groups(rewards: Tensor) -> Tensor:
    """Which groups have all-equal rewards, ``[P, G] -> [P]`` bool.

    Such groups carry no learning signal under group baselines (every advantage is zero);
    DAPO's dynamic sampling drops them and the "Echo Trap" monitor watches their fraction.
    Equality is exact, so rewards that differ by rounding count as different. A group of one
    is zero-variance (its std is 0).
    """
    rewards = _as_groups(rewards)
    return (rewards == rewards[:, :1]).all(dim=1)  # [P]


def group_reward_std(rewards: Tensor) -> Tensor:
    """Unbiased (N-1) standard deviation of each group's rewards, ``[P, G] -> [P]``.

    A group of one has std 0 (rather than NaN). This is the statistic StarPO-S filters on
    and the RAGEN "Echo Trap" monitor watches: in-group std falls before reward collapses.
    """
    rewards = _as_groups(rewards)
    if rewards.shape[1] == 1:
        return torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    return rewards.std(dim=1, correction=1)  # [P]


def _centered_rewards(rewards: Tensor) -> Tensor:
    """R - mean_G R, ``[P, G]``, exactly zero in groups whose rewards are all equal.

    The mean of equal floats need not equal them bit for bit; forcing exact zeros keeps
    "equal rewards give no gradient" true and keeps std-scaling from amplifying rounding.
    """
    centered = rewards - rewards.mean(dim=1, keepdim=True)  # [P, G]
    flat = zero_variance_groups(rewards).unsqueeze(1)  # [P, 1]
    return torch.where(flat, torch.zeros_like(centered), centered)


def grpo_advantages(
    rewards: Tensor,
    *,
    eps: float = 1e-6,
    unbiased: bool = True,
    scale_by_std: bool = True,
) -> Tensor:
    """Group-relative advantages, ``[P, G] -> [P, G]``.

    GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300, Sec. 4.1.2, outcome
    supervision): A_i = (R_i - mean_G R) / (std_G R + eps), with the unbiased (N-1) std
    unless ``unbiased=False``. ``scale_by_std=False`` gives Dr. GRPO (Liu et al. 2025,
    arXiv:2503.20783): A_i = R_i - mean_G R, which removes the per-group difficulty
    weighting; pair it with a constant loss normaliser.

    A group whose rewards are all equal gets exactly zero advantages. A group of one has no
    baseline to compare against, so its advantage is its reward (plain REINFORCE), for every
    variant.
    """
    rewards = _as_groups(rewards)
    if rewards.shape[1] == 1:
        return rewards.clone()
    centered = _centered_rewards(rewards)  # [P, G]
    if not scale_by_std:
        return centered
    std = rewards.std(dim=1, keepdim=True, correction=1 if unbiased else 0)  # [P, 1]
    return centered / (std + eps)


def rloo_advantages(rewards: Tensor) -> Tensor:
    """Leave-one-out advantages, ``[P, G] -> [P, G]``.

    RLOO (Kool et al. 2019, "Buy 4 REINFORCE samples, get a baseline for free!";
    Ahmadian et al. 2024, arXiv:2402.14740): A_i = R_i - mean_{j != i} R_j, which equals
    G / (G - 1) * (R_i - mean_G R). The baseline excludes the sample itself, so the
    estimator stays unbiased. Needs G >= 2; a group with equal rewards gets exact zeros.
    """
    rewards = _as_groups(rewards)
    group_size = rewards.shape[1]
    if group_size < 2:
        raise ValueError(f"RLOO needs a group size of at least 2, got {group_size}")
    return _centered_rewards(rewards) * (group_size / (group_size - 1))
