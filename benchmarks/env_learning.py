"""The tiny model learns task families with RL: each recipe trains from its own warm-up
(format only: the warm-up replays the environment's random policy) for the same
wall-clock budget, and the held-out success curve says how far above its start it got.

    python benchmarks/env_learning.py          # search_qa, frozen_lake (4x4, 3x3), bandit, atlas
    python benchmarks/env_learning.py --runs bandit --minutes 5 --jobs 1
    python benchmarks/env_learning.py --runs frozen_lake,env.size=5,env.max_moves=12 ...
    python benchmarks/env_learning.py --smoke  # the same runs, 2 steps of a tiny model each

A run is ``RECIPE[,KEY=VALUE...]``: the recipe as shipped (recipes/RECIPE.toml) with those
overrides, which the results record; or ``examples/NAME.py[,KEY=VALUE...]``: a user's
environment as the example defines it (``make_task``, ``make_env``, its ``RECIPE`` and
``demonstrate`` if it has them), built through the public API (the warm-up derived where
it gives none, the corpus derived). Writes benchmarks/results/env_learning.json and .md;
runs already there that this invocation did not make are kept (each records its own date
and machine), so one recipe can be re-run alone. Run directories go to benchmarks/runs
(``--out``, ``--runs-dir``; ``--smoke``: a temporary directory).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import runpy
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from outputs import parse_args
from training_runs import (
    TINY_RUN,
    curve_lines,
    eval_curve,
    run_side_by_side,
    threads_per_job,
    write_results,
)
from turnrl import Environment, load_config, make_env_family, train

ROOT = Path(__file__).resolve().parent
RUNS = [
    "search_qa",
    "frozen_lake",
    "frozen_lake,env.size=3,env.max_moves=6,env.max_turns=6,rollout.max_turns=6",
    "bandit",
    "examples/atlas.py",
]
SMOKE_RUNS = [",".join([run, *TINY_RUN]) for run in RUNS]


def run_recipe(
    number: int, run: str, minutes: float, runs: Path, threads: int, machine: str
) -> dict[str, Any]:
    name, *overrides = run.split(",")
    config, env = load_run(name, [*overrides, f"max_minutes={minutes}", f"threads={threads}"])
    run_dir = runs / f"env-{number}-{Path(name).stem}"
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    result = train(config, env=env, out=run_dir, progress=False)
    wall = time.perf_counter() - t0
    curve = eval_curve(result.rows)
    tail = [v for _, _, v in curve[-5:]]
    spec = env or make_env_family(config.env.name, **config.env.options)
    return {
        "run": run,
        "recipe": name,
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine,
        "budget_minutes": minutes,
        "overrides": overrides,
        "env": getattr(spec, "name", config.env.name),
        "chance": getattr(spec, "chance", None),
        "start_success": curve[0][2],
        "final_success": curve[-1][2],
        "last5_mean": sum(tail) / len(tail),
        "best_success": max(v for _, _, v in curve),
        "steps": curve[-1][0],
        "wall_minutes": round(wall / 60, 2),
        "alarms": [a.name for a in result.alarms],
        "curve": curve,
    }


def load_run(name: str, overrides: list[str]) -> tuple[Any, Any]:
    """The configuration of a run and its environment family: None for a recipe (it names
    its own), an ``Environment`` of the example's ``make_task`` and ``make_env``."""
    if not name.endswith(".py"):
        return load_config(name, overrides), None
    example = runpy.run_path(str(ROOT.parent / name))
    env = Environment(
        example["make_task"], example["make_env"], name=Path(name).stem,
        demonstrate=example.get("demonstrate"),
    )  # fmt: skip
    return load_config(example.get("RECIPE", "grpo"), overrides), env


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| recipe | overrides | chance | start | final | mean of last 5 evals | best | steps "
        "| wall min |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        chance = "-" if r["chance"] is None else f"{r['chance']:.3f}"
        lines.append(
            f"| {r['recipe']} | {' '.join(r['overrides']) or '-'} | {chance} | "
            f"{r['start_success']:.2f} | {r['final_success']:.2f} | {r['last5_mean']:.2f} | "
            f"{r['best_success']:.2f} | {r['steps']} | {r['wall_minutes']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=RUNS, metavar="RECIPE[,KEY=VALUE...]")
    parser.add_argument("--minutes", type=float, default=15.0, help="RL budget per recipe")
    parser.add_argument("--jobs", type=int, default=2, help="recipes trained side by side")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per recipe (default: the cores shared by the jobs)",
    )
    args = parse_args(parser, "env_learning", {"runs": SMOKE_RUNS, "minutes": 0.5}, runs=True)
    for run in args.runs:  # fail before any training on a bad recipe or override
        name, *overrides = run.split(",")
        load_run(name, overrides)
    threads = threads_per_job(args.jobs) if args.threads is None else args.threads
    machine = (f"{platform.machine()}, {multiprocessing.cpu_count()} cores, {args.jobs} "
               f"recipes at a time with {threads or 'default'} torch thread(s) each")  # fmt: skip
    results = run_side_by_side(
        run_recipe,
        [
            (n, run, args.minutes, args.runs_dir, threads, machine)
            for n, run in enumerate(args.runs)
        ],
        args.jobs,
        lambda r: print(table([r]), flush=True),
    )
    meta = {"torch": torch.__version__}
    kept = [r for r in previous_runs(args.out) if r["run"] not in args.runs]
    results = kept + results
    md = ["# The tiny model learns task families", ""]
    md += ["Each run: the recipe's RL budget in minutes after its warm-up (format only: the "
           "environment's random policy replayed), held-out success on the recipe's eval "
           "tasks; chance is the environment's own estimate for a random policy.", ""]  # fmt: skip
    md += [table(results), ""]
    md += [f"- {r['run']}: {r['date']}, {r['machine']}, {r['budget_minutes']} min" for r in results]
    md += ["", *curve_lines(results, "run")]
    write_results(args.out, meta, results, md)
    print(table(results))


def previous_runs(out: Path) -> list[dict[str, Any]]:
    """The runs an earlier invocation wrote to ``out``.json (none if there is none)."""
    path = out.with_suffix(".json")
    return list(json.loads(path.read_text())["runs"]) if path.is_file() else []


if __name__ == "__main__":
    main()
