"""``from_verifiers``: an environment of the ``verifiers`` library (Prime Intellect's; its
classic API: a dataset, a parser, a rubric of weighted reward functions, ``SingleTurnEnv``
/ ``MultiTurnEnv`` / ``ToolEnv``) as a turnrl environment family (``EnvFamily``).

How each part maps (docs/verifiers.md has the user's view):

- tasks: rows of the env's dataset (the ``test`` and ``eval`` splits read its eval
  dataset, which verifiers falls back from to the train one), ``index`` modulo its length.
  The row's prompt and answer are the ``Task``'s; the rest of the row rides in
  ``metadata["verifiers_row"]`` and goes back to verifiers as the rollout's input.
- episodes: verifiers' own ``rollout`` runs in an asyncio task of its own, with a client
  that, instead of calling a model, hands each prompt to turnrl and waits for the model's
  text from ``step``. So every hook runs exactly as under verifiers: ``setup_state``,
  ``env_response`` (its tools), the stop conditions (``is_completed``), ``max_turns``,
  ``timeout_seconds``, the cleanup handlers.
- actions: where the env offers tools, the turnrl call format (hermes by default) parses
  the model's text into the assistant message's ``tool_calls``; a malformed call is an
  error observation, as in ``ToolEnv``, and verifiers never sees that turn. The text is
  always the message's content, for the env's parser to read.
- observations: the messages verifiers adds after the assistant turn; tool results are
  rendered by the format. Each prompt must extend the previous one (turnrl's rollout is
  token-exact); an env whose ``get_prompt_messages`` rewrites history fails the episode.
- reward: when the rollout ends, the rubric's ``score_rollout``: reward is its weighted sum;
  every function's score, weight-0 metrics included, is a reward component; success is a
  reward of at least the env's ``pass_threshold``.
- end flags: ``max_turns``, the timeout, an overlong prompt or the completion-token budget
  truncate (a single-turn env's one turn is its end, not a truncation); any other stop
  condition terminates. A ``vf.Error`` on the rollout's state (a stop_errors tool failure, a
  sandbox failure) raises, so the rollout records it as the trajectory's error.
- tool calls: one ``ToolCallRecord`` each. An env that runs tools through ``call_tool``
  (ToolEnv, StatefulToolEnv) gets an observing wrapper on that method (same arguments,
  result and exceptions) so each record says whether the call raised.

Not adapted: rubrics with group reward functions (they score a group of rollouts
together, an episode here is scored alone: ``from_verifiers`` refuses them); multimodal
content (turnrl is text-only: it fails the episode); token ids and seeds verifiers never
sees (turnrl samples; verifiers envs are not seeded, so a random game is only as
deterministic as the env makes it).

``verifiers`` imports numpy and openai when imported, so it is imported only inside the
functions here: ``import turnrl.envs`` stays free of it (``pip install 'turnrl[verifiers]'``).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import importlib
import json
import random
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

from turnrl.envs.policy import demonstration_corpus
from turnrl.errors import ConfigError
from turnrl.formats import error_observation, get_format
from turnrl.protocols import Format, ToolSchema
from turnrl.types import Message, StepResult, Task, ToolCall, ToolCallRecord

TRUNCATING_STOPS = frozenset(
    {"max_turns_reached", "timeout_reached", "prompt_too_long",
     "max_total_completion_tokens_reached"}
)  # fmt: skip
"""verifiers' stop conditions that are a limit (Gymnasium's truncation), not the task's end."""

MODEL_NAME = "turnrl"
"""The model name verifiers' state records (the model itself is turnrl's)."""

_WORD = re.compile(r"[A-Za-z0-9_]+")


