"""turnrl against TRL's GRPOTrainer, side by side, on the same model and task.

Both sides train the same checkpoint on the same prompts with the same batch shape
(P prompts x G samples per step, the same temperature, one policy update per step, no KL):

- ``single``: one turn, no tools, a randomly initialised tiny model (it samples up to
  ``--single-tokens`` tokens; it almost never ends early); temperature 1;
- ``multi``: the secret-lookup task with its ``lookup(key)`` tool, from the warm-up
  checkpoint of the learning proof (it calls the tool, reads the answer, answers);
  temperature 1;
- ``real`` (not run unless named): the same secret-lookup task on a real model,
  SmolLM2-135M-Instruct (turnrl's named model ``smollm2-135m``, float32). Its own chat
  template renders no tools, which TRL refuses for tool use, so both sides get it with
  turnrl's ChatML tool template (the tiny model's: tools listed in the system turn,
  hermes ``<tool_call>`` calls, ``<tool_response>`` results in a user turn), which TRL
  parses with its Qwen response template. Untrained, the model seldom writes such a
  call, so both start from the checkpoint after turnrl's format warm-up on this task
  (``--real-warmup-steps`` steps of 8 demonstrations, lr 1e-5, as the
  ``smollm2_search_qa`` recipe: calls with random keys, random answers; they teach the
  format, not the answer). Temperature 0.7 (the recipe's: at 1 the model's text falls
  apart over turns) and lr 1e-5 on both sides. ``--smoke`` runs this case's whole path
  (template, warm-up, both sides, floor) on the random tiny model instead.

Each side runs in its own process (TRL in its own virtualenv, made here if missing:
``benchmarks/.venv-trl``), the two alternating, ``--repeats`` times each; every run takes
``--warmup-steps`` untimed steps then ``--steps`` timed ones. Reported per case and side:
median step time, generation time, generated tokens per second, completion length and
tool calls (so the work is seen to be alike), peak resident memory; and the *floor*: the
forward passes any KV-cached engine must run for the same batch shape (prefill, one decode
step per token, prefill of each tool answer) plus one forward+backward over the final
sequences, measured here with plain transformers in the same run.

    python benchmarks/vs_trl.py                      # single and multi, 3 repeats
    python benchmarks/vs_trl.py --cases multi --repeats 1 --steps 3
    python benchmarks/vs_trl.py --cases real --prompts 4 --group-size 4 --repeats 2 \
        --warmup-steps 1 --steps 3 --out benchmarks/results/vs_trl_real
    python benchmarks/vs_trl.py --smoke     # every case and side, 1 + 1 steps of 2 x 2, tiny

Each case records the load average before and after it; the results name the CPU, its
vector flags and the git commit. Writes benchmarks/results/vs_trl.json and .md;
checkpoints and run directories go to benchmarks/runs/vs_trl (``--out``, ``--runs-dir``;
``--smoke``: a temporary directory; TRL's virtualenv is made in benchmarks/.venv-trl all
the same, the TRL side being what it checks).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from outputs import parse_args
from real_model_speed import cpu_info, git_commit
from training_runs import TINY_RUN

ROOT = Path(__file__).resolve().parent
TRL_VENV = ROOT / ".venv-trl"
TRL_VERSION = "1.16.0"
ENV_OPTIONS = {"num_keys": 2, "key_pool": 2, "num_values": 12}
CASES = ("single", "multi", "real")
REAL_MODEL = "smollm2-135m"
"""The ``real`` case's model: SmolLM2-135M-Instruct, from its installed package."""
REAL_SAMPLING = {"temperature": 0.7, "lr": 1e-5}
"""The ``real`` case's sampling temperature and learning rate, on both sides (the
``smollm2_search_qa`` recipe's). The tiny cases keep temperature 1, and turnrl its
quick-start lr there (the update's cost does not depend on it)."""


# --------------------------------------------------------------------------- set-up


SHARED = ("numpy", "tokenizers", "safetensors", "huggingface-hub")
"""Besides torch and transformers, the packages whose versions TRL's venv takes from this
one: what both sides compute with. TRL's own needs (datasets, accelerate, ...) resolve
freely: pinning every package of this environment made pip refuse trl once an extra of
turnrl's pinned a datasets that trl does not take."""


