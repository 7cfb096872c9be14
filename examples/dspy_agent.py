"""A DSPy program, trained as it is (`pip install 'turnrl[agents]'`).

The program answers "What is the value of <key>?" with `dspy.ReAct` and a `lookup` tool
(a plain function, as DSPy takes tools), its language model a `dspy.LM` on the
OpenAI-compatible endpoint. The one thing that connects it to turnrl is the model's
`api_base`: the episode's policy endpoint. DSPy writes no OpenAI tool calls: each ReAct
step asks the model for its next thought, tool name and arguments as fields of DSPy's
own text format, and renders the trajectory so far into the next prompt (so each step is
a training sample of its own, counted in `rollout/context_rewrites`). When the model's
text does not parse into those fields, DSPy raises `AdapterParseError`; turnrl counts
that episode as the model's failure (reward 0, trained on, `rollout/agent_model_errors`).
"""

import json
import os
import random
import sys

import dspy

import turnrl
from turnrl import get_format
from turnrl.envs import SecretLookup

# DSPy fetches a model-price map from GitHub on its first call; the one it ships will do
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


async def agent(task: turnrl.Task, *, base_url: str, api_key: str) -> str:
    """A DSPy ReAct program with one tool (nothing here knows about turnrl but the URL)."""
    table = task.metadata["table"]  # the program's own tool reads its own data

    def lookup(key: str) -> str:
        """Look up a key."""
        return table.get(key, f"Error: no key {key!r} in the table")

    lm = dspy.LM("openai/policy", api_base=base_url, api_key=api_key, cache=False)
    react = dspy.ReAct("question -> answer", tools=[lookup], max_iters=3)
    with dspy.context(lm=lm):
        prediction = await react.acall(question=task.prompt[0]["content"])
    return str(prediction.answer)


def reward(task: turnrl.Task, answer: str, transcript: list) -> float:
    return float(answer.strip() == task.answer)


PROBE = SecretLookup(num_keys=2, key_pool=2, num_values=12)  # the quick-start's tasks


def fields(**values: str) -> str:
    """A reply in DSPy's chat format: each output field under its marker, then the end."""
    parts = [f"[[ ## {name} ## ]]\n{value}" for name, value in values.items()]
    return "\n\n".join([*parts, "[[ ## completed ## ]]"])


def demonstration(task: turnrl.Task, rng: random.Random) -> list[str]:
    """The warm-up's format lesson in DSPy's fields: a ReAct step that looks up a key, one
    that finishes, the extraction's answer (a random key and value, as the probe's own
    lesson: grammar, not the solution)."""
    call, answer = PROBE.demonstration(task, rng)
    key = get_format("hermes").parse(call).tool_calls[0].arguments["key"]
    return [
        fields(next_thought=f"I look up {key}.", next_tool_name="lookup",
               next_tool_args=json.dumps({"key": key})),
        fields(next_thought="I have the value.", next_tool_name="finish", next_tool_args="{}"),
        fields(reasoning="The table says so.", answer=answer),
    ]  # fmt: skip


if __name__ == "__main__":  # python examples/dspy_agent.py [key=value ...]
    lessons = [text for i in range(8) for text in demonstration(PROBE.task(i), random.Random(i))]
    env = turnrl.AgentEnvironment(agent, PROBE.task, reward, name="dspy",
                                  demonstrate=demonstration, corpus_text=[*PROBE.corpus(), *lessons])  # fmt: skip
    # DSPy's prompts (its signature's instructions, the trajectory so far) run to about 1,300
    # of the tiny model's tokens, and its replies are longer than a bare call
    settings = ["rollout.max_context_tokens=4096", "rollout.max_tokens_per_turn=64",
                "rollout.max_episode_tokens=256", *sys.argv[1:]]  # fmt: skip
    try:
        turnrl.train("quickstart", env=env, overrides=settings)
    finally:
        env.close()
