"""The tool shapes ``ToolEnv`` accepts (a ToolSet, a list of typed functions / Tools /
OpenAI ``(schema, fn)`` pairs, a per-task factory of either) played through real episodes
(scripted model, real tokenizer and template), and the TypeErrors for everything else."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from test_tool_env import play_episode
from turnrl.envs.tool_env import ToolEnv, toolset_from
from turnrl.errors import ToolDefinitionError
from turnrl.formats import get_format
from turnrl.rewards import Verdict, exact_match
from turnrl.rollout.episode import EpisodeLimits
from turnrl.tools import Tool, ToolSet, tool
from turnrl.types import Task, ToolCall, Trajectory

HERMES = get_format("hermes")
TASK = Task(id="t", prompt=({"role": "user", "content": "What is 2 + 3?"},), answer="5")
LIMITS = EpisodeLimits(max_turns=4, max_tokens_per_turn=256, max_episode_tokens=1024,
                       max_context_tokens=4096)  # fmt: skip


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def shout(text: str) -> str:
    """Upper-case the text."""
    return text.upper()


@tool(timeout_s=2.0)
def negate(x: int) -> int:
    """Negate a number."""
    return -x


MULTIPLY_SCHEMA = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two numbers.",
        "parameters": {
            "type": "object",
            "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
            "required": ["x", "y"],
        },
    },
}


def multiply_impl(x: float, y: float) -> float:  # untyped docstring: the schema describes it
    return x * y


def call(name: str, **arguments: Any) -> str:
    return HERMES.render_call(ToolCall(name, arguments))


def verifier(task: Task, answer: str) -> Verdict:
    return exact_match(answer, str(task.answer))


def play(tokenizer: Any, env: ToolEnv, texts: list[str]) -> Trajectory:
    return play_episode(tokenizer, env, texts, TASK, LIMITS)


def tool_outputs(traj: Trajectory) -> list[str]:
    return [str(m["content"]) for m in traj.messages if m["role"] == "tool"]


def test_a_plain_list_of_functions_runs_episodes(tokenizer: Any) -> None:
    env = ToolEnv([add], verifier, format=HERMES)  # this used to construct, then fail every episode
    traj = play(tokenizer, env, [call("add", a=2, b=3), "5"])
    assert traj.error is None
    assert tool_outputs(traj) == ["5"]
    assert [(r.name, r.ok) for r in traj.tool_calls] == [("add", True)]
    assert traj.success
    assert traj.reward == 1.0
    (schema,) = env.tool_schemas()  # the schema comes from the signature and docstring
    assert schema["function"]["name"] == "add"
    assert schema["function"]["description"] == "Add two integers."
    assert schema["function"]["parameters"]["properties"]["a"] == {
        "type": "integer", "description": "The first.",
    }  # fmt: skip


def test_functions_tools_and_openai_pairs_mix_in_one_list(tokenizer: Any) -> None:
    env = ToolEnv((add, negate, (MULTIPLY_SCHEMA, multiply_impl)), verifier, format=HERMES)
    texts = [call("add", a=2, b=3), call("negate", x=4), call("multiply", x=2.5, y=2), "5"]
    traj = play(tokenizer, env, texts)
    assert tool_outputs(traj) == ["5", "-4", "5.0"]
    assert all(r.ok for r in traj.tool_calls)
    assert traj.success
    schemas = {s["function"]["name"]: s for s in env.tool_schemas()}
    assert schemas["multiply"] == MULTIPLY_SCHEMA  # an OpenAI schema is kept as given
    assert env.tools.get("negate") is negate  # a Tool keeps its own limits
    assert negate.timeout_s == 2.0


def test_an_openai_schema_checks_the_arguments_the_model_sends(tokenizer: Any) -> None:
    env = ToolEnv([(MULTIPLY_SCHEMA, multiply_impl)], verifier, format=HERMES)
    traj = play(tokenizer, env, [call("multiply", x="two", y=2), "5"])
    (record,) = traj.tool_calls
    assert not record.ok
    assert record.error == "multiply: argument 'x' must be a number, got string \"two\""
    assert tool_outputs(traj) == [f"Error: {record.error}"]


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_factory_may_return_a_list(tokenizer: Any, kind: str) -> None:
    seen: list[str] = []

    def per_task(task: Task) -> list[Any]:
        seen.append(task.id)
        return [add, (MULTIPLY_SCHEMA, multiply_impl)]

    async def per_task_async(task: Task) -> list[Any]:
        return per_task(task)

    env = ToolEnv(per_task if kind == "sync" else per_task_async, verifier, format=HERMES)
    traj = play(tokenizer, env, [call("add", a=1, b=4), "5"])
    assert tool_outputs(traj) == ["5"]
    assert traj.success
    assert seen == ["t"]


def test_a_toolset_and_an_untyped_lambda_factory_still_work(tokenizer: Any) -> None:
    for tools in (ToolSet([add]), lambda task: ToolSet([add])):
        traj = play(
            tokenizer, ToolEnv(tools, verifier, format=HERMES), [call("add", a=2, b=3), "5"]
        )
        assert tool_outputs(traj) == ["5"]
        assert traj.success


def test_a_factory_returning_something_else_fails_the_episode_not_the_batch(
    tokenizer: Any,
) -> None:
    env = ToolEnv(lambda task: {"add": add}, verifier, format=HERMES)
    traj = play(tokenizer, env, ["5"])
    assert traj.stop_reason == "error"
    assert traj.error is not None
    assert traj.error.startswith("TypeError: tools must be a ToolSet; a list of typed functions")


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        (None, "tools must be a ToolSet; a list of typed functions, Tools or OpenAI "
               "(schema, fn) pairs; or a function of the task returning one of those; got NoneType"),
        ("add", "tools must be a ToolSet;"),
        ({"add": add}, "tools must be a ToolSet;"),
        (add, "tools: add is neither a list nor a factory taking the task (one argument); "
              "for a single tool pass a list: [add]"),
        (shout, "tools: shout looks like a tool (its argument is typed for the model), not a "
                "factory of the task; pass a list: [shout]"),
        (negate, "tools: got a single Tool 'negate'; pass a list: [negate]"),
        ((MULTIPLY_SCHEMA, multiply_impl), "tools: got one (schema, fn) pair; pass a list"),
        ([MULTIPLY_SCHEMA], "tools[0]: an OpenAI schema needs its implementation: pass (schema, fn)"),
        ([add, 3], "tools[1]: expected a typed function, a Tool or an OpenAI (schema, fn) "
                   "pair; got int"),
        ([ToolSet([add])], "tools[0]: expected a typed function"),
    ],
)  # fmt: skip
def test_anything_else_is_a_type_error_at_construction(tools: Any, message: str) -> None:
    with pytest.raises(TypeError) as caught:
        ToolEnv(tools, verifier, format=HERMES)
    assert str(caught.value).startswith(message)


def untyped(a, b):  # type: ignore[no-untyped-def]
    """No annotations."""
    return a


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (untyped, "untyped: parameter 'a' has no type annotation"),
        (({"name": "multiply", "parameters": {}}, multiply_impl),
         "tools[0]: an OpenAI tool schema is {\"type\": \"function\", \"function\": "),
        (({"type": "function", "function": {"description": "no name"}}, multiply_impl),
         "tools[0]: the schema's \"function\" has no \"name\""),
        (({"type": "function", "function": {"name": "m", "parameters": {"type": "array"}}},
          multiply_impl), "tools[0] m: parameters must be a JSON schema object"),
        (({"type": "function", "function": {"name": "m", "parameters": {
            "type": "object", "properties": {"x": {}, "y": {}, "z": {}}}}}, multiply_impl),
         "tools[0] m: the function takes no argument(s) ['z']"),
        (({"type": "function", "function": {"name": "m", "parameters": {
            "type": "object", "properties": {"x": {}}}}}, multiply_impl),
         "tools[0] m: the schema lacks required argument(s) ['y']"),
        (({"type": "function", "function": {"name": "bad name"}}, lambda: "ok"),
         "tool name 'bad name' must match"),
    ],
)  # fmt: skip
def test_a_bad_entry_says_what_is_wrong(entry: Any, message: str) -> None:
    with pytest.raises(ToolDefinitionError) as caught:
        ToolEnv([entry], verifier, format=HERMES)
    assert str(caught.value).startswith(message)
    assert isinstance(caught.value, TypeError)


def test_an_openai_schema_may_describe_a_function_taking_kwargs() -> None:
    def anything(**kwargs: Any) -> str:
        return repr(sorted(kwargs))

    tools = toolset_from([(MULTIPLY_SCHEMA, anything)])
    result, record = asyncio.run(tools.run(ToolCall("multiply", {"x": 1, "y": 2})))
    assert result.content == "['x', 'y']"
    assert record.ok
    assert isinstance(tools.get("multiply"), Tool)


@pytest.mark.parametrize(
    ("score", "success"), [(1.0, True), (0.5, False), (True, True), (0, False)]
)
def test_a_verifier_may_return_a_plain_number(tokenizer: Any, score: float, success: bool) -> None:
    env = ToolEnv([add], lambda task, answer: score, format=HERMES)
    traj = play(tokenizer, env, ["5"])
    assert traj.error is None
    assert traj.reward == float(score)
    assert traj.success is success


def test_a_verifier_returning_something_else_is_a_clear_error(tokenizer: Any) -> None:
    env = ToolEnv([add], lambda task, answer: "yes", format=HERMES)  # type: ignore[arg-type,return-value]
    traj = play(tokenizer, env, ["5"])
    assert traj.error is not None
    assert "the verifier returned str; return a turnrl.Verdict or a number" in traj.error
