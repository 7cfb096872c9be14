"""Train an agent that already exists: its model calls become the policy's turns.

The agent is ordinary code against an OpenAI-compatible client (``async def agent(task,
client)``, or any callable taking ``base_url`` and ``api_key``). ``AgentEnv`` turns one run
of it into one episode: ``reset`` starts the agent on the task and waits for its first
request to the policy endpoint (``turnrl.envs.endpoint``); each ``step`` answers the
pending request with the policy's completion (tool calls parsed by the model family's
format and returned as OpenAI ``tool_calls``) and waits for the agent's next request, whose
new messages (tool results, user turns) are the observation; when the agent returns, its
answer is scored by your ``reward(task, answer, transcript)`` and the episode ends.

Token-exactness (docs/design.md, invariant 1). The policy's turns are kept as the ids it sampled.
When a request extends the conversation the endpoint answered (the previous request's
messages, the reply, then new messages), only the new messages are rendered, after the
sampled ids: the usual case, one training sample. When the agent rewrote its history
(summarised, dropped, edited a message, changed its tools) the request starts a new
sample of the episode from its messages rendered afresh, counted as
``rollout/context_rewrites``; sampled text is never re-tokenized into a sample that
claims to continue it.

What the endpoint does not take from a request, on purpose: ``temperature``, ``top_p``,
``seed`` and ``max_tokens`` are the run's (``rollout.*``), since training needs the
completions sampled as the learner scores them; ``tool_choice`` is not enforced (the
policy decides whether to call, which is what RL trains). ``stop`` strings are honoured.

The model's mistakes are data. Frameworks report some of the model's mistakes by raising
(the Agents SDK's ``ModelBehaviorError`` for a call to a tool that does not exist, LangChain's
``OutputParserException``, ...). Such an exception, one of ``model_errors`` (``MODEL_ERRORS``
and the environment's own), ends the episode as a failure the policy is trained on: rewarded
by ``model_error_reward`` (0 by default), ``info["model_error"]`` naming it, counted in
``rollout/agent_model_errors``. Any other exception is a bug: an agent that raises, never
calls the endpoint, or hangs past ``rollout.episode_timeout_s`` ends its episode with
``error`` set and its traceback kept (and the run stops, unless ``rollout.max_error_frac``
allows it); when the exception comes from a framework, its message names ``model_errors``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hashlib
import inspect
import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from turnrl.envs.custom import Environment
from turnrl.envs.endpoint import AgentCall, EndpointError, EpisodeInbox, PolicyEndpoint
from turnrl.envs.http_transport import aiohttp_client
from turnrl.formats import default_format, get_format
from turnrl.formats.openai_message import assistant_text
from turnrl.protocols import Format, ToolSchema
from turnrl.rewards import Verdict
from turnrl.types import Message, StepResult, Task, ToolCallRecord, Turn

Agent = Callable[..., Any]
"""``(task, client) -> answer`` (async, with an ``openai.AsyncOpenAI``; or sync, with an
``openai.OpenAI``, run in a thread), or ``(task, *, base_url, api_key) -> answer``."""

Reward = Callable[[Any, Any, list[dict[str, Any]]], Any]
"""``(task, answer, transcript) -> float | bool | Verdict`` (sync or async): the agent's
task, its return value and the conversation as OpenAI messages, the last reply included."""

ModelErrors = Sequence[type[BaseException] | str]
"""Exception classes, or their qualified names (``"package.module.ClassName"``, matched
against every class the exception is an instance of, so the package need not be installed)."""

MODEL_ERRORS: tuple[str, ...] = (
    # OpenAI Agents SDK: a call to a tool the agent does not have, malformed arguments, ...
    "agents.exceptions.ModelBehaviorError",
    "agents.exceptions.MaxTurnsExceeded",  # the model never answered within max_turns
    # LangChain: the model's text does not parse as the output the chain asked for
    "langchain_core.exceptions.OutputParserException",
    "langgraph.errors.GraphRecursionError",  # the graph looped past its recursion_limit
    # PydanticAI: an unknown tool, output that fails validation after the retries
    "pydantic_ai.exceptions.UnexpectedModelBehavior",
    # smolagents' AgentError family, less AgentGenerationError (the model call itself
    # failed: the endpoint, not the model); AgentToolCallError and AgentToolExecutionError
    # are AgentExecutionErrors
    "smolagents.utils.AgentParsingError",
    "smolagents.utils.AgentExecutionError",
    "smolagents.utils.AgentMaxStepsError",
    # DSPy: the model's text does not parse as the signature's output fields (after the
    # JSON adapter's second try)
    "dspy.utils.exceptions.AdapterParseError",
)
"""The exceptions that agent frameworks raise for the model's own mistakes: an episode of
``AgentEnvironment`` that ends on one is a failed episode, trained on, not a bug."""

FRAMEWORKS = (
    "agents", "autogen_agentchat", "crewai", "dspy", "langchain", "langchain_core",
    "langgraph", "llama_index", "pydantic_ai", "smolagents",
)  # fmt: skip
"""Top-level packages of agent frameworks: a bug raised from one of them says how to count
it as the model's mistake instead (``model_errors``)."""


