"""``turnrl serve``: a local model behind a minimal OpenAI-compatible HTTP API.

Enough of the API for ``turnrl eval --endpoint`` and for other OpenAI clients to talk to a
checkpoint: ``GET /v1/models``, ``POST /v1/chat/completions`` (``messages``, ``tools``,
``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``; one choice) and ``POST
/v1/responses`` (the Responses API: ``instructions``, ``input`` messages and function-call
items, function ``tools``, ``max_output_tokens``, ``previous_response_id`` for the server's
last ``RESPONSES_KEPT`` responses), each with ``stream: true`` as server-sent events (sent
when the reply is sampled, carrying the same text). The Responses shapes are translated by
``turnrl.envs.openai_api``, as on the training endpoint. The conversation is rendered by
the checkpoint's own chat template (tools included) and sampled by the torch backend; the
reply's content is the raw text the model wrote, tool-call markup included (no
server-side tool parsing: the environment's call format parses it).

Requests are served one at a time (a lock around sampling): this is a correctness tool
for evaluation and tests, not a throughput server; use vLLM for that.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from turnrl.backends.torch_backend import TorchBackend
from turnrl.envs.openai_api import (
    chat_chunks,
    chat_request,
    check_responses_request,
    conversation,
    response_events,
    response_object,
    server_sent_events,
)
from turnrl.errors import TemplateError
from turnrl.models.loading import load_model, load_tokenizer, stop_token_ids
from turnrl.rollout.chat import ChatRenderer
from turnrl.types import GenerationRequest

MAX_BODY = 8 << 20
RESPONSES_KEPT = 1024
"""Responses a later request may continue by ``previous_response_id`` (the oldest go)."""


class ChatService:
    """Turns chat-completion requests into completions from one local model."""

    def __init__(self, model_path: str | Path, *, name: str | None = None) -> None:
        self.name = name or Path(model_path).name
        self.tokenizer = load_tokenizer(model_path)
        self.model = load_model(model_path)
        self.backend = TorchBackend(self.model, self.tokenizer, reuse_history=False)
        self.renderer = ChatRenderer(self.tokenizer)
        self.stops = stop_token_ids(self.tokenizer)
        self.context = int(getattr(self.model.config, "max_position_embeddings", 2048))
        self._lock = threading.Lock()
        self._responses: dict[str, list[dict[str, Any]]] = {}  # id -> its conversation

    def respond(self, body: Any) -> dict[str, Any]:
        """One Responses-API response; raises ``ValueError`` for a malformed request."""
        check_responses_request(body)  # its RequestError is a ValueError
        earlier: list[dict[str, Any]] = []
        if (previous := body.get("previous_response_id")) is not None:
            with self._lock:
                found = self._responses.get(previous)
            if found is None:
                raise ValueError(
                    f"previous_response_id {previous!r} is not one of this server's last "
                    f"{RESPONSES_KEPT} responses"
                )
            earlier = found
        messages = conversation(body, earlier)
        chat = chat_request(body, messages)
        for key in ("temperature", "top_p", "seed"):
            if body.get(key) is not None:
                chat[key] = body[key]
        if body.get("max_output_tokens") is not None:
            chat["max_tokens"] = body["max_output_tokens"]
        completion = self.complete(chat)
        response = response_object(completion, body)
        with self._lock:
            self._responses[response["id"]] = [*messages, completion["choices"][0]["message"]]
            while len(self._responses) > RESPONSES_KEPT:
                del self._responses[next(iter(self._responses))]
        return response

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """One chat completion; raises ``ValueError`` for a malformed request."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ValueError("each message needs a string 'role'")
            content = m.get("content", "")
            if not isinstance(content, str) and not (content is None and m.get("tool_calls")):
                raise ValueError("message 'content' must be a string")
        tools = body.get("tools") or ()
        stop = body.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 256)
        try:
            prompt = self.renderer.with_tools(tools).prompt(messages)
        except TemplateError as exc:
            raise ValueError(str(exc)) from None
        max_tokens = min(max_tokens, self.context - len(prompt))
        if max_tokens < 1:
            raise ValueError(
                f"the prompt ({len(prompt)} tokens) fills the context ({self.context})"
            )
        request = GenerationRequest(
            prompt_ids=prompt,
            max_new_tokens=max_tokens,
            temperature=float(body.get("temperature", 1.0)),
            top_p=float(body.get("top_p", 1.0)),
            seed=int(body.get("seed") or 0),
            stop_token_ids=self.stops,
            stop_strings=stop,
        )
        with self._lock:
            (completion,) = self.backend.generate_sync([request])
        ids = list(completion.token_ids)
        if ids and ids[-1] in self.stops:
            ids = ids[:-1]
        text = self.renderer.decode(ids)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.name,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": completion.finish_reason,
            }],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(completion.token_ids),
                "total_tokens": len(prompt) + len(completion.token_ids),
            },
        }  # fmt: skip


def make_server(
    service: ChatService, host: str = "127.0.0.1", port: int = 8000
) -> ThreadingHTTPServer:
    """An HTTP server for ``service`` (port 0: any free port; see ``server_address``)."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # quiet by default
            pass

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _stream(self, data: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str) -> None:
            self._send(status, {"error": {"message": message, "type": "invalid_request_error"}})

        def do_GET(self) -> None:
            if self.path.rstrip("/") in ("/v1/models", "/models"):
                self._send(200, {"object": "list", "data": [
                    {"id": service.name, "object": "model", "owned_by": "turnrl"}]})  # fmt: skip
            elif self.path.rstrip("/") in ("/health", "/v1/health"):
                self._send(200, {"status": "ok"})
            else:
                self._error(404, f"no route {self.path}")

        def do_POST(self) -> None:
            route = self.path.rstrip("/").removeprefix("/v1")
            if route not in ("/chat/completions", "/responses"):
                self._error(404, f"no route {self.path}")
                return
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                self._error(413, "request body too large")
                return
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
                if not isinstance(body, dict):
                    raise ValueError("the body must be a JSON object")
                if route == "/responses":
                    response = service.respond(body)
                    if not body.get("stream"):
                        self._send(200, response)
                        return
                    events = response_events(response)
                    self._stream(server_sent_events(events, named=True, done=False))
                    return
                completion = service.complete(body)
                if not body.get("stream"):
                    self._send(200, completion)
                    return
                usage = bool((body.get("stream_options") or {}).get("include_usage"))
                chunks = chat_chunks(completion, include_usage=usage)
                self._stream(server_sent_events(chunks, named=False, done=True))
            except (ValueError, TypeError) as exc:
                self._error(400, str(exc))
            except Exception as exc:  # the server stays up; the client learns why
                self._error(500, f"{type(exc).__name__}: {exc}")

    return ThreadingHTTPServer((host, port), Handler)


def serve(model_path: str | Path, *, host: str = "127.0.0.1", port: int = 8000,
          name: str | None = None) -> None:  # fmt: skip
    """Serve until interrupted; prints the base URL once ready."""
    service = ChatService(model_path, name=name)
    server = make_server(service, host, port)
    bound_host, bound_port = server.server_address[:2]
    print(f"turnrl: serving {service.name} at http://{bound_host!s}:{bound_port}/v1", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