def from_verifiers(
    vf_env: Any,
    *,
    format: str | Format = "hermes",
    name: str | None = None,
    env_args: Mapping[str, Any] | None = None,
) -> VerifiersFamily:
    """A turnrl environment family running ``vf_env``, a ``verifiers.Environment`` or the id
    of an installed verifiers environment (loaded by ``verifiers.load_environment`` with
    ``env_args``). ``format`` parses tool calls out of the model's text and renders the
    results (a name from ``turnrl.formats`` or a ``Format``); ``name`` defaults to the
    env's id, else its class name. As a config's environment:
    ``"turnrl.envs.verifiers_env:from_verifiers"`` with ``vf_env = "<env id>"``."""
    vf = _verifiers()
    if isinstance(vf_env, str):
        vf_env = vf.load_environment(vf_env, **dict(env_args or {}))
    elif env_args:
        raise ConfigError("from_verifiers: env_args are for an env id; this env is built")
    if not isinstance(vf_env, vf.Environment):
        raise TypeError(
            f"from_verifiers takes a verifiers Environment or an env id, not "
            f"{type(vf_env).__name__}"
        )
    if vf_env.rubric.has_group_rewards:
        raise ConfigError(
            f"from_verifiers: the rubric of {type(vf_env).__name__} has group reward "
            "functions (they score several rollouts together); turnrl scores each episode "
            "on its own, so they cannot be adapted"
        )
    _observe_tool_calls(vf_env)
    fmt = get_format(format) if isinstance(format, str) else format
    return VerifiersFamily(vf_env, fmt, name or vf_env.env_id or type(vf_env).__name__)


class VerifiersFamily:
    """A verifiers environment as a turnrl ``EnvFamily``; made by ``from_verifiers``."""

    def __init__(self, vf_env: Any, format: Format, name: str) -> None:
        self.vf_env = vf_env
        self.format = format
        self.name = name
        self._datasets: dict[str, Any] = {}

    def _rows(self, split: str) -> Any:
        """The ``datasets.Dataset`` a split reads, built by verifiers once."""
        which = "eval" if split in ("test", "eval") else "train"
        if which not in self._datasets:
            vf_env = self.vf_env
            built = vf_env.get_eval_dataset() if which == "eval" else vf_env.get_dataset()
            self._datasets[which] = built
        return self._datasets[which]

    @functools.cached_property
    def _answers(self) -> list[Any]:
        rows = self._rows("train")
        return [a for a in rows["answer"] if a is not None] if "answer" in rows.column_names else []

    def task(self, index: int, split: str = "train") -> Task:
        """Row ``index`` (modulo the dataset's length) of the train dataset, or of the eval
        dataset for the ``test`` and ``eval`` splits."""
        rows = self._rows(split)
        if len(rows) == 0:
            raise ConfigError(f"{self.name}: the verifiers dataset is empty")
        row = dict(rows[index % len(rows)])
        return Task(
            id=f"{split}-{index}",
            prompt=tuple(_message_from_row(m) for m in _as_messages(row["prompt"])),
            answer=row.get("answer"),
            metadata={
                "verifiers_row": {k: v for k, v in row.items() if k not in ("prompt", "answer")}
            },
        )

    def make_env(self) -> VerifiersEnv:
        return VerifiersEnv(self.vf_env, self.format)

    def tool_schemas(self, task: Task | None = None) -> list[ToolSchema]:
        """The env's tools as OpenAI schemas (a task's ``info["tool_defs"]`` first)."""
        info = dict(task.metadata.get("verifiers_row", {})).get("info") if task else None
        defs = info.get("tool_defs") if isinstance(info, Mapping) else None
        return [_schema(d) for d in (defs if defs is not None else self.vf_env.tool_defs or [])]

    def demonstration(self, task: Task, rng: random.Random) -> list[str]:
        """Format-only turns: where there are tools, a call to a random one with plausible
        arguments (words of the task's prompt, small numbers); then a random answer of the
        dataset, written the way the env's parser reads it (XML fields, a think block)."""
        turns: list[str] = []
        schemas = self.tool_schemas(task)
        if schemas:
            function = rng.choice(schemas)["function"]
            words = _WORD.findall(" ".join(str(m["content"]) for m in task.prompt)) or ["x"]
            arguments = _example(function.get("parameters", {}), rng, words)
            turns.append(self.format.render_call(ToolCall(function["name"], arguments)))
        answer = str(rng.choice(self._answers)) if self._answers else ""
        turns.append(_written(self.vf_env.parser, answer))
        return turns

    def corpus(self) -> list[str]:
        """Tokenizer text: the prompts and answers of the dataset (its first 2,000 rows),
        the tool schemas as the format shows them, and demonstrations."""
        rows = self._rows("train")
        lines: list[str] = []
        for k in range(min(len(rows), 2000)):
            row = rows[k]
            lines += [str(_message_from_row(m)["content"]) for m in _as_messages(row["prompt"])]
            if row.get("answer") is not None:
                lines.append(str(row["answer"]))
        schemas = self.tool_schemas()
        lines += [json.dumps(s, ensure_ascii=False) for s in schemas]
        if schemas and not self.format.template_tools:
            lines.append(self.format.system_prompt(schemas))
        return lines + demonstration_corpus(self, min(len(rows), 60))

    @property
    def reward_range(self) -> tuple[float, float]:
        """The weighted sum's range when each reward function returns a value in [0, 1], as
        verifiers' own do (weight-0 metrics do not count)."""
        weights = self.vf_env.rubric._get_reward_weights()  # a RubricGroup's, flattened
        return (sum(min(w, 0.0) for w in weights), sum(max(w, 0.0) for w in weights))


