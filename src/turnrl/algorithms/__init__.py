"""RL estimators and losses as pure tensor functions (ALGORITHMS.md is the reference).

``advantages`` maps rewards to advantages; ``losses`` holds policy losses and the masked
reductions that aggregate them. Nothing here touches a model, an optimiser or a rollout.
"""

from turnrl.algorithms.advantages import (
    group_reward_std,
    grpo_advantages,
    rloo_advantages,
    zero_variance_groups,
)
from turnrl.algorithms.losses import (
    PolicyLossOutput,
    clip_fraction,
    clipped_policy_loss,
    kl_k3,
    masked_mean,
    masked_sum,
    policy_ratio,
    token_mean,
)

__all__ = [
    "PolicyLossOutput",
    "clip_fraction",
    "clipped_policy_loss",
    "group_reward_std",
    "grpo_advantages",
    "kl_k3",
    "masked_mean",
    "masked_sum",
    "policy_ratio",
    "rloo_advantages",
    "token_mean",
    "zero_variance_groups",
]
