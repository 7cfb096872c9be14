"""A sampler for a Hugging Face causal LM, in torch, with a KV cache and continuous
batching.

Requests from many episodes decode together in one running batch (``engine.DecodeBatch``):
new requests are prefilled and join at the next step, finished rows leave at once, so an
episode back from a tool call never waits for the rest of a batch. Each request has its
own seed, so a sample does not depend on which other requests shared its steps.
Log-probabilities are those of the distribution each token was drawn from (temperature
applied, before top-p), which is what the learner recomputes.

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
from collections import deque
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import torch
from transformers import DynamicCache

from turnrl.backends.engine import DecodeBatch, Prefill, Waiter
from turnrl.backends.hf_cache import returned_cache
from turnrl.backends.lockstep import until_reacted
from turnrl.backends.prefix_cache import LayerKV, PrefixCache
from turnrl.protocols import TurnSync
from turnrl.types import Completion, GenerationRequest

T = TypeVar("T")

MIN_SHARED_PREFIX = 8
"""Shortest common prompt prefix worth computing once for the whole batch."""


class TorchBackend:
    """Samples from a causal LM held in this process (CPU or one GPU).

    ``model`` is shared with the learner in the single-process loop: weight sync is free,
    and ``sync`` bumps ``policy_version`` after each optimizer step. In asynchronous
    training it is a copy of the learner's model (it samples while the learner updates), and
    ``sync`` copies the learner's weights into it.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_batch_size: int = 256,
        reuse_history: bool = True,
        max_cached_tokens: int = 1 << 20,
        autocast: torch.dtype | None = None,
        weights_of: Callable[[Any], dict[str, torch.Tensor]] | None = None,
    ) -> None:
        self.model = model
        self.autocast = autocast
        """Autocast the forward passes to this dtype (``model.precision = bf16-mixed``)."""
        self.weights_of = weights_of
        """The state dict ``sync`` loads from the learner's model (e.g. a LoRA policy's
        merged weights); the model's own ``state_dict`` when None."""
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.policy_version = 0
        pad = tokenizer.pad_token_id
        self.pad_id: int = int(pad if pad is not None else tokenizer.eos_token_id)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self._lock = threading.Lock()
        self.prefix_cache = PrefixCache(max_cached_tokens) if reuse_history else None
        self._jobs: queue.SimpleQueue[_Job | _Ack | None] | None = None
        self.submissions = 0
        """Jobs handed to the running batch so far (the lockstep barrier watches it)."""
        self.program_over = False
        """Set on the event loop when ``run``'s program has returned: a barrier asked for
        after that releases at once (``asyncio.run`` is then cancelling what is left, and a
        task started now would be destroyed pending when the loop closes)."""
        self.turn_sync: TurnSync | None = None
        """New weights to take between turns while ``run`` serves (turn_sync.py)."""

    def _autocast(self) -> Any:
        device = next(self.model.parameters()).device
        return torch.autocast(device.type, dtype=self.autocast, enabled=self.autocast is not None)

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
            past = returned_cache(head)
            past.batch_repeat_interleave(B)
        return input_ids.to(device), attn.to(device), past, shared

    def _reuse(
        self,
        requests: Sequence[GenerationRequest],
        hits: Sequence[tuple[int, list[LayerKV]] | None],
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor, Any, int]:
        """Prefill inputs for rows that continue a cached history. Layout: [left padding]
        [row's cached tokens] [left padding][row's new tokens]; only the new tokens run."""
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

    def run(self, program: Coroutine[Any, Any, T]) -> T:
        """Run the asyncio ``program`` to completion and return its result.

        The program's event loop (episodes, tool calls) runs on a helper thread; this
        thread serves every ``generate`` it asks for with continuous batching, so tools
        keep running during generation and all torch work stays on the calling thread."""
        if self._jobs is not None:
            raise RuntimeError("TorchBackend.run is already running")
        jobs: queue.SimpleQueue[_Job | _Ack | None] = queue.SimpleQueue()
        outcome: dict[str, Any] = {}

        async def program_then_over() -> T:
            try:
                return await program
            finally:
                self.program_over = True

        def drive() -> None:
            try:
                outcome["value"] = asyncio.run(program_then_over())
            except BaseException as exc:  # re-raised on the calling thread
                outcome["error"] = exc
            finally:
                jobs.put(None)

        self._jobs = jobs
        self.program_over = False
        helper = threading.Thread(target=drive, name="turnrl-episodes", daemon=True)
        with self._lock, _eval_mode(self.model), self._autocast():
            helper.start()
            try:
                self._serve(jobs)
            finally:
                self._jobs = None
        helper.join()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]  # type: ignore[no-any-return]

    def _prefill_inputs(self, requests: Sequence[GenerationRequest]) -> list[Prefill]:
        """The prefill forwards for ``requests``: one for the requests that continue a
        kept history (only their new tokens run), one for the others (their common prompt
        prefix run once). Kept apart, a history-less prompt does not widen the rows that
        continue a history with padding as long as itself."""
        device = next(self.model.parameters()).device
        hits: list[tuple[int, list[LayerKV]] | None] = [None] * len(requests)
        if self.prefix_cache is not None:
            self.prefix_cache.sync(self.policy_version)
            hits = [self.prefix_cache.longest_prefix(r.prompt_ids) for r in requests]
        reuse = [i for i, h in enumerate(hits) if h is not None]
        fresh = [i for i, h in enumerate(hits) if h is None]
        out = []
        if reuse:
            chosen = [requests[i] for i in reuse]
            out.append((reuse, *self._reuse(chosen, [hits[i] for i in reuse], device)))
        if fresh:
            out.append((fresh, *self._share([requests[i] for i in fresh], device)))
        return out

    def _keep_history(
        self, request: GenerationRequest, tokens: list[int], layers: list[LayerKV]
    ) -> None:
        """Keep a finished row's keys and values (its prompt and every sampled token that
        was fed back, i.e. all but the last) for the episode's next turn."""
        assert self.prefix_cache is not None
        self.prefix_cache.put((*request.prompt_ids, *tokens[:-1]), layers)

    def _new_batch(self) -> DecodeBatch:
        return DecodeBatch(
            self.model,
            self.tokenizer,
            vocab_size=self.vocab_size,
            prefill=self._prefill_inputs,
            store=self._keep_history if self.prefix_cache is not None else None,
            version=lambda: self.policy_version,
        )

    def _drive(
        self, batch: DecodeBatch, waiting: deque[tuple[GenerationRequest, Waiter]]
    ) -> list[Waiter]:
        """Admit waiting requests while there is room, then take one decode step; return
        the waiters whose requests ended in it. On a failure every row in flight and
        every admitted request gets the error."""
        taken: list[tuple[GenerationRequest, Waiter]] = []
        try:
            room = self.max_batch_size - len(batch)
            while waiting and room > 0:
                taken.append(waiting.popleft())
                room -= 1
            if taken:
                batch.admit(taken)
            batch.step()
        except Exception as exc:
            for waiter in [w for _, w in taken] + [row.waiter for row in batch.rows]:
                waiter.fail(exc)
            batch.clear()
        return batch.take_finished()

    @torch.inference_mode()
    def _serve(self, jobs: queue.SimpleQueue[_Job | _Ack | None]) -> None:
        """Serve ``jobs`` until the program ends (a None in the queue): every step admits
        what has arrived since the last one (continuous batching).

        Lockstep: when requests submitted with a ``quiet`` check end, decoding pauses
        until the event loop has reacted (their episodes ran their tools and asked for
        their next turns, or went quiet), so a follow-up request joins at the same step
        whatever the threads' timing: runs are reproducible to the bit.

        New weights wanted mid-batch (``turn_sync``): admissions stop, the rows being
        decoded finish, the weights are loaded, then the waiting requests are admitted."""
        batch = self._new_batch()
        waiting: deque[tuple[GenerationRequest, Waiter]] = deque()
        ended = False
        acks_owed = 0
        while not ended or batch or waiting or acks_owed:
            block = (not batch and not waiting) or acks_owed > 0
            try:
                job = jobs.get(block=block)
                while True:
                    if job is None:
                        ended = True
                    elif isinstance(job, _Ack):
                        acks_owed -= 1
                    else:
                        waiting.extend(job.items)
                    job = jobs.get_nowait()
            except queue.Empty:
                pass
            if ended:  # the program is over: no barrier is left to answer
                acks_owed = 0
            if acks_owed or not (batch or waiting):
                continue
            hold = self.turn_sync is not None and self.turn_sync.wanted()
            if hold and not batch:  # nothing is being decoded: the new weights go in now
                assert self.turn_sync is not None
                try:
                    self.turn_sync.apply()
                except Exception as exc:  # each waiting episode records the failed load
                    for _, waiter in waiting:
                        waiter.fail(exc)
                    waiting.clear()
                    continue
                hold = False
            # while new weights wait, the rows being decoded finish and nothing joins them
            finished = self._drive(batch, deque() if hold else waiting)
            quiet = {id(w.quiet): w for w in finished if isinstance(w, _Pending) and w.quiet}
            if quiet:
                acks_owed += 1
                first = next(iter(quiet.values()))
                checks = [w.quiet for w in quiet.values() if w.quiet is not None]
                try:
                    first.loop.call_soon_threadsafe(
                        _start_barrier, checks, lambda: jobs.put(_Ack()), self
                    )
                except RuntimeError:  # the loop has closed: nobody will answer
                    acks_owed -= 1

    def sync(self, model: Any) -> None:
        """After an optimizer step on ``model``: where this backend samples with that very
        model object the weights are already in place, else they are copied into its own
        (same architecture; never while it samples: the caller syncs between batches). The
        version moves on, and the kept histories' keys and values (computed by the old
        weights) are dropped on the next prefill (``PrefixCache.sync``). A copy in another
        dtype (the bf16 sampler) takes the weights cast to its own."""
        if model is not self.model:
            weights = self.weights_of(model) if self.weights_of else model.state_dict()
            with torch.no_grad():
                self.model.load_state_dict(weights)
        self.policy_version += 1

    def sleep_metrics(self) -> dict[str, float]:
        """Nothing: the torch engine never releases its memory between batches."""
        return {}

    def submit(
        self,
        requests: Sequence[GenerationRequest],
        quiet: Callable[[], bool] | None = None,
    ) -> list[asyncio.Future[Completion]] | None:
        """Hand ``requests`` to the running batch and return one future each, settled as
        soon as that request's completion is done; None outside ``run`` (then use
        ``generate``). Call from the event loop ``run`` is driving.

        ``quiet``: the caller's "nothing left to submit" check. When one of these
        requests ends, decoding waits until ``quiet()`` has held for ``LOCKSTEP_TURNS``
        turns of the event loop with nothing new submitted (see ``_serve``)."""
        jobs = self._jobs
        if jobs is None:
            return None
        job = _Job(requests, asyncio.get_running_loop(), quiet)
        self.submissions += 1
        jobs.put(job)
        return [waiter.future for _, waiter in job.items]

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        """Sample every request. Inside ``run`` the calling thread of ``run`` computes it
        (continuous batching); otherwise a worker thread does (slower on CPU, see the
        module docstring)."""
        futures = self.submit(requests)
        if futures is None:
            return await asyncio.to_thread(self.generate_sync, requests)
        return list(await asyncio.gather(*futures))

    def generate_sync(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        """Sample every request on this thread; at most ``max_batch_size`` rows decode at
        once, and a waiting request takes the place of one that finished."""
        waiters = [_Collect() for _ in requests]
        with self._lock, torch.inference_mode(), _eval_mode(self.model), self._autocast():
            batch = self._new_batch()
            waiting: deque[tuple[GenerationRequest, Waiter]] = deque(
                zip(requests, waiters, strict=True)
            )
            while batch or waiting:
                self._drive(batch, waiting)
        for waiter in waiters:
            if waiter.error is not None:
                raise waiter.error
        return [w.result for w in waiters if w.result is not None]


class _Collect:
    """Where ``generate_sync`` gets one request's completion or error."""

    def __init__(self) -> None:
        self.result: Completion | None = None
        self.error: Exception | None = None

    def deliver(self, completion: Completion) -> None:
        self.result = completion

    def fail(self, error: Exception) -> None:
        self.error = error


class _Pending:
    """One request of a ``_Job``: settles its future on the event loop that waits for it."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, quiet: Callable[[], bool] | None = None
    ) -> None:
        self.loop = loop
        self.quiet = quiet
        self.future: asyncio.Future[Completion] = loop.create_future()

    def deliver(self, completion: Completion) -> None:
        self._settle(lambda: self.future.set_result(completion))

    def fail(self, error: Exception) -> None:
        self._settle(lambda: self.future.set_exception(error))

    def _settle(self, action: Callable[[], None]) -> None:
        def settle() -> None:
            if not self.future.done():  # the episode may have been cancelled meanwhile
                action()

        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits for this
            self.loop.call_soon_threadsafe(settle)


class _Job:
    """Requests handed from the episodes' event loop to the torch thread."""

    def __init__(
        self,
        requests: Sequence[GenerationRequest],
        loop: asyncio.AbstractEventLoop,
        quiet: Callable[[], bool] | None = None,
    ) -> None:
        self.items: list[tuple[GenerationRequest, _Pending]] = [
            (r, _Pending(loop, quiet)) for r in requests
        ]


class _Ack:
    """The event loop's answer to a lockstep barrier: decoding may go on."""


def _start_barrier(
    checks: list[Callable[[], bool]], release: Callable[[], None], backend: TorchBackend
) -> None:
    """On the event loop, after the completions that called for it were settled: wait
    until every ``check`` holds and no job was submitted for ``LOCKSTEP_TURNS`` turns,
    then ``release`` the torch thread."""

    if backend.program_over:
        release()
        return

    async def barrier() -> None:
        try:
            await until_reacted(checks, lambda: backend.submissions)
        finally:
            release()

    task = asyncio.ensure_future(barrier())
    _BARRIERS.add(task)
    task.add_done_callback(_BARRIERS.discard)


_BARRIERS: set[asyncio.Future[None]] = set()
"""Running barrier tasks (a reference keeps each alive until it is done)."""


@contextlib.contextmanager
def _eval_mode(model: Any) -> Iterator[None]:
    """The model in eval mode (no dropout) for sampling, restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


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
