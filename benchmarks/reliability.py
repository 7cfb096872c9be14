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

Hostile code: every attack class of ``turnrl.tools.hostile`` (``--attacks`` names some)
run in the bubblewrap sandbox (as root: a dedicated uid), each contained, escaped, or not
enforceable on this machine.

``--sections`` measures some sections only; the others' figures are kept from the results
file already there (and the markdown says from which run).

    python benchmarks/reliability.py              # 10 kills of a 12-step run, 7 damages
    python benchmarks/reliability.py --sections hostile
    python benchmarks/reliability.py --kills 30 --seed 1
    python benchmarks/reliability.py --smoke      # 3 kills of a 6-step run, 2 damages, 2 attacks

Writes benchmarks/results/reliability.json and .md; run directories go to benchmarks/runs
(``--out``, ``--runs-dir``; ``--smoke``: a temporary directory).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import inspect
import json
import keyword
import math
import multiprocessing
import platform
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Optional, Union

import hypothesis
import hypothesis.strategies as st
import torch

from outputs import parse_args
from training_runs import TINY_RUN
from turnrl.envs.tool_env import ToolEnv
from turnrl.errors import ConfigError, ToolDefinitionError
from turnrl.formats import FORMATS, get_format
from turnrl.jsonl import read_jsonl_lines
from turnrl.models.loading import stop_token_ids
from turnrl.protocols import ParsedAction
from turnrl.rollout.chat import ChatRenderer
from turnrl.rollout.episode import EpisodeLimits, SamplingParams, derive_seed
from turnrl.rollout.groups import GroupSpec, collect_groups
from turnrl.tools import Tool
from turnrl.tools.hostile import ATTACKS
from turnrl.trainer.checkpoint import checkpoint_problems
from turnrl.trainer.config import load_config
from turnrl.trainer.monitors import read_rows
from turnrl.trainer.sinks import RECORD_FILES, trim_run_files
from turnrl.types import Completion, Message, StepResult, Task, ToolCall, Trajectory

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
    """The steps from ``first`` on at which a kill may aim at ``phase``: every step's
    rollout and learner; the checkpoints every ``save_every`` steps before the last step
    (a kill that comes too late in the last one finds the run finished, and the kills
    after it would have nothing left to hit)."""
    return [s for s in range(first, args.steps + 1)
            if phase != "checkpoint" or (s % args.save_every == 0 and s < args.steps)]  # fmt: skip


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
        if not later:  # no such phase left (a last checkpoint aimed at twice): another one
            phase = next((p for p in PHASES if phase_steps(p, before + 1, args)), phase)
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
ATTACK_NAMES = tuple(attack.name for attack in ATTACKS)
SMOKE_ATTACKS = ["ptrace", "forged result (thread)"]
"""Two quick ones: tests/test_sandbox_hostile.py runs and judges every attack; the smoke
checks this script's path (two of the others wait out a 5-second timeout)."""


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


# --------------------------------------------------------------------------- load

LOAD_FAILURES = {"raise": 0.05, "hang": 0.05}
"""Share of tool calls that raise, and that never answer (so the tool's ``timeout_s``
ends them); the rest answer after a random latency."""
LOAD_TOOL_TIMEOUT_S = 1.5
"""The flaky tool's ``timeout_s``: past the largest jitter, so only a hang times out."""
LOAD_CALLS_PER_EPISODE = 2


def load_plan(key: str, jitter_s: float) -> tuple[str, float]:
    """What the flaky tool does for the call with argument ``key``: raise, hang or answer,
    and after what latency (0 .. ``jitter_s``); a pure function of the key, so the check
    knows what every call should have recorded."""
    draw, delay = derive_seed("load", key), derive_seed("latency", key)
    u = draw / 2**63
    kind = (
        "raise"
        if u < LOAD_FAILURES["raise"]
        else "hang"
        if u < sum(LOAD_FAILURES.values())
        else "ok"
    )
    return kind, delay / 2**63 * jitter_s


def load_policy(prompt: str) -> str:
    """The backend double's reply: call ``probe`` (hermes) until it answered
    ``LOAD_CALLS_PER_EPISODE`` times, then answer ``done``."""
    task = re.findall(r"Task (\w+):", prompt)[-1]
    answered = prompt.count("<tool_response>")
    if answered >= LOAD_CALLS_PER_EPISODE:
        return "done"
    return get_format("hermes").render_call(ToolCall("probe", {"key": f"{task}-{answered}"}))


