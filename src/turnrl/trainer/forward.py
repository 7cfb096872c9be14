"""Forward passes the learner and the critic share: hidden states of right-padded rows,
with a batch's common prefix computed once, and per-token log-probs and entropies."""

from __future__ import annotations

from typing import Any

import torch

MIN_SHARED_PREFIX = 8
"""Shortest common prefix worth computing once for the whole micro-batch."""


def common_prefix_length(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> int:
    """How many leading tokens every row shares (and attends to), at most T - 1."""
    same = ((input_ids == input_ids[:1]) & attention_mask.bool()).all(dim=0)  # [T]
    differs = (~same).nonzero()
    length = int(differs[0, 0]) if len(differs) else input_ids.shape[1]
    return min(length, input_ids.shape[1] - 1)


def hidden_states(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
    """The last hidden states [B, T, H] of right-padded rows.

    Rows of one batch usually share a long prefix (system prompt, tool list, often the
    whole question of a group). That prefix is run once with batch size 1 and its key/value
    cache is repeated for the rest of the rows, so the shared tokens cost one row instead
    of B; gradients flow back through the shared computation (equal to the plain forward to
    float rounding — tested).
    """
    rows = input_ids.shape[0]
    shared = common_prefix_length(input_ids, attention_mask) if rows > 1 else 0
    if shared < MIN_SHARED_PREFIX:
        return model.base_model(
            input_ids=input_ids, attention_mask=attention_mask
        ).last_hidden_state
    head = model.base_model(
        input_ids=input_ids[:1, :shared], attention_mask=attention_mask[:1, :shared], use_cache=True
    )
    cache = head.past_key_values
    cache.batch_repeat_interleave(rows)
    tail = model.base_model(
        input_ids=input_ids[:, shared:],
        attention_mask=attention_mask,
        past_key_values=cache,
        use_cache=False,
    ).last_hidden_state
    return torch.cat([head.last_hidden_state.expand(rows, -1, -1), tail], dim=1)


def token_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    temperature: float,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(x_t | x_<t) and the entropy of pi(. | x_<t), both [B, T], where ``loss_mask``.

    Only the positions that are trained on go through the output layer: in agent rollouts
    most tokens are prompt and tool output, so this skips most of the vocabulary-sized
    work. Logits are divided by the sampling temperature, matching the sampler's log-probs.
    Elsewhere both outputs are 0. The entropy carries a gradient only with
    ``entropy_grad`` (an entropy bonus needs it; logging does not).
    """
    hidden = hidden_states(model, input_ids, attention_mask)  # [B, T, H]
    target = loss_mask.clone()
    target[:, 0] = False  # the first token has no context to be predicted from
    b, t = target.nonzero(as_tuple=True)
    logits = model.get_output_embeddings()(hidden[b, t - 1]).float() / temperature  # [N, V]
    logp_all = torch.log_softmax(logits, dim=-1)
    picked = logp_all.gather(-1, input_ids[b, t][:, None]).squeeze(-1)
    logprobs = torch.zeros(input_ids.shape, dtype=picked.dtype, device=picked.device)
    logprobs = logprobs.index_put((b, t), picked)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        per_position = -(logp_all.exp() * logp_all).sum(-1)
        entropy = torch.zeros_like(logprobs).index_put((b, t), per_position)
    return logprobs, entropy
