"""``ToolEnv``: the common environment shape: a task, some tools, a call format, a verifier.

Each model turn is parsed by the format. Tool calls run and their results come back as
the observation; a turn the format cannot parse comes back as a precise error observation
(the model reads it and may fix its call); a turn with no call is the final answer, which
the verifier scores, ending the episode. A tool that raises, times out or does not exist
is an observation too (docs/design.md, invariant 4).

``toolset_from`` turns the tool shapes users already have (a ``ToolSet``, a list of typed
functions or ``Tool``s, OpenAI ``(schema, fn)`` pairs) into a ``ToolSet``; ``ToolEnv``
takes any of them, or a per-task factory returning one.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias, cast

from turnrl.errors import ToolDefinitionError
from turnrl.formats import default_format, error_observation, get_format
from turnrl.protocols import Format, ToolSchema
from turnrl.rewards import Verdict
from turnrl.rewards.composite import CompositeReward, gold_calls
from turnrl.tools import Tool, ToolSet
from turnrl.types import Message, StepResult, Task, ToolCall, ToolCallRecord

Verifier = Callable[[Task, str], Verdict | float | Awaitable[Verdict | float]]
"""(task, final answer) -> a ``Verdict``, or a plain number: its reward, a success when it
is at least 1 (full credit)."""

OpenAITool: TypeAlias = tuple[ToolSchema, Callable[..., Any]]
"""An OpenAI function schema (``{"type": "function", "function": {"name", "description",
"parameters"}}``) with the Python function that implements it."""

ToolItem: TypeAlias = Tool | Callable[..., Any] | OpenAITool
"""One entry of a tool list: a ``Tool``, a typed function (schema from its signature and
docstring, as ``@tool`` builds it) or an ``OpenAITool`` pair."""

ToolList: TypeAlias = ToolSet | list[ToolItem] | tuple[ToolItem, ...]

Tools: TypeAlias = ToolList | Callable[[Task], ToolList | Awaitable[ToolList]]
"""What ``ToolEnv`` accepts as ``tools``: a ``ToolList``, or a function of the task
(sync or async) returning one, called at every ``reset``."""

_ACCEPTED = (
    "a ToolSet; a list of typed functions, Tools or OpenAI (schema, fn) pairs; or a "
    "function of the task returning one of those"
)


class ToolEnv:
    """A multi-turn tool-use episode. Make one instance per episode.

    ``tools`` (see ``Tools``) is a ToolSet or a list of tools (typed functions, ``Tool``s,
    OpenAI ``(schema, fn)`` pairs, mixed freely), or a function (sync or async) building
    one from the task (tools that close over per-task state; an MCP server's ``toolset``,
    which opens a session). Anything else is a ``TypeError`` here, at construction; a
    list's bad entry (an untyped function, a malformed schema) is a ``ToolDefinitionError``
    (a ``TypeError`` too). ``max_tool_calls`` bounds calls per episode and
    ``max_calls_per_turn`` calls in one turn; a call beyond a budget gets an error
    observation instead of running (recorded with error ``"budget"``). The calls of one
    turn run concurrently; their results come back in the order they were made.
    ``close`` releases the tools' resources (the rollout calls it when the episode ends).
    ``reward``: a ``CompositeReward`` that shapes the verifier's outcome with a gated
    format term and a tool-call match against ``task.metadata["gold_calls"]``.

    ``format`` (a ``Format`` or its name) is how calls are written and parsed; None, the
    default, takes the run's: the call format of the model family being trained, which a
    ``turnrl.Environment`` hands to the episodes it builds (hermes outside a run).
    """

    def __init__(
        self,
        tools: Tools,
        verifier: Verifier,
        *,
        format: Format | str | None = None,
        system_prompt: str | None = None,
        max_tool_calls: int | None = None,
        max_calls_per_turn: int | None = None,
        reward: CompositeReward | None = None,
    ) -> None:
        self._tools_for = _tools_factory(tools)
        self.format = _format_of(format)
        self.verifier = _verifier_of(verifier)
        self.system_prompt = system_prompt
        self.max_tool_calls = max_tool_calls
        self.max_calls_per_turn = max_calls_per_turn
        self.reward = reward
        self.task: Task | None = None
        self.tools = ToolSet([])
        self.num_tool_calls = 0
        self.calls: list[ToolCall] = []
        self.format_errors = 0

    def stop_strings(self) -> tuple[str, ...]:
        return self.format.stop_strings

    def tool_schemas(self) -> list[ToolSchema]:
        return self.tools.schemas() if self.format.template_tools else []

    async def reset(self, task: Task, seed: int) -> list[Message]:
        self.task = task
        tools = self._tools_for(task)
        self.tools = toolset_from(await tools if inspect.isawaitable(tools) else tools)
        self.num_tool_calls = 0
        self.calls = []
        self.format_errors = 0
        system = self.system_prompt or ""
        if not self.format.template_tools and self.tools.names:
            system = "\n\n".join(
                s for s in (system, self.format.system_prompt(self.tools.schemas())) if s
            )
        head: list[Message] = [{"role": "system", "content": system}] if system else []
        return head + [dict(m) for m in task.prompt]

    async def step(self, action: str) -> StepResult:
        if self.task is None:
            raise RuntimeError("step() called before reset()")
        parsed = self.format.parse(action)
        if parsed.errors:
            self.format_errors += 1
            return StepResult(
                observation=tuple(error_observation(parsed.errors)), info={"format_error": True}
            )
        if parsed.tool_calls:
            self.calls += parsed.tool_calls
            return await self._run_calls(parsed.tool_calls)
        verdict = self.verifier(self.task, parsed.answer or "")
        if inspect.isawaitable(verdict):  # a verifier that runs something (swe's tests)
            verdict = await verdict
        if isinstance(verdict, (bool, int, float)):  # a plain score: full credit is success
            verdict = Verdict(float(verdict), success=float(verdict) >= 1.0)
        if not isinstance(verdict, Verdict):
            raise TypeError(
                f"the verifier returned {type(verdict).__name__}; return a turnrl.Verdict or "
                "a number (the reward)"
            )
        if self.reward is not None:
            verdict = self.reward.combine(
                verdict, calls=self.calls, format_errors=self.format_errors,
                gold=gold_calls(self.task.metadata),
            )  # fmt: skip
        info: dict[str, Any] = {"success": verdict.success, "reward_components": verdict.components}
        return StepResult(reward=verdict.reward, terminated=True, info=info)

    async def _run_calls(self, calls: tuple[ToolCall, ...]) -> StepResult:
        jobs: list[Awaitable[tuple[str, ToolCallRecord]]] = []
        for k, call in enumerate(calls):
            refusal = self._over_budget(k)
            jobs.append(self._refuse(call, refusal) if refusal else self._call(call))
            self.num_tool_calls += refusal is None  # a refused call does not spend budget
        done = await asyncio.gather(*jobs)
        observation = tuple(
            self.format.render_results(
                [(c, text) for c, (text, _) in zip(calls, done, strict=True)]
            )
        )
        return StepResult(observation=observation, info={"tool_calls": [r for _, r in done]})

    def _over_budget(self, index_in_turn: int) -> str | None:
        if self.max_tool_calls is not None and self.num_tool_calls >= self.max_tool_calls:
            return (
                f"Error: tool budget exhausted ({self.max_tool_calls} calls per episode); "
                "answer now."
            )
        if self.max_calls_per_turn is not None and index_in_turn >= self.max_calls_per_turn:
            return (
                f"Error: too many calls in one turn (at most {self.max_calls_per_turn}); "
                "this call did not run."
            )
        return None

    async def _call(self, call: ToolCall) -> tuple[str, ToolCallRecord]:
        result, record = await self.tools.run(call)
        return (result.content if result.ok else f"Error: {result.error}"), record

    @staticmethod
    async def _refuse(call: ToolCall, text: str) -> tuple[str, ToolCallRecord]:
        return text, ToolCallRecord(call.name, dict(call.arguments), 0.0, False, "budget")

    async def close(self) -> None:
        """Release the episode's tools (sandboxes, sessions); safe to call twice."""
        await self.tools.close()


