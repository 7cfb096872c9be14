"""Forward passes the learner and the critic share: hidden states of right-padded rows,
with a batch's common prefix computed once, or of the same sequences packed back to back
(no padding), and per-token log-probs and entropies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from turnrl.backends.hf_cache import cache_kwargs, returned_cache

MIN_SHARED_PREFIX = 8
"""Shortest common prefix worth computing once for the whole micro-batch."""


def common_prefix_length(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> int:
    """How many leading tokens every row shares (and attends to), at most T - 1."""
    same = ((input_ids == input_ids[:1]) & attention_mask.bool()).all(dim=0)  # [T]
    differs = (~same).nonzero()
    length = int(differs[0, 0]) if len(differs) else input_ids.shape[1]
    return min(length, input_ids.shape[1] - 1)


def prefix_to_share(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> int:
    """The common prefix of the rows that ``hidden_states`` would run once, apart: their
    common prefix, or 0 when it is shorter than ``MIN_SHARED_PREFIX``, for a single row,
    or in training with gradient checkpointing (which turns the prefix's cache off)."""
    rows = input_ids.shape[0]
    shared = common_prefix_length(input_ids, attention_mask) if rows > 1 else 0
    recomputing = model.training and getattr(model.base_model, "gradient_checkpointing", False)
    return 0 if shared < MIN_SHARED_PREFIX or recomputing else shared


def agreed_prefix(model: Any, shared: int) -> int:
    """``shared`` as agreed with the other processes that run this forward in step.

    A model sharded layer by layer under FSDP2 gathers each layer at every call of its
    base model, so every rank must call it as often: two calls (a shared prefix) only
    where every rank runs one. Such a model's base model offers ``agree_on_prefix`` (the
    smallest ``shared`` over the ranks: distributed/rank.py); any other model runs its own.
    """
    agree = getattr(model.base_model, "agree_on_prefix", None)
    return int(agree(shared)) if agree is not None else shared


def hidden_states(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, shared: int | None = None
) -> Any:
    """The last hidden states [B, T, H] of right-padded rows.

    Rows of one batch usually share a long prefix (system prompt, tool list, often the
    whole question of a group). That prefix is run once with batch size 1 and its key/value
    cache is repeated for the rest of the rows, so the shared tokens cost one row instead
    of B; gradients flow back through the shared computation (equal to the plain forward to
    float rounding — tested). ``shared``: the prefix to run apart (0: none), a common prefix
    of the rows; by default ``prefix_to_share``'s, as ``agreed_prefix`` settles it.
    """
    rows = input_ids.shape[0]
    if shared is None:
        shared = agreed_prefix(model, prefix_to_share(model, input_ids, attention_mask))
    if shared == 0:
        return model.base_model(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).last_hidden_state
    head = model.base_model(
        input_ids=input_ids[:1, :shared], attention_mask=attention_mask[:1, :shared], use_cache=True
    )
    cache = returned_cache(head)
    cache.batch_repeat_interleave(rows)
    tail = model.base_model(
        input_ids=input_ids[:, shared:],
        attention_mask=attention_mask,
        use_cache=False,
        **cache_kwargs(model.base_model, cache),
    ).last_hidden_state
    return torch.cat([head.last_hidden_state.expand(rows, -1, -1), tail], dim=1)


@dataclass(frozen=True)
class PackedRows:
    """Sequences of a right-padded batch laid back to back in fewer rows.

    ``position_ids`` restart at 0 where each sequence starts, which is how transformers
    tells packed sequences apart: attention stays within a sequence. ``index[b, t]`` is
    the flat position (``row * width + column``) of token ``t`` of sequence ``b``.
    """

    input_ids: torch.Tensor  # [R, W]
    position_ids: torch.Tensor  # [R, W]
    index: torch.Tensor  # [B, T] long


def padded_cost(input_ids: torch.Tensor, shared: int) -> int:
    """Token positions ``hidden_states`` runs for right-padded rows: every cell, with a
    common prefix of ``shared`` tokens run once instead of once per row."""
    rows, width = input_ids.shape
    return rows * width - (rows - 1) * shared


def pack_rows(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    pad_id: int = 0,
    width: int = 0,
    plan: tuple[list[int], dict[int, tuple[int, int]], int] | None = None,
) -> PackedRows:
    """Pack the sequences of a right-padded batch back to back (``packing_plan``). A
    row's unused tail is padding that forms its own sequence (positions from 0), so no
    real token attends to it."""
    lengths = [int(n) for n in attention_mask.sum(-1).tolist()]
    fill, place, width = plan or packing_plan(lengths, width)
    device = input_ids.device
    packed = torch.full((len(fill), width), pad_id, dtype=input_ids.dtype, device=device)
    positions = torch.zeros((len(fill), width), dtype=torch.long, device=device)
    index = torch.zeros(input_ids.shape, dtype=torch.long, device=device)
    for i, (row, start) in place.items():
        n = lengths[i]
        packed[row, start : start + n] = input_ids[i, :n]
        positions[row, start : start + n] = torch.arange(n, device=device)
        index[i, :n] = row * width + start + torch.arange(n, device=device)
    for row, used in enumerate(fill):
        positions[row, used:] = torch.arange(width - used, device=device)
    return PackedRows(packed, positions, index)


def packing_plan(
    lengths: list[int], width: int = 0
) -> tuple[list[int], dict[int, tuple[int, int]], int]:
    """Where each sequence goes when packed into rows ``width`` tokens wide, first-fit
    by decreasing length: each row's used tokens, each sequence's (row, start), the width.
    The default width is the one (1, 1.5, 2, 3 or 4 times the longest sequence) that
    needs the fewest cells, the narrowest on a tie, so packing never costs more cells
    than padding."""
    longest = max(lengths)
    if width:
        width = max(width, longest)
        return (*_first_fit(lengths, width), width)
    widths = [int(f * longest) for f in (1, 1.5, 2, 3, 4)]
    options = [_first_fit(lengths, w) for w in widths]
    best = min(range(len(options)), key=lambda k: (len(options[k][0]) * widths[k], k))
    return (*options[best], widths[best])


def _first_fit(lengths: list[int], width: int) -> tuple[list[int], dict[int, tuple[int, int]]]:
    """Rows' used tokens and each sequence's (row, start), first-fit decreasing."""
    fill: list[int] = []
    place: dict[int, tuple[int, int]] = {}
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        row = next((r for r, used in enumerate(fill) if used + n <= width), len(fill))
        if row == len(fill):
            fill.append(0)
        place[i] = (row, fill[row])
        fill[row] += n
    return fill, place


def token_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    temperature: float,
    entropy_grad: bool = False,
    layout: str = "padded",
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(x_t | x_<t) and the entropy of pi(. | x_<t), both [B, T], where ``loss_mask``.

    Only the positions that are trained on go through the output layer: in agent rollouts
    most tokens are prompt and tool output, so this skips most of the vocabulary-sized
    work. Logits are divided by the sampling temperature, matching the sampler's log-probs.
    Elsewhere both outputs are 0. The entropy carries a gradient only with
    ``entropy_grad`` (an entropy bonus needs it; logging does not). Without
    ``with_entropy`` it is not computed (``None``): three vocabulary-sized passes over
    every trained position, which a reference, a scoring pass or a later epoch would
    throw away. ``layout``: the rows as given (``padded``, their common prefix run once),
    packed back to back (``packed``, ``pack_rows``: no work on padding, no shared prefix),
    or whichever of the two runs fewer token positions (``auto``). The outputs keep the
    batch's layout.
    """
    target = loss_mask.clone()
    target[:, 0] = False  # the first token has no context to be predicted from
    b, t = target.nonzero(as_tuple=True)
    rows = None
    shared = prefix_to_share(model, input_ids, attention_mask)
    if layout != "padded":
        plan = packing_plan([int(n) for n in attention_mask.sum(-1).tolist()])
        cells = len(plan[0]) * plan[2]
        if layout == "packed" or cells < padded_cost(input_ids, shared):
            rows = pack_rows(input_ids, attention_mask, plan=plan)
    # Packed rows are one call, as are padded rows without a shared prefix.
    shared = agreed_prefix(model, 0 if rows is not None else shared)
    if rows is not None:
        # No attention mask and no cache: transformers then reads the sequence boundaries
        # from the restarting position ids and keeps attention within each sequence.
        flat = model.base_model(
            input_ids=rows.input_ids, position_ids=rows.position_ids, use_cache=False
        ).last_hidden_state.flatten(0, 1)  # [R * W, H]
        before = flat[rows.index[b, t - 1]]
    else:
        before = hidden_states(model, input_ids, attention_mask, shared)[b, t - 1]  # [N, H]
    logits = model.get_output_embeddings()(before).float() / temperature  # [N, V]
    logp_all = torch.log_softmax(logits, dim=-1)
    picked = logp_all.gather(-1, input_ids[b, t][:, None]).squeeze(-1)
    logprobs = torch.zeros(input_ids.shape, dtype=picked.dtype, device=picked.device)
    logprobs = logprobs.index_put((b, t), picked)
    if not with_entropy:
        return logprobs, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = torch.zeros_like(logprobs).index_put((b, t), entropy_of(logp_all))
    return logprobs, entropy


def entropy_of(logp_all: torch.Tensor) -> torch.Tensor:
    """The entropy of each row of log-probabilities over the vocabulary: [N, V] -> [N]."""
    return -(logp_all.exp() * logp_all).sum(-1)
