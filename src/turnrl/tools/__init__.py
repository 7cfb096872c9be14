"""Tools: typed Python functions the model can call, with schemas and execution limits;
a sandboxed, persistent Python interpreter for model-written code."""

from turnrl.tools.python_tool import CodeResult, PythonInterpreter, python_tool
from turnrl.tools.sandbox import (
    Sandbox,
    SandboxError,
    SandboxLimits,
    SandboxUnavailableError,
)
from turnrl.tools.tool import Tool, ToolResult, ToolSet, tool

__all__ = [
    "CodeResult",
    "PythonInterpreter",
    "Sandbox",
    "SandboxError",
    "SandboxLimits",
    "SandboxUnavailableError",
    "Tool",
    "ToolResult",
    "ToolSet",
    "python_tool",
    "tool",
]
