"""Generalised advantage estimation over multi-turn token sequences (PPO with a critic).

Token-level GAE (Schulman et al. 2016, arXiv:1506.02438, eq. 16) with the multi-turn rule
of docs/algorithms.md, "GAE": positions where ``loss_mask`` is false (prompt, tool output,
observation tokens, padding) are skipped. The recursion runs over sampled tokens only and
carries the next value and the running advantage across the skipped ones, so gamma and
lambda apply between consecutive sampled tokens and the last token of one turn bootstraps
from the first sampled token of the next turn. Turn-level (bi-level) GAE (RAGEN, Wang et
al. 2025, arXiv:2504.20073) adds a recursion over turns.

Inputs are ``[B, T]``: ``rewards`` per token (the outcome on the last sampled token, turn
rewards on each turn's last token, an optional per-token KL penalty), ``values`` the
critic's V at every position. Rewards and values at masked positions are ignored, whatever
they hold (inf and NaN included). The sequence ends after its last sampled token: the value
after it is 0. Both estimators compute without gradient, since advantages and returns are
constants for the losses; whitening, if wanted, is ``advantages.masked_whiten``.

Not here: critic-free estimators (``advantages``, ``gigpo``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from turnrl.algorithms.reductions import _bool_mask
from turnrl.algorithms.turns import turn_end_mask

__all__ = ["AdvantagesAndReturns", "gae_advantages", "turn_level_gae_advantages"]


class AdvantagesAndReturns(NamedTuple):
    """Both ``[B, T]``, exactly 0 where masked."""

    advantages: Tensor
    """A_t, the policy-gradient weight of each sampled token."""
    returns: Tensor
    """A_t + V_t, the critic's regression target (``clipped_value_loss``'s ``returns``)."""


def _checked(rewards: Tensor, values: Tensor, loss_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Validate shapes; return the bool mask and rewards/values sanitised to 0 where masked."""
    if rewards.ndim != 2 or rewards.shape != values.shape or loss_mask.shape != rewards.shape:
        raise ValueError(
            "rewards, values and loss_mask must share one [B, T] shape, got "
            f"{tuple(rewards.shape)}, {tuple(values.shape)}, {tuple(loss_mask.shape)}"
        )
    dtype = torch.promote_types(rewards.dtype, values.dtype)
    if not dtype.is_floating_point:
        dtype = torch.get_default_dtype()
    mask = _bool_mask(loss_mask, rewards)
    zeros = torch.zeros(rewards.shape, dtype=dtype, device=rewards.device)
    return (
        mask,
        torch.where(mask, rewards.to(dtype), zeros),
        torch.where(mask, values.to(dtype), zeros),
    )


@torch.no_grad()
def gae_advantages(
    rewards: Tensor,
    values: Tensor,
    loss_mask: Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> AdvantagesAndReturns:
    """GAE over the sampled tokens of each sequence, skipping masked ones.

    For consecutive sampled tokens t < t' (anything between them masked):
        delta_t = r_t + gamma V_t' - V_t,    A_t = delta_t + gamma lambda A_t',
    with V and A after the last sampled token equal to 0; returns = A + V. RAGEN and
    Search-R1 use gamma = lambda = 1 (the defaults), which makes A_t the undiscounted
    return minus V_t.

    The loop runs backwards over the T positions, vectorised over the B sequences.
    """
    mask, r, v = _checked(rewards, values, loss_mask)
    batch_size, num_tokens = r.shape
    advantages = torch.zeros_like(r)
    next_value = torch.zeros(batch_size, dtype=r.dtype, device=r.device)  # V_t'
    next_advantage = torch.zeros_like(next_value)  # A_t'
    for t in reversed(range(num_tokens)):
        valid = mask[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(valid, advantage, 0.0)
        # A masked position leaves the carry untouched: it is skipped, not a time step.
        next_value = torch.where(valid, v[:, t], next_value)
        next_advantage = torch.where(valid, advantage, next_advantage)
    returns = torch.where(mask, advantages + v, 0.0)
    return AdvantagesAndReturns(advantages, returns)


@torch.no_grad()
def turn_level_gae_advantages(
    rewards: Tensor,
    values: Tensor,
    loss_mask: Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    turn_gamma: float = 0.95,
) -> AdvantagesAndReturns:
    """Bi-level GAE (RAGEN): GAE over turns, then token-level GAE inside each turn.

    A turn is a run of sampled tokens (``turns.turn_end_mask``); its reward and value are
    those at its last token e_k. High level, over the turns k of a sequence, with
    ``turn_gamma`` and ``lam``:
        delta_k = r_{e_k} + turn_gamma V_{e_{k+1}} - V_{e_k},
        A_k = delta_k + turn_gamma lam A_{k+1},     G_k = A_k + V_{e_k},
    with V and A after the last turn equal to 0. Low level, inside turn k, with ``gamma``
    and ``lam``: token GAE (skipping masked positions, as ``gae_advantages``) in which the
    turn's last token has reward G_k and nothing after it (the recursion resets at each turn
    end). So the last token of turn k gets A_k, and earlier tokens of the turn are credited
    through the critic towards G_k. Rewards on other tokens of a turn enter the low level
    only. Follows RAGEN's ``compute_bi_level_gae_advantage_return``, which uses one lambda
    for both levels, except that turns are read from the mask rather than from where rewards
    are non-zero.
    """
    mask, r, v = _checked(rewards, values, loss_mask)
    turn_end = turn_end_mask(mask)  # [B, T]
    batch_size, num_tokens = r.shape
    advantages = torch.zeros_like(r)
    zeros = torch.zeros(batch_size, dtype=r.dtype, device=r.device)
    next_turn_value, next_turn_advantage = zeros, zeros  # V_{e_{k+1}}, A_{k+1}
    next_value, next_advantage = zeros, zeros  # token level, within the current turn
    for t in reversed(range(num_tokens)):
        valid, end = mask[:, t], turn_end[:, t]
        # High level: only turn-end tokens update the turn recursion. Going backwards, the
        # later turns are done by the time turn k's end is reached.
        turn_delta = r[:, t] + turn_gamma * next_turn_value - v[:, t]
        turn_advantage = turn_delta + turn_gamma * lam * next_turn_advantage
        turn_return = turn_advantage + v[:, t]
        next_turn_value = torch.where(end, v[:, t], next_turn_value)
        next_turn_advantage = torch.where(end, turn_advantage, next_turn_advantage)
        # Low level: at a turn end the reward is the turn's return and nothing follows.
        token_reward = torch.where(end, turn_return, r[:, t])
        carry_value = torch.where(end, 0.0, next_value)
        carry_advantage = torch.where(end, 0.0, next_advantage)
        delta = token_reward + gamma * carry_value - v[:, t]
        advantage = delta + gamma * lam * carry_advantage
        advantages[:, t] = torch.where(valid, advantage, 0.0)
        next_value = torch.where(valid, v[:, t], next_value)
        next_advantage = torch.where(valid, advantage, next_advantage)
    returns = torch.where(mask, advantages + v, 0.0)
    return AdvantagesAndReturns(advantages, returns)
