"""Monitors: early warnings of a failing run, computed every step from its metrics rows.

Each ``Rule`` watches one metric (docs/design.md, "Metric names") and compares its recent
level with a reference level; when the comparison crosses a threshold, the rule raises an ``Alarm``
naming the metric, the step, the numbers and what users usually do about it. The training
loop (loop.py) prints each alarm once, marks it in the metrics row as ``alarm/<name>`` = 1.0,
appends it to ``alarms.jsonl`` and, with ``monitor.action = "stop"``, ends the run. This
module is plain Python over metrics rows (no torch), so a finished run's metrics.jsonl can
be replayed through the same rules.

How a rule decides, robust to the step-to-step noise of small batches:

- recent: the median of the metric's last ``window`` values (a spike rule uses the
  latest value alone);
- trailing: the median of up to ``baseline_window`` values before those;
- record: the highest trailing level since the warm-up, for a rule that watches a fall,
  or the lowest, for one that watches a rise. Collapses are slow drifts that a trailing
  baseline follows down; the record does not (so a collapse completed within the warm-up
  goes unseen: the record starts from the level the warm-up ends at). Sudden changes
  (jumps, spikes) use the trailing level.
- A fall fires when recent < min(ratio x reference, reference - min_change): it must fall
  both by the ratio and by an absolute margin. A rise fires when recent > ratio x
  reference + min_change. The margins keep tiny levels (an entropy of 0.01 nats, a
  log-prob mismatch of 1e-7) from alarming on noise; a rule without one stays silent while
  its reference is 0 (no multiple of nothing is a spike: a run whose gradients are mostly
  zero has no grad-norm scale yet).
- No rule fires before its metric has ``warmup_steps`` values. A rule fires when its
  condition starts to hold, then stays quiet until the metric has recovered at least
  halfway from the threshold back to the reference on ``cooldown_steps`` consecutive
  values (hysteresis in value and in time): a lasting collapse, a metric hovering at the
  threshold, or a spike over several steps is one alarm.

Rows without a rule's metric (a step with no trainable samples has no ``loss/*``) are
skipped by that rule. What lives elsewhere: the thresholds' defaults (``MonitorConfig``),
the action on alarm (loop.py), drawing alarms on the curves (report).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from turnrl.trainer.config import MonitorConfig

Row = Mapping[str, Any]

SUCCESS = "rollout/success_mean"
"""The metric that tells convergence from collapse (``Rule.quiet_when_solved``)."""


@dataclass(frozen=True)
class Alarm:
    """One rule fired: what it watched, when, and what to do about it."""

    name: str
    """The rule, e.g. ``reward_std_collapse``; the metrics row gets ``alarm/<name>``."""
    metric: str
    """The metric it watches, e.g. ``rollout/reward_std_in_group``."""
    step: int
    """The ``step`` of the row that raised it."""
    value: float
    """The observed level: the recent median (the latest value for a spike rule)."""
    baseline: float
    """The reference level it was compared with (record or trailing median)."""
    threshold: float
    """The level ``value`` crossed."""
    advice: str
    """What users usually do about it, in one sentence."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def message(self) -> str:
        return (
            f"alarm {self.name} at step {self.step}: {self.metric} = {self.value:.4g} "
            f"(baseline {self.baseline:.4g}, threshold {self.threshold:.4g}). {self.advice}"
        )


@dataclass(frozen=True)
class Rule:
    """One alarm's definition (see the module docstring for how it decides)."""

    name: str
    """The alarm's name (``alarm/<name>`` in the metrics row)."""
    metric: str
    """The metric it watches."""
    direction: Literal["fall", "rise"]
    """Which way is trouble."""
    reference: Literal["record", "trailing"]
    """Compare with the record level (slow drifts) or the trailing median (sudden changes)."""
    ratio: float
    """Threshold as a multiple of the reference (< 1 for a fall, usually >= 1 for a rise)."""
    min_change: float
    """Absolute margin: the least fall below the reference, the excess over the multiple
    for a rise."""
    advice: str
    latest: bool = False
    """Compare the latest value instead of the recent median (a one-step spike)."""
    quiet_when_solved: bool = False
    """Stay quiet while the run succeeds (recent ``rollout/success_mean`` at or above
    ``monitor.solved_success``): uniform groups and a falling entropy are then the policy
    converging on solved tasks, not collapsing."""

    def threshold(self, reference: float) -> float:
        """The level a value must cross, given the reference level."""
        if self.direction == "fall":
            return min(self.ratio * reference, reference - self.min_change)
        return self.ratio * reference + self.min_change

    def crossed(self, value: float, reference: float) -> bool:
        """Whether ``value`` is past the threshold."""
        if not math.isfinite(value):  # only a spike rule sees raw values: NaN/inf is a spike
            return self.direction == "rise"
        threshold = self.threshold(reference)
        if threshold == reference:  # a multiple of a zero level and no margin
            return False
        return value < threshold if self.direction == "fall" else value > threshold

    def recovered(self, value: float, reference: float) -> bool:
        """Back at least halfway from the threshold to the reference."""
        if not math.isfinite(value):
            return False
        halfway = (self.threshold(reference) + reference) / 2
        return value > halfway if self.direction == "fall" else value < halfway


