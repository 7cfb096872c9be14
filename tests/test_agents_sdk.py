"""An OpenAI Agents SDK agent (examples/agents_sdk.py), trained as it is.

The real SDK (`openai-agents`, from the lock) with its default model, which speaks the
Responses API, against the real policy endpoint over loopback HTTP; the policy is the
backend double of tests/test_agent_endpoint.py (replies chosen from the prompt), so the
agent reaches its tool, its answer, or a tool it does not have, on purpose. Checked: an
episode of the SDK is one token-exact training sample; the SDK's ``ModelBehaviorError``
for a call to an unknown tool is a failed episode, rewarded 0 and counted, not a bug;
the same with the SDK streaming (``Runner.run_streamed``) and with its Chat Completions
model. examples/agents_sdk.py itself trains a few steps in tests/test_examples.py.
"""

from __future__ import annotations

import asyncio
import re
import runpy
from pathlib import Path
from typing import Any

import openai
import pytest
from agents import Agent, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool
from agents.models.openai_provider import OpenAIProvider

from test_agent_endpoint import HERMES, ReadingBackend, play_agent
from turnrl.envs.agent import AgentEnvironment
from turnrl.models.loading import stop_token_ids
from turnrl.rollout.chat import ChatRenderer
from turnrl.rollout.episode import EpisodeLimits, SamplingParams
from turnrl.rollout.groups import GroupSpec, collect_groups, rollout_metrics
from turnrl.types import Task, ToolCall

EXAMPLE = runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "agents_sdk.py"))
PROBE = EXAMPLE["PROBE"]


def policy(prompt: str) -> str:
    """Calls lookup for the asked key (a tool named ``ant`` instead when the key is the
    one task 1 asks for), then answers the tool's reply."""
    replies = re.findall(r"<tool_response>\s*(.*?)\s*</tool_response>", prompt, re.S)
    if replies:
        return replies[-1]
    key = re.findall(r"What is the value of (\w+)\?", prompt)[-1]
    name = "ant" if key == PROBE.task(1).metadata["key"] else "lookup"
    return HERMES.render_call(ToolCall(name, {"key": key}))


def _make_solver(table: dict[str, str]) -> Agent[Any]:
    @function_tool
    def lookup(key: str) -> str:
        """Look up a key.

        Args:
            key: The key.
        """
        return table.get(key, f"Error: no key {key!r} in the table")

    return Agent(name="solver", model="policy", tools=[lookup])


async def streamed_agent(task: Task, client: openai.AsyncOpenAI) -> str:
    """The example's agent, run by ``Runner.run_streamed`` (the Responses API, streamed)."""
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)
    result = Runner.run_streamed(
        _make_solver(task.metadata["table"]), task.prompt[0]["content"], max_turns=4,
        run_config=config,
    )  # fmt: skip
    async for _ in result.stream_events():
        pass
    return str(result.final_output)


async def chat_completions_agent(task: Task, client: openai.AsyncOpenAI) -> str:
    """The example's agent on the SDK's Chat Completions model."""
    solver = _make_solver(task.metadata["table"])
    solver.model = OpenAIChatCompletionsModel(model="policy", openai_client=client)
    config = RunConfig(tracing_disabled=True)
    result = await Runner.run(solver, task.prompt[0]["content"], max_turns=4, run_config=config)
    return str(result.final_output)


AGENTS = {"Runner.run": EXAMPLE["agent"], "run_streamed": streamed_agent,
          "chat_completions": chat_completions_agent}  # fmt: skip


@pytest.mark.parametrize("how", list(AGENTS))
def test_an_agents_sdk_episode_is_one_token_exact_sample(tokenizer: Any, how: str) -> None:
    task = _task_with_key_other_than(PROBE.task(1).metadata["key"])
    backend = ReadingBackend(tokenizer, policy)
    traj, endpoint = play_agent(tokenizer, AGENTS[how], backend, task=task, reward=EXAMPLE["reward"])  # fmt: skip
    assert traj.error is None, traj.info.get("traceback")
    assert (traj.success, traj.reward, traj.stop_reason) == (True, 1.0, "answered")
    assert [(c.name, c.ok) for c in traj.tool_calls] == [("lookup", True)]
    assert (len(traj.turns), traj.context_rewrites) == (2, 0)
    [sample] = traj.samples()  # the SDK's second request extends the first: one sample
    assert list(sample.input_ids) == [*backend.requests[-1].prompt_ids, *traj.turns[-1].completion_ids]  # fmt: skip
    sampled = [i for turn in traj.turns for i in turn.completion_ids]
    assert [i for i, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m] == sampled
    prompt = tokenizer.decode(list(backend.requests[0].prompt_ids))
    assert '"name": "lookup"' in prompt  # the SDK's tool schema, rendered by the template
    assert endpoint.open_episodes == 0


