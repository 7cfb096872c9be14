"""Continuous batching: one running decode batch that requests join and leave at any step.

``DecodeBatch`` holds the rows being sampled, their key/value cache (left-padded to a
common width), their attention mask and the logits of their next token. Each ``step``
samples one token for every row; rows that stop leave the batch at once (their
completion is delivered right away, their history kept for the next turn), and the
others feed their new token in one forward pass. ``admit`` prefills new requests (only
the tokens no kept history covers) and merges them into the running batch, so an
episode back from its tool call does not wait for the rest of the batch to finish.

Each row draws its uniforms from its own seed, so its tokens do not depend on which other
rows share a step (to float rounding of the batched forward; the backend's lockstep makes
even that reproducible). Decode steps append keys and values in place (``GrowingLayer``);
the cache is copied only when rows join or leave.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from turnrl.backends.hf_cache import cache_kwargs, returned_cache
from turnrl.types import Completion, FinishReason, GenerationRequest

Prefill = tuple[list[int], torch.Tensor, torch.Tensor, Any, int]
"""One prefill forward: which of the requests it covers, their input ids, attention mask,
the cache of any kept history, and how many columns that cache spans."""


class Waiter(Protocol):
    """Who receives one request's completion (or the error that ended it)."""

    def deliver(self, completion: Completion) -> None: ...

    def fail(self, error: Exception) -> None: ...


