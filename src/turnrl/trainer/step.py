"""One training step, top to bottom: collect, rewards, select, advantages, update, sync.

``RunParts`` holds what every step needs, built once at start-up (startup.py): the run's
configuration, the environment family, the engine (any ``Backend``), the learner, the
chat renderer, the episode limits and sampling settings, and the choices of the algorithm
resolved to functions (``ESTIMATORS`` for the advantages, the learner's update). Each phase
below is a plain function of it; ``train_step`` calls them in order and returns the step's
metrics row. What lives elsewhere: the math (``turnrl.algorithms``), credit assignment over
trajectories (credit.py), the loop with its evaluations, checkpoints and alarms (loop.py),
the run's start-up (startup.py); and what asynchronous training adds: the steps run with
the next rollouts overlapped (pipeline.py), the staleness metrics (staleness.py), the
rollout workers' protocol (workers.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TextIO, TypeVar

import torch

from turnrl.algorithms import (
    distillation_advantages,
    informative_groups,
    overlong_penalty,
    top_variance_groups,
)
from turnrl.envs import EnvFamily
from turnrl.protocols import Backend
from turnrl.rollout.batch import trainable
from turnrl.rollout.chat import ChatRenderer
from turnrl.rollout.episode import EpisodeLimits, SamplingParams, derive_seed
from turnrl.rollout.failures import check_failures
from turnrl.rollout.groups import GroupSpec, collect_groups, rollout_metrics
from turnrl.trainer.config import Config
from turnrl.trainer.credit import ESTIMATORS, KL, Estimator, SampleValues
from turnrl.trainer.learner import Learner
from turnrl.trainer.staleness import version_metrics
from turnrl.trainer.workers import Groups, RolloutWorkers
from turnrl.types import Sample, Task, Trajectory

Row = dict[str, Any]
T = TypeVar("T")

EXTRA_TASKS = 10**9
"""Task indices of dynamic sampling's extra rounds start here, away from the main stream."""


@dataclass(frozen=True)
class RunParts:
    """The run's parts: everything a step needs, built once at start-up (``config`` may
    change on an alarm with ``monitor.action = "filter"``: ``with_config``). It trains
    nothing itself: the step's phases below take it, and the loop (loop.py) runs them."""

    config: Config
    family: EnvFamily
    backend: Backend
    learner: Learner
    renderer: ChatRenderer
    limits: EpisodeLimits
    sampling: SamplingParams
    estimator: Estimator
    """``algorithm.advantage``, resolved (credit.ESTIMATORS)."""
    update: Callable[[Sequence[Sample], Sequence[float | list[float]], int], dict[str, float]]
    """The learner's update for that estimator: advantages, or a critic's token rewards."""
    workers: RolloutWorkers | None = None
    """Where the episodes run, if not on ``backend`` (``cluster.rollout_workers`` >= 1)."""

    @classmethod
    def build(
        cls,
        config: Config,
        family: EnvFamily,
        backend: Backend,
        learner: Learner,
        renderer: ChatRenderer,
        limits: EpisodeLimits,
        sampling: SamplingParams,
    ) -> RunParts:
        estimator = ESTIMATORS[config.algorithm.advantage]
        update = learner.step_samples_gae if estimator.critic else learner.step_samples
        return cls(config, family, backend, learner, renderer, limits, sampling, estimator, update)

    def with_config(self, config: Config) -> RunParts:
        return dataclasses.replace(self, config=config)


def run_groups(parts: RunParts, tasks: Sequence[Task], spec: GroupSpec) -> Groups:
    """``tasks``' groups of episodes (``groups_of``), run to completion."""
    return run_program(parts, groups_of(parts, tasks, spec))


async def groups_of(parts: RunParts, tasks: Sequence[Task], spec: GroupSpec) -> Groups:
    """``tasks``' groups of episodes: on the rollout workers if the run has any, else on
    the trainer's engine (within its ``run``)."""
    if parts.workers is not None:
        return await parts.workers.collect(tasks, spec)
    return await collect_groups(tasks, parts.family.make_env, parts.backend, parts.renderer, spec)


def run_program(parts: RunParts, program: Coroutine[Any, Any, T]) -> T:
    """Run ``program`` on the trainer's engine, or, with rollout workers, on an event loop
    of its own (where it waits for the workers' answers)."""
    return asyncio.run(program) if parts.workers is not None else parts.backend.run(program)