@pytest.mark.parametrize("how", list(AGENTS))
def test_a_call_to_a_tool_the_agent_lacks_is_a_failed_episode(tokenizer: Any, how: str) -> None:
    traj, _ = play_agent(
        tokenizer, AGENTS[how], ReadingBackend(tokenizer, policy), task=PROBE.task(1),
        reward=EXAMPLE["reward"],
    )  # fmt: skip
    assert traj.error is None, traj.info.get("traceback")
    assert (traj.success, traj.reward, traj.stop_reason, len(traj.turns)) == (
        False, 0.0, "answered", 1,
    )  # fmt: skip
    assert traj.info["model_error"]["type"] == "ModelBehaviorError"
    assert "ant" in traj.info["model_error"]["message"]
    [call] = traj.tool_calls  # the call the agent refused, recorded as failed
    assert (call.name, call.ok) == ("ant", False)
    assert (call.error or "").startswith("ModelBehaviorError: ")


def test_a_batch_counts_the_sdks_model_errors_and_trains_on_them(tokenizer: Any) -> None:
    environment = AgentEnvironment(EXAMPLE["agent"], PROBE.task, EXAMPLE["reward"])
    spec = GroupSpec(
        group_size=2,
        limits=EpisodeLimits(max_turns=4, timeout_s=60),
        sampling=SamplingParams(stop_token_ids=stop_token_ids(tokenizer)),
        seed=0,
    )
    tasks = [environment.task(i) for i in range(8)]
    try:
        groups = asyncio.run(
            collect_groups(
                tasks, environment.make_env, ReadingBackend(tokenizer, policy),
                ChatRenderer(tokenizer), spec,
            )
        )  # fmt: skip
    finally:
        environment.close()
    trajs = [t for g in groups for t in g]
    wrong = PROBE.task(1).metadata["key"]
    erred = [t for t in trajs if t.info.get("model_error")]
    assert [t.error for t in trajs] == [None] * 16
    assert {t.task_id for t in erred} == {t.id for t in tasks if t.metadata["key"] == wrong}
    assert all(t.success for t in trajs if t not in erred)
    assert all(t.samples() for t in trajs)  # every episode, failed or not, is trained on
    metrics = rollout_metrics(groups)
    assert metrics["rollout/agent_model_errors"] == len(erred) > 0
    assert metrics["rollout/agent_model_errors/ModelBehaviorError"] == len(erred)
    assert metrics["rollout/errors"] == 0


def _task_with_key_other_than(key: str) -> Task:
    return next(t for t in map(PROBE.task, range(100)) if t.metadata["key"] != key)


def test_the_sdk_s_requests_are_the_responses_api(tokenizer: Any) -> None:
    """The example's agent speaks the Responses API by default (what the issue found the
    endpoint lacked): its requests reach ``.../responses``, its tools in that form."""
    seen: list[str] = []

    class Recording(openai.AsyncOpenAI):
        async def post(self, path: str, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
            seen.append(path)
            return await super().post(path, *args, **kwargs)

    async def recorded(task: Task, *, base_url: str, api_key: str) -> str:
        client = Recording(base_url=base_url, api_key=api_key, max_retries=0)
        try:
            return await EXAMPLE["agent"](task, client)
        finally:
            await client.close()

    task = _task_with_key_other_than(PROBE.task(1).metadata["key"])
    traj, _ = play_agent(
        tokenizer, recorded, ReadingBackend(tokenizer, policy), task=task, reward=EXAMPLE["reward"]
    )
    assert traj.error is None, traj.info.get("traceback")
    assert traj.success
    assert seen == ["/responses", "/responses"]
