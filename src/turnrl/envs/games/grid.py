"""What the grid games share: directions, cells, the ``move`` call, and reading the latest
board back out of a conversation (the oracles read the same text the model reads)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Literal

from turnrl.formats import get_format
from turnrl.types import Message, Task, ToolCall

Direction = Literal["up", "down", "left", "right"]
DIRECTIONS: tuple[Direction, ...] = ("up", "down", "left", "right")
Cell = tuple[int, int]
"""(row, column), row 0 at the top."""

_DELTAS: dict[Direction, Cell] = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
_OPPOSITE: dict[Direction, Direction] = {
    "up": "down",
    "down": "up",
    "left": "right",
    "right": "left",
}


class IllegalMove(ValueError):
    """A move the rules refuse; its message is what the model reads (nothing changed)."""


def neighbour(cell: Cell, direction: Direction) -> Cell:
    dr, dc = _DELTAS[direction]
    return cell[0] + dr, cell[1] + dc


def opposite(direction: Direction) -> Direction:
    return _OPPOSITE[direction]


def perpendicular(direction: Direction) -> tuple[Direction, Direction]:
    return ("left", "right") if direction in ("up", "down") else ("up", "down")


def move_call(direction: Direction) -> str:
    """The hermes text of one ``move`` call (what oracles and demonstrations say)."""
    return get_format("hermes").render_call(ToolCall("move", {"direction": direction}))


def random_moves(rng: random.Random, turns: int) -> list[str]:
    """A warm-up demonstration for a move game: one random ``move`` call per turn. It shows
    the call format with random content (grammar, not the solution); replayed, it is the
    random policy."""
    return [move_call(rng.choice(DIRECTIONS)) for _ in range(turns)]


def grid_corpus(task: Callable[[int, str], Task], grid_key: str) -> list[str]:
    """Text for a tiny tokenizer of a move game: every move call, and the prompts and grids
    (``task.metadata[grid_key]``, one string per row) of 40 tasks of a "corpus" split."""
    lines = [move_call(d) for d in DIRECTIONS] * 20
    for i in range(40):
        sample = task(i, "corpus")
        lines.append(sample.prompt[0]["content"])
        lines += sample.metadata[grid_key]
    return lines


def where(cell: Cell) -> str:
    """A cell in words, 1-based as people count: ``row 2, column 3``."""
    return f"row {cell[0] + 1}, column {cell[1] + 1}"


def latest_board(messages: Sequence[Message], alphabet: str) -> list[str] | None:
    """The last board shown in ``messages``: the last run of two or more lines of equal
    length made only of ``alphabet``'s characters, in the latest message that has one."""
    for message in reversed(messages):
        content = message.get("content")
        if message.get("role") == "assistant" or not isinstance(content, str):
            continue
        board: list[str] = []
        found: list[str] | None = None
        for line in [*content.splitlines(), ""]:
            fits = bool(line) and set(line) <= set(alphabet)
            if fits and (not board or len(line) == len(board[0])):
                board.append(line)
                continue
            if len(board) >= 2:
                found = board
            board = [line] if fits else []
        if found is not None:
            return found
    return None
