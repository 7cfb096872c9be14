"""Agents that fail the way agent frameworks do, in a module that imports no torch:
``AgentProcesses``' workers import it to unpickle them (tests/test_agent_model_errors.py)."""

from __future__ import annotations

import openai

from turnrl.types import Task


def framework_error(qualified_name: str, *, base: type[Exception] = Exception) -> type[Exception]:
    """A class whose ``module.QualName`` is ``qualified_name`` (e.g.
    ``"langgraph.errors.GraphRecursionError"``), as if that framework defined it."""
    module, name = qualified_name.rsplit(".", 1)
    return type(name, (base,), {"__module__": module, "__qualname__": name})


async def calls_an_unknown_tool(task: Task, client: openai.AsyncOpenAI) -> str:
    """Asks the policy once, then fails as the OpenAI Agents SDK does when the model calls
    a tool the agent does not have (the real SDK's exception)."""
    from agents.exceptions import ModelBehaviorError

    await client.chat.completions.create(model="p", messages=list(task.prompt))
    raise ModelBehaviorError("Tool ant not found in agent solver")
