"""The hermes/Qwen tool-call format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Qwen2.5 and Hermes-style chat templates render the tool list themselves, so
``system_prompt`` and ``for_plain_template`` are only for templates that cannot: the tool
list goes into the system turn and each turn's results into one user turn of
``<tool_response>`` blocks, the layout Qwen2.5's template writes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from turnrl.formats.plain_template import merged_tool_turns, tools_in_system
from turnrl.protocols import ParsedAction, ToolSchema
from turnrl.types import Message, ToolCall

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
RESULT_OPEN = "<tool_response>"
RESULT_CLOSE = "</tool_response>"
_WHITESPACE = " \t\n\r"
_DECODER = json.JSONDecoder()
_JSON_KINDS: dict[type, str] = {str: "string", bool: "boolean", int: "number", float: "number"}


class HermesFormat:
    """Several ``<tool_call>`` blocks per turn; a turn without any is the final answer."""

    name: str = "hermes"
    template_tools: bool = True
    stop_strings: tuple[str, ...] = ()  # several calls may follow each other in one turn

    def system_prompt(self, tools: Sequence[ToolSchema]) -> str:
        """A tool section in the Qwen2.5 layout, in our own words, for templates that cannot
        render tools (a Qwen checkpoint's own template renders them itself)."""
        if not tools:
            return ""
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return (
            "# Tools\n\nThese functions are available, one JSON schema per line:\n"
            f"<tools>\n{listing}\n</tools>\n\n"
            "To call one, write a JSON object with its name and arguments between "
            "<tool_call> tags (several calls may follow one another):\n"
            '<tool_call>\n{"name": <the function\'s name>, "arguments": <an object of '
            "argument values>}\n</tool_call>"
        )

    def for_plain_template(
        self, messages: Sequence[Message], tools: Sequence[ToolSchema]
    ) -> list[Message]:
        """The conversation for a template that renders no tools: ``system_prompt`` at the
        end of the system turn, and the results of each turn's calls in one user turn, a
        ``<tool_response>`` block each (Qwen2.5's layout)."""
        return merged_tool_turns(
            tools_in_system(messages, self.system_prompt(tools)), "user",
            lambda content: f"{RESULT_OPEN}\n{content}\n{RESULT_CLOSE}", "\n",
        )  # fmt: skip

    def render_call(self, call: ToolCall) -> str:
        body = {"name": call.name, "arguments": dict(call.arguments)}
        return f"{OPEN}\n{json.dumps(body, ensure_ascii=False)}\n{CLOSE}"

    def parse(self, text: str) -> ParsedAction:
        """Every call in the turn, or the answer, or all errors (never a partial set).

        A block is read as JSON first, so a ``</tool_call>`` inside a JSON string is data,
        not the end of the block. Never raises.
        """
        calls: list[ToolCall] = []
        errors: list[str] = []
        pos = 0
        index = 0
        seen_tag = False
        while True:
            start, close = text.find(OPEN, pos), text.find(CLOSE, pos)
            if start < 0 and close < 0:
                break
            seen_tag = True
            if close >= 0 and (start < 0 or close < start):
                errors.append(f"{CLOSE} without an opening {OPEN}")
                pos = close + len(CLOSE)
                continue
            index += 1
            body_start = start + len(OPEN)
            obj, end = _decode(text, body_start)
            if end is not None and text.startswith(CLOSE, end):
                pos = end + len(CLOSE)
                result = _to_call(obj, index)
                if isinstance(result, ToolCall):
                    calls.append(result)
                else:
                    errors.append(result)
                continue
            # No clean JSON-then-close: the block ends at the next close tag, if any.
            close = text.find(CLOSE, body_start)
            reopen = text.find(OPEN, body_start)
            if close < 0 or 0 <= reopen < close:
                errors.append(f"unclosed {OPEN} tag")
                if close < 0:
                    break
                pos = reopen
                continue
            errors.append(f"tool call {index}: {_json_problem(text[body_start:close])}")
            pos = close + len(CLOSE)
        if errors:
            return ParsedAction(errors=tuple(errors))
        if not seen_tag:
            return ParsedAction(answer=text.strip())
        return ParsedAction(tool_calls=tuple(calls))

    def render_results(self, results: Sequence[tuple[ToolCall, str]]) -> list[Message]:
        """One ``tool`` message per call, in call order, named after the tool."""
        return [{"role": "tool", "name": call.name, "content": text} for call, text in results]


def _decode(text: str, pos: int) -> tuple[Any, int | None]:
    """The JSON value starting at ``pos`` (after whitespace) and the index after it."""
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    try:
        obj, end = _DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError):
        return None, None
    while end < len(text) and text[end] in _WHITESPACE:
        end += 1
    return obj, end


def _json_problem(body: str) -> str:
    """Why ``body`` is not one JSON value, positions counted in the stripped body."""
    try:
        json.loads(body.strip(_WHITESPACE))
    except json.JSONDecodeError as exc:
        return f"invalid JSON ({exc.msg} at char {exc.pos})"
    except (ValueError, RecursionError) as exc:
        return f"invalid JSON ({type(exc).__name__}: {exc})"
    return "invalid JSON"  # not reached: the block failed to decode as one value before


def _to_call(obj: Any, index: int) -> ToolCall | str:
    where = f"tool call {index}"
    if not isinstance(obj, dict):
        kind = "array" if isinstance(obj, list) else _JSON_KINDS.get(type(obj), "null")
        return f"{where}: expected a JSON object, got {kind}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return f'{where}: "name" must be a non-empty string'
    arguments = obj.get("arguments", {})
    if not isinstance(arguments, dict):
        return f'{where}: "arguments" must be an object'
    return ToolCall(name=name, arguments=arguments)
