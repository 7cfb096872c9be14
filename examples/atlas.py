"""An atlas of made-up countries: the model asks `capital` and copies what it says.

Each task is a fresh world (two countries, their capitals drawn at random), so only the
tool knows the answer: chance is 1 in 12. It learns with the quick-start's settings:
`python benchmarks/env_learning.py --runs examples/atlas.py` measures it.
"""

import random
import sys

import turnrl
from turnrl import Environment, Task, ToolCall, ToolEnv
from turnrl.formats import default_format

RECIPE = "quickstart"  # the tiny model, GiGPO's turn-level credit, a KL anchor
COUNTRIES = ["Norland", "Vesta"]
CITIES = ["Arden", "Brisk", "Calder", "Dunmore", "Elsby", "Fenwick",
          "Garrow", "Holt", "Ivel", "Jarrow", "Kelso", "Lorne"]  # fmt: skip


def make_task(index: int, split: str) -> Task:
    rng = random.Random(f"{split}-{index}")
    world = {country: rng.choice(CITIES) for country in COUNTRIES}
    asked = rng.choice(COUNTRIES)
    prompt = f"What is the capital of {asked}?"
    return Task(f"{split}-{index}", prompt, answer=world[asked], metadata={"world": world})


def tools(task: Task) -> list:
    def capital(country: str) -> str:
        """The capital of a country."""
        return str(task.metadata["world"][country])

    return [capital]


def demonstrate(task: Task, rng: random.Random) -> list[str]:
    """The warm-up's turns: the format only (a random country, a random city), the call
    written in the run's call format."""
    call = ToolCall("capital", {"country": rng.choice(COUNTRIES)})
    return [default_format().render_call(call), rng.choice(CITIES)]


def make_env() -> ToolEnv:
    verify = lambda task, answer: float(answer.strip() == task.answer)  # noqa: E731
    return ToolEnv(tools, verify, max_tool_calls=2)


if __name__ == "__main__":  # python examples/atlas.py [key=value ...]
    env = Environment(make_task, make_env, demonstrate=demonstrate)
    turnrl.train(RECIPE, env=env, overrides=sys.argv[1:])
