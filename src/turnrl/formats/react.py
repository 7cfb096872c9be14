"""The ReAct format: ``Thought:`` / ``Action:`` / ``Action Input:`` lines, then ``Observation:``.

ReAct (Yao et al., 2023, arXiv:2210.03629, "ReAct: Synergizing Reasoning and Acting in
Language Models") interleaves a free-text thought with one action and the observation it
produces. The paper's actions were strings such as ``Search[entity]``; here the action
line names a tool and its input is a JSON object of arguments, so any ``Tool`` can be
called.

Grammar of one model turn. Keywords start a line (leading spaces allowed), are
case-sensitive, and run to the next keyword line:

    Thought: free text (optional, any number of lines)
    Action: tool_name
    Action Input: {"json": "object"}

or, to finish,

    Thought: ...
    Final Answer: the answer (up to the next keyword line, stripped; may span lines)

One action per turn: the model must read its observation before acting again, which is the
point of ReAct. The tool result comes back as a ``tool`` message ``Observation: result``.

Errors (the whole turn is rejected, every problem listed): an Action without an Action
Input, an Action Input without an Action or before it, an Action that is not one tool name,
an Action Input that is not exactly one JSON object (broken JSON, trailing text), several
Actions, several Action Inputs, several Final Answers, an Action and a Final Answer in the
same turn, an ``Observation:`` the model wrote itself, and a turn with neither an Action nor
a Final Answer. A name that is not a tool is reported by the environment when the call runs
(``unknown tool ...; available tools: ...``), as for every format: the parser does not see
the tool list. A bare ``Observation:`` at the very end is allowed: it is the stop string
(``stop_strings``) at which generation ends after an action.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from turnrl.protocols import ParsedAction, ToolSchema
from turnrl.types import Message, ToolCall

_KEYWORD = re.compile(
    r"^[ \t]*(Thought|Action Input|Action|Final Answer|Observation)[ \t]*:", re.MULTILINE
)
_JSON_KINDS: dict[type, str] = {
    str: "a string",
    bool: "a boolean",
    int: "a number",
    float: "a number",
    list: "an array",
}


class ReActFormat:
    """Thought/Action/Action Input lines; one action per turn, or a Final Answer."""

    name: str = "react"
    template_tools: bool = False
    stop_strings: tuple[str, ...] = ("\nObservation:",)

    def system_prompt(self, tools: Sequence[ToolSchema]) -> str:
        if not tools:
            return ""
        entries = []
        for schema in tools:
            function = schema.get("function", {})
            parameters = json.dumps(function.get("parameters", {}), ensure_ascii=False)
            description = function.get("description") or "(no description)"
            entries.append(f"{function.get('name')}: {description}\n  arguments: {parameters}")
        names = ", ".join(str(t.get("function", {}).get("name")) for t in tools)
        return (
            "You solve the task step by step and can use these tools:\n\n"
            + "\n\n".join(entries)
            + "\n\nIn each turn, think, then call one tool with exactly these lines, and stop:\n"
            "Thought: what you know and what you need next\n"
            f"Action: the tool's name, one of [{names}]\n"
            "Action Input: the arguments as one JSON object, e.g. {} for none\n"
            "The result comes back as a line starting with 'Observation:'. "
            "When you know the answer, end with these lines instead:\n"
            "Thought: why the answer is right\n"
            "Final Answer: the answer"
        )

    def render_call(self, call: ToolCall) -> str:
        """The Action and Action Input lines. Raises ValueError for a name this grammar
        cannot hold (empty or with whitespace)."""
        if not call.name or any(c.isspace() for c in call.name):
            raise ValueError(f"react: a tool name must be one word, got {call.name!r}")
        arguments = json.dumps(dict(call.arguments), ensure_ascii=False)
        return f"Action: {call.name}\nAction Input: {arguments}"

    def parse(self, text: str) -> ParsedAction:
        """The one call, or the answer, or every error found. Never raises."""
        marks = list(_KEYWORD.finditer(text))
        ends = [m.start() for m in marks[1:]] + [len(text)]
        # (keyword, the text after it up to the next keyword line)
        sections = [(m.group(1), text[m.end() : ends[i]]) for i, m in enumerate(marks)]
        kinds = [kind for kind, _ in sections]
        errors: list[str] = []
        for i, (kind, value) in enumerate(sections):
            is_stop_string = i == len(sections) - 1 and not value.strip()
            if kind == "Observation" and not is_stop_string:
                errors.append(
                    "Observation lines come from the tool, not from you: "
                    "end your turn after Action Input"
                )
                break
        actions = [value for kind, value in sections if kind == "Action"]
        inputs = [value for kind, value in sections if kind == "Action Input"]
        finals = [value for kind, value in sections if kind == "Final Answer"]
        if len(finals) > 1:
            errors.append(f"several Final Answer lines ({len(finals)}); give exactly one")
        if (actions or inputs) and finals:
            errors.append(
                "a turn has either an Action or a Final Answer, not both: act, read the "
                "Observation, then answer in a later turn"
            )
        if len(actions) > 1:
            errors.append(
                f"several Actions ({len(actions)}) in one turn; write one Action and its "
                "Action Input, then wait for the Observation"
            )
        if len(inputs) > 1:
            errors.append(f"several Action Input lines ({len(inputs)}); write one per Action")
        call = None
        if len(actions) == 1 and len(inputs) <= 1:
            call = _call(actions[0], inputs[0] if inputs else None, errors)
            if inputs and kinds.index("Action Input") < kinds.index("Action"):
                errors.append("Action Input must come after the Action line")
        if inputs and not actions:
            errors.append("Action Input without an Action line naming the tool")
        if not (actions or inputs or finals or errors):
            errors.append(
                "no Action and no Final Answer: call a tool with 'Action:' and "
                "'Action Input:' lines, or finish with a 'Final Answer:' line"
            )
        if errors:
            return ParsedAction(errors=tuple(errors))
        if finals:
            return ParsedAction(answer=finals[0].strip())
        assert call is not None  # one Action, its input checked, no errors
        return ParsedAction(tool_calls=(call,))

    def render_results(self, results: Sequence[tuple[ToolCall, str]]) -> list[Message]:
        """One ``tool`` message per call: ``Observation: result``."""
        return [
            {"role": "tool", "name": call.name, "content": f"Observation: {text}"}
            for call, text in results
        ]


def _call(action: str, action_input: str | None, errors: list[str]) -> ToolCall | None:
    """The call one Action and its Action Input make, or None with the problems appended."""
    name = action.strip()
    if not name:
        errors.append("Action names no tool: write the tool's name after 'Action:'")
    elif any(c.isspace() for c in name):
        errors.append(
            f"Action must be one tool name on its own line, got {_shorten(name)!r}; "
            "put the arguments on an 'Action Input:' line"
        )
    if action_input is None:
        errors.append(
            f"Action {_shorten(name)!r} has no Action Input: add a line "
            "'Action Input: {...}' with the arguments as a JSON object ({} for none)"
        )
        return None
    body = action_input.strip()
    if not body:
        errors.append("Action Input is empty: write the arguments as a JSON object ({} for none)")
        return None
    try:
        arguments = json.loads(body)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":
            errors.append(
                f"Action Input has text after its JSON value (at char {exc.pos}); "
                "end your turn after the Action Input"
            )
        else:
            errors.append(f"Action Input is not valid JSON ({exc.msg} at char {exc.pos})")
        return None
    except (ValueError, RecursionError) as exc:
        errors.append(f"Action Input is not valid JSON ({type(exc).__name__})")
        return None
    if not isinstance(arguments, dict):
        kind = _JSON_KINDS.get(type(arguments), "null")
        errors.append(f"Action Input must be a JSON object, got {kind}")
        return None
    return ToolCall(name, arguments)


def _shorten(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