class ReadingBackend:
    """A backend double: replies ``load_policy(prompt text)`` and the end token, through the
    real tokenizer, to every request of a batch; counts requests and batches."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.end = stop_token_ids(tokenizer)[0]
        self.policy_version = 0
        self.pad_id = self.end
        self.num_requests = 0
        self.num_batches = 0

    def submit(self, requests: Any, quiet: Any = None) -> None:
        return None

    async def generate(self, requests: Any) -> list[Completion]:
        self.num_batches += 1
        out = []
        for r in requests:
            self.num_requests += 1
            text = load_policy(self.tokenizer.decode(list(r.prompt_ids)))
            ids = (*self.tokenizer.encode(text, add_special_tokens=False), self.end)
            out.append(Completion(ids, tuple(0.0 for _ in ids), "stop", policy_version=0))
        return out

    def run(self, program: Any) -> Any:
        return asyncio.run(program)

    def sync(self, model: Any) -> None:
        self.policy_version += 1


def rss_mb() -> tuple[float, float]:
    """(current, peak) resident set size of this process, MB (/proc/self/status)."""
    status = Path("/proc/self/status").read_text()
    kb = {k: float(v.split()[0]) for k, v in re.findall(r"^(VmRSS|VmHWM):\s+(.*)$", status, re.M)}
    return kb.get("VmRSS", 0.0) / 1024, kb.get("VmHWM", 0.0) / 1024


def load(args: argparse.Namespace) -> dict[str, Any]:
    """``args.episodes`` concurrent episodes through ``collect_groups`` against a flaky
    tool; every call, error and episode accounted for, under a deadline."""
    from turnrl.models.tiny import build_tokenizer, default_corpus

    tokenizer = build_tokenizer(default_corpus(), vocab_size=512)
    started: Counter[str] = Counter()  # tool calls that began, by planned outcome

    async def probe(key: str) -> str:
        """Look up a key.

        Args:
            key: The key.
        """
        kind, delay = load_plan(key, args.jitter_s)
        started[kind] += 1
        if kind == "hang":
            await asyncio.sleep(3600)
        await asyncio.sleep(delay)
        if kind == "raise":
            raise RuntimeError(f"injected failure for {key}")
        return f"value of {key}"

    flaky = Tool.from_function(probe, timeout_s=LOAD_TOOL_TIMEOUT_S)
    hermes = get_format("hermes")
    where: dict[int, str] = {}  # each live episode's env: what it is doing now

    class TrackedEnv(ToolEnv):
        async def reset(self, task: Task, seed: int) -> list[Message]:
            where[id(self)] = f"task {task.id}: reset"
            return await super().reset(task, seed)

        async def step(self, action: str) -> StepResult:
            where[id(self)] = f"task {self.task.id if self.task else '?'}: step"
            result = await super().step(action)
            where[id(self)] = f"task {self.task.id if self.task else '?'}: waiting for the model"
            return result

        async def close(self) -> None:
            where.pop(id(self), None)
            await super().close()

    def make_env() -> TrackedEnv:
        return TrackedEnv([flaky], hermes, lambda task, answer: float(answer.strip() == "done"))

    G = 4
    tasks = [
        Task(id=f"t{p}", prompt=({"role": "user", "content": f"Task t{p}: look up two keys."},))
        for p in range(args.episodes // G)
    ]
    limits = EpisodeLimits(
        max_turns=LOAD_CALLS_PER_EPISODE + 2, max_tokens_per_turn=128,
        max_episode_tokens=1024, max_context_tokens=8192, timeout_s=args.episode_timeout_s,
    )  # fmt: skip
    spec = GroupSpec(G, limits, SamplingParams(stop_token_ids=stop_token_ids(tokenizer)), seed=0)
    backend = ReadingBackend(tokenizer)
    rss_before, _ = rss_mb()
    t0 = time.perf_counter()

    async def program() -> list[list[Trajectory]]:
        job = collect_groups(tasks, make_env, backend, ChatRenderer(tokenizer), spec)
        return await asyncio.wait_for(job, args.load_deadline_s)

    hung: list[str] = []
    try:
        groups = asyncio.run(program())
    except asyncio.TimeoutError:  # what hung, by what each open episode was doing
        groups = []
        hung = [f"{n}x {w}" for w, n in Counter(where.values()).most_common()]
    wall_s = time.perf_counter() - t0
    trajectories = [t for g in groups for t in g]
    records = [(t, c) for t in trajectories for c in t.tool_calls]
    recorded: Counter[str] = Counter()
    wrong = []  # calls whose record does not say what the tool did
    for _, c in records:
        kind, _ = load_plan(str(c.arguments.get("key")), args.jitter_s)
        recorded[kind] += 1
        error = c.error or ""
        ok = {"ok": c.ok, "raise": not c.ok and error.startswith("RuntimeError: injected"),
              "hang": not c.ok and "timed out after" in error}[kind]  # fmt: skip
        if not ok:
            wrong.append(f"{c.arguments}: ok={c.ok} error={c.error!r} (planned {kind})")
    seen = Counter((t.task_id, t.sample_index) for t in trajectories)
    out = {
        "episodes_in": len(tasks) * G,
        "episodes_out": len(trajectories),
        "episodes_lost": len(tasks) * G - len(set(seen)),
        "episodes_duplicated": sum(n - 1 for n in seen.values()),
        "hung": hung,
        "open_episodes_after": len(where),
        "stop_reasons": dict(Counter(t.stop_reason for t in trajectories)),
        "episode_errors": dict(
            Counter(str(t.error).split(":")[0] for t in trajectories if t.error)
        ),
        "success": sum(t.success for t in trajectories),
        "tool_calls_started": dict(started),
        "tool_calls_recorded": dict(recorded),
        "tool_calls_unrecorded": sum(started.values()) - len(records),
        "tool_errors": dict(
            Counter(
                ("timeout" if "timed out" in (c.error or "") else (c.error or "").split(":")[0])
                for _, c in records
                if not c.ok
            )
        ),
        "records_wrong": wrong[:10],
        "num_records_wrong": len(wrong),
        "model_requests": backend.num_requests,
        "model_batches": backend.num_batches,
        "wall_s": round(wall_s, 2),
        "rss_before_mb": round(rss_before, 1),
        "peak_rss_mb": round(rss_mb()[1], 1),
        "jitter_s": args.jitter_s,
        "tool_timeout_s": LOAD_TOOL_TIMEOUT_S,
        "episode_timeout_s": args.episode_timeout_s,
        "deadline_s": args.load_deadline_s,
    }
    print(load_table(out), flush=True)
    return out


def load_table(r: dict[str, Any]) -> str:
    errors = ", ".join(f"{k} {n}" for k, n in sorted(r["tool_errors"].items())) or "-"
    episode_errors = ", ".join(f"{k} {n}" for k, n in sorted(r["episode_errors"].items())) or "0"
    lines = [
        "| episodes in / out / lost | hangs | tool calls (started / recorded) | tool errors recorded | "
        "records wrong | episode errors | answered | wall | peak RSS |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {r['episodes_in']} / {r['episodes_out']} / {r['episodes_lost']} | "
        f"{len(r['hung']) or 0} | {sum(r['tool_calls_started'].values())} / "
        f"{sum(r['tool_calls_recorded'].values())} | {errors} | {r['num_records_wrong']} | "
        f"{episode_errors} | {r['stop_reasons'].get('answered', 0)} | {r['wall_s']:.1f} s | "
        f"{r['peak_rss_mb']:.0f} MB (before: {r['rss_before_mb']:.0f} MB) |",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- fuzz

MARKERS = [
    "<tool_call>", "</tool_call>", "<tool_response>", "<|python_tag|>", "[TOOL_CALLS]",
    "Thought:", "Action:", "Action Input:", "Observation:", "\nObservation:", "Final Answer:",
    "```", "```python", "```output", "````", "\\boxed{", "<search>", "</search>",
    "<answer>", "</answer>", "<information>", "</information>", '{"name": ', '"arguments": ',
    '"parameters": ', "{", "}", "[", "]", ",", ":", '"', "\\", "\n", " ", "\t", "\x00",
    "\ud800", "\u2028", "é", "😀", "null", "NaN", "Infinity", "-0", "1e999", "9" * 5000,
    "[" * 3000, "{\"a\":" * 2000, "python", "search", "lookup", "code",
]  # fmt: skip
"""Pieces of the call formats' syntax and of JSON, and adversarial ones: a lone surrogate,
NUL, a 5,000-digit number (past Python's int-string limit), nesting past the recursion
limit."""


def json_values(keys: st.SearchStrategy[str] | None = None) -> st.SearchStrategy[Any]:
    """JSON values (NaN and infinities included), nested."""
    scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.dictionaries(keys or st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=12,
    )


def json_text() -> st.SearchStrategy[str]:
    return json_values().map(lambda v: json.dumps(v, ensure_ascii=False))


def model_texts() -> st.SearchStrategy[str]:
    """A model turn: random text, or the formats' pieces, JSON and random text mixed."""
    piece = st.sampled_from(MARKERS) | json_text() | st.text(max_size=12)
    return st.text() | st.lists(piece, max_size=12).map("".join)


def call_texts(name: str) -> st.SearchStrategy[str]:
    """A well-formed call of format ``name`` (random tool name and arguments), then cut,
    spliced or left whole: the near misses a model writes."""
    fmt = get_format(name)

    def render(tool: str, arguments: dict[str, Any]) -> str:
        try:
            return fmt.render_call(ToolCall(tool, arguments))
        except ValueError:  # a call the format cannot write: its one tool's, then
            query = re.sub(r"[<>]", "", str(arguments))  # no tags inside a search query
            one = {"search_r1": ToolCall("search", {"query": query}),
                   "code": ToolCall("python", {"code": str(arguments)})}[name]  # fmt: skip
            return fmt.render_call(one)

    call = st.builds(
        render,
        st.sampled_from(["python", "search", "lookup", "x"]),
        st.dictionaries(st.sampled_from(["code", "query", "key", "x"]), json_values(), max_size=3),
    )

    def mutate(text: str, cut: int, insert: str) -> str:
        at = cut % (len(text) + 1)
        return text[:at] + insert + text[at:]

    return st.one_of(call, st.builds(mutate, call, st.integers(0, 10**6), model_texts()))


def parser_check(name: str) -> Callable[[str], None]:
    fmt = get_format(name)

    def check(text: str) -> None:
        parsed = fmt.parse(text)
        if not isinstance(parsed, ParsedAction):
            raise AssertionError(f"parse returned {type(parsed).__name__}")
        json.dumps([c.arguments for c in parsed.tool_calls], default=repr)

    return check


SCHEMA_TYPES = ["string", "integer", "number", "boolean", "null", "array", "object"]


def json_schemas() -> st.SearchStrategy[dict[str, Any]]:
    """Property schemas in the subset ``Tool.validate`` checks (type, enum, anyOf, items,
    additionalProperties) plus keywords it leaves to the tool."""
    leaf = st.one_of(
        st.builds(lambda t: {"type": t}, st.sampled_from(SCHEMA_TYPES)),
        st.builds(lambda t: {"type": t}, st.lists(st.sampled_from(SCHEMA_TYPES), min_size=1, max_size=3)),
        st.builds(lambda e: {"enum": e}, st.lists(json_values(), min_size=1, max_size=4)),
        st.just({}), st.just({"$ref": "#/defs/x"}), st.just({"type": "string", "pattern": "^a"}),
    )  # fmt: skip
    return st.recursive(
        leaf,
        lambda inner: st.one_of(
            st.builds(lambda s: {"type": "array", "items": s}, inner),
            st.builds(lambda s: {"type": "object", "additionalProperties": s}, inner),
            st.builds(lambda s: {"anyOf": s}, st.lists(inner, min_size=1, max_size=3)),
            st.builds(
                lambda p: {"type": "object", "properties": p},
                st.dictionaries(st.text(max_size=5), inner, max_size=3),
            ),
        ),
        max_leaves=6,
    )


class DeepList(list[Any]):
    """A list nested 5,000 deep (past the recursion limit), with a short repr (hypothesis
    prints its inputs)."""

    def __init__(self) -> None:
        super().__init__([functools.reduce(lambda inner, _: [inner], range(5000), [])])

    def __repr__(self) -> str:
        return "[[[...5,000 deep...]]]"


def python_values() -> st.SearchStrategy[Any]:
    """What a parser or an MCP client may hand a tool: JSON values, and Python values JSON
    lacks (tuples, sets, bytes, non-string keys, a deeply nested list)."""
    odd = st.one_of(
        st.binary(max_size=8), st.sets(st.integers(), max_size=3), st.complex_numbers(),
        st.just(object()), st.builds(DeepList),
    )  # fmt: skip
    scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | odd
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.lists(inner, max_size=3).map(tuple)
            | st.dictionaries(st.text(max_size=5) | st.integers(), inner, max_size=3)
        ),
        max_leaves=10,
    )


