"""Reliability: a short run killed with SIGKILL at random points, resumed after each kill,
against the same run uninterrupted; and resumes past damaged checkpoints.

Kills: every attempt is ``turnrl train`` in its own process, wrapped so that it marks
when it enters and leaves a step's rollout, its learner update and a checkpoint write
(``WRAPPER``; nothing else changes). The kills aim at those phases in turn, each at a step
drawn at random (``aims``: in step order, so they spread over the run) and a random fraction
of the phase's mean duration in the uninterrupted run after it began; each records where
it landed. After the last kill the run is
resumed to its end and compared with the uninterrupted one: the metrics (all but timings;
``train/logprob_mismatch`` to 1e-9), and whether every run file (metrics.jsonl,
trajectories.jsonl, alarms.jsonl, the TensorBoard event files) holds each step's records
once, and the same ones.

Damaged checkpoints: a copy of the finished uninterrupted run, its newest checkpoint
damaged one way each case, is resumed to its end (``--resume``): the damage must be
named, the checkpoint before it used, and the result equal the uninterrupted run. The
last case damages every checkpoint: the resume must stop with a clear error.

    python benchmarks/reliability.py              # 10 kills of a 12-step run, 7 damages
    python benchmarks/reliability.py --kills 30 --seed 1
    python benchmarks/reliability.py --smoke      # 3 kills of a 6-step run, 2 damages

Writes benchmarks/results/reliability.json and .md; run directories go to benchmarks/runs
(``--out``, ``--runs-dir``; ``--smoke``: a temporary directory).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from outputs import parse_args
from training_runs import TINY_RUN

RUN = [*TINY_RUN, "model.echo_steps=0", "log.tensorboard=true",
       # an alarm a few steps in, so alarms.jsonl has a record to keep once
       "monitor.warmup_steps=3", "monitor.window=1", "monitor.entropy_jump=1e-6"]  # fmt: skip
PHASES = ("rollout", "learner", "checkpoint")

WRAPPER = """
import os, sys, time
import turnrl.trainer.loop as loop
import turnrl.trainer.step as step
from turnrl.cli import main
from turnrl.trainer.learner import Learner

fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND)

def traced(phase, fn, step_of):
    def run(*args, **kwargs):
        os.write(fd, f"{time.monotonic():.6f} enter {phase} {step_of(args)}\\n".encode())
        out = fn(*args, **kwargs)
        os.write(fd, f"{time.monotonic():.6f} exit {phase}\\n".encode())
        return out
    return run

step.collect = traced("rollout", step.collect, lambda a: a[1] + 1)
Learner.step_samples = traced("learner", Learner.step_samples, lambda a: -1)
loop.save_checkpoint = traced("checkpoint", loop.save_checkpoint, lambda a: a[4].step)
sys.exit(main(sys.argv[2:]))
"""
"""``python -c WRAPPER PHASE_LOG train ...``: ``turnrl train`` writing a line to PHASE_LOG
as it enters and leaves each phase (the learner's line has no step: the last rollout's)."""


def start(run: Path, options: list[str], phase_log: Path, resume: bool) -> subprocess.Popen[str]:
    sets = [x for option in options for x in ("--set", option)]
    command = [sys.executable, "-c", WRAPPER, str(phase_log), "train", "--out", str(run),
               "--no-progress", *sets, *(["--resume"] if resume else [])]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def marks(phase_log: Path) -> list[tuple[float, str, str, int]]:
    """(time, enter/exit, phase, step) of each line so far; a learner line gets the step of
    the rollout before it."""
    out: list[tuple[float, str, str, int]] = []
    text = phase_log.read_text() if phase_log.is_file() else ""
    current = 0
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        at, what, phase, *rest = line.split()
        step = int(rest[0]) if rest and int(rest[0]) >= 0 else current
        if what == "enter" and phase == "rollout":
            current = step
        out.append((float(at), what, phase, step))
    return out


def durations(phase_log: Path) -> dict[str, float]:
    """The mean duration of each phase in a finished run's log."""
    spans: dict[str, list[float]] = {p: [] for p in PHASES}
    began: dict[str, float] = {}
    for at, what, phase, _ in marks(phase_log):
        if what == "enter":
            began[phase] = at
        elif phase in began:
            spans[phase].append(at - began.pop(phase))
    return {p: sum(v) / len(v) for p, v in spans.items() if v}


