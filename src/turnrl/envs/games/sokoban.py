"""Sokoban: push every box onto a goal. Moves are irreversible: a box can be pushed, never
pulled, so one careless push into a corner loses the level (RAGEN's hardest text game).

Levels are seeded and procedural (reverse play from the solved state, confirmed solvable by
a breadth-first solver, see sokoban_rules.py). The episode ends, terminated, when every box
is on a goal (reward 1) or when a box stands on a dead square from which it can never reach
a goal, such as a corner (reward 0: the level can no longer be solved, and the env says so).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from turnrl.envs.env_card import EnvCard
from turnrl.envs.games import sokoban_rules as rules
from turnrl.envs.games.game_env import GameEnv, Outcome
from turnrl.envs.games.grid import (
    DIRECTIONS,
    Direction,
    grid_corpus,
    latest_board,
    move_call,
    random_moves,
    where,
)
from turnrl.envs.policy import Policy
from turnrl.errors import ConfigError
from turnrl.tools import Tool, ToolSet
from turnrl.types import Message, Task

CHANCE_EPISODES = 200
"""Tasks (test split) the random policy's success ``chance`` is estimated on."""


@dataclass(frozen=True)
class Sokoban:
    """Sokoban: push every box onto a goal; boxes cannot be pulled (irreversible moves)."""

    height: int = 6
    """Rows of the board, border walls included."""
    width: int = 6
    """Columns of the board, border walls included."""
    num_boxes: int = 1
    """Boxes (and goals) per level."""
    min_solution: int = 5
    """Fewest moves a level's shortest solution may have (shorter levels are too easy to
    guess: with 3, a random policy solves 13%; with 5, about 5%)."""
    max_moves: int = 20
    """Move budget per episode (every call counts); a level's shortest solution fits it."""
    max_turns: int = 20
    """Model turns per episode (a turn may hold several calls)."""
    seed: int = 0
    """Seed of the level stream (levels are a pure function of seed, split and index)."""

    name = "sokoban"

    def __post_init__(self) -> None:
        if not (4 <= self.height <= 12 and 4 <= self.width <= 12):
            raise ConfigError("sokoban.height and width must be in 4..12 (border included)")
        if not 1 <= self.num_boxes <= 3:
            raise ConfigError("sokoban.num_boxes must be in 1..3")
        if not 1 <= self.min_solution <= min(self.max_moves, self.max_turns):
            raise ConfigError("sokoban.min_solution must be in 1..min(max_moves, max_turns)")

    def task(self, index: int, split: str = "train") -> Task:
        rng = random.Random(f"sokoban/{self.seed}/{split}/{index}")
        # The oracle plays one move per turn: its solution must fit both limits.
        limit = min(self.max_moves, self.max_turns)
        level, state, plan = rules.generate(
            rng,
            self.height,
            self.width,
            self.num_boxes,
            min_moves=self.min_solution,
            max_moves=limit,
        )
        board = rules.render(level, state)
        prompt = (
            "Sokoban. Push every box onto a goal.\n"
            f"Legend: {rules.LEGEND}.\n"
            "Move one square with the move tool (up, down, left or right). Walking into a box "
            "pushes it if the square behind it is free. Boxes cannot be pulled: a box pushed "
            "into a corner is stuck for good and the level is lost.\n"
            f"You have {self.max_moves} moves.\n\n{board}"
        )
        return Task(
            id=f"{split}-{index}",
            prompt=({"role": "user", "content": prompt},),
            answer=len(plan),
            metadata={"board": board.splitlines()},
        )

    def make_env(self) -> GameEnv:
        return GameEnv(_new_game, max_moves=self.max_moves, max_turns=self.max_turns)

    def oracle(self, task: Task) -> Policy:
        """Reads the latest board, plans with the solver, replans if the board surprises it."""
        return _Oracle()

    def demonstration(self, task: Task, rng: random.Random) -> list[str]:
        """Random moves, one per turn (``grid.random_moves``)."""
        return random_moves(rng, self.max_turns)

    def corpus(self) -> list[str]:
        """Prompts, boards and calls, for a tiny tokenizer."""
        return grid_corpus(self.task, "board")

    @cached_property
    def chance(self) -> float:
        """The random policy's success, estimated on ``CHANCE_EPISODES`` test levels."""
        wins = 0
        for i in range(CHANCE_EPISODES):
            rng = random.Random(f"sokoban-chance/{i}")
            level, state = rules.parse(self.task(i, "test").metadata["board"])
            for _ in range(min(self.max_moves, self.max_turns)):
                state = rules.moved(level, state, rng.choice(DIRECTIONS)) or state
                if rules.solved(level, state) or rules.stuck_box(level, state):
                    break
            wins += rules.solved(level, state)
        return wins / CHANCE_EPISODES

    @property
    def card(self) -> EnvCard:
        return EnvCard(
            name=self.name,
            summary=(
                f"push {self.num_boxes} box(es) onto goals on a {self.height}x{self.width} board "
                "(boxes cannot be pulled)"
            ),
            tools=("move(direction: up|down|left|right)",),
            tool_budget=self.max_moves,
            turn_limit=self.max_turns,
            scaffold="hermes <tool_call> format; the prompt shows rules, legend and board; each "
            "move's result shows the new board",
            evaluator="1 when every box is on a goal, else 0 (success = solved)",
            on_failure="a refused move (wall, two boxes) is an error result and costs a move; a "
            "box on a dead square ends the episode with 0; a turn without a call ends it with "
            "0; malformed calls are error observations; out of moves or turns: truncated",
            chance=self.chance,
        )


