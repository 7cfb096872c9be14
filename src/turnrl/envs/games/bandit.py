"""RAGEN's two-arm bandit: one pull of a safe arm or a risky arm, rewarded by the payout.

The safe arm always pays ``safe_payout`` (0.15); the risky arm pays ``risky_payout`` (1)
with probability ``risky_prob`` (0.25), else 0. Expected payouts: safe 0.15, risky 0.25, a
uniformly random pull 0.20. The risky arm is the better one in expectation, and the lesson
is to take it despite its 75% chance of paying nothing.

Each task names the two arms with two words drawn from a pool and lists them, with their
payout rules, in a random order, so a policy has to read the prompt to find the better arm.
Success means pulling the arm with the higher expected payout (random policy: exactly 1/2);
the reward is the payout itself, drawn from the episode's seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from turnrl.envs.env_card import EnvCard
from turnrl.envs.games.game_env import GameEnv, Outcome
from turnrl.envs.policy import Policy
from turnrl.errors import ConfigError
from turnrl.formats import get_format
from turnrl.tools import Tool, ToolSet
from turnrl.types import Task, ToolCall

ARM_NAMES = ("red", "blue", "green", "gold", "silver", "black", "white", "orange")


@dataclass(frozen=True)
class Bandit:
    """RAGEN's two-arm bandit: a safe arm (0.15 always) or a risky one (1 with prob 0.25)."""

    safe_payout: float = 0.15
    """What the safe arm pays on every pull."""
    risky_payout: float = 1.0
    """What the risky arm pays when it pays."""
    risky_prob: float = 0.25
    """Probability that the risky arm pays; otherwise it pays 0."""
    reward: str = "payout"
    """``payout``: the reward is the pull's payout (RAGEN); ``expected``: the pulled arm's
    expected payout (0.15 or 0.25), the same ordering of arms without the draw's noise."""
    seed: int = 0
    """Seed of the task stream (tasks are a pure function of seed, split and index)."""

    name = "bandit"

    def __post_init__(self) -> None:
        if not (0.0 <= self.safe_payout <= 1.0 and 0.0 <= self.risky_payout <= 1.0):
            raise ConfigError("bandit payouts must be in [0, 1] (rewards are payouts)")
        if not 0.0 < self.risky_prob < 1.0:
            raise ConfigError("bandit.risky_prob must be in (0, 1)")
        if self.reward not in ("payout", "expected"):
            raise ConfigError(f"bandit.reward must be 'payout' or 'expected', got {self.reward!r}")
        if self.expected_payouts["safe"] == self.expected_payouts["risky"]:
            raise ConfigError("bandit arms must differ in expected payout (else no arm is best)")

    @property
    def expected_payouts(self) -> dict[str, float]:
        """Expected payout per pull: safe 0.15 and risky 0.25 by default."""
        return {"safe": self.safe_payout, "risky": self.risky_payout * self.risky_prob}

    @property
    def best_arm(self) -> str:
        """``"risky"`` or ``"safe"``: the kind of arm with the higher expected payout."""
        payouts = self.expected_payouts
        return "risky" if payouts["risky"] > payouts["safe"] else "safe"

    chance = 0.5
    """Success of a uniformly random pull: one arm of two is the better one."""

    def task(self, index: int, split: str = "train") -> Task:
        rng = random.Random(f"bandit/{self.seed}/{split}/{index}")
        first, second = rng.sample(ARM_NAMES, 2)
        kinds = (
            {first: "safe", second: "risky"}
            if rng.random() < 0.5
            else {first: "risky", second: "safe"}
        )
        rules = {
            "safe": f"pays {self.safe_payout:g} on every pull",
            "risky": f"pays {self.risky_payout:g} with probability {self.risky_prob:g}, otherwise 0",
        }
        listing = "\n".join(f"- {arm}: {rules[kind]}" for arm, kind in kinds.items())
        prompt = (
            "A slot machine has two arms:\n"
            f"{listing}\n"
            "Pull one arm, once, with the pull tool. Your reward is what it pays; choose the "
            "arm that pays more on average."
        )
        best = next(arm for arm, kind in kinds.items() if kind == self.best_arm)
        return Task(
            id=f"{split}-{index}",
            prompt=({"role": "user", "content": prompt},),
            answer=best,
            metadata={"arms": kinds},
        )

    def make_env(self) -> GameEnv:
        def new_game(task: Task, seed: int) -> _Game:
            rng = random.Random(f"bandit-payout/{task.id}/{task.answer}/{seed}")
            return _Game(self, dict(task.metadata["arms"]), str(task.answer), rng)

        return GameEnv(new_game, max_moves=1, max_turns=1)

    def oracle(self, task: Task) -> Policy:
        """Pulls the arm with the higher expected payout."""
        call = _pull_call(str(task.answer))
        return lambda messages: call

    def demonstration(self, task: Task, rng: random.Random) -> list[str]:
        """One pull of a random arm: the call format with random content; replayed, the
        random policy."""
        return [_pull_call(rng.choice(list(task.metadata["arms"])))]

    def corpus(self) -> list[str]:
        """Prompts and calls, for a tiny tokenizer."""
        lines = [_pull_call(arm) for arm in ARM_NAMES] * 10
        lines += [str(self.task(i, "corpus").prompt[0]["content"]) for i in range(40)]
        return lines

    @property
    def card(self) -> EnvCard:
        payouts = self.expected_payouts
        return EnvCard(
            name=self.name,
            summary=(
                f"pull one of two arms once: safe (expected {payouts['safe']:g}) or risky "
                f"(expected {payouts['risky']:g})"
            ),
            tools=("pull(arm: one of the two arm names)",),
            tool_budget=1,
            turn_limit=1,
            scaffold="hermes <tool_call> format; the prompt lists the two arms and their "
            "payout rules in a random order",
            evaluator="reward = the payout (seeded per episode); success = pulled the arm "
            f"with the higher expected payout ({self.best_arm})",
            on_failure="an unknown arm is an error result; a malformed call, a turn without "
            "a call or a failed pull ends the single turn with 0",
            chance=self.chance,
        )


def _pull_call(arm: str) -> str:
    return get_format("hermes").render_call(ToolCall("pull", {"arm": arm}))


class _Game:
    def __init__(self, spec: Bandit, arms: dict[str, str], best: str, rng: random.Random) -> None:
        self.spec, self.arms, self.best, self.rng = spec, arms, best, rng
        self.pulled: tuple[str, float] | None = None

    def tools(self) -> ToolSet:
        async def pull(arm: str) -> str:
            risky = self.arms[arm] == "risky"
            wins = self.rng.random() < self.spec.risky_prob
            payout = (self.spec.risky_payout if wins else 0.0) if risky else self.spec.safe_payout
            self.pulled = (arm, payout)
            return f"The {arm} arm paid {payout:g}."

        names = list(self.arms)
        parameters = {
            "type": "object",
            "properties": {
                "arm": {"type": "string", "enum": names, "description": " or ".join(names)}
            },
            "required": ["arm"],
            "additionalProperties": False,
        }
        tool = Tool(pull, "pull", "Pull one arm of the slot machine.", parameters, timeout_s=None)
        return ToolSet([tool])

    def outcome(self) -> Outcome | None:
        if self.pulled is None:
            return None
        arm, payout = self.pulled
        best = float(arm == self.best)
        reward = payout
        if self.spec.reward == "expected":
            reward = self.spec.expected_payouts[self.arms[arm]]
        return Outcome(
            reward, arm == self.best, f"pulled {arm}", {"payout": payout, "best_arm": best}
        )
