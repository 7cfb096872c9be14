"""The Mistral tool-call format: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]``.

Mistral's v3 tokenizer writes the calls of a turn as the control token ``[TOOL_CALLS]``
followed by a JSON list of call objects, and the template closes the turn with ``</s>``;
results come back in ``[TOOL_RESULTS]...[/TOOL_RESULTS]`` blocks and the tool list in an
``[AVAILABLE_TOOLS]`` block, both written by the chat template. Keys other than ``name`` and
``arguments`` (a call ``id``) are ignored. Text before the first ``[TOOL_CALLS]`` is allowed
(a thought); after it, only call lists may follow, each after its own ``[TOOL_CALLS]`` (so
``render_call`` outputs joined together parse back). A turn without ``[TOOL_CALLS]`` is
the final answer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from turnrl.formats._json_call import (
    call_from_json,
    decode_json_at,
    excerpt,
    json_kind,
    skip_whitespace,
)
from turnrl.formats.plain_template import merged_tool_turns, tools_in_system
from turnrl.protocols import ParsedAction, ToolSchema
from turnrl.types import Message, ToolCall

TOOL_CALLS = "[TOOL_CALLS]"
TOOL_RESULTS = "[TOOL_RESULTS]"
TOOL_RESULTS_END = "[/TOOL_RESULTS]"
_ARGUMENT_KEYS = ("arguments",)


class MistralFormat:
    """``[TOOL_CALLS]`` lists of JSON calls; a turn without one is the final answer."""

    name: str = "mistral"
    template_tools: bool = True
    stop_strings: tuple[str, ...] = ()  # the model ends the call turn with </s>

    def system_prompt(self, tools: Sequence[ToolSchema]) -> str:
        """The tool list and the call syntax, for templates that cannot render tools."""
        if not tools:
            return ""
        listing = json.dumps(list(tools), ensure_ascii=False)
        return (
            f"You can call these tools:\n{listing}\n\n"
            'To call tools, reply with [TOOL_CALLS] followed by a JSON list: [TOOL_CALLS][{"name": '
            '<function-name>, "arguments": <args-json-object>}]'
        )

    def for_plain_template(
        self, messages: Sequence[Message], tools: Sequence[ToolSchema]
    ) -> list[Message]:
        """The conversation for a template that renders no tools: ``system_prompt`` at the
        end of the system turn, and the results of each turn's calls in one user turn of
        ``[TOOL_RESULTS]`` blocks (so user and assistant turns still alternate, as Mistral's
        templates require)."""
        return merged_tool_turns(
            tools_in_system(messages, self.system_prompt(tools)), "user",
            lambda content: f"{TOOL_RESULTS}{content}{TOOL_RESULTS_END}", "",
        )  # fmt: skip

    def render_call(self, call: ToolCall) -> str:
        body = [{"name": call.name, "arguments": dict(call.arguments)}]
        return TOOL_CALLS + json.dumps(body, ensure_ascii=False)

    def parse(self, text: str) -> ParsedAction:
        """Every call in the turn, or the answer, or all errors (never a partial set).

        Never raises.
        """
        start = text.find(TOOL_CALLS)
        if start < 0:
            return ParsedAction(answer=text.strip())
        calls: list[ToolCall] = []
        errors: list[str] = []
        pos = start
        index = 0
        while pos < len(text):
            pos = skip_whitespace(text, pos + len(TOOL_CALLS))
            decoded = decode_json_at(text, pos)
            if isinstance(decoded, str):
                errors.append(f"tool call {index + 1}: {decoded}")
                break  # where the list ends is unknown, so nothing after it can be read
            value, pos = decoded
            if not isinstance(value, list):
                errors.append(
                    f"{TOOL_CALLS} must be followed by a JSON array of calls, "
                    f"got {json_kind(value)}"
                )
            elif not value:
                errors.append(f"{TOOL_CALLS} is followed by an empty array")
            for obj in value if isinstance(value, list) else ():
                index += 1
                result = call_from_json(obj, index, _ARGUMENT_KEYS)
                if isinstance(result, ToolCall):
                    calls.append(result)
                else:
                    errors.append(result)
            pos = skip_whitespace(text, pos)
            if pos < len(text) and not text.startswith(TOOL_CALLS, pos):
                errors.append(f"unexpected text after the tool calls: {excerpt(text[pos:])}")
                break
        if errors:
            return ParsedAction(errors=tuple(errors))
        return ParsedAction(tool_calls=tuple(calls))

    def render_results(self, results: Sequence[tuple[ToolCall, str]]) -> list[Message]:
        """One ``tool`` message per call, in call order (Mistral templates show each in a
        ``[TOOL_RESULTS]`` block)."""
        return [{"role": "tool", "name": call.name, "content": text} for call, text in results]