def default_rules(config: MonitorConfig) -> tuple[Rule, ...]:
    """The alarms of issue 6, with ``config``'s thresholds.

    =====================  ==============================================================
    alarm                  fires when (defaults)
    =====================  ==============================================================
    reward_std_collapse    in-group reward std < 0.5 x its best level, and 0.02 below it
    zero_variance_rise     zero-variance group fraction > its lowest level + 0.3
    entropy_collapse       entropy < 0.3 x its best level, and 0.05 nats below it
    entropy_jump           entropy > 2 x its trailing level + 0.05 nats
    grad_norm_spike        the latest grad norm > 10 x its trailing level
    tool_calls_drop        tool calls per episode < 0.5 x their best level, and 0.1 below it
    logprob_mismatch_rise  mismatch > 2 x its lowest level + 0.01 nats per token
    slowdown               sampled tokens per second < 0.25 x their best level
    =====================  ==============================================================

    The ratios are ``config``'s fields; the absolute margins are fixed here. "best",
    "lowest" are records, "trailing" the trailing median (module docstring). The first three
    stay quiet while recent success is at least ``solved_success``: a run that solves its
    tasks has uniform groups and a confident policy, and that is convergence.
    """
    c = config
    return (
        Rule(
            "reward_std_collapse", "rollout/reward_std_in_group", "fall", "record",
            c.reward_std_frac, 0.02,
            "the groups are becoming uniform, so group advantages vanish: consider variance "
            "filtering (StarPO-S) or dynamic sampling (DAPO), a higher temperature, or harder "
            "tasks.",
            quiet_when_solved=True,
        ),
        Rule(
            "zero_variance_rise", "rollout/zero_variance_groups_frac", "rise", "record",
            1.0, c.zero_variance_rise,
            "more groups give every sample the same reward and so no gradient: filter them "
            "out (DAPO dynamic sampling), raise group_size or the temperature, or bring task "
            "difficulty to the model's level.",
            quiet_when_solved=True,
        ),
        Rule(
            "entropy_collapse", "loss/entropy", "fall", "record", c.entropy_frac, 0.05,
            "the policy is becoming deterministic and stops exploring: consider clip-higher "
            "(DAPO, algorithm.clip.high = 0.28), a higher temperature, a KL or entropy term, or a lower "
            "learning rate.",
            quiet_when_solved=True,
        ),
        Rule(
            "entropy_jump", "loss/entropy", "rise", "trailing", c.entropy_jump, 0.05,
            "the policy suddenly became more random, often the start of a divergence: lower "
            "the learning rate, check the grad norm and the log-prob mismatch, or resume from "
            "an earlier checkpoint.",
        ),
        Rule(
            "grad_norm_spike", "train/grad_norm", "rise", "trailing", c.grad_norm_spike, 0.0,
            "one update was far larger than usual: look at this step's trajectories (very long "
            "or degenerate samples); repeated spikes call for a lower learning rate or a "
            "tighter max_grad_norm.",
            latest=True,
        ),
        Rule(
            "tool_calls_drop", "rollout/tool_calls_mean", "fall", "record",
            c.tool_calls_frac, 0.1,
            "the agent calls its tools less often (it answers without them, or its calls no "
            "longer parse): read recent trajectories, check rollout/tool_errors_frac and the "
            "call format, and consider a turn budget or a tool-use reward component.",
        ),
        Rule(
            "logprob_mismatch_rise", "train/logprob_mismatch", "rise", "record",
            c.mismatch_rise, 0.01,
            "the sampler's and the learner's log-probabilities are drifting apart, so updates "
            "are off-policy: check weight sync, dtypes and sampler settings, or correct with "
            "truncated importance sampling (TIS).",
        ),
        Rule(
            "slowdown", "perf/tokens_per_s", "fall", "record", c.slowdown_frac, 0.0,
            "steps take several times longer than earlier in this run for the same kind of "
            "work: another job is probably sharing the cores (torch's threads slow each other "
            "down many times over when they do) or memory is swapping; check the load "
            "average and free memory, stop the other job, or set `threads` below the free "
            "cores.",
        ),
    )  # fmt: skip


