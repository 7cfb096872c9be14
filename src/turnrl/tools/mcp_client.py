"""MCP: the tools of a Model Context Protocol server, as turnrl tools.

``McpServer`` names a server, by URL (streamable HTTP) or by command (stdio: the client
starts the process and talks over its stdin/stdout), and how its tools are called
(timeout, concurrency, output limit: the same limits as any ``Tool``). ``connect``
opens a session and lists the server's tools; each becomes a ``Tool`` whose calls go to
the server and are recorded on the trajectory like any other call.

An episode gets its own session: ``ToolEnv(tools=server.toolset, ...)`` connects at
``reset`` and disconnects when the rollout closes the env, so a stateful server starts
each episode fresh and nothing outlives the event loop that opened it. A tool that
reports an error, a server that answers with a protocol error, and a server that dies
all become error observations; once the server is gone, later calls fail at once,
naming the reason and the last lines the server wrote to stderr (stdio).

The official ``mcp`` SDK is needed (``pip install 'turnrl[mcp]'``); it is imported when
a session opens, so the rest of turnrl does not depend on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from turnrl.errors import ConfigError, TurnrlError
from turnrl.tools.tool import Tool, ToolSet
from turnrl.types import Task


class McpError(TurnrlError):
    """The MCP server could not be reached, died, or a tool reported an error."""


@dataclass(frozen=True)
class McpServer:
    """Where an MCP server is and how its tools are called.

    ``target``: an ``http(s)://`` URL of a streamable-HTTP endpoint, or a command line
    (a list: program and arguments) started as a stdio server with ``env`` added to a
    minimal environment and ``cwd`` as its directory. ``prefix`` is put before every tool
    name (two servers with a ``search`` tool can coexist). ``include``: only these tools
    (None: all). ``timeout_s``, ``max_concurrency``, ``max_output_chars``: per tool, as
    in ``Tool``. ``connect_timeout_s`` bounds starting the session and listing tools.
    """

    target: str | Sequence[str]
    env: Mapping[str, str] | None = None
    cwd: str | None = None
    prefix: str = ""
    include: Sequence[str] | None = None
    timeout_s: float | None = 30.0
    max_concurrency: int | None = None
    max_output_chars: int = 4000
    connect_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if isinstance(self.target, str):
            if not self.target.startswith(("http://", "https://")):
                raise ConfigError(
                    f"MCP target {self.target!r}: give an http(s) URL, or a command as a "
                    "list of strings (stdio)"
                )
        elif not self.target or not all(isinstance(a, str) for a in self.target):
            raise ConfigError("MCP stdio target: a non-empty list of strings (program, args)")

    @property
    def label(self) -> str:
        """The URL, or the command with the program's directory left out."""
        if isinstance(self.target, str):
            return self.target
        program, *args = self.target
        return " ".join([os.path.basename(program), *args])

    async def connect(self) -> McpSession:
        """Open a session and list the tools; close it with ``await session.close()``.
        Raises ``McpError`` if the server cannot be started or reached in time."""
        session = McpSession(self)
        await session.start()
        return session

    async def toolset(self, task: Task | None = None, extra: Iterable[Tool] = ()) -> ToolSet:
        """A fresh session's tools (and ``extra`` local tools) as a ToolSet whose ``close``
        ends the session: pass ``server.toolset`` as a ``ToolEnv``'s ``tools``."""
        session = await self.connect()
        try:
            return ToolSet([*extra, *session.tools], on_close=[session.close])
        except Exception:
            await session.close()
            raise


