"""``assistant_text``: a turn whose calls a server parsed into ``message.tool_calls`` reads
back, in every format, as the calls it held; reasoning and content keep their place; a
malformed call becomes an error the environment shows, never a crash. And ``turnrl eval
--endpoint`` steps the environment with those calls (a scripted server)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from test_formats import calls, json_values, names  # the hermes tests' strategies
from turnrl.envs import SecretLookup
from turnrl.evaluation import EvalConfig, evaluate, runner
from turnrl.formats import FORMATS, get_format
from turnrl.formats.openai_message import assistant_text
from turnrl.protocols import Format
from turnrl.types import ToolCall

ENV = {"num_keys": 2, "key_pool": 2}
MULTI_CALL = ("hermes", "llama3_json", "mistral", "search_r1")
"""Formats that hold several calls in one turn."""


def openai_message(found: Sequence[ToolCall], content: str | None = None) -> dict[str, Any]:
    """An assistant message as a tool-parsing server returns it (arguments as JSON text)."""
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(dict(c.arguments))},
            }
            for i, c in enumerate(found)
        ],
    }


def server_side(fmt: Format, text: str) -> dict[str, Any]:
    """What a server makes of the model's ``text``: its calls parsed into ``tool_calls``."""
    parsed = fmt.parse(text)
    assert parsed.tool_calls, (text, parsed)
    assert not parsed.errors
    return openai_message(parsed.tool_calls)


def a_call(name: str) -> st.SearchStrategy[ToolCall]:
    """Calls ``name``'s format can write and read: any for the JSON formats and react (a
    one-word name); the single tool for code (some code) and search_r1 (a query without
    tags or surrounding whitespace)."""
    if name == "code":
        code = st.text().filter(str.strip)  # an empty block is an error
        return st.builds(lambda c: ToolCall("python", {"code": c}), code)
    if name == "search_r1":
        query = st.text().filter(lambda q: "<" not in q and q.strip() == q and q != "")
        return st.builds(lambda q: ToolCall("search", {"query": q}), query)
    if name == "react":
        return st.builds(ToolCall, names, st.dictionaries(st.text(max_size=8), json_values))
    return calls


@pytest.mark.parametrize("name", list(FORMATS))
@given(data=st.data())
def test_a_call_parsed_by_the_server_reads_back_as_the_same_call(name: str, data: Any) -> None:
    fmt = get_format(name)
    call = data.draw(a_call(name))
    rebuilt = assistant_text(server_side(fmt, fmt.render_call(call)), fmt)
    assert fmt.parse(rebuilt).tool_calls == (call,)


@pytest.mark.parametrize("name", MULTI_CALL)
@given(data=st.data())
def test_several_calls_read_back_in_order(name: str, data: Any) -> None:
    fmt = get_format(name)
    batch = data.draw(st.lists(a_call(name), min_size=1, max_size=4))
    rebuilt = assistant_text(openai_message(batch), fmt)
    assert fmt.parse(rebuilt).tool_calls == tuple(batch)


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("hermes", "Let me look.",
         'Let me look.\n<tool_call>\n{"name": "lookup", "arguments": {"key": "alpha"}}\n</tool_call>'),
        ("llama3_json", None, '{"name": "lookup", "parameters": {"key": "alpha"}}'),
        ("mistral", "", '[TOOL_CALLS][{"name": "lookup", "arguments": {"key": "alpha"}}]'),
        ("react", "Thought: I need the value.",
         'Thought: I need the value.\nAction: lookup\nAction Input: {"key": "alpha"}'),
    ],
)  # fmt: skip
def test_content_comes_first_then_each_call_on_its_own_line(
    name: str, content: str | None, expected: str
) -> None:
    fmt = get_format(name)
    message = openai_message([ToolCall("lookup", {"key": "alpha"})], content)
    assert assistant_text(message, fmt) == expected
    assert fmt.parse(expected).tool_calls == (ToolCall("lookup", {"key": "alpha"}),)


def test_a_message_without_calls_is_its_content() -> None:
    hermes = get_format("hermes")
    assert assistant_text({"role": "assistant", "content": "cat"}, hermes) == "cat"
    assert assistant_text({"role": "assistant", "content": None, "tool_calls": []}, hermes) == ""
    parts = {"content": [{"type": "text", "text": "c"}, {"type": "text", "text": "at"}]}
    assert assistant_text(parts, hermes) == "cat"


@pytest.mark.parametrize("key", ["reasoning", "reasoning_content"])
def test_reasoning_comes_first_in_a_think_block(key: str) -> None:
    hermes = get_format("hermes")
    message = {
        key: "\nThe key is alpha.\n",
        **openai_message([ToolCall("lookup", {"key": "alpha"})]),
    }
    text = assistant_text(message, hermes)
    assert text == (
        "<think>\nThe key is alpha.\n</think>\n\n"
        '<tool_call>\n{"name": "lookup", "arguments": {"key": "alpha"}}\n</tool_call>'
    )
    assert hermes.parse(text).tool_calls == (ToolCall("lookup", {"key": "alpha"}),)
    search_r1 = get_format("search_r1")
    answer = assistant_text({key: "It is cat.", "content": "<answer>cat</answer>"}, search_r1)
    assert answer == "<think>\nIt is cat.\n</think>\n\n<answer>cat</answer>"
    assert search_r1.parse(answer).answer == "cat"


