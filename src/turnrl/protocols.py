"""The seams between layers, as small structural protocols.

An environment, a backend, a task source and a tool-call format are each one protocol
here; implementations live in their own layers and tests use fakes of the same shape.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from turnrl.types import (
    Completion,
    GenerationRequest,
    Message,
    StepResult,
    Task,
    ToolCall,
    Turn,
)

T = TypeVar("T")

ToolSchema = dict[str, Any]
"""A tool's description in the OpenAI function format:
``{"type": "function", "function": {"name", "description", "parameters"}}``."""


@runtime_checkable
class Env(Protocol):
    """A multi-turn environment (async, because tools do I/O). One instance per episode.

    ``reset`` returns the opening messages; ``step`` takes the model's text for one turn.
    ``tool_schemas`` lists the tools for chat templates that render them (empty if none);
    ``stop_strings`` is text that ends a model turn (the call format's, often empty).
    An env holding resources (a sandbox, a server session) may also define ``async def
    close()``; the rollout calls it once when the episode ends, however it ends.
    """

    async def reset(self, task: Task, seed: int) -> list[Message]: ...

    async def step(self, action: str) -> StepResult: ...

    def tool_schemas(self) -> list[ToolSchema]: ...

    def stop_strings(self) -> tuple[str, ...]: ...


@runtime_checkable
class TaskSource(Protocol):
    """Tasks addressed by position, so a run's data position is one integer (resumable)."""

    def task(self, index: int, split: str = "train") -> Task: ...


@runtime_checkable
class Backend(Protocol):
    """A generation engine: a batch of requests in, one completion per request out.

    This is everything the trainer uses of an engine (``TorchBackend`` on CPU and small
    GPUs; ``ScriptedBackend``, a test double that emits chosen text):

    - ``policy_version``: the version of the weights it samples with, recorded on every
      turn; ``sync`` bumps it;
    - ``pad_id``: the token the learner pads batches with;
    - ``generate``: sample every request (token ids in, ids and log-probs out);
    - ``submit``: hand requests to a running continuous batch and get one future each,
      settled as soon as that request is done (None where the engine has no such batch:
      then ``generate``); ``quiet`` is the caller's "nothing left to submit" check;
    - ``run``: drive a rollout program (a coroutine of episodes) to completion;
    - ``sync``: after an optimizer step, take the learner's new weights (in place where
      the engine shares the model object), drop what the old weights computed (cached
      keys and values), and bump ``policy_version``;
    - ``turn_sync``: new weights to take between the turns of the batch ``run`` serves
      (``TurnSync``: partial rollouts); None, nothing wanted;
    - ``sleep_metrics``: what releasing its memory between batches cost since the last call
      (vLLM's sleep mode: ``perf/engine_sleep_s``, ``perf/engine_wake_s``); empty for an
      engine that never sleeps.
    """

    policy_version: int
    pad_id: int
    turn_sync: TurnSync | None

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]: ...

    def submit(
        self, requests: Sequence[GenerationRequest], quiet: Callable[[], bool] | None = None
    ) -> list[asyncio.Future[Completion]] | None: ...

    def run(self, program: Coroutine[Any, Any, T]) -> T: ...

    def sync(self, model: Any) -> None: ...

    def sleep_metrics(self) -> dict[str, float]: ...


@dataclass(frozen=True)
class TurnSync:
    """New weights taken mid-batch, between turns (``algorithm.partial_rollouts``): what an
    engine asks between decoding steps while it runs a batch (``Backend.turn_sync``).

    In asynchronous training the engine samples the next batch while the learner updates.
    Without partial rollouts the learner's new weights wait for that batch to end. With
    them the engine takes them as soon as it can without splitting a turn: it stops
    admitting requests, lets the completions it is decoding finish (each is one turn of one
    episode, sampled by one version from its first token to its last), calls ``apply``,
    then admits the requests that waited. The episodes in flight sample their next turns
    with the new weights, and each turn records the version that sampled it
    (``Completion.policy_version``). The trainer's pipeline sets it for the engine in its
    process (trainer/pipeline.py), a rollout worker for its own
    (distributed/rollout_workers.py). The engine asks ``wanted`` at each decoding step, so
    it must be cheap, and calls ``apply`` on its own thread."""

    wanted: Callable[[], bool]
    """True while newer weights are waiting for the engine."""
    apply: Callable[[], None]
    """Load them (and move the engine's ``policy_version`` on); called on the engine's
    thread, when no completion is being decoded."""


@dataclass(frozen=True)
class ParsedAction:
    """What a format found in one model turn.

    ``tool_calls`` to run, or an ``answer`` (final text), or ``errors``: precise messages
    that are shown to the model as an observation when the turn could not be understood.
    """

    tool_calls: tuple[ToolCall, ...] = ()
    answer: str | None = None
    errors: tuple[str, ...] = field(default_factory=tuple)


@runtime_checkable
class Format(Protocol):
    """How tools appear in the prompt, how calls are parsed, how results are shown.

    ``template_tools``: True if the tokenizer's chat template renders the tool list (the
    schemas are passed as ``tools=``); otherwise ``system_prompt`` returns the text.
    ``stop_strings``: text that ends a model turn, e.g. right after a call, so the model
    cannot go on to write the observation itself (empty for formats that need none).
    """

    name: str
    template_tools: bool
    stop_strings: tuple[str, ...]

    def system_prompt(self, tools: Sequence[ToolSchema]) -> str: ...

    def render_call(self, call: ToolCall) -> str: ...

    def parse(self, text: str) -> ParsedAction: ...

    def render_results(self, results: Sequence[tuple[ToolCall, str]]) -> list[Message]: ...


class ToolSchemas(Protocol):
    """An episode's tools, as an environment holds them after ``reset`` (a ``ToolSet``)."""

    def schemas(self) -> list[ToolSchema]: ...


# An environment's optional members, beyond ``Env``: read here, in one place, so that the
# layers above never probe an environment themselves. An environment without one is
# not wrong: its turns are plain text, its tools are known only to its own episodes, or it
# holds nothing to release.


def env_format(env: Env) -> Format | None:
    """The tool-call ``Format`` that parses ``env``'s turns (its ``format``: ``ToolEnv``,
    the games, the agent environments), or None where it has none (or holds something
    else under that name)."""
    fmt = getattr(env, "format", None)
    return fmt if isinstance(fmt, Format) else None


def env_tools(env: Env) -> ToolSchemas | None:
    """The tools ``env`` holds after ``reset`` with their full schemas (its ``tools``,
    whether or not its format puts them in the chat template), or None where it holds
    none it can show (no ``tools``, or one without ``schemas()``, such as a plain list of
    functions)."""
    tools = getattr(env, "tools", None)
    return tools if callable(getattr(tools, "schemas", None)) else None


def env_turn_observer(env: Env) -> Callable[[Turn], object] | None:
    """``env``'s ``observe_turn(turn)``, called with each sampled turn before ``step``
    (an agent environment keeps the turn's tokens), or None where it has none."""
    observe: Callable[[Turn], object] | None = getattr(env, "observe_turn", None)
    return observe


async def close_env(env: Env) -> None:
    """Let ``env`` release what it holds: its ``close()``, where it has one, awaited when
    it is a coroutine method."""
    close = getattr(env, "close", None)
    if close is not None:
        result = close()
        if inspect.isawaitable(result):
            await result
