"""Every preset trains on the secret-lookup probe on several seeds: per seed one warm-up
checkpoint that every preset starts from, the same wall-clock budget; a table of how far
each gets on each seed, its mean and its worst seed.

Per seed, the tiny model and its syntax-only warm-up are built once (``learning_proof``
recipe settings with that seed, and ``--echo-steps`` of generic copying: 6000 by default,
where the learning proof uses 2500); every preset then starts RL on that seed from that
checkpoint (``model.path``, no further warm-up), with its own algorithm knobs
(recipes/NAME.toml, docs/papers.md). The seed changes both the base model and the RL run,
so a preset passes only if it learns from every seed's base model.

Why 6000: at 2500 echo steps the tiny model's in-context copying is unfinished (echo loss
still falling), and only turn-level credit (GiGPO) got past it in 15 minutes; with the
copying finished, every preset learns the probe on seed 0 (docs/measurements.md,
"Presets"; five of them thanks to the KL their recipes add).

    python benchmarks/presets.py --minutes 15        # all presets, seeds 0 1 2, 2 at a time
    python benchmarks/presets.py --presets grpo gigpo --seeds 1 --minutes 3 --jobs 1
    python benchmarks/presets.py --echo-steps 2500   # the learning proof's base model
    python benchmarks/presets.py --presets dapo --set algorithm.kl.coef=0 --merge
    python benchmarks/presets.py --smoke       # grpo and ppo, seeds 0 and 1, 2 steps, tiny

``--seed N`` is ``--seeds N``. ``--set KEY=VALUE`` changes every listed preset (an ablation:
the row is labelled with it); ``--merge`` keeps the rows already in the results file that this
run does not re-measure (a row is one preset, variant and seed), so a table can grow preset
by preset and seed by seed (each row records its own date and machine sharing).

Writes benchmarks/results/presets.json and .md; the warm-up checkpoints and run directories
go to benchmarks/runs (``--out``, ``--runs-dir``; ``--smoke``: a temporary directory).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import shutil
import statistics
import time
from collections.abc import Sequence
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

ROOT = Path(__file__).resolve().parent
PRESETS = ["grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "ppo", "gspo", "starpo_s", "gigpo"]
SEEDS = [0, 1, 2]
PROBE = [  # the learning proof's probe and evaluation, whatever the preset's base says
    "env.num_keys=2", "env.key_pool=2", "env.num_values=12",
    "eval.every=10", "eval.num_tasks=128", "steps=5000", "save_every=100000",
]  # fmt: skip
BAR = 0.8
"""Held-out success every preset must reach on every seed within the budget."""
HOLD = 0.7
"""...and stay above until the budget ends: a run that reached ``BAR`` and then fell below
this (a collapse, not the evaluation's noise of a few points on 128 tasks) did not pass."""
WARMUP_THREADS = 1
"""Torch threads a seed's warm-up is built with (``build_warmup``)."""


def warmup_checkpoint(runs: Path, seed: int, echo_steps: int, extra: Sequence[str] = ()) -> Path:
    """Build the tiny model and run the warm-up once (``extra``: overrides of the
    ``learning_proof`` recipe put first); return the policy RL starts from."""
    run_dir = runs / f"warmup-seed{seed}-echo{echo_steps}"
    start = run_dir / "start_model"
    if not (start / "config.json").is_file():
        shutil.rmtree(run_dir, ignore_errors=True)
        overrides = [*extra, f"seed={seed}", "steps=0", f"model.tiny.echo_steps={echo_steps}"]
        train(load_config("learning_proof", overrides), out=run_dir, progress=False)
    return start


def build_warmup(
    runs: Path, seed: int, echo_steps: int, extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    """``warmup_checkpoint`` in a worker process (so seeds' warm-ups can be built side by
    side), always on one torch thread: a seed's base model then does not depend on
    ``--jobs`` or ``--threads`` (with two threads the float sums of the 6000 echo steps
    come out otherwise, and so does the model). Returns the seed and its start model."""
    torch.set_num_threads(WARMUP_THREADS)
    return {"seed": seed, "start": str(warmup_checkpoint(runs, seed, echo_steps, extra))}


def run_preset(
    name: str,
    start: Path,
    seed: int,
    minutes: float,
    runs: Path,
    threads: int,
    extra: tuple[str, ...] = (),
    unlabelled: tuple[str, ...] = (),
) -> dict[str, Any]:
    """``extra``: overrides the row is labelled with (an ablation); ``unlabelled``: more
    overrides, put before them (--smoke's tiny run)."""
    overrides = [
        *PROBE, *unlabelled, f"seed={seed}", f"model.path={start}", "warmup.steps=0",
        f"max_minutes={minutes}", f"threads={threads}", *extra,
    ]  # fmt: skip
    config = load_config(name, overrides)
    variant = " ".join(extra)
    suffix = "".join(  # algorithm.kl.coef=0.1 -> -kl_coef0.1
        f"-{key.rpartition('.')[2]}{value}" for key, _, value in (o.partition("=") for o in extra)
    )
    run_dir = runs / f"preset-{name}{suffix}-seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    result = train(config, out=run_dir, progress=False)
    wall = time.perf_counter() - t0
    curve = eval_curve(result.rows)
    reached = first_reaching(curve, BAR)
    return {
        "preset": name,
        "variant": variant,
        "seed": seed,
        "date": time.strftime("%Y-%m-%d"),
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


def label(row: dict[str, Any]) -> str:
    """The preset's name, with the ablation's overrides if it ran with any."""
    return f"{row['preset']} ({row['variant']})" if row.get("variant") else row["preset"]


def row_key(row: dict[str, Any]) -> tuple[int, str, int]:
    """What a row measures: its preset (in ``PRESETS`` order), variant and seed."""
    return PRESETS.index(row["preset"]), row.get("variant", ""), row["seed"]


def merged(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``old`` rows that ``new`` does not re-measure (same preset, variant and seed), plus
    ``new``; in preset order, each preset's recipe as shipped before its ablations, then by
    seed."""
    fresh = {row_key(r) for r in new}
    return sorted([r for r in old if row_key(r) not in fresh] + new, key=row_key)


def upgraded(results: dict[str, Any]) -> dict[str, Any]:
    """A results file as this script writes it now. Files written before the benchmark ran
    several seeds hold one ``seed`` in their meta and none in their rows: every row gets
    that seed, and the meta loses it."""
    seed = results.get("seed", 0)
    runs = [{**r, "seed": r.get("seed", seed)} for r in results["runs"]]
    return {**{k: v for k, v in results.items() if k != "seed"}, "runs": runs}


def fmt(value: float | None) -> str:
    """A success (or minutes) to two decimals, ``-`` for none."""
    return "-" if value is None else f"{value:.2f}"


def verdict(row: dict[str, Any]) -> str:
    """``passed``, ``not reached`` (never at ``BAR``) or ``fell`` (reached it, ended below
    ``HOLD``)."""
    if row["step_reaching_80"] is None:
        return "not reached"
    return "fell" if row["final_success"] < HOLD else "passed"


def summary(results: list[dict[str, Any]]) -> str:
    """One row per preset (and ablation): every seed's final / best / minutes to 80%, the
    mean final success over the seeds, the worst seed (lowest final) and the seeds that did
    not pass (``verdict``)."""
    lines = [
        "| preset | seeds | final | best | minutes to 80% | mean final | worst seed (final) "
        f"| every seed reached {BAR:.0%} and ended above {HOLD:.0%} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in sorted(results, key=row_key):
        groups.setdefault(label(r), []).append(r)
    for name, rows in groups.items():
        worst = min(rows, key=lambda r: r["final_success"])
        failed = [f"seed {r['seed']} {verdict(r)}" for r in rows if verdict(r) != "passed"]
        lines.append(
            f"| {name} | {' / '.join(str(r['seed']) for r in rows)} "
            f"| {' / '.join(fmt(r['final_success']) for r in rows)} "
            f"| {' / '.join(fmt(r['best_success']) for r in rows)} "
            f"| {' / '.join(fmt(r['minutes_to_80']) for r in rows)} "
            f"| {statistics.mean(r['final_success'] for r in rows):.2f} "
            f"| {worst['seed']} ({worst['final_success']:.2f}) "
            f"| {'no: ' + ', '.join(failed) if failed else 'yes'} |"
        )
    return "\n".join(lines)


def table(results: list[dict[str, Any]]) -> str:
    """Every run: one row per preset, variant and seed."""
    lines = [
        "| preset | seed | start | final | best | steps | steps to 80% | minutes to 80% "
        "| wall min |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {label(r)} | {r['seed']} | {r['start_success']:.2f} | "
            f"{r['final_success']:.2f} | {r['best_success']:.2f} | {r['steps']} | "
            f"{r['step_reaching_80'] or '-'} | {r['minutes_to_80'] or 'not reached'} | "
            f"{r['wall_minutes']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=PRESETS, choices=PRESETS)
    parser.add_argument("--minutes", type=float, default=8.0, help="RL budget per preset")
    parser.add_argument(
        "--seeds", "--seed", nargs="+", type=int, default=SEEDS,
        help="seeds: each its own base model and warm-up, every preset on each",
    )  # fmt: skip
    parser.add_argument(
        "--echo-steps",
        type=int,
        default=6000,
        help="generic copying steps of the shared base model",
    )
    parser.add_argument("--jobs", type=int, default=2, help="presets trained side by side")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads per preset (0: cores / jobs)"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override for every listed preset (an ablation; the rows are labelled with it)",
    )
    parser.add_argument(
        "--merge", action="store_true", help="keep the rows of --out this run does not re-run"
    )
    parser.add_argument(
        "--render", action="store_true", help="only rewrite the .md from the .json, no training"
    )
    smoke = {"presets": ["grpo", "ppo"], "seeds": [0, 1], "minutes": 0.5, "echo_steps": 2}
    args = parse_args(parser, "presets", smoke, runs=True)
    if args.render:  # e.g. after noting by hand what else ran on the machine beside a row
        old = upgraded(json.loads(args.out.with_suffix(".json").read_text()))
        save(args.out, {k: v for k, v in old.items() if k != "runs"}, merged([], old["runs"]))
        return
    meta = {
        "torch": torch.__version__,
        "budget_minutes": args.minutes,
        "echo_steps": args.echo_steps,
    }
    earlier_rows(args, meta)  # a results file that cannot be merged fails now, not in hours
    tiny = tuple(TINY_RUN) if args.smoke else ()
    seeds = list(dict.fromkeys(args.seeds))
    threads = args.threads or max(1, multiprocessing.cpu_count() // args.jobs)
    warmups = [(args.runs_dir, seed, args.echo_steps, tiny) for seed in seeds]
    starts = {w["seed"]: Path(w["start"]) for w in run_side_by_side(
        build_warmup, warmups, args.jobs, lambda w: print(f"seed {w['seed']}: {w['start']}")
    )}  # fmt: skip
    extra = tuple(args.overrides)
    machine = (
        f"{platform.machine()}, {multiprocessing.cpu_count()} cores, "
        f"{args.jobs} preset(s) at a time in this run, {threads} torch thread(s) each"
    )
    calls = [
        (name, starts[seed], seed, args.minutes, args.runs_dir, threads, extra, tiny)
        for seed in seeds
        for name in args.presets
    ]
    done: list[dict[str, Any]] = []

    def finished(row: dict[str, Any]) -> None:  # saved as each preset ends: nothing is lost
        row["machine"] = machine
        done.append(row)
        print(table([row]), flush=True)
        save(args.out, meta, merged(earlier_rows(args, meta), done))  # re-read: another run may
        # have added rows meanwhile

    results = run_side_by_side(run_preset, calls, args.jobs, finished)
    print(summary(merged(earlier_rows(args, meta), results)))


def earlier_rows(args: argparse.Namespace, meta: dict[str, Any]) -> list[dict[str, Any]]:
    """With ``--merge``, the rows already in the results file (which must have been measured
    with the same budget, torch and base model's echo steps; any seeds); otherwise none."""
    path = args.out.with_suffix(".json")
    if not (args.merge and path.is_file()):
        return []
    old = upgraded(json.loads(path.read_text()))
    if {k: old.get(k) for k in meta} != meta:
        raise SystemExit(f"--merge: {path} was measured with other settings than {meta}")
    rows: list[dict[str, Any]] = old["runs"]
    return rows


def save(out: Path, meta: dict[str, Any], results: list[dict[str, Any]]) -> None:
    """The results file: every row with its curve (.json) and the tables (.md)."""
    dates = sorted({r["date"] for r in results})
    seeds = sorted({r["seed"] for r in results})
    md = ["# Presets on the secret-lookup probe", ""]
    md += [f"Budget: {meta['budget_minutes']} minutes of RL per preset and seed, seeds "
           f"{', '.join(map(str, seeds))}; on each seed every preset starts from that seed's "
           f"warm-up checkpoint (base model: {meta['echo_steps']} echo steps); held-out success "
           f"on 128 tasks (chance 0.083). Measured {', '.join(dates)}; torch {meta['torch']}. "
           "A row with overrides in brackets is an ablation of that preset's recipe.", ""]  # fmt: skip
    md += ["Per preset, every seed (values in seed order; minutes to 80%: `-` if not reached):"]
    md += ["", summary(results), "", "Every run:", "", table(results), ""]
    md += ["Where and how each row ran:", ""]
    md += [f"- {label(r)}, seed {r['seed']}: {r['date']}, {r.get('machine', 'not recorded')}"
           for r in results]  # fmt: skip
    md += ["", *curve_lines([{**r, "label": f"{label(r)}, seed {r['seed']}"} for r in results],
                            "label")]  # fmt: skip
    write_results(out, meta, results, md)


if __name__ == "__main__":
    main()