def ensure_trl_venv() -> Path:
    """TRL's virtualenv with the same torch, transformers and ``SHARED`` packages as this
    one. It is layered on this one: a .pth puts this environment's site-packages on its
    path, after its own, so pip finds those packages installed and adds only what TRL
    needs beyond them (trl, a newer datasets: these come first). 8 seconds of pip, where
    installing torch, transformers and the rest again took two minutes of CPU."""
    from importlib import metadata

    import transformers

    python = TRL_VENV / "bin" / "python"
    stamp = TRL_VENV / ".installed"
    base = sysconfig.get_path("purelib")
    # torch pinned without its local tag (+cpu): pip takes the wheel this one came from, not
    # the latest CUDA build that a plain "torch" would download
    shared = [f"{name}=={metadata.version(name)}" for name in SHARED]
    want = " ".join(
        [f"torch=={torch.__version__.split('+')[0]}", f"transformers=={transformers.__version__}",
         f"trl=={TRL_VERSION}", *shared]
    )  # fmt: skip
    if stamp.is_file() and stamp.read_text() == f"{want} on {base}":
        return python
    print(f"setting up {TRL_VENV} on {base}: {want}", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(TRL_VENV)], check=True)
    own = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    Path(own, "turnrl-base-venv.pth").write_text(base + "\n")
    # --no-warn-conflicts: packages of this environment that TRL's does not use (verifiers
    # wants the older datasets) are not TRL's conflicts
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-warn-conflicts", *want.split()],
        check=True,
    )  # fmt: skip
    stamp.write_text(f"{want} on {base}")
    return python


def checkpoints(work: Path, cases: set[str], extra: Sequence[str] = ()) -> dict[str, Path]:
    """Of the random tiny model (single) and the learning proof's warm-up checkpoint (multi:
    its recipe's echo tuning and warm-up), those ``cases`` name, made where missing;
    ``extra``: overrides of both (--smoke's tiny run)."""
    from presets import warmup_checkpoint
    from turnrl import load_config, train

    made: dict[str, Path] = {}
    if "single" in cases:
        random_dir = work / "random-model"
        made["single"] = random_dir / "start_model"
        if not (made["single"] / "config.json").is_file():
            shutil.rmtree(random_dir, ignore_errors=True)
            overrides = [
                *extra,
                "steps=0",
                "model.tiny.echo_steps=0",
                "warmup.steps=0",
                "eval.num_tasks=1",
            ]
            train(load_config("learning_proof", overrides), out=random_dir, progress=False)
    if "multi" in cases:
        echo_steps = load_config("learning_proof", list(extra)).model.tiny.echo_steps
        made["multi"] = warmup_checkpoint(work, 0, echo_steps, extra)
    return made


def real_checkpoint(work: Path, base: str | Path, warmup_steps: int, threads: int) -> Path:
    """``base`` with turnrl's ChatML tool template, after turnrl's format warm-up on the
    secret-lookup task (``warmup_steps`` steps of 8 demonstrations at lr 1e-5): the policy
    both sides of the ``real`` case start from. Made once per base and step count."""
    from turnrl import load_config, train
    from turnrl.models import FAMILIES, load_tokenizer

    run_dir = work / f"real-warmup-{Path(base).name}-{warmup_steps}"
    start = run_dir / "start_model"
    if (start / "config.json").is_file():
        return start
    shutil.rmtree(run_dir, ignore_errors=True)
    templated = run_dir / "base"
    templated.mkdir(parents=True)
    # The weights are linked, not copied; only the tokenizer is written anew, with the
    # template that renders tools (hermes calls, as TRL's Qwen parser reads them).
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        if (Path(base) / name).is_file():
            (templated / name).symlink_to(Path(base, name).resolve())
    tokenizer = load_tokenizer(base)
    tokenizer.chat_template = FAMILIES["qwen2"].chat_template
    tokenizer.save_pretrained(templated)
    overrides = [
        f"model.path={templated}", "seed=0", "steps=0", "eval.num_tasks=1",
        *(f"env.{k}={v}" for k, v in ENV_OPTIONS.items()),
        f"warmup.steps={warmup_steps}", "warmup.batch_size=8", "warmup.lr=1e-5",
        f"rollout.temperature={REAL_SAMPLING['temperature']}", "algorithm.kl.coef=0",
        f"threads={threads}",
    ]  # fmt: skip
    train(load_config("quickstart", overrides), out=run_dir / "run", progress=False)
    (run_dir / "run" / "start_model").rename(start)
    # the run's metrics stay (the warm-up's losses); its step-0 checkpoint is the same model
    shutil.rmtree(run_dir / "run" / "checkpoints")
    shutil.rmtree(templated)
    return start


