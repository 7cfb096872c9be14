"""A batched sampler for a Hugging Face causal LM, in torch, with a KV cache.

One ``generate`` call takes a batch of requests from many episodes (left-padded into one
tensor), prefills them in one forward pass, then decodes one token per step for all rows
with the cache. Each request has its own seed, so a sample does not depend on which other
requests shared its batch. Log-probabilities are those of the distribution each token was
drawn from (temperature applied, before top-p), which is what the learner recomputes.

All torch work runs on one thread: ``run(program)`` drives an asyncio program (the
episodes, their tools) on a helper thread while the calling thread serves its ``generate``
calls. Torch's CPU thread pool belongs to the thread that uses it; a second thread doing
torch work brings a second pool that competes with the first for the same cores
(generation ran 2x slower from a worker thread than from the main thread, measured).

Across turns, an episode's history is not encoded again: after each call the keys and
values of every row are kept (``PrefixCache``, valid for one policy version), and a later
request that extends a kept sequence runs only its new tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import torch
from transformers import DynamicCache

from turnrl.backends.prefix_cache import LayerKV, PrefixCache
from turnrl.types import Completion, FinishReason, GenerationRequest

T = TypeVar("T")

MIN_SHARED_PREFIX = 8
"""Shortest common prompt prefix worth computing once for the whole batch."""


class TorchBackend:
    """Samples from a causal LM held in this process (CPU or one GPU).

    ``model`` is shared with the learner in the single-process loop: weight sync is free,
    and ``policy_version`` is bumped by the trainer after each optimizer step.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_batch_size: int = 256,
        reuse_history: bool = True,
        max_cached_tokens: int = 1 << 20,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.policy_version = 0
        pad = tokenizer.pad_token_id
        self.pad_id: int = int(pad if pad is not None else tokenizer.eos_token_id)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self._lock = threading.Lock()
        self.prefix_cache = PrefixCache(max_cached_tokens) if reuse_history else None
        self._jobs: queue.SimpleQueue[_Job | None] | None = None

    def _share(
        self, requests: Sequence[GenerationRequest], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, Any, int]:
        """Prefill inputs when no history is cached: the batch's common prompt prefix
        (system prompt, tools, often a group's whole question) runs once and its cache is
        repeated for every row. Layout: [shared prefix][left padding][rest of the prompt]."""
        B = len(requests)
        shared = _common_prefix([r.prompt_ids for r in requests]) if B > 1 else 0
        if shared < MIN_SHARED_PREFIX:
            shared = 0
        input_ids, attn = _padded(requests, [shared] * B, self.pad_id, shared)
        attn[:, :shared] = 1
        past = None
        if shared:
            head = self.model(
                input_ids=torch.tensor([requests[0].prompt_ids[:shared]], device=device),
                use_cache=True,
            )
            past = head.past_key_values
            past.batch_repeat_interleave(B)
        return input_ids.to(device), attn.to(device), past, shared

    def _reuse(
        self,
        requests: Sequence[GenerationRequest],
        hits: Sequence[tuple[int, list[LayerKV]] | None],
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor, Any, int]:
        """Prefill inputs when some rows continue a cached history. Layout: [left padding]
        [row's cached tokens] [left padding][row's new tokens]; only the new tokens run.
        Rows without a hit have an empty cached part."""
        B = len(requests)
        cached = [h[0] if h is not None else 0 for h in hits]
        width = max(cached)
        input_ids, attn = _padded(requests, cached, self.pad_id, width)
        layers = next(h[1] for h in hits if h is not None)
        past = DynamicCache()
        for layer, (k0, v0) in enumerate(layers):
            keys = k0.new_zeros((B, k0.shape[0], width, k0.shape[2]))
            values = v0.new_zeros((B, v0.shape[0], width, v0.shape[2]))
            for i, h in enumerate(hits):
                if h is not None:
                    n = h[0]
                    keys[i, :, width - n :] = h[1][layer][0]
                    values[i, :, width - n :] = h[1][layer][1]
            past.update(keys, values, layer)
        for i, n in enumerate(cached):
            attn[i, width - n : width] = 1
        return input_ids.to(device), attn.to(device), past, width

    def _store(
        self,
        requests: Sequence[GenerationRequest],
        tokens: Sequence[Sequence[int]],
        past: Any,
        attn: torch.Tensor,
    ) -> None:
        """Keep each row's keys and values (the real positions of the batch cache: its
        prompt and every sampled token that was fed back, i.e. all but the last)."""
        assert self.prefix_cache is not None
        kept = attn[:, : past.get_seq_length()].bool()
        for i, (r, out) in enumerate(zip(requests, tokens, strict=True)):
            seq = (*r.prompt_ids, *out[:-1])
            rows = kept[i].nonzero().squeeze(-1)
            if len(rows) != len(seq):  # not the expected layout: do not guess
                continue
            layers = [
                (layer.keys[i][:, rows].clone(), layer.values[i][:, rows].clone())
                for layer in past.layers
            ]
            self.prefix_cache.put(seq, layers)

    def _stop_strings(
        self, requests: Sequence[GenerationRequest], tokens: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """Rows whose recent text contains one of their stop strings."""
        hits = torch.zeros(len(requests), dtype=torch.bool, device=tokens.device)
        for i, r in enumerate(requests):
            if r.stop_strings:
                n = int(lengths[i])
                tail = self.tokenizer.decode(tokens[i, max(0, n - 16) : n].tolist())
                hits[i] = any(s in tail for s in r.stop_strings)
        return hits

    def run(self, program: Coroutine[Any, Any, T]) -> T:
        """Run the asyncio ``program`` to completion and return its result.

        The program's event loop (episodes, tool calls) runs on a helper thread; this
        thread computes every ``generate`` it asks for, so tools keep running during
        generation and all torch work stays on the calling thread."""
        if self._jobs is not None:
            raise RuntimeError("TorchBackend.run is already running")
        jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        outcome: dict[str, Any] = {}

        def drive() -> None:
            try:
                outcome["value"] = asyncio.run(program)
            except BaseException as exc:  # re-raised on the calling thread
                outcome["error"] = exc
            finally:
                jobs.put(None)

        self._jobs = jobs
        helper = threading.Thread(target=drive, name="turnrl-episodes", daemon=True)
        helper.start()
        try:
            while (job := jobs.get()) is not None:
                job.serve(self.generate_sync)
        finally:
            self._jobs = None
        helper.join()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]  # type: ignore[no-any-return]

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        """Sample every request. Inside ``run`` the calling thread of ``run`` computes it;
        otherwise a worker thread does (slower on CPU, see the module docstring)."""
        jobs = self._jobs
        if jobs is None:
            return await asyncio.to_thread(self.generate_sync, requests)
        job = _Job(list(requests), asyncio.get_running_loop())
        jobs.put(job)
        return await job.future

    def generate_sync(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        out: list[Completion] = []
        with self._lock:
            for start in range(0, len(requests), self.max_batch_size):
                out.extend(self._generate_batch(requests[start : start + self.max_batch_size]))
        return out

    @torch.no_grad()
    def _generate_batch(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        if not requests:
            return []
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        try:
            return self._decode(requests, device)
        finally:
            self.model.train(was_training)

    def _decode(
        self, requests: Sequence[GenerationRequest], device: torch.device
    ) -> list[Completion]:
        B = len(requests)
        lengths = [len(r.prompt_ids) for r in requests]
        if min(lengths) == 0:
            raise ValueError("a generation request has an empty prompt")
        hits: list[tuple[int, list[LayerKV]] | None] = [None] * B
        if self.prefix_cache is not None:
            self.prefix_cache.sync(self.policy_version)
            hits = [self.prefix_cache.longest_prefix(r.prompt_ids) for r in requests]
        if any(h is not None for h in hits):
            input_ids, attn, past, cached = self._reuse(requests, hits, device)
        else:
            input_ids, attn, past, cached = self._share(requests, device)
        positions = (attn.cumsum(-1) - 1).clamp(min=0)[:, cached:]

        # Each request draws its uniforms from its own seed: a sample does not depend on
        # which other requests share the batch. Inverse-CDF sampling, vectorised over rows.
        budgets = torch.tensor([max(0, r.max_new_tokens) for r in requests])
        max_new = int(budgets.max())
        uniforms = torch.stack(
            [torch.rand(max_new, generator=torch.Generator().manual_seed(r.seed)) for r in requests]
        ).to(device)
        temps = torch.tensor([r.temperature for r in requests], device=device)[:, None]
        top_ps = torch.tensor([r.top_p for r in requests], device=device)[:, None]
        stop_table = torch.zeros((B, self.vocab_size), dtype=torch.bool, device=device)
        for i, r in enumerate(requests):
            stop_table[i, [t for t in r.stop_token_ids if 0 <= t < self.vocab_size]] = True
        out_tokens = torch.full((B, max_new), self.pad_id, dtype=torch.long, device=device)
        out_logps = torch.zeros((B, max_new), device=device)
        lengths_out = torch.zeros(B, dtype=torch.long, device=device)
        stopped = torch.zeros(B, dtype=torch.bool, device=device)
        live = budgets.to(device) > 0
        rows = torch.arange(B, device=device)

        out = self.model(
            input_ids=input_ids,
            attention_mask=attn,
            position_ids=positions,
            past_key_values=past,
            use_cache=True,
        )
        past = out.past_key_values
        next_pos = positions[:, -1:] + 1
        for step in range(max_new):
            logits = out.logits[:, -1, :].float()
            tok, logp = _sample(logits, temps, top_ps, uniforms[:, step])
            tok = torch.where(live, tok, self.pad_id)
            out_tokens[:, step] = tok
            out_logps[:, step] = torch.where(live, logp, 0.0)
            lengths_out += live.long()
            hit_stop = live & stop_table[rows, tok]
            if any(r.stop_strings for r in requests):
                hit_stop |= live & self._stop_strings(requests, out_tokens, lengths_out)
            stopped |= hit_stop
            live = live & ~hit_stop & (lengths_out < budgets.to(device))
            if not bool(live.any()):
                break
            attn = torch.cat([attn, live[:, None].long()], dim=1)
            out = self.model(
                input_ids=tok[:, None],
                attention_mask=attn,
                position_ids=next_pos,
                past_key_values=past,
                use_cache=True,
            )
            past = out.past_key_values
            next_pos = next_pos + 1

        n_out = lengths_out.tolist()
        tokens = [out_tokens[i, : n_out[i]].tolist() for i in range(B)]
        if self.prefix_cache is not None:
            self._store(requests, tokens, past, attn)
        logps = [out_logps[i, : n_out[i]].tolist() for i in range(B)]
        finish: list[FinishReason] = ["stop" if s else "length" for s in stopped.tolist()]
        return [
            Completion(
                token_ids=tuple(tokens[i]),
                logprobs=tuple(logps[i]),
                finish_reason=finish[i],
                text=self.tokenizer.decode(tokens[i], skip_special_tokens=False),
            )
            for i in range(B)
        ]


class _Job:
    """One ``generate`` call handed from the episodes' event loop to the torch thread."""

    def __init__(self, requests: list[GenerationRequest], loop: asyncio.AbstractEventLoop):
        self.requests = requests
        self.loop = loop
        self.future: asyncio.Future[list[Completion]] = loop.create_future()

    def serve(self, compute: Any) -> None:
        try:
            result = compute(self.requests)
        except Exception as exc:
            self._settle(None, exc)
        else:
            self._settle(result, None)

    def _settle(self, result: list[Completion] | None, error: Exception | None) -> None:
        def settle() -> None:
            if self.future.done():  # the episode was cancelled meanwhile
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(result)  # type: ignore[arg-type]

        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits for this
            self.loop.call_soon_threadsafe(settle)


def _padded(
    requests: Sequence[GenerationRequest], starts: Sequence[int], pad_id: int, head: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prompt from ``starts[i]`` on, left-padded into ``[B, L]`` ids, and a ``[B, head
    + L]`` attention mask whose first ``head`` columns are left for the caller to fill."""
    rest = [len(r.prompt_ids) - s for r, s in zip(requests, starts, strict=True)]
    width = max(rest)
    input_ids = torch.full((len(requests), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(requests), head + width), dtype=torch.long)
    for i, (r, s, n) in enumerate(zip(requests, starts, rest, strict=True)):
        input_ids[i, width - n :] = torch.tensor(r.prompt_ids[s:], dtype=torch.long)
        attn[i, head + width - n :] = 1
    return input_ids, attn


def _common_prefix(prompts: Sequence[Sequence[int]]) -> int:
    """Leading tokens all ``prompts`` share, leaving each at least one token of its own."""
    first = prompts[0]
    limit = min(len(p) for p in prompts) - 1
    n = 0
    while n < limit and all(p[n] == first[n] for p in prompts):
        n += 1
    return n


def _sample(
    logits: torch.Tensor, temps: torch.Tensor, top_ps: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` [B, V] by inverse CDF with uniforms ``u`` [B].

    Returns the tokens and their log-probs under the temperature-scaled distribution
    (before top-p truncation). Temperature 0 is greedy; its log-prob is at temperature 1.
    """
    greedy = temps <= 0.0
    logprobs = torch.log_softmax(logits / torch.where(greedy, 1.0, temps), dim=-1)
    probs = logprobs.exp()
    if bool((top_ps < 1.0).any()):
        probs, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        probs = torch.where((probs.cumsum(-1) - probs) < top_ps, probs, 0.0)
    else:
        order = None
    cdf = probs.cumsum(-1)
    target = (u[:, None] * cdf[:, -1:]).clamp(max=cdf[:, -1:] * (1 - 1e-7))
    tok = torch.searchsorted(cdf, target).clamp(max=logits.shape[-1] - 1)
    if order is not None:
        tok = order.gather(-1, tok)
    tok = tok.squeeze(-1)
    if bool(greedy.any()):
        tok = torch.where(greedy.squeeze(-1), logits.argmax(-1), tok)
    return tok, logprobs.gather(-1, tok[:, None]).squeeze(-1)
