# A calculator agent: the model calls `multiply`, reads the result, answers.
import random
import sys

from turnrl import Environment, Task, ToolEnv, train


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def make_task(index: int, split: str) -> Task:
    a, b = random.Random(f"{split}-{index}").sample(range(2, 10), 2)
    return Task(id=f"{split}-{index}", prompt=f"What is {a} times {b}?", answer=str(a * b))


def verify(task: Task, answer: str) -> float:  # or a turnrl.Verdict with reward components
    return float(answer.strip() == task.answer)


environment = Environment(make_task, lambda: ToolEnv([multiply], verify, max_tool_calls=2))
if __name__ == "__main__":  # python examples/calculator.py [key=value ...]
    train("grpo", env=environment, overrides=sys.argv[1:])