class VerifiersEnv:
    """One episode of a verifiers environment, driven by turnrl's rollout (see the module
    docstring). Made by ``VerifiersFamily.make_env``."""

    def __init__(self, vf_env: Any, format: Format) -> None:
        self.vf_env = vf_env
        self._format = format
        self._client: Any = None
        self._rollout: asyncio.Task[Any] | None = None
        self._prompt: list[Any] = []  # the conversation verifiers last sent to the model
        self._tools: list[ToolSchema] = []
        self._calls: dict[str, ToolCall] = {}  # this turn's calls, by the id verifiers sees
        self._outcomes: dict[str, tuple[float, str | None]] = {}
        self._turn = 0
        self._done = False

    @property
    def format(self) -> Format | None:
        """The call format, where the env has tools; without tools the model's text is
        passed to verifiers as it is, and there is no call syntax."""
        return self._format if self._tools or self.vf_env.tool_defs else None

    def stop_strings(self) -> tuple[str, ...]:
        return self._format.stop_strings if self._tools else ()

    def tool_schemas(self) -> list[ToolSchema]:
        return self._tools if self._format.template_tools else []

    async def reset(self, task: Task, seed: int) -> list[Message]:
        """Start verifiers' rollout of ``task`` and return the prompt it sends first
        (verifiers envs take no seed)."""
        await self.close()
        self._client = _bridge_client_class()()
        self._done, self._turn = False, 0
        row = dict(task.metadata.get("verifiers_row", {}))
        rollout_input = {**row, "prompt": [dict(m) for m in task.prompt]}
        if task.answer is not None:
            rollout_input["answer"] = task.answer
        self._rollout = asyncio.create_task(self._run(rollout_input))
        request = await self._next_request()
        if request is None:  # it ended before asking the model anything: step reports it
            return [dict(m) for m in task.prompt]
        prompt, tools = request
        self._prompt = prompt
        self._tools = [_schema(t) for t in tools or []]
        opening = [_message_from_vf(m) for m in prompt]
        if self._tools and not self._format.template_tools:
            _add_system_text(opening, self._format.system_prompt(self._tools))
        return opening

    async def step(self, action: str) -> StepResult:
        if self._rollout is None or self._done:
            raise RuntimeError("step() called before reset() or after the episode ended")
        if self._rollout.done():
            return await self._finish([])
        self._turn += 1
        calls: tuple[ToolCall, ...] = ()
        if self._tools:
            parsed = self._format.parse(action)
            if parsed.errors:  # shown to the model; verifiers never sees this turn
                return StepResult(
                    observation=tuple(error_observation(parsed.errors)),
                    info={"format_error": True},
                )
            calls = parsed.tool_calls
        self._calls = {f"call_{self._turn}_{k}": c for k, c in enumerate(calls)}
        self._outcomes = {}
        started = time.perf_counter()
        await self._client.replies.put(_response(action, self._calls))
        request = await self._next_request()
        ended = "not run: the verifiers rollout ended first" if request is None else None
        records = self._records(time.perf_counter() - started, ended)
        if request is None:
            return await self._finish(records)
        prompt, _tools = request
        observation = self._observation(prompt)
        self._prompt = prompt
        return StepResult(observation=tuple(observation), info={"tool_calls": records})

    async def close(self) -> None:
        """Cancel verifiers' rollout if it is still running (its cleanup handlers run)."""
        rollout, self._rollout = self._rollout, None
        if rollout is None:
            return
        if not rollout.done():
            rollout.cancel()
            await asyncio.wait({rollout})  # until its cleanup handlers ran
        if not rollout.cancelled():
            rollout.exception()  # seen: step reported it, or the episode ended before

    async def _run(self, rollout_input: dict[str, Any]) -> Any:
        _OUTCOMES.set(self._outcomes_sink)  # this task's context only
        return await self.vf_env.rollout(rollout_input, self._client, MODEL_NAME, {})

    def _outcomes_sink(self, call_id: str, latency_s: float, error: str | None) -> None:
        self._outcomes[call_id] = (latency_s, error)

    async def _next_request(self) -> tuple[list[Any], list[Any] | None] | None:
        """The next prompt verifiers sends the model, or None when its rollout ended."""
        assert self._rollout is not None
        request = asyncio.ensure_future(self._client.requests.get())
        await asyncio.wait({request, self._rollout}, return_when=asyncio.FIRST_COMPLETED)
        if request.done():
            result: tuple[list[Any], list[Any] | None] = request.result()
            return result
        request.cancel()
        return None

    def _observation(self, prompt: list[Any]) -> list[Message]:
        """The messages after the assistant turn, which must extend the previous prompt."""
        before = len(self._prompt)
        same = len(prompt) > before and all(
            a is b or a == b for a, b in zip(prompt[:before], self._prompt, strict=True)
        )
        if not same or getattr(prompt[before], "role", None) != "assistant":
            raise RuntimeError(
                f"{type(self.vf_env).__name__} rewrote the conversation (a non-linear "
                "get_prompt_messages); turnrl's rollout needs each prompt to extend the last"
            )
        return self._rendered(prompt[before + 1 :])

    def _rendered(self, messages: Sequence[Any]) -> list[Message]:
        """verifiers' messages as turnrl's: runs of tool results through the format."""
        out: list[Message] = []
        results: list[tuple[ToolCall, str]] = []
        for message in messages:
            if getattr(message, "role", None) == "tool":
                call = self._calls.get(str(message.tool_call_id), ToolCall("tool", {}))
                results.append((call, _text(message.content)))
                continue
            if results:
                out += self._format.render_results(results)
                results = []
            out.append(_message_from_vf(message))
        if results:
            out += self._format.render_results(results)
        return out

    def _records(self, elapsed_s: float, ended: str | None) -> list[ToolCallRecord]:
        """This turn's calls, with their outcomes where the observed ``call_tool`` saw them;
        ``ended`` is why calls did not run when the rollout stopped before running them."""
        observed = getattr(getattr(self.vf_env, "call_tool", None), "turnrl_observed", False)
        records: list[ToolCallRecord] = []
        for call_id, call in self._calls.items():
            args = dict(call.arguments)
            if call_id in self._outcomes:
                latency, error = self._outcomes[call_id]
                records.append(ToolCallRecord(call.name, args, latency, error is None, error))
            elif observed or ended:
                error = ended or "not run by the verifiers environment"
                records.append(ToolCallRecord(call.name, args, 0.0, False, error))
            else:  # the env runs calls its own way: it answered, that is all turnrl knows
                records.append(ToolCallRecord(call.name, args, elapsed_s, True, None))
        return records

    async def _finish(self, records: list[ToolCallRecord]) -> StepResult:
        """Score the ended rollout as verifiers does and report the end of the episode."""
        assert self._rollout is not None
        self._done = True
        state = self._rollout.result()  # an exception of the env's code propagates
        if state.get("error") is not None:
            raise RuntimeError(f"verifiers rollout failed: {state['error']!r}")
        rubric = self.vf_env.rubric
        if self.vf_env.score_rollouts:
            await rubric.score_rollout(state)
        else:
            await rubric.dummy_score_rollout(state)
        await rubric.cleanup(state)
        stop = state.get("stop_condition")
        truncated = stop in TRUNCATING_STOPS and not (
            stop == "max_turns_reached" and getattr(self.vf_env, "max_turns", None) == 1
        )
        reward = float(state["reward"] or 0.0)
        info: dict[str, Any] = {
            "success": not truncated and reward >= self.vf_env.pass_threshold,
            "reward_components": {str(k): float(v) for k, v in (state["metrics"] or {}).items()},
            "stop_condition": stop,
            "tool_calls": records,
        }
        if truncated:
            info["truncated_reason"] = stop
        final = state.get("final_env_response")
        observation = self._rendered(final) if final else []
        return StepResult(
            observation=tuple(observation), reward=reward, terminated=not truncated,
            truncated=truncated, info=info,
        )  # fmt: skip


