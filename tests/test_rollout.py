"""Invariants of the rollout engine, driven by a scripted backend through a real tokenizer
and chat template: token-exactness, the loss mask, prefix continuity, errors as
observations, and the recorded reason of every truncation."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from turnrl.backends.scripted import ScriptedBackend
from turnrl.envs import SecretLookup
from turnrl.formats import get_format
from turnrl.models.loading import stop_token_ids
from turnrl.rollout.chat import ChatRenderer
from turnrl.rollout.episode import EpisodeLimits, SamplingParams, run_episode
from turnrl.types import Completion, GenerationRequest, Task, ToolCall, Trajectory

SPEC = SecretLookup()
TASK = SPEC.task(0)
KEY = TASK.metadata["key"]
CALL = get_format("hermes").render_call(ToolCall("lookup", {"key": KEY}))


def play(
    tokenizer: Any,
    texts: list[str],
    *,
    limits: EpisodeLimits | None = None,
    task: Task = TASK,
    spec: SecretLookup = SPEC,
) -> tuple[Trajectory, ScriptedBackend]:
    stops = stop_token_ids(tokenizer)
    backend = ScriptedBackend(tokenizer, texts, end_token_id=stops[0])

    async def generate(request: GenerationRequest) -> Completion:
        return (await backend.generate([request]))[0]

    env = spec.make_env()
    traj = asyncio.run(
        run_episode(
            env,
            task,
            generate,
            ChatRenderer(tokenizer, env.tool_schemas()),
            limits=limits or EpisodeLimits(),
            sampling=SamplingParams(stop_token_ids=stops),
            seed=0,
        )
    )
    return traj, backend


def test_loss_mask_is_one_exactly_on_sampled_tokens(tokenizer: Any) -> None:
    traj, _ = play(tokenizer, [CALL, TASK.answer])
    assert traj.success
    assert traj.stop_reason == "answered"
    assert traj.reward == 1.0
    [sample] = traj.samples()
    sampled = [t for turn in traj.turns for t in turn.completion_ids]
    assert [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m] == sampled
    # Positions, not just values: each completion sits right after its turn's prompt tokens.
    pos = 0
    for turn in traj.turns:
        pos += len(turn.prompt_ids)
        n = len(turn.completion_ids)
        assert sample.loss_mask[pos - 1] == 0
        assert all(sample.loss_mask[pos : pos + n])
        assert list(sample.input_ids[pos : pos + n]) == list(turn.completion_ids)
        pos += n
    assert sum(sample.loss_mask) == len(sampled)


def test_sequence_is_exactly_the_rendered_conversation(tokenizer: Any) -> None:
    traj, _ = play(tokenizer, [CALL, TASK.answer])
    [sample] = traj.samples()
    env = SPEC.make_env()
    asyncio.run(env.reset(TASK, 0))
    renderer = ChatRenderer(tokenizer, env.tool_schemas())
    text = renderer.text(traj.messages, add_generation_prompt=False)
    # The template closes the last turn with a newline the model never sampled.
    assert renderer.decode(sample.input_ids) == text.rstrip("\n")


def test_each_turn_context_starts_with_all_previous_tokens(tokenizer: Any) -> None:
    traj, backend = play(tokenizer, [CALL, CALL, TASK.answer])
    assert len(backend.requests) == 3
    for k in range(2):
        before = list(backend.requests[k].prompt_ids) + list(traj.turns[k].completion_ids)
        after = list(backend.requests[k + 1].prompt_ids)
        assert after[: len(before)] == before
        assert len(after) > len(before)
    assert traj.template_breaks == 0
    assert len(traj.samples()) == 1


def test_tool_exception_becomes_an_observation(tokenizer: Any) -> None:
    bad = get_format("hermes").render_call(ToolCall("lookup", {"key": "no-such-key"}))
    traj, backend = play(tokenizer, [bad, TASK.answer])
    assert traj.stop_reason == "answered"
    assert traj.error is None
    [record] = traj.tool_calls
    assert not record.ok
    assert "no key 'no-such-key'" in (record.error or "")
    shown = tokenizer.decode(backend.requests[1].prompt_ids)
    assert "LookupError: no key 'no-such-key' in the table" in shown


def test_unknown_tool_and_malformed_call_become_observations(tokenizer: Any) -> None:
    unknown = get_format("hermes").render_call(ToolCall("search", {"q": "x"}))
    broken = '<tool_call>\n{"name": "lookup", "arguments": {"key": }\n</tool_call>'
    traj, backend = play(tokenizer, [unknown, broken, TASK.answer])
    assert traj.stop_reason == "answered"
    second = tokenizer.decode(backend.requests[1].prompt_ids)
    third = tokenizer.decode(backend.requests[2].prompt_ids)
    assert "unknown tool 'search'" in second
    assert "lookup" in second
    assert "invalid JSON" in third


def test_max_turns_is_recorded(tokenizer: Any) -> None:
    traj, _ = play(tokenizer, [CALL] * 3, limits=EpisodeLimits(max_turns=3))
    assert traj.truncated
    assert not traj.terminated
    assert traj.stop_reason == "max_turns"
    assert len(traj.turns) == 3
    assert traj.reward == 0.0


def test_max_tokens_per_turn_is_recorded(tokenizer: Any) -> None:
    traj, _ = play(tokenizer, ["word " * 50], limits=EpisodeLimits(max_tokens_per_turn=8))
    assert traj.stop_reason == "max_tokens_per_turn"
    assert traj.truncated
    assert len(traj.turns[0].completion_ids) == 8
    assert traj.turns[0].finish_reason == "length"


def test_max_episode_tokens_is_recorded(tokenizer: Any) -> None:
    n_call = len(tokenizer.encode(CALL, add_special_tokens=False)) + 1
    limits = EpisodeLimits(max_tokens_per_turn=64, max_episode_tokens=n_call + 1)
    traj, _ = play(tokenizer, [CALL, "a longer answer than one token"], limits=limits)
    assert traj.stop_reason == "max_episode_tokens"
    assert traj.truncated
    assert traj.num_completion_tokens == n_call + 1


def test_max_context_is_recorded(tokenizer: Any) -> None:
    traj, _ = play(tokenizer, [CALL, CALL], limits=EpisodeLimits(max_context_tokens=10))
    assert traj.stop_reason == "max_context"
    assert traj.turns == []


def test_backend_failure_is_recorded_not_raised(tokenizer: Any) -> None:
    traj, _ = play(tokenizer, [])  # the scripted backend has nothing to say: it raises
    assert traj.stop_reason == "error"
    assert traj.error is not None
    assert "IndexError" in traj.error
    assert not traj.truncated
    assert not traj.terminated


def test_template_break_starts_a_new_sample(tokenizer: Any) -> None:
    # A template that hides the content of earlier assistant turns (as reasoning-stripping
    # templates do) cannot be continued token-exactly: the episode splits into samples.
    hiding = tokenizer.chat_template.replace(
        "{{- message.content }}",
        "{{- message.content if loop.last or message.role != 'assistant' else '(hidden)' }}",
    )
    if hiding == tokenizer.chat_template:
        pytest.skip("the template's layout changed; update the substitution")
    tokenizer.chat_template, original = hiding, tokenizer.chat_template
    try:
        traj, _ = play(tokenizer, [CALL, CALL, TASK.answer])
    finally:
        tokenizer.chat_template = original
    assert traj.template_breaks >= 1
    assert traj.turns[1].new_sample
    samples = traj.samples()
    assert len(samples) == 1 + traj.template_breaks
    assert sum(sum(s.loss_mask) for s in samples) == traj.num_completion_tokens


def test_trajectory_json_round_trip_is_exact(tokenizer: Any) -> None:
    import json

    traj, _ = play(tokenizer, [CALL, TASK.answer])
    # each turn's version kept (partial rollouts sample an episode's turns with several)
    traj.turns = [dataclasses.replace(turn, policy_version=v) for v, turn in enumerate(traj.turns)]
    again = Trajectory.from_json(json.loads(json.dumps(traj.to_json())))
    assert again == traj
    assert [turn.policy_version for turn in again.turns] == [0, 1]
    assert again.samples() == traj.samples()


def test_a_format_stop_string_ends_the_turn_before_the_model_writes_an_observation(
    tokenizer: Any,
) -> None:
    from turnrl.envs.tool_env import ToolEnv
    from turnrl.rewards import exact_match
    from turnrl.tools import Tool, ToolSet

    def search(query: str) -> str:
        """Search.

        Args:
            query: The query.
        """
        return f"found {query}"

    fmt = get_format("search_r1")
    env = ToolEnv(
        ToolSet([Tool.from_function(search)]), lambda t, a: exact_match(a, "cat"), format=fmt
    )
    stops = stop_token_ids(tokenizer)
    backend = ScriptedBackend(
        tokenizer,
        ["<search>cat</search><information>made up</information>", "<answer>cat</answer>"],
        end_token_id=stops[0],
    )

    async def generate(request: GenerationRequest) -> Completion:
        return (await backend.generate([request]))[0]

    traj = asyncio.run(
        run_episode(
            env,
            TASK,
            generate,
            ChatRenderer(tokenizer),
            limits=EpisodeLimits(),
            sampling=SamplingParams(stop_token_ids=stops),
            seed=0,
        )
    )
    assert backend.requests[0].stop_strings == ("</search>",)
    assert traj.turns[0].text == "<search>cat</search>"  # cut at the stop string
    assert traj.turns[0].completion_ids[-1] not in stops  # the model did not end the turn
    (sample,) = traj.samples()  # still one token-exact sequence
    context = tokenizer.decode(sample.input_ids)
    assert "made up" not in context
    assert "found cat" in context
    assert traj.success
    assert traj.stop_reason == "answered"
