"""``turnrl doctor``: what this machine offers turnrl, and a short self-check that the
main path works here.

It reports versions (Python, turnrl, torch and the libraries it builds on), devices (CPU
cores, CUDA GPUs), the code sandbox (bubblewrap, or the rlimit fallback and why), and which
optional extras are importable (vllm, lora, agents, ray, wandb, mcp). The self-check (about 10 seconds
on a laptop CPU) runs the real pieces on a throwaway tiny model: a two-step RL run on the
secret-lookup probe (model build, warm-up, rollouts, learner steps, checkpoint, report),
one call in the sandboxed interpreter, and one BM25 search. Each line says ok or FAIL with
the reason; the command exits 1 if anything failed.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "bm25s",
            "tensorboardX")  # fmt: skip
EXTRAS = {
    "vllm": "vllm", "lora": "peft", "agents": "aiohttp", "ray": "ray", "wandb": "wandb",
    "mcp": "mcp",
}  # fmt: skip
SELF_CHECK_RUN = [  # two RL steps on the probe with the smallest model: seconds on a CPU
    "steps=2", "save_every=2", "max_minutes=0", "model.tiny.hidden_size=32",
    "model.tiny.num_layers=1", "model.tiny.num_heads=2", "model.tiny.vocab_size=512",
    "model.tiny.echo_steps=0",
    "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_tokens_per_turn=24",
    "warmup.steps=2", "warmup.batch_size=4", "eval.every=2", "eval.num_tasks=4",
]  # fmt: skip


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def facts() -> list[str]:
    """Versions, devices, sandbox and extras, one line each."""
    import torch

    lines = [
        f"python        {platform.python_version()} ({platform.machine()}, {platform.system()})",
        f"turnrl        {_version('turnrl')}",
        *(f"{name:<13} {_version(name)}" for name in PACKAGES),
        f"cpu cores     {os.cpu_count()} (torch threads {torch.get_num_threads()})",
    ]
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        lines.append(f"cuda          {torch.version.cuda}: {', '.join(names)}")
        free, total = torch.cuda.mem_get_info(0)
        lines.append(f"gpu memory    {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB")
    else:
        lines.append("cuda          none (CPU training; model.device auto = cpu)")
    lines.extend(_learner_lines(torch))
    lines += [f"sandbox       {line}" for line in _sandbox_lines()]
    for extra, module in EXTRAS.items():
        try:
            importlib.import_module(module)
            state = f"yes ({_version(module)})"
        except Exception as exc:  # missing, or broken on import: say which
            state = "no" if isinstance(exc, ImportError) else f"broken ({type(exc).__name__})"
        lines.append(f"extra {extra:<7} {state}")
    return lines


def _learner_lines(torch: Any) -> list[str]:
    """The learner's GPU-path options (``model.precision``, ``model.attention``,
    ``model.gradient_checkpointing``) and whether this machine can use them."""
    on_gpu = torch.cuda.is_available()
    bf16 = torch.cuda.is_bf16_supported() if on_gpu else True  # CPU autocast takes bf16
    where = "CUDA" if on_gpu else "CPU autocast, slow"
    flash = importlib.util.find_spec("flash_attn") is not None
    sdpa = hasattr(torch.nn.functional, "scaled_dot_product_attention")
    attention = [
        "eager",
        *(["sdpa"] if sdpa else []),
        *(["flash_attention_2"] if flash and on_gpu else []),
    ]
    return [
        "precision     float32 (default; master weights float32); "
        + (f"bf16-mixed available ({where}; master weights stay float32; the torch "
           "sampler holds a bf16 copy, rollout.sampler_weights)" if bf16
           else "bf16-mixed NOT supported by this GPU"),
        f"attention     {', '.join(attention)} (auto = transformers' default)"
        + ("" if flash else "; flash_attention_2 needs flash-attn and CUDA"),
        "checkpointing gradient checkpointing available (non-reentrant)",
    ]  # fmt: skip


def _sandbox_lines() -> list[str]:
    """The sandbox's mode, then one line per limit this machine cannot enforce."""
    from turnrl.tools import Sandbox
    from turnrl.tools.sandbox import SandboxError

    try:
        sandbox = Sandbox("auto")
    except SandboxError as exc:
        return [f"unavailable: {exc}"]
    if sandbox.isolated:
        first = "bubblewrap (isolating; some limits NOT enforced here, listed below)"
        if not sandbox.unenforced:
            first = "bubblewrap (isolating; syscall filter, cgroup per slot, tmpfs work dir)"
    else:
        first = f"rlimit fallback, does NOT isolate: {sandbox.fallback_reason}"
    return [first, *(f"  {line}" for line in sandbox.unenforced)]


def self_check() -> list[tuple[str, bool, str]]:
    """(name, ok, detail) for each piece of the self-check."""
    results = []
    for name, check in (
        ("rl run", _check_training),
        ("sandbox call", _check_sandbox),
        ("bm25 search", _check_search),
    ):
        t0 = time.perf_counter()
        try:
            detail = check()
            results.append((name, True, f"{detail} ({time.perf_counter() - t0:.1f} s)"))
        except Exception as exc:
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()
            results.append((name, False, last))
    return results


def _check_training() -> str:
    from turnrl.trainer.config import load_config
    from turnrl.trainer.loop import train

    with tempfile.TemporaryDirectory(prefix="turnrl-doctor-") as tmp:
        run_dir = Path(tmp) / "run"
        result = train(load_config("quickstart", SELF_CHECK_RUN), run_dir, progress=False)
        steps = [r for r in result.rows if "loss/policy" in r or "train/grad_norm" in r]
        missing = [f for f in ("metrics.jsonl", "trajectories.jsonl", "config.json")
                   if not (run_dir / f).exists()]  # fmt: skip
        if missing:
            raise RuntimeError(f"the run directory lacks {', '.join(missing)}")
        if not (run_dir / "checkpoints").exists():
            raise RuntimeError("no checkpoint was written")
        return f"{len(steps)} learner steps, checkpoint written"


def _check_sandbox() -> str:
    from turnrl.tools import PythonInterpreter, Sandbox

    async def run() -> str:
        sandbox = Sandbox("auto")
        async with PythonInterpreter(sandbox, timeout_s=10) as interp:
            result = await interp.run("x = 6 * 7\nx")
        if "42" not in result.text:
            raise RuntimeError(f"expected 42, got {result.text!r}")
        return "bubblewrap" if sandbox.isolated else "rlimit fallback (no isolation)"

    return asyncio.run(run())


def _check_search() -> str:
    from turnrl.tools import SearchIndex

    index = SearchIndex(["the cat sat on the mat", "paris is the capital of france"])
    hits = index.search("capital of france", k=1)
    if not hits or hits[0].document.id != "1":
        raise RuntimeError("BM25 did not rank the matching document first")
    return "ranked the matching document first"


def run(echo: Callable[[str], None] = print) -> bool:
    """Print the facts and the self-check; True if every check passed."""
    for line in facts():
        echo(line)
    echo("")
    echo("self-check:")
    ok = True
    for name, passed, detail in self_check():
        ok &= passed
        echo(f"  {'ok  ' if passed else 'FAIL'} {name}: {detail}")
    return ok