_OUTCOMES: contextvars.ContextVar[Any] = contextvars.ContextVar("turnrl_vf_outcomes", default=None)
"""In an episode's rollout task: where the observed ``call_tool`` reports each outcome."""


def _observe_tool_calls(vf_env: Any) -> None:
    """Wrap ``vf_env.call_tool`` (if it has one) so each call's latency and exception reach
    the episode that made it; arguments, result and exceptions pass through unchanged."""
    call_tool = getattr(vf_env, "call_tool", None)
    if call_tool is None or getattr(call_tool, "turnrl_observed", False):
        return

    @functools.wraps(call_tool)
    async def observed(*args: Any, **kwargs: Any) -> Any:
        sink = _OUTCOMES.get()
        call_id = kwargs.get("tool_call_id", args[2] if len(args) > 2 else None)
        start = time.perf_counter()
        try:
            result = await call_tool(*args, **kwargs)
        except Exception as exc:
            if sink is not None:
                sink(str(call_id), time.perf_counter() - start, f"{type(exc).__name__}: {exc}")
            raise
        if sink is not None:
            sink(str(call_id), time.perf_counter() - start, None)
        return result

    observed.turnrl_observed = True  # type: ignore[attr-defined]
    vf_env.call_tool = observed


def _verifiers() -> Any:
    try:
        return importlib.import_module("verifiers")
    except ImportError as exc:
        raise ConfigError(
            f"from_verifiers needs the verifiers package: pip install 'turnrl[verifiers]' ({exc})"
        ) from exc


