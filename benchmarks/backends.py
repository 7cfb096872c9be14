"""turnrl's samplers against raw vLLM on the same requests, and the cost of a weight sync.

Four samplers, one model (the tiny model with 2 heads, since vLLM's CPU attention needs
heads 32 wide, after a short syntax warm-up on secret-lookup demonstrations so that it
calls the tool and episodes have several turns):

- ``torch``: ``TorchBackend``, turnrl's own sampler (the CPU default);
- ``turnrl-vllm``: ``VLLMBackend``, turnrl's vLLM path;
- ``raw-vllm``: ``vllm.LLM.generate`` called directly, on the *same engine object* as
  ``turnrl-vllm`` (same weights, KV cache, scheduler and prefix cache), so only what turnrl
  adds around the engine can differ;
- ``raw-vllm-ids``: the same with ``SamplingParams(detokenize=False)``: vLLM then makes
  no text and no decoded log-prob tokens, which turnrl never reads (it decodes the text
  itself); what turnrl's path could cost without them.

Cases:

- ``single``: one batch of P x G requests (the first-turn prompts of P secret-lookup tasks,
  G samples each, as a GRPO step asks for them) with no stop tokens, so every request
  samples exactly ``--single-tokens`` tokens in all of them. turnrl-vLLM is
  ``VLLMBackend.run(VLLMBackend.generate(requests))``, the call the rollout engine makes;
  raw vLLM is ``LLM.generate`` on the same
  prompt token ids with the same ``SamplingParams`` (built per request inside the timed
  region, as a caller would: the script checks they equal the backend's) and the same
  per-request seeds, with ``use_tqdm=False``. Both sides sample the same tokens (checked).
- ``multi``: P x G secret-lookup episodes (hermes tool calls, up to 4 turns) through
  turnrl's rollout engine: ``collect_groups`` -> ``BatchingClient`` -> backend, the
  episodes rendering their chat, parsing tool calls, running the (instant) lookup tool and
  encoding its answer between turns. An untimed first run records the batches of requests
  the episodes sent (``BatchingClient`` waits until every live episode is waiting, so a
  batch is a wave of turns); raw vLLM then replays exactly those batches: as many
  ``LLM.generate`` calls, on the same growing contexts, same sampling params and seeds,
  each call after the previous one returned (what a loop without continuous batching
  does; where ``VLLMBackend`` feeds the engine continuously, its follow-up turns need not
  wait for a whole wave). The replay knows
  every context in advance, so it does none of the episode work (rendering, parsing, the
  tool, bookkeeping): the ratio is an upper bound on what turnrl's rollout engine costs
  over a hand-written loop whose environment is free. Both sample the same tokens
  (checked against the recorded completions). The torch backend plays the same episodes
  with its own sampler (other random streams, so other tokens: compare its tokens/s).

Each timed run starts with vLLM's prefix cache emptied (turns of an episode still reuse
their history within the run, on both sides); the samplers take turns, ``--repeats``
times each. Reported: median wall time, tokens/s and episodes/s; the seconds spent inside
vLLM's engine steps (``LLMEngine.step``, which both ``LLM.generate`` and turnrl's backend
drive; the rest is what the caller adds around the engine); and each sampler's
wall time over raw vLLM's as the median of the per-repeat ratios (runs back to back, so a
machine that slows down for a while, as this shared one does, slows both). The issue's
target: turnrl-vLLM costs at most 1.1x raw vLLM.

``sync``: ``VLLMBackend.load_weights`` (the learner's tensors into the engine in place via
``reload_weights``, then the prefix cache reset) on the tiny model and on random models of
about 10x and 100x its parameters (heads 32 wide), median of ``--repeats``; the reset
alone is timed too.

``gpu``: where CUDA is available, a random model shaped like Qwen2.5-0.5B (hidden 896,
24 layers, 14 heads, 2 key-value heads, MLP 4864, vocabulary 151,936) in bfloat16, the two
vLLM paths on the same cases (target: turnrl-vLLM at least 0.8x raw vLLM's episodes/s).
On a CPU it is skipped, and the results say so.

Threads: ``torch.set_num_threads(--threads)`` before vLLM starts, and vLLM's CPU worker
left unbound (``VLLM_CPU_OMP_THREADS_BIND=nobind`` unless set), so all three samplers
compute with the same number of threads (several threads on 2 shared cores made
every sampler erratic: OpenMP threads that wait for a busy core).

    .venv-vllm/bin/python benchmarks/backends.py
    .venv-vllm/bin/python benchmarks/backends.py --smoke    # tiny settings, seconds
    python3 benchmarks/backends.py --sections gpu   # a lent GPU (dev/gpu_vllm_checks.sh)

Needs vLLM (``make setup-vllm``: .venv-vllm). Writes benchmarks/results/backends.json and
.md; models go to benchmarks/runs/backends (``--out``, ``--runs-dir``; ``--smoke``: a
temporary directory).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch

from outputs import parse_args
from turnrl import Trajectory
from turnrl.backends import (
    Completion,
    GenerationRequest,
    TorchBackend,
    VLLMBackend,
    import_vllm,
)
from turnrl.envs import SecretLookup
from turnrl.models import (
    TinyModelConfig,
    build_tiny_model,
    load_model,
    load_tokenizer,
    stop_token_ids,
)
from turnrl.rollout import ChatRenderer, EpisodeLimits, GroupSpec, SamplingParams, collect_groups
from turnrl.trainer import (
    WarmupConfig,
    demonstration_trajectories,
    supervised_warmup,
    warmup_samples,
)

SECTIONS = ("tiny", "sync", "gpu")
"""The parts of the benchmark, in the order they run (``--sections``)."""
TINY = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=1024)
"""The quick-start's shape with 2 heads (32 wide), as ``model.tiny.num_heads=2`` builds it."""
SYNC_SHAPES = {
    "tiny": TINY,
    "~10x": TinyModelConfig(hidden_size=192, num_layers=4, num_heads=6, num_kv_heads=2,
                            intermediate_size=1024, vocab_size=1024),
    "~100x": TinyModelConfig(hidden_size=512, num_layers=8, num_heads=16, num_kv_heads=4,
                             intermediate_size=1792, vocab_size=1024),
}  # fmt: skip
"""Weight-sync models: the tiny one and two of about 10x and 100x its parameters."""
QWEN25_05B = {
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
    "max_position_embeddings": 4096, "tie_word_embeddings": True, "rope_theta": 1000000.0,
}  # fmt: skip
"""Qwen2.5-0.5B's shape (its config.json), context cut to 4096 for the KV cache."""
ENV = SecretLookup(num_keys=2, key_pool=2, num_values=12)
MAX_TURNS = 4
MAX_MODEL_LEN = 1024