def sync_engines(parts: RunParts, version: int | None = None, model: Any = None) -> Row:
    """After an update: the engine takes the learner's weights (or ``model``'s, a copy of
    them: trainer/pipeline.py) and its policy version moves on, or becomes ``version``; so
    do the rollout workers. The workers' sync metrics, and a sleeping engine's sleep and
    wake times (``Backend.sleep_metrics``)."""
    source = parts.learner.model if model is None else model
    parts.backend.sync(source)
    if version is not None:
        parts.backend.policy_version = version
    row: Row = dict(parts.backend.sleep_metrics())
    if parts.workers is not None:
        row.update(parts.workers.sync(source, parts.backend.policy_version))
    return row


def train_step(parts: RunParts, step: int, trajectories_out: TextIO) -> Row:
    """One RL step: the metrics row of ``step`` (counted from 0; the row says step + 1)."""
    t0 = time.perf_counter()
    collected = rollout_phase(parts, step)
    row = update_phase(parts, step, collected, parts.backend.policy_version, trajectories_out)
    row.update(sync_engines(parts))  # 6. the engines sample with the new weights from here on
    return timed(row, collected.rollout_s, time.perf_counter() - t0)


def timed(row: Row, rollout_s: float, step_s: float) -> Row:
    """``row`` with the step's wall time, the rollout's share and the rest (the update,
    the sync; in an asynchronous run, the wait for the batch too), and tokens/s."""
    row["perf/rollout_s"], row["perf/step_s"] = rollout_s, step_s
    row["perf/train_s"] = step_s - rollout_s
    row["perf/tokens_per_s"] = row.pop("_tokens") / max(step_s, 1e-9)
    return row


@dataclass
class StepRollouts:
    """What the rollout phase of one step gathered, for its update phase."""

    groups: Groups
    """The groups to train on (after dynamic sampling)."""
    sampled: Groups
    """Every group sampled."""
    row: Row
    """Selection metrics so far."""
    rollout_s: float
    """Seconds the rollout took."""


def rollout_phase(parts: RunParts, step: int) -> StepRollouts:
    """Step ``step``'s episodes (DAPO: until groups are informative), checked for failures:
    ``rollout_program``, run (``run_program``)."""
    t0 = time.perf_counter()
    collected = run_program(parts, rollout_program(parts, step))
    collected.rollout_s = time.perf_counter() - t0  # the engine's start-up included
    return collected


async def rollout_program(parts: RunParts, step: int) -> StepRollouts:
    """The rollout phase as a program of the engine's event loop, so that the batches of
    several steps can share one engine (``algorithm.overlap_batches``: pipeline.py)."""
    t0 = time.perf_counter()
    groups, sampled, row = await collect(parts, step)
    check_failures([x for g in sampled for x in g], parts.config.rollout.max_error_frac,
                   f"step {step + 1}")  # fmt: skip
    return StepRollouts(groups, sampled, row, time.perf_counter() - t0)


def update_phase(
    parts: RunParts,
    step: int,
    rollouts: StepRollouts,
    learner_version: int,
    trajectories_out: TextIO,
) -> Row:
    """Rewards, selection, credit and the policy update on ``rollouts``; the step's metrics row.
    ``learner_version``: the policy version of the learner's weights before this update
    (the sampler's, in a synchronous run; up to ``algorithm.max_staleness`` newer than the
    trajectories' in an asynchronous one). The engine is not synced here (the caller does)."""
    groups, row = rollouts.groups, rollouts.row
    versions = version_metrics(rollouts.sampled, learner_version, parts.config.algorithm)
    kl = shape_rewards(parts, groups, row)  # 2. rewards: overlong penalty, a KL in the reward
    groups = select(parts, groups, row)  # 3. StarPO-S variance filter
    values = parts.estimator.assign(
        parts.config.algorithm, groups, kl, shuffle_seed(parts.config, step)
    )  # 4.
    values = distill(parts, groups, values, row)  # 4b. on-policy distillation's teacher term
    samples, sample_values = trainable_samples(parts, groups, values)
    if samples:
        row.update(
            parts.update(samples, sample_values, parts.backend.pad_id)
        )  # 5. the policy update

    row = {"step": step + 1, **rollout_metrics(rollouts.sampled), **row}
    row.update(versions)  # how many policy versions behind the learner they were sampled
    row["rollout/dropped_errors"] = float(sum(x.error is not None for g in groups for x in g))
    if parts.config.algorithm.overlong.filter:
        row["select/truncated_excluded"] = float(sum(x.truncated for g in groups for x in g))
    row["_tokens"] = sum(x.num_tokens for g in rollouts.sampled for x in g)  # for ``timed``
    log_trajectories(parts, step, groups, values, trajectories_out)
    return row


