"""Sokoban's rules as pure functions: boards in text, moves, dead squares, a breadth-first
solver, and seeded level generation by reverse play. The environment is in sokoban.py.

Boards use the XSB notation with ``_`` for floor (so no line is blank or ends in spaces):
``#`` wall, ``_`` floor, ``.`` goal, ``$`` box, ``*`` box on a goal, ``@`` player,
``+`` player on a goal.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from turnrl.envs.games.grid import DIRECTIONS, Cell, Direction, IllegalMove, neighbour, opposite

ALPHABET = "#_.$*@+"
LEGEND = "# wall, _ floor, . goal, $ box, * box on a goal, @ you, + you standing on a goal"


@dataclass(frozen=True)
class Level:
    """The fixed part of a board: its size, walls and goals. Outside the grid is wall."""

    height: int
    width: int
    walls: frozenset[Cell]
    goals: frozenset[Cell]

    def blocked(self, cell: Cell) -> bool:
        r, c = cell
        return cell in self.walls or not (0 <= r < self.height and 0 <= c < self.width)

    @cached_property
    def dead_squares(self) -> frozenset[Cell]:
        """Floor squares from which no push sequence brings a box to any goal (corners and
        most squares along a wall). A box on one can never reach a goal: the level is lost.

        Found backwards from the goals: a box reaches ``cell`` by a push from ``prev`` (one
        square back) with the player one further back; both must be free of walls.
        """
        live = set(self.goals)
        frontier = list(self.goals)
        while frontier:
            cell = frontier.pop()
            for d in DIRECTIONS:
                prev = neighbour(cell, opposite(d))
                stand = neighbour(prev, opposite(d))
                if prev not in live and not self.blocked(prev) and not self.blocked(stand):
                    live.add(prev)
                    frontier.append(prev)
        floor = {
            (r, c)
            for r in range(self.height)
            for c in range(self.width)
            if not self.blocked((r, c))
        }
        return frozenset(floor - live)


@dataclass(frozen=True)
class State:
    """The moving part of a board: where the player and the boxes are."""

    player: Cell
    boxes: frozenset[Cell]


def solved(level: Level, state: State) -> bool:
    """Every box is on a goal."""
    return state.boxes <= level.goals


def stuck_box(level: Level, state: State) -> Cell | None:
    """A box that can never reach a goal again (on a dead square), if there is one."""
    return min(state.boxes & level.dead_squares, default=None)


def moved(level: Level, state: State, direction: Direction) -> State | None:
    """The state after one step (pushing a box ahead), or None if the rules refuse it."""
    target = neighbour(state.player, direction)
    if level.blocked(target):
        return None
    if target not in state.boxes:
        return State(target, state.boxes)
    beyond = neighbour(target, direction)
    if level.blocked(beyond) or beyond in state.boxes:
        return None
    return State(target, (state.boxes - {target}) | {beyond})


def move(level: Level, state: State, direction: Direction) -> State:
    """Like ``moved``, but a refused move raises ``IllegalMove`` saying why."""
    after = moved(level, state, direction)
    if after is not None:
        return after
    target = neighbour(state.player, direction)
    if level.blocked(target):
        raise IllegalMove(f"cannot move {direction}: a wall is in the way")
    behind = "another box" if neighbour(target, direction) in state.boxes else "a wall"
    raise IllegalMove(f"cannot push the box {direction}: {behind} is behind it")


def solve(level: Level, start: State, *, max_states: int = 200_000) -> list[Direction] | None:
    """A shortest move sequence that solves the level (breadth-first search over states,
    never pushing a box onto a dead square), or None if there is none within
    ``max_states`` visited states."""
    if solved(level, start):
        return []
    parents: dict[State, tuple[State, Direction]] = {}
    seen = {start}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        for d in DIRECTIONS:
            nxt = moved(level, state, d)
            if nxt is None or nxt in seen or nxt.boxes & level.dead_squares:
                continue
            seen.add(nxt)
            parents[nxt] = (state, d)
            if solved(level, nxt):
                return _path(parents, nxt, start)
            if len(seen) >= max_states:
                return None
            queue.append(nxt)
    return None


def _path(
    parents: dict[State, tuple[State, Direction]], end: State, start: State
) -> list[Direction]:
    path: list[Direction] = []
    state = end
    while state != start:
        state, d = parents[state]
        path.append(d)
    return path[::-1]


def render(level: Level, state: State) -> str:
    """The board as text, one line per row."""

    def char(cell: Cell) -> str:
        if level.blocked(cell):
            return "#"
        goal = cell in level.goals
        if cell == state.player:
            return "+" if goal else "@"
        if cell in state.boxes:
            return "*" if goal else "$"
        return "." if goal else "_"

    return "\n".join("".join(char((r, c)) for c in range(level.width)) for r in range(level.height))


def parse(board: Sequence[str]) -> tuple[Level, State]:
    """The level and state a rendered board shows (the inverse of ``render``)."""
    cells = {(r, c): ch for r, line in enumerate(board) for c, ch in enumerate(line)}
    if set(cells.values()) - set(ALPHABET):
        raise ValueError(f"not a Sokoban board: {list(board)!r}")
    players = [cell for cell, ch in cells.items() if ch in "@+"]
    if len(players) != 1:
        raise ValueError(f"a board needs exactly one player, found {len(players)}")
    level = Level(
        height=len(board),
        width=max((len(line) for line in board), default=0),
        walls=frozenset(cell for cell, ch in cells.items() if ch == "#"),
        goals=frozenset(cell for cell, ch in cells.items() if ch in ".*+"),
    )
    return level, State(players[0], frozenset(cell for cell, ch in cells.items() if ch in "$*"))


def generate(
    rng: random.Random,
    height: int,
    width: int,
    num_boxes: int,
    *,
    min_moves: int,
    max_moves: int,
    max_attempts: int = 1000,
) -> tuple[Level, State, list[Direction]]:
    """A random level whose shortest solution has ``min_moves..max_moves`` moves, with it.

    Reverse play (as in gym-sokoban): carve a room, put the boxes on goals, then walk the
    player backwards, pulling boxes; undoing the walk pushes every box home, so the level is
    solvable by construction. The solver confirms it and supplies the shortest solution.
    """
    for _ in range(max_attempts):
        floor = _carve_room(rng, height, width)
        if len(floor) < num_boxes + 3:
            continue
        picks = rng.sample(sorted(floor), num_boxes + 1)
        everything = {(r, c) for r in range(height) for c in range(width)}
        level = Level(height, width, frozenset(everything - floor), frozenset(picks[1:]))
        state = _reverse_play(rng, level, State(picks[0], level.goals), 4 * (height + width))
        plan = solve(level, state)
        if plan is not None and min_moves <= len(plan) <= max_moves:
            return level, state, plan
    raise RuntimeError(
        f"no {height}x{width} level with {num_boxes} box(es) and a {min_moves}..{max_moves}"
        f"-move solution in {max_attempts} attempts; allow more moves or a bigger room"
    )


def _carve_room(rng: random.Random, height: int, width: int) -> set[Cell]:
    """A connected floor inside the border: a random walk until 50-80% is floor."""
    inside = [(r, c) for r in range(1, height - 1) for c in range(1, width - 1)]
    target = round(len(inside) * rng.uniform(0.5, 0.8))
    cell = rng.choice(inside)
    floor = {cell}
    while len(floor) < target:
        nxt = neighbour(cell, rng.choice(DIRECTIONS))
        if 0 < nxt[0] < height - 1 and 0 < nxt[1] < width - 1:
            cell = nxt
            floor.add(cell)
    return floor


def _reverse_play(rng: random.Random, level: Level, state: State, steps: int) -> State:
    """Walk backwards from ``state``, pulling a box behind the player 80% of the time."""
    player, boxes = state.player, set(state.boxes)
    for _ in range(steps):
        d = rng.choice(DIRECTIONS)
        target = neighbour(player, d)
        if level.blocked(target) or target in boxes:
            continue
        behind = neighbour(player, opposite(d))
        if behind in boxes and rng.random() < 0.8:
            boxes.remove(behind)
            boxes.add(player)
        player = target
    return State(player, frozenset(boxes))
