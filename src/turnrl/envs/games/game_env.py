"""``GameEnv``: an episode of a turn-based game whose actions are tool calls.

Why tool calls rather than bare words: the game's actions are then ordinary tools
(``move(direction)``, ``pull(arm)``) with JSON schemas, validated arguments and precise
error messages, parsed by the same call format as every other environment (as for
``ToolEnv``, the run's model family's unless one is given; hermes outside a run), counted
in the same tool-call metrics, and taught by the same warm-up. What ``ToolEnv`` cannot do
is end the episode from inside a tool: here, after each turn's calls, the game's
``outcome`` decides. The episode

- terminates when the game ends (won, lost, or a turn with no call: the model stopped);
- is truncated when the move budget (calls) or the turn limit runs out, with the reason in
  ``info["truncated_reason"]`` (``"max_moves"`` or ``"max_turns"``);
- goes on after a turn that could not be parsed: the error is the observation (the turn
  still counts toward the turn limit).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from turnrl.formats import default_format, error_observation
from turnrl.protocols import Format, ToolSchema
from turnrl.tools import ToolSet
from turnrl.types import Message, StepResult, Task, ToolCall, ToolCallRecord


@dataclass(frozen=True)
class Outcome:
    """How a game ended: the reward, whether it counts as solved, and why, in words."""

    reward: float
    success: bool
    reason: str
    components: Mapping[str, float] = field(default_factory=dict)


class Game(Protocol):
    """One episode's game state. Its actions are its tools, which change the state."""

    def tools(self) -> ToolSet: ...

    def outcome(self) -> Outcome | None:
        """How the game ended, or None while it goes on."""
        ...


class GameEnv:
    """A game played through tool calls. Make one instance per episode.

    ``new_game(task, seed)`` builds the episode's game; ``seed`` drives its randomness
    (slips, payouts), so the same task and seed replay the same episode.
    """

    def __init__(
        self,
        new_game: Callable[[Task, int], Game],
        *,
        max_moves: int,
        max_turns: int,
        format: Format | None = None,
    ) -> None:
        self._new_game = new_game
        self.max_moves = max_moves
        self.max_turns = max_turns
        self.format = default_format() if format is None else format
        self.game: Game | None = None
        self.tools = ToolSet([])
        self.num_moves = 0
        self.num_turns = 0
        self.ended = False

    def stop_strings(self) -> tuple[str, ...]:
        return self.format.stop_strings

    def tool_schemas(self) -> list[ToolSchema]:
        return self.tools.schemas() if self.format.template_tools else []

    async def reset(self, task: Task, seed: int) -> list[Message]:
        self.game = self._new_game(task, seed)
        self.tools = self.game.tools()
        self.num_moves = self.num_turns = 0
        self.ended = False
        head: list[Message] = []
        if not self.format.template_tools:
            head = [{"role": "system", "content": self.format.system_prompt(self.tools.schemas())}]
        return head + [dict(m) for m in task.prompt]

    async def step(self, action: str) -> StepResult:
        if self.game is None:
            raise RuntimeError("step() called before reset()")
        if self.ended:
            raise RuntimeError("step() called after the episode ended; reset() first")
        self.num_turns += 1
        parsed = self.format.parse(action)
        if parsed.errors:
            observation = tuple(error_observation(parsed.errors))
            return self._after_turn(self.game, observation, {"format_error": True})
        if not parsed.tool_calls:
            return self._end(Outcome(0.0, False, "stopped before the game ended"), (), {})
        observation, records = await self._run_calls(self.game, parsed.tool_calls)
        return self._after_turn(self.game, observation, {"tool_calls": records})

    def _after_turn(
        self, game: Game, observation: tuple[Message, ...], info: dict[str, Any]
    ) -> StepResult:
        outcome = game.outcome()
        if outcome is not None:
            return self._end(outcome, observation, info)
        for reason, used, limit in (
            ("max_moves", self.num_moves, self.max_moves),
            ("max_turns", self.num_turns, self.max_turns),
        ):
            if used >= limit:
                self.ended = True
                info |= {
                    "success": False,
                    "truncated_reason": reason,
                    "end_reason": f"{reason} ({limit}) reached before the game ended",
                }
                return StepResult(observation=observation, truncated=True, info=info)
        return StepResult(observation=observation, info=info)

    def _end(
        self, outcome: Outcome, observation: tuple[Message, ...], info: dict[str, Any]
    ) -> StepResult:
        self.ended = True
        info |= {
            "success": outcome.success,
            "end_reason": outcome.reason,
            "reward_components": dict(outcome.components),
        }
        return StepResult(observation, reward=outcome.reward, terminated=True, info=info)

    async def _run_calls(
        self, game: Game, calls: Sequence[ToolCall]
    ) -> tuple[tuple[Message, ...], list[ToolCallRecord]]:
        results: list[tuple[ToolCall, str]] = []
        records: list[ToolCallRecord] = []
        for call in calls:
            refused = None
            if game.outcome() is not None:
                refused = ("game_over", "Error: the game is over; this call was not run.")
            elif self.num_moves >= self.max_moves:
                refused = ("budget", f"Error: no moves left ({self.max_moves} per episode).")
            if refused is None:
                result, record = await self.tools.run(call)
                self.num_moves += 1
                text = result.content
            else:
                record = ToolCallRecord(call.name, dict(call.arguments), 0.0, False, refused[0])
                text = refused[1]
            results.append((call, text))
            records.append(record)
        return tuple(self.format.render_results(results)), records
