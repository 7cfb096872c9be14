"""GiGPO: group-in-group advantages for multi-step agents, without a critic.

Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent Training"
(arXiv:2505.10978); docs/algorithms.md, "GiGPO". Two levels of group-relative credit:

- episode level: GRPO over the G trajectories of one task, on each trajectory's return;
- step level: among those G trajectories, steps that acted on an identical observation form
  an "anchor" group, and each step's discounted return is normalised within its group.

A = A_episode + omega * A_step. No critic and no extra rollouts: the anchor groups come for
free when trajectories of one task revisit the same state.

Layout: steps (turns) are ``[B, S]`` with B = P * G trajectories in prompt-major order (rows
p*G .. p*G + G-1 are prompt p's group) and S the most steps of any trajectory; ``step_mask``
marks real steps. Observations are identified by integer ``anchor_ids`` (equal ids = identical
observations; the caller hashes the observation text), and grouped within one task only.
Spread the result over tokens with ``turns.turn_values_to_tokens``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from turnrl.algorithms.advantages import grpo_advantages
from turnrl.algorithms.reductions import _bool_mask, masked_sum

__all__ = ["discounted_step_returns", "gigpo_advantages", "step_group_advantages"]


def _check_steps(step_values: Tensor, step_mask: Tensor, name: str) -> Tensor:
    if step_values.ndim != 2 or step_mask.shape != step_values.shape:
        raise ValueError(
            f"{name} and step_mask must share one [B, S] shape, got "
            f"{tuple(step_values.shape)} and {tuple(step_mask.shape)}"
        )
    return _bool_mask(step_mask, step_values)


@torch.no_grad()
def discounted_step_returns(step_rewards: Tensor, step_mask: Tensor, *, gamma: float) -> Tensor:
    """R_t = sum_{k >= t} gamma^(k-t) r_k over the real steps of each trajectory, ``[B, S]``.

    GiGPO eq. 5. Steps where ``step_mask`` is false are skipped (they neither add a reward
    nor count as a discount step) and get 0.
    """
    mask = _check_steps(step_rewards, step_mask, "step_rewards")
    rewards = torch.where(mask, step_rewards, torch.zeros_like(step_rewards))
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])  # [B]
    for s in reversed(range(rewards.shape[1])):
        valid = mask[:, s]
        running = torch.where(valid, rewards[:, s] + gamma * running, running)
        returns[:, s] = torch.where(valid, running, 0.0)
    return returns


@torch.no_grad()
def step_group_advantages(
    step_returns: Tensor,
    anchor_ids: Tensor,
    step_mask: Tensor,
    *,
    group_size: int,
    eps: float = 1e-6,
    scale_by_std: bool = True,
) -> Tensor:
    """GiGPO's step-level advantages, ``[B, S] -> [B, S]`` (eq. 6-7).

    Real steps of one task (rows p*G .. p*G + G-1) with equal ``anchor_ids`` form a group;
    each step's return becomes (R - mean) / (std + eps) within its group, unbiased std, or
    R - mean with ``scale_by_std=False`` (verl-agent's "mean_norm" mode). A step alone in its
    group, or a group whose returns are all equal, gets exactly 0: there is nothing to
    compare it with. Masked steps get 0 whatever their entries hold.
    """
    mask = _check_steps(step_returns, step_mask, "step_returns")
    if anchor_ids.shape != step_returns.shape or anchor_ids.is_floating_point():
        raise ValueError(
            f"anchor_ids must be an integer [B, S] tensor, got {anchor_ids.dtype} "
            f"{tuple(anchor_ids.shape)}"
        )
    num_rows = step_returns.shape[0]
    if group_size < 1 or num_rows % group_size:
        raise ValueError(f"B = {num_rows} is not a multiple of group_size = {group_size}")

    rows = torch.arange(num_rows, device=step_returns.device)[:, None].expand_as(anchor_ids)
    task = rows // group_size  # [B, S]
    keys = torch.stack([task[mask], anchor_ids[mask]], dim=1)  # [N, 2], valid steps only
    values = step_returns[mask]  # [N]
    if values.numel() == 0:
        return torch.zeros_like(step_returns)
    _, group = torch.unique(keys, dim=0, return_inverse=True)  # [N] group of each step
    num_groups = int(group.max()) + 1

    def per_group(reduce: str, x: Tensor, init: float) -> Tensor:
        out = torch.full((num_groups,), init, dtype=x.dtype, device=x.device)
        return out.scatter_reduce(0, group, x, reduce=reduce, include_self=reduce != "mean")

    counts = per_group("sum", torch.ones_like(values), 0.0)  # [K]
    mean = per_group("mean", values, 0.0)  # [K]
    centered = values - mean[group]  # [N]
    # Exact zeros for groups of equal returns (including groups of one), as in GRPO.
    flat = per_group("amax", values, -torch.inf) == per_group("amin", values, torch.inf)
    centered = torch.where(flat[group], torch.zeros_like(centered), centered)
    if scale_by_std:
        sq = per_group("sum", centered.square(), 0.0)
        std = (sq / (counts - 1).clamp(min=1)).sqrt()  # unbiased; groups of one are flat
        centered = centered / (std[group] + eps)
    out = torch.zeros_like(step_returns)
    out[mask] = centered
    return out


@torch.no_grad()
def gigpo_advantages(
    step_rewards: Tensor,
    anchor_ids: Tensor,
    step_mask: Tensor,
    *,
    group_size: int,
    gamma: float = 0.95,
    omega: float = 1.0,
    eps: float = 1e-6,
    scale_by_std: bool = True,
) -> Tensor:
    """GiGPO advantage of each step, ``[B, S] -> [B, S]``: A_episode + omega * A_step (eq. 8).

    - A_episode: GRPO (``grpo_advantages``) over each group of G trajectories on the
      trajectory's undiscounted return sum_t r_t (eq. 3), the same for all its steps;
    - A_step: ``step_group_advantages`` of the gamma-discounted step returns
      (``discounted_step_returns``), grouped by identical observation within the task.

    The episode statistics (mean, std) count each trajectory once, as eq. 3 defines them.
    This departs deliberately from verl-agent's default (its batch rows are steps, and
    ``compute_mean_std_cross_steps`` takes the statistics over them): there a trajectory
    enters its group's mean and std once per step, so longer trajectories weigh more.

    ``gamma`` = 0.95 and ``omega`` = 1 as in the paper. ``scale_by_std`` applies to both
    levels (False gives the mean-only normalisation). Masked steps get exactly 0.
    """
    mask = _check_steps(step_rewards, step_mask, "step_rewards")
    num_rows = step_rewards.shape[0]
    if group_size < 1 or num_rows % group_size:
        raise ValueError(f"B = {num_rows} is not a multiple of group_size = {group_size}")
    episode_returns = masked_sum(step_rewards, mask, dim=1)  # [B]
    episode = grpo_advantages(
        episode_returns.reshape(-1, group_size), eps=eps, scale_by_std=scale_by_std
    ).reshape(num_rows, 1)  # [B, 1]
    step_returns = discounted_step_returns(step_rewards, mask, gamma=gamma)
    step = step_group_advantages(
        step_returns, anchor_ids, mask, group_size=group_size, eps=eps, scale_by_std=scale_by_std
    )
    combined = episode + omega * step  # [B, S]
    return torch.where(mask, combined, torch.zeros_like(combined))
