"""Tool-call formats: how tools appear in the prompt, how calls are parsed from model text,
how results are shown. Each format satisfies ``turnrl.protocols.Format``; pick one by name."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from turnrl.errors import ConfigError
from turnrl.formats.code import CodeFormat
from turnrl.formats.hermes import HermesFormat
from turnrl.formats.llama3 import Llama3JsonFormat
from turnrl.formats.mistral import MistralFormat
from turnrl.formats.react import ReActFormat
from turnrl.formats.search_r1 import SearchR1Format
from turnrl.protocols import Format
from turnrl.types import Message

__all__ = [
    "FORMATS",
    "CodeFormat",
    "HermesFormat",
    "Llama3JsonFormat",
    "MistralFormat",
    "ReActFormat",
    "SearchR1Format",
    "error_observation",
    "get_format",
]

FORMATS: dict[str, Callable[[], Format]] = {
    "hermes": HermesFormat,
    "search_r1": SearchR1Format,
    "react": ReActFormat,
    "code": CodeFormat,
    "llama3_json": Llama3JsonFormat,
    "mistral": MistralFormat,
}
"""Format constructors by the name configs use (the default, hermes, first; then the
call formats of the Llama-3 and Mistral families)."""


def get_format(name: str) -> Format:
    """A fresh instance of the format called ``name`` (as written in a config)."""
    try:
        factory = FORMATS[name]
    except KeyError:
        known = ", ".join(FORMATS)
        raise ConfigError(f"unknown tool-call format {name!r}; known formats: {known}") from None
    return factory()


def error_observation(errors: Sequence[str]) -> list[Message]:
    """The observation for a turn that could not be parsed: what was wrong, and to retry.

    Environments show it instead of running any call, so the model learns to fix the turn.
    """
    listing = "\n".join(f"- {e}" for e in errors)
    content = (
        f"Error: your tool call could not be understood:\n{listing}\nFix the call and try again."
    )
    return [{"role": "tool", "name": "error", "content": content}]
