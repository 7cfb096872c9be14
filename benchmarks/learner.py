"""The learner's forward/backward layouts side by side: right-padded rows, right-padded
rows with the common prefix run once, packed sequences,

and ``auto`` (the default), which picks per micro-batch whichever runs fewer positions.

Two batches of 32 samples, the loss on each sample's last 75% of tokens:
- ``agent``: one shared 100-token prompt (system, tools, question) and 20-60 tokens of
  turns each: what a group of agent rollouts looks like;
- ``varied``: unrelated sequences of 32-512 tokens: long-tailed lengths, no common prefix.

Each cell is the median of 5 learner steps (``Learner.step_samples``, one optimizer step;
the layouts take turns) on the tiny model and on a wider one (hidden 256, 4 layers),
float32 on CPU.

``padded`` (no prefix run once) is the ``padded`` layout on the same batch with the first
token of one sample changed, so that the rows share no prefix: every row runs in full, as
many positions as before, and a step's cost does not depend on the tokens' values. The
packed cells are those the ``packed`` learner's model is called with (a forward pre-hook on
its base model, in the untimed first round). Before issue 55 both came from inside the
trainer (its prefix threshold set out of reach, its packing function called apart): the
same figures through public names.

    python benchmarks/learner.py
    python benchmarks/learner.py --smoke       # the tiny model only, one timed step each

Writes benchmarks/results/learner.json and .md (``--out``; ``--smoke``: a temporary
directory).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from outputs import parse_args
from turnrl.trainer import AlgorithmConfig, Learner, MicroBatchConfig, Sample

ROOT = Path(__file__).resolve().parent
VOCAB = 1024
MODELS = [("tiny (64 x 2)", 64, 2), ("wider (256 x 4)", 256, 4)]


def batch(kind: str, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    prompt = [rng.randrange(1, VOCAB) for _ in range(100)]
    samples = []
    for _ in range(32):
        if kind == "agent":
            ids = prompt + [rng.randrange(1, VOCAB) for _ in range(rng.randint(20, 60))]
        else:
            ids = [rng.randrange(1, VOCAB) for _ in range(rng.randint(32, 512))]
        trained = len(ids) // 4
        mask = [0] * trained + [1] * (len(ids) - trained)
        logps = [-6.9 if m else 0.0 for m in mask]
        samples.append(Sample(tuple(ids), tuple(mask), tuple(logps)))
    return samples


def model(hidden: int, layers: int) -> Any:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=4 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=1024,
    )  # fmt: skip
    return Qwen2ForCausalLM(config)


def unshared(samples: list[Sample]) -> list[Sample]:
    """``samples`` with the first sample's first token changed: the rows then share no
    prefix, so the padded layout runs every row in full (the same positions)."""
    first = samples[0]
    ids = (first.input_ids[0] % (VOCAB - 1) + 1, *first.input_ids[1:])
    return [dataclasses.replace(first, input_ids=ids), *samples[1:]]


def time_layouts(
    net: Any, samples: list[Sample], layouts: list[str], repeats: int
) -> tuple[dict[str, float], int]:
    """Median seconds of one learner step per layout, the layouts taking turns (round
    robin) so that drift in the machine's speed hits them alike; and the token positions
    the packed layout's model call runs (its cells)."""
    advantages = [float((-1) ** i) for i in range(len(samples))]
    learners = {}
    for layout in layouts:
        chosen = "padded" if layout.startswith("padded") else layout
        config = AlgorithmConfig(lr=1e-5, micro_batch=MicroBatchConfig(size=32, layout=chosen))
        learners[layout] = Learner(copy.deepcopy(net), config, temperature=1.0)
    rows = {layout: unshared(samples) if layout == "padded" else samples for layout in layouts}
    cells: list[int] = []

    def count(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        cells.append(kwargs["input_ids"].numel())

    hook = learners["packed"].model.base_model.register_forward_pre_hook(count, with_kwargs=True)
    times: dict[str, list[float]] = {layout: [] for layout in layouts}
    for r in range(repeats + 1):  # the first round warms up
        for layout in layouts:
            t0 = time.perf_counter()
            learners[layout].step_samples(rows[layout], advantages, pad_id=0)
            if r:
                times[layout].append(time.perf_counter() - t0)
        hook.remove()  # the first round's packed step has been counted
    return {layout: statistics.median(t) for layout, t in times.items()}, cells[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parse_args(parser, "learner", {"repeats": 1, "threads": 1})
    torch.set_num_threads(args.threads)
    layouts = ["padded", "padded + shared prefix", "packed", "auto"]
    rows = []
    for name, hidden, layers in MODELS[:1] if args.smoke else MODELS:
        net = model(hidden, layers)
        for kind in ("agent", "varied"):
            samples = batch(kind)
            lengths = [len(s.input_ids) for s in samples]
            real = sum(lengths)
            padded_cells = len(lengths) * max(lengths)
            times, packed_cells = time_layouts(net, samples, layouts, args.repeats)
            row = {
                "model": name, "batch": kind, "tokens": real,
                "padded_cells": padded_cells, "packed_cells": packed_cells, "step_s": times,
            }  # fmt: skip
            rows.append(row)
            print(name, kind, {k: round(v, 4) for k, v in times.items()}, flush=True)
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {args.threads} torch threads",
        "torch": torch.__version__,
        "repeats": args.repeats,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
    lines = [
        "# Learner layouts",
        "",
        f"{meta['date']}, {meta['machine']}, torch {meta['torch']}; one learner step "
        f"(forward, backward, optimizer) on 32 samples, median of {args.repeats}.",
        "",
        "| model | batch | real tokens | padded cells | packed cells | padded s "
        "| padded + shared prefix s | packed s | auto (default) s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = r["step_s"]
        best = min(t.values())
        cells = [f"**{t[k]:.3f}**" if t[k] == best else f"{t[k]:.3f}" for k in layouts]
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['tokens']} | {r['padded_cells']} | "
            f"{r['packed_cells']} | " + " | ".join(cells) + " |"
        )
    lines += [
        "",
        "`algorithm.sequence_layout`: `padded` (common prefix run once), `packed`, or "
        "`auto` (the default: whichever runs fewer token positions, per micro-batch).",
    ]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
