"""turnrl's torch path on a CUDA device: a real-sized model's training step, and the probe.

Two sections, each a real ``turnrl.train`` run (rollouts with the torch sampler, the
learner, the start-up check, the final checkpoint):

- ``real``: a random model shaped like Qwen2.5-0.5B (hidden 896, 24 layers, 14 heads, 2
  key-value heads, MLP 4864, vocabulary 151,936; 494M parameters), with the quick-start's
  tokenizer (its ids are a subset of the larger vocabulary), on secret-lookup episodes
  (``--prompts`` x ``--group`` episodes a step, up to 2 turns of ``--turn-tokens``
  tokens). Five learner set-ups (``--setups`` picks some), ``--steps`` steps each: full
  fine-tuning in float32; in bf16-mixed (float32 master weights, gradients and AdamW
  state; bf16 autocast) with the torch sampler sharing the learner's model (autocast
  too), and with its default bf16 copy (``rollout.sampler_weights``); the latter with
  gradient checkpointing; and LoRA (rank 16, every linear layer) in bf16-mixed, merged
  into the bf16 sampler.
  Reported per set-up: median step, rollout and learner seconds over the steps after the
  first, sampled tokens/s, the start-up check's largest log-prob gap, peak GPU memory
  (``torch.cuda.max_memory_allocated``, reset before each set-up), and the whole run's
  wall time (model load, start-up check and the final checkpoint included).
- ``probe``: the quick-start recipe (the tiny model built locally, echo tuning, warm-up,
  GiGPO on the secret-lookup probe) on the device in bf16-mixed (``--probe-set`` adds or
  replaces settings, e.g. ``model.precision=float32 seed=1``), capped at
  ``--probe-minutes`` of RL: the held-out success curve, step time and peak memory.

A random model never finishes a turn early, so ``real``'s episodes run to the token
limit: the figures are throughput and memory, not learning.

    python benchmarks/gpu.py                 # on a machine with CUDA
    python benchmarks/gpu.py --smoke         # tiny shapes on the CPU, seconds

Without CUDA only ``--smoke`` runs (the same code on the CPU, float32). Writes
benchmarks/results/gpu.json and .md (``--out``); runs and models go to benchmarks/runs/gpu
(``--runs-dir``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from outputs import parse_args
from turnrl import load_config, train
from turnrl.models import TinyModelConfig, build_tiny_model, load_tokenizer

QWEN25_05B = {
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
    "max_position_embeddings": 4096, "tie_word_embeddings": True, "rope_theta": 1000000.0,
}  # fmt: skip
"""Qwen2.5-0.5B's shape (its config.json), context cut to 4096."""
SMOKE_SHAPE = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 4096,
    "max_position_embeddings": 1024, "tie_word_embeddings": True,
}  # fmt: skip
SETUPS: dict[str, list[str]] = {
    "full, float32": [],
    "full, bf16-mixed, shared sampler": [
        "model.precision=bf16-mixed",
        "rollout.sampler_weights=shared",
    ],
    "full, bf16-mixed": ["model.precision=bf16-mixed"],
    "full, bf16-mixed, grad ckpt": [
        "model.precision=bf16-mixed",
        "model.gradient_checkpointing=true",
    ],
    "LoRA r16, bf16-mixed": ["model.precision=bf16-mixed", "model.lora.rank=16"],
}
"""Learner set-ups of the ``real`` section: ``--set`` overrides."""


