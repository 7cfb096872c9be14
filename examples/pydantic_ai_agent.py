"""A PydanticAI agent, trained as it is (`pip install 'turnrl[agents]'`).

The agent answers "What is the value of <key>?" with its own `lookup` tool, written
PydanticAI's way (`Agent`, `@agent.tool_plain`, `agent.run`) on its OpenAI chat model.
The one thing that connects it to turnrl is the model's provider: built on the
`openai.AsyncOpenAI` turnrl hands each episode, whose base URL is that episode's policy
endpoint. When the model keeps calling a tool the agent does not have, PydanticAI raises
`UnexpectedModelBehavior` once its retries are spent; turnrl counts that episode as the
model's failure (reward 0, trained on, `rollout/agent_model_errors`) rather than a bug.
"""

import sys

import openai
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

import turnrl
from turnrl.envs import SecretLookup


async def agent(task: turnrl.Task, client: openai.AsyncOpenAI) -> str:
    """A PydanticAI agent with one tool (nothing here knows about turnrl but `client`)."""
    table = task.metadata["table"]  # the agent's own tool reads its own data
    model = OpenAIChatModel("policy", provider=OpenAIProvider(openai_client=client))
    solver = Agent(model, retries=1)

    @solver.tool_plain
    def lookup(key: str) -> str:
        """Look up a key.

        Args:
            key: The key.
        """
        return table.get(key, f"Error: no key {key!r} in the table")

    result = await solver.run(task.prompt[0]["content"])
    return result.output


def reward(task: turnrl.Task, answer: str, transcript: list) -> float:
    return float(answer.strip() == task.answer)


PROBE = SecretLookup(num_keys=2, key_pool=2, num_values=12)  # the quick-start's tasks

if __name__ == "__main__":  # python examples/pydantic_ai_agent.py [key=value ...]
    env = turnrl.AgentEnvironment(agent, PROBE.task, reward, name="pydantic_ai",
                                  demonstrate=PROBE.demonstration, corpus_text=PROBE.corpus())  # fmt: skip
    try:
        turnrl.train("quickstart", env=env, overrides=sys.argv[1:])
    finally:
        env.close()