def validator_cases() -> st.SearchStrategy[tuple[Tool, Any]]:
    def make(props: dict[str, Any], required: list[str], more: bool) -> Tool:
        parameters = {"type": "object", "properties": props, "required": required,
                      "additionalProperties": more}  # fmt: skip
        return Tool(lambda **kw: None, name="t", description="", parameters=parameters)

    tools = st.builds(
        make, st.dictionaries(st.text(max_size=5), json_schemas(), max_size=4),
        st.lists(st.text(max_size=5), max_size=3), st.booleans(),
    )  # fmt: skip
    arguments = st.dictionaries(st.text(max_size=5), python_values(), max_size=4) | python_values()
    return st.tuples(tools, arguments)


def validator_check(case: tuple[Tool, Any]) -> None:
    found = case[0].validate(case[1])
    if found is not None and not isinstance(found, str):
        raise AssertionError(f"validate returned {type(found).__name__}")


class Opaque:
    """A class no schema knows."""


def annotations() -> st.SearchStrategy[Any]:
    """Annotations, supported or not: scalars, containers, Literal, unions, Optional, Any,
    strings (forward references, some not Python)."""
    base = st.sampled_from([str, int, float, bool, bytes, type(None), Any, object, Opaque,
                            list, dict, tuple, set, None])  # fmt: skip
    text = st.sampled_from(["int", "list[str]", "Undefined", "1 +", "", "lambda: 0", "str | None"])
    literals = st.lists(st.one_of(st.text(max_size=4), st.integers(), st.booleans(), st.floats(),
                                  st.none()), min_size=1, max_size=3)  # fmt: skip
    return text | st.recursive(  # a string only at the top: typing checks those inside
        base | literals.map(lambda v: Literal[tuple(v)]),  # type: ignore[misc]
        lambda inner: st.one_of(
            inner.map(lambda t: list[t]),  # type: ignore[valid-type]
            st.tuples(inner, inner).map(lambda kv: dict[kv[0], kv[1]]),  # type: ignore[misc]
            inner.map(lambda t: Optional[t]),  # noqa: UP045
            st.tuples(inner, inner).map(lambda ab: Union[ab[0], ab[1]]),  # noqa: UP007
            inner.map(lambda t: tuple[t, ...]),  # type: ignore[valid-type]
        ),
        max_leaves=4,
    )


