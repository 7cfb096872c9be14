"""The synchronous training loop: rollout, advantages, update, log, checkpoint.

``train`` reads top to bottom: build or load the model, warm it up on format
demonstrations, then each step collects groups of episodes, turns rewards into GRPO
advantages, trains on the token-exact samples and writes one metrics row, which the
collapse monitors check (monitors.py; alarms go to alarms.jsonl and may stop the run).
Everything a run produces goes into its run directory (DESIGN.md "The main job").
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch
from tqdm import tqdm

from turnrl.algorithms import overlong_penalty, top_variance_groups
from turnrl.backends.torch_backend import TorchBackend
from turnrl.envs import EnvSpec, make_env_spec
from turnrl.errors import ConfigError
from turnrl.models import TinyModelConfig, build_tiny_model, load_model, load_tokenizer
from turnrl.models.loading import stop_token_ids
from turnrl.rollout.batch import trainable
from turnrl.rollout.chat import ChatRenderer
from turnrl.rollout.episode import EpisodeLimits, SamplingParams, derive_seed
from turnrl.rollout.failures import check_failures
from turnrl.rollout.groups import GroupSpec, collect_groups, rollout_metrics
from turnrl.trainer.checkpoint import (
    TrainerState,
    latest_checkpoint,
    load_extra,
    load_trainer_state,
    save_checkpoint,
    save_start_policy,
)
from turnrl.trainer.config import Config, inert_settings
from turnrl.trainer.credit import (
    SampleValues,
    batch_rewards,
    gigpo_turn_advantages,
    group_advantages,
    reinforce_pp_sample_advantages,
    token_advantages,
)
from turnrl.trainer.learner import Learner
from turnrl.trainer.monitors import Alarm, Monitor, read_rows
from turnrl.trainer.sinks import MetricSinks
from turnrl.trainer.warmup import demonstration_trajectories, supervised_warmup, warmup_samples
from turnrl.types import Sample, Trajectory

Row = dict[str, Any]

logger = logging.getLogger(__name__)


@dataclass
class RunResult:
    """What ``train`` returns: where the run lives, every metrics row and alarm it wrote."""

    run_dir: Path
    rows: list[Row] = field(default_factory=list)
    alarms: list[Alarm] = field(default_factory=list)


def train(
    config: Config,
    run_dir: Path,
    *,
    resume: bool = False,
    progress: bool = True,
    on_row: Callable[[Row], None] | None = None,
    env: EnvSpec | None = None,
) -> RunResult:
    """Run ``config`` into ``run_dir``; with ``resume`` continue from its last checkpoint.
    ``env``: an environment family object to train on instead of ``config.env``'s."""
    run_dir = Path(run_dir)
    if (run_dir / "metrics.jsonl").exists() and not resume:
        raise ConfigError(f"{run_dir} already holds a run; pass --resume or choose another --out")
    run_dir.mkdir(parents=True, exist_ok=True)
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    (run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    for message in inert_settings(config):
        _say(f"warning: {message}", progress)
    spec = env if env is not None else make_env_spec(config.env.name, **config.env.options)

    checkpoint = latest_checkpoint(run_dir) if resume else None
    model_path = (
        checkpoint / "model" if checkpoint else _base_model(config, spec, run_dir, progress)
    )
    tokenizer = load_tokenizer(model_path)
    model = load_model(model_path)
    stops = stop_token_ids(tokenizer)
    r = config.rollout
    sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, stop_token_ids=stops)
    limits = EpisodeLimits(
        r.max_turns, r.max_tokens_per_turn, r.max_episode_tokens, r.max_context_tokens
    )

    renderer = ChatRenderer(tokenizer)

    result = RunResult(run_dir)
    with (
        (run_dir / "metrics.jsonl").open("a") as metrics_out,
        (run_dir / "trajectories.jsonl").open("a") as traj_out,
        (run_dir / "alarms.jsonl").open("a") as alarms_out,
        MetricSinks(config, run_dir) as sinks,
    ):

        def emit(row: Row) -> None:
            metrics_out.write(json.dumps(row) + "\n")
            metrics_out.flush()
            sinks.write(row)
            result.rows.append(row)
            if on_row:
                on_row(row)

        first: Row = {"step": 0}
        if checkpoint is None and config.warmup.steps > 0:
            first.update(
                _warmup(config, spec, model, tokenizer, renderer, limits, sampling, progress)
            )
        reference = None
        if checkpoint is None:
            save_start_policy(run_dir, model, tokenizer)
        elif config.algorithm.kl_coef > 0:
            if not (run_dir / "start_model" / "config.json").is_file():
                raise ConfigError(
                    f"cannot resume {run_dir} with a KL term: its start_model (the reference "
                    "policy) is missing"
                )
            reference = load_model(run_dir / "start_model")
        learner = Learner(
            model,
            config.algorithm,
            temperature=r.temperature,
            reference=reference,
            max_length=r.max_episode_tokens,
        )
        backend = TorchBackend(model, tokenizer)
        start = 0
        if checkpoint is not None:
            state = load_trainer_state(checkpoint, learner.optimizer)
            start, backend.policy_version = state.step, state.policy_version
            extra = load_extra(checkpoint)
            if learner.critic is not None:
                if extra is None or "critic" not in extra:
                    raise ConfigError(f"{checkpoint} has no critic state to resume PPO from")
                learner.critic.load_state_dict(extra["critic"])
        monitor = Monitor(config.monitor)
        if checkpoint is not None:  # replay the run so far: raised alarms stay latched
            monitor.replay(read_rows(run_dir / "metrics.jsonl"), until_step=start)

        def evaluate() -> Row:
            tasks = [spec.task(i, split="test") for i in range(config.eval.num_tasks)]
            eval_spec = GroupSpec(1, limits, sampling, seed=derive_seed(config.seed, "eval"))
            groups = backend.run(collect_groups(tasks, spec.make_env, backend, renderer, eval_spec))
            episodes = [t for g in groups for t in g]
            check_failures(episodes, config.rollout.max_error_frac, where="evaluation")
            metrics = rollout_metrics(groups)
            return {
                "eval/success_mean": metrics["rollout/success_mean"],
                "eval/reward_mean": metrics["rollout/reward_mean"],
                "eval/tool_calls_mean": metrics["rollout/tool_calls_mean"],
            }

        if checkpoint is None:
            first.update(evaluate())
            emit(first)
        bar = tqdm(
            range(start, config.steps), desc="train", disable=not progress, initial=start,
            total=config.steps,
        )  # fmt: skip
        started = time.perf_counter()
        active = config  # what the steps run with: an alarm may switch on variance filtering
        if checkpoint is not None and read_rows(run_dir / "alarms.jsonl"):
            active = _on_alarm(active, progress)  # the resumed run had raised one already
        for step in bar:
            row = _train_step(active, step, spec, backend, learner, renderer, limits,
                              sampling, traj_out)  # fmt: skip
            alarms = monitor.update(row)
            stop = bool(alarms) and config.monitor.action == "stop"
            if alarms:
                active = _on_alarm(active, progress)
            done = step + 1
            out_of_time = (
                config.max_minutes > 0 and time.perf_counter() - started > 60 * config.max_minutes
            )
            last = done == config.steps or out_of_time or stop
            if done % config.eval.every == 0 or last:
                row.update(evaluate())
            row["perf/elapsed_s"] = time.perf_counter() - started
            for alarm in alarms:
                row[f"alarm/{alarm.name}"] = 1.0
                alarms_out.write(json.dumps(alarm.to_json()) + "\n")
                _say(alarm.message(), progress)
            alarms_out.flush()
            result.alarms.extend(alarms)
            emit(row)
            bar.set_postfix(
                success=f"{row['rollout/success_mean']:.2f}",
                reward=f"{row['rollout/reward_mean']:.2f}",
                errors=f"{row['rollout/errors']:.0f}",
            )
            if done % config.save_every == 0 or last:
                state = TrainerState(step=done, policy_version=backend.policy_version)
                save_checkpoint(
                    run_dir, model, tokenizer, learner.optimizer, state, _extra(learner)
                )
            if stop:
                _say(f"stopping after step {done}: monitor.action = stop", progress)
            if out_of_time or stop:
                break
        if config.steps == 0 or start >= config.steps:
            state = TrainerState(step=start, policy_version=backend.policy_version)
            save_checkpoint(run_dir, model, tokenizer, learner.optimizer, state, _extra(learner))
    return result


