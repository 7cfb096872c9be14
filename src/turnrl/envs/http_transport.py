"""An aiohttp transport under the openai SDK's HTTP client, for the agents turnrl runs.

The openai SDK sends every request through an httpx-style client (``httpx`` in openai 1-2,
``httpx2`` from 3). Its default transport (httpcore with h11) costs about 1.4 ms of CPU per
request on this project's 2-core machine, half of the SDK's whole per-call cost and more
than the policy endpoint spends serving the call (measured against a loopback server
answering a fixed tool call: 2.7 ms per ``chat.completions.create`` with the default
transport, 1.3 ms with this one; benchmarks/endpoint.py has the step times). The clients ``AgentPool``
gives to agents therefore carry this transport: the same requests, bytes and status codes,
sent over an ``aiohttp.ClientSession`` (already needed for the endpoint's server).

What it keeps of the SDK's contract: the request's connect and read timeouts (from the
request's ``timeout`` extension), and transport failures raised as the httpx module's own
``ConnectError``, ``ReadTimeout`` and ``ReadError``, so the SDK turns them into
``APIConnectionError`` / ``APITimeoutError`` as it does with its own transport. Bodies are
read whole, decompressed by aiohttp: the endpoint's streams (``stream: true``) are written
at once, when the turn is sampled, so reading them whole loses nothing.
"""

from __future__ import annotations

import asyncio
from types import ModuleType
from typing import Any

_HOP_BY_HOP = {"host", "content-length", "transfer-encoding", "connection"}
"""Request headers aiohttp writes itself."""
_DECODED = {"content-encoding", "content-length", "transfer-encoding"}
"""Response headers that no longer describe the body once aiohttp has decoded it."""


def openai_httpx() -> ModuleType:
    """The httpx-style module the installed openai SDK builds its clients on."""
    from openai import _base_client

    module = getattr(_base_client, "httpx2", None) or getattr(_base_client, "httpx", None)
    if not isinstance(module, ModuleType):  # pragma: no cover - a future SDK layout
        raise ImportError("cannot tell which HTTP client library the openai SDK uses")
    return module


def aiohttp_client(httpx: ModuleType | None = None) -> Any:
    """An ``AsyncClient`` of the openai SDK's httpx module that sends through aiohttp; give
    it to ``openai.AsyncOpenAI(http_client=...)``. Belongs to the event loop that first
    sends with it (aiohttp sessions are bound to one loop)."""
    httpx = httpx or openai_httpx()
    return httpx.AsyncClient(transport=_transport_class(httpx)(), timeout=None)


_CLASSES: dict[str, type] = {}


def _transport_class(httpx: ModuleType) -> type:
    """The transport class, subclassing ``httpx.AsyncBaseTransport`` of that module."""
    if httpx.__name__ in _CLASSES:
        return _CLASSES[httpx.__name__]

    class AiohttpTransport(httpx.AsyncBaseTransport):  # type: ignore[name-defined,misc]
        """``handle_async_request`` over one aiohttp session, opened on first use."""

        def __init__(self) -> None:
            self._session: Any = None

        async def handle_async_request(self, request: Any) -> Any:
            import aiohttp

            if self._session is None or self._session.closed:
                self._session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=0), cookie_jar=aiohttp.DummyCookieJar()
                )
            timeout = request.extensions.get("timeout") or {}
            limits = aiohttp.ClientTimeout(
                total=None, sock_connect=timeout.get("connect"), sock_read=timeout.get("read")
            )
            headers = [
                (k, v) for k, v in request.headers.multi_items() if k.lower() not in _HOP_BY_HOP
            ]
            body = await request.aread()
            try:
                async with self._session.request(
                    request.method, str(request.url), data=body or None, headers=headers,
                    timeout=limits, allow_redirects=False,
                ) as response:  # fmt: skip
                    content = await response.read()
                    status = response.status
                    kept = [
                        (k.decode("latin-1"), v.decode("latin-1"))
                        for k, v in response.raw_headers
                        if k.decode("latin-1").lower() not in _DECODED
                    ]
            except asyncio.TimeoutError as exc:
                raise httpx.ReadTimeout(f"timed out: {exc}", request=request) from exc
            except aiohttp.ClientConnectorError as exc:
                raise httpx.ConnectError(str(exc), request=request) from exc
            except aiohttp.ClientError as exc:
                raise httpx.ReadError(f"{type(exc).__name__}: {exc}", request=request) from exc
            return httpx.Response(status, headers=kept, content=content, request=request)

        async def aclose(self) -> None:
            if self._session is not None:
                await self._session.close()
                self._session = None

    _CLASSES[httpx.__name__] = AiohttpTransport
    return AiohttpTransport