@functools.cache
def _bridge_client_class() -> type[Any]:
    """A ``verifiers.Client`` that calls no model: it puts each request where
    ``VerifiersEnv`` reads it and answers with the response ``step`` gives it."""
    base: Any = _verifiers().Client

    class BridgeClient(base):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(None)
            self.requests: asyncio.Queue[tuple[list[Any], list[Any] | None]] = asyncio.Queue()
            self.replies: asyncio.Queue[Any] = asyncio.Queue()

        async def get_response(self, prompt: Any, model: str, sampling_args: Any,
                               tools: Any = None, **kwargs: Any) -> Any:  # fmt: skip
            await self.requests.put((list(prompt), tools))
            return await self.replies.get()

        # The abstract methods of a client that talks to a provider: none is used.
        def setup_client(self, config: Any) -> None:
            return None

        async def to_native_tool(self, tool: Any) -> Any:
            return tool

        async def to_native_prompt(self, messages: Any) -> tuple[Any, dict[str, Any]]:
            return messages, {}

        async def get_native_response(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError("the turnrl bridge answers get_response itself")

        async def raise_from_native_response(self, response: Any) -> None:
            return None

        async def from_native_response(self, response: Any) -> Any:
            return response

        async def close(self) -> None:
            return None

    return BridgeClient


def _response(text: str, calls: Mapping[str, ToolCall]) -> Any:
    """The model's turn as a ``verifiers.types.Response``."""
    types = importlib.import_module("verifiers.types")
    tool_calls = [
        types.ToolCall(id=call_id, name=c.name, arguments=json.dumps(dict(c.arguments)))
        for call_id, c in calls.items()
    ]
    message = types.ResponseMessage(
        content=text, tool_calls=tool_calls or None, is_truncated=False,
        finish_reason="tool_calls" if tool_calls else "stop",
    )  # fmt: skip
    return types.Response(id="turnrl", created=int(time.time()), model=MODEL_NAME, message=message)


def _schema(tool_def: Any) -> ToolSchema:
    """A ``verifiers.Tool`` (or its dict) as an OpenAI function schema."""
    get = tool_def.get if isinstance(tool_def, Mapping) else functools.partial(getattr, tool_def)
    return {
        "type": "function",
        "function": {
            "name": str(get("name")),
            "description": str(get("description") or ""),
            "parameters": dict(get("parameters") or {"type": "object", "properties": {}}),
        },
    }


def _as_messages(prompt: Any) -> list[Any]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def _message_from_row(message: Mapping[str, Any]) -> Message:
    """A dataset row's message (Arrow adds None for the keys other messages have)."""
    return {"role": str(message["role"]), "content": _text(message.get("content"))}


def _message_from_vf(message: Any) -> Message:
    role = str(getattr(message, "role", "user"))
    return {"role": "user" if role == "text" else role, "content": _text(message.content)}


def _text(content: Any) -> str:
    """Message content as text; a part that is not text (an image) fails the episode."""
    if content is None or isinstance(content, str):
        return content or ""
    texts: list[str] = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else getattr(part, "type", None)
        text = part.get("text") if isinstance(part, Mapping) else getattr(part, "text", None)
        if kind != "text" or not isinstance(text, str):
            raise TypeError(f"turnrl's models read text; a {kind!r} content part cannot be shown")
        texts.append(text)
    return " ".join(texts)


def _add_system_text(messages: list[Message], text: str) -> None:
    if messages and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}
    else:
        messages.insert(0, {"role": "system", "content": text})