def _say(message: str, progress: bool) -> None:
    """Print above the progress bar, or log when there is none."""
    if progress:
        tqdm.write(f"turnrl: {message}")
    else:
        logger.warning(message)


def tiny_model_config(config: Config) -> TinyModelConfig:
    """The tiny model a run with an empty ``model.path`` builds (its shape, echo tuning and
    the run's seed)."""
    m = config.model
    return TinyModelConfig(
        arch=m.arch,
        hidden_size=m.hidden_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        vocab_size=m.vocab_size,
        echo_steps=m.echo_steps,
        echo_novel=m.echo_novel,
        seed=config.seed,
    )


def _base_model(config: Config, spec: EnvSpec, run_dir: Path, progress: bool) -> Path:
    if config.model.path:
        return Path(config.model.path)
    tiny = tiny_model_config(config)
    target = run_dir / "base_model"
    if (target / "config.json").is_file():
        return target
    return Path(build_tiny_model(target, tiny, extra_corpus=spec.corpus(), progress=progress))


def _warmup(
    config: Config,
    spec: EnvSpec,
    model: Any,
    tokenizer: Any,
    renderer: ChatRenderer,
    limits: EpisodeLimits,
    sampling: SamplingParams,
    progress: bool,
) -> Row:
    t0 = time.perf_counter()
    w = config.warmup
    demos = demonstration_trajectories(
        spec, tokenizer, renderer, count=min(w.steps * w.batch_size, 4096),
        limits=limits, sampling=sampling, seed=config.seed,
    )  # fmt: skip
    check_failures(demos, config.rollout.max_error_frac, where="warm-up demonstrations")
    samples = warmup_samples(demos)
    if not samples:
        raise ConfigError("the warm-up demonstrations produced no trainable samples")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    losses = supervised_warmup(
        model, samples, w, pad_id=int(pad), seed=config.seed, progress=progress
    )
    return {
        "warmup/loss_first": losses[0],
        "warmup/loss_last": losses[-1],
        "warmup/demonstrations": float(len(demos)),
        "warmup/s": time.perf_counter() - t0,
    }