PARAMETER_KINDS = list(inspect._ParameterKind)


def functions() -> st.SearchStrategy[Callable[..., Any]]:
    """Functions with random signatures (names, kinds, annotations, defaults), names and
    docstrings (Google-style ``Args:`` sections, or not)."""
    names = st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True).filter(
        lambda n: not keyword.iskeyword(n)
    )
    params = st.lists(
        st.tuples(names, st.sampled_from(PARAMETER_KINDS), st.booleans(), annotations(),
                  st.none() | st.integers() | st.text(max_size=4) | st.just(inspect.Parameter.empty)),
        max_size=4, unique_by=lambda p: p[0],
    )  # fmt: skip
    docs = st.none() | st.text() | st.lists(
        st.sampled_from(["Args:", "    x: the x", "  y (int): why", "Returns:", "", "**kw: more",
                         "Parameters:", "\tz:"]) | st.text(max_size=10), max_size=8,
    ).map("\n".join)  # fmt: skip

    def make(spec: list[Any], doc: str | None, name: str) -> Callable[..., Any]:
        order = sorted(spec, key=lambda p: p[1])  # a signature's kinds come in order
        parameters, seen_default = [], False
        for pname, kind, annotated, annotation, default in order:
            if kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
                default = inspect.Parameter.empty
            elif kind != inspect.Parameter.KEYWORD_ONLY and seen_default:
                default = default if default is not inspect.Parameter.empty else 0
            seen_default = seen_default or (
                default is not inspect.Parameter.empty and kind != inspect.Parameter.KEYWORD_ONLY
            )
            parameters.append(inspect.Parameter(
                pname, kind, default=default,
                annotation=annotation if annotated else inspect.Parameter.empty,
            ))  # fmt: skip

        def fn(*args: Any, **kwargs: Any) -> Any:
            return None

        fn.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        fn.__annotations__ = {p.name: p.annotation for p in parameters
                              if p.annotation is not inspect.Parameter.empty}  # fmt: skip
        fn.__doc__ = doc
        fn.__name__ = name
        fn.__qualname__ = name
        return fn

    return st.builds(make, params, docs, st.text(max_size=8) | names)


def schema_check(fn: Callable[..., Any]) -> None:
    built = Tool.from_function(fn)
    json.dumps(built.schema(), allow_nan=False)


CONFIG_KEYS = [
    "seed", "steps", "save_every", "max_minutes", "model.hidden_size", "model.echo_steps",
    "model.precision", "env.name", "env.options", "env.num_tasks", "rollout.group_size",
    "rollout.prompts_per_step", "rollout.max_error_frac", "rollout.backend",
    "algorithm.preset", "algorithm.kl_coef", "algorithm.kl.coef", "algorithm.clip",
    "algorithm.loss_agg", "algorithm.advantage", "eval.every", "log.tensorboard",
    "monitor.window", "warmup.steps", "lora", "lora.rank", "model", "algorithm",
]  # fmt: skip
"""Keys of the config (and a few old names, sections and wrong ones) the fuzzer sets."""


def config_values() -> st.SearchStrategy[str]:
    """A ``--set`` value as typed: JSON, a bare word, a boolean in any case, or junk."""
    return st.one_of(
        json_text(), st.text(max_size=10), st.sampled_from(["TRUE", "false", "1e400", "9" * 5000,
        "[" * 3000, "nan", "-1", "0", "grpo", "vllm", "quickstart"]),
    )  # fmt: skip


def overrides() -> st.SearchStrategy[list[str]]:
    key = st.sampled_from(CONFIG_KEYS) | st.text(max_size=12)
    item = st.builds(lambda k, sep, v: f"{k}{sep}{v}", key, st.sampled_from(["=", "=", " = ", ""]),
                     config_values())  # fmt: skip
    return st.lists(item, max_size=4)