def shaped_model(work: Path, shape: dict[str, Any]) -> Path:
    """A random Qwen2 model of ``shape`` with the quick-start tokenizer, built once."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = work / f"qwen2-h{shape['hidden_size']}-l{shape['num_hidden_layers']}"
    if not (out / "config.json").is_file():
        tok_dir = build_tiny_model(work / "tokenizer", TinyModelConfig(vocab_size=1024))
        tokenizer = load_tokenizer(tok_dir)
        config = Qwen2Config(
            **shape, bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).save_pretrained(out)
        tokenizer.save_pretrained(out)
    return out


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_mib() -> float:
    if not torch.cuda.is_available():
        return 0.0
    return torch.cuda.max_memory_allocated() / 2**20


def later_median(rows: list[dict[str, Any]], key: str) -> float:
    """The median of ``key`` over the steps after the first (which warms kernels up)."""
    values = [float(r[key]) for r in rows if key in r]
    return statistics.median(values[1:] if len(values) > 1 else values)


def step_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if "perf/step_s" in r]


def run_real(args: argparse.Namespace, device: str) -> list[dict[str, Any]]:
    shape = SMOKE_SHAPE if args.smoke else QWEN25_05B
    model_dir = shaped_model(args.runs_dir / "gpu", shape)
    params = sum(t.numel() for t in _safetensors(model_dir))
    out = []
    for name, extra in SETUPS.items():
        if args.setups and name not in args.setups:
            continue
        sets = [
            f"model.path={model_dir}", f"model.device={device}", f"steps={args.steps}",
            "max_minutes=0", "warmup.steps=0", f"save_every={args.steps}",
            f"rollout.prompts_per_step={args.prompts}", f"rollout.group_size={args.group}",
            "rollout.max_turns=2", f"rollout.max_tokens_per_turn={args.turn_tokens}",
            f"eval.every={args.steps}", "eval.num_tasks=8", *extra,
        ]  # fmt: skip
        if args.smoke:
            sets = [s for s in sets if "precision" not in s]  # CPU: float32 only
        run_dir = args.runs_dir / "gpu" / ("real-" + name.replace(", ", "-").replace(" ", "_"))
        reset_peak()
        began = time.perf_counter()
        row: dict[str, Any] = {"setup": name, "params": params}
        try:
            result = train(load_config("quickstart", sets), out=run_dir, progress=False)
        except Exception as exc:  # one set-up failing must not hide the others' figures
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            print(f"{name}: {row['error']}", flush=True)
            out.append(row)
            continue
        rows = step_rows(result.rows)
        row.update(
            wall_s=time.perf_counter() - began,
            step_s=later_median(rows, "perf/step_s"),
            rollout_s=later_median(rows, "perf/rollout_s"),
            train_s=later_median(rows, "perf/train_s"),
            tokens_per_s=later_median(rows, "perf/tokens_per_s"),
            startup_gap=float(result.rows[0].get("startup/logprob_gap_max", float("nan"))),
            peak_mib=peak_mib(),
            steps=len(rows),
        )
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def _safetensors(model_dir: Path) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    return [t for f in sorted(model_dir.glob("*.safetensors")) for t in load_file(f).values()]


def run_probe(args: argparse.Namespace, device: str) -> dict[str, Any]:
    sets = [f"model.device={device}", f"max_minutes={args.probe_minutes}", "save_every=1000"]
    if not args.smoke:
        sets.append("model.precision=bf16-mixed")
    else:
        sets += ["steps=2", "model.tiny.echo_steps=10", "warmup.steps=4", "eval.num_tasks=8",
                 "rollout.prompts_per_step=2", "rollout.group_size=2"]  # fmt: skip
    sets += args.probe_set
    reset_peak()
    began = time.perf_counter()
    name = "-".join(["probe", *args.probe_set]).replace("=", "_")
    run_dir = args.runs_dir / "gpu" / name
    result = train(load_config("quickstart", sets), out=run_dir, progress=False)
    rows = step_rows(result.rows)
    curve = [[r["step"], r["eval/success_mean"]] for r in result.rows if "eval/success_mean" in r]
    probe = {
        "wall_s": time.perf_counter() - began, "steps": len(rows),
        "step_s": later_median(rows, "perf/step_s"), "peak_mib": peak_mib(),
        "startup_gap": float(result.rows[0].get("startup/logprob_gap_max", float("nan"))),
        "curve": curve, "final": curve[-1][1] if curve else float("nan"),
        "settings": sets,
    }  # fmt: skip
    print(json.dumps(probe), flush=True)
    return probe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", nargs="+", default=["real", "probe"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--turn-tokens", type=int, default=64)
    parser.add_argument("--probe-minutes", type=float, default=3.0)
    parser.add_argument(
        "--setups", nargs="+", default=[], help="the real section's set-ups to run (all)"
    )
    parser.add_argument(
        "--probe-set", nargs="+", default=[], metavar="KEY=VALUE",
        help="settings added to the probe's (after bf16-mixed)",
    )  # fmt: skip
    smoke = {"steps": 2, "prompts": 2, "group": 2, "turn_tokens": 8, "probe_minutes": 0.0}
    args = parse_args(parser, "gpu", smoke, runs=True)
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py needs a CUDA device (or --smoke, which runs on the CPU)")
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    data: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.machine(),
        "torch": torch.__version__,
        "command": "python benchmarks/gpu.py " + " ".join(sys.argv[1:]),
        "settings": {k: getattr(args, k) for k in ("steps", "prompts", "group", "turn_tokens")},
    }
    if "real" in args.sections:
        data["real"] = run_real(args, device)
    if "probe" in args.sections:
        data["probe"] = run_probe(args, device)
    write(args.out, data)


def write(out: Path, data: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
    lines = [
        "# turnrl's torch path on a CUDA device", "",
        f"{data['date']}, {data['device']}, torch {data['torch']}: `{data['command']}`", "",
    ]  # fmt: skip
    if "real" in data:
        s = data["settings"]
        lines += [
            f"## A random Qwen2.5-0.5B-shaped model, {s['prompts']}x{s['group']} episodes a "
            f"step, up to 2 turns of {s['turn_tokens']} tokens", "",
            "| set-up | step s | rollout s | learner s | tokens/s | start-up gap | "
            "peak MiB | run wall s |", "|---|---|---|---|---|---|---|---|",
        ]  # fmt: skip
        for r in data["real"]:
            if "error" in r:
                lines.append(f"| {r['setup']} | failed: {r['error']} ||||||| ")
                continue
            lines.append(
                f"| {r['setup']} | {r['step_s']:.2f} | {r['rollout_s']:.2f} | "
                f"{r['train_s']:.2f} | {r['tokens_per_s']:.0f} | {r['startup_gap']:.2e} | "
                f"{r['peak_mib']:.0f} | {r['wall_s']:.0f} |"
            )
    if "probe" in data:
        p = data["probe"]
        curve = ", ".join(f"{s}: {v:.2f}" for s, v in p["curve"])
        lines += [
            "", "## The quick-start probe", "",
            "| steps | step s | start-up gap | peak MiB | final success | wall s |",
            "|---|---|---|---|---|---|",
            f"| {p['steps']} | {p['step_s']:.2f} | {p['startup_gap']:.2e} | "
            f"{p['peak_mib']:.0f} | {p['final']:.2f} | {p['wall_s']:.0f} |", "",
            f"Held-out success (step: value): {curve}",
        ]  # fmt: skip
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
