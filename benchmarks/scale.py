"""Beyond one process: what a learner step and a weight gather cost with 1 and 2 ranks;
what asynchronous training saves.

Section ``learner``:

For each model, side by side in one run (the learners take turns, so drift in the
machine's speed hits them alike): one learner step (``step_samples``: forward, backward,
optimizer) on the same 16 agent-like samples by the in-process ``Learner`` (1 and 2 torch
threads), a ``LearnerGroup`` of 1 rank and one of 2 ranks (FSDP2, gloo); and the time to gather the
whole weights from the shards to the driver (``full_state_dict``, what a weight sync
sends). The group's start (process spawn, imports, model load, sharding) is timed once.
Models: the tests' tiny model shape (hidden 64 x 2 layers, random weights) and one about
10x larger (hidden 192 x 5 layers), float32 on the CPU. On this 2-core machine the
2-rank group has one core per rank: it shows the overhead of ranks, not a speed-up.

Section ``async``: the same run trained synchronously (``algorithm.max_staleness = 0``)
and asynchronously (``= 1``: the next step's rollout overlaps this step's update; ``= 2``:
the next two steps' rollouts may be collected ahead), one after the other in one process: the quick-start's tiny model after a short warm-up (so it
calls the tool), secret-lookup with a lookup that takes ``--tool-latency`` seconds (500 ms),
8 x 8 episodes a step, and ``--epochs`` learner epochs per batch, chosen so that the update
takes about as long as the rollout; one torch thread (``--async-threads``), so that the
overlapped rollout and update each have one of this machine's two cores (with two threads
each they fight over both: 0.77-0.78x measured). Reported: the median step, rollout and update times over
the steps after the second, the ratio async / sync (the issue's target for k = 1: at most
0.6), and the staleness k = 2 reached (the share of trajectories 2 versions behind). The
k = 1 and 2 runs are made again with partial rollouts (``algorithm.partial_rollouts``: the
engine takes new weights mid-batch, between turns): their step times, the sampled tokens'
mean lag behind the learner, and the share of episodes that span two versions.

Section ``tail``: batches with a slow tail, one after the other and overlapping
(``algorithm.overlap_batches``). secret-lookup whose lookups take ``--tail-latency``
seconds (2 s) for one task in each batch of 8 (one group of 8 episodes in 64) and no
time for the others: a batch lasts as long as its slow group's lookups, while the engine
has little else to do. The same run synchronously, with k = 2 and partial rollouts, and
with k = 2, partial rollouts and overlapping batches; one learner epoch (the update is
short: the rollout is the slow side). The three again with the episodes on one Ray rollout
worker (``cluster.rollout_workers = 1``, one thread: the learner has the other core).
Reported: the median step, its ratio to the synchronous step of its layout, the most
batches the driver ran at once, the sampled tokens' mean lag.

Section ``workers``: rollout throughput with the episodes in process (1 and 2 torch
threads) and on 1 and 2 Ray rollout workers (``cluster.rollout_workers``, one thread
each), the same run synchronously: a 4x larger model than the async section's and 16 x 8
episodes of up to 2 turns of 48 tokens (``WORKERS_RUN``), with an instant tool (``--workers-latency``, 0 s: the rollout is the engine's compute, which more
workers can split). Reported: median rollout seconds per step, episodes per second of
rollout, and the weight sync to the workers (``perf/rollout_sync_s``). On this 2-core
machine two workers have a core each while the driver waits for them.

Section ``sync``: the weight sync to the rollout workers against the model's size, through
Ray's object store and by broadcast (``cluster.weight_sync``, gloo here), to 1 and 2 torch
workers: ``RayRolloutWorkers.sync`` of the driver's model, timed from the driver (the
weights reach every worker and are loaded into its engine). For each worker count the two
fleets run side by side and sync in turn, ``--repeats`` times after one untimed sync (the
broadcast's first forms its group: reported apart). Models: random Qwen2 models built
locally, from the tiny one to about 100M parameters, float32.

Section ``ranks``: a whole weight sync after an update, from 2 learner ranks (FSDP2, gloo)
to 2 torch workers by broadcast, the same models: through the driver's model (gathered into
it, then broadcast from it) and from the ranks themselves (rank 0 broadcasts, the driver
only coordinates: ranks_to_workers.py), the two fleets side by side, syncing in turn.

Since issue 55 every section reaches these parts through public names (``turnrl.distributed``'s
``RayRolloutWorkers``, ``GroupLearner``, ``with_adapters``; ``turnrl.trainer``'s
``WorkersSpec``, ``resolved``), and the learner section finds a rank's decoder layers as
the Qwen2 decoder layers they are (transformers' class), not through the ranks' own
lookup: the same parts, timed the same way.

    python benchmarks/scale.py
    python benchmarks/scale.py --sections sync
    python benchmarks/scale.py --sections async
    python benchmarks/scale.py --sections workers
    python benchmarks/scale.py --sections tail
    python benchmarks/scale.py --sections ranks
    python benchmarks/scale.py --smoke       # the tiny model only, one timed round

Writes benchmarks/results/scale.json and .md (``--out``; ``--smoke``: a temporary
directory).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from outputs import parse_args
from turnrl import Task
from turnrl.distributed import LearnerGroup
from turnrl.envs import SecretLookup
from turnrl.models import load_model
from turnrl.tools import ToolSet
from turnrl.trainer import AlgorithmConfig, Learner, MicroBatchConfig, Sample

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


LEARNERS = [
    "in-process, 1 thread", "in-process, 2 threads", "1 rank", "2 ranks", "2 ranks, one unit",
]  # fmt: skip
"""What is timed: the in-process learner with 1 and with 2 torch threads, a group of 1
rank (2 threads) and two of 2 ranks (1 thread each): each decoder layer an FSDP2 unit
(``cluster.fsdp_unit = "layer"``, the default) and the whole model one unit (``"model"``)."""
GROUPS = [("1 rank", 1, "layer"), ("2 ranks", 2, "layer"), ("2 ranks, one unit", 2, "model")]


def whole_parameters(learner: Any, batch: list[Sample], advantages: list[float]) -> list[int]:
    """On a rank: one update, and [the most bytes of parameters (policy and KL reference)
    held whole when a decoder layer starts its forward, the bytes of this rank's shards]."""
    from torch.distributed.tensor import DTensor
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    models = [m for m in (learner.root, learner.reference_root) if m is not None]

    def nbytes(p: Any) -> int:
        return int(p.numel() * p.element_size())

    most = [0]

    def count(module: Any, args: Any) -> None:
        whole = sum(nbytes(p) for m in models for p in m.parameters() if not isinstance(p, DTensor))
        most[0] = max(most[0], whole)

    # the decoder layers (FSDP2's units; fully_shard makes a subclass of each)
    layers = [
        layer for m in models for layer in m.modules() if isinstance(layer, Qwen2DecoderLayer)
    ]
    handles = [layer.register_forward_pre_hook(count) for layer in layers]
    try:
        learner.step_samples(batch, advantages, 0)
    finally:
        for handle in handles:
            handle.remove()
    shards = sum(nbytes(p.to_local()) for m in models for p in m.parameters())
    return [most[0], shards]


def measure(directory: Path, batch: list[Sample], repeats: int) -> dict[str, Any]:
    """Median seconds of a step per learner and of a gather per group, and each group's
    start."""
    advantages = [float((-1) ** i) for i in range(len(batch))]
    learner = Learner(load_model(directory), CONFIG, temperature=1.0)
    groups: dict[str, LearnerGroup] = {}
    start_s: dict[str, float] = {}
    try:
        for name, n, unit in GROUPS:
            t0 = time.perf_counter()
            groups[name] = LearnerGroup(
                directory, CONFIG, num_ranks=n, temperature=1.0, num_threads=2 // n,
                fsdp_unit=unit,
            )  # fmt: skip
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
        # Rank 0's figures (the ranks' are alike: the same batch on each, even shards).
        whole = {
            name: group.call(whole_parameters, batch, advantages)[0]
            for name, group in groups.items()
            if group.num_ranks > 1
        }
    finally:
        for group in groups.values():
            group.close()
    return {
        "step_s": {k: statistics.median(v) for k, v in step.items()},
        "gather_s": {k: statistics.median(v) for k, v in gather.items()},
        "start_s": start_s,
        "whole_parameter_bytes": {k: v[0] for k, v in whole.items()},
        "shard_bytes": {k: v[1] for k, v in whole.items()},
    }


ASYNC_RUN = [
    "model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.num_heads=2",
    "model.tiny.vocab_size=512", "model.tiny.echo_steps=0", "warmup.steps=60",
    "rollout.prompts_per_step=8",
    "rollout.group_size=8", "rollout.max_turns=2", "rollout.max_tokens_per_turn=24",
    "eval.every=1000", "eval.num_tasks=8", "save_every=1000", "max_minutes=0",
]  # fmt: skip
"""The async section's run (with ``env.latency_s``, ``algorithm.epochs``, ``steps``)."""


ASYNC_RUNS = (
    ("k0", 0, False), ("k1", 1, False), ("k2", 2, False), ("k1p", 1, True), ("k2p", 2, True),
)  # fmt: skip
"""(key, max_staleness, partial_rollouts) of each run of the async section, per tool."""


@dataclasses.dataclass(frozen=True)
class UnevenLookup(SecretLookup):
    """secret-lookup whose lookups take twice ``latency_s`` in the batches of even steps and
    no time in odd ones: rollouts that alternate slow and fast, as long as the steady run's
    on average (a step's tasks are the indices ``step * per_step`` onwards)."""

    per_step: int = 8

    def _tools(self, task: Task) -> ToolSet:
        split, _, index = task.id.rpartition("-")
        slow = split == "train" and int(index) // self.per_step % 2 == 0
        latency = 2 * self.latency_s if slow else 0.0
        return SecretLookup._tools(dataclasses.replace(self, latency_s=latency), task)


@dataclasses.dataclass(frozen=True)
class TailLookup(SecretLookup):
    """secret-lookup whose lookups take ``slow_s`` for the first task of each step's
    ``per_step`` (one group in each batch) and no time for the others."""

    per_step: int = 8
    slow_s: float = 2.0

    def _tools(self, task: Task) -> ToolSet:
        split, _, index = task.id.rpartition("-")
        slow = split == "train" and int(index) % self.per_step == 0
        latency = self.slow_s if slow else 0.0
        return SecretLookup._tools(dataclasses.replace(self, latency_s=latency), task)


TAIL_RUNS = (
    ("k0", 0, False, 0), ("k2p", 2, False, 0), ("k2p_overlap", 2, True, 0),
    ("k0_w1", 0, False, 1), ("k2p_w1", 2, False, 1), ("k2p_overlap_w1", 2, True, 1),
)  # fmt: skip
"""(key, max_staleness, overlap_batches, rollout workers) of the tail section's runs
(partial rollouts on with k >= 1). Each ratio is to the synchronous run of its layout."""


def tail_section(args: argparse.Namespace) -> dict[str, Any]:
    """The same run with a slow group in every batch: synchronously, with k = 2 and
    partial rollouts, and with overlapping batches too, in process and on a rollout
    worker; median step seconds."""
    from turnrl import load_config, make_env_family, train

    out: dict[str, Any] = {"slow_s": args.tail_latency, "steps": args.async_steps}
    with tempfile.TemporaryDirectory(prefix="scale-tail-") as tmp:
        for key, k, overlap, workers in TAIL_RUNS:
            settings = [
                f"cluster.rollout_workers={workers}",
                *ASYNC_RUN, "algorithm.epochs=1", f"threads={args.async_threads}",
                f"steps={args.async_steps}", f"algorithm.max_staleness={k}",
                f"algorithm.partial_rollouts={str(k > 0).lower()}",
                f"algorithm.overlap_batches={str(overlap).lower()}",
            ]  # fmt: skip
            if args.smoke:
                settings += ["warmup.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2"]
            config = load_config("quickstart", settings)
            steady = make_env_family(config.env.name, **config.env.options)
            env = TailLookup(
                **dataclasses.asdict(steady), per_step=config.rollout.prompts_per_step,
                slow_s=args.tail_latency,
            )  # fmt: skip
            rows = train(config, out=Path(tmp) / key, progress=False, env=env).rows
            stepped = [r for r in rows if "perf/step_s" in r]
            timed = stepped[2:] or stepped
            got: dict[str, Any] = {
                "step_s": statistics.median(r["perf/step_s"] for r in timed),
                "rollout_s": statistics.median(r["perf/rollout_s"] for r in timed),
                "timed_steps": len(timed),
                "tool_calls_mean": statistics.mean(r["rollout/tool_calls_mean"] for r in timed),
                "batches_at_once": max(r.get("rollout/batches_at_once", 1.0) for r in timed),
                "token_lag": statistics.mean(
                    r.get("rollout/policy_lag_tokens_mean", 0.0) for r in timed
                ),
            }
            out[key] = got
            print(f"tail, {key}", json.dumps(got), flush=True)
    for key, k, _, workers in TAIL_RUNS:
        if k:
            out[key]["ratio"] = out[key]["step_s"] / out["k0" + "_w1" * workers]["step_s"]
    return out


def tail_lines(t: dict[str, Any]) -> list[str]:
    """The tail section's table."""
    names = {"k0": "0", "k2p": "2, partial", "k2p_overlap": "2, partial, overlapping batches"}
    names.update({f"{key}_w1": f"{name}; 1 rollout worker" for key, name in names.items()})
    return [
        "",
        f"## A slow tail ({t['slow_s'] * 1000:.0f} ms lookups for one group in each batch, "
        f"none for the others; {t['steps']} steps each)",
        "",
        "| max_staleness | step s | async / sync | rollout s | tool calls / episode "
        "| most batches at once | sampled tokens' mean lag |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {names[key]} | {t[key]['step_s']:.2f} | "
            + (f"{t[key]['ratio']:.2f}x" if "ratio" in t[key] else "-")
            + f" | {t[key]['rollout_s']:.2f} | {t[key]['tool_calls_mean']:.2f} | "
            f"{t[key]['batches_at_once']:.0f} | {t[key]['token_lag']:.2f} |"
            for key, *_ in TAIL_RUNS
        ),
        "",
        "Rollout s is each batch's own wall time; with overlapping batches two of them run "
        "at once, so a step can take less than its batch.",
    ]


