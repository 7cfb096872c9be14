"""An existing agent trained through the policy endpoint: what the endpoint costs, and
that the agent learns.

    python benchmarks/endpoint.py                 # overhead (both paths) + learning run
    python benchmarks/endpoint.py --sections overhead
    python benchmarks/endpoint.py --sections overhead --agent-processes 0   # two paths only
    python benchmarks/endpoint.py --smoke         # the same code on tiny settings

Overhead: the same training (the quick-start, no evaluation) twice in one process, once
with the probe's own ``ToolEnv`` in process and once with ``examples/existing_agent.py``'s
agent (the `openai` SDK over loopback HTTP, one agent per episode); the mean step and
rollout times of steps 2.. are compared (target: the endpoint at most 1.3x the in-process
step time); a third run has the same agent in ``--agent-processes`` worker processes of
its own (``turnrl.AgentProcesses``), off the sampler's interpreter lock. The two environments differ where the model errs: ``ToolEnv`` answers a
malformed call with an error and the episode goes on, the agent takes it as its answer.
So the episodes are the same only for a model that does not err: ``--overhead-model``
(e.g. the learning section's last checkpoint) starts both runs from it, without warm-up;
without it, both start from a short warm-up and their episodes differ. Learning: the quick-start through the endpoint,
from its format-only warm-up, with held-out success every 10 steps (the target is >= 0.8).
Writes benchmarks/results/endpoint.json and .md; a section not run keeps its figures
there (each section records the date and machine it ran on).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from outputs import parse_args
from training_runs import TINY_RUN, eval_curve, first_reaching, write_results
from turnrl import train

ROOT = Path(__file__).resolve().parent
EXAMPLE = ROOT.parent / "examples" / "existing_agent.py"
OVERHEAD = [  # the quick-start's model and batch; a short warm-up so episodes call the tool
    "model.tiny.echo_steps=100", "warmup.steps=100", "eval.every=100000", "max_minutes=0",
    "save_every=100000",
]  # fmt: skip
LEARNING = ["max_minutes=0", "eval.every=10", "eval.num_tasks=64", "save_every=100000"]


def environments(agent_processes: int = 0) -> tuple[Any, Any]:
    """The probe in process, and the example's agent on the same tasks, with the probe's
    warm-up and the probe's tokenizer text: both paths then train the same tiny model from
    the same start, so their curves compare directly. ``agent_processes`` >= 1: the agent
    runs in that many worker processes (``turnrl.AgentProcesses``)."""
    example = vars(_example_module())
    from turnrl import AgentEnvironment, AgentProcesses

    probe = example["PROBE"]

    class ProbeAgent(AgentEnvironment):
        def corpus(self) -> list[str]:
            return list(probe.corpus())

    policy_agent = example["agent"]
    if agent_processes:
        policy_agent = AgentProcesses(policy_agent, processes=agent_processes)
    agent = ProbeAgent(
        policy_agent, probe.task, example["reward"], name="existing_agent",
        demonstrate=probe.demonstration,
    )  # fmt: skip
    if agent_processes:
        agent.close = _closing(agent.close, policy_agent.close)  # type: ignore[method-assign]
    return probe, agent


def _example_module() -> Any:
    """examples/existing_agent.py imported as the module ``existing_agent`` (its folder on
    sys.path), so that agent worker processes can import its agent by name."""
    import importlib

    if str(EXAMPLE.parent) not in sys.path:
        sys.path.insert(0, str(EXAMPLE.parent))
    return importlib.import_module(EXAMPLE.stem)


def _closing(*closers: Any) -> Any:
    def close() -> None:
        for c in closers:
            c()

    return close


def run(env: Any, overrides: list[str], run_dir: Path) -> list[dict[str, Any]]:
    shutil.rmtree(run_dir, ignore_errors=True)
    return train("quickstart", env=env, out=run_dir, overrides=overrides, progress=False).rows


def overhead(
    steps: int, extra: list[str], runs: Path, model: Path | None, agent_processes: int
) -> dict[str, Any]:
    probe, agent = environments()
    paths: list[tuple[str, Any]] = [("in_process", probe), ("endpoint", agent)]
    if agent_processes:
        paths.append(("endpoint_agent_processes", environments(agent_processes)[1]))
    named = str(model) if model else "the quick-start's model after a 100-step warm-up"
    out: dict[str, Any] = {"steps": steps, "model": named, "agent_processes": agent_processes}
    start = [f"model.path={model}", "warmup.steps=0"] if model else []
    try:
        for name, env in paths:
            overrides = [*OVERHEAD, *start, *extra, f"steps={steps}"]
            rows = run(env, overrides, runs / f"endpoint-{name}")
            timed = [r for r in rows if "perf/step_s" in r and r["step"] >= 2]
            out[name] = {
                "step_s": statistics.mean(r["perf/step_s"] for r in timed),
                "rollout_s": statistics.mean(r["perf/rollout_s"] for r in timed),
                "tool_calls_mean": statistics.mean(r["rollout/tool_calls_mean"] for r in timed),
                "turns_mean": statistics.mean(r["rollout/turns_mean"] for r in timed),
                "success_mean": statistics.mean(r["rollout/success_mean"] for r in timed),
                "errors": sum(r["rollout/errors"] for r in timed),
                "steps_timed": len(timed),
            }
    finally:
        for _, env in paths[1:]:
            env.close()
    out["ratio_step"] = out["endpoint"]["step_s"] / out["in_process"]["step_s"]
    out["ratio_rollout"] = out["endpoint"]["rollout_s"] / out["in_process"]["rollout_s"]
    if agent_processes:
        own = out["endpoint_agent_processes"]
        out["ratio_step_agent_processes"] = own["step_s"] / out["in_process"]["step_s"]
        out["ratio_rollout_agent_processes"] = own["rollout_s"] / out["in_process"]["rollout_s"]
    return out


def learning(steps: int, extra: list[str], runs: Path) -> dict[str, Any]:
    _, agent = environments()
    start = time.perf_counter()
    try:
        rows = run(agent, [*LEARNING, *extra, f"steps={steps}"], runs / "endpoint-learning")
    finally:
        agent.close()
    curve = eval_curve(rows)
    reached = first_reaching(curve, 0.8)
    return {
        "steps": steps,
        "wall_s": time.perf_counter() - start,
        "curve": curve,
        "start": curve[0][2],
        "best": max(v for _, _, v in curve),
        "final": curve[-1][2],
        "reached_0.8": None if reached is None else {"step": reached[0], "rl_s": reached[1]},
        "errors": sum(r.get("rollout/errors", 0.0) for r in rows),
        "context_rewrites": sum(r.get("rollout/context_rewrites", 0.0) for r in rows),
    }


def markdown(data: dict[str, Any]) -> list[str]:
    lines = [
        "# The policy endpoint: an existing agent trained as it is",
        "",
        f"{data['date']}, {data['machine']}, torch threads {data['threads']}.",
    ]
    if "overhead" in data:
        o = data["overhead"]
        lines += [
            "",
            f"## Overhead ({o['in_process']['steps_timed']} timed steps each; {o['date']}, "
            f"{o['threads']} thread(s))",
            "",
            f"Start: {o['model']}"
            + (f"; overrides: {' '.join(o['set'])}" if o.get("set") else "")
            + ".",
            "",
            "| path | step s | rollout s | turns / episode | tool calls / episode | success | "
            "errors |",
            "|---|---|---|---|---|---|---|",
        ]
        for name in ("in_process", "endpoint", "endpoint_agent_processes"):
            if name not in o:
                continue
            r = o[name]
            lines.append(
                f"| {name} | {r['step_s']:.2f} | {r['rollout_s']:.2f} | {r['turns_mean']:.2f} | "
                f"{r['tool_calls_mean']:.2f} | {r['success_mean']:.2f} | {r['errors']:.0f} |"
            )
        lines += [
            "",
            f"Endpoint / in-process: step {o['ratio_step']:.2f}x, rollout "
            f"{o['ratio_rollout']:.2f}x (target: step at most 1.3x).",
        ]
        if "ratio_step_agent_processes" in o:
            lines.append(
                f"With the agents in {o['agent_processes']} worker process(es) "
                f"(`turnrl.AgentProcesses`): step {o['ratio_step_agent_processes']:.2f}x, "
                f"rollout {o['ratio_rollout_agent_processes']:.2f}x."
            )
    if "learning" in data:
        r = data["learning"]
        reached = r["reached_0.8"]
        lines += [
            "",
            f"## Learning through the endpoint (quick-start, held-out success; {r['date']}, "
            f"seed {r['seed']}, {r['threads']} thread(s))",
            "",
            f"Start {r['start']:.2f}, best {r['best']:.2f}, final {r['final']:.2f} after "
            f"{r['steps']} steps ({r['wall_s'] / 60:.1f} min); 0.8 "
            + (f"first at step {reached['step']}" if reached else "not reached")
            + f"; errors {r['errors']:.0f}, context rewrites {r['context_rewrites']:.0f}.",
            "",
            "| step | success |",
            "|---|---|",
            *(f"| {s} | {v:.3f} |" for s, _, v in r["curve"]),
        ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", default="overhead,learning")
    parser.add_argument("--overhead-steps", type=int, default=10)
    parser.add_argument("--overhead-model", type=Path, default=None, help="start both from it")
    parser.add_argument("--learning-steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="more overrides for both paths "
                             "(e.g. a larger model.tiny.hidden_size)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=2)
    parser.add_argument(
        "--agent-processes", type=int, default=1,
        help="overhead: also run the agents in this many worker processes (0: not)",
    )  # fmt: skip
    smoke = {"overhead_steps": 2, "learning_steps": 1}
    args = parse_args(parser, "endpoint", smoke, runs=True)
    extra = [f"threads={args.threads}", f"seed={args.seed}", *args.set]
    if args.smoke:
        extra += [o for o in TINY_RUN if not o.startswith(("steps=", "eval."))]
    runs = args.runs_dir
    data: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads max",
        "threads": args.threads,
        "seed": args.seed,
        "smoke": args.smoke,
    }
    sections = args.sections.split(",")
    previous = args.out.with_suffix(".json")
    if previous.is_file() and not args.smoke:  # a section not re-run keeps its last figures
        kept = json.loads(previous.read_text())
        data.update({k: kept[k] for k in ("overhead", "learning") if k in kept})
    stamp = {"date": data["date"], "threads": args.threads, "seed": args.seed, "set": args.set}
    if "overhead" in sections:
        started = args.overhead_model.resolve() if args.overhead_model else None
        measured = overhead(args.overhead_steps, extra, runs, started, args.agent_processes)
        data["overhead"] = {**measured, **stamp}
    if "learning" in sections:
        data["learning"] = {**learning(args.learning_steps, extra, runs), **stamp}
    lines = markdown(data)
    print("\n".join(lines))
    write_results(args.out, data, [], lines)


if __name__ == "__main__":
    main()
