"""Typed Python functions as tools: JSON schema from the signature, safe invocation.

A tool call never raises into the rollout (docs/design.md, invariant 4): invalid arguments,
exceptions, timeouts and unknown tools all become a ``ToolResult`` with ``ok=False`` whose
``content`` the model reads. Only cancellation propagates. Parsing calls out of model text
lives in ``turnrl.formats``, not here.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import time
import types
import typing
import weakref
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from turnrl.errors import ToolDefinitionError
from turnrl.protocols import ToolSchema
from turnrl.types import ToolCall, ToolCallRecord

JsonSchema = dict[str, Any]

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # what OpenAI-style APIs accept
_SECTION_RE = re.compile(r"^(Args|Arguments|Parameters):$")
_ARG_RE = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_SCALARS: dict[type, str] = {str: "string", bool: "boolean", int: "integer", float: "number"}
_ARTICLES = {"integer": "an integer", "array": "an array", "object": "an object", "null": "null"}


@dataclass(frozen=True)
class ToolResult:
    """The outcome of one call. On failure ``content`` is ``"Error: " + error``, shown to
    the model; ``truncated`` says the output was cut to the tool's ``max_output_chars``."""

    content: str
    ok: bool
    error: str | None
    latency_s: float
    truncated: bool


@dataclass(eq=False)
class Tool:
    """A function the model can call, with its schema and its execution limits.

    ``parameters`` is a JSON schema object (``from_function`` writes it). ``timeout_s``
    bounds one call (None: no limit; a timed-out sync function's thread runs on, only its
    result is dropped). ``max_concurrency`` bounds simultaneous calls per event loop (None:
    unlimited). Output longer than ``max_output_chars`` is cut with a visible marker.
    Calling the tool object directly calls the plain function (handy in unit tests).
    ``isolated`` says whether the tool runs untrusted code in an isolating sandbox (True),
    in a non-isolating fallback (False), or runs none (None); calls record it.
    """

    fn: Callable[..., Any]
    name: str
    description: str
    parameters: JsonSchema
    timeout_s: float | None = 10.0
    max_concurrency: int | None = None
    max_output_chars: int = 4000
    isolated: bool | None = None
    # A semaphore belongs to one event loop; each asyncio.run() gets its own.
    _semaphores: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = field(
        default_factory=weakref.WeakKeyDictionary, init=False, repr=False
    )

    def __post_init__(self) -> None:
        name = self.name
        if not _NAME_RE.match(name):
            raise ToolDefinitionError(
                f"tool name {name!r} must match {_NAME_RE.pattern}; pass name= to rename it"
            )
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ToolDefinitionError(f"{name}: timeout_s must be > 0 or None")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ToolDefinitionError(f"{name}: max_concurrency must be >= 1 or None")
        if self.max_output_chars < 0:
            raise ToolDefinitionError(f"{name}: max_output_chars must be >= 0")

    @classmethod
    def from_function(
        cls,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        timeout_s: float | None = 10.0,
        max_concurrency: int | None = None,
        max_output_chars: int = 4000,
        isolated: bool | None = None,
    ) -> Tool:
        """Build a tool whose schema comes from ``fn``'s annotations and docstring."""
        doc_description, arg_docs = _parse_docstring(inspect.getdoc(fn) or "")
        return cls(
            fn,
            name=name or str(getattr(fn, "__name__", type(fn).__name__)),
            description=doc_description if description is None else description,
            parameters=_parameters_schema(fn, arg_docs),
            timeout_s=timeout_s,
            max_concurrency=max_concurrency,
            max_output_chars=max_output_chars,
            isolated=isolated,
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def schema(self) -> ToolSchema:
        """The OpenAI function format, as chat templates and HTTP APIs expect it."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    def validate(self, arguments: Any) -> str | None:
        """Why ``arguments`` do not fit the schema (all problems, one line), or None.

        Checks required keys, unknown keys (unless the schema allows more), types, enums,
        array items and mapping values; keywords it does not know (``$ref``, ``pattern``,
        bounds) are left to the tool itself, so a foreign schema (MCP) never blocks a call
        that might be valid.
        """
        if not isinstance(arguments, Mapping):
            return f"{self.name}: arguments must be an object, got {_describe(arguments)}"
        props: dict[str, JsonSchema] = self.parameters.get("properties", {})
        problems = [
            f"missing required argument '{key}'"
            for key in self.parameters.get("required", [])
            if key not in arguments
        ]
        open_ended = bool(self.parameters.get("additionalProperties", False))
        for key, value in arguments.items():
            if key not in props:
                if not open_ended:
                    expected = ", ".join(props) or "none"
                    problems.append(f"unknown argument '{key}' (expected: {expected})")
            elif (problem := _check(value, props[key], str(key))) is not None:
                problems.append(problem)
        return f"{self.name}: " + "; ".join(problems) if problems else None

    async def invoke(self, arguments: Mapping[str, Any]) -> ToolResult:
        """Validate, run under the limits, and turn the outcome into text. Never raises
        except ``asyncio.CancelledError`` (and other non-``Exception`` signals)."""
        start = time.perf_counter()
        if (problem := self.validate(arguments)) is not None:
            return self._failure(problem, start)
        semaphore = self._semaphore()
        if semaphore is None:
            value, error = await self._run(dict(arguments))
        else:
            async with semaphore:
                value, error = await self._run(dict(arguments))
        if error is not None:
            return self._failure(error, start)
        content, truncated = self._to_text(value)
        return ToolResult(content, True, None, time.perf_counter() - start, truncated)

    async def _run(self, arguments: dict[str, Any]) -> tuple[Any, str | None]:
        """The function's value, or None and the error text."""

        async def call() -> tuple[Any, str | None]:
            # Exceptions are caught inside, so a TimeoutError the function raises itself
            # is not mistaken for our timeout; BaseException (cancellation) passes through.
            try:
                if inspect.iscoroutinefunction(self.fn):
                    return await self.fn(**arguments), None
                result = await asyncio.to_thread(self.fn, **arguments)
                return (await result if inspect.isawaitable(result) else result), None
            except Exception as exc:
                kind = type(exc).__name__
                return None, f"{kind}: {exc}" if str(exc) else kind

        try:
            return await asyncio.wait_for(call(), self.timeout_s)
        except asyncio.TimeoutError:
            return None, f"{self.name}: timed out after {self.timeout_s:g}s"

    def _semaphore(self) -> asyncio.Semaphore | None:
        if self.max_concurrency is None:
            return None
        loop = asyncio.get_running_loop()
        if loop not in self._semaphores:
            self._semaphores[loop] = asyncio.Semaphore(self.max_concurrency)
        return self._semaphores[loop]

    def _to_text(self, value: Any) -> tuple[str, bool]:
        if isinstance(value, str):
            text = value
        else:
            try:
                text = json.dumps(value, ensure_ascii=False, default=str)
            except (TypeError, ValueError):  # circular or non-string keys
                text = str(value)
        if len(text) <= self.max_output_chars:
            return text, False
        cut = len(text) - self.max_output_chars
        return f"{text[: self.max_output_chars]}\n...[truncated {cut} chars]", True

    def _failure(self, error: str, start: float) -> ToolResult:
        return ToolResult(f"Error: {error}", False, error, time.perf_counter() - start, False)


@typing.overload
def tool(fn: Callable[..., Any], /) -> Tool: ...


@typing.overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float | None = 10.0,
    max_concurrency: int | None = None,
    max_output_chars: int = 4000,
) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float | None = 10.0,
    max_concurrency: int | None = None,
    max_output_chars: int = 4000,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Turn a typed function into a ``Tool``: ``@tool`` or ``@tool(timeout_s=2)``."""

    def wrap(f: Callable[..., Any]) -> Tool:
        return Tool.from_function(
            f,
            name=name,
            description=description,
            timeout_s=timeout_s,
            max_concurrency=max_concurrency,
            max_output_chars=max_output_chars,
        )

    return wrap if fn is None else wrap(fn)


class ToolSet:
    """The tools of one environment, ordered, by unique name; runs parsed calls.

    ``on_close`` are async callables that release what the tools hold (a sandboxed
    interpreter, a server session); ``close`` runs each once, at the end of the episode.
    """

    def __init__(
        self,
        tools: Iterable[Tool | Callable[..., Any]] = (),
        *,
        on_close: Iterable[Callable[[], Awaitable[None]]] = (),
    ) -> None:
        self._on_close = list(on_close)
        self._tools: dict[str, Tool] = {}
        for item in tools:
            t = item if isinstance(item, Tool) else Tool.from_function(item)
            if t.name in self._tools:
                raise ToolDefinitionError(f"duplicate tool name {t.name!r}")
            self._tools[t.name] = t

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._tools)

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def schemas(self) -> list[ToolSchema]:
        return [t.schema() for t in self._tools.values()]

    async def run(self, call: ToolCall) -> tuple[ToolResult, ToolCallRecord]:
        """Run one call; an unknown name is a failed result naming the available tools."""
        found = self._tools.get(call.name)
        if found is None:
            available = ", ".join(self._tools) or "none"
            error = f"unknown tool '{call.name}'; available tools: {available}"
            result = ToolResult(f"Error: {error}", False, error, 0.0, False)
        else:
            result = await found.invoke(call.arguments)
        record = ToolCallRecord(
            call.name, dict(call.arguments), result.latency_s, result.ok, result.error,
            isolated=found.isolated if found is not None else None,
        )  # fmt: skip
        return result, record

    async def close(self) -> None:
        """Release the tools' resources; later calls to ``close`` do nothing. Every
        callback runs even if one fails; the first failure is raised after all ran."""
        callbacks, self._on_close = self._on_close, []
        failure: BaseException | None = None
        for callback in callbacks:
            try:
                await callback()
            except Exception as exc:  # keep closing the others
                failure = failure or exc
        if failure is not None:
            raise failure


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """First paragraph, and per-argument text from a Google-style ``Args:`` section."""
    lines = doc.splitlines()
    first: list[str] = []
    for line in lines:
        if not line.strip() or _SECTION_RE.match(line.strip()):
            break
        first.append(line.strip())
    args: dict[str, str] = {}
    header = next((i for i, ln in enumerate(lines) if _SECTION_RE.match(ln.strip())), None)
    if header is not None:
        base = _indent(lines[header])
        entry_indent: int | None = None
        current: str | None = None
        for line in lines[header + 1 :]:
            if not line.strip():
                continue
            indent = _indent(line)
            if indent <= base:
                break  # the next section ("Returns:", ...)
            entry_indent = indent if entry_indent is None else entry_indent
            match = _ARG_RE.match(line.strip())
            if indent <= entry_indent and match:
                current = match.group(1)
                args[current] = match.group(2).strip()
            elif current is not None:
                args[current] = f"{args[current]} {line.strip()}".strip()
    return " ".join(first), args


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _parameters_schema(fn: Callable[..., Any], arg_docs: Mapping[str, str]) -> JsonSchema:
    label = getattr(fn, "__qualname__", repr(fn))
    try:
        hints = typing.get_type_hints(fn)
        signature = inspect.signature(fn)
    except Exception as exc:  # a string annotation that is no expression: SyntaxError, ...
        raise ToolDefinitionError(f"{label}: cannot read the signature ({exc})") from exc
    properties: dict[str, JsonSchema] = {}
    required: list[str] = []
    for param in signature.parameters.values():
        where = f"{label}: parameter '{param.name}'"
        if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            raise ToolDefinitionError(
                f"{where}: *args, **kwargs and positional-only are not allowed"
            )
        if param.name not in hints:
            raise ToolDefinitionError(f"{where} has no type annotation")
        prop = _type_schema(hints[param.name], where)
        if param.name in arg_docs:
            prop["description"] = arg_docs[param.name]
        if param.default is param.empty:
            required.append(param.name)
        elif param.default is None or isinstance(param.default, (str, int, float, bool)):
            prop["default"] = param.default
        properties[param.name] = prop
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


def _type_schema(tp: Any, where: str) -> JsonSchema:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if isinstance(tp, type) and tp in _SCALARS:
        return {"type": _SCALARS[tp]}
    if origin is list and len(args) == 1:
        return {"type": "array", "items": _type_schema(args[0], where)}
    if origin is dict and len(args) == 2 and args[0] is str:
        return {"type": "object", "additionalProperties": _type_schema(args[1], where)}
    if origin is Literal and all(isinstance(a, (str, int, bool)) for a in args):
        kinds = {_SCALARS[type(a)] for a in args}
        return (
            {"type": kinds.pop(), "enum": list(args)} if len(kinds) == 1 else {"enum": list(args)}
        )
    if origin in (Union, types.UnionType) and len(args) == 2 and type(None) in args:
        inner = next(a for a in args if a is not type(None))
        return {"anyOf": [_type_schema(inner, where), {"type": "null"}]}
    raise ToolDefinitionError(
        f"{where} has unsupported type {tp!r}; use str, int, float, bool, list[X], "
        "dict[str, X], Literal[...] or X | None"
    )


def _check(value: Any, schema: JsonSchema, path: str) -> str | None:
    """Why ``value`` does not fit ``schema`` (type, enum, anyOf, items, mapping values),
    or None; keywords outside that subset are not checked."""
    if not _fits(value, schema):
        return f"argument '{path}' must be {_expected(schema)}, got {_describe(value)}"
    if "anyOf" in schema:
        return next((_check(value, s, path) for s in schema["anyOf"] if _fits(value, s)), None)
    items = schema.get("items")
    if _json_type(value) == "array" and isinstance(items, dict):
        for i, item in enumerate(value):
            if (problem := _check(item, items, f"{path}[{i}]")) is not None:
                return problem
    values = schema.get("additionalProperties")
    if _json_type(value) == "object" and isinstance(values, dict) and "properties" not in schema:
        for key, item in value.items():
            sub = f"{path}[{json.dumps(key, ensure_ascii=False, default=str)}]"
            if (problem := _check(item, values, sub)) is not None:
                return problem
    return None


def _fits(value: Any, schema: JsonSchema) -> bool:
    """The shallow check: type and enum (items of arrays and objects are checked by _check).
    A schema with neither (``$ref``, ``{}``) accepts anything."""
    if "anyOf" in schema:
        return any(_fits(value, s) for s in schema["anyOf"])
    if "enum" in schema:
        return any(_json_type(value) == _json_type(e) and value == e for e in schema["enum"])
    if "type" not in schema:
        return True
    kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    kind = _json_type(value)
    return kind in kinds or (kind == "integer" and "number" in kinds)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    for py, name in _SCALARS.items():  # bool before int: bool subclasses int
        if isinstance(value, py):
            return name
    if isinstance(value, (list, tuple)):
        return "array"
    # a Python type's own name could be a JSON one ("object"): keep them apart
    return "object" if isinstance(value, Mapping) else f"Python {type(value).__name__}"


def _expected(schema: JsonSchema) -> str:
    if "anyOf" in schema:
        return " or ".join(_expected(s) for s in schema["anyOf"])
    if "enum" in schema:
        return "one of " + ", ".join(json.dumps(e) for e in schema["enum"])
    kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    return " or ".join(_ARTICLES.get(k, f"a {k}") for k in kinds)


def _describe(value: Any) -> str:
    kind = _json_type(value)
    if kind == "null":
        return "null"
    try:
        text = json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        text = repr(value)
    except RecursionError:  # repr would recurse as deep
        return f"{kind} nested too deeply to show"
    return f"{kind} {text if len(text) <= 60 else text[:57] + '...'}"
