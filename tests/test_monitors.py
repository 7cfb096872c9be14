"""Collapse alarms on synthetic metric streams, and the alarm action through the real loop.

The synthetic runs sample real groups (16 prompts x 8 samples, 0/1 rewards, a success
probability per prompt) and compute the in-group metrics as ``rollout_metrics`` does, so
their noise is the noise of a real small run.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import SMALL_RUN
from turnrl.errors import ConfigError
from turnrl.trainer.config import MonitorConfig, load_config
from turnrl.trainer.loop import train
from turnrl.trainer.monitors import Alarm, Monitor, read_rows

Row = dict[str, float]
SMALL = SMALL_RUN
P, G = 16, 8


def group_metrics(probs: list[float], rng: random.Random) -> Row:
    """Rollout metrics of one step whose prompts succeed with ``probs`` (0/1 rewards)."""
    groups = [[float(rng.random() < p) for _ in range(G)] for p in probs]
    stds = [statistics.stdev(g) for g in groups]
    return {
        "rollout/reward_mean": statistics.fmean(x for g in groups for x in g),
        "rollout/reward_std_in_group": statistics.fmean(stds),
        "rollout/zero_variance_groups_frac": sum(s == 0.0 for s in stds) / len(stds),
    }


def run_stream(
    num_steps: int,
    seed: int,
    probs: Callable[[int, random.Random], list[float]] | None = None,
) -> list[Row]:
    """A healthy run (step 0 is the evaluation-only row, as in the loop); ``probs(step,
    rng)`` replaces the per-prompt success probabilities."""
    rng = random.Random(seed)
    speed = random.Random(seed + 1000)  # apart: the other metrics stay what they were
    rows: list[Row] = [{"step": 0, "eval/success_mean": 0.1}]
    for step in range(1, num_steps + 1):
        p = probs(step, rng) if probs else [rng.random() for _ in range(P)]
        row: Row = {"step": step, **group_metrics(p, rng)}
        row["rollout/tool_calls_mean"] = statistics.fmean(rng.randint(0, 3) for _ in range(P * G))
        row["loss/entropy"] = 0.8 - 0.001 * step + rng.gauss(0.0, 0.04)  # a slow, healthy fall
        row["train/grad_norm"] = 0.3 * rng.lognormvariate(0.0, 0.5)
        row["train/logprob_mismatch"] = 1e-3 * rng.lognormvariate(0.0, 0.3)
        row["perf/tokens_per_s"] = 150.0 * speed.lognormvariate(0.0, 0.4)  # a shared machine
        rows.append(row)
    return rows


def alarms_of(rows: list[Row], config: MonitorConfig | None = None) -> list[Alarm]:
    monitor = Monitor(config or MonitorConfig())
    fired = [a for row in rows for a in monitor.update(row)]
    assert fired == monitor.alarms
    return fired


def polarising(
    start: int, fall: int, speed: float = 0.1
) -> Callable[[int, random.Random], list[float]]:
    """Groups become uniform from ``start`` (each prompt drifts to always or never solved,
    the mean staying at 0.5; ``speed`` sets how fast); from ``fall`` the prompts drift to
    never solved."""

    def probs(step: int, rng: random.Random) -> list[float]:
        sharpness = 1.0 + speed * max(0, step - start)
        shift = max(0, step - fall) / 15
        out = []
        for _ in range(P):
            u = min(max(rng.random(), 1e-3), 1 - 1e-3)
            logit = sharpness * (math.log(u / (1 - u)) - shift)
            out.append(1 / (1 + math.exp(-max(-50.0, min(50.0, logit)))))
        return out

    return probs


@pytest.mark.parametrize("speed", [0.1, 0.05])
@pytest.mark.parametrize("seed", range(4))
def test_reward_std_collapse_is_raised_before_the_reward_falls(seed: int, speed: float) -> None:
    rows = run_stream(160, seed, polarising(start=40, fall=100, speed=speed))
    rewards = [r["rollout/reward_mean"] for r in rows[1:]]
    # The step at which the reward has visibly fallen: its 10-step mean under 0.35 (from 0.5).
    fallen = next(
        i + 10 for i in range(len(rewards)) if statistics.fmean(rewards[i : i + 10]) < 0.35
    )
    assert fallen > 100
    alarms = alarms_of(rows)
    collapse = [a for a in alarms if a.name == "reward_std_collapse"]
    assert len(collapse) == 1  # raised once, though the collapse lasts
    step = collapse[0].step
    assert 40 < step < 100 < fallen
    # When it is raised, the reward is still where it was before the groups polarised.
    assert abs(statistics.fmean(rewards[step - 10 : step]) - statistics.fmean(rewards[:40])) < 0.1
    assert collapse[0].value < collapse[0].threshold < collapse[0].baseline
    assert {a.name for a in alarms} <= {"reward_std_collapse", "zero_variance_rise"}


def converging(to: float, start: int = 40) -> Callable[[int, random.Random], list[float]]:
    """From ``start`` every prompt drifts to success probability ``to`` (1: the run solves
    its tasks; 0: it stops solving them)."""

    def probs(step: int, rng: random.Random) -> list[float]:
        w = min(1.0, max(0, step - start) / 30)
        return [(1 - w) * rng.random() + w * to for _ in range(P)]

    return probs


def with_entropy_falling_and_success(rows: list[Row], start: int = 75) -> list[Row]:
    """The policy grows confident from ``start`` (entropy 0.8 -> 0.02), and each row
    carries its success rate (the 0/1 rewards' mean)."""
    for row in rows[1:]:
        row["loss/entropy"] = (
            0.8 if row["step"] < start else max(0.02, 0.8 - 0.03 * (row["step"] - start))
        )
        row["rollout/success_mean"] = row["rollout/reward_mean"]
    return rows


QUIET_WHEN_SOLVED = {"reward_std_collapse", "zero_variance_rise", "entropy_collapse"}


@pytest.mark.parametrize("seed", range(3))
def test_converging_on_solved_tasks_is_not_a_collapse(seed: int) -> None:
    rows = with_entropy_falling_and_success(run_stream(150, seed, converging(to=1.0)))
    assert statistics.fmean(r["rollout/success_mean"] for r in rows[-20:]) > 0.95
    assert not [a for a in alarms_of(rows) if a.name in QUIET_WHEN_SOLVED]


@pytest.mark.parametrize("seed", range(3))
def test_the_same_collapse_on_failing_tasks_raises_all_three(seed: int) -> None:
    rows = with_entropy_falling_and_success(run_stream(150, seed, converging(to=0.0)))
    assert {a.name for a in alarms_of(rows)} >= QUIET_WHEN_SOLVED


def test_a_quiet_alarm_fires_once_success_falls_away() -> None:
    # Solved by step ~70 (quiet), then from step 120 the tasks stop being solved while the
    # groups stay uniform: now it is a collapse, and the alarms fire after the fall.
    solved, failing = converging(to=1.0), converging(to=0.0, start=120)
    rows = run_stream(200, 0, lambda step, rng: (solved if step < 120 else failing)(step, rng))
    alarms = alarms_of(with_entropy_falling_and_success(rows))
    assert {a.name for a in alarms} & QUIET_WHEN_SOLVED
    assert min(a.step for a in alarms if a.name in QUIET_WHEN_SOLVED) > 120


def test_the_quick_start_converging_raises_no_collapse_alarm() -> None:
    """A real run: `make demo` on a fresh clone (2026-11-25; the monitored metrics of its
    metrics.jsonl). Held-out success went 0.14 -> 0.95; before alarms knew success, entropy
    collapse, reward-std collapse and zero-variance rise fired at steps 146, 162 and 163,
    with training success at 0.9 and above."""
    path = Path(__file__).parent / "data" / "quickstart_metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[-1]["eval/success_mean"] > 0.9
    assert not [a for a in alarms_of(rows) if a.name in QUIET_WHEN_SOLVED]
    unaware = alarms_of(rows, MonitorConfig(solved_success=1.1))  # success ignored
    assert {a.name for a in unaware} >= QUIET_WHEN_SOLVED


@pytest.mark.parametrize("seed", range(10))
def test_a_healthy_noisy_run_raises_no_alarm(seed: int) -> None:
    assert alarms_of(run_stream(300, seed)) == []


def test_a_burst_of_grad_norm_spikes_fires_once_and_a_later_spike_again() -> None:
    rows = run_stream(200, 0)
    for step in (80, 81, 83, 86, 150):  # a burst of spikes, then a lone one much later
        rows[step]["train/grad_norm"] *= 40
    alarms = alarms_of(rows)
    assert [(a.name, a.step) for a in alarms] == [("grad_norm_spike", 80), ("grad_norm_spike", 150)]
    assert alarms[0].metric == "train/grad_norm"
    assert alarms[0].value == rows[80]["train/grad_norm"]
    assert alarms[0].threshold == pytest.approx(10 * alarms[0].baseline)


def test_a_non_finite_grad_norm_is_a_spike() -> None:
    rows = run_stream(100, 0)
    rows[60]["train/grad_norm"] = math.nan
    assert [(a.name, a.step) for a in alarms_of(rows)] == [("grad_norm_spike", 60)]


def test_a_zero_baseline_is_no_scale_for_a_spike() -> None:
    rows = run_stream(100, 0)
    for row in rows[1:60]:
        row["train/grad_norm"] = 0.0  # no learning signal yet: any signal is not a spike
    assert alarms_of(rows) == []


def _scale(metric: str, factor: Callable[[int], float]) -> Callable[[list[Row]], None]:
    def change(rows: list[Row]) -> None:
        for row in rows[1:]:
            row[metric] *= factor(int(row["step"]))

    return change


def _add(metric: str, amount: Callable[[int], float]) -> Callable[[list[Row]], None]:
    def change(rows: list[Row]) -> None:
        for row in rows[1:]:
            row[metric] = min(1.0, row[metric] + amount(int(row["step"])))

    return change


@pytest.mark.parametrize(
    ("name", "change"),
    [
        ("entropy_collapse", _scale("loss/entropy", lambda t: math.exp(-max(0, t - 60) / 15))),
        ("entropy_jump", _scale("loss/entropy", lambda t: 3.0 if t >= 60 else 1.0)),
        ("tool_calls_drop", _scale("rollout/tool_calls_mean", lambda t: max(0.1, 1 - max(0, t - 60) / 40))),
        ("logprob_mismatch_rise", _add("train/logprob_mismatch", lambda t: 1e-3 * max(0, t - 60))),
        ("zero_variance_rise", _add("rollout/zero_variance_groups_frac", lambda t: 0.01 * max(0, t - 60))),
        ("slowdown", _scale("perf/tokens_per_s", lambda t: 0.1 if t >= 60 else 1.0)),
    ],
)  # fmt: skip
def test_each_failure_fires_its_alarm_once(name: str, change: Callable[[list[Row]], None]) -> None:
    rows = run_stream(160, 0)
    change(rows)
    alarms = alarms_of(rows)
    assert [a.name for a in alarms] == [name]
    assert 60 <= alarms[0].step <= 100
    assert alarms[0].advice


def test_slowdown_measured_in_real_runs() -> None:
    """SmolLM2-135M on search_qa, 2026-11-29: each step's sampled tokens per second while
    a test suite shared the 2 cores (48-159: a busy machine, no alarm), then one run's
    step 10 at 2 torch threads beside 3 other jobs (20 tokens/s, 13x slower): the alarm
    fires once that lasts for the recent window."""
    busy = [115, 116, 88, 97, 72, 77, 151, 151, 129, 120, 98, 74, 64, 65, 48, 69,
            91, 141, 107, 78, 148, 121, 98, 91, 87, 89, 126, 156, 155, 154, 155, 159]  # fmt: skip
    rows: list[Row] = [{"step": i + 1, "perf/tokens_per_s": v} for i, v in enumerate(busy)]
    assert alarms_of(rows) == []
    rows += [{"step": len(rows) + i + 1, "perf/tokens_per_s": 20.0} for i in range(10)]
    (alarm,) = alarms_of(rows)
    assert (alarm.name, alarm.step) == ("slowdown", len(busy) + 6)
    assert alarms_of(rows, MonitorConfig(slowdown_frac=0.0)) == []


def test_the_warm_up_suppresses_alarms() -> None:
    rows = run_stream(100, 0)
    for step in (10, 80):
        rows[step]["train/grad_norm"] *= 40
    assert [a.step for a in alarms_of(rows)] == [80]  # the default warm-up is 20 values
    assert [a.step for a in alarms_of(rows, MonitorConfig(warmup_steps=8, window=5))] == [10, 80]


def test_alarms_are_json_serialisable() -> None:
    alarms = alarms_of(run_stream(160, 0, polarising(start=40, fall=100)))
    assert alarms
    for alarm in alarms:
        line = json.dumps(alarm.to_json(), allow_nan=False)
        assert Alarm(**json.loads(line)) == alarm
        assert alarm.metric in alarm.message()
        assert f"step {alarm.step}" in alarm.message()


def test_a_resumed_monitor_continues_the_same_alarms() -> None:
    rows = run_stream(160, 1, polarising(start=40, fall=100))
    straight = alarms_of(rows)
    assert straight
    split = straight[0].step + 3  # the first alarm is raised before the split
    monitor = Monitor(MonitorConfig())
    monitor.replay(rows + rows[5:9], until_step=split)  # a repeated step counts once
    assert monitor.alarms == []
    resumed = [a for row in rows if row["step"] > split for a in monitor.update(row)]
    assert resumed == [a for a in straight if a.step > split]


def test_monitor_config_errors_are_clear() -> None:
    with pytest.raises(
        ConfigError, match=r"unknown config key 'monitor\.actoin'.*'monitor\.action'"
    ):
        load_config(None, ["monitor.actoin=stop"])
    with pytest.raises(
        ConfigError, match=r"monitor.action must be one of \['none', 'stop', 'filter'\]"
    ):
        load_config(None, ["monitor.action=pause"])
    with pytest.raises(ConfigError, match=r"monitor.warmup_steps must be > monitor.window"):
        load_config(None, ["monitor.warmup_steps=5"])
    with pytest.raises(ConfigError, match=r"monitor.reward_std_frac must be in \(0, 1\)"):
        load_config(None, ["monitor.reward_std_frac=1.5"])
    with pytest.raises(ConfigError, match=r"monitor.window must be int"):
        load_config(None, ["monitor.window=2.5"])
    assert load_config(None).monitor == MonitorConfig()


# A tiny entropy-jump factor: the alarm fires as soon as the warm-up (2 steps) ends. The
# slowdown alarm, read from wall-clock time, is off: a busy machine would fire it too.
TINY_THRESHOLD = ["monitor.warmup_steps=2", "monitor.window=1", "monitor.entropy_jump=1e-6",
                  "monitor.slowdown_frac=0"]  # fmt: skip


def test_alarm_action_stop_ends_the_run_with_a_checkpoint(tmp_path: Path) -> None:
    config = load_config(None, [*SMALL, "steps=5", "monitor.action=stop", *TINY_THRESHOLD])
    run = tmp_path / "run"
    result = train(config, run, progress=False)
    assert [r["step"] for r in result.rows] == [0, 1, 2]  # stopped early (steps=5)
    assert [(a.name, a.step) for a in result.alarms] == [("entropy_jump", 2)]
    assert result.rows[-1]["alarm/entropy_jump"] == 1.0
    assert not any(k.startswith("alarm/") for r in result.rows[:-1] for k in r)
    assert "eval/success_mean" in result.rows[-1]  # the last step is evaluated as usual
    lines = (run / "alarms.jsonl").read_text().splitlines()
    assert [Alarm(**json.loads(line)) for line in lines] == result.alarms
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000002"
    assert (run / "checkpoints" / "step_000002" / "model" / "config.json").is_file()
    # Resuming replays the run so far: the raised alarm stays raised and the run goes on.
    resumed = train(config, run, resume=True, progress=False)
    assert [r["step"] for r in resumed.rows] == [3, 4, 5]
    assert resumed.alarms == []
    assert [r["step"] for r in read_rows(run / "metrics.jsonl")] == [0, 1, 2, 3, 4, 5]
    assert len((run / "alarms.jsonl").read_text().splitlines()) == 1


def test_without_an_action_alarms_are_recorded_and_the_run_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    quiet = tmp_path / "quiet"
    train(load_config(None, SMALL), quiet, progress=False)
    assert (quiet / "alarms.jsonl").read_text() == ""  # written even when nothing fired
    config = load_config(None, [*SMALL, "steps=3", *TINY_THRESHOLD])
    result = train(config, tmp_path / "run", progress=False)
    assert [r["step"] for r in result.rows] == [0, 1, 2, 3]
    assert [(a.name, a.step) for a in result.alarms] == [("entropy_jump", 2)]
    assert (tmp_path / "run" / "alarms.jsonl").read_text().count("\n") == 1
    said = [r.getMessage() for r in caplog.records if "alarm entropy_jump" in r.getMessage()]
    assert len(said) == 1  # printed once, though its condition holds at step 3 too
    assert "at step 2: loss/entropy" in said[0]


def test_alarm_action_filter_switches_on_variance_filtering(tmp_path: Path) -> None:
    options = [
        *SMALL, "steps=4", "rollout.prompts_per_step=4", "monitor.action=filter",
        "monitor.filter_keep=0.5", *TINY_THRESHOLD,
    ]  # fmt: skip
    result = train(load_config(None, options), tmp_path / "run", progress=False)
    assert [(a.name, a.step) for a in result.alarms] == [("entropy_jump", 2)]
    kept = {r["step"]: r.get("select/variance_groups_kept") for r in result.rows if r["step"]}
    assert kept == {1: None, 2: None, 3: 2.0, 4: 2.0}  # from the step after the alarm on
    with pytest.raises(ConfigError, match=r"monitor.filter_keep must be in \(0, 1\)"):
        load_config(None, ["monitor.filter_keep=1"])
