"""RL estimators and losses as pure tensor functions (docs/algorithms.md is the reference).

- ``advantages``: critic-free advantages (GRPO, Dr. GRPO, RLOO, REINFORCE++) and group stats;
- ``gae``: GAE and turn-level (bi-level) GAE over multi-turn sequences, skipping masked tokens;
- ``gigpo``: GiGPO's episode- and step-level group advantages;
- ``turns``: turns of a sequence read off its loss mask;
- ``losses``: per-token PPO clip (decoupled, dual clip), GSPO, CISPO, GMPO, SAPO, value loss,
  entropy;
- ``reductions``: masked sums and means, and the four loss-aggregation modes;
- ``kl``: the k1, k2, k3 and k3+ estimators of KL to a reference policy;
- ``distill``: on-policy distillation's per-token advantage (reverse KL to a teacher);
- ``selection``: DAPO dynamic sampling and overlong shaping, StarPO-S variance filter;
- ``off_policy``: truncated and masked importance sampling (token, sequence, IcePop),
  sequence masking (product or geometric-mean ratio), decoupled PPO, lag.

Nothing here touches a model, an optimiser, a config or a rollout.
"""

from turnrl.algorithms.advantages import (
    dr_grpo_advantages,
    group_reward_std,
    grpo_advantages,
    masked_whiten,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    zero_variance_groups,
)
from turnrl.algorithms.distill import distillation_advantages
from turnrl.algorithms.gae import AdvantagesAndReturns, gae_advantages, turn_level_gae_advantages
from turnrl.algorithms.gigpo import (
    discounted_step_returns,
    gigpo_advantages,
    step_group_advantages,
)
from turnrl.algorithms.kl import KL_ESTIMATORS, kl_k1, kl_k2, kl_k3, kl_k3_plus
from turnrl.algorithms.losses import (
    PolicyLossOutput,
    ValueLossOutput,
    cispo_policy_loss,
    clip_fraction,
    clipped_policy_loss,
    clipped_value_loss,
    entropy_from_logits,
    gmpo_policy_loss,
    gspo_policy_loss,
    policy_ratio,
    sapo_policy_loss,
    sequence_ratio,
)
from turnrl.algorithms.off_policy import (
    ImportanceWeights,
    MaskedWeights,
    SequenceMask,
    decoupled_policy_loss,
    geometric_sequence_mask,
    icepop_weights,
    policy_lag_metrics,
    sequence_mis_weights,
    sequence_ratio_mask,
    sequence_tis_weights,
    token_mis_weights,
    token_tis_weights,
)
from turnrl.algorithms.reductions import (
    masked_mean,
    masked_sum,
    seq_mean_token_mean,
    seq_mean_token_sum,
    seq_mean_token_sum_norm,
    token_mean,
)
from turnrl.algorithms.selection import (
    informative_groups,
    overlong_filter_mask,
    overlong_penalty,
    top_variance_groups,
)
from turnrl.algorithms.turns import turn_end_mask, turn_index, turn_values_to_tokens

__all__ = [
    "KL_ESTIMATORS",
    "AdvantagesAndReturns",
    "ImportanceWeights",
    "MaskedWeights",
    "PolicyLossOutput",
    "SequenceMask",
    "ValueLossOutput",
    "cispo_policy_loss",
    "clip_fraction",
    "clipped_policy_loss",
    "clipped_value_loss",
    "decoupled_policy_loss",
    "discounted_step_returns",
    "distillation_advantages",
    "dr_grpo_advantages",
    "entropy_from_logits",
    "gae_advantages",
    "geometric_sequence_mask",
    "gigpo_advantages",
    "gmpo_policy_loss",
    "group_reward_std",
    "grpo_advantages",
    "gspo_policy_loss",
    "icepop_weights",
    "informative_groups",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_k3_plus",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "overlong_filter_mask",
    "overlong_penalty",
    "policy_lag_metrics",
    "policy_ratio",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "sapo_policy_loss",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "sequence_mis_weights",
    "sequence_ratio",
    "sequence_ratio_mask",
    "sequence_tis_weights",
    "step_group_advantages",
    "token_mean",
    "token_mis_weights",
    "token_tis_weights",
    "top_variance_groups",
    "turn_end_mask",
    "turn_index",
    "turn_level_gae_advantages",
    "turn_values_to_tokens",
    "zero_variance_groups",
]
