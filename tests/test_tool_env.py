"""ToolEnv's budgets, concurrent calls within a turn, the close hook and the isolation
flag on call records, through real episodes (scripted model, real tokenizer/template)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from turnrl.backends.scripted import ScriptedBackend
from turnrl.envs.tool_env import ToolEnv
from turnrl.formats import get_format
from turnrl.models.loading import stop_token_ids
from turnrl.rewards import exact_match
from turnrl.rollout.chat import ChatRenderer
from turnrl.rollout.episode import EpisodeLimits, SamplingParams, run_episode
from turnrl.tools import Tool, ToolSet
from turnrl.types import Completion, GenerationRequest, Task, ToolCall, Trajectory

HERMES = get_format("hermes")
TASK = Task(id="t", prompt=({"role": "user", "content": "Ping twice, then say done."},),
            answer="done")  # fmt: skip


def calls(*names: str) -> str:
    return "\n".join(HERMES.render_call(ToolCall(n, {})) for n in names)


def play(tokenizer: Any, env: ToolEnv, texts: list[str]) -> Trajectory:
    return play_episode(tokenizer, env, texts, TASK, EpisodeLimits(max_turns=4))


def play_episode(
    tokenizer: Any, env: ToolEnv, texts: list[str], task: Task, limits: EpisodeLimits
) -> Trajectory:
    """One episode of ``task`` in ``env`` with the model's turns scripted as ``texts``."""
    stops = stop_token_ids(tokenizer)
    backend = ScriptedBackend(tokenizer, texts, end_token_id=stops[0])

    async def generate(request: GenerationRequest) -> Completion:
        return (await backend.generate([request]))[0]

    return asyncio.run(
        run_episode(
            env, task, generate, ChatRenderer(tokenizer, env.tool_schemas()),
            limits=limits, sampling=SamplingParams(stop_token_ids=stops), seed=0,
        )
    )  # fmt: skip


def verifier(task: Task, answer: str) -> Any:
    return exact_match(answer, str(task.answer))


def test_calls_of_one_turn_run_concurrently(tokenizer: Any) -> None:
    # "first" can only finish once "second" has started: run one after the other, it would
    # wait out its timeout instead.
    started = asyncio.Event()

    async def first() -> str:
        """Wait for the second call."""
        await asyncio.wait_for(started.wait(), timeout=5)
        return "first done"

    async def second() -> str:
        """Signal the first call."""
        started.set()
        return "second done"

    env = ToolEnv(ToolSet([first, second]), verifier, format=HERMES)
    traj = play(tokenizer, env, [calls("first", "second"), "done"])
    assert [r.ok for r in traj.tool_calls] == [True, True]
    assert [r.name for r in traj.tool_calls] == ["first", "second"]  # in the order made
    tool_messages = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert tool_messages == ["first done", "second done"]
    assert traj.success


def test_a_per_turn_budget_refuses_the_extra_calls(tokenizer: Any) -> None:
    ran: list[str] = []

    def ping() -> str:
        """Ping."""
        ran.append("ping")
        return "pong"

    env = ToolEnv(ToolSet([ping]), verifier, format=HERMES, max_calls_per_turn=2, max_tool_calls=3)
    traj = play(tokenizer, env, [calls("ping", "ping", "ping"), calls("ping", "ping"), "done"])
    assert len(ran) == 3  # 2 in turn one (the third refused), 1 in turn two (episode budget)
    assert [r.error for r in traj.tool_calls] == [None, None, "budget", None, "budget"]
    refusals = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert "at most 2" in refusals[2]
    assert "3 calls per episode" in refusals[4]


def test_the_env_is_closed_once_however_the_episode_ends(tokenizer: Any) -> None:
    closed: list[str] = []

    async def release() -> None:
        closed.append("released")

    def ping() -> str:
        """Ping."""
        return "pong"

    env = ToolEnv(lambda _t: ToolSet([ping], on_close=[release]), verifier, format=HERMES)
    traj = play(tokenizer, env, [calls("ping"), "done"])
    assert traj.success
    assert closed == ["released"]
    asyncio.run(env.close())  # a second close does nothing
    assert closed == ["released"]

    async def broken() -> None:
        raise OSError("sandbox already gone")

    failing = ToolEnv(
        lambda _t: ToolSet([ping], on_close=[broken, release]), verifier, format=HERMES
    )
    traj = play(tokenizer, failing, ["done"])
    assert traj.success  # the episode's data stands
    assert traj.info["close_error"] == "OSError: sandbox already gone"
    assert closed == ["released", "released"]  # the other callback still ran


def test_call_records_say_whether_the_tool_isolates(tokenizer: Any) -> None:
    def plain() -> str:
        """No untrusted code."""
        return "ok"

    sandboxed = Tool.from_function(lambda: "ran", name="run_code", isolated=True,
                                   description="Run code.")  # fmt: skip
    env = ToolEnv(ToolSet([plain, sandboxed]), verifier, format=HERMES)
    traj = play(tokenizer, env, [calls("plain", "run_code", "nope"), "done"])
    assert [r.isolated for r in traj.tool_calls] == [None, True, None]


@pytest.mark.parametrize("budget", [0, 1])
def test_budgets_are_checked_in_order(tokenizer: Any, budget: int) -> None:
    def ping() -> str:
        """Ping."""
        return "pong"

    env = ToolEnv(ToolSet([ping]), verifier, format=HERMES, max_calls_per_turn=budget)
    traj = play(tokenizer, env, [calls("ping", "ping"), "done"])
    assert [r.ok for r in traj.tool_calls] == [True] * budget + [False] * (2 - budget)


def test_an_async_verifier_is_awaited() -> None:
    """A verifier that has work to do (run a test suite) may be a coroutine."""
    seen: list[str] = []

    async def verify(task: Task, answer: str) -> Any:
        await asyncio.sleep(0)
        seen.append(answer)
        return exact_match(answer, "42")

    env = ToolEnv(ToolSet([]), verify, format=get_format("hermes"))
    task = Task(id="t", prompt=({"role": "user", "content": "?"},), answer="42")

    async def episode() -> Any:
        await env.reset(task, 0)
        return await env.step("42")

    result = asyncio.run(episode())
    assert seen == ["42"]
    assert result.terminated
    assert result.reward == 1.0
    assert result.info["success"] is True
