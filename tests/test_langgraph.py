"""A LangGraph agent (examples/langgraph_agent.py), trained as it is.

The real LangGraph and langchain-openai (from the lock): a ReAct graph (model node,
``ToolNode``, ``tools_condition``) whose ``ChatOpenAI`` is pointed at the real policy
endpoint's base URL, over loopback HTTP. The policy is the backend double of
tests/test_agent_endpoint.py (replies chosen from the prompt), so the graph reaches its
tool, its answer, or loops past its recursion limit, on purpose. Checked: an episode of
the graph is one token-exact training sample; LangGraph's ``GraphRecursionError`` is a
failed episode, rewarded 0 and counted, not a bug; a batch counts them; the example
trains a few steps as a user runs it.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

pytest.importorskip("langgraph")
pytest.importorskip("langchain_openai")

from framework_agents import (
    check_one_token_exact_sample,
    example,
    play_a_batch,
    task_with_key_other_than,
    train_the_example,
)
from test_agent_endpoint import HERMES, ReadingBackend, play_agent
from turnrl.types import ToolCall

EXAMPLE = example("langgraph_agent")
PROBE = EXAMPLE["PROBE"]
LOOPER = PROBE.task(1).metadata["key"]  # the key whose episodes never answer


def policy(prompt: str) -> str:
    """Calls lookup for the asked key, then answers the tool's reply; for the key of task 1
    it calls lookup again and again (the graph loops to its recursion limit)."""
    replies = re.findall(r"<tool_response>\s*(.*?)\s*</tool_response>", prompt, re.S)
    key = re.findall(r"What is the value of (\w+)\?", prompt)[-1]
    if replies and key != LOOPER:
        return replies[-1]
    return HERMES.render_call(ToolCall("lookup", {"key": key}))


def test_a_langgraph_episode_is_one_token_exact_sample(tokenizer: Any) -> None:
    task = task_with_key_other_than(PROBE, LOOPER)
    backend = ReadingBackend(tokenizer, policy)
    traj, endpoint = play_agent(tokenizer, EXAMPLE["agent"], backend, task=task, reward=EXAMPLE["reward"])  # fmt: skip
    check_one_token_exact_sample(tokenizer, traj, backend, endpoint, task, "LangGraph")


def test_a_graph_past_its_recursion_limit_is_a_failed_episode(tokenizer: Any) -> None:
    traj, _ = play_agent(
        tokenizer, EXAMPLE["agent"], ReadingBackend(tokenizer, policy), task=PROBE.task(1),
        reward=EXAMPLE["reward"],
    )  # fmt: skip
    assert traj.error is None, traj.info.get("traceback")
    assert (traj.success, traj.reward, traj.stop_reason) == (False, 0.0, "answered")
    assert traj.info["model_error"]["type"] == "GraphRecursionError"
    assert len(traj.turns) == 4  # recursion_limit 8: four model steps, four tool steps
    assert [c.ok for c in traj.tool_calls] == [True, True, True, False]  # the last one unrun


def test_a_batch_counts_the_graphs_model_errors_and_trains_on_them(tokenizer: Any) -> None:
    trajs, metrics, tasks = play_a_batch(tokenizer, EXAMPLE, policy)
    erred = [t for t in trajs if t.info.get("model_error")]
    assert [t.error for t in trajs] == [None] * len(trajs)
    assert {t.task_id for t in erred} == {t.id for t in tasks if t.metadata["key"] == LOOPER}
    assert all(t.success for t in trajs if t not in erred)
    assert all(t.samples() for t in trajs)  # every episode, failed or not, is trained on
    assert metrics["rollout/agent_model_errors"] == len(erred) > 0
    assert metrics["rollout/agent_model_errors/GraphRecursionError"] == len(erred)
    assert metrics["rollout/errors"] == 0


def test_the_example_trains_a_few_steps(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = train_the_example("langgraph_agent", tmp_path, monkeypatch)
    assert all(r["rollout/turns_mean"] >= 1 for r in rows)
