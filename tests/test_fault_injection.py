"""Fault injection (tests/faults.py): SIGKILLs aimed at each phase of a step (the rollout,
the learner update, a checkpoint write), each followed by a resume, end in the metrics and
run files of the uninterrupted run; a disk that fills while a checkpoint or a metrics row
is written is a clear error, with the newest checkpoint whole, and the run resumes once
space is freed; 100 episodes at once against a tool that raises or hangs lose no episode,
hang nowhere, and record every call as what it did. The ``slow`` tests run the same at
full size (10 kills of a 12-step run; 1,000 episodes)."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

import pytest

import faults

SMALL = {"kills": 3, "steps": 6, "save_every": 2, "seed": 0, "episodes": 100, "jitter_s": 0.2,
         "episode_timeout_s": 60.0, "load_deadline_s": 300.0, "disk_mb": 64}  # fmt: skip
FULL = {**SMALL, "kills": 10, "steps": 12, "save_every": 3, "episodes": 1000, "jitter_s": 1.0}
FILES = ["metrics.jsonl", "trajectories.jsonl", "alarms.jsonl", "tensorboard"]


def settings(runs_dir: Path, **values: Any) -> argparse.Namespace:
    return argparse.Namespace(runs_dir=runs_dir, **values)


def straight_run(args: argparse.Namespace) -> tuple[Path, list[str]]:
    """The uninterrupted run (its phases marked) the others are compared with."""
    options = [*faults.RUN, f"steps={args.steps}", f"save_every={args.save_every}"]
    straight = args.runs_dir / "straight"
    shutil.rmtree(straight, ignore_errors=True)
    proc = faults.start(straight, options, args.runs_dir / "straight.phases", resume=False)
    output = proc.communicate()[0]
    assert proc.returncode == 0, output[-3000:]
    return straight, options


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[argparse.Namespace, Path, list[str]]:
    args = settings(tmp_path_factory.mktemp("faults"), **SMALL)
    return (args, *straight_run(args))


def check_kills(killed: dict[str, Any]) -> None:
    assert {k["aimed_at"] for k in killed["kills"]} == set(faults.PHASES)
    assert all(k["killed"] for k in killed["kills"]), killed["kills"]
    assert killed["metrics_equal"]
    assert killed["files_one_record_per_step"] == dict.fromkeys(FILES, True)


def test_kills_aimed_at_each_phase_resume_into_the_uninterrupted_run(
    small: tuple[argparse.Namespace, Path, list[str]],
) -> None:
    args, straight, options = small
    killed = faults.kills(args, straight, options)
    assert sorted(k["aimed_at"] for k in killed["kills"]) == sorted(faults.PHASES)
    check_kills(killed)


def test_a_full_disk_is_a_clear_error_and_the_run_resumes_once_freed(
    small: tuple[argparse.Namespace, Path, list[str]],
) -> None:
    args, straight, options = small
    cases = faults.disk(args, straight, options)
    for case in cases:  # a tmpfs needs root; without one the row says why
        if not case["mounted"]:
            assert case["why"]
            continue
        assert case["resume_returncode"] == 0, case.get("resume_output")
        assert case["resumed_from"] == 2
        assert case["metrics_equal"]
        assert all(not problems for problems in case["checkpoint_problems"].values())
    if not cases[0]["mounted"]:
        pytest.skip(f"no tmpfs: {cases[0]['why']}")
    assert cases[0]["returncode"] == 2
    assert "could not write checkpoint step_000004" in cases[0]["message"]


def check_load(load: dict[str, Any], episodes: int) -> None:
    assert (load["episodes_in"], load["episodes_out"], load["episodes_lost"]) == (
        episodes, episodes, 0,
    )  # fmt: skip
    assert load["episodes_duplicated"] == 0
    assert (load["hung"], load["num_records_wrong"], load["tool_calls_unrecorded"]) == ([], 0, 0)
    assert load["open_episodes_after"] == 0
    assert set(load["tool_errors"]) <= {"RuntimeError", "timeout"}
    assert load["peak_rss_mb"] > 0


def test_episodes_against_a_tool_that_raises_or_hangs_are_each_accounted_for(
    tmp_path: Path,
) -> None:
    args = settings(tmp_path, **SMALL)
    check_load(faults.load(args), args.episodes)


@pytest.mark.slow
def test_ten_kills_of_a_twelve_step_run(tmp_path: Path) -> None:
    args = settings(tmp_path, **FULL)
    straight, options = straight_run(args)
    check_kills(faults.kills(args, straight, options))


@pytest.mark.slow
def test_a_thousand_episodes_against_a_tool_that_raises_or_hangs(tmp_path: Path) -> None:
    args = settings(tmp_path, **FULL)
    check_load(faults.load(args), args.episodes)