def kill_in(
    proc: subprocess.Popen[str], phase_log: Path, phase: str, step: int, delay_s: float
) -> dict[str, Any]:
    """SIGKILL ``proc`` ``delay_s`` after it enters ``phase`` at ``step`` or later; where
    it was when it died."""
    while proc.poll() is None:
        hit = [m for m in marks(phase_log) if m[1:3] == ("enter", phase) and m[3] >= step]
        if hit:
            time.sleep(delay_s)
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.001)
    output = proc.communicate()[0]
    if proc.returncode != -signal.SIGKILL:
        return {"killed": False, "returncode": proc.returncode, "output": output[-2000:]}
    last = marks(phase_log)[-1]
    landed = last[2] if last[1] == "enter" else f"after {last[2]}"
    return {"killed": True, "landed": landed, "landed_step": last[3], "output": output}


def resumed_from(phase_log: Path) -> int | None:
    """The step an attempt continued from: the one before its first rollout."""
    first = next((s for _, w, p, s in marks(phase_log) if (w, p) == ("enter", "rollout")), None)
    return None if first is None else first - 1


def checkpoint_step(run: Path) -> int:
    """The step of the newest checkpoint directory (0 without one)."""
    steps = [int(p.name[5:]) for p in (run / "checkpoints").glob("step_*") if p.name[5:].isdigit()]
    return max(steps, default=0)


def dropped_lines(output: str) -> list[str]:
    """What an attempt said it dropped from the run files as it resumed."""
    return [line.split("turnrl: ", 1)[-1] for line in output.splitlines() if "dropped" in line]


def dropped_counts(lines: list[str]) -> str:
    """``dropped_lines`` in short: file (its directory for event files) and count."""
    found = [re.search(r"dropped (\d+) record\(s\) of (\S+)", line) for line in lines]
    return ", ".join(f"{m[2].split('/')[0]} {m[1]}" for m in found if m) or "-"


def short(message: str) -> str:
    """A damage message without the run's path."""
    if found := re.search(r"(step_\d+) is damaged \((.*)\); skipping it", message):
        return f"{found[1]}: {found[2]}"
    return "error: no usable checkpoint" if "no usable checkpoint" in message else message


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def events(logdir: Path) -> list[tuple[str, int, float]]:
    """(tag, step, value) of every scalar of the event files (TFRecord framing)."""
    from tensorboardX.proto import event_pb2  # type: ignore[import-untyped]

    out = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            out += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    return out


def compare(run: Path, straight: Path) -> dict[str, Any]:
    """Whether ``run`` equals ``straight``: metrics and each run file's records per step."""
    rows, want = jsonl(run / "metrics.jsonl"), jsonl(straight / "metrics.jsonl")

    def fixed(row: dict[str, Any]) -> dict[str, Any]:
        skip = ("train/logprob_mismatch", "warmup/s")
        return {k: v for k, v in row.items() if not k.startswith("perf/") and k not in skip}

    gap = max(
        (abs(a.get("train/logprob_mismatch", 0.0) - b.get("train/logprob_mismatch", 0.0))
         for a, b in zip(rows, want, strict=False)),
        default=0.0,
    )  # fmt: skip
    metrics_equal = [fixed(r) for r in rows] == [fixed(r) for r in want] and gap <= 1e-9

    def per_step(records: list[dict[str, Any]]) -> Counter[int]:
        return Counter(int(r["step"]) for r in records)

    def trajectory(t: dict[str, Any]) -> tuple[Any, ...]:
        return t["step"], t["group"], t["task_id"], t["sample_index"], t["reward"]

    trajectories = jsonl(run / "trajectories.jsonl")
    alarms = jsonl(run / "alarms.jsonl")
    scalars = events(run / "tensorboard")
    tb = Counter((tag, step) for tag, step, _ in scalars)
    files = {
        "metrics.jsonl": [r["step"] for r in rows] == [r["step"] for r in want],
        "trajectories.jsonl": [trajectory(t) for t in trajectories]
        == [trajectory(t) for t in jsonl(straight / "trajectories.jsonl")],
        "alarms.jsonl": alarms == jsonl(straight / "alarms.jsonl"),
        "tensorboard": max(tb.values(), default=1) == 1
        and set(tb) == {(tag, step) for tag, step, _ in events(straight / "tensorboard")},
    }
    return {
        "metrics_equal": metrics_equal,
        "logprob_mismatch_max_diff": gap,
        "files_one_record_per_step": files,
        "records_per_step": {
            "metrics": max(per_step(rows).values(), default=0),
            "trajectories": sorted(set(per_step(trajectories).values())),
            "tensorboard": max(tb.values(), default=0),
        },
    }


def phase_steps(phase: str, first: int, args: argparse.Namespace) -> list[int]:
    """The steps from ``first`` on at which the run goes through ``phase`` (a checkpoint
    every ``save_every`` steps and after the last)."""
    return [s for s in range(first, args.steps + 1)
            if phase != "checkpoint" or s % args.save_every == 0 or s == args.steps]  # fmt: skip