@dataclass
class _RuleState:
    record: float | None = None
    armed: bool = True
    quiet: int = 0
    """Consecutive values recovered halfway back to the reference."""


class Monitor:
    """Feeds metrics rows through the rules, one row per step, and returns new alarms."""

    def __init__(self, config: MonitorConfig, rules: Iterable[Rule] | None = None) -> None:
        self.config = config
        self.rules = tuple(rules) if rules is not None else default_rules(config)
        size = config.window + config.baseline_window
        watched = {r.metric for r in self.rules} | {SUCCESS}
        self._history: dict[str, deque[float]] = {m: deque(maxlen=size) for m in sorted(watched)}
        self._counts = dict.fromkeys(self._history, 0)
        self._states = {r.name: _RuleState() for r in self.rules}
        self.alarms: list[Alarm] = []
        """Every alarm raised so far, in order."""

    def update(self, row: Row) -> list[Alarm]:
        """Take one step's row; return the alarms that fire on it (usually none)."""
        latest: dict[str, float] = {}
        for metric, history in self._history.items():
            value = row.get(metric)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                latest[metric] = float(value)
                if math.isfinite(value):
                    history.append(float(value))
                    self._counts[metric] += 1
        fired = []
        for rule in self.rules:
            value = latest.get(rule.metric)
            # A non-finite value joins no history; only a spike rule looks at it.
            if value is not None and (rule.latest or math.isfinite(value)):
                alarm = self._check(rule, value, int(row.get("step", 0)))
                if alarm is not None:
                    fired.append(alarm)
        self.alarms.extend(fired)
        return fired

    def replay(self, rows: Iterable[Row], until_step: int) -> None:
        """Bring the state up to ``until_step`` from earlier rows (a resumed run), raising
        nothing: alarms already fired stay latched. The last row of each step counts."""
        by_step = {int(r["step"]): r for r in rows if 0 <= int(r.get("step", -1)) <= until_step}
        for step in sorted(by_step):
            self.update(by_step[step])
        self.alarms.clear()

    def solved(self) -> bool:
        """Whether the run currently solves its tasks: the median of the last ``window``
        values of ``rollout/success_mean`` is at least ``solved_success``."""
        recent = list(self._history[SUCCESS])[-self.config.window :]
        return bool(recent) and statistics.median(recent) >= self.config.solved_success

    def _check(self, rule: Rule, latest: float, step: int) -> Alarm | None:
        c, state = self.config, self._states[rule.name]
        if self._counts[rule.metric] < c.warmup_steps:
            return None
        history = list(self._history[rule.metric])  # warmup_steps > window: ``before`` is not empty
        recent, before = history[-c.window :], history[: -c.window]
        trailing = statistics.median(before)
        if state.record is None:
            state.record = trailing
        elif rule.direction == "fall":
            state.record = max(state.record, trailing)
        else:
            state.record = min(state.record, trailing)
        reference = state.record if rule.reference == "record" else trailing
        value = latest if rule.latest else statistics.median(recent)
        if not rule.crossed(value, reference) or (rule.quiet_when_solved and self.solved()):
            state.quiet = state.quiet + 1 if rule.recovered(value, reference) else 0
            if state.quiet >= c.cooldown_steps:
                state.armed = True
            return None
        state.quiet = 0
        if not state.armed:
            return None
        state.armed = False
        threshold = rule.threshold(reference)
        return Alarm(rule.name, rule.metric, step, value, reference, threshold, rule.advice)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl; a line that does not read as a JSON row (a torn last
    line of a killed run, bytes that are not UTF-8, a number or nesting JSON refuses) is
    skipped, never raised: the monitors and the report read what is whole."""
    rows = []
    if path.is_file():
        for raw in path.read_bytes().splitlines():
            try:
                row = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError):  # JSONDecodeError too
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows
