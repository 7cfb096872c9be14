"""FrozenLake: walk across the ice from the start to the goal without falling into a hole.

Maps are seeded (Gym's layout: start top-left, goal bottom-right, each other tile a hole
with probability ``hole_prob``) and kept only when a path to the goal fits the move
budget. With ``slip_prob`` > 0 the ice is slippery: each move goes to one of the two
perpendicular directions instead, with probability ``slip_prob`` (half each), seeded per
episode. (Gym's ``is_slippery`` is ``slip_prob = 2/3``.) A move toward the edge of the lake
is refused and costs a move; a slip into the edge leaves the player where it was.

The oracle is optimal: it maximises the probability of reaching the goal within the moves
left, by dynamic programming over (cell, moves left); with no slip it walks a shortest
path and always succeeds. The same recursion, averaging over actions instead of
maximising, gives the random policy's exact success (``chance``).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from turnrl.envs.env_card import EnvCard
from turnrl.envs.games.game_env import GameEnv, Outcome
from turnrl.envs.games.grid import (
    DIRECTIONS,
    Cell,
    Direction,
    IllegalMove,
    grid_corpus,
    latest_board,
    move_call,
    neighbour,
    perpendicular,
    random_moves,
    where,
)
from turnrl.envs.policy import Policy
from turnrl.errors import ConfigError
from turnrl.tools import Tool, ToolSet
from turnrl.types import Message, Task

ALPHABET = "SFHGP"
LEGEND = "P you, S start, F frozen ice (safe), H hole, G goal"
EXACT_TASKS = 100
"""Tasks (test split) over which the exact ``chance`` and ``oracle_success`` are averaged."""


@dataclass(frozen=True)
class Lake:
    """A map: rows of S (start), F (ice), H (hole) and G (goal)."""

    rows: tuple[str, ...]

    @property
    def size(self) -> int:
        return len(self.rows)

    def inside(self, cell: Cell) -> bool:
        return 0 <= cell[0] < self.size and 0 <= cell[1] < self.size

    def tile(self, cell: Cell) -> str:
        return self.rows[cell[0]][cell[1]]

    def cells(self) -> list[Cell]:
        return [(r, c) for r in range(self.size) for c in range(self.size)]

    def render(self, player: Cell) -> str:
        return "\n".join(
            "".join("P" if (r, c) == player else ch for c, ch in enumerate(row))
            for r, row in enumerate(self.rows)
        )

    def shortest_path(self) -> int | None:
        """Moves on the shortest hole-free path from S to G, or None if there is none."""
        start, goal = (0, 0), (self.size - 1, self.size - 1)
        dist = {start: 0}
        queue = deque([start])
        while queue:
            cell = queue.popleft()
            if cell == goal:
                return dist[cell]
            for d in DIRECTIONS:
                nxt = neighbour(cell, d)
                if self.inside(nxt) and nxt not in dist and self.tile(nxt) != "H":
                    dist[nxt] = dist[cell] + 1
                    queue.append(nxt)
        return None


def landing(
    lake: Lake, cell: Cell, direction: Direction, slip_prob: float
) -> list[tuple[float, Cell]]:
    """Where one move may end, with probabilities (a refused move stays where it is)."""
    if not lake.inside(neighbour(cell, direction)):
        return [(1.0, cell)]
    outcomes = [(1.0 - slip_prob, neighbour(cell, direction))]
    outcomes += [(slip_prob / 2, neighbour(cell, d)) for d in perpendicular(direction)]
    return [(p, dest if lake.inside(dest) else cell) for p, dest in outcomes if p > 0]


def success_tables(
    lake: Lake, slip_prob: float, horizon: int, *, best: bool
) -> list[dict[Cell, float]]:
    """``tables[k][cell]``: probability of reaching the goal within ``k`` moves from ``cell``,
    acting optimally (``best``) or uniformly at random. Holes and the goal end the game."""
    goal = (lake.size - 1, lake.size - 1)
    playing = [cell for cell in lake.cells() if lake.tile(cell) not in "HG"]
    moves = {cell: [landing(lake, cell, d, slip_prob) for d in DIRECTIONS] for cell in playing}
    tables = [{cell: float(cell == goal) for cell in lake.cells()}]
    for _ in range(horizon):
        prev = tables[-1]
        table = dict(prev)  # holes and the goal keep their value: the game is over there
        for cell in playing:
            values = [sum(p * prev[dest] for p, dest in outcomes) for outcomes in moves[cell]]
            table[cell] = max(values) if best else sum(values) / len(values)
        tables.append(table)
    return tables


@dataclass(frozen=True)
class FrozenLake:
    """FrozenLake: cross the ice from S to G without falling into a hole (optionally slippery)."""

    size: int = 4
    """Rows and columns of the lake."""
    hole_prob: float = 0.2
    """Probability that a tile (other than S and G) is a hole (Gym: 0.2)."""
    slip_prob: float = 0.0
    """Probability that a move goes sideways instead (half to each side); 0: not slippery."""
    max_moves: int = 10
    """Move budget per episode (every call counts); a map's shortest path fits it."""
    max_turns: int = 10
    """Model turns per episode (a turn may hold several calls)."""
    seed: int = 0
    """Seed of the map stream (maps are a pure function of seed, split and index)."""

    name = "frozen_lake"

    def __post_init__(self) -> None:
        if not 2 <= self.size <= 10:
            raise ConfigError("frozen_lake.size must be in 2..10")
        if not 0.0 <= self.hole_prob <= 0.5:
            raise ConfigError("frozen_lake.hole_prob must be in 0..0.5")
        if not 0.0 <= self.slip_prob < 1.0:
            raise ConfigError("frozen_lake.slip_prob must be in [0, 1)")
        if min(self.max_moves, self.max_turns) < 2 * (self.size - 1):
            raise ConfigError(
                f"frozen_lake.max_moves and max_turns must be >= {2 * (self.size - 1)}, "
                "the shortest possible path (one move per turn)"
            )

    def lake(self, task: Task) -> Lake:
        return Lake(tuple(task.metadata["rows"]))

    def task(self, index: int, split: str = "train") -> Task:
        rng = random.Random(f"frozen_lake/{self.seed}/{split}/{index}")
        lake = _generate(rng, self.size, self.hole_prob, min(self.max_moves, self.max_turns))
        slippery = (
            f"The ice is slippery: a move goes sideways instead with probability "
            f"{self.slip_prob:g}. "
            if self.slip_prob
            else ""
        )
        prompt = (
            "FrozenLake. Walk from the start to the goal G without falling into a hole H.\n"
            f"Legend: {LEGEND}.\n"
            f"Move one square with the move tool (up, down, left or right). {slippery}"
            f"You have {self.max_moves} moves.\n\n{lake.render((0, 0))}"
        )
        return Task(
            id=f"{split}-{index}",
            prompt=({"role": "user", "content": prompt},),
            answer=lake.shortest_path(),
            metadata={"rows": list(lake.rows)},
        )

    def make_env(self) -> GameEnv:
        def new_game(task: Task, seed: int) -> _Game:
            lake = self.lake(task)
            rng = random.Random(f"frozen_lake-slip/{task.id}/{''.join(lake.rows)}/{seed}")
            return _Game(lake, self.slip_prob, rng)

        return GameEnv(new_game, max_moves=self.max_moves, max_turns=self.max_turns)

    def oracle(self, task: Task) -> Policy:
        """The optimal policy for the moves left, reading its position off the latest board."""
        lake = self.lake(task)
        horizon = min(self.max_moves, self.max_turns)
        tables = success_tables(lake, self.slip_prob, horizon, best=True)
        return _Oracle(lake, self.slip_prob, tables)

    def demonstration(self, task: Task, rng: random.Random) -> list[str]:
        """Random moves, one per turn (``grid.random_moves``)."""
        return random_moves(rng, self.max_turns)

    def corpus(self) -> list[str]:
        """Prompts, maps and calls, for a tiny tokenizer."""
        return grid_corpus(self.task, "rows")

    def _exact(self, *, best: bool) -> float:
        horizon = min(self.max_moves, self.max_turns)
        total = 0.0
        for i in range(EXACT_TASKS):
            lake = self.lake(self.task(i, "test"))
            total += success_tables(lake, self.slip_prob, horizon, best=best)[horizon][(0, 0)]
        return total / EXACT_TASKS

    @cached_property
    def chance(self) -> float:
        """The random policy's success: exact per map, averaged over ``EXACT_TASKS`` maps."""
        return self._exact(best=False)

    @cached_property
    def oracle_success(self) -> float:
        """The oracle's expected success (1.0 without slip), computed like ``chance``."""
        return 1.0 if self.slip_prob == 0 else self._exact(best=True)

    @property
    def card(self) -> EnvCard:
        ice = f"slippery (slip_prob {self.slip_prob:g})" if self.slip_prob else "not slippery"
        return EnvCard(
            name=self.name,
            summary=f"cross a {self.size}x{self.size} frozen lake to the goal, {ice}",
            tools=("move(direction: up|down|left|right)",),
            tool_budget=self.max_moves,
            turn_limit=self.max_turns,
            scaffold="hermes <tool_call> format; the prompt shows rules, legend and map; each "
            "move's result shows the new map",
            evaluator="1 on reaching G, 0 on falling into a hole (success = reached G)",
            on_failure="a move off the lake is an error result and costs a move; a hole ends "
            "the episode with 0; a turn without a call ends it with 0; malformed calls are "
            "error observations; out of moves or turns: truncated",
            chance=self.chance,
        )


def _generate(rng: random.Random, size: int, hole_prob: float, max_path: int) -> Lake:
    for _ in range(1000):
        rows = [
            "".join("H" if rng.random() < hole_prob else "F" for _ in range(size))
            for _ in range(size)
        ]
        rows[0] = "S" + rows[0][1:]
        rows[-1] = rows[-1][:-1] + "G"
        lake = Lake(tuple(rows))
        path = lake.shortest_path()
        if path is not None and path <= max_path:
            return lake
    raise RuntimeError(f"no {size}x{size} lake with a path of at most {max_path} moves")


class _Game:
    def __init__(self, lake: Lake, slip_prob: float, rng: random.Random) -> None:
        self.lake, self.slip_prob, self.rng = lake, slip_prob, rng
        self.player: Cell = (0, 0)

    def tools(self) -> ToolSet:
        async def move(direction: Direction) -> str:
            """Move one square on the ice.

            Args:
                direction: up, down, left or right.
            """
            if not self.lake.inside(neighbour(self.player, direction)):
                raise IllegalMove(f"cannot move {direction}: that is the edge of the lake")
            went = direction
            if self.slip_prob and self.rng.random() < self.slip_prob:
                went = self.rng.choice(perpendicular(direction))
            dest = neighbour(self.player, went)
            if went == direction:
                text = f"You moved {direction}."
            elif self.lake.inside(dest):
                text = f"You slipped: you went {went} instead of {direction}."
            else:
                text = f"You slipped {went} against the edge and did not move."
            if self.lake.inside(dest):
                self.player = dest
            tile = self.lake.tile(self.player)
            if tile == "H":
                text += " You fell into a hole."
            elif tile == "G":
                text += " You reached the goal!"
            return f"{text}\n{self.lake.render(self.player)}"

        return ToolSet([Tool.from_function(move, timeout_s=None)])

    def outcome(self) -> Outcome | None:
        tile = self.lake.tile(self.player)
        if tile == "G":
            return Outcome(1.0, True, "reached the goal")
        if tile == "H":
            return Outcome(0.0, False, f"fell into the hole at {where(self.player)}")
        return None


class _Oracle:
    """Acts greedily on the optimal success tables, preferring the sooner success on ties
    (so without slip it walks a shortest path, never a detour)."""

    def __init__(self, lake: Lake, slip_prob: float, tables: list[dict[Cell, float]]) -> None:
        self.lake, self.slip_prob, self.tables = lake, slip_prob, tables
        self.moves_left = len(tables) - 1

    def __call__(self, messages: Sequence[Message]) -> str:
        board = latest_board(messages, ALPHABET)
        if board is None or self.moves_left <= 0:
            return "I give up."
        cell = next((r, c) for r, row in enumerate(board) for c, ch in enumerate(row) if ch == "P")
        direction = max(DIRECTIONS, key=lambda d: self._values(cell, d))
        self.moves_left -= 1
        return move_call(direction)

    def _values(self, cell: Cell, direction: Direction) -> tuple[float, ...]:
        """Success within the moves left first, then within 1, 2, ... moves (sooner wins)."""
        k = self.moves_left
        q = [
            sum(
                p * self.tables[j - 1][dest]
                for p, dest in landing(self.lake, cell, direction, self.slip_prob)
            )
            for j in [k, *range(1, k)]
        ]
        return tuple(q)