def lag_cells(run: dict[str, Any]) -> str:
    """The token-lag and episodes-across-versions cells of an async run's line."""
    lag = f"{run['token_lag']:.2f}" if "token_lag" in run else "-"
    return f"{lag} | " + (f"{run['across_versions']:.0%}" if "across_versions" in run else "-")


def async_line(key: str, k: int, partial: bool, run: dict[str, Any]) -> str:
    """One line of the steady tool's table."""
    stale = f"{run['stale_by_k']:.0%}" if "stale_by_k" in run else "-"
    return (
        f"| {k}{', partial' if partial else ''} | {run['step_s']:.2f} | {run['rollout_s']:.2f} "
        f"| {run['train_s']:.2f} | {run['tool_calls_mean']:.2f} | {stale} | {lag_cells(run)} |"
    )


def async_section(args: argparse.Namespace) -> dict[str, Any]:
    """The same run with max_staleness 0, 1 and 2, and 1 and 2 with partial rollouts, with a
    steady tool and with an uneven one: median and mean step/rollout/update seconds, and
    how far behind the sampled tokens were."""
    from turnrl import load_config, make_env_family, train

    out: dict[str, Any] = {
        "tool_latency_s": args.tool_latency, "epochs": args.epochs, "steps": args.async_steps,
        "threads": args.async_threads,
    }  # fmt: skip
    keys = ("perf/step_s", "perf/rollout_s", "perf/train_s")
    with tempfile.TemporaryDirectory(prefix="scale-async-") as tmp:
        for tool in ("steady", "uneven"):
            runs = out if tool == "steady" else out.setdefault("uneven", {})
            for key, k, partial in ASYNC_RUNS:
                settings = [
                    *ASYNC_RUN, f"env.latency_s={args.tool_latency}", f"algorithm.epochs={args.epochs}",
                    f"threads={args.async_threads}", f"steps={args.async_steps}", f"algorithm.max_staleness={k}",
                    f"algorithm.partial_rollouts={str(partial).lower()}",
                ]  # fmt: skip
                if args.smoke:
                    settings += [
                        "warmup.steps=2",
                        "rollout.prompts_per_step=2",
                        "rollout.group_size=2",
                    ]
                config = load_config("quickstart", settings)
                env = None
                if tool == "uneven":
                    steady = make_env_family(config.env.name, **config.env.options)
                    env = UnevenLookup(
                        **dataclasses.asdict(steady), per_step=config.rollout.prompts_per_step
                    )
                rows = train(config, env=env, out=Path(tmp) / f"{tool}-{key}", progress=False).rows
                timed = [r for r in rows if "perf/step_s" in r][2:] or [
                    r for r in rows if "perf/step_s" in r
                ]
                got = {key.split("/")[1]: statistics.median(r[key] for r in timed) for key in keys}
                got["step_s_mean"] = statistics.mean(r["perf/step_s"] for r in timed)
                got["timed_steps"] = len(timed)
                got["tool_calls_mean"] = statistics.mean(
                    r["rollout/tool_calls_mean"] for r in timed
                )
                got["stale_by_k"] = statistics.mean(r[f"rollout/staleness_{k}"] for r in timed)
                # without partial rollouts a batch is one version: its tokens lag as it does
                lag = "rollout/policy_lag_tokens_mean" if partial else "rollout/policy_lag_mean"
                got["token_lag"] = statistics.mean(r[lag] for r in timed)
                if partial:
                    got["across_versions"] = statistics.mean(
                        r["rollout/episodes_across_versions"] for r in timed
                    )
                runs[key] = got
                print(f"{tool} tool, {key}", json.dumps(got), flush=True)
            runs["ratio"] = runs["k1"]["step_s"] / runs["k0"]["step_s"]
            runs["ratio_k2"] = runs["k2"]["step_s"] / runs["k0"]["step_s"]
    u = out["uneven"]  # alternating steps: the mean is the throughput, not the median
    u["ratio_mean"] = u["k1"]["step_s_mean"] / u["k0"]["step_s_mean"]
    u["ratio_k2_mean"] = u["k2"]["step_s_mean"] / u["k0"]["step_s_mean"]
    return out