class AgentEnv:
    """One episode of ``agent`` on a task, its model calls answered by the policy.

    Made by ``AgentEnvironment.make_env``; see the module docstring for the protocol.
    """

    def __init__(
        self,
        agent: Agent,
        reward: Reward,
        endpoint: PolicyEndpoint,
        format: Format,
        *,
        pool: AgentPool | None = None,
        grace_s: float = 5.0,
        model_errors: ModelErrors = MODEL_ERRORS,
        model_error_reward: Reward | None = None,
    ) -> None:
        self.agent = agent
        self.reward = reward
        self.model_errors = tuple(model_errors)
        self.model_error_reward = model_error_reward
        self.endpoint = endpoint
        self.format = format
        self.pool = pool or AgentPool(endpoint)
        self.grace_s = grace_s
        self._kind = agent_kind(agent)
        self.task: Task | None = None
        self.inbox: EpisodeInbox | None = None
        self._agent: asyncio.Future[Any] | None = None
        self._call: AgentCall | None = None
        self._tools: list[ToolSchema] = []
        self._stops: tuple[str, ...] = ()
        self._known: list[str] = []  # keys of the conversation the last reply extended
        self._sampled: dict[str, str] = {}  # reply message key -> the text the policy wrote
        self._call_names: dict[str, str] = {}  # tool call id -> tool name
        self._turn: Turn | None = None
        self._turns = 0
        self._transcript: list[dict[str, Any]] = []
        self._entered = False

    # -- the Env protocol ------------------------------------------------------------------

    def tool_schemas(self) -> list[ToolSchema]:
        return list(self._tools) if self.format.template_tools else []

    def stop_strings(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*self.format.stop_strings, *self._stops)))

    async def reset(self, task: Task, seed: int) -> list[Message]:
        self.task = task
        await self.pool.enter()  # a bounded number of agents run at once
        self._entered = True
        self.inbox = self.endpoint.open_episode(asyncio.get_running_loop())
        self._agent = asyncio.ensure_future(self._run_agent(task, self.inbox.base_url))
        call = await self._next_call()
        if call is None:
            self._raise_agent_failure("before its first request to the endpoint")
            raise RuntimeError(
                f"the agent returned {self._agent.result()!r} without ever calling the policy "
                f"endpoint (its base_url was {self.inbox.base_url}); an agent must get its "
                "answer from the model it is trained as"
            )
        return self._take(call)

    def observe_turn(self, turn: Turn) -> None:
        """The policy's sampled turn (ids and log-probs), just before ``step``."""
        self._turn = turn

    async def step(self, action: str) -> StepResult:
        if self._call is None or self.inbox is None:
            raise RuntimeError("step() called with no request of the agent to answer")
        message, calls = self._reply_message(action)
        self._sampled[_key(message)] = action
        self._known.append(_key(message))
        self._transcript.append(message)
        self.inbox.answer(self._call, self._response(message, calls))
        self._call = None
        self._turns += 1
        answered = time.monotonic()
        call = await self._next_call()
        if call is None:
            return await self._finish(calls)
        latency = time.monotonic() - answered
        results = {
            str(m.get("tool_call_id")) for m in call.body["messages"] if m.get("role") == "tool"
        }
        records = [
            ToolCallRecord(
                c["function"]["name"],
                _arguments(c["function"]["arguments"]),
                latency,
                c["id"] in results,
                None if c["id"] in results else "the agent sent no result for this call",
            )
            for c in calls
        ]
        rewritten = not self._extends(call.body)
        observation = self._take(call)
        info = {"tool_calls": records}
        if rewritten:
            return StepResult(context=tuple(observation), info=info)
        return StepResult(observation=tuple(observation), info=info)

    async def close(self) -> None:
        """End the episode: refuse the agent's waiting and later calls, stop the agent."""
        if self.inbox is not None:
            why = "the episode ended (a turn or token limit, or the run's deadline)"
            if self._call is not None and not self._call.reply.done():
                self._call.reply.set_exception(EndpointError(409, f"episode over: {why}"))
            self._call = None
            self.endpoint.close_episode(self.inbox, why)
        if self._agent is not None and not self._agent.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._agent), self.grace_s)
            except BaseException:  # it ignored the refusal or failed on it: stop it
                self._agent.cancel()
        if self._agent is not None and self._agent.done() and not self._agent.cancelled():
            self._agent.exception()  # retrieved: a failure after the end is not news
        if self._entered:
            self._entered = False
            await self.pool.leave()

    # -- the agent -------------------------------------------------------------------------

    async def _run_agent(self, task: Task, base_url: str) -> Any:
        given = task.metadata.get(AGENT_TASK, task)
        loop = asyncio.get_running_loop()
        key = self.pool.api_key()
        if self._kind == "base_url":
            if _is_async(self.agent):
                return await self.agent(given, base_url=base_url, api_key=key)
            call = functools.partial(self.agent, given, base_url=base_url, api_key=key)
            return await loop.run_in_executor(self.pool.executor, call)
        if self._kind == "async_client":
            return await self.agent(given, self.pool.async_client(base_url))
        client = self.pool.sync_client(base_url)
        return await loop.run_in_executor(self.pool.executor, self.agent, given, client)

    async def _next_call(self) -> AgentCall | None:
        """The agent's next request, or None when the agent has returned (or failed)."""
        assert self.inbox is not None
        assert self._agent is not None
        getter = asyncio.ensure_future(self.inbox.calls.get())
        await asyncio.wait({getter, self._agent}, return_when=asyncio.FIRST_COMPLETED)
        if getter.done():
            return getter.result()
        getter.cancel()
        return None

    def _raise_agent_failure(self, when: str) -> None:
        assert self._agent is not None
        if self._agent.cancelled():
            raise RuntimeError(f"the agent was cancelled {when}")
        exc = self._agent.exception()
        if exc is not None:
            if _looks_like_a_framework_error(exc):
                _add_note(
                    exc,
                    f"if {_class_names(exc)[0]} is the model's mistake rather than a bug, "
                    "list it in AgentEnvironment(model_errors=...): such an episode is then "
                    "a failed episode the policy learns from",
                )
            raise exc  # the agent's own traceback is the story

    async def _finish(self, calls: list[dict[str, Any]]) -> StepResult:
        """The agent returned (scored by ``reward``) or raised one of the model errors
        (a failed episode; the tool calls of the last reply, which the agent did not run,
        are recorded as failed with it); anything else it raised is raised here."""
        assert self._agent is not None
        assert self.task is not None
        error = None if self._agent.cancelled() else self._agent.exception()
        kind = None if error is None else model_error_type(error, self.model_errors)
        if self._agent.cancelled() or (error is not None and kind is None):
            self._raise_agent_failure("while the episode ran")
        given = self.task.metadata.get(AGENT_TASK, self.task)
        if error is None:
            verdict = await _score(self.reward, given, self._agent.result(), self._transcript)
        elif self.model_error_reward is not None:
            verdict = await _score(self.model_error_reward, given, error, self._transcript)
            verdict = Verdict(verdict.reward, success=False, components=verdict.components)
        else:
            verdict = Verdict(0.0, success=False)
        info: dict[str, Any] = {"success": verdict.success, "reward_components": verdict.components}
        if error is not None:
            info["model_error"] = {"type": kind, "message": _message(error)}
            info["tool_calls"] = [
                ToolCallRecord(
                    c["function"]["name"], _arguments(c["function"]["arguments"]), 0.0, False,
                    f"{kind}: {_message(error)}",
                )
                for c in calls
            ]  # fmt: skip
        return StepResult(reward=verdict.reward, terminated=True, info=info)

    # -- requests and replies --------------------------------------------------------------

    def _take(self, call: AgentCall) -> list[Message]:
        """Make ``call`` the one to answer; return the messages the policy reads next: the
        new ones after the known conversation, or (first call, rewrite) all of them."""
        body = call.body
        first = self._call is None and not self._known
        extends = not first and self._extends(body)
        self._call = call
        stop = body.get("stop") or ()
        self._stops = (stop,) if isinstance(stop, str) else tuple(stop)
        if first:  # the episode's tools are its first request's (the template has them)
            self._tools = list(body.get("tools") or [])
        messages = body["messages"]
        for m in messages:
            for c in m.get("tool_calls") or ():
                if isinstance(c.get("id"), str):
                    self._call_names.setdefault(c["id"], c["function"]["name"])
        self._transcript = [dict(m) for m in messages]
        new = messages[len(self._known) :] if extends else messages
        self._known = [_key(m) for m in messages]
        converted = [self._internal(m) for m in new]
        if extends:
            return converted
        return self._with_tool_prompt(converted)

    def _extends(self, body: Mapping[str, Any]) -> bool:
        messages = body["messages"]
        n = len(self._known)
        return len(messages) > n and [_key(m) for m in messages[:n]] == self._known

    def _with_tool_prompt(self, messages: list[Message]) -> list[Message]:
        """Formats whose template does not render tools get them in the system prompt, as
        ``ToolEnv`` does."""
        if self.format.template_tools or not self._tools:
            return messages
        prompt = self.format.system_prompt(self._tools)
        if messages and messages[0]["role"] == "system":
            head = {"role": "system", "content": f"{messages[0]['content']}\n\n{prompt}"}
            return [head, *messages[1:]]
        return [{"role": "system", "content": prompt}, *messages]

    def _internal(self, m: Mapping[str, Any]) -> Message:
        """An OpenAI message as the chat template reads it: the policy's own turns as the
        text it sampled; an agent-written assistant turn with its calls in the format."""
        role = str(m["role"])
        content = _text(m.get("content"))
        if role == "assistant":
            sampled = self._sampled.get(_key(m))
            text = sampled if sampled is not None else assistant_text(m, self.format)
            return {"role": "assistant", "content": text}
        if role == "tool":
            out: Message = {"role": "tool", "content": content}
            name = m.get("name") or self._call_names.get(str(m.get("tool_call_id")))
            if name:
                out["name"] = str(name)
            return out
        return {"role": "system" if role == "developer" else role, "content": content}

    def _reply_message(self, text: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The assistant message an OpenAI server would return for ``text``: parsed calls
        become ``tool_calls`` (content None); otherwise the text is the content."""
        parsed = self.format.parse(text)
        if parsed.errors or not parsed.tool_calls:
            return {"role": "assistant", "content": text}, []
        assert self.inbox is not None
        calls = []
        for i, call in enumerate(parsed.tool_calls):
            digest = hashlib.blake2b(f"{self.inbox.id}/{self._turns}/{i}".encode(), digest_size=8)
            call_id = digest.hexdigest()[:9]
            self._call_names[call_id] = call.name
            arguments = json.dumps(dict(call.arguments), ensure_ascii=False)
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": arguments},
                }
            )
        return {"role": "assistant", "content": None, "tool_calls": calls}, calls

    def _response(self, message: dict[str, Any], calls: list[dict[str, Any]]) -> dict[str, Any]:
        assert self.inbox is not None
        assert self._call is not None
        turn = self._turn
        completion = len(turn.completion_ids) if turn is not None else 0
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": "tool_calls" if calls else "stop",
            "logprobs": None,
        }
        if self._call.body.get("logprobs") and turn is not None:
            # vLLM's convention for tokens named by id (--return-tokens-as-token-ids)
            choice["logprobs"] = {
                "content": [
                    {"token": f"token_id:{i}", "logprob": lp, "bytes": None, "top_logprobs": []}
                    for i, lp in zip(turn.completion_ids, turn.completion_logprobs, strict=True)
                ]
            }
        return {
            "id": f"chatcmpl-{self.inbox.id}-{self._turns}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.endpoint.model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": 0,
                "completion_tokens": completion,
                "total_tokens": completion,
            },
        }


class AgentPool:
    """What the episodes of one environment share: a bound on the agents running at once,
    the threads of sync agents, and the HTTP clients (an openai client takes about 30 ms to
    build, too slow to make one per episode for thousands; each episode gets a view of a
    shared one with its own base URL). Async clients belong to one event loop: one per loop,
    closed when that loop's last episode ends."""

    def __init__(
        self, endpoint: PolicyEndpoint, *, max_concurrent: int = 256, max_threads: int = 256
    ) -> None:
        if max_concurrent < 1:
            raise ValueError("max_concurrent must be >= 1")
        self.endpoint = endpoint
        self.max_concurrent = max_concurrent
        self.executor = concurrent.futures.ThreadPoolExecutor(max_threads, "turnrl-agent")
        self._loops: dict[asyncio.AbstractEventLoop, _LoopShare] = {}
        self._sync: Any = None
        self._lock = threading.Lock()

    async def enter(self) -> None:
        share = self._share()
        share.users += 1
        await share.slots.acquire()

    async def leave(self) -> None:
        loop = asyncio.get_running_loop()
        share = self._loops[loop]
        share.slots.release()
        share.users -= 1
        if share.users == 0:
            del self._loops[loop]
            if share.client is not None:
                await _close_client(share.client)

    def async_client(self, base_url: str) -> Any:
        share = self._share()
        if share.client is None:
            share.client = async_openai_client(base_url, self.api_key())
        return share.client.with_options(base_url=base_url)

    def sync_client(self, base_url: str) -> Any:
        with self._lock:
            if self._sync is None:
                self._sync = _openai().OpenAI(
                    base_url=base_url, api_key=self.api_key(), max_retries=0
                )
        return self._sync.with_options(base_url=base_url)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self._sync is not None:
            self._sync.close()
            self._sync = None

    def _share(self) -> _LoopShare:
        loop = asyncio.get_running_loop()
        if loop not in self._loops:
            self._loops[loop] = _LoopShare(asyncio.Semaphore(self.max_concurrent))
        return self._loops[loop]

    def api_key(self) -> str:
        return self.endpoint.api_key or "turnrl"  # the SDK needs one even where none is checked


@dataclass
class _LoopShare:
    slots: asyncio.Semaphore
    users: int = 0
    client: Any = None


AGENT_TASK = "agent_task"
"""``Task.metadata`` key holding a task given as any object (the agent gets that object)."""


class AgentEnvironment(Environment):
    """An existing agent as an environment family: its tasks, a fresh ``AgentEnv`` per
    episode, one policy endpoint for all of them (started on first use).

    ``tasks`` (and ``test_tasks``): ``turnrl.Task`` objects, or any objects (each wrapped
    in a ``Task``; the agent and the reward get the object itself), or a function of
    (index, split). ``format``: the model family's call format (``hermes`` for the
    quick-start and Qwen-style templates, ``llama3_json``, ``mistral``); None, the
    default, is the run's (``Environment.format``). ``endpoint``: a
    ``PolicyEndpoint`` to serve on (default: loopback, a free port). ``demonstrate`` and
    ``corpus_text``: as for ``Environment`` (by default both are derived, the derived
    demonstration playing one call through the agent itself). At most ``max_concurrent``
    agents run at once (the rest wait their turn: the warm-up plays thousands of
    demonstrations); sync agents run on up to ``max_threads`` threads.
    """

    endpoint: PolicyEndpoint
    pool: AgentPool

    def __init__(
        self,
        agent: Agent,
        tasks: Sequence[Any] | Callable[[int, str], Task],
        reward: Reward,
        *,
        test_tasks: Sequence[Any] | Callable[[int, str], Task] | None = None,
        format: str | Format | None = None,
        endpoint: PolicyEndpoint | None = None,
        name: str = "agent",
        demonstrate: Callable[[Task, Any], list[str]] | None = None,
        corpus_text: Sequence[str] = (),
        max_concurrent: int = 256,
        max_threads: int = 256,
        model_errors: ModelErrors = (),
        model_error_reward: Reward | None = None,
    ) -> None:
        agent_kind(agent)  # a wrong signature fails here, before any episode
        if not callable(reward):
            raise TypeError(f"reward must be a function (task, answer, transcript), got {reward!r}")
        if model_error_reward is not None and not callable(model_error_reward):
            raise TypeError(
                "model_error_reward must be a function (task, exception, transcript), got "
                f"{model_error_reward!r}"
            )
        if isinstance(model_errors, (str, type)):
            model_errors = (model_errors,)
        for e in model_errors:
            if not (isinstance(e, str) or (isinstance(e, type) and issubclass(e, BaseException))):
                raise TypeError(
                    f"model_errors holds exception classes or qualified names, got {e!r}"
                )
        errors = (*MODEL_ERRORS, *model_errors)
        fmt = get_format(format) if isinstance(format, str) else format  # None: the run's
        served = endpoint or PolicyEndpoint()
        pool = AgentPool(served, max_concurrent=max_concurrent, max_threads=max_threads)

        def make() -> AgentEnv:
            return AgentEnv(
                agent, reward, served, fmt or default_format(), pool=pool, model_errors=errors,
                model_error_reward=model_error_reward,
            )  # fmt: skip

        super().__init__(
            tasks=as_tasks(tasks, "train"),
            env=make,
            test_tasks=None if test_tasks is None else as_tasks(test_tasks, "test"),
            name=name,
            demonstrate=demonstrate,
            corpus_text=tuple(corpus_text),
            format=fmt,
        )
        object.__setattr__(self, "endpoint", served)  # a frozen dataclass's fields are set
        object.__setattr__(self, "pool", pool)

    def close(self) -> None:
        """Stop the endpoint and the agents' shared clients and threads."""
        self.pool.close()
        self.endpoint.close()


def as_tasks(
    tasks: Sequence[Any] | Callable[[int, str], Any], split: str
) -> Sequence[Task] | Callable[[int, str], Task]:
    """``tasks`` as ``Task``s: any other object becomes ``Task(id, prompt=its text)``
    holding the object under ``metadata["agent_task"]``."""
    if callable(tasks):
        source = tasks
        return lambda index, sp: _as_task(source(index, sp), f"{sp}-{index}")
    if isinstance(tasks, (str, bytes)) or not isinstance(tasks, Sequence) or not tasks:
        raise TypeError("tasks must be a non-empty list (of Task or any objects) or a function")
    return [_as_task(t, f"{split}-{i}") for i, t in enumerate(tasks)]


def _as_task(obj: Any, task_id: str) -> Task:
    if isinstance(obj, Task):
        return obj
    text = obj if isinstance(obj, str) else json.dumps(obj, default=str)
    return Task(id=task_id, prompt=text, metadata={AGENT_TASK: obj})


def agent_kind(agent: Any) -> str:
    """How ``agent`` is called: ``async_client``, ``sync_client`` or ``base_url``."""
    if not callable(agent):
        raise TypeError(f"agent must be a function, got {agent!r}")
    try:
        params = inspect.signature(agent).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    if "base_url" in params:
        return "base_url"
    positional = [
        p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(positional) < 2 and not any(p.kind == p.VAR_POSITIONAL for p in params.values()):
        raise TypeError(
            "an agent is `async def agent(task, client)` (an openai.AsyncOpenAI), "
            "`def agent(task, client)` (an openai.OpenAI, run in a thread), or takes "
            f"`base_url=` and `api_key=` keywords; got {getattr(agent, '__name__', agent)!r}"
            f"{inspect.signature(agent) if params else ''}"
        )
    return "async_client" if _is_async(agent) else "sync_client"


def model_error_type(exc: BaseException, errors: ModelErrors) -> str | None:
    """The class name of ``exc`` when it is one of ``errors`` (a class it is an instance of,
    or the qualified name of one); else None. An agent's exception raised in a worker
    process (``AgentProcessError``) is matched by the names of the classes it had there."""
    names = _class_names(exc)
    for e in errors:
        if isinstance(e, str) and e in names:
            return names[0].rsplit(".", 1)[-1]
        if isinstance(e, type) and isinstance(exc, e):
            return type(exc).__name__
    return None


def _class_names(exc: BaseException) -> tuple[str, ...]:
    """``module.QualName`` of every class ``exc`` is an instance of, most derived first
    (for an exception from a worker process, the classes of the original there)."""
    remote = getattr(exc, "remote_types", None)
    if remote:
        return tuple(remote)
    return tuple(f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__)


def _message(exc: BaseException) -> str:
    """``str(exc)``; for an exception from a worker process (its whole traceback), the
    traceback's last line, which is the original's ``Type: message``."""
    text = str(exc)
    if getattr(exc, "remote_types", None):
        lines = [line for line in text.splitlines() if line.strip()]
        return lines[-1] if lines else text
    return text


def _looks_like_a_framework_error(exc: BaseException) -> bool:
    return _class_names(exc)[0].split(".", 1)[0] in FRAMEWORKS


def _add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` (Python 3.11), by hand on 3.10: the traceback and the
    episode's ``error`` show it."""
    notes = list(getattr(exc, "__notes__", ()))
    if note not in notes:
        exc.__notes__ = [*notes, note]  # type: ignore[attr-defined]


async def _score(
    reward: Reward, task: Any, answer: Any, transcript: list[dict[str, Any]]
) -> Verdict:
    """``reward``'s verdict (awaited when async; a number ``r`` is ``Verdict(r)``, a success
    when ``r >= 1``)."""
    verdict = reward(task, answer, list(transcript))
    if inspect.isawaitable(verdict):
        verdict = await verdict
    if isinstance(verdict, (bool, int, float)):
        verdict = Verdict(float(verdict), success=float(verdict) >= 1.0)
    if not isinstance(verdict, Verdict):
        raise TypeError(
            f"the reward function returned {type(verdict).__name__}; return a number or "
            "a turnrl.Verdict"
        )
    return verdict


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or (
        callable(fn) and inspect.iscoroutinefunction(type(fn).__call__)
    )


def _key(m: Mapping[str, Any]) -> str:
    """What makes two OpenAI messages the same turn of a conversation (None and "" content
    alike; call arguments compared as JSON values; SDK-only fields ignored)."""
    out: dict[str, Any] = {"role": m.get("role"), "content": _text(m.get("content"))}
    if m.get("tool_calls"):
        out["tool_calls"] = [
            [c["function"]["name"], _arguments(c["function"].get("arguments"))]
            for c in m["tool_calls"]
        ]
    if m.get("tool_call_id") is not None:
        out["tool_call_id"] = str(m["tool_call_id"])
    return json.dumps(out, sort_keys=True, default=str)


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)


def _arguments(raw: Any) -> dict[str, Any]:
    """A call's arguments as an object (a JSON string is parsed; what does not parse is
    kept whole under ``"_raw"``, so comparison and rendering still see it)."""
    if isinstance(raw, Mapping):
        return dict(raw)
    try:
        value = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError:
        return {"_raw": raw}
    return dict(value) if isinstance(value, dict) else {"_raw": raw}


def async_openai_client(base_url: str, api_key: str) -> Any:
    """The ``openai.AsyncOpenAI`` agents get: no retries (a failed call is the episode's
    story), sending through aiohttp (half the SDK's per-call cost, ``http_transport``)."""
    return _openai().AsyncOpenAI(
        base_url=base_url, api_key=api_key, max_retries=0, http_client=aiohttp_client()
    )


def _openai() -> Any:
    try:
        import openai
    except ImportError as exc:  # pragma: no cover - openai is in the lock
        raise ImportError("agents get an openai client: pip install 'turnrl[agents]'") from exc
    return openai


async def _close_client(client: Any) -> None:
    try:
        result = client.close()
        if inspect.isawaitable(result):
            await result
    except Exception:  # closing a finished client's pool: nothing to save
        return