# --------------------------------------------------------------------------- models


def caller_model(model_dir: Path, steps: int) -> Any:
    """The model of ``model_dir`` after ``steps`` of syntax warm-up on secret-lookup
    demonstrations (as tests/test_vllm_backend.py's ``caller``): it calls the tool."""
    tokenizer, model = load_tokenizer(model_dir), load_model(model_dir)
    demos = demonstration_trajectories(
        ENV, tokenizer, ChatRenderer(tokenizer), count=256,
        limits=EpisodeLimits(max_turns=MAX_TURNS, max_tokens_per_turn=24),
        sampling=SamplingParams(stop_token_ids=stop_token_ids(tokenizer)), seed=0,
    )  # fmt: skip
    supervised_warmup(
        model, warmup_samples(demos), WarmupConfig(steps=steps, batch_size=16, lr=3e-3),
        pad_id=int(tokenizer.pad_token_id), seed=0,
    )  # fmt: skip
    return model.eval()


def tiny_dir(work: Path, name: str, config: TinyModelConfig) -> Path:
    """A random model of ``config`` (tokenizer over the secret-lookup corpus), built once."""
    out = work / name
    if not (out / "config.json").is_file():
        build_tiny_model(out, config, extra_corpus=ENV.corpus(), overwrite=True)
    return out


