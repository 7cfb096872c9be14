"""The critic for PPO: a value per sampled-token state, trained on GAE returns.

Two placements (``algorithm.critic``):

- ``head``: a linear value head reading the policy's own last hidden states. The features
  are detached, so the value loss trains the head only and never pulls the policy; the
  cheapest critic, and the one that shares the policy's view of the context.
- ``model``: a separate value model, a copy of the policy as RL starts plus a value head,
  trained whole with its own optimizer and learning rate (``algorithm.critic.lr``).

The value of sampled token t is read at position t - 1, the state the token was chosen in
(the same position its log-prob comes from). Values exist only where ``loss_mask`` is 1:
GAE (``gae_advantages``) skips masked tool-output and prompt tokens.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from turnrl.algorithms import clipped_value_loss, masked_mean, token_mean
from turnrl.rollout.batch import Batch
from turnrl.trainer.config import AlgorithmConfig
from turnrl.trainer.forward import hidden_states


class Critic:
    """Owns the value head (and, with ``critic = "model"``, a value trunk) and its optimizer."""

    def __init__(self, policy: Any, config: AlgorithmConfig, trunk: Any = None) -> None:
        """``trunk``: the value model's trunk with ``placement = "model"`` (default: a copy of
        ``policy``; a learner rank gives its own sharded one)."""
        self.config = config
        self.shared = config.critic.placement == "head"
        if self.shared:
            self.trunk = policy
        else:
            self.trunk = trunk if trunk is not None else copy.deepcopy(policy)
        hidden = int(policy.config.hidden_size)
        param = next(policy.parameters())
        self.head = torch.nn.Linear(hidden, 1, device=param.device, dtype=param.dtype)
        torch.nn.init.zeros_(self.head.weight)  # V = 0 to start: advantages = returns
        torch.nn.init.zeros_(self.head.bias)
        params = list(self.head.parameters())
        if not self.shared:
            params += list(self.trunk.parameters())
        self.optimizer = torch.optim.AdamW(params, lr=config.critic.lr)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: the head, the trunk (separate model only), the
        optimizer."""
        state: dict[str, Any] = {
            "head": self.head.state_dict(), "optimizer": self.optimizer.state_dict()
        }  # fmt: skip
        if not self.shared:
            state["trunk"] = self.trunk.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.head.load_state_dict(state["head"])
        if not self.shared:
            self.trunk.load_state_dict(state["trunk"])
        self.optimizer.load_state_dict(state["optimizer"])

    def values(self, mb: Batch, *, grad: bool = False) -> torch.Tensor:
        """V of each sampled token's state, ``[B, T]`` (0 where ``loss_mask`` is 0)."""
        target = mb.loss_mask.clone()
        target[:, 0] = False
        b, t = target.nonzero(as_tuple=True)
        with torch.set_grad_enabled(grad and not self.shared):
            hidden = hidden_states(self.trunk, mb.input_ids, mb.attention_mask)[b, t - 1]
        with torch.set_grad_enabled(grad):
            picked = self.head(hidden.float() if hidden.dtype != torch.float32 else hidden)
            out = torch.zeros(mb.input_ids.shape, dtype=picked.dtype, device=picked.device)
            return out.index_put((b, t), picked[:, 0])

    def step(
        self,
        micro: Sequence[Batch],
        returns: Sequence[torch.Tensor],
        old_values: Sequence[torch.Tensor],
        num_tokens: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """``critic.epochs`` optimizer steps on the clipped value loss (token mean over the
        whole batch, exact under micro-batching; ``num_tokens``: the whole batch's sampled
        tokens where ``micro`` is one rank's part of it)."""
        cfg = self.config
        if num_tokens is None:
            num_tokens = torch.stack([mb.loss_mask.sum() for mb in micro]).sum().clamp(min=1)
        num_tokens = num_tokens.float()
        clip = cfg.critic.value_clip if cfg.critic.value_clip > 0 else None
        self.trunk.train()
        totals = {"loss": 0.0, "clipped": 0.0, "error": 0.0}
        for epoch in range(cfg.critic.epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for mb, ret, old in zip(micro, returns, old_values, strict=True):
                values = self.values(mb, grad=True)
                out = clipped_value_loss(values, old, ret, mb.loss_mask, clip_range=clip)
                loss = token_mean(out.per_token_loss, mb.loss_mask, num_tokens)
                torch.autograd.backward(loss)
                if epoch == 0:
                    with torch.no_grad():
                        share = float(mb.loss_mask.sum() / num_tokens)
                        totals["loss"] += float(loss)
                        totals["clipped"] += float(
                            masked_mean(out.clipped.float(), mb.loss_mask) * share
                        )
                        err = (values - ret).abs()
                        totals["error"] += float(masked_mean(err, mb.loss_mask) * share)
            self.clip_gradients()
            self.optimizer.step()
        return {  # each this micro-batch set's part of the whole batch's value
            "critic/value_loss": totals["loss"],
            "critic/value_clip_frac": totals["clipped"],
            "critic/abs_error": totals["error"],
        }

    def clip_gradients(self) -> None:
        """Clip the critic's gradients to ``max_grad_norm`` (their joint norm)."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm)
