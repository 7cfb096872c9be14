"""``ToolEnv``: the common environment shape: a task, some tools, a call format, a verifier.

Each model turn is parsed by the format. Tool calls run and their results come back as
the observation; a turn the format cannot parse comes back as a precise error observation
(the model reads it and may fix its call); a turn with no call is the final answer, which
the verifier scores, ending the episode. A tool that raises, times out or does not exist
is an observation too (DESIGN.md invariant 4).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from turnrl.formats import error_observation
from turnrl.protocols import Format, ToolSchema
from turnrl.rewards import Verdict
from turnrl.rewards.composite import CompositeReward, gold_calls
from turnrl.tools import ToolSet
from turnrl.types import Message, StepResult, Task, ToolCall, ToolCallRecord

Verifier = Callable[[Task, str], Verdict | Awaitable[Verdict]]


class ToolEnv:
    """A multi-turn tool-use episode. Make one instance per episode.

    ``tools`` is a ToolSet, or a function (sync or async) building one from the task (tools
    that close over per-task state; an MCP server's ``toolset``, which opens a session). ``max_tool_calls`` bounds calls per episode and
    ``max_calls_per_turn`` calls in one turn; a call beyond a budget gets an error
    observation instead of running (recorded with error ``"budget"``). The calls of one
    turn run concurrently; their results come back in the order they were made.
    ``close`` releases the tools' resources (the rollout calls it when the episode ends).
    ``reward``: a ``CompositeReward`` that shapes the verifier's outcome with a gated
    format term and a tool-call match against ``task.metadata["gold_calls"]``.
    """

    def __init__(
        self,
        tools: ToolSet | Callable[[Task], ToolSet | Awaitable[ToolSet]],
        format: Format,
        verifier: Verifier,
        *,
        system_prompt: str | None = None,
        max_tool_calls: int | None = None,
        max_calls_per_turn: int | None = None,
        reward: CompositeReward | None = None,
    ) -> None:
        self._tools_for = tools if callable(tools) else (lambda _task: tools)
        self.format = format
        self.verifier = verifier
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
        self.tools = await tools if inspect.isawaitable(tools) else tools
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
