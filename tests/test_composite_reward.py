"""The composite reward: ToolRL's tool-call score on hand-computed cases, the gated format
term, weights that keep the outcome dominant, and the terms inside real episodes."""

from __future__ import annotations

import asyncio

import pytest

from turnrl.envs.policy import play, replay
from turnrl.envs.tool_env import ToolEnv
from turnrl.formats import get_format
from turnrl.rewards import Verdict, exact_match
from turnrl.rewards.composite import CompositeReward, toolrl_correctness
from turnrl.tools import ToolSet
from turnrl.types import Task, ToolCall

S = ToolCall


@pytest.mark.parametrize(
    ("predicted", "gold", "expected"),
    [
        (None, [S("search", {"q": "a"})], -3.0),  # the calls did not parse
        ([S("search", {"q": "a"})], [S("search", {"q": "a"})], 3.0),  # identical
        ([], [], 3.0),  # no call wanted, none made
        ([], [S("search", {"q": "a"})], -3.0),  # score 0 of S_max 3
        # names 1 + keys 1 + values 0 = 2 of 3 -> 6 * 2/3 - 3
        ([S("search", {"q": "b"})], [S("search", {"q": "a"})], 1.0),
        # names 1/2 + (keys 1 + values 1) = 2.5 of 3 -> 2
        ([S("search", {"q": "a"}), S("lookup", {"k": 1})], [S("search", {"q": "a"})], 2.0),
        # names 1 + keys 1/2 + values 1 = 2.5 of 3 -> 2
        ([S("search", {"q": "a", "k": 3})], [S("search", {"q": "a"})], 2.0),
        # two gold calls, S_max = 1 + 2 + 3 = 6; names 1 + (1 + 1) + (1 + 1) = 5 -> 2
        (
            [S("a", {"x": 1}), S("b", {"y": 2, "z": 0})],
            [S("a", {"x": 1}), S("b", {"y": 2, "z": 3})],
            2.0,
        ),
    ],
)
def test_toolrl_correctness(
    predicted: list[ToolCall] | None, gold: list[ToolCall], expected: float
) -> None:
    assert toolrl_correctness(predicted, gold) == pytest.approx(expected)


def test_the_best_match_is_taken_among_same_name_predictions() -> None:
    # names 1 + (keys 1 + values 1) = 3 of S_max 3 -> +3, though not identical to gold
    assert toolrl_correctness([S("a", {"x": 0}), S("a", {"x": 1})], [S("a", {"x": 1})]) == 3.0


def test_format_is_gated_on_the_outcome() -> None:
    shaped = CompositeReward(format_weight=0.1)
    right, wrong = Verdict(1.0, True, {"correct": 1.0}), Verdict(0.0, False, {"correct": 0.0})
    assert shaped.combine(wrong, calls=[], format_errors=0).reward == 0.0  # form alone: 0
    assert shaped.combine(right, calls=[], format_errors=0).reward == pytest.approx(1.1)
    clumsy = shaped.combine(right, calls=[], format_errors=2)
    assert clumsy.reward == 1.0
    assert clumsy.components == {"correct": 1.0, "outcome": 1.0, "format": 0.0}
    assert clumsy.success


def test_tool_match_needs_gold_and_is_scaled_to_unit_range() -> None:
    shaped = CompositeReward(format_weight=0.0, tool_weight=0.5)
    wrong = Verdict(0.0, False)
    gold = [S("search", {"q": "a"})]
    missed = shaped.combine(wrong, calls=[], format_errors=0, gold=gold)
    assert missed.components["tool_match"] == -1.0
    assert missed.reward == -0.5
    close = shaped.combine(wrong, calls=[S("search", {"q": "b"})], format_errors=0, gold=gold)
    assert close.components["tool_match"] == pytest.approx(1 / 3)
    assert "tool_match" not in shaped.combine(wrong, calls=[], format_errors=0).components


@pytest.mark.parametrize(
    "weights",
    [{"outcome_weight": 0.0}, {"format_weight": -0.1}, {"format_weight": 0.6, "tool_weight": 0.6}],
)
def test_weights_keep_the_outcome_dominant(weights: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must"):
        CompositeReward(**weights)


def test_the_terms_inside_episodes() -> None:
    hermes = get_format("hermes")

    def lookup(key: str) -> str:
        """Look up a key.

        Args:
            key: the key
        """
        return {"a": "cat"}.get(key, "none")

    task = Task("t", ({"role": "user", "content": "value of a?"},), answer="cat",
                metadata={"gold_calls": [{"name": "lookup", "arguments": {"key": "a"}}]})  # fmt: skip

    def episode(turns: list[str]) -> Verdict:
        env = ToolEnv(
            ToolSet([lookup]), lambda t, a: exact_match(a, str(t.answer)), format=hermes,
            reward=CompositeReward(format_weight=0.1, tool_weight=0.2),
        )  # fmt: skip
        ep = asyncio.run(play(env, task, replay(turns), seed=0, max_steps=6))
        last = ep.results[-1]
        return Verdict(last.reward, bool(last.info.get("success")),
                       last.info.get("reward_components", {}))  # fmt: skip

    call = hermes.render_call(ToolCall("lookup", {"key": "a"}))
    clean = episode([call, "cat"])
    assert clean.reward == pytest.approx(1.0 + 0.1 + 0.2)
    assert clean.components["tool_match"] == 1.0
    sloppy = episode(["<tool_call>{broken", call, "cat"])
    assert sloppy.components["format"] == 0.0
    assert sloppy.reward == pytest.approx(1.0 + 0.2)
    form_only = episode([""])  # an empty answer: no outcome, no format bonus, missed call
    assert form_only.reward == pytest.approx(-0.2)
    assert not form_only.success
