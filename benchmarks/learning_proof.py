"""The learning proof: the tiny model learns the secret-lookup probe with RL, and the
controls do not.

For each seed: build the tiny model, run the syntax-only warm-up, then RL (GiGPO credit) on the
secret-lookup environment within a wall-clock budget; record the held-out success curve.
Two controls run with the same recipe and budget (seed 0): rewards shuffled across the
batch, and the lookup tool removed. Chance is 1 / num_values.

    python benchmarks/learning_proof.py                 # 3 seeds + 2 controls
    python benchmarks/learning_proof.py --seeds 0 --no-controls --minutes 5
    python benchmarks/learning_proof.py --jobs 2        # two runs side by side, 1 thread each
    python benchmarks/learning_proof.py --seeds --eval-tasks 512   # the controls, 512 tasks
    python benchmarks/learning_proof.py --seeds --controls no-tools --eval-tasks 512
    python benchmarks/learning_proof.py --smoke   # seed 0 + controls, 2 steps of a tiny model

Writes benchmarks/results/learning_proof.json and .md (a table and the curves); run
directories go to benchmarks/runs (``--out``, ``--runs-dir``; ``--smoke``: a temporary
directory).
"""

from __future__ import annotations

import argparse
import multiprocessing
import platform
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
    first_reaching,
    run_side_by_side,
    threads_per_job,
    write_results,
)
from turnrl import load_config, make_env_family, train

ROOT = Path(__file__).resolve().parent


CONTROLS = {
    "shuffled-rewards": ["seed=0", "algorithm.control=shuffled_rewards"],
    "no-tools": ["seed=0", "env.tools_enabled=false"],
}


def run_one(
    label: str, overrides: list[str], minutes: float, runs: Path, threads: int = 0
) -> dict[str, Any]:
    config = load_config(
        "learning_proof", [*overrides, f"max_minutes={minutes}", f"threads={threads}"]
    )
    run_dir = runs / label
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    result = train(config, out=run_dir, progress=False)
    wall = time.perf_counter() - t0
    curve = eval_curve(result.rows)
    reached = first_reaching(curve, 0.9)
    family = make_env_family(config.env.name, **config.env.options)
    chance = family.chance  # type: ignore[attr-defined]
    return {
        "label": label,
        "overrides": overrides,
        "chance": chance,
        "start_success": curve[0][2],
        "final_success": curve[-1][2],
        "best_success": max(v for _, _, v in curve),
        "steps": curve[-1][0],
        "step_reaching_90": reached[0] if reached else None,
        "minutes_to_90": round(reached[1] / 60, 2) if reached else None,
        "wall_minutes": round(wall / 60, 2),
        "threads": threads or torch.get_num_threads(),
        "curve": curve,
        "run_dir": str(run_dir),
    }


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| run | chance | start | final | best | mean of evals | steps | minutes to 90% "
        "| wall minutes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        values = [v for _, _, v in r["curve"]]
        lines.append(
            f"| {r['label']} | {r['chance']:.3f} | {r['start_success']:.3f} | "
            f"{r['final_success']:.3f} | {r['best_success']:.3f} | "
            f"{sum(values) / len(values):.3f} | {r['steps']} | "
            f"{r['minutes_to_90'] if r['minutes_to_90'] is not None else 'not reached'} | "
            f"{r['wall_minutes']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seeds", type=int, nargs="*", default=[0, 1, 2], help="none: the controls only"
    )
    parser.add_argument("--minutes", type=float, default=15.0, help="budget per run")
    parser.add_argument("--no-controls", action="store_true")
    parser.add_argument(
        "--controls", nargs="+", choices=sorted(CONTROLS), default=sorted(CONTROLS),
        help="which controls to run (default: both)",
    )  # fmt: skip
    parser.add_argument(
        "--eval-tasks", type=int, default=0,
        help="held-out tasks per evaluation (0: the recipe's); 512 makes one evaluation's "
        "standard error at chance 0.012",
    )  # fmt: skip
    parser.add_argument(
        "--jobs", type=int, default=1,
        help="runs side by side, each with cpu_count / jobs torch threads",
    )  # fmt: skip
    smoke = {"seeds": [0], "minutes": 0.5, "jobs": 2}
    args = parse_args(parser, "learning_proof", smoke, runs=True)
    plan = [(f"seed{seed}", [f"seed={seed}"]) for seed in args.seeds]
    if not args.no_controls:
        plan += [(f"control-{name}", CONTROLS[name]) for name in args.controls]
    evals = [f"eval.num_tasks={args.eval_tasks}"] if args.eval_tasks else []
    tiny = TINY_RUN if args.smoke else []
    threads = threads_per_job(args.jobs)
    results = run_side_by_side(
        run_one,
        [
            (label, [*tiny, *overrides, *evals], args.minutes, args.runs_dir, threads)
            for label, overrides in plan
        ],
        args.jobs,
        lambda r: print(table([r]), flush=True),
    )
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {multiprocessing.cpu_count()} cores",
        "torch": torch.__version__,
        "budget_minutes": args.minutes,
        "jobs": args.jobs,
    }
    md = [
        f"# Learning proof ({meta['date']}, {meta['machine']}, {args.jobs} run(s) at a time)",
        "",
        table(results),
        "",
        *curve_lines(results, "label"),
    ]
    write_results(args.out, meta, results, md)
    print(table(results))


if __name__ == "__main__":
    main()