WORKER_LAYOUTS = [  # (label, overrides)
    ("in process, 1 thread", ["threads=1"]),
    ("in process, 2 threads", ["threads=2"]),
    ("1 worker", ["threads=1", "cluster.rollout_workers=1"]),
    ("2 workers", ["threads=1", "cluster.rollout_workers=2"]),
]


WORKERS_RUN = [
    "rollout.prompts_per_step=16", "rollout.max_tokens_per_turn=48",
    "model.tiny.hidden_size=128", "model.tiny.num_layers=4", "model.tiny.num_heads=4",
]  # fmt: skip
"""The workers section's changes to ``ASYNC_RUN``: a rollout with more compute (a 4x larger
model, 128 episodes of longer turns), which workers can split; with the async section's
0.3 s rollouts, the workers' per-call costs would be most of what is measured."""


def workers_section(args: argparse.Namespace) -> dict[str, Any]:
    """The same synchronous run in each ``WORKER_LAYOUTS``: rollout throughput."""
    from turnrl import load_config, train

    out: dict[str, Any] = {"tool_latency_s": args.workers_latency, "steps": args.async_steps}
    with tempfile.TemporaryDirectory(prefix="scale-workers-") as tmp:
        for i, (label, layout) in enumerate(WORKER_LAYOUTS):
            settings = [
                *ASYNC_RUN, *WORKERS_RUN, f"env.latency_s={args.workers_latency}",
                "algorithm.epochs=1",
                f"steps={args.async_steps}", *layout,
            ]  # fmt: skip
            if args.smoke:
                settings += ["warmup.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2"]
            config = load_config("quickstart", settings)
            rows = train(config, out=Path(tmp) / f"layout{i}", progress=False).rows
            timed = [r for r in rows if "perf/step_s" in r][2:] or [
                r for r in rows if "perf/step_s" in r
            ]
            episodes = config.rollout.prompts_per_step * config.rollout.group_size
            rollout_s = statistics.median(r["perf/rollout_s"] for r in timed)
            syncs = [r["perf/rollout_sync_s"] for r in timed if "perf/rollout_sync_s" in r]
            out[label] = {
                "rollout_s": rollout_s,
                "step_s": statistics.median(r["perf/step_s"] for r in timed),
                "episodes_per_s": episodes / rollout_s,
                "sync_s": statistics.median(syncs) if syncs else None,
                "timed_steps": len(timed),
            }
            print(label, json.dumps(out[label]), flush=True)
    return out


