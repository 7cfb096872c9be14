"""``TorchBackend.run``: episodes on a helper thread, torch on the calling thread. Same
samples as the plain asyncio path, errors reach the caller, tools run during generation."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch

from turnrl.backends.torch_backend import TorchBackend
from turnrl.envs import SecretLookup
from turnrl.models.loading import stop_token_ids
from turnrl.rollout.chat import ChatRenderer
from turnrl.rollout.episode import EpisodeLimits, SamplingParams
from turnrl.rollout.groups import GroupSpec, collect_groups
from turnrl.types import GenerationRequest


def collect(
    backend: TorchBackend, tokenizer: Any, via_run: bool, *, max_tokens: int = 12, seed: int = 5
) -> list[Any]:
    """4 tasks x 3 episodes of up to 3 turns of ``max_tokens``, through ``backend.run``
    (``via_run``) or a plain event loop."""
    spec = SecretLookup(num_keys=2, key_pool=2)
    group = GroupSpec(
        3, EpisodeLimits(max_turns=3, max_tokens_per_turn=max_tokens),
        SamplingParams(stop_token_ids=stop_token_ids(tokenizer)), seed=seed,
    )  # fmt: skip
    program = collect_groups(
        [spec.task(i) for i in range(4)], spec.make_env, backend, ChatRenderer(tokenizer), group
    )
    groups = backend.run(program) if via_run else asyncio.run(program)
    return [t for g in groups for t in g]


def test_run_samples_what_the_plain_event_loop_samples(model: Any, tokenizer: Any) -> None:
    plain = collect(TorchBackend(model, tokenizer), tokenizer, via_run=False)
    driven = collect(TorchBackend(model, tokenizer), tokenizer, via_run=True)
    assert [t.to_json() for t in plain] == [t.to_json() for t in driven]


def test_generation_runs_on_the_calling_thread(
    model: Any, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = TorchBackend(model, tokenizer)
    threads: set[str] = set()
    forward = model.forward

    def recording(*args: Any, **kwargs: Any) -> Any:
        threads.add(threading.current_thread().name)
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", recording)
    collect(backend, tokenizer, via_run=True)
    assert threads == {threading.current_thread().name}


def test_errors_reach_the_caller_and_the_backend_is_reusable(model: Any, tokenizer: Any) -> None:
    backend = TorchBackend(model, tokenizer)

    async def broken() -> None:
        await backend.generate([GenerationRequest((1, 2, 3), 2, seed=0)])
        raise KeyError("in the program")

    with pytest.raises(KeyError, match="in the program"):
        backend.run(broken())

    async def empty_prompt() -> None:
        await backend.generate([GenerationRequest((), 2, seed=0)])

    with pytest.raises(ValueError, match="empty prompt"):  # a compute error, raised in run
        backend.run(empty_prompt())

    async def fine() -> int:
        out = await backend.generate([GenerationRequest((1, 2, 3), 2, seed=0)])
        return len(out)

    assert backend.run(fine()) == 1


def test_a_tool_waits_while_the_model_generates(model: Any, tokenizer: Any) -> None:
    """A coroutine sleeping on the episodes' loop finishes while a long generation runs:
    the loop is not blocked by torch work."""
    backend = TorchBackend(model, tokenizer)
    long = GenerationRequest(tuple(range(5, 40)), 200, seed=1)

    async def program() -> tuple[float, float]:
        t0 = time.perf_counter()
        slept: list[float] = []

        async def tool() -> None:
            await asyncio.sleep(0.05)
            slept.append(time.perf_counter() - t0)

        await asyncio.gather(backend.generate([long] * 16), tool())
        return slept[0], time.perf_counter() - t0

    tool_done, total = backend.run(program())
    assert total > 0.15  # the generation is long enough to tell
    assert tool_done < total * 0.8  # the sleep ended well before the generation did


def alone(model: Any, tokenizer: Any, request: GenerationRequest) -> Any:
    return TorchBackend(model, tokenizer, reuse_history=False).generate_sync([request])[0]


def test_a_request_joining_a_running_batch_samples_what_it_samples_alone(
    model: Any, tokenizer: Any
) -> None:
    backend = TorchBackend(model, tokenizer, reuse_history=False)
    first = GenerationRequest(tuple(tokenizer.encode("What is the value of alpha?")), 30, seed=3)
    later = GenerationRequest(tuple(tokenizer.encode("Look up beta, please.")), 12, seed=4)
    got: dict[str, Any] = {}

    class Keep:
        def __init__(self, name: str) -> None:
            self.name = name

        def deliver(self, completion: Any) -> None:
            got[self.name] = completion

        def fail(self, error: Exception) -> None:
            raise error

    batch = backend._new_batch()
    with torch.no_grad():
        batch.admit([(first, Keep("first"))])
        for _ in range(7):
            batch.step()
        assert len(batch) == 1  # "first" runs on (it has no stop tokens)
        batch.admit([(later, Keep("later"))])  # joins mid-way, with a different width
        while len(batch):
            batch.step()
    for name, request in (("first", first), ("later", later)):
        expected = alone(model, tokenizer, request)
        assert got[name].token_ids == expected.token_ids
        assert torch.allclose(
            torch.tensor(got[name].logprobs), torch.tensor(expected.logprobs), atol=1e-5
        )


def test_finished_rows_leave_the_batch(model: Any, tokenizer: Any) -> None:
    backend = TorchBackend(model, tokenizer)
    vocab = backend.vocab_size
    stops_at_once = GenerationRequest((5, 6, 7), 20, seed=1, stop_token_ids=tuple(range(vocab)))
    runs_long = GenerationRequest((5, 6, 8), 20, seed=2)
    done: list[Any] = []

    class Keep:
        def deliver(self, completion: Any) -> None:
            done.append(completion)

        def fail(self, error: Exception) -> None:
            raise error

    batch = backend._new_batch()
    with torch.no_grad():
        batch.admit([(stops_at_once, Keep()), (runs_long, Keep())])
        batch.step()
        assert len(batch) == 1
        assert len(done) == 1
        assert done[0].finish_reason == "stop"
        assert len(done[0].token_ids) == 1
        forwards = batch.forwards
        while len(batch):
            batch.step()
    assert batch.forwards - forwards == 18  # one row's steps: 20 tokens, 2 sampled before
    assert done[1].finish_reason == "length"
    assert len(done[1].token_ids) == 20


def test_a_small_batch_size_limit_gives_the_same_samples(model: Any, tokenizer: Any) -> None:
    requests = [
        GenerationRequest(tuple(tokenizer.encode(f"Question {i}: what is x?")), 6 + i, seed=i)
        for i in range(5)
    ]
    wide = TorchBackend(model, tokenizer).generate_sync(requests)
    narrow = TorchBackend(model, tokenizer, max_batch_size=2).generate_sync(requests)
    assert [c.token_ids for c in wide] == [c.token_ids for c in narrow]


def test_an_episode_back_from_its_tool_does_not_wait_for_a_long_generation(
    model: Any, tokenizer: Any
) -> None:
    """Continuous batching: a short turn, a tool call, the next short turn, all while one
    long generation is still running."""
    backend = TorchBackend(model, tokenizer)
    long = GenerationRequest(tuple(range(5, 30)), 300, seed=1)
    short = GenerationRequest(tuple(range(40, 60)), 3, seed=2)
    order: list[str] = []

    async def program() -> None:
        async def long_episode() -> None:
            await backend.generate([long])
            order.append("long done")

        async def short_episode() -> None:
            first = (await backend.generate([short]))[0]
            await asyncio.sleep(0.01)  # the tool
            follow = GenerationRequest((*short.prompt_ids, *first.token_ids, 61, 62), 3, seed=3)
            await backend.generate([follow])
            order.append("second turn done")

        await asyncio.gather(long_episode(), short_episode())

    backend.run(program())
    assert order == ["second turn done", "long done"]


class SlowToReact:
    """A SecretLookup env whose step blocks the event loop for a random moment, as a
    busy loop would: without lockstep, the follow-up turns would join the running batch
    at other decode steps."""

    def __init__(self, inner: Any, rng: Any) -> None:
        self.inner, self.rng = inner, rng

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def step(self, action: str) -> Any:
        time.sleep(self.rng.uniform(0, 0.01))
        return await self.inner.step(action)


def test_runs_are_reproducible_to_the_bit_whatever_the_threads_timing(
    caller: Any, tokenizer: Any
) -> None:
    import random

    spec = SecretLookup(num_keys=2, key_pool=2)
    group = GroupSpec(
        4, EpisodeLimits(max_turns=3, max_tokens_per_turn=16),
        SamplingParams(stop_token_ids=stop_token_ids(tokenizer)), seed=9,
    )  # fmt: skip
    tasks = [spec.task(i) for i in range(4)]
    runs = []
    for slow in (False, True):
        backend = TorchBackend(caller, tokenizer)
        rng = random.Random(slow)
        make = (lambda r=rng: SlowToReact(spec.make_env(), r)) if slow else spec.make_env
        program = collect_groups(tasks, make, backend, ChatRenderer(tokenizer), group)
        runs.append([t.to_json() for g in backend.run(program) for t in g])
    assert sum(len(t["turns"]) for t in runs[0]) > len(runs[0])  # follow-up turns happened
    assert runs[0] == runs[1]  # same tokens and the very same float log-probs


def test_a_barrier_asked_for_after_the_program_returned_releases_at_once(
    model: Any, tokenizer: Any
) -> None:
    """A completion settled while ``asyncio.run`` cancels what is left would otherwise start
    a barrier task that is never cancelled ("Task was destroyed but it is pending")."""
    from turnrl.backends.torch_backend import _BARRIERS, _start_barrier

    backend = TorchBackend(model, tokenizer)
    collect(backend, tokenizer, via_run=True)
    assert backend.program_over
    released: list[bool] = []

    async def ask() -> int:
        _start_barrier([lambda: True], lambda: released.append(True), backend)
        return len(_BARRIERS)

    assert asyncio.run(ask()) == 0
    assert released == [True]
    backend.program_over = False  # while a program runs, the barrier waits as before

    async def ask_running() -> int:
        _start_barrier([lambda: True], lambda: released.append(True), backend)
        started = len(_BARRIERS)
        while len(released) < 2:
            await asyncio.sleep(0)
        return started

    assert asyncio.run(ask_running()) == 1


def test_a_growing_layer_appends_in_place_and_grows_like_a_dynamic_one() -> None:
    from transformers.cache_utils import DynamicLayer

    from turnrl.backends.engine import GrowingLayer

    k0, v0 = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 5)
    growing, plain = GrowingLayer(k0, v0, room=2), DynamicLayer()
    plain.update(k0, v0)
    buffer = growing._k
    for n in (1, 1, 3, 1):  # the third append outgrows the room: the buffer doubles
        k, v = torch.randn(2, 3, n, 5), torch.randn(2, 3, n, 5)
        got, want = growing.update(k, v), plain.update(k, v)
        assert torch.equal(got[0], want[0])
        assert torch.equal(got[1], want[1])
        assert growing.get_seq_length() == plain.get_seq_length()
    assert growing._k is not buffer  # it grew once
    assert growing._k.shape[2] >= growing.get_seq_length()


def test_every_turn_records_the_policy_version_that_sampled_it(model: Any, tokenizer: Any) -> None:
    backend = TorchBackend(model, tokenizer)
    spec = SecretLookup()
    group = GroupSpec(
        2, EpisodeLimits(max_tokens_per_turn=16),
        SamplingParams(stop_token_ids=stop_token_ids(tokenizer)), seed=1,
    )  # fmt: skip

    def versions() -> set[int]:
        program = collect_groups(
            [spec.task(0)], spec.make_env, backend, ChatRenderer(tokenizer), group
        )
        groups = asyncio.run(program)
        return {turn.policy_version for g in groups for t in g for turn in t.turns}

    assert versions() == {0}
    backend.sync(model)
    backend.sync(model)
    assert versions() == {2}