def write_tasks(path: Path, count: int) -> None:
    """The secret-lookup tasks both sides read, in order (prompt messages, answer, table)."""
    from turnrl import make_env_family

    spec = make_env_family("secret_lookup", **ENV_OPTIONS)
    with path.open("w") as f:
        for i in range(count):
            task = spec.task(i)
            row = {
                "prompt": list(task.prompt),
                "answer": task.answer,
                "table": task.metadata["table"],
            }
            f.write(json.dumps(row) + "\n")


# --------------------------------------------------------------------------- turnrl's side


def turnrl_side(spec: dict[str, Any], out: Path) -> None:
    """GRPO steps through ``turnrl.trainer.loop.train`` (the path ``turnrl train`` runs)."""
    from turnrl import load_config, train

    tools = spec["tools"]
    steps = spec["warmup_steps"] + spec["steps"]
    overrides = [
        f"seed={spec['seed']}", f"model.path={spec['model']}", "warmup.steps=0",
        *(f"env.{k}={v}" for k, v in ENV_OPTIONS.items()),
        f"env.tools_enabled={'true' if tools else 'false'}",
        f"rollout.prompts_per_step={spec['prompts_per_step']}",
        f"rollout.group_size={spec['group_size']}",
        f"rollout.temperature={spec['temperature']}",
        *([f"algorithm.lr={spec['lr']}"] if spec["lr"] is not None else []),
        f"rollout.max_turns={spec['max_tool_calls'] + 1 if tools else 1}",
        f"rollout.max_tokens_per_turn={spec['max_tokens_per_turn']}",
        f"rollout.max_episode_tokens={spec['max_completion_length']}",
        "algorithm.advantage=grpo", "algorithm.kl.coef=0", "algorithm.epochs=1",
        f"algorithm.micro_batch.size={spec['prompts_per_step'] * spec['group_size']}",
        f"steps={steps}", "max_minutes=0", "save_every=1000000", "eval.every=1000000", "eval.num_tasks=1",
        f"threads={spec['threads']}",
    ]  # fmt: skip
    run_dir = Path(spec["out_dir"])
    shutil.rmtree(run_dir, ignore_errors=True)
    result = train(load_config("quickstart", overrides), out=run_dir, progress=False)
    rows = [r for r in result.rows if "perf/step_s" in r][spec["warmup_steps"] :]
    shapes = _shapes(run_dir / "trajectories.jsonl", spec["warmup_steps"])
    json.dump(
        {
            "side": "turnrl",
            "step_s": [r["perf/step_s"] for r in rows],
            "generate_s": [r["perf/rollout_s"] for r in rows],
            "completion_tokens_mean": [r["rollout/completion_tokens_mean"] for r in rows],
            "tool_calls_mean": [r["rollout/tool_calls_mean"] for r in rows],
            "reward_mean": [r["rollout/reward_mean"] for r in rows],
            "batch": spec["prompts_per_step"] * spec["group_size"],
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "shape": shapes,
        },
        out.open("w"),
    )


def _shapes(path: Path, skip_steps: int) -> dict[str, Any]:
    """Mean token counts of the timed steps' episodes: the first prompt, each turn's
    completion and each observation (what the floor replays)."""
    prompt, completions, observations = [], [], []
    for line in path.open():
        row = json.loads(line)
        if row["step"] <= skip_steps:
            continue
        turns = row["turns"]
        prompt.append(len(turns[0]["prompt_ids"]))
        for i, t in enumerate(turns):
            completions.append((i, len(t["completion_ids"])))
            if i > 0:
                observations.append(len(t["prompt_ids"]))
    episodes = len(prompt)
    by_turn: dict[int, list[int]] = {}
    for i, n in completions:
        by_turn.setdefault(i, []).append(n)
    return {
        "prompt": round(statistics.mean(prompt)),
        # Per turn: the mean length over every episode (0 for episodes that ended before).
        "turns": [round(sum(v) / episodes) for _, v in sorted(by_turn.items())],
        "observation": round(statistics.mean(observations)) if observations else 0,
    }


# --------------------------------------------------------------------------- the floor


