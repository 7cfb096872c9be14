"""The tool check shared by formats whose grammar can call exactly one tool.

Search-R1 tags and code fences each name no tool: the format decides which tool a block
calls. A tool list with other tools would offer the model tools it cannot reach, so it is
a configuration error, raised when the prompt is built (loudly, at the first reset).
"""

from __future__ import annotations

from collections.abc import Sequence

from turnrl.errors import ConfigError
from turnrl.protocols import ToolSchema


def the_single_tool(tools: Sequence[ToolSchema], tool_name: str, format_name: str) -> ToolSchema:
    """The schema of ``tool_name``, which must be the only tool in ``tools``."""
    names = [str(t.get("function", {}).get("name", "")) for t in tools]
    if names != [tool_name]:
        listed = ", ".join(repr(n) for n in names) or "none"
        raise ConfigError(
            f"the {format_name} format can call only the tool {tool_name!r}, "
            f"but the environment offers: {listed}; rename the tool or pass tool_name="
        )
    return tools[0]


def describe_tool(schema: ToolSchema) -> str:
    """The tool's description and its arguments' descriptions, one per line (may be empty)."""
    function = schema.get("function", {})
    lines = [str(function["description"])] if function.get("description") else []
    properties = function.get("parameters", {}).get("properties", {})
    for key, spec in properties.items():
        if isinstance(spec, dict) and spec.get("description"):
            lines.append(f"- {key}: {spec['description']}")
    return "\n".join(lines)
