"""Reading a user's jsonl files: every line a JSON value, a bad line a ``ConfigError`` that
names the file and the line (stdlib only, so every layer may use it)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from turnrl.errors import ConfigError


def read_jsonl_lines(path: str | Path) -> Iterator[tuple[int, Any]]:
    """``(line number, value)`` for each non-blank line of ``path``."""
    with Path(path).open("rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(f"{path}:{n}: not UTF-8 ({exc.reason})") from None
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{n}: not JSON ({exc.msg})") from None
            except (ValueError, RecursionError) as exc:  # a 5,000-digit number; deep nesting
                raise ConfigError(f"{path}:{n}: not readable JSON ({exc})") from None
