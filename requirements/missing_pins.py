"""Print the pins of one lock that another lock does not hold.

    python3 requirements/missing_pins.py requirements/vllm-lock.txt requirements/lock.txt

Prints each ``name==version`` of the first lock that the second lacks at that version
(under any environment marker), leaving out the packages requirements/not-locked.txt
names (torch: installed apart, by TORCH_SPEC). The Makefile installs these into .venv-vllm
while .venv is still being made: .venv-vllm is layered on .venv, and everything else the
vLLM lock pins comes from there. Standard library only: it runs before any virtualenv.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)")


def normalized(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> list[tuple[str, str]]:
    """The (normalized name, version) of every ``name==version`` line of a lock."""
    found = []
    for line in path.read_text().splitlines():
        match = PIN.match(line.strip())
        if match:
            found.append((normalized(match.group(1)), match.group(2)))
    return found


def missing_pins(first: Path, second: Path, not_locked: Path) -> list[str]:
    """``first``'s pins that ``second`` lacks, as ``name==version`` lines."""
    held = set(pins(second))
    apart = {normalized(line.split("#")[0].strip()) for line in not_locked.read_text().splitlines()}
    return [f"{n}=={v}" for n, v in pins(first) if (n, v) not in held and n not in apart]


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit("usage: python3 requirements/missing_pins.py FIRST_LOCK SECOND_LOCK")
    here = Path(__file__).resolve().parent
    print("\n".join(missing_pins(Path(sys.argv[1]), Path(sys.argv[2]), here / "not-locked.txt")))


if __name__ == "__main__":
    main()
