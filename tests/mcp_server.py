"""A real MCP server, written with the official ``mcp`` SDK, that the MCP tests and
``benchmarks/tools.py`` start as a process:

    python tests/mcp_server.py stdio
    python tests/mcp_server.py http PORT      # streamable HTTP at http://127.0.0.1:PORT/mcp

Its tools cover the cases a client must survive: plain results, a tool error, a slow
call, a large output, state kept by the process, and the server dying mid-call.
"""

from __future__ import annotations

import asyncio
import os
import sys

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("turnrl-test")
_calls = {"count": 0}


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


@server.tool()
def fail(message: str) -> str:
    """Fail with this message (an anticipated tool error: the client sees it)."""
    raise ToolError(message)


@server.tool()
async def slow(seconds: float) -> str:
    """Sleep, then answer."""
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


@server.tool()
def big(chars: int) -> str:
    """A long text of this many characters."""
    return "x" * chars


@server.tool()
def count() -> int:
    """How many times this tool has been called in this server process."""
    _calls["count"] += 1
    return _calls["count"]


@server.tool()
def die() -> str:
    """Kill the server process at once."""
    print("test server: dying on request", file=sys.stderr, flush=True)
    os._exit(3)


if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run("stdio")
