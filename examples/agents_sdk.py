"""An OpenAI Agents SDK agent, trained as it is (`pip install 'turnrl[agents]'`).

The agent answers "What is the value of <key>?" with its own `lookup` tool, written the
SDK's way (`Agent`, `@function_tool`, `Runner.run`) and run by the SDK's default model,
which speaks the Responses API. The one line that connects it to turnrl is the client the
SDK's model provider gets: the `openai.AsyncOpenAI` turnrl hands each episode, whose base
URL is that episode's policy endpoint. When the model calls a tool the agent does not
have, the SDK raises `ModelBehaviorError`; turnrl counts that episode as the model's
failure (reward 0, trained on, `rollout/agent_model_errors`) rather than a bug.
"""

import sys

import openai
from agents import Agent, RunConfig, Runner, function_tool
from agents.models.openai_provider import OpenAIProvider

import turnrl
from turnrl.envs import SecretLookup


async def agent(task: turnrl.Task, client: openai.AsyncOpenAI) -> str:
    """An Agents SDK agent with one tool (nothing here knows about turnrl but `client`)."""
    table = task.metadata["table"]  # the agent's own tool reads its own data

    @function_tool
    def lookup(key: str) -> str:
        """Look up a key.

        Args:
            key: The key.
        """
        return table.get(key, f"Error: no key {key!r} in the table")

    solver = Agent(name="solver", model="policy", tools=[lookup])
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)
    result = await Runner.run(solver, task.prompt[0]["content"], max_turns=4, run_config=config)
    return str(result.final_output)


def reward(task: turnrl.Task, answer: str, transcript: list) -> float:
    return float(answer.strip() == task.answer)


PROBE = SecretLookup(num_keys=2, key_pool=2, num_values=12)  # the quick-start's tasks

if __name__ == "__main__":  # python examples/agents_sdk.py [key=value ...]
    env = turnrl.AgentEnvironment(agent, PROBE.task, reward, name="agents_sdk",
                                  demonstrate=PROBE.demonstration, corpus_text=PROBE.corpus())  # fmt: skip
    try:
        turnrl.train("quickstart", env=env, overrides=sys.argv[1:])
    finally:
        env.close()