def floor_time(model_dir: Path, batch: int, shape: dict[str, Any], threads: int) -> float:
    """Seconds for the work any cached engine must do: prefill the prompts, one decode
    step per sampled token, prefill each observation; then one forward+backward over the
    final sequences (a plain LM loss over all positions). Median of 3."""
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    parameters = inspect.signature(type(model).forward).parameters  # cache: transformers >= 5.24
    cache_name = "cache" if "cache" in parameters else "past_key_values"
    vocab = model.config.vocab_size
    turns = [n for n in shape["turns"] if n > 0]
    total = shape["prompt"] + sum(turns) + shape["observation"] * (len(turns) - 1)

    def once() -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            model.eval()
            cache = DynamicCache()
            ids = torch.randint(0, vocab, (batch, shape["prompt"]))
            for t, n in enumerate(turns):
                if t > 0:
                    ids = torch.randint(0, vocab, (batch, shape["observation"]))
                out = model(input_ids=ids, use_cache=True, **{cache_name: cache})
                for _ in range(n):
                    probs = torch.softmax(out.logits[:, -1].float(), -1)
                    tok = torch.multinomial(probs, 1)
                    out = model(input_ids=tok, use_cache=True, **{cache_name: cache})
        model.train()
        seqs = torch.randint(0, vocab, (batch, total))
        loss = model(input_ids=seqs, labels=seqs).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    once()
    return statistics.median(once() for _ in range(3))


# --------------------------------------------------------------------------- the driver