def qwen_shaped_dir(work: Path, tokenizer_dir: Path) -> Path:
    """A random model shaped like Qwen2.5-0.5B, with the tiny tokenizer (its ids are a
    subset of the larger vocabulary), built once."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = work / "qwen2.5-0.5b-shaped"
    if not (out / "config.json").is_file():
        tokenizer = load_tokenizer(tokenizer_dir)
        config = Qwen2Config(
            **QWEN25_05B, bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
        tokenizer.save_pretrained(out)
    return out


# --------------------------------------------------------------------------- requests


class Recorder:
    """A backend that passes every batch to ``inner`` and keeps its requests and
    completions, in order: the batches raw vLLM replays. Its ``submit`` declines, so
    ``BatchingClient`` sends each batch (every live episode's next request) whole through
    ``generate`` and the recording run proceeds in waves of turns."""

    def __init__(self, inner: VLLMBackend) -> None:
        self.inner = inner
        self.pad_id = inner.pad_id
        self.policy_version = inner.policy_version
        self.calls: list[tuple[list[GenerationRequest], list[Completion]]] = []

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        out = await self.inner.generate(requests)
        self.calls.append((list(requests), out))
        return out

    def submit(self, requests: Sequence[GenerationRequest], quiet: Any = None) -> None:
        return None

    def run(self, program: Any) -> Any:
        return self.inner.run(program)


def episodes(backend: Any, tokenizer: Any, num_tasks: int, group_size: int, turn_tokens: int,
             seed: int = 0) -> list[Trajectory]:  # fmt: skip
    """P x G secret-lookup episodes through turnrl's rollout engine on ``backend``."""
    spec = GroupSpec(
        group_size,
        EpisodeLimits(max_turns=MAX_TURNS, max_tokens_per_turn=turn_tokens),
        SamplingParams(temperature=1.0, stop_token_ids=stop_token_ids(tokenizer)),
        seed=seed,
    )
    tasks = [ENV.task(i) for i in range(num_tasks)]
    program = collect_groups(tasks, ENV.make_env, backend, ChatRenderer(tokenizer), spec)
    trajectories = [t for g in backend.run(program) for t in g]
    errors = [t.error for t in trajectories if t.error]
    if errors:
        raise RuntimeError(f"episodes failed: {errors[:3]}")
    return trajectories


def raw_params(vllm: Any, r: GenerationRequest, detokenize: bool = True) -> Any:
    """The ``SamplingParams`` a direct caller of vLLM would write for ``r``: the same
    settings as turnrl's (token ids out, log-prob of the sampled token, stops kept).
    ``detokenize=False`` (the ``raw-vllm-ids`` row) skips vLLM's detokenizer: no text and
    no decoded log-prob tokens, which turnrl never reads; stop strings need it on."""
    return vllm.SamplingParams(
        n=1, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_new_tokens,
        seed=r.seed, logprobs=0, stop_token_ids=list(r.stop_token_ids),
        stop=list(r.stop_strings), include_stop_str_in_output=True, skip_special_tokens=False,
        ignore_eos=True, detokenize=detokenize or bool(r.stop_strings),
    )  # fmt: skip


def raw_generate(
    llm: Any, vllm: Any, requests: Sequence[GenerationRequest], detokenize: bool = True
) -> list[Any]:
    """One ``LLM.generate`` call on ``requests``' token ids: vLLM's own outputs."""
    prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in requests]
    params = [raw_params(vllm, r, detokenize) for r in requests]
    return list(llm.generate(prompts, params, use_tqdm=False))


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