def _format_of(format: object) -> Format:
    if format is None:
        return default_format()
    if isinstance(format, str):
        return get_format(format)
    if isinstance(format, Format):
        return format
    raise TypeError(
        f"format must be a turnrl Format, a format's name or None (the run's), got "
        f"{type(format).__name__}; ToolEnv's arguments are (tools, verifier, *, format=...)"
    )


def _verifier_of(verifier: object) -> Verifier:
    if isinstance(verifier, Format):  # the old ToolEnv(tools, format, verifier) order
        raise TypeError(
            "ToolEnv(tools, verifier, *, format=None): the second argument is the verifier; "
            "the call format is the keyword format= (left out, the run's model family's)"
        )
    if not callable(verifier):
        raise TypeError(
            f"verifier must be a function (task, answer) -> reward, got {type(verifier).__name__}"
        )
    return cast(Verifier, verifier)


def toolset_from(tools: ToolList) -> ToolSet:
    """``tools`` as a ``ToolSet``: a ToolSet as it is; a list (or tuple) of typed functions,
    ``Tool``s and OpenAI ``(schema, fn)`` pairs, each made a ``Tool``. Raises ``TypeError``
    for anything else, ``ToolDefinitionError`` for a bad entry (both say what is wrong)."""
    if isinstance(tools, ToolSet):
        return tools
    if isinstance(tools, Tool):
        raise _single_tool(tools)
    if _is_pair(tools):
        raise TypeError("tools: got one (schema, fn) pair; pass a list of pairs: [(schema, fn)]")
    if not isinstance(tools, (list, tuple)):
        raise TypeError(f"tools must be {_ACCEPTED}; got {type(tools).__name__}")
    return ToolSet([_tool_from(item, k) for k, item in enumerate(tools)])


