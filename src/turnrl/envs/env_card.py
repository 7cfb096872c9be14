"""``EnvCard``: an environment family's card (as a model card is a model's): what it is, in the
few facts an evaluation report prints."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EnvCard:
    """The card of an environment family (issue 5): its budget, limits, scaffold, evaluator
    and what happens on failure. ``turnrl envs check`` and evaluation reports print it."""

    name: str
    summary: str
    """One sentence: what the agent must do."""
    tools: tuple[str, ...]
    """The tools, as signatures."""
    tool_budget: int | None
    """Tool calls allowed per episode (None: unlimited)."""
    turn_limit: int | None
    """Model turns the environment allows before it truncates (None: only the runner's)."""
    scaffold: str
    """The call format and what the prompt and observations show."""
    evaluator: str
    """How the reward and success are decided."""
    on_failure: str
    """What happens on a malformed call, an illegal action, or running out of budget."""
    chance: float
    """Success rate of the random policy (uniformly random actions)."""

    def lines(self) -> list[str]:
        """The card as ``field: value`` lines."""
        return [
            f"{self.name}: {self.summary}",
            f"  tools:       {', '.join(self.tools)}",
            f"  tool budget: {_count(self.tool_budget)} calls per episode",
            f"  turn limit:  {_count(self.turn_limit)} turns",
            f"  scaffold:    {self.scaffold}",
            f"  evaluator:   {self.evaluator}",
            f"  on failure:  {self.on_failure}",
            f"  chance:      {self.chance:.3f} (random policy's success)",
        ]


def _count(n: int | None) -> str:
    return "unlimited" if n is None else str(n)
