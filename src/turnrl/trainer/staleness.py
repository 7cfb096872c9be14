"""How far behind the learner a step's trajectories were sampled (policy versions).

In a synchronous run every trajectory is sampled by the learner's current weights, and
these metrics say so (lag 0). In asynchronous training (``algorithm.max_staleness`` = k:
trainer/pipeline.py) a batch may be up to k versions behind the learner when it is
trained on; with partial rollouts (``algorithm.partial_rollouts``) an episode's turns may
be sampled by several versions, and an episode counts by its oldest turn.
"""

from __future__ import annotations

from typing import Any

import torch

from turnrl.algorithms import policy_lag_metrics
from turnrl.trainer.config import AlgorithmConfig
from turnrl.trainer.workers import Groups

Row = dict[str, Any]


def version_metrics(sampled: Groups, learner_version: int, algo: AlgorithmConfig) -> Row:
    """The step's policy-lag metrics (``rollout/policy_lag_*``), its staleness histogram
    and, with partial rollouts, the share of episodes sampled across versions and the
    mean lag of their tokens. ``learner_version``: the version of the learner's weights
    before the step's update."""
    versions = torch.tensor([x.oldest_version for g in sampled for x in g], dtype=torch.long)
    lag = policy_lag_metrics(versions, learner_version)
    row: Row = {f"rollout/{name}": float(value) for name, value in lag.items()}
    row.update(staleness_histogram(versions, learner_version, algo.max_staleness))
    if algo.partial_rollouts:
        row["rollout/episodes_across_versions"] = across_versions(sampled)
        row["rollout/policy_lag_tokens_mean"] = token_lag(sampled, learner_version)
    return row


def staleness_histogram(versions: torch.Tensor, learner_version: int, bound: int) -> Row:
    """The share of the step's trajectories sampled ``d`` versions behind the learner, for
    ``d`` in 0..``bound`` (``rollout/staleness_<d>``); a trajectory staler than ``bound``
    raises (the pipeline must never hand one over)."""
    lag = learner_version - versions
    if versions.numel() and int(lag.max()) > bound:
        raise ValueError(
            f"a trajectory {int(lag.max())} versions behind the learner reached the update; "
            f"algorithm.max_staleness is {bound}"
        )
    n = max(versions.numel(), 1)
    return {f"rollout/staleness_{d}": float((lag == d).sum()) / n for d in range(bound + 1)}


def across_versions(groups: Groups) -> float:
    """The share of trajectories whose turns were sampled by more than one policy version
    (partial rollouts: the engine took new weights while the episode was in flight)."""
    trajectories = [x for g in groups for x in g]
    mixed = sum(len({turn.policy_version for turn in x.turns}) > 1 for x in trajectories)
    return mixed / max(len(trajectories), 1)


def token_lag(groups: Groups, learner_version: int) -> float:
    """How many versions behind the learner the step's sampled tokens are, on average:
    with partial rollouts an episode's later turns are fresher than its oldest one, which
    ``rollout/policy_lag_mean`` and the staleness histogram count it by."""
    lags = [
        (learner_version - turn.policy_version, len(turn.completion_ids))
        for g in groups for x in g for turn in x.turns
    ]  # fmt: skip
    return sum(lag * n for lag, n in lags) / max(sum(n for _, n in lags), 1)
