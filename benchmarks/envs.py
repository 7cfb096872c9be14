"""Environment table: for each environment, the oracle's success (must be at least 99%), the
random policy's success (must be low), and episodes per second, on seeded test tasks.

The random policy replays the family's demonstrations (valid calls with random content);
episodes per second time task generation, reset and every step of a random-policy episode
(the oracle column adds its planning). No model is involved: this is the environments' own
cost. Slippery FrozenLake is listed for information: its oracle is optimal, and no policy
can reach 99% there, so it is held to its exact expected success instead.

    python benchmarks/envs.py                  # 200 tasks per environment
    python benchmarks/envs.py --tasks 50
    python benchmarks/envs.py --smoke          # 2 tasks per environment

Writes benchmarks/results/envs.json and .md (``--out``; ``--smoke``: a temporary directory).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import random
import time
from pathlib import Path
from typing import Any

from outputs import parse_args
from turnrl import make_env_family
from turnrl.envs import Episode, HasOracle, play, replay

ROOT = Path(__file__).resolve().parent
CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("sokoban", {}),
    ("sokoban", {"height": 7, "width": 7, "num_boxes": 2, "max_moves": 30, "max_turns": 30}),
    ("frozen_lake", {}),
    ("frozen_lake", {"slip_prob": 0.2}),
    ("bandit", {}),
    ("secret_lookup", {}),
    ("search_qa", {"min_hops": 1, "max_hops": 1}),
    ("search_qa", {}),
    ("search_qa", {"min_hops": 3, "max_hops": 3}),
    ("shop", {}),
    ("service", {}),
    ("tool_math", {}),
    ("swe", {}),
]
MAX_STEPS = 64
TASK_CAP = {"swe": 40}
"""Environments whose episodes take seconds (swe runs a real test suite twice per episode)
are measured on fewer tasks."""
SMOKE_OPTIONS: dict[str, dict[str, Any]] = {"swe": {"libraries": ("toolz",), "num_bugs": 3}}
"""With ``--smoke``: swe finds 3 bugs in one library (its 3 x 40 take minutes on a new
machine; they are found once and cached)."""


async def episodes(
    name: str, options: dict[str, Any], policy: str, num_tasks: int
) -> tuple[list[Episode], float]:
    """``policy`` ("oracle" or "random") on ``num_tasks`` test tasks, and the seconds taken."""
    spec = make_env_family(name, **options)
    played = []
    t0 = time.perf_counter()
    for index in range(num_tasks):
        task = spec.task(index, "test")
        if policy == "oracle" and isinstance(spec, HasOracle):
            act = spec.oracle(task)
        else:
            act = replay(spec.demonstration(task, random.Random(index)))
        played.append(await play(spec.make_env(), task, act, seed=index, max_steps=MAX_STEPS))
    return played, time.perf_counter() - t0


def measure(name: str, options: dict[str, Any], num_tasks: int) -> dict[str, Any]:
    spec = make_env_family(name, **options)
    chance = float(getattr(spec, "chance", math.nan))
    randoms, random_s = asyncio.run(episodes(name, options, "random", num_tasks))
    row: dict[str, Any] = {
        "env": name,
        "options": options,
        "tasks": num_tasks,
        "chance": chance,
        "random_success": sum(e.success for e in randoms) / num_tasks,
        "random_reward": sum(e.reward for e in randoms) / num_tasks,
        "random_episodes_per_s": num_tasks / random_s,
        "oracle_success": None,
        "oracle_reward": None,
        "oracle_turns": None,
        "oracle_episodes_per_s": None,
    }
    expected = float(getattr(spec, "oracle_success", 1.0))
    # 0.99, or an oracle that cannot always win held to its expectation less 3 standard errors
    row["oracle_required"] = min(
        0.99, expected - 3 * math.sqrt(expected * (1 - expected) / num_tasks)
    )
    if isinstance(spec, HasOracle):
        oracles, oracle_s = asyncio.run(episodes(name, options, "oracle", num_tasks))
        row["oracle_success"] = sum(e.success for e in oracles) / num_tasks
        row["oracle_reward"] = sum(e.reward for e in oracles) / num_tasks
        row["oracle_turns"] = sum(len(e.actions) for e in oracles) / num_tasks
        row["oracle_episodes_per_s"] = num_tasks / oracle_s
    # "Low": at most 20%, or no more than chance allows where chance is high by construction
    # (the bandit has two arms: a random pull picks the better one half the time).
    margin = 3 * math.sqrt(max(chance, 0.01) * (1 - min(chance, 0.99)) / num_tasks)
    row["random_low"] = row["random_success"] <= max(0.2, chance + margin)
    row["oracle_ok"] = (
        row["oracle_success"] is None or row["oracle_success"] >= row["oracle_required"]
    )
    return row


def label(row: dict[str, Any]) -> str:
    options = ", ".join(f"{k}={v}" for k, v in row["options"].items())
    return f"{row['env']} ({options})" if options else row["env"]


def table(rows: list[dict[str, Any]]) -> str:
    def num(value: float | None, digits: int = 3) -> str:
        return "n/a" if value is None else f"{value:.{digits}f}"

    lines = [
        "| environment | tasks | oracle success | required | random success | chance "
        "| oracle reward | random reward | oracle turns | episodes/s (random) "
        "| episodes/s (oracle) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        required = "n/a" if r["oracle_success"] is None else f">= {r['oracle_required']:.3f}"
        lines.append(
            f"| {label(r)} | {r['tasks']} | {num(r['oracle_success'])} | {required} "
            f"| {num(r['random_success'])} | {num(r['chance'])} | {num(r['oracle_reward'])} "
            f"| {num(r['random_reward'])} | {num(r['oracle_turns'], 1)} "
            f"| {num(r['random_episodes_per_s'], 0)} | {num(r['oracle_episodes_per_s'], 0)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=200, help="test tasks per environment")
    parser.add_argument(
        "--only", nargs="+", default=None,
        help="measure these environments and keep the other rows of an existing result",
    )  # fmt: skip
    args = parse_args(parser, "envs", {"tasks": 2})
    kept: dict[str, dict[str, Any]] = {}
    if args.only and args.out.with_suffix(".json").is_file():
        for row in json.loads(args.out.with_suffix(".json").read_text())["rows"]:
            kept[label(row)] = row
    rows = []
    for name, options in CONFIGS:
        if args.smoke:
            options = {**options, **SMOKE_OPTIONS.get(name, {})}
        if args.only and name not in args.only:
            key = label({"env": name, "options": options})
            if key in kept:
                rows.append(kept[key])
            continue
        rows.append(measure(name, options, min(args.tasks, TASK_CAP.get(name, args.tasks))))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, one process",
        "python": platform.python_version(),
        "tasks": args.tasks,
    }
    failures = [label(r) for r in rows if not (r["oracle_ok"] and r["random_low"])]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    md = [
        f"# Environments ({meta['date']}, {meta['machine']}, {args.tasks} test tasks each; "
        "the tasks column says where fewer)",
        "",
        table(rows),
        "",
        "- oracle: the family's scripted policy; required: 0.99, or for slippery ice (where no "
        "policy can always win) the oracle's exact expected success less 3 standard errors.",
        "- random: the family's demonstrations replayed (valid calls, random content); chance: "
        "the family's declared random success (exact for FrozenLake and the bandit, estimated "
        "for Sokoban). The bandit's is 1/2 by construction (two arms); its learning signal is "
        "the payout: 0.20 expected at random, 0.25 for the better arm.",
        "- search_qa: the oracle searches each hop's entity by name, in order (one search per "
        "hop), and answers with what it read; the random policy searches a random word of the "
        "question and answers a random name that search showed (chance, a blind guess: 1 / "
        "number of entities). secret_lookup "
        "without its tool (the learning proof's control) is not listed: its oracle is chance.",
        "- episodes/s: one process, no model; random: task generation + reset + steps; oracle: "
        "the same plus the oracle's planning (Sokoban: a breadth-first solver).",
        "- swe: 40 test tasks (the test split is one validated bug in five of 40 per library, "
        "so bugs repeat); the oracle reads the lines around the bug, makes the inverse edit, "
        "runs the failing tests and answers; the random policy reads a random module, runs "
        "one test file and answers; each episode runs tests in the sandbox twice (its own "
        "run and the grading run of the whole suite). The bugs are found once per machine "
        "(`python -m turnrl.envs.swe`) and are not timed.",
        f"- all requirements met: {'yes' if not failures else 'NO: ' + ', '.join(failures)}",
    ]
    args.out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print(table(rows))
    if failures:
        raise SystemExit(f"requirements not met: {', '.join(failures)}")


if __name__ == "__main__":
    main()