def _train_step(
    config: Config,
    step: int,
    spec: EnvSpec,
    backend: TorchBackend,
    learner: Learner,
    renderer: ChatRenderer,
    limits: EpisodeLimits,
    sampling: SamplingParams,
    traj_out: TextIO,
) -> Row:
    t0 = time.perf_counter()
    groups, all_groups, selection = _collect(
        config, step, spec, backend, renderer, limits, sampling
    )
    sampled = [t for g in all_groups for t in g]
    check_failures(sampled, config.rollout.max_error_frac, where=f"step {step + 1}")
    t1 = time.perf_counter()
    kl = _reward_kl(config, learner, groups, backend.pad_id)
    advantages = _advantages(config, step, groups, kl)
    samples: list[Sample] = []
    sample_adv: list[float | list[float]] = []
    overlong_filter = config.algorithm.overlong_filter
    gae = config.algorithm.advantage == "gae"
    for group, group_adv in zip(groups, advantages, strict=True):
        keep = {id(t) for t in trainable(group) if not (overlong_filter and t.truncated)}
        for traj, adv in zip(group, group_adv, strict=True):
            if id(traj) in keep:
                samples.extend(traj.samples())
                sample_adv.extend(adv)
    row: Row = {"step": step + 1, **rollout_metrics(all_groups), **selection}
    row["rollout/dropped_errors"] = float(sum(t.error is not None for g in groups for t in g))
    if overlong_filter:
        row["select/truncated_excluded"] = float(sum(t.truncated for g in groups for t in g))
    if samples:
        if gae:  # GAE's "advantages" are token rewards; the learner's critic does the rest
            rewards = [a for a in sample_adv if isinstance(a, list)]
            row.update(learner.step_samples_gae(samples, rewards, backend.pad_id))
        else:
            row.update(learner.step_samples(samples, sample_adv, backend.pad_id))
    backend.policy_version += 1
    t2 = time.perf_counter()
    tokens = sum(t.num_tokens for g in all_groups for t in g)
    row.update(
        {
            "perf/rollout_s": t1 - t0,
            "perf/train_s": t2 - t1,
            "perf/step_s": t2 - t0,
            "perf/tokens_per_s": tokens / max(t2 - t0, 1e-9),
        }
    )
    for g, (group, group_adv) in enumerate(zip(groups, advantages, strict=True)):
        if g >= config.log_groups:
            break
        for traj, adv in zip(group, group_adv, strict=True):
            summary = None if gae else _mean_sampled(traj, adv)
            line = {"step": step + 1, "group": g, "advantage": summary, **traj.to_json()}
            traj_out.write(json.dumps(line) + "\n")
    traj_out.flush()
    return row


