"""The policy endpoint: an OpenAI-compatible HTTP front that existing agents call in training.

Every episode of an agent gets its own base URL, ``http://HOST:PORT/episodes/<id>/v1``
(the episode id in the path is the only coupling, so the agent may run in this process,
another one, or another machine). A ``POST .../chat/completions`` there becomes an
``AgentCall`` in that episode's inbox; the episode's environment (``turnrl.envs.agent``)
answers it with the policy's completion, sampled in the same continuous batch as every
other episode. ``POST /v1/chat/completions`` with the header ``X-Turnrl-Episode: <id>``
routes the same way.

``POST .../responses`` (the Responses API) is served as the chat completion it stands for
(``turnrl.envs.openai_api``), so both APIs reach the episode in the same form; the episode
keeps its responses, so a request may continue one by ``previous_response_id``. Either
API streams with ``stream: true``: the same completion, as server-sent events.

The server runs in its own thread with its own event loop, so it answers between training
steps too: a request for an episode that is over gets a 404 at once, never a hang. The
episodes live in the rollout's event loop; calls and replies cross over thread-safely.

Errors are OpenAI-shaped (``{"error": {"message", "type", "code"}}``): 400 for a request
the endpoint cannot serve (``n > 1``, malformed messages, a ``previous_response_id`` that
is not one of the episode's responses), 401 for a wrong API
key, 404 for an unknown or finished episode, 409 for a second call while one is in flight
in the same episode or a call the episode ended under, 504 when no reply came in time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any

from turnrl.envs.openai_api import (
    RequestError,
    chat_chunks,
    chat_request,
    check_responses_request,
    conversation,
    response_events,
    response_object,
    server_sent_events,
)

MAX_BODY = 16 << 20
"""Largest request body accepted, in bytes."""


class EndpointError(Exception):
    """A call the endpoint answers with an HTTP error (status and OpenAI-style message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class AgentCall:
    """One chat-completions request of an agent, waiting for its episode to answer it.

    ``body`` is the request's JSON, checked by ``check_request``. ``reply`` is settled by
    the episode with the response's JSON, or with an ``EndpointError``.
    """

    body: dict[str, Any]
    reply: concurrent.futures.Future[dict[str, Any]] = field(
        default_factory=concurrent.futures.Future
    )


class EpisodeInbox:
    """The calls of one episode, in the event loop that plays it.

    One call at a time: an agent waits for each reply before its next request (a second
    call while one is in flight is refused with 409, since a conversation has one head).
    """

    def __init__(self, episode_id: str, base_url: str, loop: asyncio.AbstractEventLoop) -> None:
        self.id = episode_id
        self.base_url = base_url
        self.loop = loop
        self.calls: asyncio.Queue[AgentCall] = asyncio.Queue()
        self.busy = False
        self.closed: str | None = None
        self.responses: dict[str, list[dict[str, Any]]] = {}
        """Each Responses-API response of the episode: the conversation it ended (chat
        messages, its output last), for a request naming it as ``previous_response_id``.
        Written and read by the server's thread only."""

    def deliver(self, call: AgentCall) -> None:
        """Take ``call`` (runs in the episode's loop, scheduled by the server thread)."""
        if self.closed is not None:
            call.reply.set_exception(
                EndpointError(409, f"episode {self.id} is over: {self.closed}")
            )
        elif self.busy:
            call.reply.set_exception(
                EndpointError(
                    409,
                    f"episode {self.id} already has a call in flight: an episode is one "
                    "conversation, so wait for each reply before the next request",
                )
            )
        else:
            self.busy = True
            self.calls.put_nowait(call)

    def answer(self, call: AgentCall, response: dict[str, Any]) -> None:
        self.busy = False
        if not call.reply.done():
            call.reply.set_result(response)

    def close(self, why: str) -> None:
        """Refuse this episode's waiting and future calls, saying ``why``."""
        self.closed = why
        while not self.calls.empty():
            waiting = self.calls.get_nowait()
            if not waiting.reply.done():
                waiting.reply.set_exception(EndpointError(409, f"episode {self.id} is over: {why}"))


class PolicyEndpoint:
    """The HTTP server (aiohttp, in a daemon thread) and the table of open episodes.

    ``host`` and ``port`` (0: a free port) say where it listens; agents on other machines
    need a ``host`` they can reach (e.g. ``0.0.0.0``), the name they reach it by in the
    base URLs (``advertise``, e.g. this machine's address), and an ``api_key``, which every
    request must carry as ``Authorization: Bearer <key>`` (None: no check, for loopback).
    ``reply_timeout_s`` bounds how long one request waits for its completion.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        api_key: str | None = None,
        advertise: str | None = None,
        model_name: str = "turnrl-policy",
        reply_timeout_s: float = 900.0,
        start_timeout_s: float = 30.0,
    ) -> None:
        self.host = host
        self.port = port
        self.api_key = api_key
        self.advertise = advertise
        self.model_name = model_name
        self.reply_timeout_s = reply_timeout_s
        self.start_timeout_s = start_timeout_s
        self._episodes: dict[str, EpisodeInbox] = {}
        self._lock = threading.Lock()
        self._count = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: Any = None

    @property
    def address(self) -> str:
        """``http://host:port`` of the running server (starts it if needed)."""
        self.start()
        host = self.advertise or ("127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host)
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        """Start serving (idempotent); raises if the server is not up within the deadline."""
        if self._thread is not None:
            return
        try:
            from aiohttp import web
        except ImportError as exc:  # pragma: no cover - aiohttp is in the lock
            raise ImportError(
                "the policy endpoint needs aiohttp: pip install 'turnrl[agents]'"
            ) from exc
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="turnrl-endpoint", daemon=True)
        thread.start()
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_post("/episodes/{episode}/v1/chat/completions", self._chat)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/episodes/{episode}/v1/responses", self._responses)
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_get("/episodes/{episode}/v1/models", self._models)
        app.router.add_get("/v1/models", self._models)

        async def serve() -> int:
            runner = web.AppRunner(app, access_log=None, handle_signals=False)
            await runner.setup()
            site = web.TCPSite(runner, self.host, self.port, reuse_address=True, backlog=4096)
            await site.start()
            self._runner = runner
            return int(runner.addresses[0][1])

        try:
            self.port = asyncio.run_coroutine_threadsafe(serve(), loop).result(self.start_timeout_s)
        except BaseException as exc:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(self.start_timeout_s)
            if not thread.is_alive():
                loop.close()
            raise RuntimeError(
                f"the policy endpoint did not start on {self.host}:{self.port} within "
                f"{self.start_timeout_s:g} s: {type(exc).__name__}: {exc}"
            ) from exc
        self._loop, self._thread = loop, thread

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop serving; open episodes are refused from then on."""
        loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None or thread is None:
            return
        if self._runner is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._runner.cleanup(), loop).result(timeout_s)
            except Exception as exc:  # the server is going away anyway: say so, go on
                print(f"turnrl: the policy endpoint did not shut down cleanly: {exc!r}")
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout_s)
        if not thread.is_alive():
            loop.close()
        self._runner = None

    def open_episode(self, loop: asyncio.AbstractEventLoop | None = None) -> EpisodeInbox:
        """A new episode's inbox, reachable at its ``base_url`` until ``close_episode``."""
        self.start()
        episode_id = f"{next(self._count)}-{secrets.token_hex(4)}"
        inbox = EpisodeInbox(
            episode_id,
            f"{self.address}/episodes/{episode_id}/v1",
            loop or asyncio.get_running_loop(),
        )
        with self._lock:
            self._episodes[episode_id] = inbox
        return inbox

    def close_episode(self, inbox: EpisodeInbox, why: str) -> None:
        with self._lock:
            self._episodes.pop(inbox.id, None)
        inbox.close(why)

    @property
    def open_episodes(self) -> int:
        with self._lock:
            return len(self._episodes)

    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        if (denied := self._denied(request)) is not None:
            return denied
        data = [{"id": self.model_name, "object": "model", "owned_by": "turnrl"}]
        return web.json_response({"object": "list", "data": data})

    async def _chat(self, request: Any) -> Any:
        if (denied := self._denied(request)) is not None:
            return denied
        try:
            body = await _json(request)
            check_request(body)
            inbox = self._inbox(request)
            completion = await self._ask(inbox, body)
        except EndpointError as exc:
            return _error(exc.status, exc.message)
        if not body.get("stream"):
            return _json_response(completion)
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunks = chat_chunks(completion, include_usage=usage)
        return await _stream(request, server_sent_events(chunks, named=False, done=True))

    async def _responses(self, request: Any) -> Any:
        if (denied := self._denied(request)) is not None:
            return denied
        try:
            body = await _json(request)
            try:
                check_responses_request(body)
            except RequestError as exc:
                raise EndpointError(400, str(exc)) from None
            inbox = self._inbox(request)
            earlier: list[dict[str, Any]] = []
            if body.get("previous_response_id") is not None:
                found = inbox.responses.get(body["previous_response_id"])
                if found is None:
                    raise EndpointError(
                        400,
                        f"previous_response_id {body['previous_response_id']!r} is not a "
                        f"response of episode {inbox.id} (responses live as long as their "
                        "episode)",
                    )
                earlier = found
            messages = conversation(body, earlier)
            chat = chat_request(body, messages)
            check_request(chat)
            completion = await self._ask(inbox, chat)
        except EndpointError as exc:
            return _error(exc.status, exc.message)
        response = response_object(completion, body)
        inbox.responses[response["id"]] = [*messages, completion["choices"][0]["message"]]
        if not body.get("stream"):
            return _json_response(response)
        events = response_events(response)
        return await _stream(request, server_sent_events(events, named=True, done=False))

    def _inbox(self, request: Any) -> EpisodeInbox:
        """The open episode a request names (in its path, or its X-Turnrl-Episode header)."""
        episode_id = request.match_info.get("episode") or request.headers.get("X-Turnrl-Episode")
        if not episode_id:
            raise EndpointError(
                404,
                "no episode in the request: use the base URL turnrl gave the agent "
                "(.../episodes/<id>/v1) or the header X-Turnrl-Episode",
            )
        with self._lock:
            inbox = self._episodes.get(episode_id)
        if inbox is None:
            raise EndpointError(
                404, f"no episode {episode_id!r} is open (it is over, or was never started)"
            )
        return inbox

    async def _ask(self, inbox: EpisodeInbox, body: dict[str, Any]) -> dict[str, Any]:
        """The episode's chat completion for the chat request ``body``."""
        call = AgentCall(body)
        try:
            inbox.loop.call_soon_threadsafe(inbox.deliver, call)
            return await asyncio.wait_for(asyncio.wrap_future(call.reply), self.reply_timeout_s)
        except asyncio.TimeoutError:
            raise EndpointError(
                504, f"the policy did not answer within {self.reply_timeout_s:g} s"
            ) from None
        except RuntimeError as exc:  # the episode's loop is gone (the run stopped)
            raise EndpointError(409, f"episode {inbox.id} is over: {exc}") from None

    def _denied(self, request: Any) -> Any:
        if self.api_key is None:
            return None
        if request.headers.get("Authorization", "") == f"Bearer {self.api_key}":
            return None
        return _error(401, "wrong or missing API key (Authorization: Bearer <key>)")


def check_request(body: Any) -> None:
    """Raise ``EndpointError(400, ...)`` for a chat request the training endpoint cannot
    serve."""
    if not isinstance(body, dict):
        raise EndpointError(400, "the request body must be a JSON object")
    if body.get("n", 1) not in (1, None):
        raise EndpointError(400, "n must be 1: each call is one turn of one episode")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise EndpointError(400, "'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise EndpointError(400, f"messages[{i}] must be an object with a string 'role'")
        content = m.get("content")
        text_parts = isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content
        )
        if not (content is None or isinstance(content, str) or text_parts):
            raise EndpointError(
                400, f"messages[{i}].content must be a string or a list of text parts"
            )
        calls = m.get("tool_calls")
        if calls is not None and not (
            isinstance(calls, list)
            and all(
                isinstance(c, dict)
                and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str)
                for c in calls
            )
        ):
            raise EndpointError(400, f"messages[{i}].tool_calls must be OpenAI tool calls")
    tools = body.get("tools")
    if tools is not None and not (
        isinstance(tools, list)
        and all(isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools)
    ):
        raise EndpointError(400, "'tools' must be a list of OpenAI function tools")
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise EndpointError(400, "'stop' must be a string or a list of strings")


async def _json(request: Any) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EndpointError(400, f"the request body is not JSON: {exc}") from None


def _json_response(payload: dict[str, Any]) -> Any:
    from aiohttp import web

    return web.json_response(payload)


async def _stream(request: Any, body: bytes) -> Any:
    """A ``text/event-stream`` response of the events in ``body`` (all sampled already)."""
    from aiohttp import web

    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    await response.write(body)
    await response.write_eof()
    return response


def _error(status: int, message: str) -> Any:
    from aiohttp import web

    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": status}}, status=status
    )
