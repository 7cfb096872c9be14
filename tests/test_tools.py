"""Tools: schemas from signatures and docstrings, validation, limits, failures as data."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any, Literal, Optional

import pytest

from turnrl.errors import ToolDefinitionError
from turnrl.tools import Tool, ToolResult, ToolSet, tool
from turnrl.types import ToolCall, ToolCallRecord


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@tool
def lookup(key: str, limit: int = 3) -> str:
    """Look a key up in the table.

    Returns the stored value.

    Args:
        key: The key to find,
            exactly as stored.
        limit (int): At most this many results.

    Returns:
        The value.
    """
    return f"{key}:{limit}"


def test_schema_from_signature_and_docstring() -> None:
    assert lookup.schema() == {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a key up in the table.",
            "parameters": {
                "type": "object",
                "properties": {
                    "key": {"type": "string", "description": "The key to find, exactly as stored."},
                    "limit": {
                        "type": "integer",
                        "description": "At most this many results.",
                        "default": 3,
                    },
                },
                "required": ["key"],
                "additionalProperties": False,
            },
        },
    }
    assert lookup("a") == "a:3"  # the tool object still calls the plain function


def test_schema_for_container_literal_and_optional_types() -> None:
    def f(
        xs: list[int],
        m: dict[str, list[float]],
        mode: Literal["fast", "slow"],
        flag: bool,
        mixed: Literal[1, "a"],
        note: str | None = None,
        old: Optional[float] = 1.5,  # noqa: UP045 - the typing spelling must work too
    ) -> None:
        """Multi-line first
        paragraph."""

    t = Tool.from_function(f, name="g", description=None, timeout_s=None)
    params = t.parameters
    assert t.name == "g"
    assert t.description == "Multi-line first paragraph."
    assert params["required"] == ["xs", "m", "mode", "flag", "mixed"]
    props = params["properties"]
    assert props["xs"] == {"type": "array", "items": {"type": "integer"}}
    assert props["m"] == {
        "type": "object",
        "additionalProperties": {"type": "array", "items": {"type": "number"}},
    }
    assert props["mode"] == {"type": "string", "enum": ["fast", "slow"]}
    assert props["flag"] == {"type": "boolean"}
    assert props["mixed"] == {"enum": [1, "a"]}
    assert props["note"] == {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None}
    assert props["old"] == {"anyOf": [{"type": "number"}, {"type": "null"}], "default": 1.5}


def test_decorator_with_options_and_no_docstring() -> None:
    @tool(name="renamed", timeout_s=2, max_concurrency=3, max_output_chars=10)
    async def f() -> str:
        return "x"

    assert isinstance(f, Tool)
    assert (f.name, f.timeout_s, f.max_concurrency, f.max_output_chars) == ("renamed", 2, 3, 10)
    assert f.description == ""
    assert f.parameters["properties"] == {}


def _missing(x, y: int) -> None:
    pass


def _unsupported(x: tuple[int, int]) -> None:
    pass


def _union(x: int | str) -> None:
    pass


def _dict_int_keys(x: dict[int, str]) -> None:
    pass


def _varargs(*xs: int) -> None:
    pass


@pytest.mark.parametrize(
    ("fn", "fragment"),
    [
        (_missing, "_missing: parameter 'x' has no type annotation"),
        (_unsupported, "_unsupported: parameter 'x' has unsupported type"),
        (_union, "_union: parameter 'x' has unsupported type"),
        (_dict_int_keys, "_dict_int_keys: parameter 'x' has unsupported type"),
        (_varargs, "_varargs: parameter 'xs': *args"),
        (lambda: None, "tool name '<lambda>' must match"),
    ],
)
def test_definition_errors_name_function_and_parameter(fn: Any, fragment: str) -> None:
    with pytest.raises(ToolDefinitionError, match=re.escape(fragment)):
        Tool.from_function(fn)


def test_invalid_limits_are_definition_errors() -> None:
    with pytest.raises(ToolDefinitionError, match="timeout_s"):
        tool(timeout_s=0)(lookup.fn)
    with pytest.raises(ToolDefinitionError, match="max_concurrency"):
        tool(max_concurrency=0)(lookup.fn)


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        ({"key": 3}, "lookup: argument 'key' must be a string, got integer 3"),
        ({}, "lookup: missing required argument 'key'"),
        ({"key": "a", "x": 1}, "lookup: unknown argument 'x' (expected: key, limit)"),
        (
            {"key": "a", "limit": True},
            "lookup: argument 'limit' must be an integer, got boolean true",
        ),
        ({"key": "a", "limit": 2.5}, "lookup: argument 'limit' must be an integer, got number 2.5"),
        (
            {"key": None, "limit": "2"},
            "lookup: argument 'key' must be a string, got null; "
            "argument 'limit' must be an integer, got string \"2\"",
        ),
        ([1], "lookup: arguments must be an object, got array [1]"),
    ],
)
def test_validation_errors_do_not_call_the_function(arguments: Any, error: str) -> None:
    calls: list[str] = []

    @tool
    def lookup(key: str, limit: int = 3) -> str:
        calls.append(key)
        return key

    result = run(lookup.invoke(arguments))
    assert not result.ok
    assert result.error == error
    assert result.content == f"Error: {error}"
    assert calls == []


def test_nested_validation_and_number_accepts_integer() -> None:
    @tool
    def f(xs: list[float], m: dict[str, Literal["a", "b"]], o: list[int] | None = None) -> float:
        return sum(xs)

    assert run(f.invoke({"xs": [1, 2.5], "m": {"k": "a"}, "o": None})).content == "3.5"
    assert run(f.invoke({"xs": [1, "2"], "m": {}})).error == (
        "f: argument 'xs[1]' must be a number, got string \"2\""
    )
    assert run(f.invoke({"xs": [], "m": {"k": "c"}})).error == (
        'f: argument \'m["k"]\' must be one of "a", "b", got string "c"'
    )
    assert run(f.invoke({"xs": [], "m": {}, "o": [1, False]})).error == (
        "f: argument 'o[1]' must be an integer, got boolean false"
    )
    assert run(f.invoke({"xs": [], "m": {}, "o": "x"})).error == (
        "f: argument 'o' must be an array or null, got string \"x\""
    )


def test_sync_and_async_functions_and_return_conversion() -> None:
    @tool
    def sync_fn(n: int) -> dict[str, Any]:
        return {"n": n, "when": time.gmtime(0).tm_year, "obj": object}

    @tool
    async def async_fn(n: int) -> list[int]:
        await asyncio.sleep(0)
        return [n, n]

    r = run(sync_fn.invoke({"n": 1}))
    assert r.ok
    assert r.error is None
    assert not r.truncated
    assert r.content == '{"n": 1, "when": 1970, "obj": "<class \'object\'>"}'
    assert r.latency_s >= 0
    r = run(async_fn.invoke({"n": 2}))
    assert (r.content, r.ok, r.error, r.truncated) == ("[2, 2]", True, None, False)
    assert isinstance(r, ToolResult)


def test_exception_becomes_observation() -> None:
    @tool
    def boom(x: int) -> int:
        raise ValueError(f"bad x {x}")

    @tool
    async def own_timeout() -> None:
        raise TimeoutError

    r = run(boom.invoke({"x": 1}))
    assert (r.ok, r.error, r.content) == (
        False,
        "ValueError: bad x 1",
        "Error: ValueError: bad x 1",
    )
    # A TimeoutError the function raises itself is its exception, not the tool's timeout.
    assert run(own_timeout.invoke({})).error == "TimeoutError"


def test_timeout() -> None:
    @tool(timeout_s=0.2)
    async def slow() -> str:
        await asyncio.sleep(5)
        return "late"

    r = run(slow.invoke({}))
    assert not r.ok
    assert r.error == "slow: timed out after 0.2s"
    assert 0.15 < r.latency_s < 2


def test_cancellation_propagates() -> None:
    @tool
    async def slow() -> None:
        await asyncio.sleep(5)

    async def main() -> None:
        task = asyncio.create_task(slow.invoke({}))
        await asyncio.sleep(0.01)
        task.cancel()
        await task

    with pytest.raises(asyncio.CancelledError):
        run(main())


def test_truncation_marker() -> None:
    @tool(max_output_chars=10)
    def big() -> str:
        return "x" * 25

    r = run(big.invoke({}))
    assert r.ok
    assert r.truncated
    assert r.content == "x" * 10 + "\n...[truncated 15 chars]"
    assert not run(tool(max_output_chars=25)(big.fn).invoke({})).truncated


def _max_concurrent(limit: int | None) -> int:
    active = 0
    peak = 0

    @tool(max_concurrency=limit)
    async def work() -> None:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(0.02)
        active -= 1

    async def main() -> None:
        results = await asyncio.gather(*(work.invoke({}) for _ in range(6)))
        assert all(r.ok for r in results)

    run(main())
    run(main())  # a second event loop gets its own semaphore
    return peak


def test_concurrency_limit() -> None:
    assert _max_concurrent(2) == 2
    assert _max_concurrent(None) == 6


def test_toolset_runs_records_and_rejects_unknown_and_duplicates() -> None:
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    tools = ToolSet([lookup, add])
    assert tools.names == ("lookup", "add")
    assert len(tools) == 2
    assert [t.name for t in tools] == ["lookup", "add"]
    assert tools.get("add") is not None
    assert tools.get("nope") is None
    assert [s["function"]["name"] for s in tools.schemas()] == ["lookup", "add"]

    result, record = run(tools.run(ToolCall("add", {"a": 1, "b": 2})))
    assert result.content == "3"
    assert record == ToolCallRecord("add", {"a": 1, "b": 2}, result.latency_s, True, None)

    result, record = run(tools.run(ToolCall("nope", {"q": 1})))
    assert not result.ok
    assert result.error == "unknown tool 'nope'; available tools: lookup, add"
    assert (record.name, record.arguments, record.ok, record.error) == (
        "nope",
        {"q": 1},
        False,
        result.error,
    )

    with pytest.raises(ToolDefinitionError, match="duplicate tool name 'add'"):
        ToolSet([add, Tool.from_function(add)])
