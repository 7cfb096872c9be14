"""Advantage estimators without a critic: pure tensor functions from rewards to advantages.

Group estimators (GRPO, Dr. GRPO, RLOO) take rewards laid out as ``[P, G]`` (P prompts, each
with a group of G sampled trajectories) and return one advantage per trajectory. The
REINFORCE++ estimators return one advantage per token, ``[B, T]`` with B = P * G sequences in
prompt-major order (rows p*G .. p*G + G-1 are prompt p's group). Group statistics used by
monitors (reward std, zero-variance groups) live here too, so the metrics and the estimators
agree on one definition. Definitions and test vectors: docs/algorithms.md, "Advantages".

Not here: estimators with a critic (``gae``) and GiGPO's step-level groups (``gigpo``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from turnrl.algorithms.reductions import _bool_mask, masked_mean

__all__ = [
    "dr_grpo_advantages",
    "group_reward_std",
    "grpo_advantages",
    "masked_whiten",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
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


def dr_grpo_advantages(rewards: Tensor) -> Tensor:
    """Dr. GRPO advantages, ``[P, G] -> [P, G]``: A_i = R_i - mean_G R, no std division.

    Liu et al. 2025 ("Understanding R1-Zero-like training", arXiv:2503.20783, Sec. 3.2):
    dividing by the group std up-weights prompts that are nearly always or nearly never
    solved. Pair it with a constant loss normaliser (``seq_mean_token_sum_norm``). The same
    as ``grpo_advantages(rewards, scale_by_std=False)``.
    """
    return grpo_advantages(rewards, scale_by_std=False)


def masked_whiten(values: Tensor, mask: Tensor, *, eps: float = 1e-8) -> Tensor:
    """(x - mean) / (std + eps) over the positions where ``mask`` is true, 0 elsewhere.

    Mean and (unbiased, N-1) std are taken over all valid positions of the whole tensor,
    i.e. over the batch, not per row. If the valid values are all equal (or there is only
    one) the result is exactly 0 there, rather than rounding noise divided by ``eps``.
    Masked positions cannot influence the result whatever they hold.
    """
    bool_mask = _bool_mask(mask, values)
    count = bool_mask.sum()
    mean = masked_mean(values, bool_mask)
    centered = torch.where(bool_mask, values - mean, torch.zeros_like(values))
    var = centered.square().sum() / (count - 1).clamp(min=1).to(values.dtype)
    highest = torch.where(bool_mask, values, -torch.inf).amax()
    lowest = torch.where(bool_mask, values, torch.inf).amin()
    flat = ~(highest > lowest)  # also true when nothing is valid (-inf > inf is false)
    whitened = torch.where(flat, torch.zeros_like(centered), centered / (var.sqrt() + eps))
    return torch.where(bool_mask, whitened, torch.zeros_like(whitened))


def _last_valid_index(mask: Tensor) -> Tensor:
    """Position of the last true entry of each row of a ``[B, T]`` bool mask (0 if none)."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask, positions, 0).amax(dim=1)  # [B]


@torch.no_grad()
def reinforce_pp_advantages(
    rewards: Tensor,
    loss_mask: Tensor,
    *,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    eps: float = 1e-8,
) -> Tensor:
    """REINFORCE++ advantages per token, ``rewards [B]``, ``loss_mask [B, T]`` -> ``[B, T]``.

    REINFORCE++ (Hu 2025, arXiv:2501.03262, Sec. 3): token rewards
        r_t = [t = T] R - kl_coef * KL_t,
    with T the last sampled token of the sequence and ``kl`` a per-token KL estimate (k1 is
    usual, e.g. ``kl_k1(logprobs, ref_logprobs, loss_mask)``); the return G_t = sum_{s>=t}
    r_s (gamma = 1) runs over sampled tokens only, so tool-output tokens add nothing; the
    advantages are the returns whitened over all valid tokens of the batch
    (``masked_whiten``), which replaces a critic's baseline. Exactly 0 where masked.
    Computed without gradient: advantages are constants for the loss.
    """
    mask = _bool_mask(loss_mask, loss_mask)
    if mask.ndim != 2 or rewards.shape != (mask.shape[0],):
        raise ValueError(
            f"rewards must be [B] and loss_mask [B, T], got {tuple(rewards.shape)} and "
            f"{tuple(loss_mask.shape)}"
        )
    if kl is not None and kl.shape != mask.shape:
        raise ValueError(f"kl must be [B, T] = {tuple(mask.shape)}, got {tuple(kl.shape)}")
    dtype = rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype()
    token_rewards = torch.zeros(mask.shape, dtype=dtype, device=rewards.device)  # [B, T]
    last = _last_valid_index(mask)[:, None]  # [B, 1]
    token_rewards.scatter_(1, last, rewards.to(dtype)[:, None])
    if kl is not None and kl_coef != 0.0:
        token_rewards = token_rewards - kl_coef * torch.where(mask, kl, 0.0).to(dtype)
    token_rewards = torch.where(mask, token_rewards, torch.zeros_like(token_rewards))
    returns = token_rewards.flip(1).cumsum(1).flip(1)  # G_t = sum_{s >= t} r_s
    return masked_whiten(returns, mask, eps=eps)


@torch.no_grad()
def reinforce_pp_baseline_advantages(
    rewards: Tensor,
    loss_mask: Tensor,
    *,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    eps: float = 1e-8,
) -> Tensor:
    """REINFORCE++-baseline, ``rewards [P, G]``, ``loss_mask [P*G, T]`` -> ``[P*G, T]``.

    Subtract each group's mean reward (R_i - mean_G R, exactly 0 for an all-equal group),
    then proceed as ``reinforce_pp_advantages``: per-token KL penalty, return over sampled
    tokens, whitening over the batch (Hu 2025, arXiv:2501.03262; OpenRLHF's
    "reinforce_baseline"). The group mean removes the prompt's difficulty; the batch
    whitening then sets a common scale without GRPO's per-group std.

    A group of one has no mean to subtract: its baseline is zero, as in ``grpo_advantages``
    (so ``G = 1`` is plain REINFORCE++; the group mean would cancel every reward).
    """
    grouped = _as_groups(rewards)
    centered = grouped.clone() if grouped.shape[1] == 1 else _centered_rewards(grouped)  # [P, G]
    if loss_mask.ndim != 2 or loss_mask.shape[0] != centered.numel():
        raise ValueError(
            f"loss_mask must be [P*G, T] with P*G = {centered.numel()}, got "
            f"{tuple(loss_mask.shape)}"
        )
    return reinforce_pp_advantages(centered.reshape(-1), loss_mask, kl=kl, kl_coef=kl_coef, eps=eps)
