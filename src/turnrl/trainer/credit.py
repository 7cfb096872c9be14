"""Credit assignment for the loop: from episode rewards to the advantage of every token.

Three shapes of estimator:

- *group* estimators (GRPO, Dr. GRPO, RLOO) give each trajectory one advantage, compared
  within the G trajectories of its task (``group_advantages``);
- REINFORCE++ (and its group-baseline variant) whiten per-token returns over every sampled
  token of the batch (``reinforce_pp_sample_advantages``);
- GiGPO gives each *turn* its own advantage: the episode-level GRPO term plus a step-level
  term computed among the turns of the task's trajectories that acted on an identical
  context (``gigpo_turn_advantages``). Identical contexts are found exactly, by the token
  ids the policy saw before the turn.

``token_advantages`` spreads per-turn values over a trajectory's samples, token-aligned
with ``Trajectory.samples``; PPO's critic gets token rewards instead (``token_rewards``).
Each is the trainer's view of a pure function of ``turnrl.algorithms``, which does the
math; ``ESTIMATORS`` names them for ``algorithm.advantage``, resolved once at start-up.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch

from turnrl.algorithms import (
    dr_grpo_advantages,
    gigpo_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from turnrl.trainer.config import AlgorithmConfig
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
    """REINFORCE++ advantage of every sampled token (docs/algorithms.md), per sample:
    ``reinforce_pp_advantages`` (or, with ``baseline``, ``reinforce_pp_baseline_advantages``)
    on the batch laid out as one row per member, its samples' tokens back to back.

    The reward is paid on a trajectory's last sampled token; with ``kl`` (per sample, per
    token, keyed by ``id(trajectory)``) each sampled token also pays ``-kl_coef * KL_t``
    (the KL in the reward, as in the paper). Returns run over sampled tokens only and are
    whitened over every sampled token of the batch. Errored members take no part and get
    0: their row has no sampled token, and with ``baseline`` their reward slot holds their
    group's mean over the other members, so the mean subtracted is theirs alone.
    """
    if not groups:
        return []
    rewards = batch_rewards(groups, shuffle_seed)
    group_size = _one_group_size(groups, "REINFORCE++")
    out: list[list[SampleValues]] = [[[0.0] * len(t.samples()) for t in g] for g in groups]
    masks: list[list[int]] = []
    kls: list[list[float]] = []
    slots: list[list[float]] = []  # [P, G] rewards as the estimator reads them
    for group, group_rewards in zip(groups, rewards, strict=True):
        valid = [t.error is None and bool(t.turns) for t in group]
        kept = [r for r, ok in zip(group_rewards, valid, strict=True) if ok]
        stand_in = sum(kept) / len(kept) if kept else 0.0
        slots.append([r if ok else stand_in for r, ok in zip(group_rewards, valid, strict=True)])
        for traj, ok in zip(group, valid, strict=True):
            mask = [m for s in traj.samples() for m in s.loss_mask] if ok else []
            masks.append(mask)
            kls.append(
                [x for part in kl[id(traj)] for x in part] if kl and ok else [0.0] * len(mask)
            )
    width = max(1, max(len(m) for m in masks))
    mask_t = torch.zeros(len(masks), width, dtype=torch.bool)
    kl_t = torch.zeros(len(masks), width, dtype=torch.float64)
    for r, (mask, kl_row) in enumerate(zip(masks, kls, strict=True)):
        mask_t[r, : len(mask)] = torch.tensor(mask, dtype=torch.bool)
        kl_t[r, : len(kl_row)] = torch.tensor(kl_row, dtype=torch.float64)
    values = torch.tensor(slots, dtype=torch.float64)  # [P, G]
    if baseline:
        adv = reinforce_pp_baseline_advantages(values, mask_t, kl=kl_t, kl_coef=kl_coef)
    else:
        adv = reinforce_pp_advantages(values.reshape(-1), mask_t, kl=kl_t, kl_coef=kl_coef)
    for g, group in enumerate(groups):
        for i, traj in enumerate(group):
            mask = masks[g * group_size + i]
            if not mask:
                continue
            flat = adv[g * group_size + i, : len(mask)].tolist()
            pieces: SampleValues = []
            start = 0
            for sample in traj.samples():
                pieces.append(flat[start : start + len(sample.input_ids)])
                start += len(sample.input_ids)
            out[g][i] = pieces
    return out


def _one_group_size(groups: Sequence[Sequence[Trajectory]], what: str) -> int:
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"{what} needs groups of one size, got sizes {sorted(sizes)}")
    (size,) = sizes
    return size


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
    ``gigpo_advantages`` (A_episode + omega * A_step, docs/algorithms.md "GiGPO") on each
    group's members without an error, one row per member and one column per turn.

    All groups must have the same size G (the rollout's group size). The reward is given at
    the last turn; errored trajectories take no part in either level (their turns get 0).
    Anchor states are exact: two turns of one task share an anchor when the token contexts
    before them are equal (e.g. the same question and the same tool output).
    """
    if not groups:
        return []
    _one_group_size(groups, "GiGPO")
    rewards = batch_rewards(groups, shuffle_seed)
    out: list[list[list[float]]] = []
    for group, group_rewards in zip(groups, rewards, strict=True):
        members = [[0.0] * len(t.turns) for t in group]
        valid = [i for i, t in enumerate(group) if t.error is None and t.turns]
        if valid:
            steps = max(len(group[i].turns) for i in valid)
            step_rewards = torch.zeros(len(valid), steps, dtype=torch.float64)  # [G', S]
            step_mask = torch.zeros_like(step_rewards, dtype=torch.bool)
            anchors = torch.zeros_like(step_rewards, dtype=torch.long)
            ids: dict[tuple[int, ...], int] = {}
            for row, i in enumerate(valid):
                n = len(group[i].turns)
                step_mask[row, :n] = True
                step_rewards[row, n - 1] = group_rewards[i]
                for k, context in enumerate(turn_contexts(group[i])):
                    anchors[row, k] = ids.setdefault(context, len(ids))
            adv = gigpo_advantages(
                step_rewards, anchors, step_mask, group_size=len(valid), gamma=gamma, omega=omega
            )
            for row, i in enumerate(valid):
                members[i] = adv[row, : len(group[i].turns)].tolist()
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


