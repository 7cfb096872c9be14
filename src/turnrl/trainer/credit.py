"""Credit assignment for the loop: from episode rewards to the advantage of every token.

Two shapes of estimator:

- *group* estimators (GRPO, Dr. GRPO, RLOO) give each trajectory one advantage, compared
  within the G trajectories of its task (``group_advantages``);
- REINFORCE++ (and its group-baseline variant) whiten per-token returns over every sampled
  token of the batch (``reinforce_pp_sample_advantages``);
- GiGPO gives each *turn* its own advantage: the episode-level GRPO term plus a step-level
  term computed among the turns of the task's trajectories that acted on an identical
  context (``gigpo_turn_advantages``). Identical contexts are found exactly, by the token
  ids the policy saw before the turn.

``token_advantages`` spreads per-turn values over a trajectory's samples, token-aligned
with ``Trajectory.samples``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence

import torch

from turnrl.algorithms import (
    discounted_step_returns,
    dr_grpo_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    step_group_advantages,
)
from turnrl.types import Trajectory

ADVANTAGES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
}
"""Group advantage estimators by ``algorithm.advantage`` name, ``[1, G] -> [1, G]``."""


def batch_rewards(
    groups: Sequence[Sequence[Trajectory]], shuffle_seed: int | None = None
) -> list[list[float]]:
    """Each trajectory's reward, group by group. With ``shuffle_seed`` the rewards are
    permuted across the whole batch: the negative control in which rewards carry no
    information about the samples they are paired with."""
    rewards = [[t.reward for t in g] for g in groups]
    if shuffle_seed is not None:
        flat = [x for g in rewards for x in g]
        random.Random(shuffle_seed).shuffle(flat)
        it = iter(flat)
        rewards = [[next(it) for _ in g] for g in rewards]
    return rewards


def group_advantages(
    groups: Sequence[Sequence[Trajectory]],
    *,
    shuffle_seed: int | None = None,
    estimator: str = "grpo",
) -> list[list[float]]:
    """Advantages per group (``estimator`` of ``ADVANTAGES``), over the members without an
    infrastructure error.

    Errored members get advantage 0 (they are excluded from training anyway).
    """
    rewards = batch_rewards(groups, shuffle_seed)
    out: list[list[float]] = []
    for group, group_rewards in zip(groups, rewards, strict=True):
        valid = [i for i, t in enumerate(group) if t.error is None]
        adv = [0.0] * len(group)
        if valid:
            rewards_row = torch.tensor([[group_rewards[i] for i in valid]])
            if estimator == "rloo" and len(valid) < 2:
                values = torch.zeros_like(rewards_row[0])  # no other member to compare with
            else:
                values = ADVANTAGES[estimator](rewards_row)[0]
            for i, a in zip(valid, values.tolist(), strict=True):
                adv[i] = float(a)
        out.append(adv)
    return out


SampleValues = list[float | list[float]]
"""Per sample of a trajectory (``Trajectory.samples``): one value, or one per token."""


def reinforce_pp_sample_advantages(
    groups: Sequence[Sequence[Trajectory]],
    *,
    baseline: bool = False,
    shuffle_seed: int | None = None,
    kl: Mapping[int, list[list[float]]] | None = None,
    kl_coef: float = 0.0,
) -> list[list[SampleValues]]:
    """REINFORCE++ advantage of every sampled token (ALGORITHMS.md), per sample.

    The reward is paid on a trajectory's last sampled token; with ``kl`` (per sample, per
    token, keyed by ``id(trajectory)``) each sampled token also pays ``-kl_coef * KL_t``
    (the KL in the reward, as in the paper). The return of a token sums what is paid from
    it on, over sampled tokens only (tool output is skipped); the returns are whitened over
    every sampled token of the batch (``reinforce_pp_advantages``), so without a KL every
    token of a trajectory has the same advantage and long trajectories weigh more in the
    batch mean. ``baseline`` first subtracts each group's mean reward
    (REINFORCE++-baseline). Errored members take no part and get 0.
    """
    rewards = batch_rewards(groups, shuffle_seed)
    out: list[list[SampleValues]] = [[[0.0] * len(t.samples()) for t in g] for g in groups]
    rows: list[tuple[int, int, float, list[int], list[float]]] = []
    for g, (group, group_rewards) in enumerate(zip(groups, rewards, strict=True)):
        valid = [i for i, t in enumerate(group) if t.error is None and t.turns]
        mean = sum(group_rewards[i] for i in valid) / len(valid) if valid else 0.0
        for i in valid:
            traj = group[i]
            mask = [m for s in traj.samples() for m in s.loss_mask]
            kl_row = [x for part in kl[id(traj)] for x in part] if kl else [0.0] * len(mask)
            value = group_rewards[i] - mean if baseline else group_rewards[i]
            rows.append((g, i, value, mask, kl_row))
    if not rows:
        return out
    width = max(len(mask) for *_, mask, _ in rows)
    mask_t = torch.zeros(len(rows), width, dtype=torch.bool)
    kl_t = torch.zeros(len(rows), width, dtype=torch.float64)
    for r, (*_, mask, kl_row) in enumerate(rows):
        mask_t[r, : len(mask)] = torch.tensor(mask, dtype=torch.bool)
        kl_t[r, : len(kl_row)] = torch.tensor(kl_row, dtype=torch.float64)
    values = torch.tensor([v for _, _, v, _, _ in rows], dtype=torch.float64)
    adv = reinforce_pp_advantages(values, mask_t, kl=kl_t, kl_coef=kl_coef)
    for r, (g, i, _, mask, _) in enumerate(rows):
        flat = adv[r, : len(mask)].tolist()
        pieces: SampleValues = []
        start = 0
        for sample in groups[g][i].samples():
            pieces.append(flat[start : start + len(sample.input_ids)])
            start += len(sample.input_ids)
        out[g][i] = pieces
    return out


def turn_contexts(trajectory: Trajectory) -> list[tuple[int, ...]]:
    """The exact token context the policy saw before each of its turns."""
    contexts: list[tuple[int, ...]] = []
    seen: list[int] = []
    for turn in trajectory.turns:
        if turn.new_sample:
            seen = []  # a template break re-renders the whole context
        seen.extend(turn.prompt_ids)
        contexts.append(tuple(seen))
        seen.extend(turn.completion_ids)
    return contexts


def gigpo_turn_advantages(
    groups: Sequence[Sequence[Trajectory]],
    *,
    gamma: float = 0.95,
    omega: float = 1.0,
    shuffle_seed: int | None = None,
) -> list[list[list[float]]]:
    """GiGPO advantage of every turn of every trajectory, ``[group][member][turn]``:
    A_episode + omega * A_step (ALGORITHMS.md "GiGPO"; the algorithms' ``gigpo_advantages``
    on the same layout, except that errored members are left out of both levels).

    All groups must have the same size G (the rollout's group size). The reward is given at
    the last turn; errored trajectories take no part (their turns get 0). Anchor states are
    exact: two turns of one task share an anchor when the token contexts before them are
    equal (e.g. the same question and the same tool output).
    """
    if not groups:
        return []
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"GiGPO needs groups of one size, got sizes {sorted(sizes)}")
    (group_size,) = sizes
    # Episode level: GRPO over each group's valid members (the errored ones get 0), on the
    # same (possibly shuffled) rewards as the step level.
    episode = group_advantages(groups, shuffle_seed=shuffle_seed, estimator="grpo")
    rewards = batch_rewards(groups, shuffle_seed)
    flat = [t for g in groups for t in g]
    flat_rewards = [r for g in rewards for r in g]
    steps = max((len(t.turns) for t in flat), default=0)
    step_rewards = torch.zeros(len(flat), max(steps, 1), dtype=torch.float64)
    step_mask = torch.zeros_like(step_rewards, dtype=torch.bool)
    anchors = torch.zeros_like(step_rewards, dtype=torch.long)
    ids: dict[tuple[int, ...], int] = {}
    for row, (traj, reward) in enumerate(zip(flat, flat_rewards, strict=True)):
        if traj.error is not None or not traj.turns:
            continue
        n = len(traj.turns)
        step_mask[row, :n] = True
        step_rewards[row, n - 1] = reward
        for s, context in enumerate(turn_contexts(traj)):
            anchors[row, s] = ids.setdefault(context, len(ids))
    returns = discounted_step_returns(step_rewards, step_mask, gamma=gamma)
    step = step_group_advantages(returns, anchors, step_mask, group_size=group_size)
    out: list[list[list[float]]] = []
    for g, group in enumerate(groups):
        members: list[list[float]] = []
        for i, traj in enumerate(group):
            row = g * group_size + i
            valid = traj.error is None
            members.append(
                [
                    episode[g][i] + omega * float(step[row, s]) if valid else 0.0
                    for s in range(len(traj.turns))
                ]
            )
        out.append(members)
    return out


def token_advantages(trajectory: Trajectory, turn_values: Sequence[float]) -> list[list[float]]:
    """Per-turn values spread over the tokens of ``trajectory.samples()``: each turn's
    prompt and completion tokens take that turn's value (only completion tokens are trained
    on; the prompt's values are never read)."""
    if len(turn_values) != len(trajectory.turns):
        raise ValueError(
            f"{len(turn_values)} turn values for a trajectory of {len(trajectory.turns)} turns"
        )
    out: list[list[float]] = []
    current: list[float] = []
    for turn, value in zip(trajectory.turns, turn_values, strict=True):
        if turn.new_sample and current:
            out.append(current)
            current = []
        current.extend([float(value)] * (len(turn.prompt_ids) + len(turn.completion_ids)))
    if current:
        out.append(current)
    return out
