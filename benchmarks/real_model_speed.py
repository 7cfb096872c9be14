"""turnrl's speed on a real model, SmolLM2-135M-Instruct, with its peers in the same run.

The model is turnrl's named model ``smollm2-135m`` (float32 on the CPU); every timing is
the median of ``--repeats`` rounds in which the variants take turns, after one untimed
round, so a machine that slows down for a while slows them all alike; a ratio is computed
in each round and then medianed. Every section records the load average before and after
it, the CPU model and its vector flags (/proc/cpuinfo), torch's threads and the git commit.

- ``sampler``: the same 16 requests (the first-turn prompts of 4 ``search_qa`` tasks of the
  ``smollm2_search_qa`` recipe, as turnrl's rollout renders them: one episode each through
  ``collect_groups``, its first turn's prompt ids kept; 4 samples each, seeds fixed),
  temperature 0.7, ``--new-tokens`` each and no stop token, so every sampler does the whole
  work (tokens actually sampled are counted). Samplers: transformers' ``generate`` on the
  16 left-padded at once (KV cache, ``do_sample``, no top-k, ``min_new_tokens`` =
  ``max_new_tokens``) and one request at a time (``--single-repeats`` rounds); turnrl's
  ``TorchBackend`` (``run(generate(...))``, what the rollout calls; ``sync`` before each
  run, as after an update, so no history is reused); and where ``vllm`` imports (run it
  under .venv-vllm), ``vllm.LLM.generate`` called directly (``raw-vllm``; ``raw-vllm-ids``
  with ``detokenize=False``) and turnrl's ``VLLMBackend``, all on one engine, its prefix
  cache emptied before each run. Sampled tokens/s each, and turnrl-torch over HF generate
  (target: at least 1.5x on 16 at once) and turnrl-vLLM over raw vLLM (target: at least
  1x). ``concurrency``: ``TorchBackend`` and ``VLLMBackend`` on 16, 64 and 256 requests at
  once (the 4 prompts in turn; ``--concurrency``), and where vLLM overtakes torch. ``sync``:
  ``VLLMBackend.load_weights`` of the model, median. vLLM runs in float32 with the threads
  torch has, unbound (``VLLM_CPU_OMP_THREADS_BIND=nobind``), and a KV cache of 4 GiB
  unless ``VLLM_CPU_KVCACHE_SPACE`` says otherwise (turnrl's default, 1 GiB, holds about
  23,000 tokens of this model: 256 requests would not fit at once).
- ``update``: one GRPO update of 16 samples (4 groups of 4; each group's prompt is its
  rendered task prompt filled to ``--prompt-tokens`` with random ids, standing for earlier
  turns; completions of ``--completion-tokens`` random ids; loss on completions only;
  advantages +1/-1), the recipe's algorithm settings (lr 1e-5, no KL, one micro-batch of
  16): ``Learner.step_samples`` against a bare PyTorch step on exactly the same tokens
  (right-padded batch built before the clock starts, full forward, ``log_softmax`` and
  ``gather`` of the trained tokens, ``-(adv * logp)`` masked mean, backward, ``AdamW``
  with the same lr and weight decay, ``zero_grad``); turnrl also clips the gradient norm
  and logs the entropy and the sampler gap, which the bare step does not. Two bare steps:
  ``bare`` runs the output layer on every position (a model's plain ``forward``),
  ``bare-sliced`` only on the trained positions (the decoder's hidden states picked
  first), the floor a careful hand-written step reaches. Target: turnrl at most 1.2x
  bare-sliced. The no-grad forward a KL reference costs, both ways (turnrl's:
  ``Learner.sampler_gap``, the scoring pass its reference runs). Memory: each variant in a
  fresh subprocess (this script, ``--memory-child``): the model loaded, one warm-up step
  (AdamW state made), gradients dropped, freed memory handed back (``malloc_trim``), the
  resident size read as the baseline (model + optimizer state), the peak reset (``5 >
  /proc/self/clear_refs``), one step, then the peak (VmHWM): no variant sees another's
  freed memory. The growth includes the gradients, which do not grow with episodes; per
  episode it is divided by 16, with and without them. Then, with the step returned, the
  float32 tensors as wide as the vocabulary that Python still reaches (``gc``; a probe
  tensor checks that the scan finds one), the gradients still held, and the resident size
  left over the baseline.
- ``lora``: the same update with ``model.lora.rank=16`` (``add_lora`` with the run's
  settings) against full fine-tuning: step time and peak memory, as above.
- ``bf16``: where the CPU has avx512_bf16 or amx_bf16: the update step under bf16-mixed
  (autocast, float32 master weights) against float32, and the largest |sampler log-prob -
  learner log-prob| over the tokens ``TorchBackend`` sampled for the 16 requests, in
  float32, bf16-mixed with the bf16 sampler copy (turnrl's default there) and bf16-mixed
  sharing the learner's model under autocast. Report only.
- ``profile``: ``torch.profiler`` (CPU) over one ``TorchBackend`` batch of the sampler's
  requests and one ``Learner.step_samples``: the 15 ops with the most self CPU time, and
  the self time by bucket: an op falls in the bucket of itself or of what called it
  (optimizer: inside ``Optimizer.step`` or ``zero_grad``; attention: a
  scaled-dot-product call; softmax: any softmax, which outside attention is the one over
  the vocabulary; matmul/linear; sampling: the random draw, sort and search ops), else
  other.
- ``scaling``: update step time and sampler tokens/s for the tiny model turnrl builds
  (``TinyModelConfig()``), a random Llama-shaped model of about 38M parameters (hidden 384,
  12 layers, 6 heads, SmolLM2's vocabulary) and the real model; parameters and
  nanoseconds per parameter x token, to extrapolate.

    python benchmarks/real_model_speed.py                       # every section
    python benchmarks/real_model_speed.py --sections update lora --repeats 3
    .venv-vllm/bin/python benchmarks/real_model_speed.py --sections sampler   # with vLLM
    python benchmarks/real_model_speed.py --smoke   # the tiny model, 1 repeat, seconds

Needs the real model (``make setup`` installs it); ``--smoke`` builds a tiny model instead.
Writes benchmarks/results/real_model_speed.json and .md (``--out``); the tiny models of
``scaling`` go to benchmarks/runs/real_model_speed (``--runs-dir``; ``--smoke``: a
temporary directory).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import dataclasses
import gc
import importlib.util
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # as benchmarks/backends.py
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB: 256 requests of this model fit

import torch

from outputs import parse_args
from turnrl import load_config
from turnrl.backends import GenerationRequest, TorchBackend, VLLMBackend, import_vllm
from turnrl.envs import make_env_family
from turnrl.models import (
    TinyModelConfig,
    add_lora,
    build_tiny_model,
    load_model,
    load_tokenizer,
    resolve_model,
)
from turnrl.rollout import ChatRenderer, EpisodeLimits, GroupSpec, SamplingParams, collect_groups
from turnrl.trainer import AlgorithmConfig, Learner, MicroBatchConfig, Sample

ROOT = Path(__file__).resolve().parent.parent
NAME = "real_model_speed"
SECTIONS = ("sampler", "update", "lora", "bf16", "profile", "scaling")
"""The parts of the benchmark, in the order they run (``--sections``)."""
RECIPE = "smollm2_search_qa"
"""The recipe whose tasks, sampling temperature and algorithm settings are measured."""
CHILD = "--memory-child"
"""First argument of this script run as one variant's memory measurement."""
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile",
         "amx_bf16", "amx_int8")  # fmt: skip