def malformed(name: str, arguments: Any) -> dict[str, Any]:
    return {"content": None, "tool_calls": [{"function": {"name": name, "arguments": arguments}}]}


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("arguments", ['{"key": "alp', "[1, 2]", "null", '{"a": 1} x', "{{"])
def test_malformed_arguments_are_an_error_for_the_model_not_a_crash(
    name: str, arguments: str
) -> None:
    fmt = get_format(name)
    tool = {"code": "python", "search_r1": "search"}.get(name, "lookup")
    text = assistant_text(malformed(tool, arguments), fmt)
    assert arguments in text  # the model's text, kept
    parsed = fmt.parse(text)
    assert parsed.errors
    assert not parsed.tool_calls
    assert parsed.answer is None


def test_the_hermes_error_names_the_bad_json() -> None:
    hermes = get_format("hermes")
    text = assistant_text(malformed("lookup", '{"key": "alp'), hermes)
    assert text == '<tool_call>\n{"name": "lookup", "arguments": {"key": "alp}\n</tool_call>'
    assert hermes.parse(text).errors[0].startswith("tool call 1: invalid JSON")


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [("", {}), (None, {}), ({"key": "alpha"}, {"key": "alpha"}), ('{"n": 1.5}', {"n": 1.5})],
)
def test_empty_and_object_arguments(arguments: Any, expected: dict[str, Any]) -> None:
    hermes = get_format("hermes")
    text = assistant_text(malformed("lookup", arguments), hermes)
    assert hermes.parse(text).tool_calls == (ToolCall("lookup", expected),)


@pytest.mark.parametrize(
    ("name", "call"),
    [("code", ToolCall("search", {"query": "x"})), ("search_r1", ToolCall("python", {})),
     ("react", ToolCall("two words", {}))],
)  # fmt: skip
def test_a_call_the_format_cannot_write_is_an_error_too(name: str, call: ToolCall) -> None:
    fmt = get_format(name)
    text = assistant_text(openai_message([call]), fmt)
    assert json.loads(text) == {"name": call.name, "arguments": dict(call.arguments)}
    assert fmt.parse(text).errors


def optional(**fields: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({}, optional=fields)


functions = optional(name=json_values, arguments=json_values | st.text())
odd_messages = optional(
    content=json_values | st.lists(optional(type=json_values, text=json_values)),
    reasoning=json_values,
    tool_calls=json_values | st.lists(json_values | optional(function=json_values | functions)),
)


@given(odd_messages)
def test_odd_messages_never_raise(message: dict[str, Any]) -> None:
    assert isinstance(assistant_text(message, get_format("hermes")), str)


def test_eval_through_an_endpoint_steps_the_env_with_the_calls_in_its_format(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``turnrl eval --endpoint`` against a server that parses calls (a scripted one here;
    vLLM's own in tests/test_eval_vllm_server.py): the oracle's calls reach the env."""
    bodies: list[dict[str, Any]] = []

    def server(method: str, url: str, body: Any, timeout: float) -> Any:
        if method == "GET":
            return {"data": [{"id": "scripted"}]}
        bodies.append(body)
        messages = body["messages"]
        if messages[-1]["role"] == "user":  # look the asked key up, as a parsed call
            key = messages[-1]["content"].removeprefix("What is the value of ").rstrip("?")
            message = openai_message([ToolCall("lookup", {"key": key})])
            return {"choices": [{"message": message, "finish_reason": "tool_calls"}]}
        answer = {"role": "assistant", "content": messages[-1]["content"]}
        return {"choices": [{"message": answer, "finish_reason": "stop"}]}

    monkeypatch.setattr(runner, "_http", server)
    config = EvalConfig("secret_lookup", ENV, n=4, concurrency=1)
    summary = evaluate(config, tmp_path, endpoint="http://scripted/v1", progress=False)
    assert (summary["success"], summary["tool_calls_mean"], summary["errors"]) == (1.0, 1.0, 0)
    episode = json.loads((tmp_path / "episodes.jsonl").read_text().splitlines()[0])
    assert episode["task_id"] == "test-0"
    call = get_format("hermes").parse(episode["messages"][1]["content"]).tool_calls
    assert call == (
        ToolCall("lookup", {"key": SecretLookup(**ENV).task(0, "test").metadata["key"]}),
    )
    assert bodies[1]["messages"][1] == episode["messages"][1]  # what the server sees next
    # hermes has no stop strings: nothing asks the server to keep its end-of-turn token
    assert all("include_stop_str_in_output" not in b for b in bodies)


def test_a_turn_cut_off_at_the_token_limit_ends_the_episode(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """As in a local episode: stop reason max_tokens_per_turn, the cut text not stepped."""

    def server(method: str, url: str, body: Any, timeout: float) -> Any:
        if method == "GET":
            return {"data": [{"id": "scripted"}]}
        message = {"role": "assistant", "content": '<tool_call>\n{"name": "look'}
        return {"choices": [{"message": message, "finish_reason": "length"}]}

    monkeypatch.setattr(runner, "_http", server)
    config = EvalConfig("secret_lookup", ENV, n=2)
    summary = evaluate(config, tmp_path, endpoint="http://scripted/v1", progress=False)
    assert summary["stop_reasons"] == {"max_tokens_per_turn": 2}
    assert (summary["turns_mean"], summary["tool_calls_mean"], summary["errors"]) == (1, 0, 0)
