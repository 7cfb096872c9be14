"""The aiohttp transport under the openai SDK (turnrl.envs.http_transport): real aiohttp
servers on loopback, the real ``openai.AsyncOpenAI``. The SDK must see what its own
transport would give it: the response, its status and errors, compressed bodies decoded,
and its timeouts and connection failures as its own exception types."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

openai = pytest.importorskip("openai")
web = pytest.importorskip("aiohttp.web")

from turnrl.envs.http_transport import aiohttp_client  # noqa: E402

COMPLETION = {
    "id": "x", "object": "chat.completion", "created": 0, "model": "m",
    "choices": [{
        "index": 0, "finish_reason": "tool_calls",
        "message": {"role": "assistant", "content": "", "tool_calls": [{
            "id": "c1", "type": "function",
            "function": {"name": "lookup", "arguments": '{"key": "a"}'},
        }]},
    }],
}  # fmt: skip
Handler = Callable[[Any], Awaitable[Any]]


def serve_and_call(handler: Handler, call: Callable[[Any], Awaitable[Any]]) -> Any:
    """Start an aiohttp server answering every POST with ``handler``, run ``call(client)``
    with an ``AsyncOpenAI`` on the aiohttp transport, return what it returned."""

    async def main() -> Any:
        app = web.Application()
        seen: list[Any] = []

        async def recorded(request: Any) -> Any:
            seen.append((dict(request.headers), await request.json()))
            return await handler(request)

        app.router.add_post("/v1/chat/completions", recorded)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0,
            http_client=aiohttp_client(),
        )  # fmt: skip
        try:
            return await call(client), seen
        finally:
            await client.close()
            await runner.cleanup()

    return asyncio.run(main())


def create(client: Any, **kwargs: Any) -> Awaitable[Any]:
    return client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], **kwargs
    )


def test_a_completion_and_its_request_pass_through_unchanged() -> None:
    async def answer(request: Any) -> Any:
        return web.json_response(COMPLETION)

    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    result, seen = serve_and_call(answer, lambda c: create(c, tools=tools, temperature=0.5))
    call = result.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("lookup", {"key": "a"})
    headers, body = seen[0]
    assert headers["Authorization"] == "Bearer k"
    assert body["tools"] == tools
    assert body["temperature"] == 0.5


def test_a_compressed_body_is_decoded_once() -> None:
    async def gzipped(request: Any) -> Any:
        body = gzip.compress(json.dumps(COMPLETION).encode())
        return web.Response(
            body=body, headers={"Content-Encoding": "gzip", "Content-Type": "application/json"}
        )

    result, _ = serve_and_call(gzipped, create)
    assert result.choices[0].message.tool_calls[0].id == "c1"


def test_an_error_status_becomes_the_sdks_error_with_the_servers_message() -> None:
    async def refuse(request: Any) -> Any:
        return web.json_response({"error": {"message": "wrong key", "type": "auth"}}, status=401)

    with pytest.raises(openai.AuthenticationError, match="wrong key"):
        serve_and_call(refuse, create)


def test_a_slow_server_becomes_the_sdks_timeout() -> None:
    async def slow(request: Any) -> Any:
        await asyncio.sleep(2)
        return web.json_response(COMPLETION)

    with pytest.raises(openai.APITimeoutError):
        serve_and_call(slow, lambda c: create(c, timeout=0.3))


def test_a_closed_port_becomes_the_sdks_connection_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there

    async def main() -> None:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0,
            http_client=aiohttp_client(),
        )  # fmt: skip
        try:
            await create(client)
        finally:
            await client.close()

    with pytest.raises(openai.APIConnectionError):
        asyncio.run(main())