class EngineClock:
    """Seconds spent inside vLLM's engine steps (``LLMEngine.step``: schedule, forward,
    sample, process outputs), which ``LLM.generate`` and turnrl's backend both drive: the
    rest of a run's wall time is what the caller adds around the engine."""

    def __init__(self, llm: Any) -> None:
        self.seconds = 0.0
        engine = llm.llm_engine
        inner = engine.step

        def step(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        engine.step = step

    def lap(self) -> float:
        """Seconds since the last lap."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


# --------------------------------------------------------------------------- cases


def compare(
    engine: VLLMBackend,
    torch_backend: TorchBackend | None,
    tokenizer: Any,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The single- and multi-turn cases on ``engine`` (and ``torch_backend`` if given)."""
    vllm, llm = engine._vllm, engine.llm
    P, G, turn = args.tasks, args.group_size, args.turn_tokens
    # Untimed: warm the engine up and record the engine calls of the multi-turn episodes.
    recorder = Recorder(engine)
    llm.reset_prefix_cache()
    recorded = episodes(recorder, tokenizer, P, G, turn)
    calls = recorder.calls
    for requests, _ in calls:
        for r in requests:
            assert raw_params(vllm, r, detokenize=False) == engine._params(r), (
                "raw vLLM's params differ"
            )
    first = calls[0][0]  # every episode's first-turn prompt: P x G requests
    single = [
        GenerationRequest(r.prompt_ids, args.single_tokens, temperature=1.0, seed=1000 + i)
        for i, r in enumerate(first)
    ]
    clock = EngineClock(llm)
    out: dict[str, Any] = {}

    def single_turnrl() -> list[tuple[int, ...]]:
        return [c.token_ids for c in engine.run(engine.generate(single))]

    def single_raw(detokenize: bool = True) -> list[tuple[int, ...]]:
        replies = raw_generate(llm, vllm, single, detokenize)
        return [tuple(o.outputs[0].token_ids) for o in replies]

    def single_torch() -> list[tuple[int, ...]]:
        assert torch_backend is not None
        torch_backend.policy_version += 1  # no history kept from the run before
        return [c.token_ids for c in torch_backend.run(torch_backend.generate(single))]

    samplers = {
        "turnrl-vllm": single_turnrl, "raw-vllm": single_raw,
        "raw-vllm-ids": partial(single_raw, detokenize=False),
    }  # fmt: skip
    if torch_backend is not None:
        samplers["torch"] = single_torch
    out["single"] = case(samplers, llm, clock, args.repeats, len(single))
    out["single"].update(requests=len(single), prompt_tokens_mean=mean_len(single))

    want = [[c.token_ids for c in completions] for _, completions in calls]

    def multi_turnrl() -> list[tuple[int, ...]]:
        trajectories = episodes(engine, tokenizer, P, G, turn)
        return [t.turns[i].completion_ids for t in trajectories for i in range(len(t.turns))]

    def multi_raw(detokenize: bool = True) -> list[tuple[int, ...]]:
        replies = [raw_generate(llm, vllm, requests, detokenize) for requests, _ in calls]
        got = [[tuple(o.outputs[0].token_ids) for o in reply] for reply in replies]
        if got != want:
            raise RuntimeError("raw vLLM's replay sampled other tokens than turnrl's run")
        return [ids for reply in got for ids in reply]

    def multi_torch() -> list[tuple[int, ...]]:
        assert torch_backend is not None
        torch_backend.policy_version += 1
        trajectories = episodes(torch_backend, tokenizer, P, G, turn)
        return [t.turns[i].completion_ids for t in trajectories for i in range(len(t.turns))]

    samplers = {
        "turnrl-vllm": multi_turnrl, "raw-vllm": multi_raw,
        "raw-vllm-ids": partial(multi_raw, detokenize=False),
    }  # fmt: skip
    if torch_backend is not None:
        samplers["torch"] = multi_torch
    out["multi"] = case(samplers, llm, clock, args.repeats, P * G)
    out["multi"].update(
        episodes=P * G,
        engine_calls=len(calls),
        requests=sum(len(r) for r, _ in calls),
        prompt_tokens_mean=mean_len([r for requests, _ in calls for r in requests]),
        turns_mean=statistics.mean(len(t.turns) for t in recorded),
        tool_calls_mean=statistics.mean(len(t.tool_calls) for t in recorded),
    )
    return out


def case(
    samplers: dict[str, Callable[[], list[tuple[int, ...]]]],
    llm: Any,
    clock: EngineClock,
    repeats: int,
    num_episodes: int,
) -> dict[str, Any]:
    """Run every sampler ``repeats`` times, in turn, each from an empty prefix cache: the
    median wall time, tokens/s, episodes/s, seconds inside ``LLM.generate``; and each
    one's wall time over raw vLLM's, the median of each repeat's ratio (they ran back to
    back, so a machine that slows down for a while slows both)."""
    walls: dict[str, list[float]] = {name: [] for name in samplers}
    inside: dict[str, list[float]] = {name: [] for name in samplers}
    sampled: dict[str, list[tuple[int, ...]]] = {}
    for _ in range(repeats):
        for name, run in samplers.items():
            llm.reset_prefix_cache()
            clock.lap()
            wall, sampled[name] = timed(run)
            walls[name].append(wall)
            inside[name].append(clock.lap())
    raw = walls["raw-vllm"]
    row: dict[str, Any] = {"samplers": {}}
    for name, runs in walls.items():
        n = sum(len(ids) for ids in sampled[name])
        wall = statistics.median(runs)
        ratios = [a / b for a, b in zip(runs, raw, strict=True)]
        row["samplers"][name] = {
            "wall_s": wall, "wall_s_runs": runs, "sampled_tokens": n,
            "tokens_per_s": n / wall, "episodes_per_s": num_episodes / wall,
            "in_engine_steps_s": statistics.median(inside[name]),
            "over_raw": statistics.median(ratios), "over_raw_runs": ratios,
        }  # fmt: skip
        if name != "torch":  # the same requests and seeds on the same engine
            row["samplers"][name]["same_tokens_as_raw"] = sorted(sampled[name]) == sorted(
                sampled["raw-vllm"]
            )
        print(f"  {name}: {[round(w, 3) for w in runs]} s", flush=True)
    row["ratio_turnrl_over_raw"] = row["samplers"]["turnrl-vllm"]["over_raw"]
    return row


def mean_len(requests: Sequence[GenerationRequest]) -> float:
    return statistics.mean(len(r.prompt_ids) for r in requests)


def sync_times(work: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """``VLLMBackend.load_weights`` against parameter count, one engine per model."""
    rows = []
    for name in args.sync_models:
        model_dir = tiny_dir(work, f"sync-{name}", SYNC_SHAPES[name])
        tokenizer, model = load_tokenizer(model_dir), load_model(model_dir)
        engine = VLLMBackend(model_dir, tokenizer, max_model_len=256, sleep=False)
        engine.generate_sync([GenerationRequest((1, 2, 3), 4)])  # warm the engine up
        walls, resets = [], []
        for _ in range(args.repeats):
            walls.append(timed(partial(engine.load_weights, model))[0])
            resets.append(timed(engine.llm.reset_prefix_cache)[0])
        params = sum(p.numel() for p in model.parameters())
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        wall = statistics.median(walls)
        rows.append({
            "model": name, "parameters": params, "state_dict_bytes": nbytes,
            "load_weights_s": wall, "load_weights_s_runs": walls,
            "reset_prefix_cache_s": statistics.median(resets),
            "mb_per_s": nbytes / wall / 1e6,
        })  # fmt: skip
        print(f"sync {name}: {params:,} parameters, {wall * 1000:.1f} ms", flush=True)
        del engine, model
        gc.collect()
    base = rows[0]["parameters"]
    for r in rows:
        r["parameters_over_tiny"] = r["parameters"] / base
    return rows


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=16, help="P tasks")
    parser.add_argument("--group-size", type=int, default=8, help="G samples per task")
    parser.add_argument("--single-tokens", type=int, default=64)
    parser.add_argument("--turn-tokens", type=int, default=48, help="max tokens per turn")
    parser.add_argument("--warmup-steps", type=int, default=120, help="syntax warm-up")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, all samplers")
    parser.add_argument("--sync-models", nargs="+", default=list(SYNC_SHAPES))
    parser.add_argument(
        "--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
        help="which parts run (a lent GPU machine runs gpu alone: each vLLM engine there "
        "compiles and captures CUDA graphs first)",
    )  # fmt: skip
    smoke = {
        "tasks": 2, "group_size": 2, "single_tokens": 8, "turn_tokens": 16,
        "warmup_steps": 4, "repeats": 1, "threads": 1, "sync_models": ["tiny", "~10x"],
    }  # fmt: skip
    args = parse_args(parser, "backends", smoke, runs=True)
    torch.set_num_threads(args.threads)  # before vLLM's CPU worker freezes the count
    vllm = import_vllm()
    work = args.runs_dir / "backends"
    model_dir = tiny_dir(work, "tiny", TINY)
    tokenizer = load_tokenizer(model_dir)
    startup_s, tiny, sync = None, None, None
    if "tiny" in args.sections:
        caller = caller_model(model_dir, args.warmup_steps)
        t0 = time.perf_counter()
        engine = VLLMBackend(model_dir, tokenizer, max_model_len=MAX_MODEL_LEN, sleep=False)
        startup_s = time.perf_counter() - t0
        engine.load_weights(caller)
        tiny = compare(engine, TorchBackend(caller, tokenizer), tokenizer, args)
        print(f"torch threads: {torch.get_num_threads()}", flush=True)
        del engine
        gc.collect()
    if "sync" in args.sections:
        sync = sync_times(work, args)
    gpu: dict[str, Any] = {"skipped": "not asked for (--sections)"}
    if "gpu" in args.sections and not torch.cuda.is_available():
        gpu = {"skipped": "no CUDA device"}
    elif "gpu" in args.sections:
        qwen = qwen_shaped_dir(work, model_dir)
        # No sleep mode: nothing trains beside this engine, and raw vLLM's calls need it awake.
        engine = VLLMBackend(
            qwen, tokenizer, dtype="bfloat16", max_model_len=MAX_MODEL_LEN, sleep=False
        )
        gpu = {
            "model": "random, Qwen2.5-0.5B shape, bfloat16",
            **compare(engine, None, tokenizer, args),
        }
        gpu["device"] = torch.cuda.get_device_name()
    else:
        print("gpu: skipped (no CUDA device)", flush=True)
    write(args, vllm, startup_s, tiny, sync, gpu)
    if args.smoke:
        shutil.rmtree(work, ignore_errors=True)


def write(
    args: argparse.Namespace, vllm: Any, startup_s: float | None, tiny: dict[str, Any] | None,
    sync: list[dict[str, Any]] | None, gpu: dict[str, Any],
) -> None:  # fmt: skip
    """The results as JSON and a Markdown table; a section not run (``None``) says so."""
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {args.threads} threads",
        "torch": torch.__version__,
        "vllm": vllm.__version__,
        "tasks": args.tasks, "group_size": args.group_size, "single_tokens": args.single_tokens,
        "turn_tokens": args.turn_tokens, "warmup_steps": args.warmup_steps,
        "repeats": args.repeats, "engine_startup_s": startup_s,
    }  # fmt: skip
    python, root = Path(sys.executable), Path(__file__).resolve().parent.parent
    if python.is_relative_to(root):  # .venv-vllm here; the lent GPU machine's own python3
        python = python.relative_to(root)
    command = " ".join([f"{python} benchmarks/backends.py", *sys.argv[1:]])
    data = {**meta, "command": command, "tiny": tiny, "sync": sync, "gpu": gpu}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(data, indent=2))
    lines = [
        "# turnrl's samplers against raw vLLM",
        "",
        f"{meta['date']}, {meta['machine']}, torch {meta['torch']}, vLLM {meta['vllm']}, "
        f"tiny model (float32, hidden 64, 2 layers, 2 heads) after {args.warmup_steps} "
        f"warm-up steps; the samplers in turn, {args.repeats} times, the vLLM ones on one "
        "engine, each run from an empty prefix cache; medians, and the median of each "
        "repeat's wall-time ratio to raw-vllm. raw-vllm-ids: raw vLLM with "
        f"`detokenize=False`. `{command}`",
        "",
    ]
    if tiny is None:
        lines.append("Tiny model: not run (--sections).")
    else:
        lines += [
            "| case | sampler | wall s | in engine steps s | sampled tok/s | episodes/s "
            "| wall / raw-vllm's |",
            "|---|---|---|---|---|---|---|",
            *case_lines(tiny, args),
        ]
    lines += [
        "",
        "Weight sync (`VLLMBackend.load_weights`: in place, then the prefix cache reset):",
        "",
    ]
    if sync is None:
        lines.append("not run (--sections).")
    else:
        lines += [
            "| model | parameters | x tiny | float32 MB | load_weights ms "
            "| prefix reset alone ms | MB/s |",
            "|---|---|---|---|---|---|---|",
        ]
    for r in sync or []:
        lines.append(
            f"| {r['model']} | {r['parameters']:,} | {r['parameters_over_tiny']:.1f} | "
            f"{r['state_dict_bytes'] / 1e6:.1f} | {r['load_weights_s'] * 1000:.1f} | "
            f"{r['reset_prefix_cache_s'] * 1000:.2f} | {r['mb_per_s']:.0f} |"
        )
    lines += ["", "GPU (random Qwen2.5-0.5B-shaped model, bfloat16):", ""]
    if "skipped" in gpu:
        lines.append(f"skipped: {gpu['skipped']}.")
    else:
        lines += [f"{gpu['device']}.", "", "| case | sampler | wall s | in engine steps s | "
                  "sampled tok/s | episodes/s | wall / raw-vllm's |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        lines += case_lines(gpu, args)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def case_lines(result: dict[str, Any], args: argparse.Namespace) -> list[str]:
    lines = []
    for case in ("single", "multi"):
        row = result[case]
        if case == "single":
            label = f"single turn, {row['requests']} requests x {args.single_tokens} tokens"
        else:
            label = (
                f"multi-turn, {row['episodes']} episodes, {row['engine_calls']} engine calls, "
                f"{row['turns_mean']:.2f} turns, {row['tool_calls_mean']:.2f} tool calls"
            )
        for name, s in row["samplers"].items():
            ratio = "" if name == "raw-vllm" else f"{s['over_raw']:.3f}x"
            ratio = f"**{ratio}**" if name == "turnrl-vllm" else ratio
            inside = "" if name == "torch" else f"{s['in_engine_steps_s']:.3f}"
            lines.append(
                f"| {label} | {name} | {s['wall_s']:.3f} | {inside} | "
                f"{s['tokens_per_s']:,.0f} | "
                f"{s['episodes_per_s']:.1f} | {ratio} |"
            )
            label = ""
    return lines


if __name__ == "__main__":
    main()
