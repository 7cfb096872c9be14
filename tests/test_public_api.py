"""The public API: `turnrl.__all__` is pinned, `import turnrl` stays light, and
`turnrl.train` takes an environment in each documented shape."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import turnrl
from conftest import SMALL_RUN
from turnrl.envs import SecretLookup

PUBLIC = [
    "AgentEnvironment", "AgentProcesses", "Config", "ConfigError", "Environment", "EpisodeFailures", "EvalConfig", "Message",
    "RunResult", "StepResult", "Task", "TextEnv", "Tool", "ToolCall", "ToolEnv", "ToolSet", "Trajectory",
    "TurnrlError", "Verdict", "check_env", "evaluate", "get_format", "load_config",
    "make_env_family", "tool", "train",
]  # fmt: skip


def test_the_public_names_are_pinned_and_each_resolves() -> None:
    assert sorted(turnrl.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert getattr(turnrl, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'trainer_loop'"):
        _ = turnrl.trainer_loop


def test_import_turnrl_does_not_import_torch() -> None:
    code = "import sys, turnrl; print('torch' in sys.modules)"
    assert subprocess.check_output([sys.executable, "-c", code], text=True).strip() == "False"


def small_probe() -> SecretLookup:
    return SecretLookup(num_keys=2, key_pool=2, num_values=12)


@pytest.mark.parametrize(
    "env",
    [small_probe(), small_probe, "tests_public_api_probe"],
    ids=["object", "factory", "import path"],
)
def test_train_takes_an_environment_object_factory_or_name(
    env: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if env == "tests_public_api_probe":
        monkeypatch.syspath_prepend(str(Path(__file__).parent))
        env = f"{Path(__file__).stem}:small_probe"
    result = turnrl.train("grpo", env=env, out=tmp_path, overrides=SMALL_RUN, progress=False)
    assert [r["step"] for r in result.rows if "loss/policy" in r] == [1, 2]


def test_train_refuses_what_is_not_an_environment(tmp_path: Path) -> None:
    with pytest.raises(turnrl.ConfigError, match="task\\(index, split\\) and make_env"):
        turnrl.train(env=42, out=tmp_path, overrides=SMALL_RUN)


def test_train_makes_its_learner_with_make_learner(tmp_path: Path) -> None:
    """``make_learner`` is called once with the run's ``LearnerSpec``, and the learner it
    returns (the default one, wrapped here) takes every update."""
    from turnrl.trainer import Learner, LearnerSpec, in_process_learner

    specs: list[LearnerSpec] = []
    steps: list[int] = []

    class Counting(Learner):
        def step_samples(self, *args: Any, **kwargs: Any) -> dict[str, float]:
            steps.append(len(steps) + 1)
            return super().step_samples(*args, **kwargs)

    def make_learner(spec: LearnerSpec) -> Learner:
        specs.append(spec)
        learner = in_process_learner(spec)
        learner.__class__ = Counting
        return learner

    result = turnrl.train(
        "grpo", env=small_probe(), out=tmp_path, overrides=SMALL_RUN, progress=False,
        make_learner=make_learner,
    )  # fmt: skip
    assert len(specs) == 1
    assert not specs[0].resumed
    assert steps == [r["step"] for r in result.rows if "loss/policy" in r] == [1, 2]


def test_train_refuses_make_learner_with_learner_ranks(tmp_path: Path) -> None:
    with pytest.raises(turnrl.ConfigError, match="make_learner makes a learner in this process"):
        turnrl.train(
            env=small_probe(), out=tmp_path, overrides=[*SMALL_RUN, "cluster.learner_ranks=1"],
            make_learner=lambda spec: None,
        )  # fmt: skip
