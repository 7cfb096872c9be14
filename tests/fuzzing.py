"""The fuzzer of tests/test_fuzz.py: random and adversarial inputs (hypothesis strategies)
for every parser, validator and loader of user text, each with its contract (``fuzz_targets``),
and ``fuzz_target``, which draws inputs, runs the check and counts the outcomes, keeping each
crash with the input that raised it."""

from __future__ import annotations

import functools
import inspect
import json
import keyword
import math
import re
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Optional, Union

import hypothesis
import hypothesis.strategies as st

from turnrl.errors import ConfigError, ToolDefinitionError
from turnrl.formats import FORMATS, get_format
from turnrl.jsonl import read_jsonl_lines
from turnrl.protocols import ParsedAction
from turnrl.tools import Tool
from turnrl.trainer.config import load_config
from turnrl.trainer.monitors import read_rows
from turnrl.trainer.sinks import RECORD_FILES, trim_run_files
from turnrl.types import ToolCall

MARKERS = [
    "<tool_call>", "</tool_call>", "<tool_response>", "<|python_tag|>", "[TOOL_CALLS]",
    "Thought:", "Action:", "Action Input:", "Observation:", "\nObservation:", "Final Answer:",
    "```", "```python", "```output", "````", "\\boxed{", "<search>", "</search>",
    "<answer>", "</answer>", "<information>", "</information>", '{"name": ', '"arguments": ',
    '"parameters": ', "{", "}", "[", "]", ",", ":", '"', "\\", "\n", " ", "\t", "\x00",
    "\ud800", "\u2028", "é", "😀", "null", "NaN", "Infinity", "-0", "1e999", "9" * 5000,
    "[" * 3000, "{\"a\":" * 2000, "python", "search", "lookup", "code",
]  # fmt: skip
"""Pieces of the call formats' syntax and of JSON, and adversarial ones: a lone surrogate,
NUL, a 5,000-digit number (past Python's int-string limit), nesting past the recursion
limit."""


def json_values(keys: st.SearchStrategy[str] | None = None) -> st.SearchStrategy[Any]:
    """JSON values (NaN and infinities included), nested."""
    scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.dictionaries(keys or st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=12,
    )


def json_text() -> st.SearchStrategy[str]:
    return json_values().map(lambda v: json.dumps(v, ensure_ascii=False))


def model_texts() -> st.SearchStrategy[str]:
    """A model turn: random text, or the formats' pieces, JSON and random text mixed."""
    piece = st.sampled_from(MARKERS) | json_text() | st.text(max_size=12)
    return st.text() | st.lists(piece, max_size=12).map("".join)


def call_texts(name: str) -> st.SearchStrategy[str]:
    """A well-formed call of format ``name`` (random tool name and arguments), then cut,
    spliced or left whole: the near misses a model writes."""
    fmt = get_format(name)

    def render(tool: str, arguments: dict[str, Any]) -> str:
        try:
            return fmt.render_call(ToolCall(tool, arguments))
        except ValueError:  # a call the format cannot write: its one tool's, then
            query = re.sub(r"[<>]", "", str(arguments))  # no tags inside a search query
            one = {"search_r1": ToolCall("search", {"query": query}),
                   "code": ToolCall("python", {"code": str(arguments)})}[name]  # fmt: skip
            return fmt.render_call(one)

    call = st.builds(
        render,
        st.sampled_from(["python", "search", "lookup", "x"]),
        st.dictionaries(st.sampled_from(["code", "query", "key", "x"]), json_values(), max_size=3),
    )

    def mutate(text: str, cut: int, insert: str) -> str:
        at = cut % (len(text) + 1)
        return text[:at] + insert + text[at:]

    return st.one_of(call, st.builds(mutate, call, st.integers(0, 10**6), model_texts()))


