"""Beyond one process: what a learner step and a weight gather cost with 1 and 2 ranks.

For each model, side by side in one run (the learners take turns, so drift in the
machine's speed hits them alike): one learner step (``step_samples``: forward, backward,
optimizer) on the same 16 agent-like samples by the in-process ``Learner`` (1 and 2 torch
threads), a ``LearnerGroup`` of 1 rank and one of 2 ranks (FSDP2, gloo); and the time to gather the
whole weights from the shards to the driver (``full_state_dict``, what a weight sync
sends). The group's start (process spawn, imports, model load, sharding) is timed once.
Models: the tests' tiny model shape (hidden 64 x 2 layers, random weights) and one about
10x larger (hidden 192 x 5 layers), float32 on the CPU. On this 2-core machine the
2-rank group has one core per rank: it shows the overhead of ranks, not a speed-up.

    python benchmarks/scale.py
    python benchmarks/scale.py --smoke       # the tiny model only, one timed round

Writes benchmarks/results/scale.json and .md (``--out``; ``--smoke``: a temporary
directory).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from outputs import parse_args
from turnrl.distributed import LearnerGroup
from turnrl.models import load_model
from turnrl.trainer.config import AlgorithmConfig, MicroBatchConfig
from turnrl.trainer.learner import Learner
from turnrl.types import Sample

VOCAB = 1024
MODELS = [("tiny (64 x 2)", 64, 2, 512), ("larger (192 x 5)", 192, 5, 768)]
"""(name, hidden size, layers, MLP width): the tests' tiny model's shape, and one with
about 10x its parameters."""
CONFIG = AlgorithmConfig(lr=1e-5, micro_batch=MicroBatchConfig(size=8))


def samples(n: int, seed: int = 0) -> list[Sample]:
    """Agent-like samples: a shared 60-token prompt, 20-60 tokens of turns, the loss on
    the turns."""
    rng = random.Random(seed)
    prompt = [rng.randrange(1, VOCAB) for _ in range(60)]
    out = []
    for _ in range(n):
        ids = prompt + [rng.randrange(1, VOCAB) for _ in range(rng.randint(20, 60))]
        mask = [0] * len(prompt) + [1] * (len(ids) - len(prompt))
        logps = [-6.9 if m else 0.0 for m in mask]
        out.append(Sample(tuple(ids), tuple(mask), tuple(logps)))
    return out


def save_model(directory: Path, hidden: int, layers: int, width: int) -> int:
    """A random Qwen2 model of that shape saved to ``directory``; its parameter count."""
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=width,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=1024, tie_word_embeddings=True,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


LEARNERS = ["in-process, 1 thread", "in-process, 2 threads", "1 rank", "2 ranks"]
"""What is timed: the in-process learner with 1 and with 2 torch threads, a group of 1
rank (2 threads) and one of 2 ranks (1 thread each)."""


def measure(directory: Path, batch: list[Sample], repeats: int) -> dict[str, Any]:
    """Median seconds of a step per learner and of a gather per group, and each group's
    start."""
    advantages = [float((-1) ** i) for i in range(len(batch))]
    learner = Learner(load_model(directory), CONFIG, temperature=1.0)
    groups: dict[str, LearnerGroup] = {}
    start_s: dict[str, float] = {}
    try:
        for name, n in (("1 rank", 1), ("2 ranks", 2)):
            t0 = time.perf_counter()
            groups[name] = LearnerGroup(
                directory, CONFIG, num_ranks=n, temperature=1.0, num_threads=2 // n
            )
            start_s[name] = time.perf_counter() - t0
        step: dict[str, list[float]] = {name: [] for name in LEARNERS}
        gather: dict[str, list[float]] = {name: [] for name in groups}
        for r in range(repeats + 1):  # the first round warms up
            times = {}
            for threads in (1, 2):
                torch.set_num_threads(threads)
                t0 = time.perf_counter()
                learner.step_samples(batch, advantages, pad_id=0)
                times[LEARNERS[threads - 1]] = time.perf_counter() - t0
            for name, group in groups.items():
                t0 = time.perf_counter()
                group.step_samples(batch, advantages, pad_id=0)
                times[name] = time.perf_counter() - t0
                t0 = time.perf_counter()
                weights = group.full_state_dict()
                if r:
                    gather[name].append(time.perf_counter() - t0)
                assert len(weights) == len(learner.model.state_dict())
            if r:
                for name, seconds in times.items():
                    step[name].append(seconds)
    finally:
        for group in groups.values():
            group.close()
    return {
        "step_s": {k: statistics.median(v) for k, v in step.items()},
        "gather_s": {k: statistics.median(v) for k, v in gather.items()},
        "start_s": start_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--samples", type=int, default=16)
    args = parse_args(parser, "scale", {"repeats": 1, "samples": 8})
    batch = samples(args.samples)
    load_before = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory(prefix="scale-models-") as tmp:
        for name, hidden, layers, width in MODELS[:1] if args.smoke else MODELS:
            directory = Path(tmp) / f"h{hidden}x{layers}"
            params = save_model(directory, hidden, layers, width)
            row = {"model": name, "params": params, **measure(directory, batch, args.repeats)}
            rows.append(row)
            print(name, json.dumps({k: v for k, v in row.items() if k != "model"}), flush=True)
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "load_average_before_after": [load_before, os.getloadavg()[0]],
        "torch": torch.__version__,
        "repeats": args.repeats,
        "samples": args.samples,
        "tokens": sum(len(s.input_ids) for s in batch),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
    lines = [
        "# Learner across ranks",
        "",
        f"{meta['date']}, {meta['machine']}, torch {meta['torch']}; one learner step "
        f"(`step_samples`: forward, backward, optimizer) on {args.samples} samples "
        f"({meta['tokens']} tokens), median of {args.repeats}, the learners taking turns; "
        "FSDP2 over gloo, the ranks sharing the machine's cores (1 torch thread each with "
        "2 ranks, 2 with 1). Load average before/after: "
        + " / ".join(f"{x:.1f}" for x in meta["load_average_before_after"])
        + " (other jobs share these cores: a learner with 2 threads suffers most).",
        "",
        "| model | parameters | step in-process 1 thread s | step in-process 2 threads s "
        "| step 1 rank s | step 2 ranks s | gather 1 rank s | gather 2 ranks s "
        "| start 1 rank s | start 2 ranks s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s, g, st = r["step_s"], r["gather_s"], r["start_s"]
        lines.append(
            f"| {r['model']} | {r['params'] / 1e6:.2f}M | "
            + " | ".join(f"{s[k]:.3f}" for k in LEARNERS)
            + f" | {g['1 rank']:.4f} | {g['2 ranks']:.4f} "
            f"| {st['1 rank']:.1f} | {st['2 ranks']:.1f} |"
        )
    lines += [
        "",
        "Gather: `LearnerGroup.full_state_dict()`, the whole weights from the FSDP2 shards "
        "to the driver's CPU memory (the first half of a weight sync; the broadcast to "
        "engines is not measured here). Start: spawning the ranks, importing, loading the "
        "model and sharding it.",
    ]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
