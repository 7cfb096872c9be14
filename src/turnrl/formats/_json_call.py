"""Reading tool calls written as bare JSON, shared by the Llama-3 and Mistral formats.

Both families write a call as a JSON object with a ``name`` and an object of arguments
(under ``parameters`` for Llama 3.1, ``arguments`` for Mistral), with no tags around it:
the JSON itself must say where a call ends. Hermes has its own reader (tags delimit there).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from turnrl.types import ToolCall

WHITESPACE = " \t\n\r"
_DECODER = json.JSONDecoder()
_JSON_KINDS: dict[type, str] = {str: "string", bool: "boolean", int: "number", float: "number"}


def skip_whitespace(text: str, pos: int) -> int:
    """The first index at or after ``pos`` that is not JSON whitespace."""
    while pos < len(text) and text[pos] in WHITESPACE:
        pos += 1
    return pos


def decode_json_at(text: str, pos: int) -> tuple[Any, int] | str:
    """The JSON value that starts at ``pos`` and the index after it, or why there is none
    (positions in the message counted from ``pos``). Never raises."""
    try:
        return _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError as exc:
        return f"invalid JSON ({exc.msg} at char {exc.pos - pos})"
    except (ValueError, RecursionError) as exc:
        return f"invalid JSON ({type(exc).__name__})"


def json_kind(value: Any) -> str:
    """The JSON name of ``value``'s type, for error messages."""
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    return _JSON_KINDS.get(type(value), "null")


def call_from_json(obj: Any, index: int, argument_keys: Sequence[str]) -> ToolCall | str:
    """The call ``obj`` describes, or what is wrong with it (``index`` counts from 1).

    The arguments are read from the first of ``argument_keys`` present; absent, they are
    empty. Other keys (a call id, a type) are ignored.
    """
    where = f"tool call {index}"
    if not isinstance(obj, dict):
        return f"{where}: expected a JSON object, got {json_kind(obj)}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return f'{where}: "name" must be a non-empty string'
    key = next((k for k in argument_keys if k in obj), argument_keys[0])
    arguments = obj.get(key, {})
    if not isinstance(arguments, dict):
        return f'{where}: "{key}" must be an object'
    return ToolCall(name=name, arguments=arguments)


def excerpt(text: str, limit: int = 24) -> str:
    """The start of ``text`` for an error message, quoted, cut at ``limit`` characters."""
    return repr(text[:limit] + ("..." if len(text) > limit else ""))