def parser_check(name: str) -> Callable[[str], None]:
    fmt = get_format(name)

    def check(text: str) -> None:
        parsed = fmt.parse(text)
        if not isinstance(parsed, ParsedAction):
            raise AssertionError(f"parse returned {type(parsed).__name__}")
        json.dumps([c.arguments for c in parsed.tool_calls], default=repr)

    return check


SCHEMA_TYPES = ["string", "integer", "number", "boolean", "null", "array", "object"]


def json_schemas() -> st.SearchStrategy[dict[str, Any]]:
    """Property schemas in the subset ``Tool.validate`` checks (type, enum, anyOf, items,
    additionalProperties) plus keywords it leaves to the tool."""
    leaf = st.one_of(
        st.builds(lambda t: {"type": t}, st.sampled_from(SCHEMA_TYPES)),
        st.builds(lambda t: {"type": t}, st.lists(st.sampled_from(SCHEMA_TYPES), min_size=1, max_size=3)),
        st.builds(lambda e: {"enum": e}, st.lists(json_values(), min_size=1, max_size=4)),
        st.just({}), st.just({"$ref": "#/defs/x"}), st.just({"type": "string", "pattern": "^a"}),
    )  # fmt: skip
    return st.recursive(
        leaf,
        lambda inner: st.one_of(
            st.builds(lambda s: {"type": "array", "items": s}, inner),
            st.builds(lambda s: {"type": "object", "additionalProperties": s}, inner),
            st.builds(lambda s: {"anyOf": s}, st.lists(inner, min_size=1, max_size=3)),
            st.builds(
                lambda p: {"type": "object", "properties": p},
                st.dictionaries(st.text(max_size=5), inner, max_size=3),
            ),
        ),
        max_leaves=6,
    )


class DeepList(list[Any]):
    """A list nested 5,000 deep (past the recursion limit), with a short repr (hypothesis
    prints its inputs)."""

    def __init__(self) -> None:
        super().__init__([functools.reduce(lambda inner, _: [inner], range(5000), [])])

    def __repr__(self) -> str:
        return "[[[...5,000 deep...]]]"


def python_values() -> st.SearchStrategy[Any]:
    """What a parser or an MCP client may hand a tool: JSON values, and Python values JSON
    lacks (tuples, sets, bytes, non-string keys, a deeply nested list)."""
    odd = st.one_of(
        st.binary(max_size=8), st.sets(st.integers(), max_size=3), st.complex_numbers(),
        st.just(object()), st.builds(DeepList),
    )  # fmt: skip
    scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | odd
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.lists(inner, max_size=3).map(tuple)
            | st.dictionaries(st.text(max_size=5) | st.integers(), inner, max_size=3)
        ),
        max_leaves=10,
    )


def validator_cases() -> st.SearchStrategy[tuple[Tool, Any]]:
    def make(props: dict[str, Any], required: list[str], more: bool) -> Tool:
        parameters = {"type": "object", "properties": props, "required": required,
                      "additionalProperties": more}  # fmt: skip
        return Tool(lambda **kw: None, name="t", description="", parameters=parameters)

    tools = st.builds(
        make, st.dictionaries(st.text(max_size=5), json_schemas(), max_size=4),
        st.lists(st.text(max_size=5), max_size=3), st.booleans(),
    )  # fmt: skip
    arguments = st.dictionaries(st.text(max_size=5), python_values(), max_size=4) | python_values()
    return st.tuples(tools, arguments)


def validator_check(case: tuple[Tool, Any]) -> None:
    found = case[0].validate(case[1])
    if found is not None and not isinstance(found, str):
        raise AssertionError(f"validate returned {type(found).__name__}")


class Opaque:
    """A class no schema knows."""


