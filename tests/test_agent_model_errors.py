"""The model's mistakes are data, when an agent framework reports them by raising.

An agent's exception that is one of the environment's ``model_errors`` (the frameworks'
defaults, matched by qualified name, plus the user's own) ends its episode as a failure
that is rewarded (0, or ``model_error_reward``'s partial credit), trained on and counted
(``rollout/agent_model_errors``); every other exception is still a bug that stops the
run, and says how to declare it when it comes from a framework. Real ``openai`` clients
over loopback HTTP, the real OpenAI Agents SDK's exceptions; the policy is the backend
double of tests/test_agent_endpoint.py (replies chosen from the prompt).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
import pytest
from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError, UserError

import turnrl
from agent_framework_workers import calls_an_unknown_tool, framework_error
from agent_workers import LOOKUP
from conftest import SMALL_RUN
from test_agent_endpoint import PROBE, ReadingBackend, exact, oracle, play_agent
from turnrl.envs import SecretLookup
from turnrl.envs.agent import MODEL_ERRORS, AgentEnvironment, model_error_type
from turnrl.envs.agent_processes import AgentProcesses
from turnrl.models.loading import stop_token_ids
from turnrl.rewards import Verdict
from turnrl.rollout.chat import ChatRenderer
from turnrl.rollout.episode import EpisodeLimits, SamplingParams
from turnrl.rollout.groups import GroupSpec, collect_groups, rollout_metrics
from turnrl.types import Task, Trajectory


def test_the_frameworks_errors_are_matched_by_qualified_name_without_their_packages() -> None:
    for name in MODEL_ERRORS:
        assert model_error_type(framework_error(name)("x"), MODEL_ERRORS) == name.split(".")[-1]
    # subclasses are matched through their bases' names: smolagents' AgentToolCallError
    execution = framework_error("smolagents.utils.AgentExecutionError")
    tool_call = framework_error("smolagents.utils.AgentToolCallError", base=execution)
    assert model_error_type(tool_call("bad args"), MODEL_ERRORS) == "AgentToolCallError"
    # a failed model call is the endpoint's failure, not the model's
    assert model_error_type(framework_error("smolagents.utils.AgentGenerationError")("x"), MODEL_ERRORS) is None  # fmt: skip
    # the same class name from another package is not the framework's
    assert model_error_type(framework_error("mine.GraphRecursionError")("x"), MODEL_ERRORS) is None
    assert model_error_type(ValueError("x"), MODEL_ERRORS) is None
    assert model_error_type(ValueError("x"), (ValueError,)) == "ValueError"
    # the real SDK's classes match by their names
    assert model_error_type(ModelBehaviorError("x"), MODEL_ERRORS) == "ModelBehaviorError"
    assert model_error_type(MaxTurnsExceeded("x"), MODEL_ERRORS) == "MaxTurnsExceeded"
    assert model_error_type(UserError("x"), MODEL_ERRORS) is None


def test_an_agent_sdk_model_error_is_a_failed_episode_trained_on(tokenizer: Any) -> None:
    traj, endpoint = play_agent(tokenizer, calls_an_unknown_tool, ReadingBackend(tokenizer, oracle))
    assert traj.error is None, traj.info.get("traceback")
    assert (traj.stop_reason, traj.terminated, traj.success, traj.reward) == (
        "answered", True, False, 0.0,
    )  # fmt: skip
    assert traj.info["model_error"] == {
        "type": "ModelBehaviorError",
        "message": "Tool ant not found in agent solver",
    }
    assert len(traj.turns) == 1
    assert len(traj.samples()) == 1  # the sampled turn is a training sample
    assert endpoint.open_episodes == 0


def test_your_own_model_errors_and_partial_credit(tokenizer: Any) -> None:
    """``model_errors`` adds to the defaults (a class or a qualified name);
    ``model_error_reward`` sees the exception and the transcript, and never makes it a
    success; the metrics count each type."""

    class WrongFormat(Exception):
        pass

    async def strict(task: Task, client: openai.AsyncOpenAI) -> str:
        reply = await client.chat.completions.create(model="p", messages=list(task.prompt))
        text = reply.choices[0].message.content or ""
        if task.id.endswith(("-0", "-1")):
            raise WrongFormat(f"not an answer: {text}")
        if task.id.endswith("-2"):
            raise framework_error("langgraph.errors.GraphRecursionError")("25 steps")
        if task.id.endswith("-3"):
            raise framework_error("my_agents.errors.Gave_up")("gave up")
        return text

    seen: list[tuple[str, str, int]] = []

    def partial(task: Task, error: BaseException, transcript: list[dict[str, Any]]) -> Verdict:
        seen.append((task.id, type(error).__name__, len(transcript)))  # the task, the reply
        return Verdict(0.25 if isinstance(error, WrongFormat) else 0.0, success=True)

    environment = AgentEnvironment(
        strict, PROBE.task, exact, model_errors=(WrongFormat, "my_agents.errors.Gave_up"),
        model_error_reward=partial,
    )  # fmt: skip
    groups = _collect(environment, tokenizer, lambda prompt: "a guess", num_tasks=5)
    trajs = [t for g in groups for t in g]
    assert [t.error for t in trajs] == [None] * 10
    assert [t.reward for t in trajs] == [0.25] * 4 + [0.0] * 6
    assert not any(t.success for t in trajs)  # a model error is never a success
    assert sorted(set(seen)) == [
        ("train-0", "WrongFormat", 2), ("train-1", "WrongFormat", 2),
        ("train-2", "GraphRecursionError", 2), ("train-3", "Gave_up", 2),
    ]  # fmt: skip
    metrics = rollout_metrics(groups)
    assert metrics["rollout/agent_model_errors"] == 8.0
    assert metrics["rollout/agent_model_errors/WrongFormat"] == 4.0
    assert metrics["rollout/agent_model_errors/GraphRecursionError"] == 2.0
    assert metrics["rollout/agent_model_errors/Gave_up"] == 2.0
    assert metrics["rollout/errors"] == 0.0
    with pytest.raises(TypeError, match="model_errors holds"):
        AgentEnvironment(strict, PROBE.task, exact, model_errors=(3,))  # type: ignore[arg-type]


def test_any_other_exception_stays_a_bug_and_a_frameworks_one_names_the_setting(
    tokenizer: Any,
) -> None:
    async def misconfigured(task: Task, client: openai.AsyncOpenAI) -> str:
        await client.chat.completions.create(model="p", messages=list(task.prompt))
        raise UserError("Handoff target not found")  # the SDK's error for the user's code

    traj, _ = play_agent(tokenizer, misconfigured, ReadingBackend(tokenizer, oracle))
    assert traj.stop_reason == "error"
    assert (traj.error or "").startswith("UserError: Handoff target not found (if ")
    assert "AgentEnvironment(model_errors=...)" in (traj.error or "")
    assert "agents.exceptions.UserError" in (traj.error or "")

    async def own_bug(task: Task, client: openai.AsyncOpenAI) -> str:
        await client.chat.completions.create(model="p", messages=list(task.prompt))
        raise KeyError("table")

    traj, _ = play_agent(tokenizer, own_bug, ReadingBackend(tokenizer, oracle))
    assert traj.error == "KeyError: 'table'"  # not a framework's: no advice


def test_model_errors_raised_in_a_worker_process_are_recognised(tokenizer: Any) -> None:
    with AgentProcesses(calls_an_unknown_tool, processes=1) as agent:
        traj, _ = play_agent(tokenizer, agent, ReadingBackend(tokenizer, oracle))
    assert traj.error is None, traj.info.get("traceback")
    assert traj.info["model_error"] == {
        "type": "ModelBehaviorError",
        "message": "agents.exceptions.ModelBehaviorError: Tool ant not found in agent solver",
    }
    assert traj.reward == 0.0


def test_a_run_of_an_agent_whose_model_errs_trains_on_without_stopping(tmp_path: Path) -> None:
    """The issue's case: an Agents SDK agent raising ``ModelBehaviorError`` for the model's
    bad replies stopped the run at the first evaluation; now it trains, counting them."""

    async def expects_a_call(task: Task, client: openai.AsyncOpenAI) -> str:
        reply = await client.chat.completions.create(
            model="p", messages=list(task.prompt), tools=[LOOKUP]
        )
        message = reply.choices[0].message
        if not message.tool_calls:
            raise ModelBehaviorError("the model answered without looking the key up")
        call = message.tool_calls[0]
        if call.function.name != "lookup":
            raise ModelBehaviorError(f"Tool {call.function.name} not found in agent solver")
        return str(call.function.arguments)

    probe = SecretLookup(num_keys=2, key_pool=2, num_values=12)
    result = turnrl.train(
        "grpo", agent=expects_a_call, tasks=probe.task, reward=exact, out=tmp_path / "run",
        overrides=SMALL_RUN, progress=False,
    )  # fmt: skip
    trained = [r for r in result.rows if "loss/policy" in r]
    assert [r["step"] for r in trained] == [1, 2]
    assert all(r["rollout/errors"] == 0 for r in trained)
    errors = sum(r["rollout/agent_model_errors"] for r in trained)
    assert errors > 0, trained
    assert errors == sum(r.get("rollout/agent_model_errors/ModelBehaviorError", 0) for r in trained)


# -- helpers ------------------------------------------------------------------------------


def _collect(
    environment: AgentEnvironment, tokenizer: Any, policy: Any, num_tasks: int
) -> list[list[Trajectory]]:
    spec = GroupSpec(
        group_size=2,
        limits=EpisodeLimits(max_turns=4, timeout_s=60),
        sampling=SamplingParams(stop_token_ids=stop_token_ids(tokenizer)),
        seed=0,
    )
    tasks = [environment.task(i) for i in range(num_tasks)]
    try:
        return asyncio.run(
            collect_groups(
                tasks, environment.make_env, ReadingBackend(tokenizer, policy),
                ChatRenderer(tokenizer), spec,
            )
        )  # fmt: skip
    finally:
        environment.close()


def test_train_takes_the_agent_s_own_model_errors_and_their_reward(tmp_path: Path) -> None:
    """``turnrl.train(agent=..., model_errors=..., model_error_reward=...)``: what
    ``AgentEnvironment`` takes, from the one call. Every episode here ends in the agent's
    own error once its model has replied (a turn cut at the token limit ends the episode
    first), so each is counted under its type and paid the partial credit."""

    class AnsweredBlind(Exception):
        pass

    async def never_satisfied(task: Task, client: openai.AsyncOpenAI) -> str:
        await client.chat.completions.create(model="p", messages=list(task.prompt))
        raise AnsweredBlind("no lookup")

    def partial(task: Task, error: BaseException, transcript: list[dict[str, Any]]) -> float:
        return 0.5 if isinstance(error, AnsweredBlind) else 0.0

    result = turnrl.train(
        "grpo", agent=never_satisfied, tasks=PROBE.task, reward=exact, out=tmp_path / "run",
        overrides=[*SMALL_RUN, "warmup.steps=100", "warmup.batch_size=16"], progress=False,
        model_errors=(AnsweredBlind,), model_error_reward=partial,
    )  # fmt: skip
    trained = [r for r in result.rows if "loss/policy" in r]
    assert [r["step"] for r in trained] == [1, 2]
    for row in trained:  # 2 prompts x 2: each episode errs, unless its one turn was cut
        answered = 4 * (1 - row["rollout/truncated_frac"])
        assert row["rollout/agent_model_errors/AnsweredBlind"] == answered
        assert row["rollout/reward_mean"] == 0.5 * answered / 4
        assert row["rollout/errors"] == 0
    assert sum(r["rollout/agent_model_errors"] for r in trained) > 0
    with pytest.raises(turnrl.ConfigError, match=r"model_errors= .* go with agent="):
        turnrl.train(env="secret_lookup", model_errors=(AnsweredBlind,))
