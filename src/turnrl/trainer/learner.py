"""The learner: recompute log-probs, take one clipped policy-gradient step.

Micro-batches accumulate gradients; the loss of each is normalised by the token count of
the *whole* batch, so accumulation gives the same gradient as one big batch. On the first
pass after fresh rollouts the recomputed log-probs must equal the sampler's: their gap is
logged every step as ``train/logprob_mismatch`` (DESIGN.md invariant 3).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from turnrl.algorithms import (
    KL_ESTIMATORS,
    PolicyLossOutput,
    clipped_policy_loss,
    gspo_policy_loss,
    masked_mean,
    seq_mean_token_mean,
    seq_mean_token_sum,
    seq_mean_token_sum_norm,
    sequence_ratio_mask,
    sequence_tis_weights,
    token_mean,
    token_tis_weights,
)
from turnrl.errors import ConfigError
from turnrl.rollout.batch import Batch, pack
from turnrl.trainer.config import AlgorithmConfig
from turnrl.types import Sample

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


class Learner:
    """Owns the optimizer; ``step`` applies one update from one batch.

    With ``kl_coef > 0`` the reference policy is ``reference`` (or a frozen copy of the
    model as it is now); otherwise no reference model exists.
    """

    def __init__(
        self,
        model: Any,
        config: AlgorithmConfig,
        *,
        temperature: float,
        reference: Any = None,
        max_length: int = 0,
    ) -> None:
        if config.loss_reduction == "seq_mean_token_sum_norm" and max_length <= 0:
            raise ConfigError("loss_reduction seq_mean_token_sum_norm needs max_length > 0")
        self.model = model
        self.config = config
        self.temperature = temperature
        self.max_length = max_length
        self.kl_estimator = KL_ESTIMATORS[config.kl_estimator]
        self.ref_model: Any = None
        if config.kl_coef > 0:
            ref = reference if reference is not None else copy.deepcopy(model)
            self.ref_model = ref.eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=config.lr, weight_decay=config.weight_decay
        )

    def step_samples(
        self,
        samples: Sequence[Sample],
        advantages: Sequence[float | Sequence[float]],
        pad_id: int,
    ) -> dict[str, float]:
        """One update from token-exact samples: micro-batches of similar length, so little
        work is spent on padding; the result equals one update on the whole batch."""
        order = sorted(range(len(samples)), key=lambda i: len(samples[i].input_ids))
        size = self.config.micro_batch_size
        chunks = [
            pack([samples[i] for i in part], [advantages[i] for i in part], pad_id)
            for part in (order[s : s + size] for s in range(0, len(order), size))
        ]
        return self.step(chunks)

    def step(self, batch: Batch | Sequence[Batch]) -> dict[str, float]:
        """One update from a batch (split into micro-batches) or from given micro-batches."""
        cfg = self.config
        if isinstance(batch, Batch):
            micro = [
                batch.select(slice(s, s + cfg.micro_batch_size))
                for s in range(0, batch.num_sequences, cfg.micro_batch_size)
            ]
        else:
            micro = list(batch)
        self.model.train()
        num_tokens = torch.stack([mb.loss_mask.sum() for mb in micro]).sum().clamp(min=1).float()
        num_sequences = sum(mb.num_sequences for mb in micro)
        # Pass 0 is on-policy: its ratio is exactly 1 (the clip is anchored at the learner's
        # own first-pass log-probs) and its log-prob gap to the sampler is the mismatch.
        # Further passes (``epochs`` > 1) reuse the batch; the clip bounds them.
        num_seqs = torch.stack([mb.loss_mask.any(-1).sum() for mb in micro]).sum().clamp(min=1)
        norms = (num_tokens, num_seqs.float())
        proximal: list[torch.Tensor] = []
        passes = [self._pass(micro, norms, proximal) for _ in range(cfg.epochs)]
        totals, grad_norm = passes[0]
        clipped = sum(t["clipped"] for t, _ in passes) / len(passes)
        off_policy = {k: v for k, v in totals.items() if k.startswith("off_policy/")}
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
        num_tokens, num_seqs = norms
        match self.config.loss_reduction:
            case "token_mean":
                return token_mean(per_token, mask, num_tokens)
            case "seq_mean_token_mean":
                return seq_mean_token_mean(per_token, mask, num_seqs)
            case "seq_mean_token_sum":
                return seq_mean_token_sum(per_token, mask, num_seqs)
            case "seq_mean_token_sum_norm":
                return seq_mean_token_sum_norm(per_token, mask, float(self.max_length))

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
        cfg = self.config
        mask = mb.loss_mask
        adv = mb.advantages if mb.advantages.ndim == 2 else mb.advantages[:, None]
        if cfg.policy_loss == "gspo":
            seq_adv = adv[:, :1] if mb.advantages.ndim == 1 else _sequence_advantage(adv, mask)
            out = gspo_policy_loss(
                logprobs, proximal, seq_adv, mask, eps_low=cfg.eps_low, eps_high=cfg.eps_high
            )
        else:
            out = clipped_policy_loss(
                logprobs, proximal, adv, mask, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                dual_clip=cfg.dual_clip or None,
            )  # fmt: skip
        metrics: dict[str, torch.Tensor] = {}
        match cfg.off_policy:
            case "token_tis":
                w = token_tis_weights(proximal, mb.old_logprobs, mask, cap=cfg.tis_cap)
                out = _reweighted(out, w.weights, mask)
                metrics = w.metrics
            case "sequence_tis":
                w = sequence_tis_weights(proximal, mb.old_logprobs, mask, cap=cfg.tis_cap)
                out = _reweighted(out, w.weights, mask)
                metrics = w.metrics
            case "sequence_mask":
                keep = sequence_ratio_mask(proximal, mb.old_logprobs, mask, max_ratio=cfg.tis_cap)
                mask = mask & keep.keep[:, None]
                metrics = keep.metrics
            case "none":
                pass
        return out, mask, metrics

    def _pass(
        self,
        micro: Sequence[Batch],
        norms: tuple[torch.Tensor, torch.Tensor],
        proximal: list[torch.Tensor],
    ) -> tuple[dict[str, float], float]:
        """One optimizer step over all micro-batches; returns its totals and grad norm.

        ``proximal`` is empty on the first pass and is filled with each micro-batch's
        detached log-probs, the anchor of the clip for this and later passes.
        """
        cfg = self.config
        num_tokens = norms[0]
        first = not proximal
        self.optimizer.zero_grad(set_to_none=True)
        totals = dict.fromkeys(("loss", "kl", "entropy", "clipped", "abs_gap", "max_gap"), 0.0)
        for i, mb in enumerate(micro):
            logprobs, entropy = token_logprobs(
                self.model, mb.input_ids, mb.attention_mask, mb.loss_mask, self.temperature,
                entropy_grad=cfg.entropy_coef > 0,
            )  # fmt: skip
            if first:
                proximal.append(logprobs.detach())
            out, mask, off_policy = self._policy_loss(logprobs, proximal[i], mb)
            loss = self._reduce(out.per_token_loss, mask, norms)
            totals["loss"] += float(loss.detach())
            if cfg.entropy_coef > 0:
                loss = loss - cfg.entropy_coef * self._reduce(entropy, mb.loss_mask, norms)
            if self.ref_model is not None:
                with torch.no_grad():
                    ref, _ = token_logprobs(
                        self.ref_model, mb.input_ids, mb.attention_mask, mb.loss_mask,
                        self.temperature,
                    )  # fmt: skip
                kl = self._reduce(
                    self.kl_estimator(logprobs, ref, mb.loss_mask), mb.loss_mask, norms
                )
                loss = loss + cfg.kl_coef * kl
                totals["kl"] += float(kl.detach())
            torch.autograd.backward(loss)
            with torch.no_grad():
                gap = torch.where(mb.loss_mask, (logprobs - mb.old_logprobs).abs(), 0.0)
                share = mb.loss_mask.sum() / num_tokens
                totals["entropy"] += float(masked_mean(entropy.detach(), mb.loss_mask) * share)
                totals["clipped"] += float(masked_mean(out.clipped.float(), mb.loss_mask) * share)
                totals["abs_gap"] += float(gap.sum() / num_tokens)
                totals["max_gap"] = max(totals["max_gap"], float(gap.max()))
                for name, value in off_policy.items():
                    key = f"off_policy/{name}"
                    totals[key] = totals.get(key, 0.0) + float(value) * float(share)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
        self.optimizer.step()
        return totals, float(grad_norm)


def _sequence_advantage(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One advantage per row, ``[B, T] -> [B, 1]``: the mean over its sampled tokens (the
    row's value when it is the same on every token)."""
    return masked_mean(advantages, mask, dim=1)[:, None]


def _reweighted(
    out: PolicyLossOutput, weights: torch.Tensor, mask: torch.Tensor
) -> PolicyLossOutput:
    """The per-token loss times detached importance weights (``[B, T]`` or ``[B, 1]``)."""
    loss = torch.where(mask, out.per_token_loss * weights.detach(), 0.0)
    return PolicyLossOutput(per_token_loss=loss, clipped=out.clipped, ratio=out.ratio)
