"""End to end, RL raises the reward: the real trainer (tiny model, warm-up, rollouts through
the hermes tool format, GRPO, KL) learns which answer is rewarded.

This guards the whole loop in CI in about a minute. It is deliberately an easier task than
the secret-lookup probe (the rewarded answer is the same in every episode, so no copying
from context is needed); the probe itself is measured by benchmarks/learning_proof.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from turnrl.envs import registry
from turnrl.envs.secret_lookup import SecretLookup
from turnrl.envs.tool_env import ToolEnv
from turnrl.formats import get_format
from turnrl.rewards import exact_match
from turnrl.trainer.config import load_config
from turnrl.trainer.loop import train


@dataclasses.dataclass(frozen=True)
class FavouriteAnswer(SecretLookup):
    """Secret lookup whose verifier rewards one fixed value ("cat"), whatever was asked."""

    def make_env(self) -> ToolEnv:
        return ToolEnv(
            self._tools, get_format("hermes"), lambda _t, a: exact_match(a, "cat"), max_tool_calls=4
        )


@pytest.mark.learning
def test_grpo_raises_the_success_of_a_rewarded_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(registry.ENVIRONMENTS, "favourite_answer", FavouriteAnswer)
    config = load_config(
        "quickstart",
        [
            "env.name=favourite_answer",
            "steps=20",
            "save_every=100",
            "model.echo_steps=0",
            "eval.every=5",
            "eval.num_tasks=64",
        ],
    )
    rows = train(config, tmp_path / "run", progress=False).rows
    curve = [(r["step"], r["eval/success_mean"]) for r in rows if "eval/success_mean" in r]
    start, final = curve[0][1], curve[-1][1]
    assert start <= 0.25, curve  # after the warm-up: about 1 in 12 (random answers)
    assert final >= 0.8, curve
    assert rows[-1]["rollout/tool_calls_mean"] > 0.5  # it still uses the tool format