SYNC_MODELS = [(64, 2), (256, 4), (512, 8), (1024, 8)]
"""(hidden size, layers) of the sync section's models: 0.1M to about 100M parameters."""


def sync_models(args: argparse.Namespace, section: str) -> Iterator[tuple[dict[str, Any], Any]]:
    """For the sync and ranks sections, under a local Ray cluster: each of
    ``SYNC_MODELS`` (the first only with ``--smoke``) built locally. Yields ``(row, made)``:
    the section's row for it, begun (hidden, layers, parameters; printed once the section
    has filled it), and ``made``, its (path, model, tokenizer)."""
    import ray

    from turnrl.models import TinyModelConfig, build_tiny_model, load_tokenizer

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory(prefix=f"scale-{section}-") as tmp:
            for hidden, layers in SYNC_MODELS[:1] if args.smoke else SYNC_MODELS:
                shape = TinyModelConfig(
                    hidden_size=hidden, num_layers=layers, num_heads=4, vocab_size=1024,
                    intermediate_size=hidden * 3,
                )  # fmt: skip
                path = build_tiny_model(Path(tmp) / f"m{hidden}x{layers}", shape)
                model, tokenizer = load_model(path, dtype=torch.float32), load_tokenizer(path)
                params = sum(p.numel() for p in model.parameters())
                row = {"hidden": hidden, "layers": layers, "params": params}
                yield row, (path, model, tokenizer)
                print(section, json.dumps(row), flush=True)
    finally:
        ray.shutdown()


