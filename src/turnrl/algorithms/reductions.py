"""Masked reductions: how per-token values become one loss (docs/algorithms.md, "Loss reductions").

The choice of reduction is the usual source of "same algorithm, different result", so each
mode is its own named function over ``[B, T]`` per-token values and a ``loss_mask``:

- ``token_mean``: sum over valid tokens / number of valid tokens (DAPO; the default);
- ``seq_mean_token_mean``: mean over sequences of each sequence's token mean (GRPO);
- ``seq_mean_token_sum``: mean over sequences of each sequence's token sum;
- ``seq_mean_token_sum_norm``: sum over valid tokens / a constant L (Dr. GRPO).

Gradient accumulation: every mode takes its normaliser as an argument. Pass the count of the
WHOLE batch (all micro-batches of one optimiser step) and sum the micro-batch losses: the
result, and its gradient, equal the one-batch reduction. A per-micro-batch normaliser would
not. Micro-batches must split between sequences, never inside one.

Masking uses ``torch.where``, never multiplication: ``0 * inf`` and ``0 * nan`` are NaN, so a
multiplied mask lets a bad value in a masked slot leak into the loss or its gradient.

Not here: the per-token losses themselves (``losses``) and advantage whitening
(``advantages.masked_whiten``).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "masked_mean",
    "masked_sum",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "token_mean",
]


def _bool_mask(mask: Tensor, like: Tensor) -> Tensor:
    """The mask as bool (nonzero = valid), broadcast to ``like``'s shape."""
    mask = mask if mask.dtype == torch.bool else mask != 0
    return mask.expand_as(like)


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` over positions where ``mask`` is true (over ``dim``, or all of it).

    Masked positions contribute exactly 0 to the value and receive exactly 0 gradient,
    whatever they hold (inf and NaN included).
    """
    kept = torch.where(_bool_mask(mask, x), x, torch.zeros_like(x))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is true (over ``dim``, or all of it).

    An empty mask gives 0, not NaN, so a batch (or row) with no sampled tokens contributes
    nothing instead of poisoning the step.
    """
    bool_mask = _bool_mask(mask, x)
    total = masked_sum(x, bool_mask, dim)
    count = bool_mask.sum() if dim is None else bool_mask.sum(dim=dim)
    return total / count.clamp(min=1).to(total.dtype)


def _normaliser(count: float | Tensor, like: Tensor, name: str) -> Tensor:
    """A user-given normaliser as a 0-dim tensor of ``like``'s dtype and device."""
    if isinstance(count, Tensor):
        return count.to(dtype=like.dtype, device=like.device)
    if count < 0:
        raise ValueError(f"{name} must be >= 0, got {count}")
    return torch.tensor(count, dtype=like.dtype, device=like.device)


def _divide_or_zero(total: Tensor, count: Tensor) -> Tensor:
    """total / count, or 0 when count is 0; the gradient stays defined (all zeros) then."""
    has_count = count > 0
    safe_count = torch.where(has_count, count, torch.ones_like(count))
    return torch.where(has_count, total / safe_count, torch.zeros_like(total))


def token_mean(
    per_token_loss: Tensor,
    loss_mask: Tensor,
    num_tokens: float | Tensor | None = None,
) -> Tensor:
    """Token-mean loss: sum over valid tokens divided by ``num_tokens``.

    The DAPO reduction (Yu et al. 2025, arXiv:2503.14476, Sec. 3.3): every sampled token
    weighs the same, however long its sequence. ``num_tokens`` defaults to this batch's
    valid-token count. Under gradient accumulation pass the GLOBAL count (valid tokens over
    all micro-batches of the step): summing the micro-batch losses then gives exactly the
    one-batch gradient, where per-micro-batch means would not (docs/algorithms.md, "Loss
    reductions"). A count of 0 gives a loss of 0 whose gradient is defined (all zeros).
    """
    mask = _bool_mask(loss_mask, per_token_loss)
    total = masked_sum(per_token_loss, mask)
    if num_tokens is None:
        count = mask.sum().to(total.dtype)
    else:
        count = _normaliser(num_tokens, total, "num_tokens")
    return _divide_or_zero(total, count)


def _check_bt(per_token_loss: Tensor, loss_mask: Tensor) -> Tensor:
    """Validate the ``[B, T]`` layout and return the mask as bool."""
    if per_token_loss.ndim != 2 or loss_mask.shape != per_token_loss.shape:
        raise ValueError(
            "per_token_loss and loss_mask must share one [B, T] shape, got "
            f"{tuple(per_token_loss.shape)} and {tuple(loss_mask.shape)}"
        )
    return _bool_mask(loss_mask, per_token_loss)


def _sequence_count(mask: Tensor, num_seqs: float | Tensor | None, like: Tensor) -> Tensor:
    """Sequences with at least one valid token (rows of padding do not count), or the
    given global count."""
    if num_seqs is None:
        return mask.any(dim=1).sum().to(like.dtype)
    return _normaliser(num_seqs, like, "num_seqs")


def seq_mean_token_mean(
    per_token_loss: Tensor,
    loss_mask: Tensor,
    num_seqs: float | Tensor | None = None,
) -> Tensor:
    """Mean over sequences of each sequence's token mean, ``[B, T] -> []``.

    The reduction of the original GRPO objective (Shao et al. 2024, arXiv:2402.03300,
    eq. 3: 1/G sum_i 1/|o_i| sum_t). Each sequence weighs the same whatever its length, so
    a token of a short sequence weighs more than one of a long sequence; Dr. GRPO (Liu et
    al. 2025, arXiv:2503.20783) points out the length bias this creates.

    ``num_seqs`` defaults to the number of sequences with at least one valid token, so rows
    of padding change nothing. Under gradient accumulation pass that count over the whole
    batch (``loss_mask.any(dim=1).sum()`` of the full batch).
    """
    mask = _check_bt(per_token_loss, loss_mask)
    per_seq = masked_mean(per_token_loss, mask, dim=1)  # [B], 0 for empty rows
    return _divide_or_zero(per_seq.sum(), _sequence_count(mask, num_seqs, per_seq))


def seq_mean_token_sum(
    per_token_loss: Tensor,
    loss_mask: Tensor,
    num_seqs: float | Tensor | None = None,
) -> Tensor:
    """Mean over sequences of each sequence's token sum, ``[B, T] -> []``.

    Every token weighs the same (as in ``token_mean``), but the loss scale grows with the
    sequence length. ``num_seqs`` as in ``seq_mean_token_mean``.
    """
    mask = _check_bt(per_token_loss, loss_mask)
    total = masked_sum(per_token_loss, mask)
    return _divide_or_zero(total, _sequence_count(mask, num_seqs, total))


def seq_mean_token_sum_norm(
    per_token_loss: Tensor,
    loss_mask: Tensor,
    max_length: float,
) -> Tensor:
    """Sum over valid tokens divided by a constant ``max_length`` L, ``[B, T] -> []``.

    Dr. GRPO (Liu et al. 2025, arXiv:2503.20783, Sec. 3.2) replaces the per-sequence
    1/|o_i| by a constant, such as the maximum generation length, which removes the length
    bias without making the loss depend on the batch's token count. docs/algorithms.md defines
    it as sum_{i,t} m l / L (no division by the number of sequences). L must be the same
    constant for every micro-batch (not the micro-batch's padded width); then accumulation
    is exact trivially.
    """
    if max_length <= 0:
        raise ValueError(f"max_length must be > 0, got {max_length}")
    mask = _check_bt(per_token_loss, loss_mask)
    return masked_sum(per_token_loss, mask) / max_length
