"""The Llama-3 JSON and Mistral ``[TOOL_CALLS]`` formats: round trips, several calls,
precise all-or-nothing errors, and no exception on any text."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_formats import calls  # the hermes tests' strategies
from turnrl.formats import Llama3JsonFormat, MistralFormat, get_format
from turnrl.protocols import Format, ParsedAction
from turnrl.types import ToolCall

LLAMA = Llama3JsonFormat()
MISTRAL = MistralFormat()
FAST = settings(max_examples=150, deadline=None)

SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {"name": "lookup", "description": "Look up a key.", "parameters": {}},
}


@pytest.mark.parametrize(("fmt", "name"), [(LLAMA, "llama3_json"), (MISTRAL, "mistral")])
def test_satisfies_protocol_and_registry(fmt: Format, name: str) -> None:
    assert isinstance(fmt, Format)
    assert fmt.name == name
    assert type(get_format(name)) is type(fmt)
    assert fmt.template_tools  # the families' templates render the tool list
    assert fmt.stop_strings == ()  # the model ends a call turn with its end-of-turn token


def test_render_call() -> None:
    call = ToolCall("search", {"q": "café", "n": 2})
    assert LLAMA.render_call(call) == '{"name": "search", "parameters": {"q": "café", "n": 2}}'
    assert MISTRAL.render_call(call) == (
        '[TOOL_CALLS][{"name": "search", "arguments": {"q": "café", "n": 2}}]'
    )


@pytest.mark.parametrize("fmt", [LLAMA, MISTRAL], ids=["llama3_json", "mistral"])
@FAST
@given(batch=st.lists(calls, min_size=1, max_size=4), separator=st.sampled_from(["", "\n", " "]))
def test_rendered_calls_joined_parse_back(
    fmt: Format, batch: list[ToolCall], separator: str
) -> None:
    text = separator.join(fmt.render_call(c) for c in batch)
    assert fmt.parse(text) == ParsedAction(tool_calls=tuple(batch))


@pytest.mark.parametrize("fmt", [LLAMA, MISTRAL], ids=["llama3_json", "mistral"])
@FAST
@given(text=st.text())
def test_parse_never_raises_and_gives_one_outcome(fmt: Format, text: str) -> None:
    pieces = ['{"name": "a", "parameters": {}}', "[TOOL_CALLS]", "[", "]", "{", "}", ";", '"']
    for candidate in (text, text.join(pieces), "".join(pieces) + text):
        parsed = fmt.parse(candidate)
        outcomes = [bool(parsed.tool_calls), parsed.answer is not None, bool(parsed.errors)]
        assert sum(outcomes) == 1


# --- llama3_json ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"name": "a", "parameters": {"x": 1}}', [ToolCall("a", {"x": 1})]),
        ('  \n{"name": "a", "arguments": {"x": 1}}\n', [ToolCall("a", {"x": 1})]),
        ('<|python_tag|>{"name": "a", "parameters": {}}', [ToolCall("a", {})]),
        ('{"name": "now"}', [ToolCall("now", {})]),
        (
            '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": "v"}}',
            [ToolCall("a", {}), ToolCall("b", {"k": "v"})],
        ),
        (
            '{"name": "a", "parameters": {}}\n{"name": "b", "parameters": {}};',
            [ToolCall("a", {}), ToolCall("b", {})],
        ),
        ('{"name": "a", "parameters": {"t": "} ; {"}}', [ToolCall("a", {"t": "} ; {"})]),
    ],
)
def test_llama_calls(text: str, expected: list[ToolCall]) -> None:
    assert LLAMA.parse(text) == ParsedAction(tool_calls=tuple(expected))


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("  The answer is 4.\n", "The answer is 4."),
        ("", ""),
        ('I will call {"name": "a"} now', 'I will call {"name": "a"} now'),
        ("[1, 2]", "[1, 2]"),
    ],
)
def test_llama_text_not_starting_with_a_brace_is_the_answer(text: str, answer: str) -> None:
    assert LLAMA.parse(text) == ParsedAction(answer=answer)


@pytest.mark.parametrize(
    ("text", "errors"),
    [
        (
            '{"name": "a" "parameters": {}}',
            ["tool call 1: invalid JSON (Expecting ',' delimiter at char 13)"],
        ),
        (
            '{"name": "a", "parameters": {}',
            ["tool call 1: invalid JSON (Expecting ',' delimiter at char 30)"],
        ),
        ('{"parameters": {}}', ['tool call 1: "name" must be a non-empty string']),
        ('{"name": ""}', ['tool call 1: "name" must be a non-empty string']),
        ('{"name": "a", "parameters": [1]}', ['tool call 1: "parameters" must be an object']),
        ('{"name": "a", "arguments": "x=1"}', ['tool call 1: "arguments" must be an object']),
        (
            '{"name": "a", "parameters": {}} and that is it',
            ["unexpected text after tool call 1: 'and that is it'"],
        ),
        (
            '{"name": "a", "parameters": {}}; {"name": "b" "parameters": {}}',
            ["tool call 2: invalid JSON (Expecting ',' delimiter at char 13)"],
        ),
        (
            '{"name": 1}; {"parameters": {}}',
            [
                'tool call 1: "name" must be a non-empty string',
                'tool call 2: "name" must be a non-empty string',
            ],
        ),
        (
            "{" + "[" * 100_000,
            [
                "tool call 1: invalid JSON (Expecting property name enclosed in double quotes at char 1)"
            ],
        ),
    ],
)
def test_llama_malformed_turns_give_precise_errors_and_no_calls(
    text: str, errors: list[str]
) -> None:
    assert LLAMA.parse(text) == ParsedAction(errors=tuple(errors))


def test_llama_one_bad_call_discards_the_good_ones() -> None:
    text = '{"name": "a", "parameters": {}}; {"name": "b", "parameters": 3}'
    parsed = LLAMA.parse(text)
    assert parsed.tool_calls == ()
    assert parsed.errors == ('tool call 2: "parameters" must be an object',)


# --- mistral ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}]', [ToolCall("a", {"x": 1})]),
        ('[TOOL_CALLS] [{"name": "a", "arguments": {}, "id": "abc123def"}]\n', [ToolCall("a", {})]),
        (
            '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"k": "v"}}]',
            [ToolCall("a", {}), ToolCall("b", {"k": "v"})],
        ),
        (
            '[TOOL_CALLS][{"name": "a", "arguments": {}}][TOOL_CALLS][{"name": "b"}]',
            [ToolCall("a", {}), ToolCall("b", {})],
        ),
        (
            'Let me look.[TOOL_CALLS][{"name": "a", "arguments": {"t": "]"}}]',
            [ToolCall("a", {"t": "]"})],
        ),
    ],
)
def test_mistral_calls(text: str, expected: list[ToolCall]) -> None:
    assert MISTRAL.parse(text) == ParsedAction(tool_calls=tuple(expected))


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("  The answer is 4.\n", "The answer is 4."),
        ("", ""),
        ('[{"name": "a"}]', '[{"name": "a"}]'),
    ],
)
def test_mistral_text_without_the_marker_is_the_answer(text: str, answer: str) -> None:
    assert MISTRAL.parse(text) == ParsedAction(answer=answer)


@pytest.mark.parametrize(
    ("text", "errors"),
    [
        (
            '[TOOL_CALLS][{"name": "a" "arguments": {}}]',
            ["tool call 1: invalid JSON (Expecting ',' delimiter at char 14)"],
        ),
        ("[TOOL_CALLS]", ["tool call 1: invalid JSON (Expecting value at char 0)"]),
        ('[TOOL_CALLS][{"arguments": {}}]', ['tool call 1: "name" must be a non-empty string']),
        (
            '[TOOL_CALLS][{"name": "a", "arguments": [1]}]',
            ['tool call 1: "arguments" must be an object'],
        ),
        (
            '[TOOL_CALLS]{"name": "a"}',
            ["[TOOL_CALLS] must be followed by a JSON array of calls, got object"],
        ),
        ("[TOOL_CALLS][]", ["[TOOL_CALLS] is followed by an empty array"]),
        ('[TOOL_CALLS][1, {"name": "b"}]', ["tool call 1: expected a JSON object, got number"]),
        (
            '[TOOL_CALLS][{"name": "a"}] and more',
            ["unexpected text after the tool calls: 'and more'"],
        ),
        (
            '[TOOL_CALLS][{"name": "a"}][TOOL_CALLS][{"name": "b", "arguments": 1}]',
            ['tool call 2: "arguments" must be an object'],
        ),
    ],
)
def test_mistral_malformed_turns_give_precise_errors_and_no_calls(
    text: str, errors: list[str]
) -> None:
    assert MISTRAL.parse(text) == ParsedAction(errors=tuple(errors))


# --- both -------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [LLAMA, MISTRAL], ids=["llama3_json", "mistral"])
def test_system_prompt_is_a_fallback_that_lists_the_tools(fmt: Format) -> None:
    assert fmt.system_prompt([]) == ""
    prompt = fmt.system_prompt([SCHEMA])
    assert '"name": "lookup"' in prompt
    assert "Look up a key." in prompt
    example = '"parameters"' if fmt is LLAMA else "[TOOL_CALLS]"
    assert example in prompt


@pytest.mark.parametrize("fmt", [LLAMA, MISTRAL], ids=["llama3_json", "mistral"])
def test_results_are_tool_messages_in_call_order(fmt: Format) -> None:
    a, b = ToolCall("a", {}), ToolCall("b", {"x": 1})
    assert fmt.render_results([(a, "1"), (b, "Error: boom")]) == [
        {"role": "tool", "name": "a", "content": "1"},
        {"role": "tool", "name": "b", "content": "Error: boom"},
    ]
    assert json.loads(json.dumps(fmt.render_results([(a, "x")]))) == [
        {"role": "tool", "name": "a", "content": "x"}
    ]