def workers_spec(n: int, weight_sync: str, made: Any, *more: str) -> Any:
    """The ``WorkersSpec`` of ``n`` one-thread workers synced by ``weight_sync`` for a
    model ``sync_models`` made (``more``: the run's other settings)."""
    from turnrl import load_config, make_env_family
    from turnrl.trainer import WorkersSpec, resolved

    path, model, tokenizer = made
    c = resolved(
        load_config(None, [f"cluster.rollout_workers={n}", "threads=1",
                           f"cluster.weight_sync={weight_sync}", *more])
    )  # fmt: skip
    return WorkersSpec(c, make_env_family(c.env.name, **c.env.options), model, tokenizer, 0, path)


def section_meta(args: argparse.Namespace) -> dict[str, Any]:
    """What the sync and ranks sections' results begin with: the date, the load, rows."""
    return {
        "date": time.strftime("%Y-%m-%d"), "load_average_before": os.getloadavg()[0],
        "repeats": args.repeats, "rows": [],
    }  # fmt: skip


def sync_section(args: argparse.Namespace) -> dict[str, Any]:
    """``RayRolloutWorkers.sync`` seconds by model size, weight sync and worker count."""
    from turnrl.distributed import RayRolloutWorkers

    out = section_meta(args)
    for row, made in sync_models(args, "sync"):
        model = made[1]
        for n in (1, 2):
            fleets = {}
            for mode in ("object_store", "broadcast"):
                spec = workers_spec(n, mode, made)
                fleets[mode] = RayRolloutWorkers(spec, n, threads=1, weight_sync=mode)
            try:
                times: dict[str, list[float]] = {mode: [] for mode in fleets}
                for r in range(args.repeats + 1):
                    for mode, fleet in fleets.items():
                        t0 = time.perf_counter()
                        fleet.sync(model, r + 1)
                        times[mode].append(time.perf_counter() - t0)
            finally:
                for fleet in fleets.values():
                    fleet.close()
            for mode, ts in times.items():
                row[f"{mode}, {n}"] = statistics.median(ts[1:])
            row[f"broadcast first, {n}"] = times["broadcast"][0]
        out["rows"].append(row)
    return out