@dataclass
class _Row:
    request: GenerationRequest
    waiter: Waiter
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class DecodeBatch:
    """The running batch of one backend. Not thread-safe: one thread drives it.

    ``prefill(requests)`` is the backend's: the prefill forwards for new requests (each
    covering some of them: ids, mask, cache of any kept history, cached width).
    ``store(request, tokens, layers)`` keeps a finished row's history for its next turn.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        vocab_size: int,
        prefill: Callable[[Sequence[GenerationRequest]], list[Prefill]],
        store: Callable[
            [GenerationRequest, list[int], list[tuple[torch.Tensor, torch.Tensor]]], None
        ]
        | None,
        version: Callable[[], int] | None = None,
    ) -> None:
        self.model = model
        self._version = version
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._prefill = prefill
        self._store = store
        self.rows: list[_Row] = []
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []  # [B, H, W, D] each
        self.cache: Any = None  # a DynamicCache holding ``layers``; None once they change
        self.attn = torch.zeros((0, 0), dtype=torch.long)  # [B, W]
        self.logits = torch.zeros((0, vocab_size))  # [B, V]: each row's next-token logits
        self.uniforms = torch.zeros((0, 0))  # [B, max_new]
        self.temps = torch.zeros((0, 1))
        self.top_ps = torch.zeros((0, 1))
        self.stop_table = torch.zeros((0, vocab_size), dtype=torch.bool)
        self.forwards = 0
        """Forward passes run (prefills and decode steps), for tests and benchmarks."""
        self._finished: list[Waiter] = []

    def __len__(self) -> int:
        return len(self.rows)

    def take_finished(self) -> list[Waiter]:
        """The waiters whose requests ended since the last call."""
        done, self._finished = self._finished, []
        return done

    def clear(self) -> None:
        """Forget every row (after a failure: their waiters were told)."""
        self._select([])

    @property
    def device(self) -> torch.device:
        device: torch.device = next(self.model.parameters()).device
        return device

    # ------------------------------------------------------------------ joining

    def admit(self, items: Sequence[tuple[GenerationRequest, Waiter]]) -> None:
        """Prefill ``items``' requests (one forward per part the backend plans) and add
        them to the batch. A request with an empty prompt fails alone; one with no token
        budget is done."""
        live = []
        for request, waiter in items:
            if not request.prompt_ids:
                waiter.fail(ValueError("a generation request has an empty prompt"))
            elif request.max_new_tokens <= 0:
                waiter.deliver(self._completion(_Row(request, waiter), "length"))
                self._finished.append(waiter)
            else:
                live.append((request, waiter))
        if not live:
            return
        requests = [r for r, _ in live]
        for part, input_ids, attn, past, cached in self._prefill(requests):
            self._admit_part([live[i] for i in part], input_ids, attn, past, cached)

    def _admit_part(
        self,
        live: list[tuple[GenerationRequest, Waiter]],
        input_ids: torch.Tensor,
        attn: torch.Tensor,
        past: Any,
        cached: int,
    ) -> None:
        device = self.device
        requests = [r for r, _ in live]
        positions = (attn.cumsum(-1) - 1).clamp(min=0)[:, cached:]
        out = self.model(
            input_ids=input_ids,
            attention_mask=attn,
            position_ids=positions,
            use_cache=True,
            **cache_kwargs(self.model, past),
        )
        self.forwards += 1
        layers = [(layer.keys, layer.values) for layer in returned_cache(out).layers]
        width = max(r.max_new_tokens for r in requests)
        uniforms = torch.stack(
            [
                _pad_right(
                    torch.rand(r.max_new_tokens, generator=torch.Generator().manual_seed(r.seed)),
                    width,
                )
                for r in requests
            ]
        ).to(device)
        stop = torch.zeros((len(requests), self.vocab_size), dtype=torch.bool, device=device)
        for i, r in enumerate(requests):
            stop[i, [t for t in r.stop_token_ids if 0 <= t < self.vocab_size]] = True
        self._merge(
            rows=[_Row(r, w) for r, w in live],
            layers=layers,
            attn=attn.to(device),
            logits=out.logits[:, -1, :].float(),
            uniforms=uniforms,
            temps=torch.tensor([[r.temperature] for r in requests], device=device),
            top_ps=torch.tensor([[r.top_p] for r in requests], device=device),
            stop_table=stop,
        )

    def _merge(self, *, rows: list[_Row], layers: list[tuple[torch.Tensor, torch.Tensor]],
               attn: torch.Tensor, logits: torch.Tensor, uniforms: torch.Tensor,
               temps: torch.Tensor, top_ps: torch.Tensor, stop_table: torch.Tensor) -> None:  # fmt: skip
        self.cache = None
        if not self.rows:
            self.rows, self.layers, self.attn, self.logits = rows, layers, attn, logits
            self.uniforms, self.temps, self.top_ps, self.stop_table = (
                uniforms, temps, top_ps, stop_table,
            )  # fmt: skip
            return
        width = max(self.attn.shape[1], attn.shape[1])
        self.layers = [
            (
                torch.cat([_pad_left(k0, width, 2), _pad_left(k1, width, 2)]),
                torch.cat([_pad_left(v0, width, 2), _pad_left(v1, width, 2)]),
            )
            for (k0, v0), (k1, v1) in zip(self.layers, layers, strict=True)
        ]
        self.attn = torch.cat([_pad_left(self.attn, width, 1), _pad_left(attn, width, 1)])
        steps = max(self.uniforms.shape[1], uniforms.shape[1])
        self.uniforms = torch.cat([_pad_right(self.uniforms, steps), _pad_right(uniforms, steps)])
        self.logits = torch.cat([self.logits, logits])
        self.temps = torch.cat([self.temps, temps])
        self.top_ps = torch.cat([self.top_ps, top_ps])
        self.stop_table = torch.cat([self.stop_table, stop_table])
        self.rows = self.rows + rows

    # ------------------------------------------------------------------ one step

    def step(self) -> None:
        """Sample one token for every row; deliver and drop the rows that are done; feed
        the others' new tokens through the model."""
        if not self.rows:
            return
        device = self.logits.device
        counts = torch.tensor([len(r.tokens) for r in self.rows], device=device)
        u = self.uniforms.gather(1, counts[:, None]).squeeze(1)
        tok, logp = sample_tokens(self.logits, self.temps, self.top_ps, u)
        rows_idx = torch.arange(len(self.rows), device=device)
        hit_stop = self.stop_table[rows_idx, tok].tolist()
        tokens, logps = tok.tolist(), logp.tolist()
        keep: list[int] = []
        for i, row in enumerate(self.rows):
            row.tokens.append(tokens[i])
            row.logprobs.append(logps[i])
            stopped = hit_stop[i] or self._hit_stop_string(row)
            if stopped or len(row.tokens) >= row.request.max_new_tokens:
                self._finish(i, row, "stop" if stopped else "length")
            else:
                keep.append(i)
        if len(keep) < len(self.rows):
            self._select(keep)
            tok = tok[keep] if keep else tok[:0]
        if not self.rows:
            return
        positions = self.attn.sum(-1, keepdim=True)  # each row's real tokens so far
        self.attn = torch.cat([self.attn, self.attn.new_ones((len(self.rows), 1))], dim=1)
        if self.cache is None:  # rows joined or left: a cache of the new layers (one copy)
            room = int(self.uniforms.shape[1]) + 1  # the longest remaining budget fits
            self.cache = growing_cache(self.layers, room)
        out = self.model(
            input_ids=tok[:, None],
            attention_mask=self.attn,
            position_ids=positions,
            use_cache=True,
            **cache_kwargs(self.model, self.cache),
        )
        self.forwards += 1
        self.cache = returned_cache(out)  # grown in place by one position
        self.layers = [(layer.keys, layer.values) for layer in self.cache.layers]
        self.logits = out.logits[:, -1, :].float()

    def _hit_stop_string(self, row: _Row) -> bool:
        strings = row.request.stop_strings
        if not strings:
            return False
        tail = self.tokenizer.decode(row.tokens[-16:])
        return any(s in tail for s in strings)

    def _finish(self, i: int, row: _Row, reason: FinishReason) -> None:
        if self._store is not None:
            real = self.attn[i].nonzero().squeeze(-1)
            seq_len = len(row.request.prompt_ids) + len(row.tokens) - 1
            if len(real) == seq_len:  # the expected layout, else keep nothing
                layers = [(k[i][:, real], v[i][:, real]) for k, v in self.layers]  # copies
                self._store(row.request, row.tokens, layers)
        row.waiter.deliver(self._completion(row, reason))
        self._finished.append(row.waiter)

    def _completion(self, row: _Row, reason: FinishReason) -> Completion:
        return Completion(
            token_ids=tuple(row.tokens),
            logprobs=tuple(row.logprobs),
            finish_reason=reason,
            text=self.tokenizer.decode(row.tokens, skip_special_tokens=False),
            policy_version=self._version() if self._version is not None else None,
        )

    def _select(self, keep: list[int]) -> None:
        """Keep only rows ``keep``; drop the cache columns no remaining row uses."""
        self.rows = [self.rows[i] for i in keep]
        self.cache = None
        if not keep:
            self.layers, self.attn = [], self.attn[:0, :0]
            self.logits = self.logits[:0]
            return
        index = torch.tensor(keep, device=self.attn.device)
        attn = self.attn.index_select(0, index)
        used = attn.any(0).nonzero()
        start = int(used[0, 0]) if len(used) else attn.shape[1]
        self.attn = attn[:, start:]
        self.layers = [
            (k.index_select(0, index)[:, :, start:], v.index_select(0, index)[:, :, start:])
            for k, v in self.layers
        ]
        self.logits = self.logits.index_select(0, index)
        self.uniforms = self.uniforms.index_select(0, index)
        self.temps = self.temps.index_select(0, index)
        self.top_ps = self.top_ps.index_select(0, index)
        self.stop_table = self.stop_table.index_select(0, index)