def _on_alarm(config: Config, progress: bool) -> Config:
    """With ``monitor.action = "filter"``, the configuration from the next step on:
    StarPO-S variance filtering at ``monitor.filter_keep`` (unchanged if already on)."""
    if config.monitor.action != "filter" or config.algorithm.variance_filter_keep < 1.0:
        return config
    keep = config.monitor.filter_keep
    _say(f"variance filtering on (keep the top {keep:.0%} of groups): monitor.action = filter",
         progress)  # fmt: skip
    algorithm = dataclasses.replace(config.algorithm, variance_filter_keep=keep)
    return dataclasses.replace(config, algorithm=algorithm)


def _extra(learner: Learner) -> dict[str, Any] | None:
    """Checkpoint state beyond the policy and its optimizer: the critic's, if any."""
    return None if learner.critic is None else {"critic": learner.critic.state_dict()}


def _collect(
    config: Config,
    step: int,
    spec: EnvSpec,
    backend: TorchBackend,
    renderer: ChatRenderer,
    limits: EpisodeLimits,
    sampling: SamplingParams,
) -> tuple[list[list[Trajectory]], list[list[Trajectory]], Row]:
    """This step's groups: the ones to train on, every group sampled, selection metrics.

    In order: sample ``prompts_per_step`` groups; with DAPO dynamic sampling, keep only
    groups whose rewards differ and sample more prompts (at most ``max_sample_rounds``
    rounds in all) until the batch is full; shape rewards (soft overlong punishment);
    keep the top fraction of groups by reward std (StarPO-S). Every sampled episode is
    logged in the rollout metrics, kept or not.
    """
    r, algo = config.rollout, config.algorithm
    kept: list[list[Trajectory]] = []
    sampled: list[list[Trajectory]] = []
    rounds = 0
    while rounds < algo.max_sample_rounds and len(kept) < r.prompts_per_step:
        # Round 0 reads the usual task stream; extra rounds read a disjoint range.
        base = step * r.prompts_per_step if rounds == 0 else _EXTRA_TASKS + (
            step * algo.max_sample_rounds + rounds
        ) * r.prompts_per_step  # fmt: skip
        tasks = [spec.task(base + j) for j in range(r.prompts_per_step)]
        group_spec = GroupSpec(
            r.group_size, limits, sampling, seed=derive_seed(config.seed, step, *([rounds] if rounds else [])),
            policy_version=backend.policy_version,
        )  # fmt: skip
        new = backend.run(collect_groups(tasks, spec.make_env, backend, renderer, group_spec))
        sampled.extend(new)
        rounds += 1
        if algo.dynamic_sampling:
            new = [g for g in new if len({t.reward for t in g if t.error is None}) > 1]
        kept.extend(new)
    kept = kept[: r.prompts_per_step]
    metrics: Row = {}
    if algo.dynamic_sampling:
        metrics["select/sample_rounds"] = float(rounds)
        metrics["select/groups_sampled"] = float(len(sampled))
        metrics["select/groups_kept"] = float(len(kept))
    if algo.overlong_cache_tokens:
        lengths = torch.tensor([[t.num_completion_tokens for t in g] for g in kept])
        penalty = overlong_penalty(
            lengths.reshape(-1), max_length=r.max_episode_tokens,
            cache_length=algo.overlong_cache_tokens,
        ).reshape(lengths.shape).tolist()  # fmt: skip
        for group, group_penalty in zip(kept, penalty, strict=True):
            for traj, p in zip(group, group_penalty, strict=True):
                traj.reward_components["overlong_penalty"] = p
                traj.reward += p
        metrics["select/overlong_penalty_mean"] = float(sum(map(sum, penalty))) / max(
            1, sum(map(len, penalty))
        )
    if algo.variance_filter_keep < 1.0 and kept:
        rewards = torch.tensor([[t.reward for t in g] for g in kept], dtype=torch.float64)
        mask = top_variance_groups(rewards, keep_fraction=algo.variance_filter_keep).tolist()
        kept = [g for g, keep in zip(kept, mask, strict=True) if keep]
        metrics["select/variance_groups_kept"] = float(len(kept))
    return kept, sampled, metrics


_EXTRA_TASKS = 10**9
"""Task indices of dynamic sampling's extra rounds start here, away from the main stream."""