def run_side(python: str, side: str, spec: dict[str, Any], work: Path) -> dict[str, Any]:
    spec_path = work / f"spec-{side}-{spec['case']}.json"
    out = work / f"out-{side}-{spec['case']}.json"
    spec_path.write_text(json.dumps(spec))
    out.unlink(missing_ok=True)
    script = ROOT / ("vs_trl_trl_side.py" if side == "trl" else "vs_trl.py")
    args = [python, str(script), str(spec_path), str(out)]
    if side == "turnrl":
        args.insert(2, "--side")
    proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"{side} {spec['case']} failed:\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over every timed step of every repeat."""
    step = [s for r in runs for s in r["step_s"]]
    gen = [s for r in runs for s in r["generate_s"]]
    tokens = [t for r in runs for t in r["completion_tokens_mean"]]
    batch = runs[0]["batch"]
    tok_per_step = statistics.mean(tokens) * batch
    return {
        "step_s": statistics.median(step),
        "step_s_per_repeat": [statistics.median(r["step_s"]) for r in runs],
        "generate_s": statistics.median(gen),
        "completion_tokens_mean": statistics.mean(tokens),
        "tool_calls_mean": statistics.mean(t for r in runs for t in r["tool_calls_mean"]),
        "generated_tokens_per_s": tok_per_step / statistics.median(gen),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
        "steps_timed": len(step),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=CASES, default=["single", "multi"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--single-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--real-warmup-steps", type=int, default=20,
        help="format warm-up steps (8 demonstrations each) of the real case's checkpoint",
    )  # fmt: skip
    parser.add_argument(
        "--setup-only", action="store_true",
        help=f"make TRL's virtualenv ({TRL_VENV}) and stop (make setup-trl)",
    )  # fmt: skip
    smoke = {
        "cases": list(CASES), "repeats": 1, "steps": 1, "warmup_steps": 1, "prompts": 2,
        "group_size": 2, "single_tokens": 8, "threads": 1, "real_warmup_steps": 2,
    }  # fmt: skip
    args = parse_args(parser, "vs_trl", smoke, runs=True)
    if args.setup_only:
        print(f"TRL's virtualenv: {ensure_trl_venv()}")
        return

    work = args.runs_dir / "vs_trl"
    work.mkdir(parents=True, exist_ok=True)
    trl_python = str(ensure_trl_venv())
    tiny = set(args.cases) | ({"single"} if args.smoke and "real" in args.cases else set())
    models = checkpoints(work, tiny, TINY_RUN if args.smoke else ())
    if "real" in args.cases:
        from turnrl.models import resolve_model

        # --smoke: the same path on the random tiny model (seconds, no real model needed)
        base = models["single"] if args.smoke else resolve_model(REAL_MODEL)
        models["real"] = real_checkpoint(work, base, args.real_warmup_steps, args.threads)
    write_tasks(work / "tasks.jsonl", args.prompts * (args.steps + args.warmup_steps) + 64)
    results: dict[str, Any] = {}
    for case in args.cases:
        tools = case != "single"
        sampling = REAL_SAMPLING if case == "real" else {"temperature": 1.0, "lr": None}
        spec = {
            "case": case, "model": str(models[case]), "tasks": str(work / "tasks.jsonl"),
            "tools": tools, **sampling,
            "prompts_per_step": args.prompts, "group_size": args.group_size,
            "max_tokens_per_turn": 48 if tools else args.single_tokens,
            "max_completion_length": 96 if tools else args.single_tokens,
            "max_tool_calls": 3, "steps": args.steps, "warmup_steps": args.warmup_steps,
            "threads": args.threads, "seed": 0,
        }  # fmt: skip
        load_before = list(os.getloadavg())
        runs: dict[str, list[dict[str, Any]]] = {"turnrl": [], "trl": []}
        for repeat in range(args.repeats):
            for side, python in (("trl", trl_python), ("turnrl", sys.executable)):
                one = {**spec, "out_dir": str(work / f"{side}-{case}-{repeat}")}
                runs[side].append(run_side(python, side, one, work))
                print(f"{case} {side} #{repeat}: step "
                      f"{statistics.median(runs[side][-1]['step_s']):.3f} s", flush=True)  # fmt: skip
        shape = runs["turnrl"][-1]["shape"]
        floor = floor_time(models[case], args.prompts * args.group_size, shape, args.threads)
        sides = {side: summarise(r) for side, r in runs.items()}
        for s in sides.values():
            s["over_floor"] = s["step_s"] / floor
        results[case] = {
            "model": str(models[case]),
            "temperature": spec["temperature"],
            "floor_s": floor,
            "floor_shape": shape,
            "ratio_step_turnrl_over_trl": sides["turnrl"]["step_s"] / sides["trl"]["step_s"],
            **sides,
            "load_before": load_before,
            "load_after": list(os.getloadavg()),
            "raw": runs,
        }
    write(args, results)


def write(args: argparse.Namespace, results: dict[str, Any]) -> None:
    import transformers

    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} "
        f"threads, {platform.system()}",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": TRL_VERSION,
        **cpu_info(),
        "commit": git_commit(),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({**meta, "cases": results}, indent=2))
    lines = [
        "# turnrl vs TRL GRPOTrainer",
        "",
        f"{meta['date']}, {meta['machine']}; torch {meta['torch']}, transformers "
        f"{meta['transformers']}, TRL {TRL_VERSION}. {meta['cpu']} ({meta['cores']} cores; "
        f"{', '.join(meta['cpu_flags']) or 'no AVX-512/AMX flags'}), commit {meta['commit']}. "
        f"{args.prompts} prompts x {args.group_size} samples per step, float32, CPU; medians "
        f"over {args.repeats} alternating runs x {args.steps} timed steps per side.",
        "",
        "| case | side | step s | turnrl / TRL | generation s | gen tok/s | tokens/episode "
        "| tool calls/episode | over floor | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case, r in results.items():
        for side in ("trl", "turnrl"):
            s = r[side]
            ratio = f"**{r['ratio_step_turnrl_over_trl']:.2f}x**" if side == "turnrl" else ""
            lines.append(
                f"| {case} | {side} | {s['step_s']:.3f} | {ratio} | {s['generate_s']:.3f} | "
                f"{s['generated_tokens_per_s']:.0f} | {s['completion_tokens_mean']:.1f} | "
                f"{s['tool_calls_mean']:.2f} | {s['over_floor']:.2f}x | {s['peak_rss_mib']:.0f} |"
            )
        lines.append(
            f"| {case} | floor | {r['floor_s']:.3f} | | | | shape {r['floor_shape']} | | 1.00x | |"
        )
    lines.append("")
    for case, r in results.items():
        before, after = (" ".join(f"{x:.2f}" for x in r[k]) for k in ("load_before", "load_after"))
        lines.append(
            f"{case}: temperature {r['temperature']}; load average (1, 5, 15 min) {before} "
            f"before, {after} after."
        )
    if "real" in results:
        lines.append(
            f"real: {'the random tiny model (--smoke)' if args.smoke else 'SmolLM2-135M-Instruct'}"
            f" with turnrl's ChatML tool template, after {args.real_warmup_steps} steps of "
            "turnrl's format warm-up on secret lookup (the checkpoint both sides start from)."
        )
    lines += [
        "",
        "Floor: the forward passes any KV-cached engine must run for the batch shape turnrl "
        "sampled (prompt prefill, one decode step per token, each observation's prefill) "
        "plus one forward+backward over the final sequences, with plain transformers. It "
        "runs every row's whole prompt and the output layer at every position: turnrl runs "
        "a batch's common prefix (the system turn with the tool list) once, in sampling "
        "and in the update, and the output layer only where it trains, so it can go below.",
        "Tokens/episode counts sampled tokens only, on both sides; TRL's completion limit "
        "(96 tokens with tools) also spends the tool answers' tokens, turnrl's counts "
        "sampled tokens (48 a turn).",
    ]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--side":
        turnrl_side(json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[3]))
    else:
        main()
