"""The synchronous training loop around the step: evaluate, log, alarm, checkpoint.

``train`` reads top to bottom: start the run (``startup.start``: the model, warmed up on
format demonstrations, the learner, the engine, the start-up checks), evaluate, then run
``step.train_step`` (collect, rewards, select, advantages, update, sync) once per step and
write its metrics row, which the collapse monitors check (monitors.py; alarms go to
alarms.jsonl and may stop the run). Everything a run produces goes into its run directory
(docs/getting-started.md, "What a run writes").
"""

from __future__ import annotations

import dataclasses
import errno
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from turnrl.envs import EnvFamily, make_env_family
from turnrl.errors import ConfigError
from turnrl.rollout.episode import derive_seed
from turnrl.rollout.failures import check_failures
from turnrl.rollout.groups import GroupSpec, rollout_metrics
from turnrl.trainer.checkpoint import (
    RunWriteError,
    TrainerState,
    checkpoint_state,
    disk_report,
    latest_checkpoint,
    save_checkpoint,
)
from turnrl.trainer.config import Config, inert_settings, resolved
from turnrl.trainer.interrupt import stop_after_step_on_ctrl_c
from turnrl.trainer.monitors import Alarm, Monitor, read_rows
from turnrl.trainer.pipeline import add_timings, stepper
from turnrl.trainer.sinks import MetricSinks, trim_run_files
from turnrl.trainer.startup import MakeLearner, MakeWorkers, say, start
from turnrl.trainer.step import RunParts, run_groups

Row = dict[str, Any]


@dataclass
class RunResult:
    """What ``train`` returns: where the run lives, every metrics row and alarm it wrote."""

    run_dir: Path
    rows: list[Row] = field(default_factory=list)
    alarms: list[Alarm] = field(default_factory=list)
    interrupted: bool = False
    """Whether a Ctrl-C stopped the run early (after a step, with its checkpoint)."""