def _example(schema: Mapping[str, Any], rng: random.Random, words: Sequence[str]) -> Any:
    """A plausible value for a JSON schema: a word of the prompt for a string, a small
    number, an enum's member, an object of its required properties."""
    if "enum" in schema:
        return rng.choice(list(schema["enum"]))
    for key in ("anyOf", "oneOf"):
        options = [s for s in schema.get(key, []) if s.get("type") != "null"]
        if options:
            return _example(options[0], rng, words)
    kind = schema.get("type", "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if kind == "object":
        properties: Mapping[str, Any] = schema.get("properties", {})
        required = schema.get("required", list(properties))
        return {k: _example(properties.get(k, {}), rng, words) for k in required}
    if kind == "array":
        return [_example(schema.get("items", {}), rng, words)]
    if kind in ("integer", "number"):
        return rng.randint(0, 9)
    if kind == "boolean":
        return rng.random() < 0.5
    return rng.choice(list(words))


def _written(parser: Any, answer: str) -> str:
    """``answer`` as the env's parser expects a final turn: an ``XMLParser``'s fields (the
    answer in its answer field), after a think block for a ``ThinkParser``."""
    vf = _verifiers()
    if isinstance(parser, vf.XMLParser):
        fields = {f: (answer if f == parser.answer_field else "...") for f in parser.get_fields()}
        answer = parser.format(**fields)
    if isinstance(parser, vf.ThinkParser):
        answer = f"<think>\n...\n</think>\n{answer}"
    return answer