def aims(rng: random.Random, args: argparse.Namespace) -> list[tuple[int, str]]:
    """(step, phase) each kill aims at: the phases in turn, each at a step drawn from those
    where it happens, in step order, so that the kills spread over the whole run."""
    drawn = [(rng.choice(phase_steps(p, 1, args)), p)
             for p in (PHASES[i % len(PHASES)] for i in range(args.kills))]  # fmt: skip
    return sorted(drawn, key=lambda a: (a[0], PHASES.index(a[1])))


def kills(args: argparse.Namespace, straight: Path, options: list[str]) -> dict[str, Any]:
    """Kill a copy of the run ``args.kills`` times, resuming after each; compare."""
    rng = random.Random(args.seed)
    typical = durations(args.runs_dir / "straight.phases")
    run = args.runs_dir / "killed"
    shutil.rmtree(run, ignore_errors=True)
    events_log: list[dict[str, Any]] = []
    for attempt, (aimed, phase) in enumerate(aims(rng, args)):
        before = checkpoint_step(run)
        later = phase_steps(phase, before + 1, args)
        if not later:  # the run has finished
            break
        step = aimed if aimed in later else later[0]  # the run may have got past the aim
        delay = rng.random() * typical.get(phase, 0.01)
        phase_log = args.runs_dir / f"killed-{attempt}.phases"
        phase_log.unlink(missing_ok=True)
        proc = start(run, options, phase_log, resume=attempt > 0)
        t0 = time.perf_counter()
        result = kill_in(proc, phase_log, phase, step, delay)
        events_log.append({
            "attempt": attempt, "aimed_at": phase, "aimed_step": step,
            "delay_ms": round(delay * 1000, 1),
            "resumed_from": resumed_from(phase_log) if attempt and before else None,
            "dropped_at_resume": dropped_lines(result.pop("output")),
            "checkpoint_after": checkpoint_step(run), "wall_s": round(time.perf_counter() - t0, 1),
            **result,
        })  # fmt: skip
        print(kill_table([events_log[-1]]).splitlines()[-1], flush=True)
    phase_log = args.runs_dir / "killed-final.phases"
    proc = start(run, options, phase_log, resume=True)
    output = proc.communicate()[0]
    if proc.returncode != 0:
        raise SystemExit(f"the final resume failed:\n{output[-3000:]}")
    return {
        "kills": events_log,
        "final_dropped_at_resume": dropped_lines(output),
        **compare(run, straight),
    }


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def unlink(path: Path) -> None:
    path.unlink()


def older_checkpoint_optimizer_truncated(checkpoint: Path) -> None:
    """As a checkpoint written before manifests existed, its optimizer state cut short."""
    (checkpoint / "manifest.json").unlink()
    truncate(checkpoint / "optimizer.pt")


def every_optimizer_truncated(newest: Path) -> None:
    for checkpoint in newest.parent.glob("step_*"):
        truncate(checkpoint / "optimizer.pt")


DAMAGES: dict[str, Callable[[Path], None]] = {
    "weights truncated": lambda c: truncate(c / "model" / "model.safetensors"),
    "weights changed (1 byte)": lambda c: flip_a_byte(c / "model" / "model.safetensors"),
    "optimizer state changed (1 byte)": lambda c: flip_a_byte(c / "optimizer.pt"),
    "weights file missing": lambda c: unlink(c / "model" / "model.safetensors"),
    "state.json missing": lambda c: unlink(c / "state.json"),
    "manifest truncated": lambda c: truncate(c / "manifest.json"),
    "no manifest (older checkpoint), optimizer truncated": older_checkpoint_optimizer_truncated,
    "every checkpoint: optimizer truncated": every_optimizer_truncated,
}
SMOKE_DAMAGES = ["weights truncated", "every checkpoint: optimizer truncated"]


def damages(args: argparse.Namespace, straight: Path, options: list[str]) -> list[dict[str, Any]]:
    results = []
    newest = checkpoint_step(straight)
    for number, name in enumerate(args.damages):
        run = args.runs_dir / f"damaged-{number}"
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(straight, run)
        DAMAGES[name](run / "checkpoints" / f"step_{newest:06d}")
        t0 = time.perf_counter()
        phase_log = args.runs_dir / f"damaged-{number}.phases"
        phase_log.unlink(missing_ok=True)
        proc = start(run, options, phase_log, resume=True)
        output = proc.communicate()[0]
        said = [line.split("turnrl: ", 1)[-1] for line in output.splitlines()
                if "is damaged" in line or "no usable checkpoint" in line]  # fmt: skip
        row: dict[str, Any] = {
            "damage": name,
            "returncode": proc.returncode,
            "named": said,
            "resumed_from": resumed_from(phase_log),
            "wall_s": round(time.perf_counter() - t0, 1),
        }
        if proc.returncode == 0:
            row.update(compare(run, straight))
        results.append(row)
        print(damage_table([row]).splitlines()[-1], flush=True)
    return results


