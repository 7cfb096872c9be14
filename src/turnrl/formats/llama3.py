"""The Llama-3 JSON tool-call format: the assistant's message is ``{"name": ..., "parameters": {...}}``.

Llama 3.1 calls a user-defined tool by writing one JSON object as its whole message (no
tags; the 3.1 chat template puts the tool list in the prompt), and reads the result in an
``ipython`` turn. Several calls in one turn are written one after another, separated by
``;`` or whitespace (as vLLM's ``llama3_json`` parser reads them). ``arguments`` is accepted
in place of ``parameters``; a leading ``<|python_tag|>`` is skipped.

A turn is a call when its text starts with ``{`` (after whitespace), and then all of it must
be calls; anything else is the final answer. So an answer cannot start with ``{``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from turnrl.formats._json_call import (
    call_from_json,
    decode_json_at,
    excerpt,
    skip_whitespace,
)
from turnrl.formats.plain_template import renamed_tool_turns, tools_in_system
from turnrl.protocols import ParsedAction, ToolSchema
from turnrl.types import Message, ToolCall

PYTHON_TAG = "<|python_tag|>"
_ARGUMENT_KEYS = ("parameters", "arguments")


class Llama3JsonFormat:
    """Calls as bare JSON objects; a turn that does not start with ``{`` is the answer."""

    name: str = "llama3_json"
    template_tools: bool = True
    stop_strings: tuple[str, ...] = ()  # the call is the whole message: the model ends it

    def system_prompt(self, tools: Sequence[ToolSchema]) -> str:
        """Instructions for JSON calls in our own words, for templates that cannot render
        tools (a Llama 3.1 checkpoint's own template renders them itself)."""
        if not tools:
            return ""
        listing = "\n\n".join(json.dumps(t, ensure_ascii=False, indent=4) for t in tools)
        return (
            "These functions are available. To call one, reply with a single JSON object "
            'and nothing else: {"name": <the function\'s name>, "parameters": <an object of '
            "argument values>}. Use literal values only.\n\n"
            f"{listing}"
        )

    def for_plain_template(
        self, messages: Sequence[Message], tools: Sequence[ToolSchema]
    ) -> list[Message]:
        """The conversation for a template that renders no tools: ``system_prompt`` at the
        end of the system turn, and each result in an ``ipython`` turn (Llama 3.1's role
        for what a tool returned)."""
        return renamed_tool_turns(tools_in_system(messages, self.system_prompt(tools)), "ipython")

    def render_call(self, call: ToolCall) -> str:
        body = {"name": call.name, "parameters": dict(call.arguments)}
        return json.dumps(body, ensure_ascii=False)

    def parse(self, text: str) -> ParsedAction:
        """Every call in the turn, or the answer, or all errors (never a partial set).

        Never raises.
        """
        pos = skip_whitespace(text, 0)
        if text.startswith(PYTHON_TAG, pos):
            pos = skip_whitespace(text, pos + len(PYTHON_TAG))
        if not text.startswith("{", pos):
            return ParsedAction(answer=text.strip())
        calls: list[ToolCall] = []
        errors: list[str] = []
        index = 0
        while pos < len(text):
            index += 1
            decoded = decode_json_at(text, pos)
            if isinstance(decoded, str):
                errors.append(f"tool call {index}: {decoded}")
                break  # where this call ends is unknown, so nothing after it can be read
            obj, pos = decoded
            result = call_from_json(obj, index, _ARGUMENT_KEYS)
            if isinstance(result, ToolCall):
                calls.append(result)
            else:
                errors.append(result)
            pos = skip_whitespace(text, pos)
            if text.startswith(";", pos):
                pos = skip_whitespace(text, pos + 1)
            if pos < len(text) and not text.startswith("{", pos):
                errors.append(f"unexpected text after tool call {index}: {excerpt(text[pos:])}")
                break
        if errors:
            return ParsedAction(errors=tuple(errors))
        return ParsedAction(tool_calls=tuple(calls))

    def render_results(self, results: Sequence[tuple[ToolCall, str]]) -> list[Message]:
        """One ``tool`` message per call, in call order (Llama-3 templates show each as an
        ``ipython`` turn)."""
        return [{"role": "tool", "name": call.name, "content": text} for call, text in results]