def _tools_factory(tools: Tools) -> Callable[[Task], ToolList | Awaitable[ToolList]]:
    """The per-task tool factory ``ToolEnv.reset`` calls; a fixed list becomes a ToolSet
    now, so a bad list fails at construction rather than in every episode."""
    if isinstance(tools, Tool):
        raise _single_tool(tools)
    if isinstance(tools, (ToolSet, list, tuple)):
        fixed = toolset_from(tools)
        return lambda _task: fixed
    if not callable(tools):
        raise TypeError(f"tools must be {_ACCEPTED}; got {type(tools).__name__}")
    name = getattr(tools, "__qualname__", type(tools).__name__)
    try:
        inspect.signature(tools).bind(None)
    except TypeError:
        raise TypeError(
            f"tools: {name} is neither a list nor a factory taking the task (one argument); "
            f"for a single tool pass a list: [{name}]"
        ) from None
    except ValueError:  # no signature to read (some builtins): trust the caller
        return tools
    try:
        Tool.from_function(tools)
    except ToolDefinitionError:  # not a tool's signature (untyped, or a Task): a factory
        return tools
    raise TypeError(
        f"tools: {name} looks like a tool (its argument is typed for the model), not a "
        f"factory of the task; pass a list: [{name}]"
    )


def _single_tool(tool: Tool) -> TypeError:
    return TypeError(f"tools: got a single Tool {tool.name!r}; pass a list: [{tool.name}]")


def _is_pair(item: object) -> bool:
    return (
        isinstance(item, tuple)
        and len(item) == 2
        and isinstance(item[0], dict)
        and callable(item[1])
    )


def _tool_from(item: object, index: int) -> Tool:
    if isinstance(item, Tool):
        return item
    if _is_pair(item):
        schema, fn = cast(OpenAITool, item)
        return _openai_tool(schema, fn, index)
    if isinstance(item, dict):
        raise TypeError(
            f"tools[{index}]: an OpenAI schema needs its implementation: pass (schema, fn)"
        )
    if isinstance(item, ToolSet) or not callable(item):
        raise TypeError(
            f"tools[{index}]: expected a typed function, a Tool or an OpenAI (schema, fn) "
            f"pair; got {type(item).__name__}"
        )
    return Tool.from_function(item)


def _openai_tool(schema: dict[str, Any], fn: Callable[..., Any], index: int) -> Tool:
    """A ``Tool`` with ``schema``'s name, description and parameters that runs ``fn``."""
    function = schema.get("function")
    if schema.get("type") != "function" or not isinstance(function, dict):
        raise ToolDefinitionError(
            f"tools[{index}]: an OpenAI tool schema is "
            '{"type": "function", "function": {"name", "description", "parameters"}}; '
            f"got keys {sorted(schema)}"
        )
    name = function.get("name")
    if not isinstance(name, str):
        raise ToolDefinitionError(f'tools[{index}]: the schema\'s "function" has no "name"')
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise ToolDefinitionError(f"tools[{index}] {name}: parameters must be a JSON schema object")
    _check_arguments(fn, parameters, f"tools[{index}] {name}")
    description = str(function.get("description", ""))
    return Tool(fn, name=name, description=description, parameters=parameters)


def _check_arguments(fn: Callable[..., Any], parameters: dict[str, Any], where: str) -> None:
    """The schema's properties are arguments ``fn`` takes, and ``fn``'s required arguments
    are in the schema: otherwise every call would fail with a TypeError."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read: the calls will tell
        return
    params = signature.parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    properties = set(parameters.get("properties", {}))
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    needed = {p.name for p in params if p.default is p.empty and p.name in named}
    if extra := sorted(properties - named):
        raise ToolDefinitionError(f"{where}: the function takes no argument(s) {extra}")
    if missing := sorted(needed - properties):
        raise ToolDefinitionError(f"{where}: the schema lacks required argument(s) {missing}")
