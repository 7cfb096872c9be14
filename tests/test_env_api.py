"""The environment API without ceremony: a string prompt is a task's one user message, a
``ToolEnv`` takes the run's call format (its model family's) unless given one, and a text
game subclasses ``TextEnv`` and writes only ``reset`` and ``step``."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import random
from pathlib import Path
from typing import Any

import pytest

import turnrl
from turnrl import Environment, StepResult, Task, TextEnv, ToolCall, ToolEnv
from turnrl.envs import GameEnv
from turnrl.envs.agent import AgentEnvironment
from turnrl.envs.custom import as_environment
from turnrl.formats import default_format, get_format, using_default_format
from turnrl.protocols import Env


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def verify(task: Task, answer: str) -> float:
    return float(answer.strip() == task.answer)


def make_task(index: int, split: str) -> Task:
    return Task(id=f"{split}-{index}", prompt="What is 3 times 4?", answer="12")


# --- Task ----------------------------------------------------------------------------


def test_a_string_prompt_is_one_user_message() -> None:
    task = Task(id="t", prompt="What is 3 times 4?", answer="12")
    assert task.prompt == ({"role": "user", "content": "What is 3 times 4?"},)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert Task(id="t", prompt=messages).prompt == tuple(messages)  # a list: kept, as a tuple
    assert Task("t", tuple(messages)).prompt == tuple(messages)
    assert Task("t", "x").metadata == {}


def test_the_normalised_prompt_is_what_equality_copies_and_pickles_see() -> None:
    task = Task(id="t", prompt="hello", answer=1, metadata={"k": 2})
    same = Task("t", ({"role": "user", "content": "hello"},), 1, {"k": 2})
    assert task == same
    assert pickle.loads(pickle.dumps(task)) == task
    assert dataclasses.replace(task, answer=3).prompt == task.prompt
    assert dataclasses.replace(task, prompt="bye").prompt == ({"role": "user", "content": "bye"},)
    assert dataclasses.asdict(task)["prompt"] == ({"role": "user", "content": "hello"},)
    with pytest.raises(dataclasses.FrozenInstanceError):
        task.prompt = ()  # type: ignore[misc]


@pytest.mark.parametrize("prompt", [42, {"role": "user", "content": "x"}, ["x"], None])
def test_a_prompt_that_is_neither_text_nor_messages_is_refused(prompt: Any) -> None:
    with pytest.raises(TypeError, match="string \\(one user message\\) or a sequence"):
        Task(id="t", prompt=prompt)


# --- ToolEnv's call format -----------------------------------------------------------


def test_a_tool_env_outside_a_run_writes_hermes_and_an_explicit_format_wins() -> None:
    assert ToolEnv([multiply], verify).format.name == "hermes"
    assert ToolEnv([multiply], verify, format="react").format.name == "react"
    llama = get_format("llama3_json")
    assert ToolEnv([multiply], verify, format=llama).format is llama
    with using_default_format("mistral"):
        assert ToolEnv([multiply], verify).format.name == "mistral"
        assert ToolEnv([multiply], verify, format="hermes").format.name == "hermes"
    assert default_format().name == "hermes"  # the block is over


def play(env: ToolEnv, turns: list[str]) -> list[StepResult]:
    async def go() -> list[StepResult]:
        await env.reset(make_task(0, "train"), 0)
        return [await env.step(t) for t in turns]

    return asyncio.run(go())


def test_two_families_write_and_parse_the_same_episode_differently() -> None:
    """The example's environment, unchanged, under a hermes and a llama3_json run."""
    family = Environment(make_task, lambda: ToolEnv([multiply], verify, max_tool_calls=2))
    call = ToolCall("multiply", {"a": 3, "b": 4})
    rendered = {}
    for name in ("hermes", "llama3_json"):
        env = family.with_format(name).make_env()
        assert isinstance(env, ToolEnv)
        assert env.format.name == name
        rendered[name] = env.format.render_call(call)
        tool_turn, answer = play(env, [rendered[name], "12"])
        assert tool_turn.info["tool_calls"][0].ok  # parsed and ran in its own format
        assert "12" in str(tool_turn.observation[0]["content"])
        assert answer.terminated
        assert answer.reward == 1.0
    assert rendered["hermes"] != rendered["llama3_json"]
    assert "<tool_call>" in rendered["hermes"]
    assert "<tool_call>" not in rendered["llama3_json"]
    # a llama3 episode does not read hermes' call as a call: it is the final (wrong) answer
    llama = family.with_format("llama3_json").make_env()
    assert isinstance(llama, ToolEnv)
    (step,) = play(llama, [rendered["hermes"]])
    assert "tool_calls" not in step.info
    assert step.reward == 0.0


