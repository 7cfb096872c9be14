"""Turns of a multi-turn token sequence, read off its ``loss_mask``.

In an agent rollout the sampled (trainable) tokens come in runs, one run per assistant turn,
separated by tokens the policy did not sample (chat-template tokens, tool output, the next
observation). A turn is therefore a maximal run of true entries in a ``[B, T]`` loss mask;
its last token is where the turn's reward sits. Turn-level GAE and GiGPO use these helpers,
so both agree on what a turn is.

Not here: anything that needs the token ids or the chat template.
"""

from __future__ import annotations

import torch
from torch import Tensor

from turnrl.algorithms.reductions import _bool_mask

__all__ = ["turn_end_mask", "turn_index", "turn_values_to_tokens"]


def _as_bt_mask(loss_mask: Tensor) -> Tensor:
    if loss_mask.ndim != 2:
        raise ValueError(f"loss_mask must be [B, T], got shape {tuple(loss_mask.shape)}")
    return _bool_mask(loss_mask, loss_mask)


def turn_end_mask(loss_mask: Tensor) -> Tensor:
    """Bool ``[B, T]``: true on the last sampled token of each turn (each run of the mask)."""
    mask = _as_bt_mask(loss_mask)
    next_valid = torch.nn.functional.pad(mask[:, 1:], (0, 1), value=False)  # [B, T]
    return mask & ~next_valid


def turn_index(loss_mask: Tensor) -> Tensor:
    """Int64 ``[B, T]``: 0, 1, 2, ... the turn each sampled token belongs to; -1 where masked."""
    mask = _as_bt_mask(loss_mask)
    prev_valid = torch.nn.functional.pad(mask[:, :-1], (1, 0), value=False)  # [B, T]
    starts = (mask & ~prev_valid).long()
    return torch.where(mask, starts.cumsum(dim=1) - 1, -1)


def turn_values_to_tokens(turn_values: Tensor, loss_mask: Tensor) -> Tensor:
    """Spread one value per turn over that turn's sampled tokens, ``[B, S] -> [B, T]``.

    ``turn_values[b, k]`` goes to every sampled token of turn k of sequence b (e.g. GiGPO's
    step advantages, one per turn); masked positions get exactly 0. ``S`` must be at least
    the largest number of turns in a sequence.
    """
    mask = _as_bt_mask(loss_mask)
    index = turn_index(mask)  # [B, T]
    if turn_values.ndim != 2 or turn_values.shape[0] != mask.shape[0]:
        raise ValueError(
            f"turn_values must be [B, S] with B = {mask.shape[0]}, got {tuple(turn_values.shape)}"
        )
    num_turns = int(index.max()) + 1 if index.numel() else 0
    if num_turns > turn_values.shape[1]:
        raise ValueError(
            f"a sequence has {num_turns} turns but turn_values has only {turn_values.shape[1]}"
        )
    if turn_values.shape[1] == 0:
        return torch.zeros(mask.shape, dtype=turn_values.dtype, device=turn_values.device)
    spread = turn_values.gather(1, index.clamp(min=0))  # [B, T]
    return torch.where(mask, spread, torch.zeros_like(spread))