@dataclass(eq=False)
class McpSession:
    """One open session with an MCP server (made by ``McpServer.connect``).

    The SDK's client lives in a task of its own, so the session can be opened and closed
    from different tasks and calls can come from any task of the same event loop.
    """

    server: McpServer
    tools: list[Tool] = field(default_factory=list)
    _client: Any = None
    _task: asyncio.Task[None] | None = None
    _ready: asyncio.Event = field(default_factory=asyncio.Event)
    _closing: asyncio.Event = field(default_factory=asyncio.Event)
    _gone: asyncio.Event = field(default_factory=asyncio.Event)
    _reason: str | None = None
    _stderr: IO[str] | None = None

    @property
    def alive(self) -> bool:
        return self._client is not None and not self._gone.is_set()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._hold(), name=f"mcp:{self.server.label}")
        try:
            await asyncio.wait_for(self._ready.wait(), self.server.connect_timeout_s)
        except asyncio.TimeoutError:
            await self.close()
            raise McpError(
                f"MCP server {self.server.label}: no session within "
                f"{self.server.connect_timeout_s:g}s{self._stderr_tail()}"
            ) from None
        if not self.alive:
            reason = self._reason
            await self.close()
            raise McpError(f"MCP server {self.server.label}: {reason}")

    async def close(self) -> None:
        """End the session (and the stdio server process); safe to call twice."""
        self._closing.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    async def call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """Call tool ``name`` on the server; its text, or ``McpError``."""
        if not self.alive:
            raise McpError(f"MCP server {self.server.label} is gone: {self._reason}")
        call = asyncio.ensure_future(self._client.call_tool(name, dict(arguments)))
        gone = asyncio.ensure_future(self._gone.wait())
        try:
            await asyncio.wait({call, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not call.done():
                call.cancel()
        if not call.done() or call.cancelled():
            raise McpError(f"MCP server {self.server.label} died during the call: {self._reason}")
        error = call.exception()
        if error is not None:
            if not self._gone.is_set() and _connection_lost(error):
                # The SDK keeps a dead connection open; end the session so later calls
                # fail at once and a stdio server's process is reaped.
                self._reason = f"connection lost ({_describe(error)}){self._stderr_tail()}"
                self._gone.set()
                self._closing.set()
            if self._gone.is_set():
                raise McpError(f"MCP server {self.server.label} is gone: {self._reason}")
            raise error
        result = call.result()
        text = _content_text(result)
        if getattr(result, "isError", getattr(result, "is_error", False)):
            raise McpError(text or "the tool reported an error")
        return text

    async def _hold(self) -> None:
        """Own the SDK client: enter it, list tools, wait for ``close``, exit it."""
        from mcp import Client, StdioServerParameters
        from mcp.client.stdio import stdio_client

        target: Any
        if isinstance(self.server.target, str):
            target = self.server.target
        else:
            program, *args = self.server.target
            params = StdioServerParameters(
                command=program, args=args, env=dict(self.server.env or {}), cwd=self.server.cwd
            )
            self._stderr = tempfile.TemporaryFile("w+", encoding="utf-8")  # noqa: SIM115
            target = stdio_client(params, errlog=self._stderr)
        try:
            async with Client(target) as client:
                self.tools = await self._list_tools(client)
                self._client = client
                self._ready.set()
                await self._closing.wait()
                if not self._gone.is_set():
                    self._reason = "the session was closed"
        except Exception as exc:  # a dead or unreachable server: recorded, never raised
            if not self._gone.is_set():
                self._reason = f"{_describe(exc)}{self._stderr_tail()}"
        finally:
            self._client = None
            self._gone.set()
            self._ready.set()

    async def _list_tools(self, client: Any) -> list[Tool]:
        listed: list[Any] = []
        cursor: str | None = None
        while True:
            page = await client.list_tools(cursor=cursor)
            listed.extend(page.tools)
            cursor = getattr(page, "next_cursor", getattr(page, "nextCursor", None))
            if not cursor:
                break
        include = set(self.server.include) if self.server.include is not None else None
        if include is not None and (missing := include - {t.name for t in listed}):
            raise McpError(f"tools {sorted(missing)} not offered by the server")
        return [self._tool(t) for t in listed if include is None or t.name in include]

    def _tool(self, spec: Any) -> Tool:
        name = spec.name

        async def call(**arguments: Any) -> str:
            return await self.call(name, arguments)

        schema = getattr(spec, "input_schema", None) or getattr(spec, "inputSchema", None)
        parameters = dict(schema or {"type": "object", "properties": {}})
        parameters.setdefault("properties", {})
        parameters.setdefault("required", [])
        return Tool(
            call,
            name=self.server.prefix + name,
            description=spec.description or "",
            parameters=parameters,
            timeout_s=self.server.timeout_s,
            max_concurrency=self.server.max_concurrency,
            max_output_chars=self.server.max_output_chars,
        )

    def _stderr_tail(self, lines: int = 3) -> str:
        if self._stderr is None or self._stderr.closed:
            return ""
        self._stderr.flush()
        self._stderr.seek(0)
        tail = [" ".join(s.split()) for s in self._stderr.read().splitlines() if s.strip()]
        tail = tail[-lines:]
        self._stderr.seek(0, 2)
        return "; server stderr: " + " | ".join(tail) if tail else ""


def _content_text(result: Any) -> str:
    """The text of a tool result: its text blocks, a placeholder per non-text block, or
    the structured content as JSON when there is no block."""
    parts: list[str] = []
    for block in getattr(result, "content", None) or []:
        text = getattr(block, "text", None)
        if isinstance(text, str):
            parts.append(text)
        else:
            kind = getattr(block, "type", type(block).__name__)
            mime = getattr(block, "mime_type", getattr(block, "mimeType", None))
            parts.append(f"[{kind} content{f' ({mime})' if mime else ''}]")
    structured = getattr(result, "structured_content", getattr(result, "structuredContent", None))
    if not parts and structured is not None:
        return json.dumps(structured, ensure_ascii=False, default=str)
    return "\n".join(parts)


_CONNECTION_CLOSED = -32000  # the JSON-RPC code the SDK uses for a closed connection


def _connection_lost(exc: BaseException) -> bool:
    """Whether a call failed because the connection is gone (not a server's answer)."""
    if getattr(exc, "code", None) == _CONNECTION_CLOSED:
        return True
    module = type(exc).__module__.split(".")[0]
    return isinstance(exc, OSError) or module in ("anyio", "httpx", "httpx2", "httpcore")


def _describe(exc: BaseException) -> str:
    """An exception in one line; exception groups (anyio task groups) by their leaves."""
    leaves = getattr(exc, "exceptions", None)  # BaseExceptionGroup (3.11+ builtin)
    if isinstance(leaves, tuple) and leaves:
        return "; ".join(_describe(e) for e in leaves)
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
