"""On-policy distillation against RL alone: a tiny student distilled from a trained tiny
teacher, and the same student trained by RL, each until it reaches the teacher's held-out
success (or its step budget ends).

The teacher is the quick-start recipe (recipes/quickstart.toml: the tiny model, its warm-up,
GiGPO on the secret-lookup probe) on ``--teacher-seed``, trained until its held-out success
first reaches ``--teacher-bar`` (its checkpoint at that evaluation is the teacher; the
quick-start's seed 2 gets there in about 110 steps). Each student seed then builds its own
tiny model and warm-up once (the quick-start's, with that seed: another initialisation, the
same tokenizer), and from that checkpoint:

- ``rl``: the quick-start's RL, unchanged;
- ``distill``: pure on-policy distillation (``algorithm.teacher.alone``, coef
  ``--coef``): the advantage of every sampled token is minus its reverse KL to the teacher,
  the rewards are not trained on;
- ``rl+distill`` (``--arms``): the quick-start's RL advantage plus the teacher's term.

A student reaches the teacher's success when one of its held-out evaluations (128 tasks,
every ``--eval-every`` steps) is at least the teacher's minus ``--tolerance`` (one
evaluation's standard error near 0.85 is about 0.03); it stops there.

    python benchmarks/distill.py                       # teacher seed 2, students 0 and 1
    python benchmarks/distill.py --seeds 0 --arms distill --max-steps 60
    python benchmarks/distill.py --teacher runs/quickstart/checkpoints/step_000110 \\
        --teacher-success 0.84                            # a teacher trained before
    python benchmarks/distill.py --resume --max-steps 240  # the same runs, continued
    python benchmarks/distill.py --smoke               # tiny: 2 steps, seconds

Writes benchmarks/results/distill.json and .md; run directories go to benchmarks/runs
(``--out``, ``--runs-dir``; ``--smoke``: a temporary directory).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import platform
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from outputs import parse_args
from training_runs import TINY_RUN, curve_lines, eval_curve, run_side_by_side, write_results
from turnrl import load_config, train

RECIPE = "quickstart"
ARMS = {
    "rl": [],
    "distill": ["algorithm.teacher.alone=true"],
    "rl+distill": [],
}
"""Each arm's overrides beyond the teacher's path and coef (``rl`` has no teacher)."""
SEEDS = [0, 1]


class Reached(Exception):
    """Raised from a run's ``on_row`` to end it at the evaluation that met its goal."""


def probe(eval_every: int, threads: int, smoke: bool) -> list[str]:
    """What every run shares: no time budget (steps end it), an evaluation (and, for the
    teacher, a checkpoint) every ``eval_every`` steps, one torch thread count."""
    tiny = TINY_RUN if smoke else []
    return [*tiny, "max_minutes=0", f"eval.every={eval_every}", f"save_every={eval_every}",
            f"threads={threads}"]  # fmt: skip


def train_teacher(
    seed: int, bar: float, max_steps: int, eval_every: int, runs: Path, threads: int, smoke: bool
) -> dict[str, Any]:
    """The quick-start on ``seed`` until an evaluation after step 0 reaches ``bar`` (the
    run ends one step later, when that step's checkpoint is written), else ``max_steps``;
    the checkpoint of its best evaluation is the teacher."""
    torch.set_num_threads(threads)
    run_dir = runs / f"distill-teacher-seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    config = load_config(RECIPE, [*probe(eval_every, threads, smoke), f"seed={seed}",
                                  f"steps={max_steps}"])  # fmt: skip
    rows: list[dict[str, Any]] = []
    reached: list[int] = []

    def on_row(row: dict[str, Any]) -> None:
        rows.append(row)
        if reached and row["step"] > reached[0]:
            raise Reached  # the step that reached it was saved before this row
        if row["step"] > 0 and row.get("eval/success_mean", -1.0) >= bar:
            reached.append(int(row["step"]))

    t0 = time.perf_counter()
    with contextlib.suppress(Reached):
        train(config, out=run_dir, progress=False, on_row=on_row)
    curve = eval_curve(rows)
    checkpoints = run_dir / "checkpoints"
    saved = [(s, v) for s, _, v in curve if s > 0 and (checkpoints / f"step_{s:06d}").is_dir()]
    step, success = max(saved, key=lambda sv: (sv[1], -sv[0]))
    return {
        "seed": seed,
        "bar": bar,
        "reached_bar": bool(reached),
        "step": step,
        "success": success,
        "checkpoint": str(run_dir / "checkpoints" / f"step_{step:06d}"),
        "wall_minutes": round((time.perf_counter() - t0) / 60, 2),
        "curve": curve,
    }


def build_student(
    seed: int, eval_every: int, runs: Path, threads: int, smoke: bool
) -> dict[str, Any]:
    """The quick-start's tiny model and warm-up on ``seed``, built once: the checkpoint
    every arm of that seed starts from."""
    torch.set_num_threads(threads)
    run_dir = runs / f"distill-student-seed{seed}"
    start = run_dir / "start_model"
    if not (start / "config.json").is_file():
        shutil.rmtree(run_dir, ignore_errors=True)
        overrides = [*probe(eval_every, threads, smoke), f"seed={seed}", "steps=0"]
        train(load_config(RECIPE, overrides), out=run_dir, progress=False)
    return {"seed": seed, "start": str(start)}


