"""A smolagents agent (examples/smolagents_agent.py), trained as it is.

The real smolagents (from the lock): a ``ToolCallingAgent`` with a ``@tool`` on an
``OpenAIServerModel`` pointed at the real policy endpoint's base URL, over loopback HTTP,
run in a thread as a sync agent. The policy is the backend double of
tests/test_agent_endpoint.py (replies chosen from the prompt), so the agent reaches its
tool, its ``final_answer``, or a tool it does not have, on purpose. smolagents writes its
memory back into each request as text of its own ("Calling tools: ...", the tool's reply
as a user message "Observation: ..."), so every request after the first rewrites the
conversation: checked that each of its turns is then a sample of its own, token-exact,
counted in ``rollout/context_rewrites``; that a call to an unknown tool comes back to the
policy as smolagents' error and the episode fails with reward 0 (smolagents raises
nothing); that a batch trains on all of it; and that the example trains a few steps as
a user runs it.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

pytest.importorskip("smolagents")

from framework_agents import (
    example,
    play_a_batch,
    task_with_key_other_than,
    train_the_example,
)
from test_agent_endpoint import HERMES, ReadingBackend, play_agent
from turnrl.rollout.episode import EpisodeLimits
from turnrl.types import ToolCall

EXAMPLE = example("smolagents_agent")
PROBE = EXAMPLE["PROBE"]
WRONG = PROBE.task(1).metadata["key"]  # the key whose episodes call a tool that is not there
LIMITS = EpisodeLimits(max_turns=6, max_context_tokens=1 << 16)  # smolagents' long prompt


def policy(prompt: str) -> str:
    """Calls lookup for the asked key, then ``final_answer`` with the tool's reply; for the
    key of task 1 it calls a tool named ``ant`` instead, until smolagents runs out of steps
    and asks for an answer without tools."""
    if "please provide an answer" in prompt:
        return "no idea"
    key = re.findall(r"What is the value of (\w+)\?", prompt)[-1]
    if key == WRONG:
        return HERMES.render_call(ToolCall("ant", {"key": key}))
    run = prompt.split("New task:")[-1]  # the system prompt has examples of its own
    replies = re.findall(r"Observation:\s*(.*?)\s*<\|im_end\|>", run, re.S)
    if replies:
        return HERMES.render_call(ToolCall("final_answer", {"answer": replies[-1]}))
    return HERMES.render_call(ToolCall("lookup", {"key": key}))


def test_each_smolagents_step_is_a_token_exact_sample(tokenizer: Any) -> None:
    task = task_with_key_other_than(PROBE, WRONG)
    backend = ReadingBackend(tokenizer, policy)
    traj, endpoint = play_agent(
        tokenizer, EXAMPLE["agent"], backend, task=task, reward=EXAMPLE["reward"], limits=LIMITS
    )
    assert traj.error is None, traj.info.get("traceback")
    assert (traj.success, traj.reward, traj.stop_reason) == (True, 1.0, "answered")
    assert [(c.name, c.arguments) for c in traj.tool_calls] == [("lookup", {"key": task.metadata["key"]})]  # fmt: skip
    assert (len(traj.turns), traj.context_rewrites) == (2, 1)
    samples = traj.samples()  # smolagents re-renders its memory: a sample per request
    assert len(samples) == 2
    for sample, request, turn in zip(samples, backend.requests, traj.turns, strict=True):
        assert list(sample.input_ids) == [*request.prompt_ids, *turn.completion_ids]
        assert [i for i, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m] == list(turn.completion_ids)  # fmt: skip
    first = tokenizer.decode(list(backend.requests[0].prompt_ids))
    assert '"name": "lookup"' in first
    assert '"name": "final_answer"' in first
    second = tokenizer.decode(list(backend.requests[1].prompt_ids))
    assert f"Observation:\n{task.answer}" in second  # the tool ran: its reply reached the policy
    assert endpoint.open_episodes == 0


def test_a_call_to_a_tool_the_agent_lacks_is_the_policys_to_read(tokenizer: Any) -> None:
    backend = ReadingBackend(tokenizer, policy)
    traj, _ = play_agent(
        tokenizer, EXAMPLE["agent"], backend, task=PROBE.task(1), reward=EXAMPLE["reward"],
        limits=LIMITS,
    )  # fmt: skip
    assert traj.error is None, traj.info.get("traceback")
    assert (traj.success, traj.reward, traj.stop_reason) == (False, 0.0, "answered")
    assert "model_error" not in traj.info  # smolagents raised nothing: it kept the error
    assert len(traj.turns) == 4  # three steps (max_steps), then the answer without tools
    assert [c.name for c in traj.tool_calls] == ["ant"] * 3
    second = tokenizer.decode(list(backend.requests[1].prompt_ids))
    assert "Unknown tool ant, should be one of: lookup, final_answer" in second


def test_a_batch_of_smolagents_episodes_is_trained_on(tokenizer: Any) -> None:
    trajs, metrics, tasks = play_a_batch(tokenizer, EXAMPLE, policy, max_context_tokens=1 << 16)
    failed = [t for t in trajs if not t.success]
    assert [t.error for t in trajs] == [None] * len(trajs)
    assert {t.task_id for t in failed} == {t.id for t in tasks if t.metadata["key"] == WRONG}
    assert all(t.samples() for t in trajs)
    assert metrics["rollout/context_rewrites"] == sum(len(t.turns) - 1 for t in trajs) > 0
    # the endpoint never sees a tool message answering a call (smolagents sends the reply as
    # user text), so every call is recorded as sent no result (docs/existing-agent.md)
    assert metrics["rollout/tool_errors_frac"] == 1.0
    assert metrics["rollout/agent_model_errors"] == 0
    assert metrics["rollout/errors"] == 0


def test_the_example_trains_a_few_steps(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = train_the_example("smolagents_agent", tmp_path, monkeypatch)
    assert all(r["rollout/turns_mean"] >= 1 for r in rows)
