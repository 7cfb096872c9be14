"""The learner: recompute log-probs, take one clipped policy-gradient step.

Micro-batches accumulate gradients; the loss of each is normalised by the token count of
the *whole* batch, so accumulation gives the same gradient as one big batch. On the first
pass after fresh rollouts the recomputed log-probs must equal the sampler's: their gap is
logged every step as ``train/logprob_mismatch`` (docs/design.md, invariant 3).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from turnrl.algorithms import (
    KL_ESTIMATORS,
    MaskedWeights,
    PolicyLossOutput,
    cispo_policy_loss,
    clipped_policy_loss,
    decoupled_policy_loss,
    gae_advantages,
    geometric_sequence_mask,
    gmpo_policy_loss,
    gspo_policy_loss,
    icepop_weights,
    masked_mean,
    masked_whiten,
    sapo_policy_loss,
    seq_mean_token_mean,
    seq_mean_token_sum,
    seq_mean_token_sum_norm,
    sequence_mis_weights,
    sequence_ratio_mask,
    sequence_tis_weights,
    token_mean,
    token_mis_weights,
    token_tis_weights,
    turn_level_gae_advantages,
)
from turnrl.errors import ConfigError
from turnrl.models.lora import adapters_off, is_lora, trainable_parameters
from turnrl.rollout.batch import Batch, pack, per_token
from turnrl.trainer.config import AlgorithmConfig
from turnrl.trainer.critic import Critic
from turnrl.trainer.forward import (
    MIN_SHARED_PREFIX,
    common_prefix_length,
    hidden_states,
    token_logprobs,
)
from turnrl.types import Sample

__all__ = [
    "MIN_SHARED_PREFIX",
    "Learner",
    "common_prefix_length",
    "hidden_states",
    "token_logprobs",
]


class Learner:
    """Owns the optimizer; ``step`` applies one update from one batch.

    With ``kl.coef > 0`` the reference policy is ``reference`` (or a frozen copy of the
    model as it is now); otherwise no reference model exists. ``teacher`` (on-policy
    distillation, ``algorithm.teacher``) is a frozen model it scores samples with, as it
    scores them with the reference (``teacher_logprobs``).
    """

    def __init__(
        self,
        model: Any,
        config: AlgorithmConfig,
        *,
        temperature: float,
        reference: Any = None,
        teacher: Any = None,
        max_length: int = 0,
        autocast: torch.dtype | None = None,
    ) -> None:
        if config.loss_reduction == "seq_mean_token_sum_norm" and max_length <= 0:
            raise ConfigError("loss_reduction seq_mean_token_sum_norm needs max_length > 0")
        self.model = model
        self.device = next(model.parameters()).device  # batches are moved here
        self.autocast = autocast
        """Forward and backward under autocast to this dtype (bf16-mixed); the weights,
        gradients and optimizer state keep the model's dtype (float32 master weights)."""
        self.config = config
        self.temperature = temperature
        self.max_length = max_length
        self.kl_estimator = KL_ESTIMATORS[config.kl.estimator]
        self.ref_model: Any = None
        # With LoRA the reference is the base: this model with its adapters switched off.
        self.ref_is_base = config.kl.coef > 0 and reference is None and is_lora(model)
        if config.kl.coef > 0 and not self.ref_is_base:
            ref = reference if reference is not None else copy.deepcopy(model)
            self.ref_model = ref.eval().requires_grad_(False)
        self.teacher = teacher.eval().requires_grad_(False) if teacher is not None else None
        self.params = trainable_parameters(model)  # all, or (LoRA) only the adapters
        self.optimizer = torch.optim.AdamW(
            self.params, lr=config.lr, weight_decay=config.weight_decay
        )
        self.critic = self.make_critic(model, config) if config.advantage == "gae" else None
        self.token_budget = config.micro_batch.tokens or auto_token_budget(model)
        # Each choice resolved once, here (docs/design.md, invariant 5).
        self.reduction = REDUCTIONS[config.loss_reduction]
        self.policy_loss = POLICY_LOSSES[config.policy_loss]
        self.correction = CORRECTIONS[config.off_policy.correction]  # "auto": none here
        if config.policy_loss == "ppo" and config.off_policy.correction == "token_tis":
            self.policy_loss, self.correction = _decoupled_ppo, _no_correction
        g = config.gae
        self.gae = (
            functools.partial(
                turn_level_gae_advantages, gamma=g.gamma, lam=g.lam, turn_gamma=g.turn_gamma
            )
            if g.level == "turn"
            else functools.partial(gae_advantages, gamma=g.gamma, lam=g.lam)
        )

    def step_samples(
        self,
        samples: Sequence[Sample],
        advantages: Sequence[float | Sequence[float]],
        pad_id: int,
    ) -> dict[str, float]:
        """One update from token-exact samples: micro-batches of similar length, so little
        work is spent on padding; the result equals one update on the whole batch."""
        return self.step(self._chunks(samples, advantages, pad_id))

    def _parts(self, lengths: Sequence[int]) -> list[list[int]]:
        """Micro-batches as lists of sample indices: sorted by length (little padding),
        at most ``micro_batch.size`` samples and ``token_budget`` tokens each (padded
        rows x longest, or real tokens when packed), at least one sample each."""
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        size, budget = self.config.micro_batch.size, self.token_budget
        parts: list[list[int]] = []
        for i in order:
            part = parts[-1] if parts else None
            if part is not None and len(part) < size:
                grown = len(part) + 1
                cost = (
                    sum(lengths[j] for j in part) + lengths[i]
                    if self.config.micro_batch.layout == "packed"
                    else grown * lengths[i]  # sorted: the new sample is the longest
                )
                if not budget or cost <= budget:
                    part.append(i)
                    continue
            parts.append([i])
        return parts

    def _chunks(
        self,
        samples: Sequence[Sample],
        per_sample: Sequence[float | Sequence[float]],
        pad_id: int,
    ) -> list[Batch]:
        """Micro-batches of similar-length samples (``_parts``), each sample with its
        value(s) from ``per_sample``."""
        parts = self._parts([len(s.input_ids) for s in samples])
        return [
            pack([samples[i] for i in part], [per_sample[i] for i in part], pad_id).to(self.device)
            for part in parts
        ]

    def _scored(
        self, model: Any, samples: Sequence[Sample], pad_id: int
    ) -> Iterator[tuple[list[int], Batch, torch.Tensor]]:
        """Micro-batches of ``samples`` (their indices, the packed batch) with ``model``'s
        log-probs of their sampled tokens at the sampling temperature, without gradients."""
        for part in self._parts([len(s.input_ids) for s in samples]):
            mb = pack([samples[i] for i in part], [0.0] * len(part), pad_id).to(self.device)
            with torch.no_grad(), self.autocasting():
                logprobs, _ = token_logprobs(
                    model, mb.input_ids, mb.attention_mask, mb.loss_mask,
                    self.temperature, layout=self.config.micro_batch.layout, with_entropy=False,
                )  # fmt: skip
            yield part, mb, logprobs

    def reference_kl(self, samples: Sequence[Sample], pad_id: int) -> list[list[float]]:
        """The configured KL estimate of each sampled token to the reference policy, one
        list per sample (0 where nothing was sampled). On-policy, the sampler's log-probs
        stand for the policy's, so only the reference runs."""
        if not self.has_reference:
            raise ConfigError("a KL in the reward needs algorithm.kl.coef > 0")
        with self.reference() as reference:
            return self._per_token(
                reference, samples, pad_id,
                lambda mb, ref: self.kl_estimator(mb.old_logprobs, ref, mb.loss_mask),
            )  # fmt: skip

    def teacher_logprobs(self, samples: Sequence[Sample], pad_id: int) -> list[list[float]]:
        """The teacher's log-prob of each sampled token at the sampling temperature, one list
        per sample (0 where nothing was sampled): scored as the reference is, without
        gradients, in the learner's micro-batches."""
        if self.teacher is None:
            raise ConfigError("teacher log-probs need a teacher: set algorithm.teacher.path")
        return self._per_token(self.teacher, samples, pad_id, lambda _mb, logprobs: logprobs)

    def _per_token(
        self,
        model: Any,
        samples: Sequence[Sample],
        pad_id: int,
        value: Callable[[Batch, torch.Tensor], torch.Tensor],
    ) -> list[list[float]]:
        """``value(batch, model's log-probs)`` on every sampled token of ``samples`` (0 on
        the others), one list per sample, each as long as the sample."""
        out: list[list[float]] = [[] for _ in samples]
        for part, mb, logprobs in self._scored(model, samples, pad_id):
            values = torch.where(mb.loss_mask, value(mb, logprobs), 0.0)
            for row, i in enumerate(part):
                out[i] = values[row, : len(samples[i].input_ids)].tolist()
        return out

    def autocasting(self) -> Any:
        """Autocast to ``self.autocast`` (bf16-mixed) for the block; a no-op otherwise."""
        return torch.autocast(
            self.device.type, dtype=self.autocast, enabled=self.autocast is not None
        )

    @property
    def has_reference(self) -> bool:
        """Whether a KL reference policy exists (``kl.coef > 0``)."""
        return self.ref_model is not None or self.ref_is_base

    @contextlib.contextmanager
    def reference(self) -> Iterator[Any]:
        """The reference policy to score with: the frozen copy, or (LoRA) this model with
        its adapters switched off for the duration of the block."""
        if self.ref_model is not None:
            yield self.ref_model
        else:
            with adapters_off(self.model) as base:
                yield base

    def sampler_gap(self, samples: Sequence[Sample], pad_id: int) -> float:
        """The largest |sampler log-prob - this policy's log-prob| over the sampled tokens
        of ``samples`` (their recorded log-probs against a recomputation, at the sampling
        temperature): 0 up to float rounding when the engine samples this policy."""
        gaps = [
            (ours - mb.old_logprobs).abs()[mb.loss_mask]
            for _, mb, ours in self._scored(self.model, samples, pad_id)
        ]
        return max((float(g.max()) for g in gaps if g.numel()), default=0.0)

    def refresh_model(self) -> None:
        """Nothing: ``model`` is what this learner trains, never behind its weights (a
        learner on ranks brings them into it here before a checkpoint reads it)."""

    def step_samples_gae(
        self,
        samples: Sequence[Sample],
        token_rewards: Sequence[float | Sequence[float]],
        pad_id: int,
    ) -> dict[str, float]:
        """PPO: one update from samples and each sample's per-token rewards (the reward on
        the last sampled token, a KL penalty on each when it is in the reward). The critic
        scores every sampled token, GAE turns rewards and values into advantages and
        returns (skipping masked tokens), the policy steps on the (whitened) advantages,
        then the critic steps on the returns."""
        if self.critic is None:
            raise ConfigError("step_samples_gae needs algorithm.advantage = 'gae'")
        if any(isinstance(r, float) for r in token_rewards):
            raise ValueError("step_samples_gae takes one reward per token of each sample")
        cfg = self.config
        parts = self._parts([len(s.input_ids) for s in samples])
        chunks = [
            pack([samples[i] for i in part], [0.0] * len(part), pad_id).to(self.device)
            for part in parts
        ]
        rewards = [
            per_token([samples[i] for i in part], [token_rewards[i] for i in part]).to(self.device)
            for part in parts
        ]
        values = self.critic_values(chunks)
        gae = [
            self.gae(r, v, mb.loss_mask) for r, v, mb in zip(rewards, values, chunks, strict=True)
        ]
        advantages = [g.advantages for g in gae]
        if cfg.gae.whiten:
            advantages = self.whiten(advantages, [mb.loss_mask for mb in chunks])
        policy_batches = [
            dataclasses.replace(mb, advantages=adv.float())
            for mb, adv in zip(chunks, advantages, strict=True)
        ]
        metrics = self.step(policy_batches)
        metrics["critic/value_mean"] = self.value_mean(values, [mb.loss_mask for mb in chunks])
        metrics.update(self.critic_step(chunks, [g.returns for g in gae], values))
        return metrics

    # The critic's parts of ``step_samples_gae``; a learner rank (turnrl.distributed) takes
    # each over its part of the batch, with the whole batch's statistics.

    def make_critic(self, model: Any, config: AlgorithmConfig) -> Critic:
        return Critic(model, config)

    def critic_values(self, chunks: Sequence[Batch]) -> list[torch.Tensor]:
        """The critic's value of every sampled token's state, per micro-batch."""
        assert self.critic is not None
        with self.autocasting():
            return [self.critic.values(mb) for mb in chunks]

    def whiten(
        self, values: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """``masked_whiten`` over the whole batch (``_whiten_across``)."""
        return _whiten_across(values, masks)

    def value_mean(self, values: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]) -> float:
        """The mean value over the batch's sampled tokens (``critic/value_mean``)."""
        num_tokens = sum(float(m.sum()) for m in masks) or 1.0
        return sum(float(v[m].sum()) for v, m in zip(values, masks, strict=True)) / num_tokens

    def critic_step(
        self,
        chunks: Sequence[Batch],
        returns: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
    ) -> dict[str, float]:
        """The critic's update on the returns (``Critic.step``)."""
        assert self.critic is not None
        with self.autocasting():
            return self.critic.step(chunks, returns, values)

    def micro_batches(self, batch: Batch | Sequence[Batch]) -> list[Batch]:
        """``batch`` cut into micro-batches of ``micro_batch.size`` rows (or the given
        micro-batches), on the model's device."""
        if isinstance(batch, Batch):
            size = self.config.micro_batch.size
            micro = [batch.select(slice(s, s + size)) for s in range(0, batch.num_sequences, size)]
        else:
            micro = list(batch)
        return [mb.to(self.device) for mb in micro]

    def step(self, batch: Batch | Sequence[Batch]) -> dict[str, float]:
        """One update from a batch (split into micro-batches) or from given micro-batches."""
        cfg = self.config
        micro = self.micro_batches(batch)
        self.model.train()
        num_tokens = torch.stack([mb.loss_mask.sum() for mb in micro]).sum().clamp(min=1).float()
        num_sequences = sum(mb.num_sequences for mb in micro)
        # Pass 0 is on-policy: its ratio is exactly 1 (the clip is anchored at the learner's
        # own first-pass log-probs) and its log-prob gap to the sampler is the mismatch.
        # Further passes (``epochs`` > 1) reuse the batch; the clip bounds them.
        num_seqs = torch.stack([mb.loss_mask.any(-1).sum() for mb in micro]).sum().clamp(min=1)
        norms = (num_tokens, num_seqs.float())
        proximal: list[torch.Tensor] = []
        refs: list[torch.Tensor | None] = []
        with self.autocasting():
            passes = [self._pass(micro, norms, proximal, refs) for _ in range(cfg.epochs)]
        totals, grad_norm = passes[0]
        clipped = sum(t["clipped"] for t, _ in passes) / len(passes)
        off_policy = {
            k: 0.0 if math.isinf(v) else v  # an extreme over no sampled token: 0
            for k, v in totals.items()
            if k.startswith("off_policy/")
        }
        return {
            **off_policy,
            "loss/policy": totals["loss"],
            "loss/entropy": totals["entropy"],
            "loss/kl": totals["kl"],
            "train/grad_norm": grad_norm,
            "train/clip_frac": clipped,
            "train/logprob_mismatch": totals["abs_gap"],
            "train/logprob_mismatch_max": totals["max_gap"],
            "train/num_tokens": float(num_tokens),
            "train/num_sequences": float(num_sequences),
        }

    def _reduce(
        self, per_token: torch.Tensor, mask: torch.Tensor, norms: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """The configured reduction with the whole batch's normaliser (exact accumulation)."""
        return self.reduction(per_token, mask, norms, float(self.max_length))

    def _policy_loss(
        self, logprobs: torch.Tensor, proximal: torch.Tensor, mb: Batch
    ) -> tuple[PolicyLossOutput, torch.Tensor, dict[str, torch.Tensor]]:
        """The configured policy loss per token, the loss mask it applies to, and the
        off-policy correction's metrics.

        The trust region is taken around ``proximal`` (the learner's own log-probs at the
        first pass over this batch); ``mb.old_logprobs`` are the sampler's, used only by
        the off-policy correction (``off_policy``), which reweights or masks by
        pi_proximal / pi_sampler.
        """
        adv = mb.advantages if mb.advantages.ndim == 2 else mb.advantages[:, None]
        out = self.policy_loss(logprobs, proximal, mb.old_logprobs, adv, mb, self.config)
        return self.correction(out, proximal, mb, self.config)

    def _reference_logprobs(self, mb: Batch) -> torch.Tensor | None:
        """The reference policy's log-probs of ``mb``'s tokens for the KL loss, or
        ``None`` when there is none (no reference, or the KL goes into the reward)."""
        if not (self.has_reference and self.config.kl.placement == "loss"):
            return None
        # Before the policy's forward: a LoRA reference toggles the adapters.
        with torch.no_grad(), self.reference() as reference:
            ref, _ = token_logprobs(
                reference, mb.input_ids, mb.attention_mask, mb.loss_mask,
                self.temperature, layout=self.config.micro_batch.layout, with_entropy=False,
            )  # fmt: skip
        return ref

    def _pass(
        self,
        micro: Sequence[Batch],
        norms: tuple[torch.Tensor, torch.Tensor],
        proximal: list[torch.Tensor],
        refs: list[torch.Tensor | None],
    ) -> tuple[dict[str, float], float]:
        """One optimizer step over all micro-batches; returns its totals and grad norm.

        ``proximal`` is empty on the first pass and is filled with each micro-batch's
        detached log-probs, the anchor of the clip for this and later passes. ``refs``
        likewise keeps the reference policy's log-probs (``None`` without a KL loss): the
        reference does not change between passes, so with ``epochs`` > 1 its forward runs
        once per step, not once per pass.
        """
        cfg = self.config
        num_tokens = norms[0]
        first = not proximal
        self.optimizer.zero_grad(set_to_none=True)
        totals = dict.fromkeys(("loss", "kl", "entropy", "clipped", "abs_gap", "max_gap"), 0.0)
        for i, mb in enumerate(micro):
            if first:
                refs.append(self._reference_logprobs(mb))
            ref = refs[i]
            # The entropy: a loss term (entropy_coef), else logged from the first pass only.
            logprobs, entropy = token_logprobs(
                self.model, mb.input_ids, mb.attention_mask, mb.loss_mask, self.temperature,
                entropy_grad=cfg.entropy_coef > 0, layout=cfg.micro_batch.layout,
                with_entropy=first or cfg.entropy_coef > 0,
            )  # fmt: skip
            if first:
                proximal.append(logprobs.detach())
            out, mask, off_policy = self._policy_loss(logprobs, proximal[i], mb)
            loss = self._reduce(out.per_token_loss, mask, norms)
            totals["loss"] += float(loss.detach())
            if cfg.entropy_coef > 0:
                assert entropy is not None
                loss = loss - cfg.entropy_coef * self._reduce(entropy, mb.loss_mask, norms)
            if ref is not None:
                kl = self._reduce(
                    self.kl_estimator(logprobs, ref, mb.loss_mask), mb.loss_mask, norms
                )
                loss = loss + cfg.kl.coef * kl
                totals["kl"] += float(kl.detach())
            torch.autograd.backward(loss)
            with torch.no_grad():
                gap = torch.where(mb.loss_mask, (logprobs - mb.old_logprobs).abs(), 0.0)
                share = mb.loss_mask.sum() / num_tokens
                if entropy is not None:
                    totals["entropy"] += float(masked_mean(entropy.detach(), mb.loss_mask) * share)
                totals["clipped"] += float(masked_mean(out.clipped.float(), mb.loss_mask) * share)
                totals["abs_gap"] += float(gap.sum() / num_tokens)
                totals["max_gap"] = max(totals["max_gap"], float(gap.max()))
                seq_share = float(mb.loss_mask.any(-1).sum() / norms[1])
                sampled = bool(mb.loss_mask.any())
                fold_off_policy(totals, off_policy, float(share), seq_share, sampled)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm)
        self.optimizer.step()
        return totals, float(grad_norm)