def run_arm(
    arm: str,
    seed: int,
    start: str,
    teacher: dict[str, Any],
    coef: float,
    target: float,
    max_steps: int,
    eval_every: int,
    runs: Path,
    threads: int,
    smoke: bool,
    resume: bool = False,
) -> dict[str, Any]:
    """One arm from seed ``seed``'s warm-up checkpoint until an evaluation reaches
    ``target`` (the run ends there) or ``max_steps``; with ``resume``, an earlier run of it
    (a smaller ``max_steps``) continues from its last checkpoint."""
    torch.set_num_threads(threads)
    run_dir = runs / f"distill-{arm.replace('+', '-')}-seed{seed}"
    resume = resume and (run_dir / "checkpoints").is_dir()
    if not resume:
        shutil.rmtree(run_dir, ignore_errors=True)
    teach = [] if arm == "rl" else [f"algorithm.teacher.path={teacher['checkpoint']}",
                                     f"algorithm.teacher.coef={coef}"]  # fmt: skip
    overrides = [*probe(eval_every, threads, smoke), f"seed={seed}", f"model.path={start}",
                 "warmup.steps=0", f"steps={max_steps}", *teach, *ARMS[arm]]  # fmt: skip
    rows: list[dict[str, Any]] = []

    def on_row(row: dict[str, Any]) -> None:
        rows.append(row)
        if row.get("eval/success_mean", -1.0) >= target:
            raise Reached

    t0 = time.perf_counter()
    with contextlib.suppress(Reached):
        config = load_config(RECIPE, overrides)
        train(config, out=run_dir, resume=resume, progress=False, on_row=on_row)
    if resume:  # the whole run's rows, its RL time counted across the resume
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        offset, last = 0.0, 0.0
        for row in rows:
            if "perf/elapsed_s" in row:
                if row["perf/elapsed_s"] + offset < last:
                    offset = last
                row["perf/elapsed_s"] += offset
                last = row["perf/elapsed_s"]
    curve = eval_curve(rows)
    reached = next(((s, t) for s, t, v in curve if v >= target), None)
    kl = [r["distill/reverse_kl_mean"] for r in rows if "distill/reverse_kl_mean" in r]
    return {
        "arm": arm,
        "seed": seed,
        "date": time.strftime("%Y-%m-%d"),
        "start_success": curve[0][2],
        "best_success": max(v for _, _, v in curve),
        "steps": curve[-1][0],
        "step_reaching_target": reached[0] if reached else None,
        "minutes_to_target": round(reached[1] / 60, 2) if reached else None,
        "seconds_per_step": round(curve[-1][1] / max(curve[-1][0], 1), 2),
        "reverse_kl_first": kl[0] if kl else None,
        "reverse_kl_last": kl[-1] if kl else None,
        "wall_minutes": round((time.perf_counter() - t0) / 60, 2),
        "curve": curve,
    }


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(results: list[dict[str, Any]], max_steps: int) -> str:
    lines = [
        "| student seed | arm | start | best | final (step) | steps to target "
        "| minutes to target | s per step | reverse KL first -> last |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: (r["seed"], list(ARMS).index(r["arm"]))):
        steps = r["step_reaching_target"]
        kl = "-" if r["reverse_kl_first"] is None else (
            f"{r['reverse_kl_first']:.3f} -> {r['reverse_kl_last']:.3f}"
        )  # fmt: skip
        lines.append(
            f"| {r['seed']} | {r['arm']} | {r['start_success']:.2f} | {r['best_success']:.2f} "
            f"| {r['curve'][-1][2]:.2f} ({r['steps']}) "
            f"| {steps if steps is not None else 'not within ' + str(r['steps'])} "
            f"| {fmt(r['minutes_to_target'])} | {r['seconds_per_step']} | {kl} |"
        )
    return "\n".join(lines)


def save(out: Path, meta: dict[str, Any], results: list[dict[str, Any]]) -> None:
    t = meta["teacher"]
    md = ["# On-policy distillation against RL alone on the secret-lookup probe", ""]
    where = (
        f"the quick-start recipe on seed {t['seed']}, its checkpoint at step {t['step']}"
        if t["seed"] is not None
        else t["checkpoint"]
    )
    md += [
        f"Teacher: {where} (held-out success {t['success']:.2f} on {meta['eval_tasks']} tasks; "
        f"{'it reached' if t['reached_bar'] else 'best; it did not reach'} the bar of "
        f"{t['bar']:.2f}). Target: {meta['target']:.2f}, the teacher's success minus "
        f"{meta['tolerance']:.2f}. Each student seed builds its own tiny model and warm-up (the "
        "quick-start's: another initialisation, the same tokenizer); every arm starts from "
        f"it and stops at the first evaluation (every {meta['eval_every']} steps) at the "
        f"target, or after {meta['max_steps']} steps. `rl`: the quick-start's GiGPO; "
        f"`distill`: pure on-policy distillation, coef {meta['coef']} (the advantage of each "
        "sampled token is minus its reverse KL to the teacher; rewards not trained on); "
        "`rl+distill`: both. Reverse KL: `distill/reverse_kl_mean` (nats per sampled "
        f"token) at the first and last step. {meta['machine']}; torch {meta['torch']}."
        + (
            " Runs continued (`--resume`) from their checkpoints of an earlier, shorter "
            "budget; minutes count RL time across both."
            if meta.get("resumed")
            else ""
        ),
        "",
        table(results, meta["max_steps"]),
        "",
        f"- teacher, seed {t['seed']} (step:held-out success): "
        + ", ".join(f"{s}:{v:.2f}" for s, _, v in t["curve"]),
        *curve_lines([{**r, "label": f"{r['arm']}, seed {r['seed']}"} for r in results], "label"),
    ]
    write_results(out, meta, results, md)


def announce(teacher: dict[str, Any]) -> None:
    print(f"teacher: step {teacher['step']}, held-out success {teacher['success']:.2f}", flush=True)


def built(student: dict[str, Any]) -> None:
    print(f"student seed {student['seed']}: {student['start']}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=SEEDS, help="student seeds")
    parser.add_argument("--arms", nargs="+", default=["rl", "distill"], choices=list(ARMS))
    parser.add_argument("--teacher-seed", type=int, default=2)
    parser.add_argument("--teacher-bar", type=float, default=0.8)
    parser.add_argument("--teacher-steps", type=int, default=250, help="the teacher's budget")
    parser.add_argument(
        "--teacher", default="", help="a teacher checkpoint to use instead of training one"
    )
    parser.add_argument("--teacher-success", type=float, default=0.0,
                        help="with --teacher: its held-out success")  # fmt: skip
    parser.add_argument("--coef", type=float, default=1.0, help="algorithm.teacher.coef")
    parser.add_argument("--tolerance", type=float, default=0.05)
    parser.add_argument("--max-steps", type=int, default=150, help="each arm's step budget")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument(
        "--resume", action="store_true",
        help="continue each arm's earlier run (in --runs-dir) up to --max-steps, with the "
        "teacher of --out's results",
    )  # fmt: skip
    parser.add_argument(
        "--render", action="store_true", help="only rewrite the .md from the .json, no training"
    )
    smoke = {"seeds": [0, 1], "arms": list(ARMS), "teacher_steps": 2, "teacher_bar": 0.0,
             "max_steps": 2, "eval_every": 1, "tolerance": -1.5}  # fmt: skip
    # --smoke: a target above 1 (the teacher's success + 1.5), never reached: every arm
    # runs its two steps
    args = parse_args(parser, "distill", smoke, runs=True)
    if args.render:
        old = json.loads(args.out.with_suffix(".json").read_text())
        save(args.out, {k: v for k, v in old.items() if k != "runs"}, old["runs"])
        return
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    machine = (
        f"{platform.machine()}, {multiprocessing.cpu_count()} cores, one run at a time, "
        f"{args.threads} torch thread(s)"
    )
    earlier = args.out.with_suffix(".json")
    if args.resume and earlier.is_file():  # the teacher the runs being continued learnt from
        teacher = json.loads(earlier.read_text())["teacher"]
    elif args.teacher:
        teacher = {
            "seed": None, "bar": args.teacher_bar, "reached_bar": True, "step": None,
            "success": args.teacher_success, "checkpoint": args.teacher, "curve": [],
        }  # fmt: skip
    else:
        call = (args.teacher_seed, args.teacher_bar, args.teacher_steps, args.eval_every,
                args.runs_dir, args.threads, args.smoke)  # fmt: skip
        (teacher,) = run_side_by_side(train_teacher, [call], 1, announce)
    target = teacher["success"] - args.tolerance
    builds = [(s, args.eval_every, args.runs_dir, args.threads, args.smoke) for s in args.seeds]
    starts = {b["seed"]: b["start"] for b in run_side_by_side(build_student, builds, 1, built)}
    meta = {
        "torch": torch.__version__,
        "machine": machine,
        "teacher": teacher,
        "target": target,
        "tolerance": args.tolerance,
        "coef": args.coef,
        "max_steps": args.max_steps,
        "eval_every": args.eval_every,
        "eval_tasks": load_config(RECIPE, probe(1, 1, args.smoke)).eval.num_tasks,
        "smoke": args.smoke,
        "resumed": args.resume,
    }
    calls = [
        (arm, seed, starts[seed], teacher, args.coef, target, args.max_steps, args.eval_every,
         args.runs_dir, args.threads, args.smoke, args.resume)
        for seed in args.seeds for arm in args.arms
    ]  # fmt: skip
    done: list[dict[str, Any]] = []

    def finished(row: dict[str, Any]) -> None:  # saved as each run ends: nothing is lost
        done.append(row)
        print(table([row], args.max_steps), flush=True)
        save(args.out, meta, done)

    run_side_by_side(run_arm, calls, 1, finished)
    print(table(done, args.max_steps))


if __name__ == "__main__":
    main()
