"""A Gymnasium-style text game: guess a number from 1 to 16 in four turns, told
"higher" or "lower" after each guess. The environment is a ``TextEnv``: it writes ``reset``
and ``step``; no tools, no format, the reward at the end."""

import random
import sys

import turnrl
from turnrl import Environment, StepResult, Task, TextEnv

MAX_GUESSES = 4


class GuessNumber(TextEnv):
    """One episode (the trainer makes a fresh one per episode)."""

    async def reset(self, task: Task, seed: int) -> list[dict[str, str]]:
        self.secret, self.guesses = int(task.answer), 0
        return list(task.prompt)

    async def step(self, action: str) -> StepResult:
        self.guesses += 1
        words = action.split()
        guess = int(words[0]) if words and words[0].isdigit() else None
        if guess == self.secret:
            return StepResult(reward=1.0, terminated=True, info={"success": True})
        if self.guesses >= MAX_GUESSES:
            return StepResult(truncated=True, info={"truncated_reason": "max_guesses"})
        hint = "not a number" if guess is None else ("higher" if guess < self.secret else "lower")
        return StepResult(observation=({"role": "user", "content": hint},))


def make_task(index: int, split: str) -> Task:
    secret = random.Random(f"{split}-{index}").randint(1, 16)
    text = f"Guess my number from 1 to 16 in {MAX_GUESSES} tries. Answer with a number."
    return Task(id=f"{split}-{index}", prompt=text, answer=secret)


def demonstrate(task: Task, rng: random.Random) -> list[str]:
    """Format only: guesses at random (never the secret on purpose)."""
    return [str(rng.randint(1, 16)) for _ in range(MAX_GUESSES)]


env = Environment(make_task, GuessNumber, name="guess_number", demonstrate=demonstrate)

if __name__ == "__main__":  # python examples/guess_number.py [key=value ...]
    turnrl.train("grpo", env=env, overrides=["rollout.max_turns=4", *sys.argv[1:]])