def sync_table(sync: dict[str, Any]) -> list[str]:
    """The sync section's table: seconds, and what they make per second of weights."""
    lines = [
        "",
        f"## Weight sync to rollout workers (median of {sync['repeats']}, torch workers)",
        "",
        f"{sync.get('date', '')}, load average before: {sync.get('load_average_before', 0):.1f}.",
        "",
        "| model | parameters | MB | object store, 1 worker s | broadcast, 1 worker s "
        "| object store, 2 workers s | broadcast, 2 workers s | broadcast's first (group "
        "formed), 2 workers s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sync["rows"]:
        lines.append(
            f"| {r['hidden']} x {r['layers']} | {r['params'] / 1e6:.2f}M | "
            f"{r['params'] * 4 / 2**20:.1f} | {r['object_store, 1']:.3f} | "
            f"{r['broadcast, 1']:.3f} | {r['object_store, 2']:.3f} | {r['broadcast, 2']:.3f} | "
            f"{r['broadcast first, 2']:.2f} |"
        )
    lines += [
        "",
        "Timed from the driver: the weights leave the driver's model and are loaded into "
        "every worker's engine. Broadcast: gloo over this machine's loopback (on GPUs it "
        "would be NCCL, not measured here); object store: one put into Ray's shared memory, "
        "each worker reading it.",
    ]
    return lines


RANKS_SYNC = ("through the driver", "from the ranks")
"""The ranks section's two ways: the weights gathered into the driver's model, then
broadcast from it; or broadcast by rank 0 itself, the driver only coordinating."""
RANKS_LORA = {"rank": 16, "alpha": 32.0, "target_modules": ("all-linear",)}
"""The ranks section's LoRA policy: rank-16 adapters on every linear layer."""
RANKS_CASES = (("", False, 0), ("LoRA, ", True, 0), ("k = 1, ", False, 1))
"""The ranks section's cases: (its keys' prefix, LoRA, ``algorithm.max_staleness``)."""


def ranks_section(args: argparse.Namespace) -> dict[str, Any]:
    """A whole weight sync after an update, from 2 learner ranks to 2 torch workers, by
    broadcast: through the driver's model, and from the ranks themselves; the two fleets
    side by side, syncing in turn. The same for a LoRA policy (``RANKS_LORA``), whose
    sync sends the merged weights, and for an asynchronous run a step deep, whose driver
    keeps a copy of each sync it sends (rank 0, where the ranks send)."""
    out = section_meta(args)
    for row, made in sync_models(args, "ranks"):
        for prefix, lora, staleness in RANKS_CASES:
            for way, seconds in ranks_sync_times(args, made, lora, staleness).items():
                row[f"{prefix}{way}"] = seconds
        out["rows"].append(row)
    return out


def ranks_sync_times(
    args: argparse.Namespace, made: Any, lora: bool, staleness: int = 0
) -> dict[str, float]:
    """Each of ``RANKS_SYNC``'s median seconds for the model ``made`` (with ``lora``, its
    LoRA policy: adapters moved off zero, so the merge is not a no-op), in a run with
    ``algorithm.max_staleness = staleness``."""
    import functools

    from turnrl.distributed import GroupLearner, RayRolloutWorkers, with_adapters
    from turnrl.models import add_lora

    path, model, tokenizer = made
    source: Any = path
    if lora:
        load = functools.partial(load_model, path, dtype=torch.float32)
        source = functools.partial(with_adapters, load, **RANKS_LORA)
        model = add_lora(load(), **RANKS_LORA)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.01)
        made = (path, model, tokenizer)
    spec = workers_spec(2, "broadcast", made, f"algorithm.max_staleness={staleness}")
    group = LearnerGroup(source, CONFIG, num_ranks=2, temperature=1.0, num_threads=1)
    group.load_weights(model.state_dict())
    fleets: dict[str, Any] = {}
    try:
        for way in RANKS_SYNC:
            fleets[way] = RayRolloutWorkers(spec, 2, threads=1, weight_sync="broadcast")
        fleets["from the ranks"].send_from_ranks(GroupLearner(group, model), keep=staleness > 0)
        times: dict[str, list[float]] = {way: [] for way in RANKS_SYNC}
        for r in range(args.repeats + 1):  # the first forms the groups
            for way, fleet in fleets.items():
                t0 = time.perf_counter()
                if way == "through the driver":  # what GroupLearner.refresh_model does
                    model.load_state_dict(group.full_state_dict(trainable=lora), strict=not lora)
                fleet.sync(model, r + 1)
                times[way].append(time.perf_counter() - t0)
    finally:
        for fleet in fleets.values():
            fleet.close()
        group.close()
    return {way: statistics.median(ts[1:]) for way, ts in times.items()}