def fold_off_policy(
    totals: dict[str, float],
    metrics: dict[str, Any],
    token_share: float,
    seq_share: float,
    sampled: bool,
) -> None:
    """One micro-batch's off-policy ``metrics`` folded into the batch's ``totals`` (under
    ``off_policy/``), so that they are the whole batch's whatever its micro-batches: an
    extreme (a name ending ``_max`` or ``_min``) over the micro-batches with sampled tokens
    (``sampled``; ±inf until one has them); a mean over sequences (``seq_``) weighted by the
    micro-batch's share of the batch's sequences; any other mean by its share of the
    tokens."""
    for name, value in metrics.items():
        key = f"off_policy/{name}"
        if name.endswith(("_max", "_min")):
            largest = name.endswith("_max")
            kept = totals.get(key, -math.inf if largest else math.inf)
            if sampled:
                kept = max(kept, float(value)) if largest else min(kept, float(value))
            totals[key] = kept
        else:
            share = seq_share if name.startswith("seq_") else token_share
            totals[key] = totals.get(key, 0.0) + float(value) * share


def auto_token_budget(model: Any, free_bytes: int | None = None) -> int:
    """Tokens per micro-batch that fit in ``free_bytes`` (default: the free memory of the
    model's CUDA device; on CPU no budget, 0). An estimate, not a guarantee: about 40% of
    the free memory over the float32 bytes a token keeps for the backward pass (each
    layer's activations, ~16 x hidden + 2 x MLP width, and its logits, 3 x vocabulary)."""
    device = next(model.parameters()).device
    if free_bytes is None:
        if device.type != "cuda":
            return 0
        free_bytes, _ = torch.cuda.mem_get_info(device)
    c = model.config
    hidden = int(c.hidden_size)
    width = int(getattr(c, "intermediate_size", 4 * hidden))
    per_token = 4 * (int(c.num_hidden_layers) * (16 * hidden + 2 * width) + 3 * int(c.vocab_size))
    return max(256, int(0.4 * free_bytes) // per_token)


def _whiten_across(
    values: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """``masked_whiten`` over the valid entries of several ``[B_i, T_i]`` tensors at once
    (the whole batch's mean and std, whatever its micro-batch split)."""
    flat = torch.cat([v[m] for v, m in zip(values, masks, strict=True)])
    whitened = masked_whiten(flat, torch.ones_like(flat, dtype=torch.bool))
    out, start = [], 0
    for v, m in zip(values, masks, strict=True):
        piece = torch.zeros_like(v)
        count = int(m.sum())
        piece[m] = whitened[start : start + count]
        out.append(piece)
        start += count
    return out


def _sequence_advantage(adv: torch.Tensor, mb: Batch) -> torch.Tensor:
    """One advantage per row, ``[B, 1]``: the row's own where the batch holds one per
    sequence, else the mean over its sampled tokens (the row's value when it is the same on
    every token)."""
    if mb.advantages.ndim == 1:
        return adv[:, :1]
    return masked_mean(adv, mb.loss_mask, dim=1)[:, None]


def _reweighted(
    out: PolicyLossOutput, weights: torch.Tensor, mask: torch.Tensor
) -> PolicyLossOutput:
    """The per-token loss times detached importance weights (``[B, T]`` or ``[B, 1]``)."""
    loss = torch.where(mask, out.per_token_loss * weights.detach(), 0.0)
    return PolicyLossOutput(per_token_loss=loss, clipped=out.clipped, ratio=out.ratio)


Norms = tuple[torch.Tensor, torch.Tensor]
"""The whole batch's (sampled tokens, sequences with a sampled token)."""

REDUCTIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, Norms, float], torch.Tensor]] = {
    "token_mean": lambda x, mask, norms, _: token_mean(x, mask, norms[0]),
    "seq_mean_token_mean": lambda x, mask, norms, _: seq_mean_token_mean(x, mask, norms[1]),
    "seq_mean_token_sum": lambda x, mask, norms, _: seq_mean_token_sum(x, mask, norms[1]),
    "seq_mean_token_sum_norm": lambda x, mask, _, length: seq_mean_token_sum_norm(x, mask, length),
}
"""``algorithm.loss_reduction``: per-token values to the batch's loss (docs/algorithms.md)."""

