"""A PydanticAI agent (examples/pydantic_ai_agent.py), trained as it is.

The real PydanticAI (`pydantic-ai-slim[openai]`, from the lock): an ``Agent`` with a
``@agent.tool_plain`` tool on its OpenAI chat model, the provider built on the client
turnrl hands each episode, against the real policy endpoint over loopback HTTP. The policy
is the backend double of tests/test_agent_endpoint.py (replies chosen from the prompt), so
the agent reaches its tool, its answer, or a tool it does not have, on purpose. Checked:
an episode of the agent is one token-exact training sample; PydanticAI's
``UnexpectedModelBehavior`` (calls to an unknown tool past the retries) is a failed
episode, rewarded 0 and counted, not a bug; a batch counts them; the example trains a few
steps as a user runs it.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

pytest.importorskip("pydantic_ai")

from framework_agents import (
    check_one_token_exact_sample,
    example,
    play_a_batch,
    task_with_key_other_than,
    train_the_example,
)
from test_agent_endpoint import HERMES, ReadingBackend, play_agent
from turnrl.types import ToolCall

EXAMPLE = example("pydantic_ai_agent")
PROBE = EXAMPLE["PROBE"]
WRONG = PROBE.task(1).metadata["key"]  # the key whose episodes call a tool that is not there


def policy(prompt: str) -> str:
    """Calls lookup for the asked key, then answers the tool's reply; for the key of task 1
    it calls a tool named ``ant`` instead, again after PydanticAI's retry prompt."""
    key = re.findall(r"What is the value of (\w+)\?", prompt)[-1]
    if key == WRONG:
        return HERMES.render_call(ToolCall("ant", {"key": key}))
    replies = re.findall(r"<tool_response>\s*(.*?)\s*</tool_response>", prompt, re.S)
    if replies:
        return replies[-1]
    return HERMES.render_call(ToolCall("lookup", {"key": key}))


def test_a_pydantic_ai_episode_is_one_token_exact_sample(tokenizer: Any) -> None:
    task = task_with_key_other_than(PROBE, WRONG)
    backend = ReadingBackend(tokenizer, policy)
    traj, endpoint = play_agent(tokenizer, EXAMPLE["agent"], backend, task=task, reward=EXAMPLE["reward"])  # fmt: skip
    check_one_token_exact_sample(tokenizer, traj, backend, endpoint, task, "PydanticAI")


def test_calls_to_a_tool_the_agent_lacks_are_a_failed_episode(tokenizer: Any) -> None:
    traj, _ = play_agent(
        tokenizer, EXAMPLE["agent"], ReadingBackend(tokenizer, policy), task=PROBE.task(1),
        reward=EXAMPLE["reward"],
    )  # fmt: skip
    assert traj.error is None, traj.info.get("traceback")
    assert (traj.success, traj.reward, traj.stop_reason) == (False, 0.0, "answered")
    assert traj.info["model_error"]["type"] == "UnexpectedModelBehavior"
    assert len(traj.turns) == 2  # the call, PydanticAI's retry prompt, the call again
    second = traj.turns[1]
    assert second.completion_ids  # the retry was a sampled turn, trained on like any
    assert [(c.name, c.ok) for c in traj.tool_calls] == [("ant", True), ("ant", False)]


def test_a_batch_counts_pydantic_ais_model_errors_and_trains_on_them(tokenizer: Any) -> None:
    trajs, metrics, tasks = play_a_batch(tokenizer, EXAMPLE, policy)
    erred = [t for t in trajs if t.info.get("model_error")]
    assert [t.error for t in trajs] == [None] * len(trajs)
    assert {t.task_id for t in erred} == {t.id for t in tasks if t.metadata["key"] == WRONG}
    assert all(t.success for t in trajs if t not in erred)
    assert all(t.samples() for t in trajs)  # every episode, failed or not, is trained on
    assert metrics["rollout/agent_model_errors"] == len(erred) > 0
    assert metrics["rollout/agent_model_errors/UnexpectedModelBehavior"] == len(erred)
    assert metrics["rollout/errors"] == 0


def test_the_example_trains_a_few_steps(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = train_the_example("pydantic_ai_agent", tmp_path, monkeypatch)
    assert all(r["rollout/turns_mean"] >= 1 for r in rows)
