"""A bug in user code stops the run loudly; the model's mistakes stay observations."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import SMALL_RUN
from turnrl.envs import ToolEnv
from turnrl.envs.registry import ENVIRONMENTS
from turnrl.envs.secret_lookup import SecretLookup
from turnrl.errors import ConfigError, EpisodeFailures
from turnrl.formats import get_format
from turnrl.rewards import Verdict, exact_match
from turnrl.rollout.failures import check_failures, error_counts, failure_report
from turnrl.tools import ToolSet
from turnrl.trainer.config import load_config
from turnrl.trainer.loop import train
from turnrl.types import Task, Trajectory


def trajectories(errors: list[str | None]) -> list[Trajectory]:
    out = []
    for i, error in enumerate(errors):
        traj = Trajectory(task_id=f"t{i}", sample_index=0)
        traj.error = error
        if error:
            traj.info["traceback"] = f"Traceback ...\n  File 'user.py', line {i}\n{error}"
        out.append(traj)
    return out


def test_no_failure_passes_and_counts_nothing() -> None:
    assert check_failures(trajectories([None, None]), 0.0, where="step 1") == 0


def test_one_failure_stops_by_default_with_the_messages_and_the_first_traceback() -> None:
    trajs = trajectories([None, "KeyError: 'x'", "KeyError: 'x'", "ValueError: bad", None])
    with pytest.raises(EpisodeFailures) as caught:
        check_failures(trajs, 0.0, where="step 3")
    message = str(caught.value)
    assert message.startswith("step 3: 3 of 5 episodes raised an exception")
    assert "max_error_frac = 0" in message
    assert "2x KeyError: 'x'" in message
    assert "1x ValueError: bad" in message
    assert "task t1, sample 0" in message  # the first failure's traceback
    assert "File 'user.py', line 1" in message
    assert error_counts(trajs) == {"KeyError: 'x'": 2, "ValueError: bad": 1}


def test_an_allowed_share_passes_and_every_episode_failing_never_does() -> None:
    trajs = trajectories([None, None, None, "OSError: flaky"])
    assert check_failures(trajs, 0.25, where="step 1") == 1
    with pytest.raises(EpisodeFailures, match=r"max_error_frac = 0\.2"):
        check_failures(trajs, 0.2, where="step 1")
    with pytest.raises(EpisodeFailures, match="Nothing is left to train on"):
        check_failures(trajectories(["OSError: down"] * 3), 1.0, where="step 1")


def test_the_report_lists_at_most_five_messages() -> None:
    report = failure_report(trajectories([f"E{i}: x" for i in range(8)]))
    assert report.count("1x E") == 5
    assert "and 3 other message(s)" in report


@dataclass(frozen=True)
class _BuggyVerifier(SecretLookup):
    """The probe, with a verifier that has a bug on every second task."""

    name = "buggy_verifier"

    def make_env(self) -> ToolEnv:
        return ToolEnv(self._tools, _buggy_verify, format=get_format("hermes"), max_tool_calls=4)


def _buggy_verify(task: Task, answer: str) -> Verdict:
    if int(task.id.rsplit("-", 1)[-1]) % 2:
        return Verdict({"ok": 1.0}["okay"], success=True)  # the user's bug
    return exact_match(answer, str(task.answer))


@pytest.fixture
def buggy_env(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(ENVIRONMENTS, _BuggyVerifier.name, _BuggyVerifier)
    return _BuggyVerifier.name


@dataclass(frozen=True)
class _BuggyTools(SecretLookup):
    """The probe, with a tool factory that has a bug (every episode's reset raises)."""

    name = "buggy_tools"

    def make_env(self) -> ToolEnv:
        return ToolEnv(_buggy_tools, _buggy_verify, format=get_format("hermes"), max_tool_calls=4)


def _buggy_tools(task: Task) -> ToolSet:
    table: dict[str, str] = task.metadata["tables"]  # the user's bug: the key is "table"
    return ToolSet([lambda key: table[key]])  # pragma: no cover


def test_a_bug_in_a_tool_factory_stops_the_run_before_any_update(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(ENVIRONMENTS, _BuggyTools.name, _BuggyTools)
    config = load_config(None, [*SMALL_RUN, f"env.name={_BuggyTools.name}", "warmup.steps=0"])
    with pytest.raises(EpisodeFailures) as caught:
        train(config, tmp_path, progress=False)
    message = str(caught.value)
    assert "KeyError: 'tables'" in message
    assert "_buggy_tools" in message  # the user's frame is in the traceback
    assert 'task.metadata["tables"]' in message
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert not [r for r in rows if "loss/policy" in r]  # nothing was trained


def test_with_failures_allowed_the_run_trains_on_the_rest(buggy_env: str, tmp_path: Path) -> None:
    config = load_config(
        None, [*SMALL_RUN, f"env.name={buggy_env}", "warmup.steps=0", "rollout.max_error_frac=0.75"]
    )
    result = train(config, tmp_path, progress=False)
    trained = [r for r in result.rows if "loss/policy" in r]
    assert trained
    assert sum(r["rollout/errors"] for r in trained) > 0  # the buggy tasks' episodes


def test_max_error_frac_is_checked() -> None:
    with pytest.raises(ConfigError, match="max_error_frac"):
        load_config(None, ["rollout.max_error_frac=1.5"])
