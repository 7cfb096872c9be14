"""Asynchronous training (``algorithm.max_staleness``, trainer/pipeline.py): k = 0 is the
synchronous run exactly; k = 1 trains each batch one version stale, with the next rollout
overlapped, the same prompts per step, the behaviour log-probs corrected for; k = 2 stays
within its bound on the same prompts; a run that dies with batches collected ahead (a crash,
or a learner rank killed) resumes with every prompt exactly once. The deeper pipeline's
scheduling: tests/test_pipeline.py."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from conftest import SMALL_RUN
from turnrl.errors import ConfigError
from turnrl.trainer.config import load_config
from turnrl.trainer.loop import train

MOVING = [*SMALL_RUN, "steps=4", "eval.every=2", "algorithm.entropy_coef=0.05"]
"""A few steps whose updates move the weights (the entropy bonus), so that a stale batch
is visibly stale."""


def rows(run: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def trajectories(run: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run / "trajectories.jsonl").read_text().splitlines()]


def prompts(run: Path) -> list[tuple[int, str]]:
    """(step, task) of every trajectory, sorted."""
    return sorted((x["step"], x["task_id"]) for x in trajectories(run))


def samples_seen(run: Path) -> Counter[tuple[int, str, int]]:
    """How many times each (step, task, sample) was trained on."""
    return Counter((x["step"], x["task_id"], x["sample_index"]) for x in trajectories(run))


def without_timing(run: Path) -> list[dict[str, Any]]:
    timing = ("perf/", "warmup/s")
    return [{k: v for k, v in r.items() if not k.startswith(timing)} for r in rows(run)]


def test_k0_is_the_synchronous_run_exactly(tmp_path: Path) -> None:
    train(load_config(None, MOVING), tmp_path / "sync", progress=False)
    train(
        load_config(None, [*MOVING, "algorithm.max_staleness=0"]), tmp_path / "k0", progress=False
    )
    assert without_timing(tmp_path / "k0") == without_timing(tmp_path / "sync")


def test_k1_trains_one_version_stale_on_the_same_prompts(tmp_path: Path) -> None:
    train(load_config(None, MOVING), tmp_path / "sync", progress=False)
    train(
        load_config(None, [*MOVING, "algorithm.max_staleness=1"]), tmp_path / "k1", progress=False
    )
    config = json.loads((tmp_path / "k1" / "config.json").read_text())
    assert config["algorithm"]["off_policy"]["correction"] == "token_tis"  # auto, when stale
    steps = [r for r in rows(tmp_path / "k1") if r["step"] >= 1]
    assert steps[0]["rollout/staleness_0"] == 1.0  # the first batch: nothing to overlap
    for r in steps[1:]:
        assert r["rollout/staleness_1"] == 1.0
        assert r["rollout/policy_lag_max"] == 1.0
        assert r["train/logprob_mismatch_max"] > 1e-6  # the sampler's weights were older
    # every turn records the version that sampled it: batch s by the weights before update s-1
    for x in trajectories(tmp_path / "k1"):
        assert x["policy_version"] == max(x["step"] - 2, 0)
        assert {t["policy_version"] for t in x["turns"]} == {x["policy_version"]}

    assert prompts(tmp_path / "k1") == prompts(tmp_path / "sync")
    evals = [r["eval/success_mean"] for r in steps if "eval/success_mean" in r]
    assert len(evals) == 2  # steps 2 and 4, each after the batch ahead was let finish


@pytest.mark.parametrize(
    "more",
    [["algorithm.max_staleness=1"], ["algorithm.max_staleness=2"],
     ["algorithm.max_staleness=1", "algorithm.partial_rollouts=true"],
     ["algorithm.max_staleness=2", "algorithm.partial_rollouts=true",
      "algorithm.overlap_batches=true"]],
    ids=["k1", "k2", "k1-partial", "k2-overlap"],
)  # fmt: skip
def test_an_async_run_resumed_after_a_crash_sees_every_prompt_exactly_once(
    tmp_path: Path, more: list[str]
) -> None:
    settings = [*MOVING, *more, "save_every=2"]
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    train(load_config(None, settings), straight, progress=False)

    def crash_after_step_3(row: dict[str, Any]) -> None:
        if row["step"] == 3:  # step 4's batch is being collected ahead: lost with the crash
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(load_config(None, settings), crashed, progress=False, on_row=crash_after_step_3)
    train(load_config(None, settings), crashed, resume=True, progress=False)

    seen = samples_seen(crashed)
    assert set(seen.values()) == {1}  # nothing repeated
    assert seen == samples_seen(straight)  # nothing skipped
    assert [r["step"] for r in rows(crashed)] == [0, 1, 2, 3, 4]


def test_k2_trains_within_the_bound_on_the_same_prompts(tmp_path: Path) -> None:
    settings = [*MOVING, "steps=6", "eval.every=3", "algorithm.epochs=3"]
    train(load_config(None, settings), tmp_path / "sync", progress=False)
    k2 = [*settings, "algorithm.max_staleness=2"]
    train(load_config(None, k2), tmp_path / "k2", progress=False)
    steps = [r for r in rows(tmp_path / "k2") if r["step"] >= 1]
    assert steps[0]["rollout/staleness_0"] == 1.0
    for r in steps:  # the histogram covers 0..k and every trajectory is within it
        assert sum(r[f"rollout/staleness_{d}"] for d in range(3)) == pytest.approx(1.0)
        assert r["rollout/policy_lag_max"] <= 2.0
    assert steps[1]["rollout/staleness_1"] == 1.0  # queued at the first step, on its weights
    for x in trajectories(tmp_path / "k2"):  # step s's learner holds version s - 1
        assert x["step"] - 1 - 2 <= x["policy_version"] <= x["step"] - 1
        assert {t["policy_version"] for t in x["turns"]} == {x["policy_version"]}

    assert prompts(tmp_path / "k2") == prompts(tmp_path / "sync")
    assert len([r for r in steps if "eval/success_mean" in r]) == 2  # steps 3 and 6


@pytest.mark.parametrize(
    "more",
    [["model.lora.rank=4"], ["algorithm.advantage=gae"],
     ["algorithm.filter.dynamic_sampling=true"], ["rollout.sampler_weights=bf16"]],
    ids=["lora", "ppo", "dapo", "bf16-sampler"],
)  # fmt: skip
def test_k2_with_adapters_a_critic_dynamic_sampling_or_a_bf16_sampler(
    tmp_path: Path, more: list[str]
) -> None:
    """The published copy the background thread syncs from is a copy of whatever the
    learner's model is (a LoRA model merged into the sampler, a bf16 copy's source), and a
    critic's or a DAPO run's batches go through the same queue."""
    train(load_config(None, [*MOVING, "algorithm.max_staleness=2", *more]), tmp_path,
          progress=False)  # fmt: skip
    got = [r for r in rows(tmp_path) if r["step"] >= 1]
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert all(r["rollout/policy_lag_max"] <= 2.0 for r in got)
    for x in trajectories(tmp_path):
        assert {t["policy_version"] for t in x["turns"]} == {x["policy_version"]}
        assert 0 <= x["step"] - 1 - x["policy_version"] <= 2


def test_a_learner_rank_killed_with_batches_ahead_stops_the_run_and_resume_is_exactly_once(
    tmp_path: Path,
) -> None:
    """k = 2 with the learner on two ranks: rank 1 is killed once checkpoint 2 is written
    (batches ahead are queued or sampling). The run stops naming the rank, no rollout is
    left running, and the resumed run sees every prompt of the straight run exactly once."""
    import os
    import signal
    import threading
    import time

    import turnrl
    from test_distributed_train import groups_alive
    from turnrl.distributed import LearnerRankError

    settings = [*MOVING, "steps=5", "save_every=2", "algorithm.max_staleness=2",
                "cluster.learner_ranks=2"]  # fmt: skip
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    turnrl.train(None, out=straight, overrides=settings, progress=False)

    def kill_after_checkpoint_2() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (killed / "checkpoints" / "latest").exists():
            time.sleep(0.01)
        for group in groups_alive():
            os.kill(group.pids[1], signal.SIGKILL)

    killer = threading.Thread(target=kill_after_checkpoint_2, daemon=True)
    killer.start()
    with pytest.raises(LearnerRankError, match="learner rank 1 died"):
        turnrl.train(None, out=killed, overrides=settings, progress=False)
    killer.join()
    assert not [x for x in threading.enumerate() if x.name.startswith("turnrl-rollout-ahead")]
    turnrl.train(None, out=killed, overrides=settings, resume=True, progress=False)
    assert set(samples_seen(killed).values()) == {1}  # nothing repeated
    assert samples_seen(killed) == samples_seen(straight)  # nothing skipped
    assert [r["step"] for r in rows(killed)] == [0, 1, 2, 3, 4, 5]


PARTIAL = [
    "model.tiny.echo_steps=0", "steps=4", "eval.every=4", "eval.num_tasks=8",
    "rollout.prompts_per_step=4", "rollout.group_size=4", "threads=1",
    "env.options.latency_s=0.5", "algorithm.max_staleness=1",
]  # fmt: skip
"""Episodes of two turns (the quick-start's model after its 60-step warm-up calls the tool)
with a 500 ms lookup between them: a batch collected ahead is still mid-way, its episodes
waiting on the tool, when the update beside it ends."""


def test_partial_rollouts_take_the_new_weights_between_an_episode_s_turns(
    tmp_path: Path,
) -> None:
    train(load_config(None, PARTIAL), tmp_path / "whole", progress=False)
    partial = [*PARTIAL, "algorithm.partial_rollouts=true"]
    train(load_config(None, partial), tmp_path / "partial", progress=False)
    for x in trajectories(tmp_path / "whole"):  # off: each episode on one version
        assert {t["policy_version"] for t in x["turns"]} == {x["policy_version"]}
    steps = [r for r in rows(tmp_path / "partial") if r["step"] >= 2]
    for r in steps:  # each batch took the weights of the update that ended beside it
        assert r["rollout/mid_batch_syncs"] == 1.0
        assert r["rollout/episodes_across_versions"] > 0.5
        assert r["rollout/staleness_1"] == 1.0  # counted by an episode's oldest turn
        assert r["rollout/policy_lag_tokens_mean"] < 0.95  # its later turns are fresh
    assert turn_versions_move_forward(tmp_path / "partial") > 0
    assert prompts(tmp_path / "partial") == prompts(tmp_path / "whole")


def turn_versions_move_forward(run: Path, k: int = 1) -> int:
    """Check a run's logged episodes: each one's turn versions never go back, and lie
    between the learner's k steps before (step s's learner holds version s - 1) and its
    own; return how many episodes span more than one version."""
    mixed = 0
    for x in trajectories(run):
        versions = [t["policy_version"] for t in x["turns"]]
        assert versions == sorted(versions)
        assert max(x["step"] - 1 - k, 0) <= versions[0]
        assert versions[-1] <= x["step"] - 1
        mixed += len(set(versions)) > 1
    return mixed


def test_overlapping_batches_run_side_by_side_within_the_bound(tmp_path: Path) -> None:
    """k = 2 with partial rollouts, the batches one after the other and overlapping: with
    overlap the batch queued while the one before it waits on its lookups starts at once."""
    settings = [*PARTIAL, "steps=6", "eval.every=6", "algorithm.max_staleness=2",
                "algorithm.partial_rollouts=true"]  # fmt: skip
    train(load_config(None, settings), tmp_path / "one-by-one", progress=False)
    overlap = [*settings, "algorithm.overlap_batches=true"]
    train(load_config(None, overlap), tmp_path / "overlap", progress=False)
    assert all("rollout/batches_at_once" not in r for r in rows(tmp_path / "one-by-one"))
    steps = [r for r in rows(tmp_path / "overlap") if r["step"] >= 2]
    assert max(r["rollout/batches_at_once"] for r in steps) == 2.0
    for r in steps:  # every trajectory within the bound, counted by its oldest turn
        assert sum(r[f"rollout/staleness_{d}"] for d in range(3)) == pytest.approx(1.0)
        assert r["rollout/policy_lag_max"] <= 2.0
    assert turn_versions_move_forward(tmp_path / "overlap", k=2) > 0
    assert prompts(tmp_path / "overlap") == prompts(tmp_path / "one-by-one")


def test_overlapping_batches_need_partial_rollouts_and_two_batches_ahead() -> None:
    from turnrl.trainer.config import inert_settings

    with pytest.raises(ConfigError, match="partial_rollouts"):
        load_config(None, ["algorithm.max_staleness=2", "algorithm.overlap_batches=true"])
    on = ["algorithm.max_staleness=2", "algorithm.partial_rollouts=true",
          "algorithm.overlap_batches=true"]  # fmt: skip
    assert load_config(None, [*on, "cluster.rollout_workers=2"]).algorithm.overlapping
    k1 = load_config(None, [*on, "algorithm.max_staleness=1"])
    assert any("overlap_batches" in m and "max_staleness >= 2" in m for m in inert_settings(k1))
    assert not k1.algorithm.overlapping


def test_partial_rollouts_in_a_synchronous_run_are_flagged_as_inert() -> None:
    from turnrl.trainer.config import inert_settings

    synchronous = load_config(None, ["algorithm.partial_rollouts=true"])
    assert any("partial_rollouts" in m and "max_staleness >= 1" in m
               for m in inert_settings(synchronous))  # fmt: skip


def test_the_bound_is_checked() -> None:
    with pytest.raises(ConfigError, match="max_staleness"):
        load_config(None, ["algorithm.max_staleness=9"])


def test_k1_with_the_learner_on_two_ranks(tmp_path: Path) -> None:
    """One version stale with the learner on two ranks: stale batches, corrected, the
    group's weights synced to the sampler; the in-process run's metrics within 1e-5, the
    off-policy correction's included (its extremes are over ranks)."""
    import turnrl
    from test_distributed_train import assert_close

    settings = [*MOVING, "steps=3", "algorithm.max_staleness=1"]
    for name, ranks in (("run", 2), ("in_process", 0)):
        more = [*settings, f"cluster.learner_ranks={ranks}"]
        turnrl.train(None, out=tmp_path / name, overrides=more, progress=False)
    got = rows(tmp_path / "run")
    for r in [r for r in got if r["step"] >= 2]:
        assert r["rollout/staleness_1"] == 1.0
        assert r["train/logprob_mismatch_max"] > 1e-6
        assert r["off_policy/tis_ratio_max"] > 1.0 > r["off_policy/tis_ratio_min"]
        assert r["perf/weight_sync_s"] > 0
    assert_close(got, rows(tmp_path / "in_process"))