def overrides_check(items: list[str]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_config(None, items)


def toml_value(value: Any) -> str:
    """``value`` as TOML (a minimal writer: the fuzzer's own values only)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return (
            "nan"
            if value != value
            else "inf"
            if value == math.inf
            else "-inf"
            if value == -math.inf
            else repr(value)
        )
    if isinstance(value, (int, str)):
        return json.dumps(value) if isinstance(value, str) else str(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    return '""'  # None: TOML has no null


def recipes() -> st.SearchStrategy[bytes]:
    """A recipe file: TOML settings of known and unknown keys (with ``base``, sometimes
    itself), or TOML pieces mixed with junk bytes."""
    entry = st.builds(
        lambda k, v: f"{k} = {toml_value(v)}",
        st.sampled_from([*CONFIG_KEYS, "base"]) | st.text(max_size=6).map(json.dumps),
        json_values() | st.sampled_from(["quickstart", "grpo", "fuzz", "nope", "../x"]),
    )  # fmt: skip
    header = st.sampled_from(["[model]", "[algorithm]", "[algorithm.kl]", "[env]", "[[x]]", "["])
    lines = st.lists(entry | header | st.text(max_size=10), max_size=8).map("\n".join)
    return st.one_of(
        lines.map(str.encode),
        st.tuples(lines.map(str.encode), st.binary(max_size=10)).map(b"\n".join),
    )


def recipe_check(folder: Path) -> Callable[[tuple[bytes, list[str]]], None]:
    path = folder / "fuzz.toml"

    def check(case: tuple[bytes, list[str]]) -> None:
        path.write_bytes(case[0])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_config(str(path), case[1])

    return check


def jsonl_files() -> st.SearchStrategy[bytes]:
    """Run and data files: lines of JSON (rows with ``step`` of any type, other values,
    NaN), torn lines, blank lines, invalid UTF-8, nesting past the recursion limit, numbers
    past the int-string limit."""
    row = st.builds(lambda s, v: json.dumps({"step": s, "x": v}), json_values(), json_values())
    line = st.one_of(
        row, json_text(), st.text(max_size=20), st.just(""), st.just("[" * 5000),
        st.just("9" * 5000), st.just('{"step": 1, "x": NaN}'), st.just('{"step": 2'),
    ).map(str.encode) | st.binary(max_size=12)  # fmt: skip
    return st.builds(
        lambda lines, end: b"\n".join(lines) + end, st.lists(line, max_size=8),
        st.sampled_from([b"", b"\n"]),
    )  # fmt: skip


def file_check(folder: Path, read: Callable[[Path], Any]) -> Callable[[bytes], None]:
    def check(data: bytes) -> None:
        path = folder / "metrics.jsonl"
        path.write_bytes(data)
        read(path)

    return check


def trim_check(folder: Path) -> Callable[[tuple[bytes, int]], None]:
    def check(case: tuple[bytes, int]) -> None:
        for name in RECORD_FILES:
            (folder / name).write_bytes(case[0])
        trim_run_files(folder, case[1])

    return check


def fuzz_targets(
    folder: Path,
) -> dict[
    str, tuple[st.SearchStrategy[Any], Callable[[Any], None], tuple[type[BaseException], ...], str]
]:
    """name -> (inputs, check, the errors it may raise, what it is)."""
    targets: dict[str, Any] = {
        f"parser: {name}": (st.one_of(model_texts(), call_texts(name)), parser_check(name), (),
                            f"get_format({name!r}).parse: a ParsedAction, never an exception")
        for name in FORMATS
    }  # fmt: skip
    targets["tool argument validator"] = (
        validator_cases(),
        validator_check,
        (),
        "Tool.validate: None or the problem, never an exception",
    )
    targets["tool schema builder"] = (
        functions(),
        schema_check,
        (ToolDefinitionError,),
        "Tool.from_function: a Tool with a JSON schema, or ToolDefinitionError",
    )
    targets["config: --set overrides"] = (
        overrides(),
        overrides_check,
        (ConfigError,),
        "load_config(None, overrides): a Config or ConfigError",
    )
    targets["config: recipe files"] = (
        st.tuples(recipes(), overrides()),
        recipe_check(folder),
        (ConfigError,),
        "load_config(path.toml, overrides): a Config or ConfigError",
    )
    targets["jsonl: read_jsonl_lines"] = (
        jsonl_files(),
        file_check(folder, lambda p: list(read_jsonl_lines(p))),
        (ConfigError,),
        "turnrl.jsonl.read_jsonl_lines: values, or ConfigError naming file and line",
    )
    targets["run files: read_rows"] = (
        jsonl_files(),
        file_check(folder, read_rows),
        (),
        "monitors.read_rows: the readable rows (bad lines skipped), never an exception",
    )
    targets["run files: trim_run_files"] = (
        st.tuples(jsonl_files(), st.integers(-1, 5)),
        trim_check(folder),
        (),
        "sinks.trim_run_files (a resume): counts of dropped records, never an exception",
    )
    return targets


def fuzz_target(
    strategy: st.SearchStrategy[Any], check: Callable[[Any], None],
    allowed: tuple[type[BaseException], ...], examples: int, seed: int,
) -> dict[str, Any]:  # fmt: skip
    """Run ``check`` on ``examples`` inputs drawn from ``strategy`` (hypothesis, seeded);
    count the outcomes. An exception outside ``allowed`` (or an allowed one without a
    message) is a crash, kept with the input that raised it."""
    outcomes: Counter[str] = Counter()
    crashes: list[dict[str, str]] = []

    @hypothesis.seed(seed)
    @hypothesis.settings(
        max_examples=examples, database=None, deadline=None, phases=[hypothesis.Phase.generate],
        suppress_health_check=list(hypothesis.HealthCheck),
    )  # fmt: skip
    @hypothesis.given(strategy)
    def run(value: Any) -> None:
        try:
            check(value)
            outcomes["returned"] += 1
        except allowed as exc:
            outcomes[type(exc).__name__] += 1
            if not str(exc).strip():
                crashes.append(
                    {"error": f"{type(exc).__name__} without a message", "input": repr(value)[:300]}
                )
        except Exception as exc:
            outcomes[f"uncaught {type(exc).__name__}"] += 1
            if outcomes[f"uncaught {type(exc).__name__}"] <= 3:  # a few of each kind
                crashes.append({
                    "error": f"{type(exc).__name__}: {str(exc)[:200]}", "input": repr(value)[:300],
                    "where": traceback.format_exc(limit=-3)[-1200:],
                })  # fmt: skip

    t0 = time.perf_counter()
    run()
    return {
        "inputs": sum(outcomes.values()), "outcomes": dict(outcomes),
        "uncaught": sum(n for k, n in outcomes.items() if k.startswith("uncaught")),
        "crashes": crashes, "seed": seed, "wall_s": round(time.perf_counter() - t0, 1),
    }  # fmt: skip


def fuzz(args: argparse.Namespace) -> dict[str, Any]:
    rows = {}
    with tempfile.TemporaryDirectory(prefix="fuzz-") as folder:
        for number, (name, (strategy, check, allowed, what)) in enumerate(
            fuzz_targets(Path(folder)).items()
        ):
            row = fuzz_target(strategy, check, allowed, args.fuzz_examples, args.seed + number)
            rows[name] = {"contract": what, "allowed": [e.__name__ for e in allowed], **row}
            print(fuzz_table({name: rows[name]}).splitlines()[-1], flush=True)
    return rows


def fuzz_table(rows: dict[str, Any]) -> str:
    lines = ["| target | contract | seed | inputs | outcomes | uncaught | wall |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in rows.items():
        outcomes = ", ".join(f"{k} {n}" for k, n in sorted(r["outcomes"].items()))
        lines.append(f"| {name} | {r['contract']} | {r['seed']} | {r['inputs']} | {outcomes} | "
                     f"{r['uncaught'] if not r['uncaught'] else '**' + str(r['uncaught']) + '**'} | {r['wall_s']} s |")  # fmt: skip
    return "\n".join(lines)


# --------------------------------------------------------------------------- full disk

DISK_WRAPPER = """
import os, sys
import turnrl.trainer.loop as loop
import turnrl.trainer.step as step
from turnrl.cli import main
from turnrl.trainer.learner import Learner

where, at, filler = sys.argv[1], int(sys.argv[2]), sys.argv[3]
current = [0]

def fill():
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    size = 1 << 20
    while size:
        try:
            os.write(fd, b"x" * size)
        except OSError:
            size //= 2
    os.close(fd)
    print(f"filled the disk before the {where} of step {at}", flush=True)

def collect(*args, **kwargs):
    current[0] = args[1] + 1
    return collect_(*args, **kwargs)

def save(*args, **kwargs):
    if where == "checkpoint" and args[4].step == at:
        fill()
    return save_(*args, **kwargs)

def learn(*args, **kwargs):
    out = learn_(*args, **kwargs)
    if where == "metrics" and current[0] == at and not os.path.exists(filler):
        fill()
    return out

collect_, save_, learn_ = step.collect, loop.save_checkpoint, Learner.step_samples
step.collect, loop.save_checkpoint, Learner.step_samples = collect, save, learn
sys.exit(main(sys.argv[4:]))
"""
"""``python -c DISK_WRAPPER WHERE STEP FILLER train ...``: ``turnrl train`` that fills its
disk (a file ``FILLER`` written until the disk refuses even one byte) just before it
writes the checkpoint of ``STEP`` (WHERE = checkpoint), or after the learner update of
``STEP``, before that step's metrics row is written (WHERE = metrics)."""


def mounted_tmpfs(folder: Path, size_mb: int) -> str | None:
    """Mount a ``size_mb`` tmpfs at ``folder``; None, or why it could not be mounted."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs",
                               str(folder)], capture_output=True, text=True)  # fmt: skip
    except OSError as exc:
        return f"mount: {exc}"
    return None if done.returncode == 0 else f"mount failed: {done.stderr.strip()}"


def disk(args: argparse.Namespace, straight: Path, options: list[str]) -> list[dict[str, Any]]:
    """Fill the disk while a run writes a checkpoint, and while it writes a metrics row;
    then free the space and ``--resume``: it must go on from the checkpoint before."""
    mount = args.runs_dir / "disk-tmpfs"
    if (why := mounted_tmpfs(mount, args.disk_mb)) is not None:
        return [{"case": case, "mounted": False, "why": why} for case in ("checkpoint", "metrics")]
    rows = []
    try:
        cases = {"checkpoint": 2 * args.save_every, "metrics": args.save_every + 1}
        for case, at in cases.items():
            run, filler = mount / case, mount / f"filler-{case}"
            t0 = time.perf_counter()
            sets = [x for option in options for x in ("--set", option)]
            command = [sys.executable, "-c", DISK_WRAPPER, case, str(at), str(filler), "train",
                       "--out", str(run), "--no-progress", *sets]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True)
            said = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
            checkpoints = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
            row: dict[str, Any] = {
                "case": case, "mounted": True, "disk_mb": args.disk_mb, "filled_at_step": at,
                "returncode": done.returncode,
                "message": next((line for line in said if "turnrl: error" in line), said[-1] if said else ""),
                "traceback": "Traceback (most recent call last)" in done.stderr,
                "checkpoints_after": checkpoints,
                "checkpoint_problems": {c: checkpoint_problems(run / "checkpoints" / c) for c in checkpoints},
                "left_behind": sorted(p.name for p in (run / "checkpoints").glob(".*")),
                "fail_wall_s": round(time.perf_counter() - t0, 1),
            }  # fmt: skip
            filler.unlink()
            phase_log = args.runs_dir / f"disk-{case}.phases"
            phase_log.unlink(missing_ok=True)
            proc = start(run, options, phase_log, resume=True)
            output = proc.communicate()[0]
            row.update(resume_returncode=proc.returncode, resumed_from=resumed_from(phase_log))
            if proc.returncode == 0:
                row.update(compare(run, straight))
            else:
                row["resume_output"] = output[-2000:]
            row["wall_s"] = round(time.perf_counter() - t0, 1)
            rows.append(row)
            print(disk_table([row]).splitlines()[-1], flush=True)
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)
    return rows


def disk_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| disk full while writing | exit | message | checkpoints left (whole?) | "
             "left behind | resume after freeing space: exit, from step | metrics equal |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if not r["mounted"]:
            lines.append(f"| {r['case']} | not measured: {r['why']} | | | | | |")
            continue
        whole = ", ".join(
            f"{c} {'whole' if not p else 'DAMAGED'}" for c, p in r["checkpoint_problems"].items()
        )
        message = r["message"].replace("|", "\\|")[:420] + (
            " (with a traceback)" if r["traceback"] else ""
        )
        lines.append(
            f"| {r['case']} (step {r['filled_at_step']}) | {r['returncode']} | {message} | "
            f"{whole or 'none'} | {', '.join(r['left_behind']) or 'nothing'} | "
            f"{r['resume_returncode']}, {r['resumed_from']} | "
            f"{yes(r['metrics_equal']) if 'metrics_equal' in r else '-'} |"
        )  # fmt: skip
    return "\n".join(lines)


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


HOSTILE_LIMITS = {"max_memory_mb": 256, "max_cpu_s": 5, "max_file_mb": 16, "max_processes": 16,
                  "max_open_files": 64, "max_tmp_mb": 16, "max_slot_memory_mb": 192,
                  "max_workspace_mb": 64}  # fmt: skip


def hostile(names: list[str]) -> dict[str, Any]:
    """Each attack class of ``turnrl.tools.hostile`` named in ``names`` in the bubblewrap
    sandbox, judged."""
    from turnrl.tools import Sandbox, SandboxLimits, SandboxUnavailableError
    from turnrl.tools.hostile import run_attack

    attacks = [a for a in ATTACKS if a.name in names]

    try:
        sandbox = Sandbox("bwrap", limits=SandboxLimits(**HOSTILE_LIMITS))
    except SandboxUnavailableError as exc:
        rows = [{"attack": a.name, "what": a.what, "verdict": "not run", "detail": str(exc),
                 "seconds": 0.0} for a in attacks]  # fmt: skip
        return {"limits": HOSTILE_LIMITS, "missing": {"bwrap": str(exc)}, "attacks": rows}
    rows = []
    for attack in attacks:
        outcome = run_attack(sandbox, attack)
        rows.append({"attack": attack.name, "what": attack.what, "verdict": outcome.verdict,
                     "detail": outcome.detail, "seconds": outcome.seconds})  # fmt: skip
        print(f"hostile: {attack.name}: {outcome.verdict} ({outcome.detail})", flush=True)
    return {"limits": HOSTILE_LIMITS, "missing": sandbox.missing, "attacks": rows,
            "cgroup_version": sandbox.cgroup_version}  # fmt: skip


def hostile_md(r: dict[str, Any]) -> str:
    counts = Counter(row["verdict"] for row in r["attacks"])
    lines = [
        "Each class of attack the 2026-11-24 hostile run found (and the kernel surface it "
        "named), run for real by `turnrl.tools.hostile` through `PythonInterpreter` in the "
        "bubblewrap sandbox as a dedicated uid, limits "
        + ", ".join(f"{k}={v}" for k, v in r["limits"].items())
        + ". After every attack: no process of the slot's uid left, its work dir gone, its "
        "uid free. Verdicts: "
        + ", ".join(f"{n} {v}" for v, n in sorted(counts.items()))
        + '. "not enforceable": it escaped and this machine lacks what stops it.',
        "",
        "| attack | what it does | verdict | what was seen | s |",
        "|---|---|---|---|---|",
    ]
    for row in r["attacks"]:
        verdict = row["verdict"] if row["verdict"] == "contained" else f"**{row['verdict']}**"
        detail = row["detail"].replace("|", "\\|")
        lines.append(f"| {row['attack']} | {row['what']} | {verdict} | {detail} | "
                     f"{row['seconds']:.1f} |")  # fmt: skip
    missing = r["missing"]
    version = r.get("cgroup_version")
    if version is not None:
        lines += ["", f"Slot memory, tasks and CPU go through cgroup v{version}"
                  + (" (this machine's unified v2 hierarchy offers no memory, pids or cpu "
                     "controller; the v1 hierarchies of those controllers are used)"
                     if version == 1 else "") + "."]  # fmt: skip
    lines += ["", "Not enforced on this machine: "
              + ("; ".join(f"{k}: {v}" for k, v in missing.items()) if missing else "nothing")
              + "."]  # fmt: skip
    return "\n".join(lines)


SECTIONS = ("kills", "load", "fuzz", "disk", "hostile")
MD_HEADINGS = {"load": "## Load", "fuzz": "## Fuzz", "kills": "## Kills and damaged checkpoints",
               "disk": "## Full disk", "hostile": "## Hostile code"}  # fmt: skip
JSON_KEYS = {"kills": ("kills", "damages"), "load": ("load",), "fuzz": ("fuzz",),
             "disk": ("disk",), "hostile": ("hostile",)}  # fmt: skip


def kept_sections(out: Path, sections: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """From an earlier results file: the JSON keys and markdown parts of the sections not
    measured this time, so that a run of some sections keeps the others' figures."""
    if not out.with_suffix(".json").exists() or not out.with_suffix(".md").exists():
        return {}, {}
    old = json.loads(out.with_suffix(".json").read_text())
    text = out.with_suffix(".md").read_text()
    parts = {}
    for name, heading in MD_HEADINGS.items():
        if name in sections or name not in old.get("sections", []) or heading not in text:
            continue
        body = text.split(heading + "\n", 1)[1]
        cut = [body.index(h) for h in MD_HEADINGS.values() if h in body]
        parts[name] = heading + "\n" + (body[: min(cut)] if cut else body).rstrip("\n")
    kept = {key: old[key] for name in parts for key in JSON_KEYS[name] if key in old}
    kept["kept_from"] = {"date": old.get("date"), "commit": old.get("commit"),
                         "sections": sorted(parts)}  # fmt: skip
    return {**{k: v for k, v in old.items() if k not in ("sections",)}, **kept}, parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
        help="what to measure (default: all); the results hold only those",
    )  # fmt: skip
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="where the kills land; fuzz seeds")
    parser.add_argument(
        "--damages", nargs="*", choices=sorted(DAMAGES), default=list(DAMAGES),
        help="damaged-checkpoint cases (default: all)",
    )  # fmt: skip
    parser.add_argument("--episodes", type=int, default=1000, help="load: concurrent episodes")
    parser.add_argument("--jitter-s", type=float, default=1.0, help="load: tool latency 0..this")
    parser.add_argument("--episode-timeout-s", type=float, default=60.0)
    parser.add_argument("--load-deadline-s", type=float, default=300.0, help="load: all of it")
    parser.add_argument("--fuzz-examples", type=int, default=10_000, help="fuzz: per target")
    parser.add_argument("--disk-mb", type=int, default=64, help="full disk: the tmpfs size")
    parser.add_argument(
        "--attacks", nargs="*", choices=ATTACK_NAMES, default=list(ATTACK_NAMES),
        help="hostile: the attack classes to run (default: all)",
    )  # fmt: skip
    smoke = {"kills": 3, "steps": 6, "save_every": 2, "damages": SMOKE_DAMAGES,
             "episodes": 100, "jitter_s": 0.2, "fuzz_examples": 100,
             "attacks": SMOKE_ATTACKS}  # fmt: skip
    args = parse_args(parser, "reliability", smoke, runs=True)
    args.runs_dir = args.runs_dir / "reliability" if not args.smoke else args.runs_dir
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    options = [*RUN, f"steps={args.steps}", f"save_every={args.save_every}"]
    meta: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {multiprocessing.cpu_count()} cores",
        "torch": torch.__version__,
        "hypothesis": hypothesis.__version__,
        "commit": commit(),
        "sections": args.sections,
        "seed": args.seed,
    }
    results: dict[str, Any] = {}
    md = [
        f"# Reliability ({meta['date']}, {meta['machine']}, torch {meta['torch']}, "
        f"commit {meta['commit']})",
        "",
        "`python benchmarks/reliability.py` (sections: " + ", ".join(args.sections) + ")",
    ]
    if "load" in args.sections:  # first: its peak RSS is this process's so far
        results["load"] = load(args)
        md += ["", "## Load", "", load_md(results["load"], args)]
    if "fuzz" in args.sections:
        results["fuzz"] = fuzz(args)
        md += ["", "## Fuzz", "", fuzz_md(results["fuzz"], args)]
    straight = args.runs_dir / "straight"
    if {"kills", "disk"} & set(args.sections):
        meta.update(steps=args.steps, save_every=args.save_every, overrides=options)
        meta["straight_wall_s"] = straight_run(straight, options, args)
        meta["phase_mean_s"] = durations(args.runs_dir / "straight.phases")
    if "kills" in args.sections:
        results["kills"] = kills(args, straight, options)
        results["damages"] = damages(args, straight, options)
        md += ["", "## Kills and damaged checkpoints", "",
               kills_md(results["kills"], results["damages"], meta, args)]  # fmt: skip
    if "disk" in args.sections:
        results["disk"] = disk(args, straight, options)
        md += ["", "## Full disk", "", disk_md(results["disk"], args)]
    if "hostile" in args.sections:
        results["hostile"] = hostile(args.attacks)
        md += ["", "## Hostile code", "", hostile_md(results["hostile"])]
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    kept, parts = kept_sections(out, args.sections)
    if parts:
        meta["sections"] = [s for s in SECTIONS if s in args.sections or s in parts]
        md[2] += (f"; kept from the run of {kept['kept_from']['date']} (commit "
                  f"{kept['kept_from']['commit']}): " + ", ".join(sorted(parts)))  # fmt: skip
        for name in SECTIONS:
            if name in parts:
                md += ["", parts[name]]
    out.with_suffix(".json").write_text(json.dumps({**kept, **meta, **results}, indent=2))
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


