"""Tool conversations for chat templates that render no tools.

Many instruct checkpoints (SmolLM2's among them) ship a chat template without a ``tools``
branch: it ignores ``tools=`` and shows a ``tool`` message as one more turn under that role
name. A format whose tools the template is meant to render (``template_tools = True``:
hermes, llama3_json, mistral) then needs the conversation rewritten before the template
sees it: the tool list goes into the system turn, written as ``system_prompt`` writes it,
and tool results go into the turns the format documents for them. ``for_plain_template``
on a format does both; a format without that method gets ``tools_in_system`` only.

These are pure functions on messages: the chat renderer calls them just before the
template, on the conversation it was given, so what it holds (the messages, the sampled
ids) never changes and the markup they add is template text, not content.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from turnrl.protocols import Format, ToolSchema
from turnrl.types import Message


def for_plain_template(
    call_format: Format, messages: Sequence[Message], tools: Sequence[ToolSchema]
) -> list[Message]:
    """``messages`` as a template without tool support should see them in
    ``call_format``: the format's own ``for_plain_template`` where it has one, else
    ``tools_in_system`` with its ``system_prompt``."""
    own: Callable[[Sequence[Message], Sequence[ToolSchema]], list[Message]] | None = getattr(
        call_format, "for_plain_template", None
    )
    if own is not None:
        return own(messages, tools)
    return tools_in_system(messages, call_format.system_prompt(tools))


def tools_in_system(messages: Sequence[Message], text: str) -> list[Message]:
    """``messages`` with ``text`` (the tool list and how to call) at the end of the system
    turn, after a blank line; in a system turn of its own at the start where there is none.
    The other messages are the same objects."""
    out = list(messages)
    if not text:
        return out
    if out and out[0].get("role") == "system":
        content = out[0].get("content") or ""
        out[0] = {**out[0], "content": f"{content}\n\n{text}" if content else text}
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


def merged_tool_turns(
    messages: Sequence[Message], role: str, wrap: Callable[[str], str], separator: str
) -> list[Message]:
    """``messages`` with each run of consecutive ``tool`` messages made into one turn of
    ``role``, each result written as ``wrap`` writes its content, joined by ``separator``
    (as Qwen2.5 shows the results of one turn's calls in a single user turn)."""
    out: list[Message] = []
    run: list[str] = []
    for message in [*messages, None]:
        if message is not None and message.get("role") == "tool":
            run.append(str(message.get("content") or ""))
            continue
        if run:
            out.append({"role": role, "content": separator.join(wrap(c) for c in run)})
            run = []
        if message is not None:
            out.append(message)
    return out


def renamed_tool_turns(messages: Sequence[Message], role: str) -> list[Message]:
    """``messages`` with every ``tool`` message shown under ``role`` instead."""
    return [{**m, "role": role} if m.get("role") == "tool" else m for m in messages]
