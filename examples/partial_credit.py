"""A verifier with partial credit: answer with the three largest numbers of a list, in
order. Each number in its right place earns a third; the reward's components are logged
apart (``rollout/reward_components``), and success needs all three."""

import random
import sys

import turnrl
from turnrl import Environment, Task, ToolEnv, Verdict


def make_task(index: int, split: str) -> Task:
    numbers = random.Random(f"{split}-{index}").sample(range(1, 100), 6)
    text = f"Numbers: {' '.join(map(str, numbers))}. Reply with the three largest, largest first."
    gold = [str(n) for n in sorted(numbers, reverse=True)[:3]]
    return Task(id=f"{split}-{index}", prompt=text, answer=gold)


def verify(task: Task, answer: str) -> Verdict:
    given = answer.replace(",", " ").split()
    right = [i < len(given) and given[i] == gold for i, gold in enumerate(task.answer)]
    components = {f"place_{i + 1}": float(ok) / 3 for i, ok in enumerate(right)}
    too_long = len(given) > len(task.answer)  # listing every number is not an answer
    reward = 0.0 if too_long else sum(components.values())
    return Verdict(reward, success=all(right) and not too_long, components=components)


def make_env() -> ToolEnv:
    return ToolEnv([], verify)


env = Environment(make_task, make_env, name="top_three")

if __name__ == "__main__":  # python examples/partial_credit.py [key=value ...]
    turnrl.train("grpo", env=env, overrides=["rollout.max_turns=1", *sys.argv[1:]])