def yes(ok: bool) -> str:
    return "yes" if ok else "**NO**"


def kill_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| attempt | aimed at (step, delay) | landed in | resumed after step | newest "
             "checkpoint after | records dropped as it resumed |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        landed = f"{r['landed']} (step {r['landed_step']})" if r["killed"] else "not killed"
        dropped = dropped_counts(r["dropped_at_resume"])
        lines.append(
            f"| {r['attempt']} | {r['aimed_at']} ({r['aimed_step']}, {r['delay_ms']} ms) | "
            f"{landed} | {'start' if r['resumed_from'] is None else r['resumed_from']} | "
            f"{r['checkpoint_after'] or 'none'} | {dropped} |"
        )
    return "\n".join(lines)


def damage_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| damage | exit | message | resumed from | metrics equal | one record per step |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        files = r.get("files_one_record_per_step")
        lines.append(
            f"| {r['damage']} | {r['returncode']} | {' / '.join(map(short, r['named'])) or '-'} | "
            f"{r['resumed_from'] if r['resumed_from'] is not None else '-'} | "
            f"{yes(r['metrics_equal']) if 'metrics_equal' in r else '-'} | "
            f"{yes(all(files.values())) if files else '-'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="where the kills land")
    parser.add_argument(
        "--damages", nargs="*", choices=sorted(DAMAGES), default=list(DAMAGES),
        help="damaged-checkpoint cases (default: all)",
    )  # fmt: skip
    smoke = {"kills": 3, "steps": 6, "save_every": 2, "damages": SMOKE_DAMAGES}
    args = parse_args(parser, "reliability", smoke, runs=True)
    args.runs_dir = args.runs_dir / "reliability" if not args.smoke else args.runs_dir
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    options = [*RUN, f"steps={args.steps}", f"save_every={args.save_every}"]
    straight = args.runs_dir / "straight"
    shutil.rmtree(straight, ignore_errors=True)
    (args.runs_dir / "straight.phases").unlink(missing_ok=True)
    t0 = time.perf_counter()
    proc = start(straight, options, args.runs_dir / "straight.phases", resume=False)
    output = proc.communicate()[0]
    if proc.returncode != 0:
        raise SystemExit(f"the uninterrupted run failed:\n{output[-3000:]}")
    straight_s = time.perf_counter() - t0
    killed = kills(args, straight, options)
    damaged = damages(args, straight, options)
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {multiprocessing.cpu_count()} cores",
        "torch": torch.__version__,
        "commit": commit(),
        "steps": args.steps,
        "save_every": args.save_every,
        "seed": args.seed,
        "overrides": options,
        "phase_mean_s": durations(args.runs_dir / "straight.phases"),
        "straight_wall_s": round(straight_s, 1),
    }
    files = killed["files_one_record_per_step"]
    landed = Counter(k["landed"] if k["killed"] else "not killed" for k in killed["kills"])
    md = [
        f"# Reliability ({meta['date']}, {meta['machine']}, torch {meta['torch']}, "
        f"commit {meta['commit']})",
        "",
        f"A {args.steps}-step run of the tiny quick-start model (checkpoint every "
        f"{args.save_every} steps), killed with SIGKILL {args.kills} times (seed {args.seed}) "
        "and resumed after each kill, against the same run uninterrupted. Kills landed: "
        + ", ".join(f"{n} {k}" for k, n in sorted(landed.items()))
        + ". Mean phase durations in the uninterrupted run: "
        + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in meta["phase_mean_s"].items())
        + '. A kill lands "after" a phase when its delay outlasted it; "start": no '
        "checkpoint yet, the attempt starts over; the records dropped are what the attempt "
        "before wrote after its checkpoint (and any torn record).",
        "",
        kill_table(killed["kills"]),
        "",
        f"- metrics equal the uninterrupted run's: {yes(killed['metrics_equal'])} "
        f"(train/logprob_mismatch differs by at most {killed['logprob_mismatch_max_diff']:.2g})",
        "- one record per step, the same as the uninterrupted run's: "
        + ", ".join(f"{name} {yes(ok)}" for name, ok in files.items()),
        "",
        "Damaged newest checkpoint, then `turnrl train --resume` to the end:",
        "",
        damage_table(damaged),
    ]
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(
        json.dumps({**meta, "kills": killed, "damages": damaged}, indent=2)
    )
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()