PolicyLoss = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Batch, AlgorithmConfig],
    PolicyLossOutput,
]
"""(logprobs, proximal, sampler log-probs, advantages [B, T] or [B, 1], batch, config)."""


def _ppo(
    logprobs: torch.Tensor, proximal: torch.Tensor, _sampler: torch.Tensor,
    adv: torch.Tensor, mb: Batch, cfg: AlgorithmConfig,
) -> PolicyLossOutput:  # fmt: skip
    return clipped_policy_loss(
        logprobs, proximal, adv, mb.loss_mask, eps_low=cfg.clip.low, eps_high=cfg.clip.high,
        dual_clip=cfg.clip.dual or None,
    )  # fmt: skip


def _gspo(
    logprobs: torch.Tensor, proximal: torch.Tensor, _sampler: torch.Tensor,
    adv: torch.Tensor, mb: Batch, cfg: AlgorithmConfig,
) -> PolicyLossOutput:  # fmt: skip
    seq_adv = _sequence_advantage(adv, mb)
    return gspo_policy_loss(
        logprobs, proximal, seq_adv, mb.loss_mask, eps_low=cfg.clip.low, eps_high=cfg.clip.high
    )


def _decoupled_ppo(
    logprobs: torch.Tensor, proximal: torch.Tensor, sampler: torch.Tensor,
    adv: torch.Tensor, mb: Batch, cfg: AlgorithmConfig,
) -> PolicyLossOutput:  # fmt: skip
    """PPO clip around the proximal policy, reweighted by pi_prox / pi_sampler capped at
    ``off_policy.cap``: PPO with token-level TIS is decoupled PPO (AReaL)."""
    return decoupled_policy_loss(
        logprobs, proximal, sampler, adv, mb.loss_mask, eps_low=cfg.clip.low,
        eps_high=cfg.clip.high, max_weight=cfg.off_policy.cap, dual_clip=cfg.clip.dual or None,
    )  # fmt: skip