def train(
    config: Config,
    run_dir: Path,
    *,
    resume: bool = False,
    progress: bool = True,
    on_row: Callable[[Row], None] | None = None,
    env: EnvFamily | None = None,
    make_learner: MakeLearner | None = None,
    make_workers: MakeWorkers | None = None,
) -> RunResult:
    """Run ``config`` into ``run_dir``; with ``resume`` continue from its last checkpoint.
    ``env``: an environment family object to train on instead of ``config.env``'s.
    ``make_learner``: the learner's factory (``MakeLearner``); None trains in this process
    (``in_process_learner``). ``make_workers``: the rollout workers' (``MakeWorkers``);
    None samples in this process. ``turnrl.train`` passes ``turnrl.distributed``'s for
    ``cluster.learner_ranks >= 1`` and ``cluster.rollout_workers >= 1``; whoever makes
    them stops them."""
    if make_learner is None and config.cluster.learner_ranks > 0:
        raise ConfigError(
            f"cluster.learner_ranks = {config.cluster.learner_ranks} runs through turnrl.train "
            "(or `turnrl train`), which starts the learner group; trainer.loop.train alone "
            "trains in this process (cluster.learner_ranks = 0)"
        )
    if make_workers is None and config.cluster.rollout_workers > 0:
        raise ConfigError(
            f"cluster.rollout_workers = {config.cluster.rollout_workers} runs through "
            "turnrl.train (or `turnrl train`), which starts the workers; trainer.loop.train "
            "alone samples in this process (cluster.rollout_workers = 0)"
        )
    run_dir = Path(run_dir)
    if (run_dir / "metrics.jsonl").exists() and not resume:
        raise ConfigError(f"{run_dir} already holds a run; pass --resume or choose another --out")
    run_dir.mkdir(parents=True, exist_ok=True)
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    config = resolved(config)  # what runs is what is recorded: no "auto" left
    (run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    for message in inert_settings(config):
        say(f"warning: {message}", progress)
    spec = env if env is not None else make_env_family(config.env.name, **config.env.options)
    checkpoint = None
    if resume:  # the newest whole checkpoint; what was written after it is written again
        checkpoint = latest_checkpoint(run_dir, warn=lambda m: say(f"warning: {m}", progress))
        until = checkpoint_state(checkpoint).step if checkpoint is not None else -1
        since = f"after step {until}" if until >= 0 else "from the start (no checkpoint)"
        for name, count in trim_run_files(run_dir, until).items():
            say(f"resuming {since}: dropped {count} record(s) of {name} written later "
                "or torn", progress)  # fmt: skip
    try:
        return _run(config, run_dir, spec, checkpoint, progress, on_row, make_learner, make_workers)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        newest = latest_checkpoint(run_dir)
        kept = f"the newest checkpoint, {newest.name}, is whole" if newest else "no checkpoint"
        raise RunWriteError(
            f"the disk is full while writing the run in {run_dir}: {exc}. "
            f"{disk_report(run_dir)} {kept.capitalize()}; free space, then continue with "
            "--resume."
        ) from exc


def _run(
    config: Config,
    run_dir: Path,
    spec: EnvFamily,
    checkpoint: Path | None,
    progress: bool,
    on_row: Callable[[Row], None] | None,
    make_learner: MakeLearner | None = None,
    make_workers: MakeWorkers | None = None,
) -> RunResult:
    """The run itself, its files open: start (or resume), evaluate, train step by step."""
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

        built = start(config, spec, run_dir, checkpoint, progress, make_learner, make_workers)
        parts, tokenizer, start_step = built.parts, built.tokenizer, built.step
        monitor = Monitor(config.monitor)
        if checkpoint is None:
            emit({**built.row, **evaluate(parts)})
        else:  # replay the run so far: raised alarms stay latched
            monitor.replay(read_rows(run_dir / "metrics.jsonl"), until_step=start_step)
            if read_rows(run_dir / "alarms.jsonl"):
                parts = parts.with_config(
                    _on_alarm(parts.config, progress)
                )  # it had raised one already
        bar = tqdm(
            range(start_step, config.steps), desc="train", disable=not progress,
            initial=start_step, total=config.steps,
        )  # fmt: skip
        started = time.perf_counter()
        steps = stepper(parts)  # synchronous, or the next rollout overlapped (max_staleness)
        with stop_after_step_on_ctrl_c() as ctrl_c:
            try:
                for step in bar:
                    row = steps.step(parts, step, traj_out)
                    alarms = monitor.update(row)
                    stop = bool(alarms) and config.monitor.action == "stop"
                    if alarms:  # an alarm may switch on variance filtering
                        parts = parts.with_config(_on_alarm(parts.config, progress))
                    done = step + 1
                    elapsed = time.perf_counter() - started
                    out_of_time = config.max_minutes > 0 and elapsed > 60 * config.max_minutes
                    asked = ctrl_c.is_set()  # Ctrl-C: this step is the last, and is saved
                    last = done == config.steps or out_of_time or stop or asked
                    if done % config.eval.every == 0 or last:
                        add_timings(row, steps.before_eval(parts))
                        row.update(evaluate(parts))
                    row["perf/elapsed_s"] = time.perf_counter() - started
                    for alarm in alarms:
                        row[f"alarm/{alarm.name}"] = 1.0
                        alarms_out.write(json.dumps(alarm.to_json()) + "\n")
                        say(alarm.message(), progress)
                    alarms_out.flush()
                    result.alarms.extend(alarms)
                    emit(row)
                    bar.set_postfix(
                        success=f"{row['rollout/success_mean']:.2f}",
                        reward=f"{row['rollout/reward_mean']:.2f}",
                        errors=f"{row['rollout/errors']:.0f}",
                    )
                    if done % config.save_every == 0 or last:
                        _save(parts, run_dir, tokenizer, done, steps.learner_version(parts))
                    if stop:
                        say(f"stopping after step {done}: monitor.action = stop", progress)
                    if asked:
                        result.interrupted = True
                        say(f"stopped after step {done} by Ctrl-C, its checkpoint written: "
                            "--resume continues the run", progress)  # fmt: skip
                    if out_of_time or stop or asked:
                        break
            finally:
                steps.close()
        if config.steps == 0 or start_step >= config.steps:
            _save(parts, run_dir, tokenizer, start_step, steps.learner_version(parts))
    return result


def evaluate(parts: RunParts) -> Row:
    """Held-out success: one sample (at the rollout temperature) of each of the first
    ``eval.num_tasks`` test tasks."""
    c = parts.config
    tasks = [parts.family.task(i, split="test") for i in range(c.eval.num_tasks)]
    eval_spec = GroupSpec(1, parts.limits, parts.sampling, seed=derive_seed(c.seed, "eval"))
    groups = run_groups(parts, tasks, eval_spec)  # on the rollout workers, if the run has any
    check_failures([x for g in groups for x in g], c.rollout.max_error_frac, where="evaluation")
    metrics = rollout_metrics(groups)
    return {
        "eval/success_mean": metrics["rollout/success_mean"],
        "eval/reward_mean": metrics["rollout/reward_mean"],
        "eval/tool_calls_mean": metrics["rollout/tool_calls_mean"],
    }


def _save(parts: RunParts, run_dir: Path, tokenizer: Any, step: int, version: int) -> None:
    """A checkpoint of the learner's weights, whose policy version is ``version``. A
    learner whose ``model`` may lag its weights (learner ranks that send the weights to the
    rollout workers themselves) brings them into it first (``refresh_model``)."""
    parts.learner.refresh_model()
    state = TrainerState(step=step, policy_version=version)
    extra = None if parts.learner.critic is None else {"critic": parts.learner.critic.state_dict()}
    save_checkpoint(run_dir, parts.learner.model, tokenizer, parts.learner.optimizer, state, extra)


def _on_alarm(config: Config, progress: bool) -> Config:
    """With ``monitor.action = "filter"``, the configuration from the next step on:
    StarPO-S variance filtering at ``monitor.filter_keep`` (unchanged if already on)."""
    if config.monitor.action != "filter" or config.algorithm.filter.variance_keep < 1.0:
        return config
    keep = config.monitor.filter_keep
    say(f"variance filtering on (keep the top {keep:.0%} of groups): monitor.action = filter",
        progress)  # fmt: skip
    algorithm = dataclasses.replace(
        config.algorithm, filter=dataclasses.replace(config.algorithm.filter, variance_keep=keep)
    )
    return dataclasses.replace(config, algorithm=algorithm)