def straight_run(straight: Path, options: list[str], args: argparse.Namespace) -> float:
    """Run the uninterrupted run the others are compared with; its wall time."""
    shutil.rmtree(straight, ignore_errors=True)
    (args.runs_dir / "straight.phases").unlink(missing_ok=True)
    t0 = time.perf_counter()
    proc = start(straight, options, args.runs_dir / "straight.phases", resume=False)
    output = proc.communicate()[0]
    if proc.returncode != 0:
        raise SystemExit(f"the uninterrupted run failed:\n{output[-3000:]}")
    return round(time.perf_counter() - t0, 1)


def kills_md(
    killed: dict[str, Any], damaged: list[dict[str, Any]], meta: dict[str, Any],
    args: argparse.Namespace,
) -> str:  # fmt: skip
    files = killed["files_one_record_per_step"]
    landed = Counter(k["landed"] if k["killed"] else "not killed" for k in killed["kills"])
    return "\n".join([
        f"A {args.steps}-step run of the tiny quick-start model (checkpoint every "
        f"{args.save_every} steps), killed with SIGKILL {len(killed['kills'])} times "
        f"({args.kills} aimed; seed {args.seed}) "
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
    ])  # fmt: skip


def load_md(r: dict[str, Any], args: argparse.Namespace) -> str:
    failures = ", ".join(f"{share:.0%} {kind}" for kind, share in LOAD_FAILURES.items())
    return "\n".join([
        f"{r['episodes_in']} episodes at once (groups of 4) through `collect_groups` and "
        "`BatchingClient`, each a `ToolEnv` (hermes calls) whose backend double answers from "
        f"the prompt through the real tokenizer: call `probe` {LOAD_CALLS_PER_EPISODE} times, "
        f"then answer. The tool (async, `timeout_s={LOAD_TOOL_TIMEOUT_S:g}`) raises or hangs "
        f"({failures} of calls, drawn from a hash of the call's key) and otherwise answers "
        f"after 0-{args.jitter_s:g} s. Deadlines: {r['episode_timeout_s']:g} s per episode, "
        f"{r['deadline_s']:g} s for the whole batch (a hang there names what each open "
        f"episode waited on). {r['model_requests']} model requests in {r['model_batches']} "
        "batches. \"records wrong\": tool-call records that do not say what the tool did "
        "(an error for a call that answered, no error or the wrong one for a failure).",
        "",
        load_table(r),
    ])  # fmt: skip


def fuzz_md(rows: dict[str, Any], args: argparse.Namespace) -> str:
    total = sum(r["inputs"] for r in rows.values())
    uncaught = sum(r["uncaught"] for r in rows.values())
    crashes = [f"- {name}: {c['error']} on {c['input'][:120]}" for name, r in rows.items()
               for c in r["crashes"][:3]]  # fmt: skip
    return "\n".join([
        f"{args.fuzz_examples} inputs per target from hypothesis (generation only, seed as "
        "listed: `--seed` plus the target's number), random and adversarial (the formats' own "
        "syntax cut and spliced, lone surrogates, NUL, 5,000-digit numbers, nesting past the "
        f"recursion limit, invalid UTF-8). {total} inputs, {uncaught} uncaught exceptions.",
        "",
        fuzz_table(rows),
        *(["", "Crashes:", "", *crashes] if crashes else []),
    ])  # fmt: skip


def disk_md(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    return "\n".join([
        f"The run of the section above, written to a {args.disk_mb} MB tmpfs; the disk is "
        "filled (a file written until it takes no byte more) just before the checkpoint of a "
        "step is written, or just before a step's metrics row is. Then the filler is deleted "
        "and the run resumed with `--resume`.",
        "",
        disk_table(rows),
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
