"""The secret-lookup probe's warm-up demonstrations: what they teach and what they leave to
RL (its tasks and tool are covered with the environments in tests/test_registry.py and
tests/test_env_check.py)."""

from __future__ import annotations

import json
import random

import pytest

from turnrl.envs import SecretLookup
from turnrl.errors import ConfigError


def _plays(env: SecretLookup, count: int = 800) -> list[tuple[bool, bool]]:
    """(the asked key called, its value answered) for ``count`` demonstrations."""
    rng = random.Random(0)
    out = []
    for index in range(count):
        task = env.task(index, split="warmup")
        call, answer = env.demonstration(task, rng)
        called = json.loads(call.split("<tool_call>")[1].split("</tool_call>")[0])
        out.append((called["arguments"]["key"] == task.metadata["key"], answer == task.answer))
    return out


def test_plain_demonstrations_teach_grammar_only() -> None:
    plays = _plays(SecretLookup(num_keys=2, key_pool=4))
    assert 0.2 < sum(k for k, _ in plays) / len(plays) < 0.3  # a pool key, 1 time in 4
    assert sum(a for _, a in plays) / len(plays) < 0.12  # the answer by chance, 1 in 12
    assert sum(k and a for k, a in plays) / len(plays) < 0.05


def test_a_share_of_solved_demonstrations_shows_the_solution() -> None:
    plays = _plays(SecretLookup(num_keys=2, key_pool=4, demo_solved=0.25))
    solved = sum(k and a for k, a in plays) / len(plays)
    assert 0.2 < solved < 0.32  # the share, plus the random ones that happen to be right


def test_the_share_is_a_share() -> None:
    with pytest.raises(ConfigError, match=r"demo_solved must be in 0\.\.1"):
        SecretLookup(demo_solved=1.5)