class GrowingLayer(DynamicLayer):  # type: ignore[no-untyped-call]
    """One layer's keys and values in a buffer with room to grow: a decode step writes
    its position in place instead of copying the whole cache (``DynamicLayer`` appends
    with ``torch.cat``, a copy of every key and value at every step). The buffer doubles
    when full, so appending stays amortised O(new tokens)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        b, h, n, d = keys.shape
        self._k = keys.new_empty((b, h, n + room, d))
        self._v = values.new_empty((b, h, n + room, values.shape[-1]))
        self._k[:, :, :n] = keys
        self._v[:, :, :n] = values
        self._n = n
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._views()

    def _views(self) -> None:
        self.keys = self._k[:, :, : self._n]
        self.values = self._v[:, :, : self._n]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        new = key_states.shape[-2]
        if self._n + new > self._k.shape[2]:
            room = max(self._k.shape[2], new)
            for name in ("_k", "_v"):
                old = getattr(self, name)
                grown = old.new_empty((*old.shape[:2], old.shape[2] + room, old.shape[3]))
                grown[:, :, : self._n] = old[:, :, : self._n]
                setattr(self, name, grown)
        self._k[:, :, self._n : self._n + new] = key_states
        self._v[:, :, self._n : self._n + new] = value_states
        self._n += new
        self._views()
        return self._k[:, :, : self._n], self._v[:, :, : self._n]


def growing_cache(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], room: int) -> Any:
    """A ``DynamicCache`` over ``layers`` whose appends write in place (``GrowingLayer``)."""
    cache = DynamicCache()
    cache.layers = [GrowingLayer(k, v, room) for k, v in layers]
    return cache


def _pad_left(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """``x`` zero-padded on the left of ``dim`` to ``width``."""
    missing = width - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)


def _pad_right(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` zero-padded on the right of its last dimension to ``width``."""
    missing = width - x.shape[-1]
    if missing <= 0:
        return x
    return torch.cat([x, x.new_zeros((*x.shape[:-1], missing))], dim=-1)


def sample_tokens(
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