class _Game:
    def __init__(self, board: Sequence[str]) -> None:
        self.level, self.state = rules.parse(board)

    def tools(self) -> ToolSet:
        async def move(direction: Direction) -> str:
            """Move one square, pushing a box that is in the way.

            Args:
                direction: up, down, left or right.
            """
            before = self.state
            self.state = rules.move(self.level, before, direction)
            did = "pushed a box" if self.state.boxes != before.boxes else "moved"
            text = f"You {did} {direction}.\n{rules.render(self.level, self.state)}"
            if (box := rules.stuck_box(self.level, self.state)) is not None:
                text += f"\nThe box at {where(box)} can never reach a goal: the level is lost."
            elif rules.solved(self.level, self.state):
                text += "\nEvery box is on a goal: solved!"
            return text

        return ToolSet([Tool.from_function(move, timeout_s=None)])

    def outcome(self) -> Outcome | None:
        on_goals = len(self.state.boxes & self.level.goals) / len(self.state.boxes)
        components = {"boxes_on_goals": on_goals}
        if rules.solved(self.level, self.state):
            return Outcome(1.0, True, "solved", components)
        if (box := rules.stuck_box(self.level, self.state)) is not None:
            return Outcome(0.0, False, f"deadlock: the box at {where(box)} is stuck", components)
        return None


def _new_game(task: Task, seed: int) -> _Game:
    return _Game(task.metadata["board"])  # no randomness: the seed is not needed


class _Oracle:
    """Plays a shortest solution of the board it reads; replans when the board is not the
    one it expected (it never is, Sokoban being deterministic, but it costs nothing)."""

    def __init__(self) -> None:
        self.plan: list[Direction] = []
        self.expected: rules.State | None = None

    def __call__(self, messages: Sequence[Message]) -> str:
        board = latest_board(messages, rules.ALPHABET)
        if board is None:
            return "I cannot see the board."
        level, state = rules.parse(board)
        if state != self.expected or not self.plan:
            self.plan = rules.solve(level, state) or []
        if not self.plan:
            return "This level cannot be solved."
        direction = self.plan.pop(0)
        self.expected = rules.moved(level, state, direction)
        return move_call(direction)