def annotations() -> st.SearchStrategy[Any]:
    """Annotations, supported or not: scalars, containers, Literal, unions, Optional, Any,
    strings (forward references, some not Python)."""
    base = st.sampled_from([str, int, float, bool, bytes, type(None), Any, object, Opaque,
                            list, dict, tuple, set, None])  # fmt: skip
    text = st.sampled_from(["int", "list[str]", "Undefined", "1 +", "", "lambda: 0", "str | None"])
    literals = st.lists(st.one_of(st.text(max_size=4), st.integers(), st.booleans(), st.floats(),
                                  st.none()), min_size=1, max_size=3)  # fmt: skip
    return text | st.recursive(  # a string only at the top: typing checks those inside
        base | literals.map(lambda v: Literal[tuple(v)]),  # type: ignore[misc]
        lambda inner: st.one_of(
            inner.map(lambda t: list[t]),  # type: ignore[valid-type]
            st.tuples(inner, inner).map(lambda kv: dict[kv[0], kv[1]]),  # type: ignore[misc]
            inner.map(lambda t: Optional[t]),  # noqa: UP045
            st.tuples(inner, inner).map(lambda ab: Union[ab[0], ab[1]]),  # noqa: UP007
            inner.map(lambda t: tuple[t, ...]),  # type: ignore[valid-type]
        ),
        max_leaves=4,
    )


PARAMETER_KINDS = list(inspect._ParameterKind)


def functions() -> st.SearchStrategy[Callable[..., Any]]:
    """Functions with random signatures (names, kinds, annotations, defaults), names and
    docstrings (Google-style ``Args:`` sections, or not)."""
    names = st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True).filter(
        lambda n: not keyword.iskeyword(n)
    )
    params = st.lists(
        st.tuples(names, st.sampled_from(PARAMETER_KINDS), st.booleans(), annotations(),
                  st.none() | st.integers() | st.text(max_size=4) | st.just(inspect.Parameter.empty)),
        max_size=4, unique_by=lambda p: p[0],
    )  # fmt: skip
    docs = st.none() | st.text() | st.lists(
        st.sampled_from(["Args:", "    x: the x", "  y (int): why", "Returns:", "", "**kw: more",
                         "Parameters:", "\tz:"]) | st.text(max_size=10), max_size=8,
    ).map("\n".join)  # fmt: skip

    def make(spec: list[Any], doc: str | None, name: str) -> Callable[..., Any]:
        order = sorted(spec, key=lambda p: p[1])  # a signature's kinds come in order
        parameters, seen_default = [], False
        for pname, kind, annotated, annotation, default in order:
            if kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
                default = inspect.Parameter.empty
            elif kind != inspect.Parameter.KEYWORD_ONLY and seen_default:
                default = default if default is not inspect.Parameter.empty else 0
            seen_default = seen_default or (
                default is not inspect.Parameter.empty and kind != inspect.Parameter.KEYWORD_ONLY
            )
            parameters.append(inspect.Parameter(
                pname, kind, default=default,
                annotation=annotation if annotated else inspect.Parameter.empty,
            ))  # fmt: skip

        def fn(*args: Any, **kwargs: Any) -> Any:
            return None

        fn.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        fn.__annotations__ = {p.name: p.annotation for p in parameters
                              if p.annotation is not inspect.Parameter.empty}  # fmt: skip
        fn.__doc__ = doc
        fn.__name__ = name
        fn.__qualname__ = name
        return fn

    return st.builds(make, params, docs, st.text(max_size=8) | names)


def schema_check(fn: Callable[..., Any]) -> None:
    built = Tool.from_function(fn)
    json.dumps(built.schema(), allow_nan=False)


CONFIG_KEYS = [
    "seed", "steps", "save_every", "max_minutes", "model.tiny.hidden_size",
    "model.tiny.echo_steps", "model.hidden_size", "model.precision", "env.name",
    "env.options", "env.num_tasks", "rollout.group_size",
    "rollout.prompts_per_step", "rollout.max_error_frac", "rollout.backend",
    "algorithm.preset", "algorithm.kl_coef", "algorithm.kl.coef", "algorithm.clip",
    "algorithm.loss_agg", "algorithm.advantage", "eval.every", "log.tensorboard",
    "monitor.window", "warmup.steps", "lora", "lora.rank", "model", "algorithm",
]  # fmt: skip
"""Keys of the config (and a few old names, sections and wrong ones) the fuzzer sets."""


