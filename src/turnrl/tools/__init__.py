"""Tools: typed Python functions the model can call, with schemas and execution limits;
a sandboxed, persistent Python interpreter for model-written code; BM25 search over a
document collection; the tools of MCP servers."""

from turnrl.tools.mcp_client import McpError, McpServer, McpSession
from turnrl.tools.python_tool import CodeResult, PythonInterpreter, python_tool
from turnrl.tools.sandbox import (
    Sandbox,
    SandboxError,
    SandboxLimits,
    SandboxUnavailableError,
)
from turnrl.tools.search import Document, Hit, SearchIndex
from turnrl.tools.tool import Tool, ToolResult, ToolSet, tool

__all__ = [
    "CodeResult",
    "Document",
    "Hit",
    "McpError",
    "McpServer",
    "McpSession",
    "PythonInterpreter",
    "Sandbox",
    "SandboxError",
    "SandboxLimits",
    "SandboxUnavailableError",
    "SearchIndex",
    "Tool",
    "ToolResult",
    "ToolSet",
    "python_tool",
    "tool",
]
