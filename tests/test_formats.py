"""Formats: the hermes/Qwen format round-trips calls, reports precise errors, never raises."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnrl.errors import ConfigError
from turnrl.formats import HermesFormat, error_observation, get_format
from turnrl.protocols import Format, ParsedAction
from turnrl.types import ToolCall

FMT = HermesFormat()

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
names = st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-", min_size=1)
calls = st.builds(ToolCall, names, st.dictionaries(st.text(max_size=8), json_values, max_size=4))


def test_satisfies_protocol_and_registry() -> None:
    assert isinstance(FMT, Format)
    assert isinstance(get_format("hermes"), HermesFormat)
    with pytest.raises(ConfigError, match="unknown tool-call format 'xml'; known formats: hermes"):
        get_format("xml")


def test_render_call() -> None:
    call = ToolCall("search", {"q": "café", "n": 2})
    assert FMT.render_call(call) == (
        '<tool_call>\n{"name": "search", "arguments": {"q": "café", "n": 2}}\n</tool_call>'
    )


@given(calls)
def test_render_then_parse_round_trips(call: ToolCall) -> None:
    assert FMT.parse(FMT.render_call(call)) == ParsedAction(tool_calls=(call,))


@given(st.lists(calls, min_size=1, max_size=4), st.text(max_size=20))
def test_several_calls_in_one_turn_with_text_around(batch: list[ToolCall], thought: str) -> None:
    text = thought.replace("tool_call>", "") + "\n".join(FMT.render_call(c) for c in batch)
    assert FMT.parse(text) == ParsedAction(tool_calls=tuple(batch))


def test_closing_tag_inside_a_json_string_is_data() -> None:
    call = ToolCall("echo", {"text": "</tool_call> <tool_call>"})
    assert FMT.parse(FMT.render_call(call)).tool_calls == (call,)


@pytest.mark.parametrize(
    ("text", "answer"),
    [("  The answer is 4.\n", "The answer is 4."), ("", ""), ("\n \n", "")],
)
def test_no_tags_is_a_final_answer(text: str, answer: str) -> None:
    assert FMT.parse(text) == ParsedAction(answer=answer)


def test_missing_arguments_means_empty() -> None:
    assert FMT.parse('<tool_call>{"name": "now"}</tool_call>').tool_calls == (ToolCall("now", {}),)


GOOD = '<tool_call>{"name": "a", "arguments": {}}</tool_call>'


@pytest.mark.parametrize(
    ("text", "errors"),
    [
        (
            '<tool_call>{"name": "a" "arguments": {}}</tool_call>',
            ["tool call 1: invalid JSON (Expecting ',' delimiter at char 13)"],
        ),
        (
            '<tool_call>\n{"name": "a", "arguments": {}} extra\n</tool_call>',
            ["tool call 1: invalid JSON (Extra data at char 31)"],
        ),
        ("<tool_call>\n\n</tool_call>", ["tool call 1: invalid JSON (Expecting value at char 0)"]),
        (
            GOOD + '<tool_call>{"name": "b", "arguments": [1]}</tool_call>',
            ['tool call 2: "arguments" must be an object'],
        ),
        (
            '<tool_call>{"arguments": {}}</tool_call>',
            ['tool call 1: "name" must be a non-empty string'],
        ),
        ('<tool_call>{"name": 3}</tool_call>', ['tool call 1: "name" must be a non-empty string']),
        ("<tool_call>[1, 2]</tool_call>", ["tool call 1: expected a JSON object, got array"]),
        ('<tool_call>"x"</tool_call>', ["tool call 1: expected a JSON object, got string"]),
        (GOOD + '<tool_call>{"name": "b"}', ["unclosed <tool_call> tag"]),
        ('<tool_call>{"name": "a"', ["unclosed <tool_call> tag"]),
        ("<tool_call>{\n" + GOOD, ["unclosed <tool_call> tag"]),
        ("done</tool_call>", ["</tool_call> without an opening <tool_call>"]),
        (
            GOOD + "</tool_call><tool_call>{}</tool_call>",
            [
                "</tool_call> without an opening <tool_call>",
                'tool call 2: "name" must be a non-empty string',
            ],
        ),
        ("<tool_call>" + "[" * 100_000 + "</tool_call>", None),
    ],
)
def test_malformed_turns_give_precise_errors_and_no_calls(
    text: str, errors: list[str] | None
) -> None:
    parsed = FMT.parse(text)
    assert parsed.tool_calls == ()
    assert parsed.answer is None
    if errors is None:
        assert len(parsed.errors) == 1
        assert parsed.errors[0].startswith("tool call 1: invalid JSON")
    else:
        assert list(parsed.errors) == errors


fragments = st.sampled_from(
    [
        "<tool_call>",
        "</tool_call>",
        "{",
        "}",
        "[",
        '"name"',
        '"arguments"',
        ":",
        ",",
        '"',
        "\\",
        " ",
        "\n",
        "1",
        "null",
        '"a"',
        "<tool",
        "_call>",
    ]
)


@given(st.text() | st.lists(fragments | st.text(max_size=3)).map("".join))
def test_parse_never_raises(text: str) -> None:
    parsed = FMT.parse(text)
    # Exactly one of the three outcomes.
    assert sum([bool(parsed.tool_calls), parsed.answer is not None, bool(parsed.errors)]) == 1


def test_system_prompt_lists_one_schema_per_line() -> None:
    schemas: list[dict[str, Any]] = [
        {"type": "function", "function": {"name": "a", "description": "", "parameters": {}}},
        {"type": "function", "function": {"name": "b", "description": "é", "parameters": {}}},
    ]
    prompt = FMT.system_prompt(schemas)
    block = prompt.split("<tools>\n")[1].split("\n</tools>")[0]
    assert [json.loads(line) for line in block.splitlines()] == schemas
    assert "<tool_call>" in prompt
    assert FMT.system_prompt([]) == ""


def test_render_results_and_error_observation() -> None:
    a, b = ToolCall("a", {}), ToolCall("b", {"x": 1})
    assert FMT.render_results([(a, "1"), (b, "Error: boom")]) == [
        {"role": "tool", "name": "a", "content": "1"},
        {"role": "tool", "name": "b", "content": "Error: boom"},
    ]
    [message] = error_observation(["tool call 1: invalid JSON (x)", "unclosed <tool_call> tag"])
    assert message["role"] == "tool"
    assert message["name"] == "error"
    assert message["content"].startswith("Error: ")
    assert "- tool call 1: invalid JSON (x)\n- unclosed <tool_call> tag\n" in message["content"]
    assert "try again" in message["content"]