"""The /proc/cpuinfo flags that decide which CPU kernels torch can use."""
SMOKE_TINY = TinyModelConfig(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=1024
)
"""``--smoke``'s model: the quick-start's shape with heads 32 wide (vLLM's CPU minimum)."""
MID_LLAMA = {"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 12,
             "num_attention_heads": 6, "num_key_value_heads": 2}  # fmt: skip
"""The random Llama of ``scaling``, SmolLM2's proportions at hidden 384 (about 38M with
SmolLM2's 49,152-token vocabulary, tied, 19M of them in the embedding)."""
SMOKE_LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 2, "num_key_value_heads": 1}  # fmt: skip
FIRST_ID = 32
"""Random ids start here, past the special tokens of both tokenizers."""
SAMPLING_OPS = ("multinomial", "searchsorted", "cumsum", "sort", "topk", "argmax", "rand",
                "uniform", "exponential")  # fmt: skip
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear",
              "MmBackward", "AddmmBackward", "BmmBackward")  # fmt: skip
BUCKETS = ("matmul/linear", "attention", "softmax (vocabulary)", "sampling", "optimizer", "other")


# --------------------------------------------------------------------------- conditions


def cpu_info() -> dict[str, Any]:
    """The CPU's model name, its vector flags among ``FLAGS`` and its core count."""
    model, flags = platform.processor() or platform.machine(), set[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    return {"cpu": model, "cpu_flags": [f for f in FLAGS if f in flags], "cores": os.cpu_count()}


def git_commit() -> str | None:
    """The checkout's short commit, or None (no git, not a checkout)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


CPU = cpu_info()
COMMIT = git_commit()


def run_section(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``fn``'s results with the conditions they were measured under; a section that fails
    records its error (and prints the traceback) instead of results."""
    print(f"== {name}", flush=True)
    load = list(os.getloadavg())
    t0 = time.perf_counter()
    try:
        result = fn()
    except Exception as exc:
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"}
    hand_back_freed_memory()  # the next section's memory children need the room
    result["section_s"] = time.perf_counter() - t0
    result["conditions"] = {
        "load_before": load, "load_after": list(os.getloadavg()),
        "torch_threads": torch.get_num_threads(), **CPU, "commit": COMMIT,
    }  # fmt: skip
    return result


# --------------------------------------------------------------------------- timing


def take_turns(
    variants: dict[str, Callable[[], int]],
    repeats: int,
    rounds: dict[str, int] | None = None,
    warm: dict[str, Callable[[], Any]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Each variant once untimed (``warm``'s stand-in where given), then ``repeats``
    rounds in which each runs once, in turn (a variant of ``rounds`` only in its first
    rounds). A variant returns the tokens it sampled or processed. Per variant: the wall
    times and token counts of the rounds it ran in (None where it sat one out)."""
    for name, run in variants.items():
        (warm or {}).get(name, run)()
    runs: dict[str, dict[str, Any]] = {n: {"wall_s_runs": [], "tokens_runs": []} for n in variants}
    for r in range(repeats):
        for name, run in variants.items():
            if r >= (rounds or {}).get(name, repeats):
                runs[name]["wall_s_runs"].append(None)
                runs[name]["tokens_runs"].append(None)
                continue
            t0 = time.perf_counter()
            tokens = run()
            runs[name]["wall_s_runs"].append(time.perf_counter() - t0)
            runs[name]["tokens_runs"].append(tokens)
        print(f"  round {r + 1}: " + ", ".join(
            f"{n} {v['wall_s_runs'][-1]:.3f} s" for n, v in runs.items()
            if v["wall_s_runs"][-1] is not None
        ), flush=True)  # fmt: skip
    for v in runs.values():
        walls = [w for w in v["wall_s_runs"] if w is not None]
        tokens = [t for t in v["tokens_runs"] if t is not None]
        v["wall_s"] = statistics.median(walls)
        v["tokens"] = tokens[-1]
        v["tokens_per_s"] = statistics.median(t / w for t, w in zip(tokens, walls, strict=True))
    return runs


def ratio(
    runs: dict[str, dict[str, Any]], a: str, b: str, per_token: bool = True
) -> dict[str, Any] | None:
    """``a`` over ``b`` in each round both ran, then the median: tokens/s (``per_token``)
    or wall time. None where they never ran in one round."""
    pairs = [
        (wa, ta, wb, tb)
        for wa, ta, wb, tb in zip(runs[a]["wall_s_runs"], runs[a]["tokens_runs"],
                                  runs[b]["wall_s_runs"], runs[b]["tokens_runs"], strict=True)
        if wa is not None and wb is not None
    ]  # fmt: skip
    if not pairs:
        return None
    values = [(ta / wa) / (tb / wb) if per_token else wa / wb for wa, ta, wb, tb in pairs]
    return {"median": statistics.median(values), "runs": values}


# --------------------------------------------------------------------------- models, data


@dataclasses.dataclass
class Subject:
    """The model measured: its checkpoint directory, tokenizer, float32 model and the
    first-turn prompts of the recipe's tasks."""

    label: str
    path: Path
    tokenizer: Any
    model: Any
    prompts: list[tuple[int, ...]]
    vllm: list[tuple[VLLMBackend | None, dict[str, Any]]]
    """The vLLM engine ``sampler`` uses (or None and why), started with the model; the
    section takes it (``pop``), so that it is gone when the section ends."""

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    @property
    def vocab(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])


def search_qa() -> Any:
    """The recipe's ``search_qa`` family, with its options."""
    config = load_config(RECIPE)
    return make_env_family(config.env.name, **config.env.options)


def first_prompts(model: Any, tokenizer: Any, count: int) -> list[tuple[int, ...]]:
    """The first-turn prompt ids of the recipe's training tasks 0..count-1 exactly as the
    rollout builds them: one episode each through ``collect_groups`` (one token sampled),
    its first turn's ``prompt_ids`` kept."""
    family, backend = search_qa(), TorchBackend(model, tokenizer)
    spec = GroupSpec(1, EpisodeLimits(max_turns=1, max_tokens_per_turn=1), SamplingParams(), 0)
    tasks = [family.task(i) for i in range(count)]
    program = collect_groups(tasks, family.make_env, backend, ChatRenderer(tokenizer), spec)
    episodes = [group[0] for group in backend.run(program)]
    errors = [t.error for t in episodes if t.error]
    if errors:
        raise RuntimeError(f"episodes failed: {errors[:2]}")
    return [t.turns[0].prompt_ids for t in episodes]


def load_subject(args: argparse.Namespace) -> Subject:
    """The real model (``--model``), or with ``--smoke`` a tiny one built in the runs dir."""
    if args.smoke:
        path = args.runs_dir / NAME / "tiny-smoke"
        if not (path / "config.json").is_file():
            build_tiny_model(path, SMOKE_TINY, extra_corpus=search_qa().corpus(), overwrite=True)
        label = "tiny (--smoke)"
    else:
        path, label = Path(resolve_model(args.model)), args.model
    tokenizer = load_tokenizer(path)
    # the engine first, while the process holds nothing else large
    engine = [vllm_engine(path, tokenizer)] if "sampler" in args.sections else []
    model = load_model(path)
    prompts = first_prompts(model, tokenizer, args.prompts)
    return Subject(label, path, tokenizer, model, prompts, engine)


def sampler_requests(
    prompts: Sequence[tuple[int, ...]], count: int, args: argparse.Namespace, seed: int = 1000
) -> list[GenerationRequest]:
    """``count`` requests, the prompts in turn (prompt-major for 4 x 4), each with its own
    seed, no stop token: every request samples ``--new-tokens``."""
    per = max(1, count // len(prompts))
    return [
        GenerationRequest(prompts[(k // per) % len(prompts)], args.new_tokens,
                          temperature=args.temperature, seed=seed + k)
        for k in range(count)
    ]  # fmt: skip


def update_batch(
    prompts: Sequence[tuple[int, ...]], vocab: int, args: argparse.Namespace, seed: int = 0
) -> tuple[list[Sample], list[float]]:
    """16 samples, 4 groups of 4: a group shares its prompt (its task's rendered prompt,
    filled to ``--prompt-tokens`` with random ids that stand for earlier turns), each sample
    has its own random completion of ``--completion-tokens``; the loss mask covers the
    completion only; advantages +1, -1 in turn. The sampler log-probs are a stand-in (-2):
    only the learner's logged gap reads them."""
    rng = random.Random(seed)
    low, high = args.completion_tokens
    samples, advantages = [], []
    for g in range(args.prompts):
        prompt = list(prompts[g % len(prompts)][: args.prompt_tokens])
        prompt += [rng.randrange(FIRST_ID, vocab) for _ in range(args.prompt_tokens - len(prompt))]
        for s in range(args.samples):
            completion = [rng.randrange(FIRST_ID, vocab) for _ in range(rng.randint(low, high))]
            mask = [0] * len(prompt) + [1] * len(completion)
            logps = [0.0] * len(prompt) + [-2.0] * len(completion)
            samples.append(Sample(tuple(prompt + completion), tuple(mask), tuple(logps)))
            advantages.append(1.0 if s % 2 == 0 else -1.0)
    return samples, advantages


def algorithm(batch_size: int) -> AlgorithmConfig:
    """The recipe's algorithm settings, with one micro-batch of the whole batch."""
    config = load_config(RECIPE).algorithm
    return dataclasses.replace(config, micro_batch=MicroBatchConfig(size=batch_size))


def lora_settings() -> dict[str, Any]:
    """``add_lora``'s arguments for ``model.lora.rank=16`` and the rest as a run has them."""
    lo = load_config(RECIPE, ["model.lora.rank=16"]).model.lora
    return {"rank": lo.rank, "alpha": lo.alpha, "target_modules": list(lo.target_modules),
            "dropout": lo.dropout}  # fmt: skip


def learner(model: Any, samples: Sequence[Sample], temperature: float, **kw: Any) -> Learner:
    return Learner(model, algorithm(len(samples)), temperature=temperature, **kw)


def stepper(
    learn: Learner, samples: Sequence[Sample], advantages: Sequence[float], pad_id: int
) -> Callable[[], int]:
    """One ``step_samples`` of the batch, as a timed variant: returns the batch's tokens."""
    tokens = batch_tokens(samples)["tokens"]

    def step() -> int:
        learn.step_samples(samples, advantages, pad_id=pad_id)
        return tokens

    return step


def parameters(model: Any, trainable: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable)


def batch_tokens(samples: Sequence[Sample]) -> dict[str, int]:
    lengths = [len(s.input_ids) for s in samples]
    return {"tokens": sum(lengths), "trained_tokens": sum(sum(s.loss_mask) for s in samples),
            "padded_cells": len(lengths) * max(lengths), "longest": max(lengths)}  # fmt: skip


# --------------------------------------------------------------------------- peers


def hf_generate(model: Any, requests: Sequence[GenerationRequest], pad_id: int, eos: int) -> int:
    """transformers' ``generate`` on ``requests`` at once (left-padded, KV cache, sampling
    at the requests' temperature, no top-k/top-p, exactly ``max_new_tokens``): the tokens
    sampled (up to and with an end-of-sequence token, which ``min_new_tokens`` holds off)."""
    from transformers import GenerationConfig

    width = max(len(r.prompt_ids) for r in requests)
    ids = torch.full((len(requests), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(requests):
        ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
        mask[i, width - len(r.prompt_ids) :] = 1
    n = requests[0].max_new_tokens
    config = GenerationConfig(
        do_sample=True, temperature=requests[0].temperature, top_k=0, top_p=1.0,
        max_new_tokens=n, min_new_tokens=n, pad_token_id=pad_id, eos_token_id=eos,
        use_cache=True,
    )  # fmt: skip
    torch.manual_seed(requests[0].seed)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    sampled = 0
    for row in out[:, width:].tolist():
        sampled += row.index(eos) + 1 if eos in row else len(row)
    return sampled


def hf_one_at_a_time(
    model: Any, requests: Sequence[GenerationRequest], pad_id: int, eos: int
) -> int:
    return sum(hf_generate(model, [r], pad_id, eos) for r in requests)


def backend_sample(backend: Any, requests: Sequence[GenerationRequest]) -> list[Any]:
    """What the rollout does: the requests through the backend's running batch."""
    if isinstance(backend, TorchBackend):
        backend.sync(backend.model)  # a new policy version: no history reused, as after a step
    else:
        backend.llm.reset_prefix_cache()
    return list(backend.run(backend.generate(requests)))


def sampled(completions: Sequence[Any]) -> int:
    return sum(len(c.token_ids) for c in completions)


def raw_vllm(
    engine: VLLMBackend, requests: Sequence[GenerationRequest], detokenize: bool = True
) -> int:
    """``LLM.generate`` on the engine ``engine`` holds, with the params a direct caller
    writes for the same work (the sampled token's log-prob, the seed, no stop)."""
    vllm = import_vllm()
    engine.llm.reset_prefix_cache()
    params = [
        vllm.SamplingParams(n=1, temperature=r.temperature, top_p=r.top_p,
                            max_tokens=r.max_new_tokens, seed=r.seed, logprobs=0,
                            ignore_eos=True, detokenize=detokenize)
        for r in requests
    ]  # fmt: skip
    prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in requests]
    outputs = engine.llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs)


class BareStep:
    """The plain PyTorch GRPO step the learner is measured against: the batch right-padded
    once, up front; then forward over every position, ``log_softmax`` over the vocabulary
    and ``gather`` of each next token, loss ``-(advantage * logp)`` averaged over the
    trained tokens, backward, ``AdamW`` step, ``zero_grad``. ``sliced``: the output layer
    runs on the trained positions only (the decoder's hidden states picked first), the
    floor a careful hand-written step reaches; otherwise on every position, as a
    model's plain ``forward`` does."""

    def __init__(
        self, model: Any, samples: Sequence[Sample], advantages: Sequence[float],
        pad_id: int, lr: float, weight_decay: float, temperature: float,
        sliced: bool = False,
    ) -> None:  # fmt: skip
        width = max(len(s.input_ids) for s in samples)
        self.ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
        self.attention = torch.zeros_like(self.ids)
        self.trained = torch.zeros_like(self.ids, dtype=torch.bool)
        for i, s in enumerate(samples):
            self.ids[i, : len(s.input_ids)] = torch.tensor(s.input_ids)
            self.attention[i, : len(s.input_ids)] = 1
            self.trained[i, : len(s.input_ids)] = torch.tensor(s.loss_mask, dtype=torch.bool)
        self.advantages = torch.tensor(advantages)[:, None]
        self.model, self.temperature, self.sliced = model, temperature, sliced
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)

    def logprobs(self) -> torch.Tensor:
        """log pi of each trained token (in row-major order)."""
        mask = self.trained[:, 1:]
        if self.sliced:
            decoder = self.model.get_decoder()
            hidden = decoder(input_ids=self.ids, attention_mask=self.attention, use_cache=False)
            picked = hidden.last_hidden_state[:, :-1][mask]
            logits = self.model.get_output_embeddings()(picked)
            logp = torch.log_softmax(logits.float() / self.temperature, dim=-1)
            return logp.gather(-1, self.ids[:, 1:][mask][:, None]).squeeze(-1)
        out = self.model(input_ids=self.ids, attention_mask=self.attention, use_cache=False)
        logp = torch.log_softmax(out.logits[:, :-1].float() / self.temperature, dim=-1)
        return logp.gather(-1, self.ids[:, 1:, None]).squeeze(-1)[mask]

    def step(self) -> int:
        self.model.train()
        advantages = self.advantages.expand_as(self.trained)[:, 1:][self.trained[:, 1:]]
        loss = -(advantages * self.logprobs()).mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return int(self.attention.sum())

    def score(self) -> int:
        """The no-grad forward a reference model costs."""
        with torch.no_grad():
            self.logprobs()
        return int(self.attention.sum())


# --------------------------------------------------------------------------- sampler


def sampler_section(subject: Subject, args: argparse.Namespace) -> dict[str, Any]:
    """HF generate (16 at once, one at a time), TorchBackend and, with vLLM, raw vLLM and
    VLLMBackend on the same 16 requests; then the concurrency sweep and the weight sync."""
    requests = sampler_requests(subject.prompts, args.prompts * args.samples, args)
    model, pad, eos = subject.model, subject.pad_id, int(subject.tokenizer.eos_token_id)
    torch_backend = TorchBackend(model, subject.tokenizer)
    variants: dict[str, Callable[[], int]] = {
        "hf-generate-16": lambda: hf_generate(model, requests, pad, eos),
        "hf-generate-1": lambda: hf_one_at_a_time(model, requests, pad, eos),
        "turnrl-torch": lambda: sampled(backend_sample(torch_backend, requests)),
    }
    warm: dict[str, Callable[[], Any]] = {
        "hf-generate-1": lambda: hf_generate(model, requests[:1], pad, eos)
    }
    engine, vllm_info = subject.vllm.pop()
    if engine is not None:
        variants["raw-vllm"] = lambda: raw_vllm(engine, requests)
        variants["raw-vllm-ids"] = lambda: raw_vllm(engine, requests, detokenize=False)
        variants["turnrl-vllm"] = lambda: sampled(backend_sample(engine, requests))
    runs = take_turns(variants, args.repeats, {"hf-generate-1": args.single_repeats}, warm)
    ratios = {
        "torch_over_hf16": ratio(runs, "turnrl-torch", "hf-generate-16"),
        "torch_over_hf1": ratio(runs, "turnrl-torch", "hf-generate-1"),
    }
    if engine is not None:
        ratios["vllm_over_raw"] = ratio(runs, "turnrl-vllm", "raw-vllm")
        ratios["vllm_over_raw_ids"] = ratio(runs, "turnrl-vllm", "raw-vllm-ids")
        ratios["vllm_over_torch"] = ratio(runs, "turnrl-vllm", "turnrl-torch")
    torch_hf = ratios["torch_over_hf16"]
    vllm_raw = ratios.get("vllm_over_raw")
    return {
        "requests": len(requests), "prompts": args.prompts, "samples_per_prompt": args.samples,
        "new_tokens": args.new_tokens, "temperature": args.temperature,
        "prompt_tokens": [len(p) for p in subject.prompts],
        "samplers": runs, "ratios": ratios, "vllm": vllm_info,
        "targets": {
            "torch_over_hf16_at_least_1.5": torch_hf["median"] >= 1.5 if torch_hf else None,
            "vllm_over_raw_at_least_1": vllm_raw["median"] >= 1.0 if vllm_raw else None,
        },
        "concurrency": concurrency(subject, torch_backend, engine, args),
        "sync": sync_times(subject, engine, args),
    }  # fmt: skip


def vllm_engine(path: Path, tokenizer: Any) -> tuple[VLLMBackend | None, dict[str, Any]]:
    """A ``VLLMBackend`` on the model directory ``path`` (float32, the threads torch has),
    or None and the reason it could not start."""
    if importlib.util.find_spec("vllm") is None:
        return None, {"skipped": f"no vllm in {sys.executable} (run under .venv-vllm)"}
    try:
        vllm = import_vllm()
    except Exception as exc:
        return None, {"skipped": f"vllm does not import: {type(exc).__name__}: {exc}"}
    t0 = time.perf_counter()
    try:
        engine = VLLMBackend(path, tokenizer, max_model_len=1024, sleep=False)
    except Exception as exc:
        traceback.print_exc()
        return None, {"skipped": f"vLLM's engine did not start: {type(exc).__name__}: {exc}"}
    return engine, {
        "version": vllm.__version__, "engine_startup_s": time.perf_counter() - t0,
        "kv_cache_gib": float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "0") or 0),
    }  # fmt: skip


def concurrency(
    subject: Subject, torch_backend: TorchBackend, engine: VLLMBackend | None,
    args: argparse.Namespace,
) -> dict[str, Any]:  # fmt: skip
    """Tokens/s of TorchBackend (and VLLMBackend) with N requests at once, per N, and the
    smallest N at which vLLM samples faster."""
    rows = []
    for n in args.concurrency:
        requests = sampler_requests(subject.prompts, n, args, seed=5000)
        variants = {"turnrl-torch": lambda r=requests: sampled(backend_sample(torch_backend, r))}
        if engine is not None:
            variants["turnrl-vllm"] = lambda r=requests: sampled(backend_sample(engine, r))
        print(f"  {n} requests at once", flush=True)
        runs = take_turns(variants, args.repeats)
        row = {"requests": n, "samplers": runs}
        if engine is not None:
            row["vllm_over_torch"] = ratio(runs, "turnrl-vllm", "turnrl-torch")
        rows.append(row)
    if engine is None:
        crossover = "not measured: vLLM is not available here"
    else:
        faster = [r["requests"] for r in rows if r["vllm_over_torch"]["median"] > 1.0]
        crossover = (
            f"vLLM never overtook torch up to {rows[-1]['requests']} requests at once"
            if not faster else f"vLLM samples faster from {faster[0]} requests at once"
            + (" (the fewest measured)" if faster[0] == rows[0]["requests"] else "")
        )  # fmt: skip
    return {"rows": rows, "crossover": crossover}


def sync_times(
    subject: Subject, engine: VLLMBackend | None, args: argparse.Namespace
) -> dict[str, Any]:
    """``VLLMBackend.load_weights`` of the model into the running engine, median."""
    if engine is None:
        return {"skipped": "vLLM is not available here"}
    engine.load_weights(subject.model)  # warm-up
    walls = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        engine.load_weights(subject.model)
        walls.append(time.perf_counter() - t0)
    nbytes = sum(t.numel() * t.element_size() for t in subject.model.state_dict().values())
    return {"parameters": parameters(subject.model), "state_dict_bytes": nbytes,
            "load_weights_s": statistics.median(walls), "load_weights_s_runs": walls}  # fmt: skip


# --------------------------------------------------------------------------- update, lora


def update_timings(
    subject: Subject, samples: Sequence[Sample], advantages: Sequence[float],
    args: argparse.Namespace,
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """turnrl's learner step and the bare step, each on its own copy of the model, and the
    reference forward both ways, in turn."""
    config = algorithm(len(samples))
    learn = learner(copy.deepcopy(subject.model), samples, args.temperature)
    bare, sliced = (
        BareStep(copy.deepcopy(subject.model), samples, advantages, subject.pad_id,
                 config.lr, config.weight_decay, args.temperature, sliced=cut)
        for cut in (False, True)
    )  # fmt: skip
    tokens = batch_tokens(samples)["tokens"]

    def score() -> int:
        learn.sampler_gap(samples, subject.pad_id)
        return tokens

    variants = {"turnrl": stepper(learn, samples, advantages, subject.pad_id), "bare": bare.step,
                "bare-sliced": sliced.step, "turnrl-reference-forward": score,
                "bare-reference-forward": bare.score,
                "bare-sliced-reference-forward": sliced.score}  # fmt: skip
    return take_turns(variants, args.repeats)


def update_section(subject: Subject, args: argparse.Namespace) -> dict[str, Any]:
    """``Learner.step_samples`` against the bare step, the reference forward both ways,
    and each one's memory in its own process."""
    samples, advantages = update_batch(subject.prompts, subject.vocab, args)
    config = algorithm(len(samples))
    # the memory first, while this process holds one model: the timings' three copies and
    # their optimizer states stay resident here (freed, not handed back) and, beside a
    # child's step, did not fit in 24 GB
    memory = {v: measure_memory(subject, samples, advantages, v, args) for v in
              ("turnrl", "bare", "bare-sliced", "turnrl-reference-forward",
               "bare-reference-forward", "bare-sliced-reference-forward")}  # fmt: skip
    runs = update_timings(subject, samples, advantages, args)
    gc.collect()
    hand_back_freed_memory()
    step_ratio = ratio(runs, "turnrl", "bare-sliced", per_token=False)
    vocab_bytes = 4 * subject.vocab
    return {
        "batch": {"samples": len(samples), "groups": args.prompts, "group_size": args.samples,
                  "prompt_tokens": args.prompt_tokens,
                  "completion_tokens": list(args.completion_tokens), **batch_tokens(samples)},
        "config": {"lr": config.lr, "weight_decay": config.weight_decay,
                   "max_grad_norm": config.max_grad_norm, "kl_coef": config.kl.coef,
                   "micro_batch_size": config.micro_batch.size,
                   "layout": config.micro_batch.layout, "temperature": args.temperature,
                   "advantage": config.advantage, "loss_reduction": config.loss_reduction},
        "steps": runs,
        "ratio_turnrl_over_bare_sliced": step_ratio,
        "ratio_turnrl_over_bare": ratio(runs, "turnrl", "bare", per_token=False),
        "ratio_reference_turnrl_over_bare_sliced": ratio(
            runs, "turnrl-reference-forward", "bare-sliced-reference-forward", per_token=False),
        "ratio_reference_turnrl_over_bare": ratio(
            runs, "turnrl-reference-forward", "bare-reference-forward", per_token=False),
        "target_at_most_1.2": step_ratio["median"] <= 1.2 if step_ratio else None,
        "memory": memory,
        "estimate_bytes": {
            "parameters": 4 * parameters(subject.model),
            "adamw_state": 8 * parameters(subject.model),
            "gradients": 4 * parameters(subject.model),
            "vocabulary_row": vocab_bytes,
            "logits_trained_tokens": vocab_bytes * batch_tokens(samples)["trained_tokens"],
            "logits_all_positions": vocab_bytes * batch_tokens(samples)["padded_cells"],
        },
    }  # fmt: skip


def lora_section(subject: Subject, args: argparse.Namespace) -> dict[str, Any]:
    """The update with LoRA adapters (``model.lora.rank=16``) against full fine-tuning."""
    samples, advantages = update_batch(subject.prompts, subject.vocab, args)
    settings = lora_settings()
    # the memory first, as in ``update``
    memory = {
        v: measure_memory(subject, samples, advantages, v, args) for v in ("turnrl", "turnrl-lora")
    }
    full = learner(copy.deepcopy(subject.model), samples, args.temperature)
    adapted = add_lora(copy.deepcopy(subject.model), **settings)
    lora = learner(adapted, samples, args.temperature)
    runs = take_turns({"full": stepper(full, samples, advantages, subject.pad_id),
                       "lora": stepper(lora, samples, advantages, subject.pad_id)}, args.repeats)  # fmt: skip
    trainable = parameters(adapted, trainable=True)
    del full, lora, adapted
    gc.collect()
    hand_back_freed_memory()
    return {
        "lora": settings, "parameters": parameters(subject.model),
        "trainable_parameters": trainable, "steps": runs,
        "ratio_lora_over_full": ratio(runs, "lora", "full", per_token=False),
        "memory": {"full": memory["turnrl"], "lora": memory["turnrl-lora"]},
    }  # fmt: skip


# --------------------------------------------------------------------------- memory


def status_kb(field: str) -> int:
    """A ``VmRSS``/``VmHWM`` line of /proc/self/status, in kB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def hand_back_freed_memory() -> None:
    """Collect garbage and return the allocator's free pages to the system, so that the
    resident size counts live memory only."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def vocabulary_tensors(vocab: int) -> dict[str, Any]:
    """The float32 tensors Python can reach whose last dimension is the vocabulary
    (logits or log-probs of some tokens), parameters and their gradients aside (their last
    dimension is the hidden size). A probe tensor checks that the scan sees such tensors."""
    probe = torch.zeros(1, vocab)
    gc.collect()
    found = [
        o for o in gc.get_objects()
        if isinstance(o, torch.Tensor) and not isinstance(o, torch.nn.Parameter)
        and o.dtype == torch.float32 and o.dim() >= 1 and o.shape[-1] == vocab
    ]  # fmt: skip
    probe_found = any(o is probe for o in found)
    found = [o for o in found if o is not probe]
    return {"count": len(found), "bytes": sum(o.numel() * 4 for o in found),
            "shapes": [list(o.shape) for o in found[:8]], "probe_found": probe_found}  # fmt: skip


def measure_memory(
    subject: Subject, samples: Sequence[Sample], advantages: Sequence[float], variant: str,
    args: argparse.Namespace,
) -> dict[str, Any]:  # fmt: skip
    """One variant's memory, measured in a fresh process of this script (``CHILD``); once
    per variant and model (``update`` and ``lora`` measure the same full step)."""
    key = (variant, str(subject.path), tuple(map(tuple, (s.input_ids for s in samples))))
    if key not in MEASURED:
        MEASURED[key] = memory_of(subject, samples, advantages, variant, args)
    return MEASURED[key]


MEASURED: dict[tuple[Any, ...], dict[str, Any]] = {}


def memory_of(
    subject: Subject, samples: Sequence[Sample], advantages: Sequence[float], variant: str,
    args: argparse.Namespace,
) -> dict[str, Any]:  # fmt: skip
    """``measure_memory``'s subprocess: the batch and the settings go in a file, the
    results come back as the child's last line of output."""
    with tempfile.TemporaryDirectory(prefix="real-model-speed-") as folder:
        spec = Path(folder) / "spec.json"
        spec.write_text(json.dumps({
            "model": str(subject.path), "variant": variant, "pad_id": subject.pad_id,
            "temperature": args.temperature, "threads": torch.get_num_threads(),
            "samples": [dataclasses.astuple(s) for s in samples], "advantages": list(advantages),
        }))  # fmt: skip
        proc = subprocess.run([sys.executable, __file__, CHILD, str(spec)],
                              capture_output=True, text=True, timeout=1800)  # fmt: skip
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}"}
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"  memory {variant}: peak growth {result['peak_growth_mb']:.0f} MB", flush=True)
    return result


def memory_child(spec_path: Path) -> None:
    """``CHILD``: load the model, build the variant, one warm-up step, the baseline
    (gradients dropped, free memory handed back), the peak reset, one step; print the
    resident sizes and the vocabulary-wide tensors left (one JSON line)."""
    spec = json.loads(spec_path.read_text())
    torch.set_num_threads(spec["threads"])
    samples = [Sample(tuple(i), tuple(m), tuple(lp)) for i, m, lp in spec["samples"]]
    advantages, pad, temperature = spec["advantages"], spec["pad_id"], spec["temperature"]
    model = load_model(spec["model"])
    vocab = int(model.get_output_embeddings().weight.shape[0])
    variant: str = spec["variant"]
    if variant == "turnrl-lora":
        model = add_lora(model, **lora_settings())
    if variant.startswith("turnrl"):
        learn = learner(model, samples, temperature)
        step: Callable[[], Any] = (
            (lambda: learn.sampler_gap(samples, pad)) if variant.endswith("reference-forward")
            else (lambda: learn.step_samples(samples, advantages, pad_id=pad))
        )  # fmt: skip
        drop_gradients: Callable[[], None] = lambda: learn.optimizer.zero_grad(set_to_none=True)  # noqa: E731
    else:
        config = algorithm(len(samples))
        bare = BareStep(model, samples, advantages, pad, config.lr, config.weight_decay,
                        temperature, sliced=variant.startswith("bare-sliced"))  # fmt: skip
        step = bare.score if variant.endswith("reference-forward") else bare.step
        drop_gradients = lambda: bare.optimizer.zero_grad(set_to_none=True)  # noqa: E731
    if variant.endswith("reference-forward"):
        model.eval().requires_grad_(False)
    step()  # warm-up: the optimizer's state, the allocator's pools
    drop_gradients()
    hand_back_freed_memory()
    base = status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    t0 = time.perf_counter()
    step()
    wall = time.perf_counter() - t0
    peak = status_kb("VmHWM")
    alive = vocabulary_tensors(vocab)
    kept = sum(q.grad.numel() * q.grad.element_size() for q in model.parameters()
               if q.grad is not None)  # fmt: skip
    hand_back_freed_memory()
    left = status_kb("VmRSS")
    trainable = parameters(model, trainable=True)
    growth_mb = (peak - base) / 1024
    grads_mb = 4 * trainable / 2**20 if not variant.endswith("reference-forward") else 0.0
    print(json.dumps({
        "baseline_rss_mb": base / 1024, "peak_rss_mb": peak / 1024, "peak_growth_mb": growth_mb,
        "gradients_mb": grads_mb,
        "per_episode_mb": growth_mb / len(samples),
        "per_episode_without_gradients_mb": (growth_mb - grads_mb) / len(samples),
        "left_after_step_mb": (left - base) / 1024, "gradients_kept_mb": kept / 2**20,
        "trainable_parameters": trainable,
        "step_s": wall, "vocabulary_tensors_after_step": alive,
    }))  # fmt: skip


# --------------------------------------------------------------------------- bf16


def bf16_section(subject: Subject, args: argparse.Namespace) -> dict[str, Any]:
    """bf16-mixed against float32: the update's step time, and the sampler/learner
    log-prob gap on tokens TorchBackend sampled."""
    if not {"avx512_bf16", "amx_bf16"} & set(CPU["cpu_flags"]):
        return {"skipped": "the CPU reports neither avx512_bf16 nor amx_bf16"}
    samples, advantages = update_batch(subject.prompts, subject.vocab, args)
    learners = {
        "float32": learner(copy.deepcopy(subject.model), samples, args.temperature),
        "bf16-mixed": learner(copy.deepcopy(subject.model), samples, args.temperature,
                              autocast=torch.bfloat16),
    }  # fmt: skip
    runs = take_turns({k: stepper(v, samples, advantages, subject.pad_id)
                       for k, v in learners.items()}, args.repeats)  # fmt: skip
    del learners
    gc.collect()
    requests = sampler_requests(subject.prompts, args.prompts * args.samples, args)
    fp32 = learner(subject.model, samples, args.temperature)
    mixed = learner(subject.model, samples, args.temperature, autocast=torch.bfloat16)
    pairs = {
        "float32": (TorchBackend(subject.model, subject.tokenizer), fp32),
        "bf16-mixed, bf16 sampler copy": (
            TorchBackend(load_model(subject.path, dtype=torch.bfloat16), subject.tokenizer),
            mixed),
        "bf16-mixed, shared model under autocast": (
            TorchBackend(subject.model, subject.tokenizer, autocast=torch.bfloat16), mixed),
    }  # fmt: skip
    gaps = {}
    for name, (sampler, scorer) in pairs.items():
        completions = backend_sample(sampler, requests)
        scored = [
            Sample(r.prompt_ids + c.token_ids, (0,) * len(r.prompt_ids) + (1,) * len(c.token_ids),
                   (0.0,) * len(r.prompt_ids) + c.logprobs)
            for r, c in zip(requests, completions, strict=True)
        ]  # fmt: skip
        gaps[name] = {"max_abs_gap": scorer.sampler_gap(scored, subject.pad_id),
                      "sampled_tokens": sampled(completions)}  # fmt: skip
        print(f"  gap {name}: {gaps[name]['max_abs_gap']:.2e}", flush=True)
    return {"steps": runs, "ratio_bf16_over_float32": ratio(runs, "bf16-mixed", "float32",
                                                             per_token=False),
            "gap": gaps}  # fmt: skip


# --------------------------------------------------------------------------- profile


def bucket(event: Any) -> str:
    """The bucket of a profiler event, by its own name and those of its callers."""
    names, e = [], event
    while e is not None:
        names.append(e.name)
        e = e.cpu_parent
    lowered = [n.lower() for n in names]
    if any(n.startswith("Optimizer.") for n in names):
        return "optimizer"
    if any("scaled_dot_product" in n or "attention" in n for n in lowered):
        return "attention"
    if any("softmax" in n for n in lowered):
        return "softmax (vocabulary)"
    if any(n.startswith(op) for n in names for op in MATMUL_OPS):
        return "matmul/linear"
    if any(op in lowered[0] for op in SAMPLING_OPS):
        return "sampling"
    return "other"


def profiled(fn: Callable[[], Any]) -> dict[str, Any]:
    """``fn`` under torch's CPU profiler: the top 15 ops by self CPU time, the buckets."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = list(prof.events())
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    shares = dict.fromkeys(BUCKETS, 0.0)
    for e in events:
        shares[bucket(e)] += e.self_cpu_time_total / total
    top = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:15]
    return {
        "self_cpu_ms": total / 1000,
        "top": [{"op": a.key, "self_cpu_ms": a.self_cpu_time_total / 1000,
                 "share": a.self_cpu_time_total / total, "calls": a.count} for a in top],
        "buckets": shares,
    }  # fmt: skip


def profile_section(subject: Subject, args: argparse.Namespace) -> dict[str, Any]:
    """One TorchBackend batch of the sampler's requests and one learner step, profiled."""
    requests = sampler_requests(subject.prompts, args.prompts * args.samples, args)
    backend = TorchBackend(subject.model, subject.tokenizer)
    backend_sample(backend, requests)  # warm-up
    samples, advantages = update_batch(subject.prompts, subject.vocab, args)
    learn = learner(copy.deepcopy(subject.model), samples, args.temperature)
    learn.step_samples(samples, advantages, pad_id=subject.pad_id)  # warm-up: optimizer state
    return {
        "sampler": profiled(lambda: backend_sample(backend, requests)),
        "update": profiled(lambda: learn.step_samples(samples, advantages, pad_id=subject.pad_id)),
    }


# --------------------------------------------------------------------------- scaling


def random_llama(subject: Subject, shape: dict[str, int]) -> Any:
    """A randomly initialised Llama of ``shape`` with the subject's vocabulary, tied."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = subject.model.config
    config = LlamaConfig(vocab_size=subject.vocab, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=c.bos_token_id,
                         eos_token_id=c.eos_token_id, pad_token_id=subject.pad_id, **shape)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def scaling_models(subject: Subject, args: argparse.Namespace) -> list[tuple[str, Any, Any]]:
    """(label, model, tokenizer): the tiny model turnrl builds, the random Llama and the
    subject; with ``--smoke``, the smoke model and a small random Llama."""
    if args.smoke:
        return [("tiny (--smoke)", subject.model, subject.tokenizer),
                ("random Llama (--smoke shape)", random_llama(subject, SMOKE_LLAMA),
                 subject.tokenizer)]  # fmt: skip
    tiny_dir = args.runs_dir / NAME / "tiny"
    if not (tiny_dir / "config.json").is_file():
        build_tiny_model(tiny_dir, TinyModelConfig(), extra_corpus=search_qa().corpus(),
                         overwrite=True)  # fmt: skip
    return [
        ("tiny (TinyModelConfig())", load_model(tiny_dir), load_tokenizer(tiny_dir)),
        ("random Llama, hidden 384 x 12", random_llama(subject, MID_LLAMA), subject.tokenizer),
        (subject.label, subject.model, subject.tokenizer),
    ]


def scaling_section(subject: Subject, args: argparse.Namespace) -> dict[str, Any]:
    """Step time and sampler tokens/s against model size, the models taking turns."""
    steps: dict[str, Callable[[], int]] = {}
    samplers: dict[str, Callable[[], int]] = {}
    rows = []
    for label, model, tokenizer in scaling_models(subject, args):
        prompts = first_prompts(model, tokenizer, args.prompts)
        vocab = int(model.get_output_embeddings().weight.shape[0])
        samples, advantages = update_batch(prompts, vocab, args)
        learn = learner(copy.deepcopy(model), samples, args.temperature)
        steps[label] = stepper(learn, samples, advantages, int(tokenizer.pad_token_id))
        backend = TorchBackend(model, tokenizer)
        requests = sampler_requests(prompts, args.prompts * args.samples, args)
        samplers[label] = lambda b=backend, r=requests: sampled(backend_sample(b, r))
        c = model.config
        rows.append({"model": label, "parameters": parameters(model), "vocab": vocab,
                     "hidden": c.hidden_size, "layers": c.num_hidden_layers,
                     "update_tokens": batch_tokens(samples)["tokens"]})  # fmt: skip
    print("  update steps", flush=True)
    step_runs = take_turns(steps, args.repeats)
    print("  sampler", flush=True)
    sampler_runs = take_turns(samplers, args.repeats)
    for row in rows:
        s, g = step_runs[row["model"]], sampler_runs[row["model"]]
        row.update({
            "update_step_s": s["wall_s"], "update_step_s_runs": s["wall_s_runs"],
            "update_ns_per_parameter_token": 1e9 * s["wall_s"] / (row["parameters"] * s["tokens"]),
            "sampler_tokens_per_s": g["tokens_per_s"], "sampler_wall_s": g["wall_s"],
            "sampler_ns_per_parameter_token": 1e9 / (g["tokens_per_s"] * row["parameters"]),
        })  # fmt: skip
    return {"rows": rows}


# --------------------------------------------------------------------------- output


def write(args: argparse.Namespace, subject: Subject, results: dict[str, Any]) -> None:
    """The results as JSON and Markdown tables (printed too)."""
    python = Path(sys.executable)
    if python.is_relative_to(ROOT):
        python = python.relative_to(ROOT)
    command = " ".join([f"{python} benchmarks/{NAME}.py", *sys.argv[1:]])
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "model": subject.label,
        "parameters": parameters(subject.model), "machine": platform.machine(), **CPU,
        "commit": COMMIT, "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "repeats": args.repeats, "command": command,
    }  # fmt: skip
    data = {**meta, **results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(data, indent=2))
    lines = [
        f"# turnrl on a real model ({subject.label}): speed against its peers",
        "",
        f"{meta['date']}, {meta['cpu']} ({', '.join(meta['cpu_flags'])}), {meta['cores']} "
        f"cores, {meta['torch_threads']} torch threads, torch {meta['torch']}, commit "
        f"{meta['commit']}; {subject.label} ({meta['parameters']:,} parameters, float32). "
        f"Medians of {args.repeats} rounds, the variants in turn; ratios per round, then "
        f"medianed. `{command}`",
    ]
    for name in SECTIONS:
        lines += ["", f"## {name}", ""]
        result = results[name]
        if "skipped" in result or "error" in result:
            lines.append(f"{'skipped' if 'skipped' in result else 'failed'}: "
                         f"{result.get('skipped') or result.get('error')}")  # fmt: skip
        else:
            lines += SECTION_LINES[name](result)
        c = result.get("conditions")
        if c:
            lines += ["", f"Load average {c['load_before'][0]:.2f} before, "
                      f"{c['load_after'][0]:.2f} after; {c['torch_threads']} torch threads; "
                      f"{result['section_s']:.0f} s."]  # fmt: skip
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def fmt_ratio(r: dict[str, Any] | None) -> str:
    return "n/a" if r is None else f"{r['median']:.2f}x"


def runs_table(runs: dict[str, dict[str, Any]], unit: str = "sampled tok/s") -> list[str]:
    lines = [f"| variant | wall s (median) | {unit} | rounds |", "|---|---|---|---|"]
    for name, r in runs.items():
        count = sum(w is not None for w in r["wall_s_runs"])
        lines.append(f"| {name} | {r['wall_s']:.3f} | {r['tokens_per_s']:,.0f} | {count} |")
    return lines


def sampler_lines(r: dict[str, Any]) -> list[str]:
    lines = [
        f"{r['requests']} requests ({r['prompts']} search_qa first-turn prompts of "
        f"{min(r['prompt_tokens'])}-{max(r['prompt_tokens'])} tokens x {r['samples_per_prompt']} "
        f"samples), {r['new_tokens']} new tokens each, temperature {r['temperature']}.",
        "", *runs_table(r["samplers"]), "",
        f"turnrl-torch / HF generate (16 at once): **{fmt_ratio(r['ratios']['torch_over_hf16'])}**"
        f" (target 1.5x); / HF generate one at a time: {fmt_ratio(r['ratios']['torch_over_hf1'])}.",
    ]  # fmt: skip
    if "skipped" in r["vllm"]:
        lines.append(f"vLLM: skipped ({r['vllm']['skipped']}).")
    else:
        lines.append(
            f"turnrl-vLLM / raw vLLM: **{fmt_ratio(r['ratios']['vllm_over_raw'])}** (target 1x);"
            f" / raw vLLM without detokenizing: {fmt_ratio(r['ratios']['vllm_over_raw_ids'])}; "
            f"vLLM {r['vllm']['version']}, engine start {r['vllm']['engine_startup_s']:.1f} s."
        )
    lines += [
        "",
        "Requests at once (sampled tokens/s):",
        "",
        "| requests | turnrl-torch | turnrl-vllm | vllm / torch |",
        "|---|---|---|---|",
    ]
    for row in r["concurrency"]["rows"]:
        s = row["samplers"]
        vllm = f"{s['turnrl-vllm']['tokens_per_s']:,.0f}" if "turnrl-vllm" in s else "n/a"
        lines.append(f"| {row['requests']} | {s['turnrl-torch']['tokens_per_s']:,.0f} | {vllm} "
                     f"| {fmt_ratio(row.get('vllm_over_torch'))} |")  # fmt: skip
    lines += ["", f"Crossover: {r['concurrency']['crossover']}."]
    sync = r["sync"]
    if "skipped" in sync:
        lines.append(f"Weight sync: skipped ({sync['skipped']}).")
    else:
        lines.append(f"Weight sync (`VLLMBackend.load_weights`, {sync['state_dict_bytes'] / 1e6:.0f}"
                     f" MB): {sync['load_weights_s'] * 1000:.0f} ms (median).")  # fmt: skip
    return lines


def memory_lines(memory: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        "| variant | baseline RSS MB | peak RSS MB | peak growth MB | per episode MB "
        "| per episode, gradients aside MB | left after step MB | of it, gradients kept MB "
        "| vocab-wide float32 tensors alive after |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in memory.items():
        if "error" in m:
            lines.append(f"| {name} | failed: {m['error'][:120]} | | | | | | | |")
            continue
        v = m["vocabulary_tensors_after_step"]
        alive = f"{v['count']} ({v['bytes'] / 1e6:.1f} MB)" + ("" if v["probe_found"]
                                                                 else ", scan blind")  # fmt: skip
        lines.append(
            f"| {name} | {m['baseline_rss_mb']:.0f} | {m['peak_rss_mb']:.0f} | "
            f"{m['peak_growth_mb']:.0f} | {m['per_episode_mb']:.1f} | "
            f"{m['per_episode_without_gradients_mb']:.1f} | {m['left_after_step_mb']:.0f} | "
            f"{m['gradients_kept_mb']:.0f} | {alive} |"
        )
    return lines


def update_lines(r: dict[str, Any]) -> list[str]:
    b, c, e = r["batch"], r["config"], r["estimate_bytes"]
    return [
        f"{b['samples']} samples ({b['groups']} groups of {b['group_size']}, prompts of "
        f"{b['prompt_tokens']} tokens, completions of {b['completion_tokens'][0]}-"
        f"{b['completion_tokens'][1]}): {b['tokens']} tokens, {b['trained_tokens']} trained, "
        f"{b['padded_cells']} padded cells; lr {c['lr']}, KL {c['kl_coef']}, one micro-batch "
        f"of {c['micro_batch_size']} (layout {c['layout']}).",
        "", *runs_table(r["steps"], "tokens/s"), "",
        f"turnrl / bare step with the output layer on the trained positions only (bare-sliced):"
        f" **{fmt_ratio(r['ratio_turnrl_over_bare_sliced'])}** (target at most 1.2x); "
        f"turnrl / bare step with the output layer everywhere: "
        f"{fmt_ratio(r['ratio_turnrl_over_bare'])}. Reference forward, turnrl / bare-sliced: "
        f"{fmt_ratio(r['ratio_reference_turnrl_over_bare_sliced'])}; turnrl / bare: "
        f"{fmt_ratio(r['ratio_reference_turnrl_over_bare'])}.",
        "", "Memory (each variant in a fresh process; growth over model + optimizer state):",
        "", *memory_lines(r["memory"]), "",
        f"For scale: parameters {e['parameters'] / 1e6:.0f} MB, AdamW state "
        f"{e['adamw_state'] / 1e6:.0f} MB, gradients {e['gradients'] / 1e6:.0f} MB; float32 "
        f"logits over the trained tokens {e['logits_trained_tokens'] / 1e6:.0f} MB, over every "
        f"position {e['logits_all_positions'] / 1e6:.0f} MB.",
    ]  # fmt: skip


def lora_lines(r: dict[str, Any]) -> list[str]:
    lo = r["lora"]
    return [
        f"LoRA rank {lo['rank']}, alpha {lo['alpha']}, {', '.join(lo['target_modules'])}: "
        f"{r['trainable_parameters']:,} trainable of {r['parameters']:,}.",
        "", *runs_table(r["steps"], "tokens/s"), "",
        f"LoRA / full step: **{fmt_ratio(r['ratio_lora_over_full'])}**.", "",
        *memory_lines(r["memory"]),
    ]  # fmt: skip


def bf16_lines(r: dict[str, Any]) -> list[str]:
    lines = [*runs_table(r["steps"], "tokens/s"), "",
             f"bf16-mixed / float32 step: **{fmt_ratio(r['ratio_bf16_over_float32'])}**.", "",
             "| sampler / learner | max abs log-prob gap | sampled tokens |", "|---|---|---|"]  # fmt: skip
    for name, g in r["gap"].items():
        lines.append(f"| {name} | {g['max_abs_gap']:.2e} | {g['sampled_tokens']} |")
    return lines


def profile_lines(r: dict[str, Any]) -> list[str]:
    lines = ["| part | " + " | ".join(BUCKETS) + " |", "|---" * (len(BUCKETS) + 1) + "|"]
    for part in ("sampler", "update"):
        shares = r[part]["buckets"]
        lines.append(f"| {part} | " + " | ".join(f"{shares[b]:.0%}" for b in BUCKETS) + " |")
    for part in ("sampler", "update"):
        lines += ["", f"Top ops, {part} ({r[part]['self_cpu_ms']:.0f} ms self CPU in all):", "",
                  "| op | self ms | share | calls |", "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {t['op']} | {t['self_cpu_ms']:.1f} | {t['share']:.1%} | {t['calls']} |"
                  for t in r[part]["top"]]  # fmt: skip
    return lines


def scaling_lines(r: dict[str, Any]) -> list[str]:
    lines = ["| model | parameters | hidden x layers | vocab | update step s | ns / (param x "
             "token), update | sampler tok/s | ns / (param x token), sampler |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in r["rows"]:
        lines.append(
            f"| {row['model']} | {row['parameters']:,} | {row['hidden']} x {row['layers']} | "
            f"{row['vocab']:,} | {row['update_step_s']:.3f} | "
            f"{row['update_ns_per_parameter_token']:.4f} | {row['sampler_tokens_per_s']:,.0f} | "
            f"{row['sampler_ns_per_parameter_token']:.3f} |"
        )
    return lines


SECTION_LINES: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "sampler": sampler_lines, "update": update_lines, "lora": lora_lines, "bf16": bf16_lines,
    "profile": profile_lines, "scaling": scaling_lines,
}  # fmt: skip


# --------------------------------------------------------------------------- main

SECTION_RUNS: dict[str, Callable[[Subject, argparse.Namespace], dict[str, Any]]] = {
    "sampler": sampler_section, "update": update_section, "lora": lora_section,
    "bf16": bf16_section, "profile": profile_section, "scaling": scaling_section,
}  # fmt: skip


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> None:
    if sys.argv[1:2] == [CHILD]:
        memory_child(Path(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="named model or checkpoint")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds")
    parser.add_argument("--single-repeats", type=int, default=2,
                        help="rounds of HF generate one request at a time")  # fmt: skip
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    parser.add_argument("--prompts", type=int, default=4, help="tasks (groups)")
    parser.add_argument("--samples", type=int, default=4, help="samples per task")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--concurrency", type=ints, default=[16, 64, 256])
    parser.add_argument("--prompt-tokens", type=int, default=300, help="update batch prompts")
    parser.add_argument("--completion-tokens", type=ints, default=[40, 100],
                        help="update batch completions, LOW,HIGH tokens")  # fmt: skip
    smoke = {"repeats": 1, "single_repeats": 1, "new_tokens": 4, "concurrency": [4, 8],
             "prompt_tokens": 48, "completion_tokens": [4, 8]}  # fmt: skip
    args = parse_args(parser, NAME, smoke, runs=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    subject = load_subject(args)
    results = {
        name: run_section(name, lambda name=name: SECTION_RUNS[name](subject, args))
        if name in args.sections else {"skipped": "not asked for (--sections)"}
        for name in SECTIONS
    }  # fmt: skip
    write(args, subject, results)


if __name__ == "__main__":
    main()
