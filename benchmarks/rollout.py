"""The rollout engine's cost curve: episodes and tokens per second as concurrency, turns
and tool latency grow.

A real tiny model (random weights, so it samples its whole turn budget) plays episodes of
an environment whose every model turn is one call of a tool that sleeps a fixed time
(0, 50 or 500 ms), or a random time (``jitter``: uniform 0-1 s) that desynchronises the
episodes; after ``calls`` calls the episode ends. Everything else is the training path:
``collect_groups`` -> ``BatchingClient`` -> ``TorchBackend`` (batched KV-cache sampling,
history reused across turns).

The latency target of the speed issue: with a 500 ms tool, 64 episodes that each make
3 calls take at most 1.3 x (the same batch's time with an instant tool + 3 x 0.5 s).

    python benchmarks/rollout.py
    python benchmarks/rollout.py --quick          # fewer cells
    python benchmarks/rollout.py --smoke          # 1 and 4 episodes, 0 and 500 ms, one batch

Writes benchmarks/results/rollout.json and .md; the random models are built once into
benchmarks/runs/rollout (``--out``, ``--runs-dir``; ``--smoke``: a temporary directory).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from outputs import parse_args
from turnrl import Message, StepResult, Task
from turnrl.backends import TorchBackend
from turnrl.models import load_model, load_tokenizer, stop_token_ids
from turnrl.rollout import (
    ChatRenderer,
    EpisodeLimits,
    GroupSpec,
    SamplingParams,
    ToolCallRecord,
    collect_groups,
)

ROOT = Path(__file__).resolve().parent


class SleepyToolEnv:
    """Each model turn is one call of a tool that takes ``latency`` seconds (or a random
    0-2x``latency`` with ``jitter``); the episode ends after ``calls`` calls."""

    def __init__(self, calls: int, latency: float, jitter: bool) -> None:
        self.calls, self.latency, self.jitter = calls, latency, jitter
        self.made = 0
        self.rng = random.Random(0)

    def tool_schemas(self) -> list[Any]:
        return []

    def stop_strings(self) -> tuple[str, ...]:
        return ()

    async def reset(self, task: Task, seed: int) -> list[Message]:
        self.rng = random.Random(seed)
        return list(task.prompt)

    async def step(self, action: str) -> StepResult:
        if self.made >= self.calls:
            return StepResult((), reward=0.0, terminated=True)
        wait = self.rng.uniform(0, 2 * self.latency) if self.jitter else self.latency
        t0 = time.perf_counter()
        await asyncio.sleep(wait)
        self.made += 1
        record = ToolCallRecord("sleep", {"s": wait}, time.perf_counter() - t0, ok=True)
        observation = ({"role": "tool", "content": f"call {self.made} done"},)
        return StepResult(observation, reward=0.0, info={"tool_calls": [record]})


def cell(
    backend: TorchBackend,
    renderer: ChatRenderer,
    stops: tuple[int, ...],
    *,
    episodes: int,
    calls: int,
    latency: float,
    jitter: bool,
    tokens_per_turn: int,
    seed: int,
    preamble: str = "",
) -> dict[str, Any]:
    """One batch of ``episodes`` concurrent episodes; wall time and throughput.
    ``preamble``: text every prompt starts with (a long shared instruction)."""
    tasks = [
        Task(id=f"t{i}", prompt=({"role": "user", "content": f"{preamble}Task number {i}: go."},))
        for i in range(episodes)
    ]
    limits = EpisodeLimits(
        max_turns=calls + 1, max_tokens_per_turn=tokens_per_turn,
        max_episode_tokens=tokens_per_turn * (calls + 1), max_context_tokens=1024,
    )  # fmt: skip
    spec = GroupSpec(1, limits, SamplingParams(1.0, 1.0, stops), seed=seed)
    backend.policy_version += 1  # a fresh cache: nothing from the previous cell is reused
    cache = backend.prefix_cache
    hits_before = cache.hits if cache is not None else 0
    t0 = time.perf_counter()
    groups = backend.run(
        collect_groups(tasks, lambda: SleepyToolEnv(calls, latency, jitter), backend,
                       renderer, spec)
    )  # fmt: skip
    wall = time.perf_counter() - t0
    trajs = [t for g in groups for t in g]
    errors = [t.error for t in trajs if t.error]
    if errors:
        raise RuntimeError(f"episodes failed: {errors[:3]}")
    sampled = sum(t.num_completion_tokens for t in trajs)
    return {
        "context": "long" if preamble else "short",
        "prompt_tokens": statistics.mean(len(t.turns[0].prompt_ids) for t in trajs),
        "episodes": episodes,
        "calls": calls,
        "latency_s": latency,
        "jitter": jitter,
        "wall_s": wall,
        "episodes_per_s": episodes / wall,
        "sampled_tokens_per_s": sampled / wall,
        "sampled_tokens": sampled,
        "turns_mean": statistics.mean(len(t.turns) for t in trajs),
        "template_breaks": sum(t.template_breaks for t in trajs),
        "later_turns": sum(len(t.turns) - 1 for t in trajs),
        "history_hits": (cache.hits - hits_before) if cache is not None else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: a random tiny model")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stop-every", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    smoke = {"repeats": 1, "stop_every": 4, "threads": 1}
    args = parse_args(parser, "rollout", smoke, runs=True)
    torch.set_num_threads(args.threads)
    model_dir = args.model or random_model(args.runs_dir / "rollout")
    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    renderer = ChatRenderer(tokenizer)
    # A turn ends when the random model samples its end-of-turn token, which a bias on the
    # output layer makes about 1 in ``--stop-every`` likely (a geometric length, capped at
    # 4x that). Turns end as a chat template expects, so the history re-renders exactly.
    end_of_turn_bias(model, tokenizer, args.stop_every)
    stops = stop_token_ids(tokenizer)
    concurrency = [1, 8, 64] if args.quick else [1, 4, 16, 64]
    latencies = [0.0, 0.05, 0.5]
    if args.smoke:
        concurrency, latencies = [1, 4], [0.0, 0.5]
    top = concurrency[-1]  # the batch of the latency target, the jitter and long-prompt cells
    plan = [(c, k, lat, False, "") for c in concurrency for k in (1, 3) for lat in latencies]
    plan += [(top, 3, 0.5, True, "")]
    # A long shared instruction (~550 tokens): what re-encoding the history costs.
    long = "Read the rules below before you start. " + "Each call returns a short note. " * 40
    plan += [(top, 3, 0.0, False, long)]
    results = []
    for name, reuse in (("reuse", True), ("no_reuse", False)):
        backend = TorchBackend(model, tokenizer, reuse_history=reuse)
        cells = plan if reuse else [p for p in plan if p[0] == top and p[2] == 0.0]
        turn = 4 * args.stop_every
        # warm-up
        cell(backend, renderer, stops, episodes=8, calls=1, latency=0.0, jitter=False,
             tokens_per_turn=turn, seed=1)  # fmt: skip
        for c, k, lat, jit, pre in cells:
            runs = [
                cell(backend, renderer, stops, episodes=c, calls=k, latency=lat, jitter=jit,
                     tokens_per_turn=turn, seed=r, preamble=pre)
                for r in range(args.repeats)
            ]  # fmt: skip
            best = sorted(runs, key=lambda x: x["wall_s"])[len(runs) // 2]  # the median run
            best["history_reuse"] = reuse
            best["wall_s_runs"] = [r["wall_s"] for r in runs]
            results.append(best)
            label = f"{name} episodes={c} calls={k} latency={lat:.2f}"
            label += (" jitter" if jit else "") + (" long" if pre else "")
            print(f"{label}: {best['wall_s']:.2f} s, {best['episodes_per_s']:.1f} ep/s, "
                  f"{best['sampled_tokens_per_s']:.0f} tok/s", flush=True)  # fmt: skip
    # History reuse on a wider model (hidden 256, 4 layers), where recomputing a long
    # history costs more than copying its cache: the same long-prompt cell.
    wide_dir = random_model(args.runs_dir / "rollout", wide=True)
    wide, wide_tok = load_model(wide_dir), load_tokenizer(wide_dir)
    end_of_turn_bias(wide, wide_tok, args.stop_every)
    for name, reuse in (("reuse", True), ("no_reuse", False)):
        backend = TorchBackend(wide, wide_tok, reuse_history=reuse)
        runs = [
            cell(backend, ChatRenderer(wide_tok), stops, episodes=top, calls=3, latency=0.0,
                 jitter=False, tokens_per_turn=4 * args.stop_every, seed=r, preamble=long)
            for r in range(args.repeats)
        ]  # fmt: skip
        best = sorted(runs, key=lambda x: x["wall_s"])[len(runs) // 2]
        best.update(history_reuse=reuse, wall_s_runs=[r["wall_s"] for r in runs])
        best["context"] = "long, wider model"
        results.append(best)
        print(f"wide {name}: {best['wall_s']:.2f} s", flush=True)
    write(args, results)


def end_of_turn_bias(model: Any, tokenizer: Any, mean_tokens: int) -> None:
    """Give the random model's output layer a bias that makes ``<|im_end|>`` about
    1/``mean_tokens`` likely at each step (its other logits are near-uniform)."""
    end = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    old = model.get_output_embeddings()
    vocab = int(old.weight.shape[0])
    biased = torch.nn.Linear(old.in_features, vocab, bias=True)
    biased.weight = old.weight  # the same parameter (tied embeddings stay tied)
    with torch.no_grad():
        biased.bias.zero_()
        biased.bias[end] = math.log((vocab - 1) / (mean_tokens - 1))
    model.set_output_embeddings(biased)


def random_model(work: Path, wide: bool = False) -> Path:
    """A random tiny model (or a wider one: hidden 256, 4 layers) with the default
    tokenizer, built once and cached."""
    from turnrl import load_config, train

    name = "random-wide-model" if wide else "random-model"
    start = work / name / "start_model"
    if not (start / "config.json").is_file():
        overrides = ["steps=0", "model.tiny.echo_steps=0", "warmup.steps=0", "eval.num_tasks=1"]
        if wide:
            overrides += ["model.tiny.hidden_size=256", "model.tiny.num_layers=4"]
        train(load_config("quickstart", overrides), out=work / name, progress=False)
    return start


def _find(results: list[dict[str, Any]], **want: Any) -> dict[str, Any] | None:
    return next((r for r in results if all(r[k] == v for k, v in want.items())), None)


def write(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {args.threads} torch threads",
        "torch": torch.__version__,
        "stop_every": args.stop_every,
        "repeats": args.repeats,
    }
    target = {}
    top = max(r["episodes"] for r in results)  # 64, but with --smoke
    instant = _find(
        results, episodes=top, calls=3, latency_s=0.0, history_reuse=True, context="short"
    )
    slow = _find(results, episodes=top, calls=3, latency_s=0.5, jitter=False, history_reuse=True)
    if instant and slow:
        bound = 1.3 * (instant["wall_s"] + 3 * 0.5)
        target = {
            "instant_s": instant["wall_s"],
            "tool_500ms_s": slow["wall_s"],
            "bound_s": bound,
            "met": slow["wall_s"] <= bound,
            "ratio_to_ideal": slow["wall_s"] / (instant["wall_s"] + 1.5),
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(
        json.dumps({**meta, "latency_target": target, "cells": results}, indent=2)
    )
    lines = [
        "# Rollout cost curve",
        "",
        "Rows marked *wider* use a random model of hidden size 256 and 4 layers; the others "
        "the tiny model (64, 2 layers).",
        "",
        f"{meta['date']}, {meta['machine']}, torch {meta['torch']}; random model whose "
        f"end-of-turn token is biased to about 1 in {args.stop_every} (mean turn about "
        f"{args.stop_every} tokens, at most {4 * args.stop_every}); each turn but the last "
        f"is one tool call; median of {args.repeats} batches.",
        "",
        "| history reuse | prompt tokens | episodes | calls | tool latency | wall s | episodes/s "
        "| sampled tok/s | turns/episode | later turns: history hits / template breaks |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lat = f"{r['latency_s'] * 1000:.0f} ms" + (" (uniform 0-2x)" if r["jitter"] else "")
        wider = " (*wider*)" if "wider" in r["context"] else ""
        lines.append(
            f"| {'yes' if r['history_reuse'] else 'no'}{wider} | {r['prompt_tokens']:.0f} | "
            f"{r['episodes']} | {r['calls']} | "
            f"{lat} | {r['wall_s']:.2f} | {r['episodes_per_s']:.1f} | "
            f"{r['sampled_tokens_per_s']:.0f} | {r['turns_mean']:.1f} | "
            f"{r['later_turns']}: {r['history_hits']} / {r['template_breaks']} |"
        )
    if target:
        lines += [
            "",
            f"Latency target ({top} episodes x 3 calls of a 500 ms tool): {target['tool_500ms_s']:.2f} s "
            f"against a bound of 1.3 x ({target['instant_s']:.2f} s + 1.5 s) = "
            f"{target['bound_s']:.2f} s: **{'met' if target['met'] else 'missed'}** "
            f"({target['ratio_to_ideal']:.2f}x the ideal).",
        ]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