def _reward_kl(
    config: Config, learner: Learner, groups: Sequence[Sequence[Trajectory]], pad_id: int
) -> dict[int, list[list[float]]]:
    """With ``kl_placement = "reward"``: each trainable trajectory's per-sample, per-token
    KL to the reference (keyed by ``id``), recorded as the ``kl_penalty`` reward component.
    Sequence-level estimators pay the summed penalty in the reward itself; token-level ones
    (REINFORCE++, GAE) pay it token by token. Empty otherwise."""
    algo = config.algorithm
    if algo.kl_placement != "reward" or algo.kl_coef == 0:
        return {}
    trajectories = [t for g in groups for t in trainable(g)]
    samples = [s for t in trajectories for s in t.samples()]
    per_sample = iter(learner.reference_kl(samples, pad_id))
    token_level = algo.advantage in ("reinforce_pp", "reinforce_pp_baseline", "gae")
    out: dict[int, list[list[float]]] = {}
    for traj in trajectories:
        kl = [next(per_sample) for _ in traj.samples()]
        penalty = -algo.kl_coef * sum(map(sum, kl))
        traj.reward_components["kl_penalty"] = penalty
        if not token_level:
            traj.reward += penalty
        out[id(traj)] = kl
    return out


def _advantages(
    config: Config,
    step: int,
    groups: Sequence[Sequence[Trajectory]],
    kl: dict[int, list[list[float]]],
) -> list[list[SampleValues]]:
    """What each sample of each trajectory trains on: one advantage per sample, or one
    per token (GiGPO's per-turn values, REINFORCE++'s per-token returns); for GAE the token
    rewards, which the learner's critic turns into advantages. ``[group][member][sample]``.
    """
    algo = config.algorithm
    shuffle = _shuffle_seed(config, step)
    if algo.advantage == "gigpo":
        turns = gigpo_turn_advantages(
            groups, gamma=algo.gigpo_gamma, omega=algo.gigpo_omega, shuffle_seed=shuffle
        )
        return [
            [list(token_advantages(t, v)) for t, v in zip(g, gv, strict=True)]
            for g, gv in zip(groups, turns, strict=True)
        ]
    if algo.advantage in ("reinforce_pp", "reinforce_pp_baseline"):
        return reinforce_pp_sample_advantages(
            groups, baseline=algo.advantage == "reinforce_pp_baseline", shuffle_seed=shuffle,
            kl=kl or None, kl_coef=algo.kl_coef if kl else 0.0,
        )  # fmt: skip
    if algo.advantage == "gae":
        rewards = batch_rewards(groups, shuffle)
        return [
            [_token_rewards(t, r, kl.get(id(t)), algo.kl_coef) for t, r in zip(g, rg, strict=True)]
            for g, rg in zip(groups, rewards, strict=True)
        ]
    values = group_advantages(groups, shuffle_seed=shuffle, estimator=algo.advantage)
    return [
        [[a] * len(t.samples()) for t, a in zip(g, gv, strict=True)]
        for g, gv in zip(groups, values, strict=True)
    ]


def _token_rewards(
    traj: Trajectory, reward: float, kl: list[list[float]] | None, kl_coef: float
) -> SampleValues:
    """Per-token rewards of each sample: the reward on the last sampled token of the last
    sample, minus ``kl_coef`` x the KL on every sampled token when the KL is in the reward."""
    out: SampleValues = []
    pieces = traj.samples()
    for k, sample in enumerate(pieces):
        row = [-kl_coef * x for x in kl[k]] if kl else [0.0] * len(sample.input_ids)
        if k == len(pieces) - 1 and traj.error is None:
            last = max((i for i, m in enumerate(sample.loss_mask) if m), default=None)
            if last is not None:
                row[last] += reward
        out.append(row)
    return out


def _mean_sampled(traj: Trajectory, values: SampleValues) -> float | None:
    """One number per trajectory for trajectories.jsonl: its mean advantage over sampled
    tokens."""
    total, count = 0.0, 0
    for sample, value in zip(traj.samples(), values, strict=True):
        for i, m in enumerate(sample.loss_mask):
            if m:
                total += value if isinstance(value, float) else value[i]
                count += 1
    return total / count if count else None


def _shuffle_seed(config: Config, step: int) -> int | None:
    if config.algorithm.control == "shuffled_rewards":
        return derive_seed(config.seed, step, "shuffle")
    return None