async def collect(parts: RunParts, step: int) -> tuple[Groups, Groups, Row]:
    """This step's groups to train on, every group sampled, and selection metrics.

    ``prompts_per_step`` groups; with DAPO dynamic sampling, only groups whose rewards
    differ (``informative_groups``) are kept and more prompts are sampled (at most
    ``filter.max_rounds`` rounds in all) until the batch is full.
    """
    r, algo = parts.config.rollout, parts.config.algorithm
    kept: Groups = []
    sampled: Groups = []
    rounds = 0
    while rounds < algo.filter.max_rounds and len(kept) < r.prompts_per_step:
        # Round 0 reads the usual task stream; extra rounds read a disjoint range.
        base = step * r.prompts_per_step if rounds == 0 else EXTRA_TASKS + (
            step * algo.filter.max_rounds + rounds
        ) * r.prompts_per_step  # fmt: skip
        tasks = [parts.family.task(base + j) for j in range(r.prompts_per_step)]
        seed = derive_seed(parts.config.seed, step, *([rounds] if rounds else []))
        group_spec = GroupSpec(
            r.group_size,
            parts.limits,
            parts.sampling,
            seed=seed,
            policy_version=parts.backend.policy_version,
        )
        new = await groups_of(parts, tasks, group_spec)
        sampled.extend(new)
        rounds += 1
        if algo.filter.dynamic_sampling:
            new = [g for g in new if _informative(g)]
        kept.extend(new)
    row: Row = parts.workers.take_metrics() if parts.workers is not None else {}
    if algo.filter.dynamic_sampling:
        row["select/sample_rounds"] = float(rounds)
        row["select/groups_sampled"] = float(len(sampled))
        row["select/groups_kept"] = float(len(kept[: r.prompts_per_step]))
    return kept[: r.prompts_per_step], sampled, row


def _informative(group: Sequence[Trajectory]) -> bool:
    """DAPO's test on the group's members without an error: their rewards differ."""
    rewards = [x.reward for x in group if x.error is None]
    return bool(rewards) and bool(
        informative_groups(torch.tensor([rewards], dtype=torch.float64))[0]
    )


def shape_rewards(parts: RunParts, groups: Groups, row: Row) -> KL:
    """Every change to the rewards, in one place: DAPO's soft overlong penalty (a reward
    component and part of the reward) and, with ``kl.placement = "reward"``, the KL to the
    reference (the ``kl_penalty`` component: summed into the reward for sequence-level
    estimators, returned per token for those that pay it token by token)."""
    algo, r = parts.config.algorithm, parts.config.rollout
    if algo.overlong.penalty_tokens and groups:
        lengths = torch.tensor([[x.num_completion_tokens for x in g] for g in groups])
        penalty = overlong_penalty(
            lengths.reshape(-1), max_length=r.max_episode_tokens,
            cache_length=algo.overlong.penalty_tokens,
        ).reshape(lengths.shape).tolist()  # fmt: skip
        for group, group_penalty in zip(groups, penalty, strict=True):
            for traj, p in zip(group, group_penalty, strict=True):
                traj.reward_components["overlong_penalty"] = p
                traj.reward += p
        row["select/overlong_penalty_mean"] = float(sum(map(sum, penalty))) / max(
            1, sum(map(len, penalty))
        )
    if algo.kl.placement != "reward" or algo.kl.coef == 0:
        return {}
    trajectories = [x for g in groups for x in trainable(g)]
    samples = [s for x in trajectories for s in x.samples()]
    per_sample = iter(parts.learner.reference_kl(samples, parts.backend.pad_id))
    out: dict[int, list[list[float]]] = {}
    for traj in trajectories:
        kl = [next(per_sample) for _ in traj.samples()]
        kl_penalty = -algo.kl.coef * sum(map(sum, kl))
        traj.reward_components["kl_penalty"] = kl_penalty
        if not parts.estimator.token_kl:
            traj.reward += kl_penalty
        out[id(traj)] = kl
    return out


def select(parts: RunParts, groups: Groups, row: Row) -> Groups:
    """StarPO-S: keep the top ``algorithm.filter.variance_keep`` of groups by reward std (all when 1)."""
    keep = parts.config.algorithm.filter.variance_keep
    if keep >= 1.0 or not groups:
        return groups
    rewards = torch.tensor([[x.reward for x in g] for g in groups], dtype=torch.float64)
    mask = top_variance_groups(rewards, keep_fraction=keep).tolist()
    kept = [g for g, k in zip(groups, mask, strict=True) if k]
    row["select/variance_groups_kept"] = float(len(kept))
    return kept