def _cispo(
    logprobs: torch.Tensor, proximal: torch.Tensor, _sampler: torch.Tensor,
    adv: torch.Tensor, mb: Batch, cfg: AlgorithmConfig,
) -> PolicyLossOutput:  # fmt: skip
    eps_low = cfg.clip.low if cfg.clip.low < 1.0 else None  # 1: no lower bound
    return cispo_policy_loss(
        logprobs, proximal, adv, mb.loss_mask, eps_low=eps_low, eps_high=cfg.clip.high
    )


def _gmpo(
    logprobs: torch.Tensor, proximal: torch.Tensor, _sampler: torch.Tensor,
    adv: torch.Tensor, mb: Batch, cfg: AlgorithmConfig,
) -> PolicyLossOutput:  # fmt: skip
    seq_adv = _sequence_advantage(adv, mb)
    return gmpo_policy_loss(
        logprobs, proximal, seq_adv, mb.loss_mask, eps_low=cfg.clip.low, eps_high=cfg.clip.high
    )


def _sapo(
    logprobs: torch.Tensor, proximal: torch.Tensor, _sampler: torch.Tensor,
    adv: torch.Tensor, mb: Batch, cfg: AlgorithmConfig,
) -> PolicyLossOutput:  # fmt: skip
    return sapo_policy_loss(
        logprobs, proximal, adv, mb.loss_mask, tau_pos=cfg.sapo.tau_pos, tau_neg=cfg.sapo.tau_neg
    )


POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo": _ppo, "gspo": _gspo, "cispo": _cispo, "gmpo": _gmpo, "sapo": _sapo,
}  # fmt: skip
"""``algorithm.policy_loss``: the per-token surrogate (docs/algorithms.md)."""

Correction = Callable[
    [PolicyLossOutput, torch.Tensor, Batch, AlgorithmConfig],
    tuple[PolicyLossOutput, torch.Tensor, dict[str, torch.Tensor]],
]
"""(loss, proximal log-probs, batch, config) -> (loss, its mask, metrics)."""


def _no_correction(
    out: PolicyLossOutput, proximal: torch.Tensor, mb: Batch, cfg: AlgorithmConfig
) -> tuple[PolicyLossOutput, torch.Tensor, dict[str, torch.Tensor]]:
    if cfg.off_policy.correction == "token_tis":  # decoupled PPO applied the weights: report them
        w = token_tis_weights(proximal, mb.old_logprobs, mb.loss_mask, cap=cfg.off_policy.cap)
        return out, mb.loss_mask, w.metrics
    return out, mb.loss_mask, {}


def _token_tis(
    out: PolicyLossOutput, proximal: torch.Tensor, mb: Batch, cfg: AlgorithmConfig
) -> tuple[PolicyLossOutput, torch.Tensor, dict[str, torch.Tensor]]:
    w = token_tis_weights(proximal, mb.old_logprobs, mb.loss_mask, cap=cfg.off_policy.cap)
    return _reweighted(out, w.weights, mb.loss_mask), mb.loss_mask, w.metrics