def ranks_table(ranks: dict[str, Any]) -> list[str]:
    """The ranks section's table."""
    lines = [
        "",
        f"## Weight sync from 2 learner ranks to 2 rollout workers (median of "
        f"{ranks['repeats']}, broadcast, torch workers)",
        "",
        f"{ranks['date']}, load average before: {ranks['load_average_before']:.1f}.",
        "",
        "| model | parameters | through the driver's model s | from the ranks s | ratio "
        "| LoRA, through the driver's model s | LoRA, from the ranks s | LoRA ratio "
        "| k = 1, through the driver's model s | k = 1, from the ranks s | k = 1 ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in ranks["rows"]:
        cells = []
        for prefix, _, _ in RANKS_CASES:
            a, b = r.get(f"{prefix}through the driver"), r.get(f"{prefix}from the ranks")
            cells += (
                ["-"] * 3 if a is None or b is None else [f"{a:.3f}", f"{b:.3f}", f"{b / a:.2f}x"]
            )
        lines.append(
            f"| {r['hidden']} x {r['layers']} | {r['params'] / 1e6:.2f}M | "
            + " | ".join(cells)
            + " |"
        )
    lines += [
        "",
        "Timed from the driver, from the end of an update to the weights loaded in every "
        "worker's engine. Through the driver's model: the ranks gather the weights to rank "
        "0, which sends them to the driver through a pipe; the driver copies them into its "
        "model and broadcasts them (what a run with `algorithm.max_staleness` >= 2 or "
        "partial rollouts does). From the ranks: rank 0 broadcasts them itself "
        "(ranks_to_workers.py), gloo over this machine's loopback (a synchronous run, or "
        "one with `max_staleness` = 1, whose rank 0 also keeps what it sent). LoRA (rank 16 "
        "on every linear layer, parameters counted without the adapters): through the "
        "driver only the adapters are gathered and sent, "
        "and the driver merges them into its base; from the ranks, rank 0 keeps the base it "
        "gathered at the first sync, gathers the adapters and merges them. Either way the "
        "workers are sent the whole merged weights. k = 1: an asynchronous run a step deep "
        "(`algorithm.max_staleness` = 1), whose sync is kept for a worker replaced while "
        "the ranks run the next update: through the driver, the driver copies the weights "
        "it sends; from the ranks, rank 0 keeps those it sent.",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sections",
        nargs="+",
        default=["learner", "async", "tail", "workers", "sync", "ranks"],
    )
    parser.add_argument(
        "--tail-latency", type=float, default=2.0, help="the slow lookups' seconds (tail section)"
    )
    parser.add_argument(
        "--workers-latency", type=float, default=0.0, help="tool seconds (workers section)"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--tool-latency", type=float, default=0.5)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--async-steps", type=int, default=10)
    parser.add_argument(
        "--async-threads", type=int, default=1, help="torch threads (one core each)"
    )
    smoke = {
        "repeats": 1, "samples": 8, "tool_latency": 0.05, "epochs": 1, "async_steps": 3,
        "tail_latency": 0.1,
    }  # fmt: skip
    args = parse_args(parser, "scale", smoke)
    batch = samples(args.samples)
    load_before = os.getloadavg()[0]
    rows = []
    previous = args.out.with_suffix(".json")
    kept = json.loads(previous.read_text()) if previous.is_file() and not args.smoke else {}
    with tempfile.TemporaryDirectory(prefix="scale-models-") as tmp:
        for name, hidden, layers, width in (
            [] if "learner" not in args.sections else MODELS[:1] if args.smoke else MODELS
        ):
            directory = Path(tmp) / f"h{hidden}x{layers}"
            params = save_model(directory, hidden, layers, width)
            row = {"model": name, "params": params, **measure(directory, batch, args.repeats)}
            rows.append(row)
            print(name, json.dumps({k: v for k, v in row.items() if k != "model"}), flush=True)
    asynchronous = async_section(args) if "async" in args.sections else kept.get("async")
    tail = tail_section(args) if "tail" in args.sections else kept.get("tail")
    workers = workers_section(args) if "workers" in args.sections else kept.get("workers")
    sync = sync_section(args) if "sync" in args.sections else kept.get("sync")
    ranks = ranks_section(args) if "ranks" in args.sections else kept.get("ranks")
    if "learner" not in args.sections:  # a section not re-run keeps its last figures
        rows = kept.get("rows", [])
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "load_average_before_after": [load_before, os.getloadavg()[0]],
        "torch": torch.__version__,
        "repeats": args.repeats,
        "samples": args.samples,
        "tokens": sum(len(s.input_ids) for s in batch),
    }
    if "learner" not in args.sections:  # the learner table's figures are the kept ones
        meta.update({k: kept[k] for k in meta if k in kept})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    data = {
        **meta, "rows": rows, **({"async": asynchronous} if asynchronous else {}),
        **({"tail": tail} if tail else {}),
        **({"workers": workers} if workers else {}), **({"sync": sync} if sync else {}),
        **({"ranks": ranks} if ranks else {}),
    }  # fmt: skip
    args.out.with_suffix(".json").write_text(json.dumps(data, indent=2))
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
        "| step 1 rank s | step 2 ranks s | step 2 ranks, one unit s | gather 1 rank s "
        "| gather 2 ranks s | gather 2 ranks, one unit s | start 1 rank s | start 2 ranks s "
        "| start 2 ranks, one unit s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    groups = [name for name, _, _ in GROUPS]
    for r in rows:
        s, g, st = r["step_s"], r["gather_s"], r["start_s"]
        lines.append(
            f"| {r['model']} | {r['params'] / 1e6:.2f}M | "
            + " | ".join(f"{s[k]:.3f}" for k in LEARNERS)
            + " | "
            + " | ".join(f"{g[k]:.4f}" for k in groups)
            + " | "
            + " | ".join(f"{st[k]:.1f}" for k in groups)
            + " |"
        )
    lines += [
        "",
        '2 ranks: each decoder layer an FSDP2 unit (`cluster.fsdp_unit = "layer"`, the '
        'default); one unit: the whole model (`"model"`). Gather: '
        "`LearnerGroup.full_state_dict()`, the whole weights from the FSDP2 shards "
        "to the driver's CPU memory (the first half of a weight sync; the broadcast to "
        "engines is not measured here). Start: spawning the ranks, importing, loading the "
        "model and sharding it.",
        "",
        "Parameters held whole by a rank, at most, when a decoder layer starts its forward "
        "during a step (rank 0; the root's embeddings and output layer count in both), "
        "against its shards of them:",
        "",
        "| model | parameters MB | 2 ranks: most whole MB | 2 ranks, one unit: most whole MB "
        "| shards per rank MB |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        w, mb = r["whole_parameter_bytes"], 2**20
        lines.append(
            f"| {r['model']} | {r['params'] * 4 / mb:.1f} | {w['2 ranks'] / mb:.1f} "
            f"| {w['2 ranks, one unit'] / mb:.1f} | {r['shard_bytes']['2 ranks'] / mb:.1f} |"
        )
    if asynchronous:
        a = asynchronous
        lines += [
            "",
            f"## Asynchronous training ({a['tool_latency_s'] * 1000:.0f} ms tool, "
            f"{a['epochs']} learner epochs a batch, {a['steps']} steps each, "
            f"{a.get('threads', 2)} torch thread(s))",
            "",
            "| max_staleness | step s | rollout s | update s | tool calls / episode "
            "| trajectories k versions behind | sampled tokens' mean lag | episodes across "
            "versions |",
            "|---|---|---|---|---|---|---|---|",
            *(async_line(key, k, partial, a[key]) for key, k, partial in ASYNC_RUNS if key in a),
            "",
            f"Step time, async / sync: **{a['ratio']:.2f}x** with max_staleness 1 (target: at "
            "most 0.6x)"
            + (f", {a['ratio_k2']:.2f}x with 2" if "ratio_k2" in a else "")
            + ". In an asynchronous run the update column is the step's time not spent "
            "waiting for the batch collected ahead; the rollouts ran beside the updates.",
        ]
        if "uneven" in a:
            u = a["uneven"]
            lines += [
                "",
                f"Uneven rollouts: the same runs with lookups of {2 * a['tool_latency_s'] * 1000:.0f}"
                " ms in even steps' batches and of 0 ms in odd ones (the same on average). "
                "Mean step over the timed steps (they alternate, so the median says little):",
                "",
                "| max_staleness | mean step s | median rollout s | median update s "
                "| trajectories k versions behind | sampled tokens' mean lag | episodes across "
                "versions |",
                "|---|---|---|---|---|---|---|",
                *(
                    f"| {k}{', partial' if partial else ''} | {u[key]['step_s_mean']:.2f} | "
                    f"{u[key]['rollout_s']:.2f} | {u[key]['train_s']:.2f} | "
                    f"{u[key]['stale_by_k']:.0%} | {lag_cells(u[key])} |"
                    for key, k, partial in ASYNC_RUNS
                    if key in u
                ),
                "",
                f"Mean step time, async / sync: **{u['ratio_mean']:.2f}x** with max_staleness 1, "
                f"**{u['ratio_k2_mean']:.2f}x** with 2.",
            ]
    if tail:
        lines += tail_lines(tail)
    if workers:
        w = workers
        base = w["in process, 1 thread"]["episodes_per_s"]
        lines += [
            "",
            f"## Rollout workers ({w['tool_latency_s'] * 1000:.0f} ms tool, synchronous, "
            f"{w['steps']} steps each)",
            "",
            "| episodes run | rollout s | episodes / s | vs in process, 1 thread | "
            "weight sync to workers s |",
            "|---|---|---|---|---|",
            *(
                f"| {label} | {w[label]['rollout_s']:.2f} | {w[label]['episodes_per_s']:.1f} | "
                f"{w[label]['episodes_per_s'] / base:.2f}x | "
                + (f"{w[label]['sync_s']:.3f}" if w[label]["sync_s"] is not None else "-")
                + " |"
                for label, _ in WORKER_LAYOUTS
            ),
            "",
            "Workers run one torch thread each; the driver (which trains) waits while they "
            "sample. The evaluation's episodes run on the workers too (not timed here).",
        ]
    if sync:
        lines += sync_table(sync)
    if ranks:
        lines += ranks_table(ranks)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
