"""Agents for the agent tests, in a module that imports no torch: ``AgentProcesses``'
workers import it to unpickle them (tests/test_agent_processes.py), and fast."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import openai

from turnrl.types import Task

LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up a key.",
        "parameters": {
            "type": "object",
            "properties": {"key": {"type": "string", "description": "The key."}},
            "required": ["key"],
            "additionalProperties": False,
        },
    },
}  # the probe's own schema, so the two paths render the same prompt


async def react_agent(task: Task, client: openai.AsyncOpenAI) -> str:
    """A ReAct-style agent with the SDK's tool calling: what a user already has."""
    table = task.metadata["table"]
    messages: list[Any] = [dict(m) for m in task.prompt]
    for _ in range(4):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=[LOOKUP]
        )
        message = reply.choices[0].message
        if not message.tool_calls:
            return message.content or ""
        messages.append(message)  # the SDK's object, as agents usually do
        for call in message.tool_calls:
            key = json.loads(call.function.arguments).get("key")
            result = table.get(key, f"Error: no key {key!r}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""


async def whose(task: Task, client: openai.AsyncOpenAI) -> str:
    """Calls the policy once, answers with the process it runs in."""
    await client.chat.completions.create(model="p", messages=list(task.prompt))
    return str(os.getpid())


async def crashes(task: Task, client: openai.AsyncOpenAI) -> str:
    await client.chat.completions.create(model="p", messages=list(task.prompt))
    raise ValueError("the agent's own bug")


async def dies(task: Task, client: openai.AsyncOpenAI) -> str:
    """Kills its own process on the first task, else answers like ``whose``."""
    await client.chat.completions.create(model="p", messages=list(task.prompt))
    if task.id.endswith("-0"):
        os._exit(3)
    return str(os.getpid())


async def hangs(task: Task, client: openai.AsyncOpenAI) -> str:
    await client.chat.completions.create(model="p", messages=list(task.prompt))
    await asyncio.sleep(3600)
    return ""