def _sequence_tis(
    out: PolicyLossOutput, proximal: torch.Tensor, mb: Batch, cfg: AlgorithmConfig
) -> tuple[PolicyLossOutput, torch.Tensor, dict[str, torch.Tensor]]:
    w = sequence_tis_weights(proximal, mb.old_logprobs, mb.loss_mask, cap=cfg.off_policy.cap)
    return _reweighted(out, w.weights, mb.loss_mask), mb.loss_mask, w.metrics


def _sequence_mask(
    out: PolicyLossOutput, proximal: torch.Tensor, mb: Batch, cfg: AlgorithmConfig
) -> tuple[PolicyLossOutput, torch.Tensor, dict[str, torch.Tensor]]:
    keep = sequence_ratio_mask(
        proximal, mb.old_logprobs, mb.loss_mask, max_ratio=cfg.off_policy.cap
    )
    return out, mb.loss_mask & keep.keep[:, None], keep.metrics


def _masked(
    out: PolicyLossOutput, proximal: torch.Tensor, mb: Batch, cfg: AlgorithmConfig
) -> tuple[PolicyLossOutput, torch.Tensor, dict[str, torch.Tensor]]:
    """Masked importance sampling (token, sequence, IcePop): the ratio inside the band,
    the token dropped outside it (it keeps its place in the normaliser)."""
    low, high = cfg.off_policy.band
    weigh = MASKED_WEIGHTS[cfg.off_policy.correction]
    w = weigh(proximal, mb.old_logprobs, mb.loss_mask, min_ratio=low, max_ratio=high)
    return _reweighted(out, w.weights, mb.loss_mask), mb.loss_mask & w.keep, w.metrics


