"""From trajectories to a padded training batch, token-exact.

Each trajectory yields one sample per run of contiguous turns (``Trajectory.samples``);
every sample carries its trajectory's advantage, or one advantage per token when the
estimator gives each turn its own (GiGPO). Trajectories with an infrastructure
``error`` are excluded here, by one visible rule, and counted by the caller.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from turnrl.types import Sample, Trajectory


@dataclass(frozen=True)
class Batch:
    """Right-padded tensors, B sequences x T tokens.

        ``loss_mask`` is 1 exactly on sampled tokens; ``old_logprobs`` holds the sampler's
        log-probs there (0 elsewhere); ``advantages`` holds one value per token (a sequence-level
    advantage is repeated along its row).
    """

    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long
    loss_mask: torch.Tensor  # [B, T] bool
    old_logprobs: torch.Tensor  # [B, T] float
    advantages: torch.Tensor  # [B, T] float

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device) -> Batch:
        """The same batch on ``device`` (itself where it already is)."""
        if self.input_ids.device == device:
            return self
        return Batch(*(t.to(device) for t in dataclasses.astuple(self)))

    def select(self, index: slice) -> Batch:
        return Batch(
            self.input_ids[index],
            self.attention_mask[index],
            self.loss_mask[index],
            self.old_logprobs[index],
            self.advantages[index],
        )


def trainable(trajectories: Sequence[Trajectory]) -> list[Trajectory]:
    """The trajectories that may be trained on: those without an infrastructure error."""
    return [t for t in trajectories if t.error is None and t.turns]


def pack(
    samples: Sequence[Sample], advantages: Sequence[float | Sequence[float]], pad_id: int
) -> Batch:
    """Pad ``samples`` on the right into one batch.

    Each advantage is one number for the whole sample or one number per token of it.
    """
    if len(samples) != len(advantages):
        raise ValueError("one advantage per sample is required")
    if not samples:
        raise ValueError("cannot pack an empty batch")
    B, T = len(samples), max(len(s.input_ids) for s in samples)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention = torch.zeros((B, T), dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.bool)
    old = torch.zeros((B, T), dtype=torch.float32)
    for i, s in enumerate(samples):
        n = len(s.input_ids)
        input_ids[i, :n] = torch.tensor(s.input_ids, dtype=torch.long)
        attention[i, :n] = 1
        mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.bool)
        old[i, :n] = torch.tensor(s.logprobs, dtype=torch.float32)
    return Batch(input_ids, attention, mask, old, per_token(samples, advantages))


def per_token(samples: Sequence[Sample], values: Sequence[float | Sequence[float]]) -> torch.Tensor:
    """``[B, T]`` float, right-padded with 0: each sample's value repeated along its tokens,
    or its per-token values (as many as it has tokens)."""
    if len(samples) != len(values):
        raise ValueError("one value per sample is required")
    out = torch.zeros((len(samples), max(len(s.input_ids) for s in samples)))
    for i, (s, v) in enumerate(zip(samples, values, strict=True)):
        n = len(s.input_ids)
        if isinstance(v, int | float):
            out[i, :n] = float(v)
        elif len(v) == n:
            out[i, :n] = torch.tensor(v, dtype=torch.float32)
        else:
            raise ValueError(f"sample {i} has {n} tokens but {len(v)} per-token values")
    return out
