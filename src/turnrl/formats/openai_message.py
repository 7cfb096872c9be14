"""The text a model wrote, rebuilt from an OpenAI chat-completions assistant message.

A server that parses tool calls (vLLM with ``--tool-call-parser``, SGLang, OpenAI) cuts
the model's text into fields: its reasoning (``reasoning``, as vLLM names it, or
``reasoning_content``, as DeepSeek's API and older vLLM do), ``content``, and
``tool_calls`` with each call's arguments as a JSON string. An environment reads one text
in its own call format (``Format.parse``), so ``assistant_text`` writes the fields back
as one text in that format, in the order a model writes them:

- the reasoning, where there is any, in a ``<think>`` block (``<think>\\n...\\n</think>``
  and a blank line), the way Qwen3's and DeepSeek-R1's templates write it and a server's
  reasoning parser cuts it out: the env reads what it would have read in the model's own
  text, as in a local episode (where a format's answer is the whole turn, the block is
  part of it there too);
- the content, as it is;
- each call, rendered by ``fmt.render_call``, one per line after the content (as the
  Qwen2.5 template writes ``<tool_call>`` blocks).

A call whose arguments are not a JSON object (malformed JSON, a list) is the model's
mistake, not a crash: it is written in the format with the raw arguments text in place of
the object, so the format's parser rejects it and the environment shows the error to the
model, as for a bad call written in text. A call the format cannot express (another
tool than a single-tool format's, say) is written as the server's JSON of it, which such
a format does not read as a call either. Empty arguments (``""`` or none) are ``{}``, as
an absent ``arguments`` key is in the formats' own parsers.

What does not live here: the HTTP requests (``turnrl.evaluation``) and the formats.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from turnrl.protocols import Format
from turnrl.types import ToolCall

REASONING_KEYS = ("reasoning", "reasoning_content")
"""Where servers put the reasoning they parsed out of the text, first found wins."""

_PLACEHOLDER = {"\x00raw arguments\x00": 0}
"""Arguments no real call has: rendered, then replaced by a malformed call's raw text."""


def assistant_text(message: Mapping[str, Any], fmt: Format) -> str:
    """The text the model wrote, in ``fmt``'s call format, rebuilt from an OpenAI assistant
    ``message`` (its reasoning, ``content`` and ``tool_calls``). Never raises on odd fields:
    a malformed call is kept as text for the environment to reject."""
    reasoning = next((str(message[k]) for k in REASONING_KEYS if message.get(k)), "")
    thought = "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" if reasoning else ""
    content = _content_text(message.get("content"))
    entries = message.get("tool_calls")
    calls = [_call_text(entry, fmt) for entry in (entries if isinstance(entries, list) else ())]
    return thought + "\n".join([content, *calls] if content else calls)


def _content_text(content: Any) -> str:
    """``content`` as text: a string, nothing (None), or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
    return str(content)


def _call_text(entry: Any, fmt: Format) -> str:
    """One ``tool_calls`` entry (``{"function": {"name", "arguments"}}``) in ``fmt``."""
    function = entry.get("function") if isinstance(entry, Mapping) else None
    function = function if isinstance(function, Mapping) else {}
    name = function.get("name")
    name = name if isinstance(name, str) else ""
    arguments = _arguments(function.get("arguments"))
    if isinstance(arguments, dict):
        try:
            return fmt.render_call(ToolCall(name, arguments))
        except ValueError:  # a call this format cannot express
            return _raw_call(name, json.dumps(arguments, ensure_ascii=False))
    try:
        text = fmt.render_call(ToolCall(name, _PLACEHOLDER))
    except ValueError:
        return _raw_call(name, arguments)
    marker = json.dumps(_PLACEHOLDER, ensure_ascii=False)
    if text.count(marker) != 1:  # the format does not write arguments as a JSON object
        return _raw_call(name, arguments)
    return text.replace(marker, arguments)


def _arguments(raw: Any) -> dict[str, Any] | str:
    """The arguments as an object, or as the raw text when they are not a JSON object."""
    if isinstance(raw, Mapping):  # some servers send the object itself
        return dict(raw)
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}
    text = raw if isinstance(raw, str) else json.dumps(raw, ensure_ascii=False)
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return value if isinstance(value, dict) else text


def _raw_call(name: str, arguments: str) -> str:
    """The call as the server's JSON of it, for a format that cannot write it."""
    return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {arguments}}}'