KL = Mapping[int, list[list[float]]]
"""Per trajectory (keyed by ``id``), per sample, per token: the KL to the reference when it
is paid in the reward; empty when it is not."""


def token_rewards(
    groups: Sequence[Sequence[Trajectory]], kl: KL, kl_coef: float, shuffle_seed: int | None
) -> list[list[SampleValues]]:
    """PPO's input to the critic: per-token rewards of each sample (the reward on the last
    sampled token of the last sample, minus ``kl_coef`` x the KL on every sampled token when
    the KL is in the reward). The learner's critic and GAE turn them into advantages."""
    rewards = batch_rewards(groups, shuffle_seed)
    out: list[list[SampleValues]] = []
    for group, group_rewards in zip(groups, rewards, strict=True):
        members: list[SampleValues] = []
        for traj, reward in zip(group, group_rewards, strict=True):
            pieces = traj.samples()
            values: SampleValues = []
            for k, sample in enumerate(pieces):
                trajectory_kl = kl.get(id(traj))
                row = (
                    [-kl_coef * x for x in trajectory_kl[k]]
                    if trajectory_kl
                    else [0.0] * len(sample.input_ids)
                )
                if k == len(pieces) - 1 and traj.error is None:
                    last = max((i for i, m in enumerate(sample.loss_mask) if m), default=None)
                    if last is not None:
                        row[last] += reward
                values.append(row)
            members.append(values)
        out.append(members)
    return out


@dataclass(frozen=True)
class Estimator:
    """One ``algorithm.advantage`` choice: how a step's groups become per-sample values."""

    assign: Callable[
        [AlgorithmConfig, Sequence[Sequence[Trajectory]], KL, int | None], list[list[SampleValues]]
    ]
    """(algorithm, groups, KL in the reward, shuffle seed) -> ``[group][member][sample]``
    values: an advantage per sample or per token, or (``critic``) token rewards."""
    token_kl: bool = False
    """A KL in the reward is paid token by token (else summed into the episode's reward)."""
    critic: bool = False
    """The values are token rewards for a critic (PPO's GAE), not advantages."""


def _per_sample(
    values: list[list[float]], groups: Sequence[Sequence[Trajectory]]
) -> list[list[SampleValues]]:
    """One value per trajectory, repeated for each of its samples."""
    return [
        [[a] * len(t.samples()) for t, a in zip(g, gv, strict=True)]
        for g, gv in zip(groups, values, strict=True)
    ]


def _group(name: str) -> Estimator:
    return Estimator(
        lambda _algo, groups, _kl, shuffle: _per_sample(
            group_advantages(groups, shuffle_seed=shuffle, estimator=name), groups
        )
    )


def _gigpo(
    algo: AlgorithmConfig, groups: Sequence[Sequence[Trajectory]], _kl: KL, shuffle: int | None
) -> list[list[SampleValues]]:
    turns = gigpo_turn_advantages(
        groups, gamma=algo.gigpo.gamma, omega=algo.gigpo.omega, shuffle_seed=shuffle
    )
    return [
        [list(token_advantages(t, v)) for t, v in zip(g, gv, strict=True)]
        for g, gv in zip(groups, turns, strict=True)
    ]


def _reinforce_pp(baseline: bool) -> Estimator:
    return Estimator(
        lambda algo, groups, kl, shuffle: reinforce_pp_sample_advantages(
            groups,
            baseline=baseline,
            shuffle_seed=shuffle,
            kl=kl or None,
            kl_coef=algo.kl.coef if kl else 0.0,
        ),
        token_kl=True,
    )


ESTIMATORS: Mapping[str, Estimator] = MappingProxyType(
    {
        "grpo": _group("grpo"),
        "dr_grpo": _group("dr_grpo"),
        "rloo": _group("rloo"),
        "gigpo": Estimator(_gigpo),
        "reinforce_pp": _reinforce_pp(baseline=False),
        "reinforce_pp_baseline": _reinforce_pp(baseline=True),
        "gae": Estimator(
            lambda algo, groups, kl, shuffle: token_rewards(groups, kl, algo.kl.coef, shuffle),
            token_kl=True,
            critic=True,
        ),
    }
)
"""Every ``algorithm.advantage`` by name; the trainer picks one at start-up."""
