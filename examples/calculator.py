"""A calculator agent: the model calls `multiply`, reads the result, answers."""

import random
import sys

import turnrl
from turnrl import Environment, Task, ToolEnv, get_format


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def make_task(index: int, split: str) -> Task:
    a, b = random.Random(f"{split}-{index}").sample(range(2, 10), 2)
    prompt = ({"role": "user", "content": f"What is {a} times {b}?"},)
    return Task(id=f"{split}-{index}", prompt=prompt, answer=str(a * b))


def verify(task: Task, answer: str) -> float:  # or a turnrl.Verdict with reward components
    return float(answer.strip() == task.answer)


def make_env() -> ToolEnv:
    return ToolEnv([multiply], get_format("hermes"), verify, max_tool_calls=2)


if __name__ == "__main__":  # python examples/calculator.py [key=value ...]
    turnrl.train("grpo", env=Environment(make_task, make_env), overrides=sys.argv[1:])
