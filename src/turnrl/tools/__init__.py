"""Tools: typed Python functions the model can call, with schemas and execution limits."""

from turnrl.tools.tool import Tool, ToolResult, ToolSet, tool

__all__ = ["Tool", "ToolResult", "ToolSet", "tool"]
