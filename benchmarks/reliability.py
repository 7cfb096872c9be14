"""Reliability, measured through the command line alone: a short run killed with SIGKILL
at random moments and resumed after each kill, against the same run uninterrupted; and
resumes past damaged checkpoints.

Kills: every attempt is ``turnrl train`` in its own process (``python -m turnrl.cli``),
killed at a random moment (``--seed``): within half of the uninterrupted run's mean step
after its first or second new metrics row (short of the last where it can be);
where it was is read from the run
directory at that moment (metrics rows written, checkpoints, a checkpoint being written).
After the last kill the run is resumed to its end and compared with the uninterrupted one:
the metrics (all but timings; ``train/logprob_mismatch`` to 1e-9), and whether every run
file (metrics.jsonl, trajectories.jsonl, alarms.jsonl, the TensorBoard event files) holds
each step's records once, and the same ones.

Damaged checkpoints: a copy of the finished uninterrupted run, its newest checkpoint
damaged one way each case, is resumed to its end (``--resume``): the damage must be
named, the checkpoint before it used, and the result equal the uninterrupted run. The
last case damages every checkpoint: the resume must stop with a clear error.

Fault injection that reaches inside turnrl (kills aimed at a phase of the step, a disk
filled at an exact point, thousands of episodes against a tool that raises or hangs,
fuzzing, hostile code in the sandbox) is tests/'s: tests/test_fault_injection.py,
tests/test_fuzz.py and tests/test_sandbox_hostile.py.

    python benchmarks/reliability.py              # 10 kills of a 12-step run, 7 damages
    python benchmarks/reliability.py --kills 30 --seed 1
    python benchmarks/reliability.py --smoke      # 2 kills of a 6-step run, 2 damages

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

RUN = [*TINY_RUN, "model.tiny.echo_steps=0", "log.tensorboard=true",
       # an alarm a few steps in, so alarms.jsonl has a record to keep once
       "monitor.warmup_steps=3", "monitor.window=1", "monitor.entropy_jump=1e-6",
       # off: it watches wall-clock speed, which a kill and a resume change (not a metric
       # that can equal the uninterrupted run's)
       "monitor.slowdown_frac=0"]  # fmt: skip


def start(run: Path, options: list[str], resume: bool) -> subprocess.Popen[str]:
    """``turnrl train`` into ``run`` (with ``--resume``: continuing it), in a process."""
    sets = [x for option in options for x in ("--set", option)]
    command = [sys.executable, "-m", "turnrl.cli", "train", "--out", str(run),
               "--no-progress", *sets, *(["--resume"] if resume else [])]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def rows_written(run: Path) -> int:
    """The whole lines of ``run``'s metrics.jsonl."""
    path = run / "metrics.jsonl"
    return path.read_bytes().count(b"\n") if path.is_file() else 0


def kill_in(proc: subprocess.Popen[str], run: Path, rows: int, delay_s: float) -> dict[str, Any]:
    """SIGKILL ``proc`` ``delay_s`` after its metrics.jsonl has ``rows`` rows; what its run
    directory held at that moment."""
    at: dict[str, Any] = {}
    while proc.poll() is None:
        if rows_written(run) >= rows:
            time.sleep(delay_s)
            at = {"rows_at_kill": rows_written(run),
                  "writing_checkpoint": any((run / "checkpoints").glob(".tmp-step_*")),
                  "checkpoint_at_kill": checkpoint_step(run)}  # fmt: skip
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.001)
    output = proc.communicate()[0]
    if proc.returncode != -signal.SIGKILL:
        return {"killed": False, "returncode": proc.returncode, "output": output[-2000:]}
    return {"killed": True, **at, "output": output}


def resumed_from(output: str, before: int) -> int | None:
    """The step an attempt continued after: what it said as it dropped later records, or
    else the newest checkpoint it found (``before``); None: from the start."""
    if found := re.search(r"resuming after step (\d+)", output):
        return int(found[1])
    return before or None


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


