"""A smolagents agent, trained as it is (`pip install 'turnrl[agents]'`).

The agent answers "What is the value of <key>?" with its own `lookup` tool, written the
smolagents way: a `@tool` function, a `ToolCallingAgent` on an `OpenAIServerModel`, and
`agent.run`, whose loop ends when the model calls smolagents' own `final_answer` tool.
The one thing that connects it to turnrl is the model's `api_base`: the episode's policy
endpoint. smolagents keeps most of the model's mistakes inside its loop (a call to a tool
it does not have comes back to the model as an error to act on); when the steps run out it
asks the model once more, without tools, for an answer.
"""

import random
import sys

from smolagents import OpenAIServerModel, ToolCallingAgent, tool

import turnrl
from turnrl import ToolCall, get_format
from turnrl.envs import SecretLookup


def agent(task: turnrl.Task, *, base_url: str, api_key: str) -> str:
    """A smolagents agent with one tool (nothing here knows about turnrl but the URL)."""
    table = task.metadata["table"]  # the agent's own tool reads its own data

    @tool
    def lookup(key: str) -> str:
        """Look up a key.

        Args:
            key: The key.
        """
        return table.get(key, f"Error: no key {key!r} in the table")

    model = OpenAIServerModel(model_id="policy", api_base=base_url, api_key=api_key)
    solver = ToolCallingAgent(tools=[lookup], model=model, max_steps=3, verbosity_level=0)
    try:
        return str(solver.run(task.prompt[0]["content"]))
    finally:
        model.client.close()  # the model's openai client, which smolagents leaves open


def reward(task: turnrl.Task, answer: str, transcript: list) -> float:
    return float(answer.strip() == task.answer)


PROBE = SecretLookup(num_keys=2, key_pool=2, num_values=12)  # the quick-start's tasks


def demonstration(task: turnrl.Task, rng: random.Random) -> list[str]:
    """The warm-up's format lesson as smolagents ends a run: the probe's call, then its
    answer as a call to `final_answer` (a random key and value: grammar, not the solution)."""
    call, answer = PROBE.demonstration(task, rng)
    return [call, get_format("hermes").render_call(ToolCall("final_answer", {"answer": answer}))]


if __name__ == "__main__":  # python examples/smolagents_agent.py [key=value ...]
    env = turnrl.AgentEnvironment(agent, PROBE.task, reward, name="smolagents",
                                  demonstrate=demonstration, corpus_text=PROBE.corpus())  # fmt: skip
    # smolagents' system prompt alone is about 1,800 of the tiny model's tokens
    settings = ["rollout.max_context_tokens=4096", *sys.argv[1:]]
    try:
        turnrl.train("quickstart", env=env, overrides=settings)
    finally:
        env.close()