def distill(
    parts: RunParts, groups: Groups, values: list[list[SampleValues]], row: Row
) -> list[list[SampleValues]]:
    """On-policy distillation (``algorithm.teacher``): the teacher scores every token the
    student sampled in the samples trained on, and each sampled token's value gains
    ``-coef * (log pi_student - log pi_teacher)`` (``distillation_advantages``; the
    student's log-prob is the sampler's, on-policy as for a KL in the reward). With
    ``alone`` the estimator's values are dropped: the teacher's term is all there is.
    Values of samples not trained on are left as they are. ``values`` unchanged without
    a teacher."""
    teacher = parts.config.algorithm.teacher
    if not teacher.path:
        return values
    t0 = time.perf_counter()
    kept = []
    for g, group in enumerate(groups):
        trained = _trained(parts, group)
        kept += [(g, i, traj) for i, traj in enumerate(group) if id(traj) in trained]
    samples = [s for _, _, traj in kept for s in traj.samples()]
    scored = iter(parts.learner.teacher_logprobs(samples, parts.backend.pad_id) if samples else [])
    out = [list(member) for member in values]
    reverse_kl, teacher_logprob, tokens = 0.0, 0.0, 0
    for g, i, traj in kept:
        new: SampleValues = []
        for sample, value in zip(traj.samples(), values[g][i], strict=True):
            mask = torch.tensor([sample.loss_mask], dtype=torch.bool)
            student = torch.tensor([sample.logprobs], dtype=torch.float64)
            scores = torch.tensor([next(scored)], dtype=torch.float64)
            n = len(sample.input_ids)
            if teacher.alone:
                own = [0.0] * n
            else:
                own = [float(value)] * n if isinstance(value, int | float) else list(value)
            base = torch.tensor([own], dtype=torch.float64)
            adv = distillation_advantages(base, student, scores, mask, coef=teacher.coef)
            # the values of unsampled tokens are never read: keep the estimator's there
            new.append(torch.where(mask, adv, base.expand_as(adv))[0].tolist())
            reverse_kl += float(torch.where(mask, student - scores, 0.0).sum())
            teacher_logprob += float(torch.where(mask, scores, 0.0).sum())
            tokens += int(mask.sum())
        out[g][i] = new
    row["distill/reverse_kl_mean"] = reverse_kl / max(tokens, 1)
    row["distill/teacher_logprob_mean"] = teacher_logprob / max(tokens, 1)
    row["distill/tokens"] = float(tokens)
    row["perf/teacher_s"] = time.perf_counter() - t0
    return out


def _trained(parts: RunParts, group: Sequence[Trajectory]) -> set[int]:
    """The ``id``s of ``group``'s members trained on: those without an error, and with
    DAPO's overlong filter, not truncated ones."""
    overlong_filter = parts.config.algorithm.overlong.filter
    return {id(x) for x in trainable(group) if not (overlong_filter and x.truncated)}


def trainable_samples(
    parts: RunParts, groups: Groups, values: Sequence[Sequence[SampleValues]]
) -> tuple[list[Sample], list[float | list[float]]]:
    """The token-exact samples trained on (``_trained``), each with its value(s): members
    without an error, and with DAPO's overlong filter, not truncated ones
    (``select/truncated_excluded`` counts those)."""
    samples: list[Sample] = []
    sample_values: list[float | list[float]] = []
    for group, group_values in zip(groups, values, strict=True):
        keep = _trained(parts, group)
        for traj, value in zip(group, group_values, strict=True):
            if id(traj) in keep:
                samples.extend(traj.samples())
                sample_values.extend(value)
    return samples, sample_values


def shuffle_seed(config: Config, step: int) -> int | None:
    """The negative control's seed (rewards shuffled across the batch), else None."""
    if config.algorithm.control == "shuffled_rewards":
        return derive_seed(config.seed, step, "shuffle")
    return None


def log_trajectories(
    parts: RunParts,
    step: int,
    groups: Groups,
    values: Sequence[Sequence[SampleValues]],
    out: TextIO,
) -> None:
    """The first ``log_groups`` groups to trajectories.jsonl, each trajectory with its mean
    advantage over sampled tokens (none for a critic's token rewards)."""
    for g, (group, group_values) in enumerate(zip(groups, values, strict=True)):
        if g >= parts.config.log_groups:
            break
        for traj, value in zip(group, group_values, strict=True):
            summary = None if parts.estimator.critic else _mean_sampled(traj, value)
            line = {"step": step + 1, "group": g, "advantage": summary, **traj.to_json()}
            out.write(json.dumps(line) + "\n")
    out.flush()


def _mean_sampled(traj: Trajectory, values: SampleValues) -> float | None:
    """One number per trajectory: its mean value over sampled tokens."""
    total, count = 0.0, 0
    for sample, value in zip(traj.samples(), values, strict=True):
        for i, m in enumerate(sample.loss_mask):
            if m:
                total += value if isinstance(value, float) else value[i]
                count += 1
    return total / count if count else None