def kills(
    args: argparse.Namespace, straight: Path, options: list[str], step_s: float
) -> dict[str, Any]:
    """Kill a copy of the run ``args.kills`` times, resuming after each; compare."""
    rng = random.Random(args.seed)
    run = args.runs_dir / "killed"
    shutil.rmtree(run, ignore_errors=True)
    events_log: list[dict[str, Any]] = []
    for attempt in range(args.kills):
        before, rows_before = checkpoint_step(run), rows_written(run)
        if rows_before >= args.steps:  # the run has finished
            break
        # after its first or second new row (short of the last where it can be; a step's
        # time is too uneven to aim by the clock alone: a run of sub-second steps could
        # finish first), then within half a step: in the next step's rollout, update or
        # checkpoint, so that the kills spread over the whole run
        rows = min(rows_before + 1 + rng.randrange(2), max(rows_before + 1, args.steps - 1))
        delay = rng.random() * step_s / 2
        proc = start(run, options, resume=attempt > 0)
        t0 = time.perf_counter()
        result = kill_in(proc, run, rows, delay)
        output = result.pop("output")
        events_log.append({
            "attempt": attempt, "after_rows": rows, "delay_ms": round(delay * 1000, 1),
            "resumed_from": resumed_from(output, before) if attempt else None,
            "dropped_at_resume": dropped_lines(output),
            "checkpoint_after": checkpoint_step(run), "wall_s": round(time.perf_counter() - t0, 1),
            **result,
        })  # fmt: skip
        print(kill_table([events_log[-1]]).splitlines()[-1], flush=True)
    proc = start(run, options, resume=True)
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
        proc = start(run, options, resume=True)
        output = proc.communicate()[0]
        said = [line.split("turnrl: ", 1)[-1] for line in output.splitlines()
                if "is damaged" in line or "no usable checkpoint" in line]  # fmt: skip
        row: dict[str, Any] = {
            "damage": name,
            "returncode": proc.returncode,
            "named": said,
            "resumed_from": resumed_from(output, 0) if proc.returncode == 0 else None,
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
    lines = ["| attempt | delay after row | metrics rows at the kill | "
             "writing a checkpoint | resumed after step | newest checkpoint after | "
             "records dropped as it resumed |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        rows_at = r["rows_at_kill"] if r["killed"] else "not killed"
        writing = ("yes" if r["writing_checkpoint"] else "no") if r["killed"] else "-"
        lines.append(
            f"| {r['attempt']} | {r['delay_ms']} ms after {r['after_rows']} | {rows_at} | {writing} | "
            f"{'start' if r['resumed_from'] is None else r['resumed_from']} | "
            f"{r['checkpoint_after'] or 'none'} | {dropped_counts(r['dropped_at_resume'])} |"
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
    parser.add_argument("--seed", type=int, default=0, help="when the kills land")
    parser.add_argument(
        "--damages", nargs="*", choices=sorted(DAMAGES), default=list(DAMAGES),
        help="damaged-checkpoint cases (default: all)",
    )  # fmt: skip
    smoke = {"kills": 2, "steps": 6, "save_every": 2, "damages": SMOKE_DAMAGES}
    args = parse_args(parser, "reliability", smoke, runs=True)
    args.runs_dir = args.runs_dir / "reliability" if not args.smoke else args.runs_dir
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    options = [*RUN, f"steps={args.steps}", f"save_every={args.save_every}"]
    meta: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {multiprocessing.cpu_count()} cores",
        "torch": torch.__version__,
        "commit": commit(),
        "seed": args.seed,
        "steps": args.steps,
        "save_every": args.save_every,
        "overrides": options,
    }
    straight = args.runs_dir / "straight"
    meta["straight_wall_s"] = straight_run(straight, options)
    meta["step_mean_s"] = step_mean_s(straight)
    results: dict[str, Any] = {"kills": kills(args, straight, options, meta["step_mean_s"])}
    results["damages"] = damages(args, straight, options)
    md = [
        f"# Reliability ({meta['date']}, {meta['machine']}, torch {meta['torch']}, "
        f"commit {meta['commit']})",
        "",
        "`python benchmarks/reliability.py`",
        "",
        "## Kills and damaged checkpoints",
        "",
        kills_md(results["kills"], results["damages"], meta, args),
    ]
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({**meta, **results}, indent=2))
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


def straight_run(straight: Path, options: list[str]) -> float:
    """Run the uninterrupted run the others are compared with; its wall time."""
    shutil.rmtree(straight, ignore_errors=True)
    t0 = time.perf_counter()
    proc = start(straight, options, resume=False)
    output = proc.communicate()[0]
    if proc.returncode != 0:
        raise SystemExit(f"the uninterrupted run failed:\n{output[-3000:]}")
    return round(time.perf_counter() - t0, 1)


def step_mean_s(run: Path) -> float:
    """The mean RL step of a finished run: the seconds of RL over its steps."""
    rows = [r for r in jsonl(run / "metrics.jsonl") if "perf/elapsed_s" in r]
    return float(rows[-1]["perf/elapsed_s"]) / max(1, int(rows[-1]["step"])) if rows else 0.1


def kills_md(
    killed: dict[str, Any], damaged: list[dict[str, Any]], meta: dict[str, Any],
    args: argparse.Namespace,
) -> str:  # fmt: skip
    files = killed["files_one_record_per_step"]
    return "\n".join([
        f"A {args.steps}-step run of the tiny quick-start model (checkpoint every "
        f"{args.save_every} steps), killed with SIGKILL {len(killed['kills'])} times "
        f"({args.kills} asked; seed {args.seed}) and resumed after each kill, against the same "
        "run uninterrupted, through `turnrl train` alone. Each attempt is killed a random "
        f"delay (up to half the mean step, {meta['step_mean_s'] * 1000:.0f} ms) after its "
        'first or second new metrics row. "start": no checkpoint yet, the attempt starts '
        "over; the records dropped are what the attempt before wrote after its checkpoint "
        "(and any torn record).",
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
    ])  # fmt: skip


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
