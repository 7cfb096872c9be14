"""A composite reward for tool use: outcome (dominant) + format (small, gated) + tool-call
match (ToolRL's R_correct), each component logged.

ToolRL (Qian et al., 2025, arXiv:2504.13958) scores a turn's predicted calls against the
gold calls; docs/algorithms.md ("Rewards for tool use") gives the rule that
``toolrl_correctness`` implements:

    parse error -> -3; identical to the gold call list -> +3; otherwise
    score = Jaccard(names) + sum over gold calls g of the best same-name prediction's
            Jaccard(parameter keys) + the number of its parameter values equal to g's,
    S_max = 1 + sum_g (1 + |params_g|),   R_correct = 6 * score / S_max - 3.

``CompositeReward`` combines, for one episode:
- ``outcome``: the environment's verifier reward (the weight that dominates);
- ``format``: 1 when every turn parsed, else 0; *gated*: paid only when the outcome reward
  is positive, so a well-formed but wrong (or empty) answer earns nothing for its form;
- ``tool_match``: R_correct / 3 in [-1, 1] for the episode's calls against the task's
  ``metadata["gold_calls"]`` (a list of ``{"name", "arguments"}``); absent without gold.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from turnrl.rewards import Verdict
from turnrl.types import ToolCall


def _jaccard(a: set[Any], b: set[Any]) -> float:
    return 1.0 if not a and not b else len(a & b) / len(a | b)


def toolrl_correctness(
    predicted: Sequence[ToolCall] | None, gold: Sequence[ToolCall]
) -> float:  # fmt: skip
    """ToolRL's R_correct in [-3, 3]; ``predicted`` None means the calls did not parse."""
    if predicted is None:
        return -3.0
    if [(c.name, dict(c.arguments)) for c in predicted] == [
        (c.name, dict(c.arguments)) for c in gold
    ]:
        return 3.0
    score = _jaccard({c.name for c in predicted}, {c.name for c in gold})
    for g in gold:
        same = [p for p in predicted if p.name == g.name]
        score += max(
            (
                _jaccard(set(p.arguments), set(g.arguments))
                + sum(1 for k, v in g.arguments.items() if k in p.arguments and p.arguments[k] == v)
                for p in same
            ),
            default=0.0,
        )
    s_max = 1 + sum(1 + len(g.arguments) for g in gold)
    return 6.0 * score / s_max - 3.0


def gold_calls(metadata: Mapping[str, Any]) -> list[ToolCall] | None:
    """The task's gold calls (``metadata["gold_calls"]``), or None when it has none."""
    raw = metadata.get("gold_calls")
    if raw is None:
        return None
    return [ToolCall(str(c["name"]), dict(c.get("arguments", {}))) for c in raw]


@dataclass(frozen=True)
class CompositeReward:
    """Outcome + gated format + tool-call match; see the module docstring.

    ``total = outcome_weight * outcome + format_weight * format * [outcome > 0]
    + tool_weight * tool_match``. The components are returned unweighted, for logging.
    """

    outcome_weight: float = 1.0
    format_weight: float = 0.1
    tool_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.outcome_weight <= 0:
            raise ValueError("outcome_weight must be > 0: the outcome is the reward's core")
        if self.format_weight < 0 or self.tool_weight < 0:
            raise ValueError("format_weight and tool_weight must be >= 0")
        if self.format_weight + self.tool_weight > self.outcome_weight:
            raise ValueError(
                "the shaping weights (format + tool) must not exceed the outcome weight: the "
                "outcome must dominate"
            )

    def combine(
        self,
        outcome: Verdict,
        *,
        calls: Sequence[ToolCall],
        format_errors: int,
        gold: Sequence[ToolCall] | None = None,
    ) -> Verdict:
        """The episode's verdict: ``outcome`` (the verifier's) shaped by the other terms.
        Success stays the outcome's."""
        well_formed = float(format_errors == 0)
        components = {
            **outcome.components,
            "outcome": outcome.reward,
            "format": well_formed,
        }
        total = self.outcome_weight * outcome.reward
        if outcome.reward > 0:
            total += self.format_weight * well_formed
        if gold is not None:
            # A turn that failed to parse made no calls; the parse failures are counted
            # by the format term, the calls that did parse are matched here.
            match = toolrl_correctness(list(calls), gold) / 3.0
            components["tool_match"] = match
            total += self.tool_weight * match
        return Verdict(total, outcome.success, components)
