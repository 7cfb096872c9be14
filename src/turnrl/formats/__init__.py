"""Tool-call formats: how tools appear in the prompt, how calls are parsed from model text,
how results are shown. Each format satisfies ``turnrl.protocols.Format``; pick one by name."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

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
    "default_format",
    "error_observation",
    "get_format",
    "using_default_format",
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


DEFAULT_FORMAT = "hermes"
"""The call format of an environment built outside a run (and of the ChatML families)."""

_default: ContextVar[Format | str] = ContextVar("turnrl_default_format", default=DEFAULT_FORMAT)


def default_format() -> Format:
    """The call format an environment given none takes (``ToolEnv``, ``GameEnv``): the
    run's model family's while a ``turnrl.Environment`` builds an episode for a run (see
    ``using_default_format``), hermes anywhere else."""
    fmt = _default.get()
    return get_format(fmt) if isinstance(fmt, str) else fmt  # a name: a fresh instance


@contextmanager
def using_default_format(fmt: Format | str | None) -> Iterator[None]:
    """Within the block, ``default_format()`` is ``fmt`` (a format or its name; None
    leaves it as it is). ``turnrl.Environment.make_env`` builds each episode inside one,
    with the format the run chose for its model family."""
    if fmt is None:
        yield
        return
    if isinstance(fmt, str):
        get_format(fmt)  # an unknown name fails here, naming the known ones
    token = _default.set(fmt)
    try:
        yield
    finally:
        _default.reset(token)


def error_observation(errors: Sequence[str]) -> list[Message]:
    """The observation for a turn that could not be parsed: what was wrong, and to retry.

    Environments show it instead of running any call, so the model learns to fix the turn.
    """
    listing = "\n".join(f"- {e}" for e in errors)
    content = (
        f"Error: your tool call could not be understood:\n{listing}\nFix the call and try again."
    )
    return [{"role": "tool", "name": "error", "content": content}]
