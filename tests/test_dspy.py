"""A DSPy program (examples/dspy_agent.py), trained as it is.

The real DSPy (from the lock): ``dspy.ReAct`` with a plain-function tool, its
``dspy.LM("openai/policy", api_base=...)`` pointed at the real policy endpoint over
loopback HTTP. The policy is the backend double of tests/test_agent_endpoint.py (replies
chosen from the prompt), written in DSPy's field format, so the program reaches its tool,
its answer, or text that does not parse, on purpose. DSPy renders its trajectory into a
fresh prompt at each step (no OpenAI tool calls), so each request after the first
rewrites the conversation: checked that each step is then a sample of its own,
token-exact, counted in ``rollout/context_rewrites``; that DSPy's ``AdapterParseError``
is a failed episode, rewarded 0 and counted, not a bug; that a batch counts them; and
that the example trains a few steps as a user runs it.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

pytest.importorskip("dspy")

from framework_agents import (
    example,
    play_a_batch,
    task_with_key_other_than,
    train_the_example,
)
from test_agent_endpoint import ReadingBackend, play_agent
from turnrl.rollout.episode import EpisodeLimits

EXAMPLE = example("dspy_agent")  # (it keeps DSPy from fetching its model map from GitHub)
PROBE = EXAMPLE["PROBE"]
fields = EXAMPLE["fields"]
WRONG = PROBE.task(1).metadata["key"]  # the key whose episodes answer what does not parse
LIMITS = EpisodeLimits(max_turns=6, max_context_tokens=1 << 16)  # DSPy's long prompts


def policy(prompt: str) -> str:
    """In DSPy's fields: a ReAct step calling lookup for the asked key, then one finishing,
    then the extraction answering the tool's reply; for the key of task 1, text that is no
    field at all (DSPy's JSON adapter asks again, then gives up)."""
    key = re.findall(r"What is the value of (\w+)\?", prompt)[-1]
    if key == WRONG:
        return "I do not know."
    asked = prompt.rsplit("<|im_start|>user", 1)[-1]
    seen = re.findall(r"\[\[ ## observation_\d+ ## \]\]\n(.*?)\n", asked)
    if "`[[ ## next_thought ## ]]`" not in asked:  # the extraction
        return fields(reasoning="The table says so.", answer=seen[0])
    if seen:
        return fields(next_thought="Done.", next_tool_name="finish", next_tool_args="{}")
    return fields(next_thought="I look it up.", next_tool_name="lookup",
                  next_tool_args=json.dumps({"key": key}))  # fmt: skip


def test_each_dspy_step_is_a_token_exact_sample(tokenizer: Any) -> None:
    task = task_with_key_other_than(PROBE, WRONG)
    backend = ReadingBackend(tokenizer, policy)
    traj, endpoint = play_agent(
        tokenizer, EXAMPLE["agent"], backend, task=task, reward=EXAMPLE["reward"], limits=LIMITS
    )
    assert traj.error is None, traj.info.get("traceback")
    assert (traj.success, traj.reward, traj.stop_reason) == (True, 1.0, "answered")
    assert traj.tool_calls == []  # DSPy names its tool in a field of text, not an API call
    assert (len(traj.turns), traj.context_rewrites) == (3, 2)  # lookup, finish, extraction
    samples = traj.samples()  # DSPy renders a fresh prompt per step: a sample per request
    assert len(samples) == 3
    for sample, request, turn in zip(samples, backend.requests, traj.turns, strict=True):
        assert list(sample.input_ids) == [*request.prompt_ids, *turn.completion_ids]
        assert [i for i, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m] == list(turn.completion_ids)  # fmt: skip
    second = tokenizer.decode(list(backend.requests[1].prompt_ids))
    assert "[[ ## tool_name_0 ## ]]\nlookup" in second
    assert f"[[ ## observation_0 ## ]]\n{task.answer}" in second  # the tool ran: its reply
    assert endpoint.open_episodes == 0


def test_text_that_does_not_parse_is_a_failed_episode(tokenizer: Any) -> None:
    traj, _ = play_agent(
        tokenizer, EXAMPLE["agent"], ReadingBackend(tokenizer, policy), task=PROBE.task(1),
        reward=EXAMPLE["reward"], limits=LIMITS,
    )  # fmt: skip
    assert traj.error is None, traj.info.get("traceback")
    assert (traj.success, traj.reward, traj.stop_reason) == (False, 0.0, "answered")
    assert traj.info["model_error"]["type"] == "AdapterParseError"
    assert "I do not know." in traj.info["model_error"]["message"]
    assert len(traj.turns) == 2  # DSPy's chat format, then its JSON adapter's second try
    assert all(t.completion_ids for t in traj.turns)  # both sampled, both trained on


def test_a_batch_counts_dspys_model_errors_and_trains_on_them(tokenizer: Any) -> None:
    trajs, metrics, tasks = play_a_batch(tokenizer, EXAMPLE, policy, max_context_tokens=1 << 16)
    erred = [t for t in trajs if t.info.get("model_error")]
    assert [t.error for t in trajs] == [None] * len(trajs)
    assert {t.task_id for t in erred} == {t.id for t in tasks if t.metadata["key"] == WRONG}
    assert all(t.success for t in trajs if t not in erred)
    assert all(t.samples() for t in trajs)  # every episode, failed or not, is trained on
    assert metrics["rollout/agent_model_errors"] == len(erred) > 0
    assert metrics["rollout/agent_model_errors/AdapterParseError"] == len(erred)
    assert metrics["rollout/context_rewrites"] == sum(len(t.turns) - 1 for t in trajs)
    assert metrics["rollout/errors"] == 0


def test_the_example_trains_a_few_steps(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = train_the_example("dspy_agent", tmp_path, monkeypatch)
    assert all(r["rollout/turns_mean"] >= 1 for r in rows)
