"""``TorchBackend.run``: episodes on a helper thread, torch on the calling thread. Same
samples as the plain asyncio path, errors reach the caller, tools run during generation."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from turnrl.backends.torch_backend import TorchBackend
from turnrl.envs import SecretLookup
from turnrl.models.loading import stop_token_ids
from turnrl.rollout.chat import ChatRenderer
from turnrl.rollout.episode import EpisodeLimits, SamplingParams
from turnrl.rollout.groups import GroupSpec, collect_groups
from turnrl.types import GenerationRequest


def collect(backend: TorchBackend, tokenizer: Any, via_run: bool) -> list[Any]:
    spec = SecretLookup(num_keys=2, key_pool=2)
    group = GroupSpec(
        3, EpisodeLimits(max_turns=3, max_tokens_per_turn=12),
        SamplingParams(stop_token_ids=stop_token_ids(tokenizer)), seed=5,
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
    compute = backend.generate_sync

    def recording(requests: Any) -> Any:
        threads.add(threading.current_thread().name)
        return compute(requests)

    monkeypatch.setattr(backend, "generate_sync", recording)
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
