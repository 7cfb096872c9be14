"""On-policy distillation: the student samples, a frozen teacher scores the very tokens it
sampled, and every sampled token is pushed toward the teacher by the per-token reverse KL.

The reverse KL(pi_s || pi_t) = E_{a ~ pi_s}[log pi_s(a) - log pi_t(a)] is estimated on the
student's own samples by its single-sample estimate k1 = log pi_s(a) - log pi_t(a) per token
(``kl.kl_k1``: unbiased, can be negative). It enters training as a per-token advantage,

    A'_t = A_t - coef * (log pi_s(o_t) - log pi_t(o_t)),    detached,

through the same policy-gradient loss (importance ratio, clip, off-policy correction) as the
RL advantage A_t (0 for pure distillation). Its policy gradient is that of each token's own
reverse KL: tokens the teacher finds less likely than the student are pushed down, those it
finds more likely pushed up, each by how far apart the two are. A token is not credited
with the teacher's view of the tokens after it (a discount of 0, as in the recipes below).
This is the sampled-token form of Thinking Machines' "On-Policy Distillation" (Lu et al.,
2025) and of slime's OPD (advantage minus coef x the token's reverse KL); GKD (Agarwal et
al., ICLR 2024) is its ancestor with the student's own samples (lambda = 1) and the whole
next-token distribution instead of the sampled token (docs/algorithms.md, "On-policy
distillation"). As a direct loss term, k1's expected gradient would be zero
(docs/algorithms.md, "KL to a reference policy"): it has to be an advantage, or k2 in the loss,
which has the same gradient at the first pass but skips the clip and the off-policy
weights.

Nothing here touches a model: the teacher's log-probs come in as a tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from turnrl.algorithms.kl import kl_k1

__all__ = ["distillation_advantages"]


def distillation_advantages(
    advantages: Tensor,
    logprobs: Tensor,
    teacher_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    coef: float,
) -> Tensor:
    """``advantages`` - ``coef`` * (``logprobs`` - ``teacher_logprobs``) per sampled token,
    ``[B, T]``; exactly 0 where ``loss_mask`` is false, whatever the slots hold.

    ``advantages``: the RL advantage, ``[B, T]`` or one per sequence ``[B, 1]`` (zeros for
    pure distillation); ``logprobs``: the student's log-probs of its sampled tokens (the
    sampler's, on-policy); ``teacher_logprobs``: the teacher's of the same tokens. The
    result is data, not a graph: it is detached, as an advantage must be.
    """
    mask = loss_mask.bool()
    reverse_kl = kl_k1(logprobs.detach(), teacher_logprobs.detach(), mask)
    base = torch.where(mask, advantages.detach().expand_as(reverse_kl), 0.0)
    return torch.where(mask, base - coef * reverse_kl, 0.0)