MASKED_WEIGHTS: dict[str, Callable[..., MaskedWeights]] = {
    "token_mis": token_mis_weights, "sequence_mis": sequence_mis_weights,
    "icepop": icepop_weights,
}  # fmt: skip


def _geometric_mask(
    out: PolicyLossOutput, proximal: torch.Tensor, mb: Batch, cfg: AlgorithmConfig
) -> tuple[PolicyLossOutput, torch.Tensor, dict[str, torch.Tensor]]:
    low, high = cfg.off_policy.band
    keep = geometric_sequence_mask(
        proximal, mb.old_logprobs, mb.loss_mask, min_ratio=low, max_ratio=high
    )
    return out, mb.loss_mask & keep.keep[:, None], keep.metrics


CORRECTIONS: dict[str, Correction] = {
    "none": _no_correction,
    "auto": _no_correction,  # the trainer resolves it (config.resolved); a bare learner: none
    "token_tis": _token_tis,  # with PPO the trainer uses _decoupled_ppo instead
    "sequence_tis": _sequence_tis,
    "sequence_mask": _sequence_mask,
    "token_mis": _masked,
    "sequence_mis": _masked,
    "icepop": _masked,
    "geometric_mask": _geometric_mask,
}
"""``algorithm.off_policy``: how the sampler/learner gap is corrected (docs/algorithms.md)."""
