"""Fault injection for tests/test_fault_injection.py: ``turnrl train`` in a subprocess with
private functions of the trainer wrapped, to mark the phases a SIGKILL aims at
(``WRAPPER``) or to fill the disk at an exact point (``DISK_WRAPPER``); and thousands of
concurrent episodes through ``collect_groups`` against a tool that raises or hangs, with a
backend double (``load``). What a run is compared with, and how, is
benchmarks/reliability.py's (``compare``), which measures kills and damaged checkpoints
through the CLI alone."""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from turnrl.envs.tool_env import ToolEnv
from turnrl.formats import get_format
from turnrl.models.loading import stop_token_ids
from turnrl.rollout.chat import ChatRenderer
from turnrl.rollout.episode import EpisodeLimits, SamplingParams, derive_seed
from turnrl.rollout.groups import GroupSpec, collect_groups
from turnrl.tools import Tool
from turnrl.trainer.checkpoint import checkpoint_problems
from turnrl.types import Completion, Message, StepResult, Task, ToolCall, Trajectory

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from reliability import RUN, checkpoint_step, compare, dropped_lines

__all__ = ["RUN", "disk", "kills", "load", "start"]

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
        return TrackedEnv(
            [flaky], lambda task, answer: float(answer.strip() == "done"), format=hermes
        )

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
    return out


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
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)
    return rows