def test_a_family_s_own_format_is_kept_and_an_unknown_name_fails_early() -> None:
    family = Environment(make_task, lambda: ToolEnv([multiply], verify), format="react")
    assert family.with_format("mistral") is family
    assert family.make_env().format.name == "react"  # type: ignore[attr-defined]
    assert Environment(make_task, lambda: ToolEnv([multiply], verify)).make_env().format.name == (
        "hermes"  # type: ignore[attr-defined]
    )
    with pytest.raises(turnrl.ConfigError, match="unknown tool-call format 'nope'"):
        Environment(make_task, lambda: ToolEnv([multiply], verify), format="nope")


class Family:
    """A family of the user's, without demonstration or corpus: turnrl completes it."""

    name = "mine"

    def task(self, index: int, split: str = "train") -> Task:
        return make_task(index, split)

    def make_env(self) -> ToolEnv:
        return ToolEnv([multiply], verify)


def test_a_completed_family_and_a_game_env_take_the_format_too() -> None:
    completed = as_environment(Family(), format="llama3_json")
    assert completed.make_env().format.name == "llama3_json"
    assert completed.name == "mine"
    turns = asyncio.run(completed.demonstration(make_task(0, "train"), random.Random(0)))
    assert get_format("llama3_json").parse(turns[0]).tool_calls  # the warm-up writes it too
    games = Environment(make_task, lambda: GameEnv(lambda t, s: None, max_moves=1, max_turns=1))  # type: ignore[arg-type,return-value]
    assert games.with_format("mistral").make_env().format.name == "mistral"  # type: ignore[attr-defined]


def test_an_agent_environment_without_a_format_takes_the_run_s() -> None:
    def agent(task: Any, client: Any) -> str:
        return "x"

    environment = AgentEnvironment(agent, ["a task"], lambda task, answer, transcript: 0.0)
    try:
        assert environment.format is None
        assert environment.make_env().format.name == "hermes"  # type: ignore[attr-defined]
        mistral = environment.with_format("mistral")
        assert mistral.make_env().format.name == "mistral"  # type: ignore[attr-defined]
        assert mistral.endpoint is environment.endpoint  # the same endpoint and pool
        named = AgentEnvironment(agent, ["a"], lambda t, a, tr: 0.0, format="llama3_json")
        assert named.with_format("mistral") is named
        named.close()
    finally:
        environment.close()


@pytest.mark.parametrize(
    ("arch", "expected"),
    [("qwen2", "hermes"), ("qwen3", "hermes"), ("llama3", "llama3_json"), ("mistral", "mistral")],
)
def test_train_hands_the_model_family_s_format_to_the_environment(
    arch: str, expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}

    def loop(config: Any, run_dir: Any, **kwargs: Any) -> Any:
        seen["env"] = kwargs["env"]

    monkeypatch.setattr("turnrl.api._train_loop", loop)
    family = Environment(make_task, lambda: ToolEnv([multiply], verify))
    turnrl.train("grpo", env=family, out=tmp_path, overrides=[f"model.tiny.arch={arch}"])
    assert seen["env"].make_env().format.name == expected
    turnrl.train("grpo", env=Family(), out=tmp_path, overrides=[f"model.tiny.arch={arch}"])
    assert seen["env"].make_env().format.name == expected
    name = "tests.test_env_api:Family"
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1]))
    turnrl.train("grpo", out=tmp_path, overrides=[f"model.tiny.arch={arch}", f"env.name={name}"])
    assert seen["env"].make_env().format.name == expected  # a family named in the config
    path = "model.path=/no/such/checkpoint"  # a checkpoint: hermes, whatever model.tiny.arch says
    turnrl.train("grpo", env=family, out=tmp_path, overrides=[f"model.tiny.arch={arch}", path])
    assert seen["env"].make_env().format.name == "hermes"


def test_the_old_positional_format_is_a_type_error_that_says_so() -> None:
    hermes = get_format("hermes")
    with pytest.raises(TypeError, match="positional argument"):
        ToolEnv([multiply], hermes, verify)  # type: ignore[misc]
    with pytest.raises(TypeError, match="the second argument is the verifier; the call format"):
        ToolEnv([multiply], hermes)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="format must be a turnrl Format"):
        ToolEnv([multiply], verify, format=3)  # type: ignore[arg-type]


# --- TextEnv -------------------------------------------------------------------------


class Echo(TextEnv):
    async def reset(self, task: Task, seed: int) -> list[dict[str, Any]]:
        return list(task.prompt)

    async def step(self, action: str) -> StepResult:
        return StepResult(reward=float(action == "12"), terminated=True)


def test_a_text_env_writes_reset_and_step_and_gets_the_rest() -> None:
    env = Echo()
    assert isinstance(env, Env)
    assert env.tool_schemas() == []
    assert env.stop_strings() == ()
    assert asyncio.run(env.reset(make_task(0, "train"), 0))[0]["role"] == "user"
    assert asyncio.run(env.step("12")).reward == 1.0

    class NoStep(TextEnv):
        async def reset(self, task: Task, seed: int) -> list[dict[str, Any]]:
            return []

    with pytest.raises(TypeError, match="abstract"):
        NoStep()  # type: ignore[abstract]
