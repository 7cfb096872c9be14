"""Every preset trains on the secret-lookup probe: same seed, same warm-up checkpoint,
same wall-clock budget; a table of how far each gets.

The tiny model and its syntax-only warm-up are built once (``learning_proof`` recipe
settings, with ``--echo-steps`` of generic copying: 6000 by default, where the learning
proof uses 2500); every preset then starts RL from that checkpoint (``model.path``, no
further warm-up), with its own algorithm knobs (recipes/NAME.toml, docs/papers.md).

Why 6000: at 2500 echo steps the tiny model's in-context copying is unfinished (echo loss
still falling), and only turn-level credit (GiGPO) got past it in 15 minutes; with the
copying finished, GRPO and RLOO learn the probe too (README, "Algorithms and presets"). The start model is the same for every preset either way.

    python benchmarks/presets.py --minutes 15        # all presets, 2 at a time
    python benchmarks/presets.py --presets grpo gigpo --minutes 3 --jobs 1
    python benchmarks/presets.py --echo-steps 2500   # the learning proof's base model

Writes benchmarks/results/presets.json and .md.
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

from training_runs import curve_lines, eval_curve, first_reaching, run_side_by_side, write_results
from turnrl.trainer.config import load_config
from turnrl.trainer.loop import train

ROOT = Path(__file__).resolve().parent
PRESETS = ["grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "ppo", "gspo", "starpo_s", "gigpo"]
PROBE = [  # the learning proof's probe and evaluation, whatever the preset's base says
    "env.num_keys=2", "env.key_pool=2", "env.num_values=12",
    "eval.every=10", "eval.num_tasks=128", "steps=5000", "save_every=100000",
]  # fmt: skip


def warmup_checkpoint(runs: Path, seed: int, echo_steps: int) -> Path:
    """Build the tiny model and run the warm-up once; return the policy RL starts from."""
    run_dir = runs / f"warmup-seed{seed}-echo{echo_steps}"
    start = run_dir / "start_model"
    if not (start / "config.json").is_file():
        shutil.rmtree(run_dir, ignore_errors=True)
        overrides = [f"seed={seed}", "steps=0", f"model.echo_steps={echo_steps}"]
        train(load_config("learning_proof", overrides), run_dir, progress=False)
    return start


def run_preset(
    name: str, start: Path, seed: int, minutes: float, runs: Path, threads: int
) -> dict[str, Any]:
    overrides = [
        *PROBE, f"seed={seed}", f"model.path={start}", "warmup.steps=0",
        f"max_minutes={minutes}", f"threads={threads}",
    ]  # fmt: skip
    config = load_config(name, overrides)
    run_dir = runs / f"preset-{name}"
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    result = train(config, run_dir, progress=False)
    wall = time.perf_counter() - t0
    curve = eval_curve(result.rows)
    reached = first_reaching(curve, 0.8)
    return {
        "preset": name,
        "start_success": curve[0][2],
        "final_success": curve[-1][2],
        "best_success": max(v for _, _, v in curve),
        "steps": curve[-1][0],
        "step_reaching_80": reached[0] if reached else None,
        "minutes_to_80": round(reached[1] / 60, 2) if reached else None,
        "wall_minutes": round(wall / 60, 2),
        "alarms": [a.name for a in result.alarms],
        "curve": curve,
    }


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| preset | start | final | best | steps | steps to 80% | minutes to 80% | wall min |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['preset']} | {r['start_success']:.2f} | {r['final_success']:.2f} | "
            f"{r['best_success']:.2f} | {r['steps']} | {r['step_reaching_80'] or '-'} | "
            f"{r['minutes_to_80'] or 'not reached'} | {r['wall_minutes']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=PRESETS, choices=PRESETS)
    parser.add_argument("--minutes", type=float, default=8.0, help="RL budget per preset")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--echo-steps",
        type=int,
        default=6000,
        help="generic copying steps of the shared base model",
    )
    parser.add_argument("--jobs", type=int, default=2, help="presets trained side by side")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "presets")
    args = parser.parse_args()
    runs = ROOT / "runs"
    start = warmup_checkpoint(runs, args.seed, args.echo_steps)
    threads = max(1, multiprocessing.cpu_count() // args.jobs)
    results = run_side_by_side(
        run_preset,
        [(name, start, args.seed, args.minutes, runs, threads) for name in args.presets],
        args.jobs,
        lambda r: print(table([r]), flush=True),
    )
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {multiprocessing.cpu_count()} cores, "
        f"{args.jobs} presets at a time with {threads} torch thread(s) each",
        "torch": torch.__version__,
        "budget_minutes": args.minutes,
        "seed": args.seed,
        "echo_steps": args.echo_steps,
    }
    md = [f"# Presets on the secret-lookup probe ({meta['date']}, {meta['machine']})", ""]
    md += [f"Budget: {args.minutes} minutes of RL per preset, seed {args.seed}, from one "
           f"warm-up checkpoint (base model: {args.echo_steps} echo steps); held-out success "
           "on 128 tasks (chance 0.083).", ""]  # fmt: skip
    md += [table(results), "", *curve_lines(results, "preset")]
    write_results(args.out, meta, results, md)
    print(table(results))


if __name__ == "__main__":
    main()
