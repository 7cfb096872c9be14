"""An agent you already have, written with the `openai` SDK, trained as it is.

The agent answers "What is the value of <key>?" by calling its own `lookup` tool. turnrl
serves the policy behind an OpenAI-compatible endpoint, hands each agent instance its own
base URL, stitches the calls of an episode into one token-exact trajectory, and trains.
"""

import json
import sys

import openai

import turnrl
from turnrl.envs import SecretLookup

LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look up a key.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string", "description":
                   "The key."}}, "required": ["key"], "additionalProperties": False}}}  # fmt: skip


async def agent(task: turnrl.Task, client: openai.AsyncOpenAI) -> str:
    """A plain ReAct loop with the SDK's tool calling (nothing here knows about turnrl)."""
    table = task.metadata["table"]  # the agent's own tool reads its own data
    messages = [dict(m) for m in task.prompt]
    for _ in range(4):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=[LOOKUP]
        )
        message = reply.choices[0].message
        if not message.tool_calls:
            return message.content or ""
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            key = json.loads(call.function.arguments).get("key")
            found = table.get(key, f"Error: no key {key!r} in the table")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": found})
    return ""


def reward(task: turnrl.Task, answer: str, transcript: list) -> float:
    return float(answer.strip() == task.answer)


PROBE = SecretLookup(num_keys=2, key_pool=2, num_values=12)  # the quick-start's tasks

if __name__ == "__main__":  # python examples/existing_agent.py [key=value ...]
    env = turnrl.AgentEnvironment(agent, PROBE.task, reward, name="existing_agent",
                                  demonstrate=PROBE.demonstration, corpus_text=PROBE.corpus())  # fmt: skip
    try:
        turnrl.train("quickstart", env=env, overrides=sys.argv[1:])
    finally:
        env.close()