def config_values() -> st.SearchStrategy[str]:
    """A ``--set`` value as typed: JSON, a bare word, a boolean in any case, or junk."""
    return st.one_of(
        json_text(), st.text(max_size=10), st.sampled_from(["TRUE", "false", "1e400", "9" * 5000,
        "[" * 3000, "nan", "-1", "0", "grpo", "vllm", "quickstart"]),
    )  # fmt: skip


def overrides() -> st.SearchStrategy[list[str]]:
    key = st.sampled_from(CONFIG_KEYS) | st.text(max_size=12)
    item = st.builds(lambda k, sep, v: f"{k}{sep}{v}", key, st.sampled_from(["=", "=", " = ", ""]),
                     config_values())  # fmt: skip
    return st.lists(item, max_size=4)


def overrides_check(items: list[str]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_config(None, items)


def toml_value(value: Any) -> str:
    """``value`` as TOML (a minimal writer: the fuzzer's own values only)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return (
            "nan"
            if value != value
            else "inf"
            if value == math.inf
            else "-inf"
            if value == -math.inf
            else repr(value)
        )
    if isinstance(value, (int, str)):
        return json.dumps(value) if isinstance(value, str) else str(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    return '""'  # None: TOML has no null


def recipes() -> st.SearchStrategy[bytes]:
    """A recipe file: TOML settings of known and unknown keys (with ``base``, sometimes
    itself), or TOML pieces mixed with junk bytes."""
    entry = st.builds(
        lambda k, v: f"{k} = {toml_value(v)}",
        st.sampled_from([*CONFIG_KEYS, "base"]) | st.text(max_size=6).map(json.dumps),
        json_values() | st.sampled_from(["quickstart", "grpo", "fuzz", "nope", "../x"]),
    )  # fmt: skip
    header = st.sampled_from(["[model]", "[algorithm]", "[algorithm.kl]", "[env]", "[[x]]", "["])
    lines = st.lists(entry | header | st.text(max_size=10), max_size=8).map("\n".join)
    return st.one_of(
        lines.map(str.encode),
        st.tuples(lines.map(str.encode), st.binary(max_size=10)).map(b"\n".join),
    )


def recipe_check(folder: Path) -> Callable[[tuple[bytes, list[str]]], None]:
    path = folder / "fuzz.toml"

    def check(case: tuple[bytes, list[str]]) -> None:
        path.write_bytes(case[0])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_config(str(path), case[1])

    return check


def jsonl_files() -> st.SearchStrategy[bytes]:
    """Run and data files: lines of JSON (rows with ``step`` of any type, other values,
    NaN), torn lines, blank lines, invalid UTF-8, nesting past the recursion limit, numbers
    past the int-string limit."""
    row = st.builds(lambda s, v: json.dumps({"step": s, "x": v}), json_values(), json_values())
    line = st.one_of(
        row, json_text(), st.text(max_size=20), st.just(""), st.just("[" * 5000),
        st.just("9" * 5000), st.just('{"step": 1, "x": NaN}'), st.just('{"step": 2'),
    ).map(str.encode) | st.binary(max_size=12)  # fmt: skip
    return st.builds(
        lambda lines, end: b"\n".join(lines) + end, st.lists(line, max_size=8),
        st.sampled_from([b"", b"\n"]),
    )  # fmt: skip


def file_check(folder: Path, read: Callable[[Path], Any]) -> Callable[[bytes], None]:
    def check(data: bytes) -> None:
        path = folder / "metrics.jsonl"
        path.write_bytes(data)
        read(path)

    return check


def trim_check(folder: Path) -> Callable[[tuple[bytes, int]], None]:
    def check(case: tuple[bytes, int]) -> None:
        for name in RECORD_FILES:
            (folder / name).write_bytes(case[0])
        trim_run_files(folder, case[1])

    return check


def fuzz_targets(
    folder: Path,
) -> dict[
    str, tuple[st.SearchStrategy[Any], Callable[[Any], None], tuple[type[BaseException], ...], str]
]:
    """name -> (inputs, check, the errors it may raise, what it is)."""
    targets: dict[str, Any] = {
        f"parser: {name}": (st.one_of(model_texts(), call_texts(name)), parser_check(name), (),
                            f"get_format({name!r}).parse: a ParsedAction, never an exception")
        for name in FORMATS
    }  # fmt: skip
    targets["tool argument validator"] = (
        validator_cases(),
        validator_check,
        (),
        "Tool.validate: None or the problem, never an exception",
    )
    targets["tool schema builder"] = (
        functions(),
        schema_check,
        (ToolDefinitionError,),
        "Tool.from_function: a Tool with a JSON schema, or ToolDefinitionError",
    )
    targets["config: --set overrides"] = (
        overrides(),
        overrides_check,
        (ConfigError,),
        "load_config(None, overrides): a Config or ConfigError",
    )
    targets["config: recipe files"] = (
        st.tuples(recipes(), overrides()),
        recipe_check(folder),
        (ConfigError,),
        "load_config(path.toml, overrides): a Config or ConfigError",
    )
    targets["jsonl: read_jsonl_lines"] = (
        jsonl_files(),
        file_check(folder, lambda p: list(read_jsonl_lines(p))),
        (ConfigError,),
        "turnrl.jsonl.read_jsonl_lines: values, or ConfigError naming file and line",
    )
    targets["run files: read_rows"] = (
        jsonl_files(),
        file_check(folder, read_rows),
        (),
        "monitors.read_rows: the readable rows (bad lines skipped), never an exception",
    )
    targets["run files: trim_run_files"] = (
        st.tuples(jsonl_files(), st.integers(-1, 5)),
        trim_check(folder),
        (),
        "sinks.trim_run_files (a resume): counts of dropped records, never an exception",
    )
    return targets


def fuzz_target(
    strategy: st.SearchStrategy[Any], check: Callable[[Any], None],
    allowed: tuple[type[BaseException], ...], examples: int, seed: int,
) -> dict[str, Any]:  # fmt: skip
    """Run ``check`` on ``examples`` inputs drawn from ``strategy`` (hypothesis, seeded);
    count the outcomes. An exception outside ``allowed`` (or an allowed one without a
    message) is a crash, kept with the input that raised it."""
    outcomes: Counter[str] = Counter()
    crashes: list[dict[str, str]] = []

    @hypothesis.seed(seed)
    @hypothesis.settings(
        max_examples=examples, database=None, deadline=None, phases=[hypothesis.Phase.generate],
        suppress_health_check=list(hypothesis.HealthCheck),
    )  # fmt: skip
    @hypothesis.given(strategy)
    def run(value: Any) -> None:
        try:
            check(value)
            outcomes["returned"] += 1
        except allowed as exc:
            outcomes[type(exc).__name__] += 1
            if not str(exc).strip():
                crashes.append(
                    {"error": f"{type(exc).__name__} without a message", "input": repr(value)[:300]}
                )
        except Exception as exc:
            outcomes[f"uncaught {type(exc).__name__}"] += 1
            if outcomes[f"uncaught {type(exc).__name__}"] <= 3:  # a few of each kind
                crashes.append({
                    "error": f"{type(exc).__name__}: {str(exc)[:200]}", "input": repr(value)[:300],
                    "where": traceback.format_exc(limit=-3)[-1200:],
                })  # fmt: skip

    t0 = time.perf_counter()
    run()
    return {
        "inputs": sum(outcomes.values()), "outcomes": dict(outcomes),
        "uncaught": sum(n for k, n in outcomes.items() if k.startswith("uncaught")),
        "crashes": crashes, "seed": seed, "wall_s": round(time.perf_counter() - t0, 1),
    }  # fmt: skip
