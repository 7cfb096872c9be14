"""History reuse across turns: kept keys and values give the same samples as re-encoding
the whole context, only the new tokens run, and stale caches are never used."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import PROPERTY
from turnrl.backends.prefix_cache import PrefixCache
from turnrl.backends.torch_backend import TorchBackend
from turnrl.envs import SecretLookup
from turnrl.models.loading import stop_token_ids
from turnrl.rollout.chat import ChatRenderer
from turnrl.rollout.episode import EpisodeLimits, SamplingParams
from turnrl.rollout.groups import GroupSpec, collect_groups
from turnrl.types import GenerationRequest, Trajectory


def kv(n: int, fill: float = 0.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((2, n, 4), fill), torch.full((2, n, 4), fill)) for _ in range(3)]


def test_the_longest_proper_prefix_is_found_and_lru_evicts() -> None:
    cache = PrefixCache(max_tokens=10)
    cache.put((1, 2), kv(2, 1.0))
    cache.put((1, 2, 3, 4), kv(4, 2.0))
    hit = cache.longest_prefix((1, 2, 3, 4, 5))
    assert hit is not None
    assert hit[0] == 4
    assert float(hit[1][0][0].max()) == 2.0
    assert cache.longest_prefix((1, 2, 3, 4)) is not None  # proper prefix: (1, 2)
    assert cache.longest_prefix((1, 2, 3, 4))[0] == 2  # type: ignore[index]
    assert cache.longest_prefix((9, 1, 2)) is None
    cache.put((7, 7, 7, 7, 7), kv(5))  # 11 tokens > 10: the least recently used goes
    assert len(cache) == 2
    assert cache.longest_prefix((1, 2, 3, 4, 5)) is not None  # (1, 2, 3, 4) was used last
    with pytest.raises(ValueError, match="cover exactly"):
        cache.put((5, 6), kv(3))
    cache.sync(1)
    assert len(cache) == 0  # new weights: everything is stale


def episodes(model: Any, tokenizer: Any, reuse: bool) -> tuple[list[Trajectory], TorchBackend]:
    backend = TorchBackend(model, tokenizer, reuse_history=reuse)
    spec = SecretLookup(num_keys=2, key_pool=2)
    group = GroupSpec(
        4, EpisodeLimits(max_turns=4, max_tokens_per_turn=24),
        SamplingParams(stop_token_ids=stop_token_ids(tokenizer)), seed=11,
    )  # fmt: skip
    groups = asyncio.run(
        collect_groups(
            [spec.task(i) for i in range(3)], spec.make_env, backend, ChatRenderer(tokenizer), group
        )
    )
    return [t for g in groups for t in g], backend


def test_reusing_the_history_samples_exactly_what_re_encoding_does(
    caller: Any, tokenizer: Any
) -> None:
    plain, _ = episodes(caller, tokenizer, reuse=False)
    reused, backend = episodes(caller, tokenizer, reuse=True)
    assert backend.prefix_cache is not None
    assert backend.prefix_cache.hits > 0  # later turns did continue a kept history
    assert sum(len(t.turns) for t in plain) > len(plain)  # there were later turns
    for a, b in zip(plain, reused, strict=True):
        assert [t.completion_ids for t in a.turns] == [t.completion_ids for t in b.turns]
        for ta, tb in zip(a.turns, b.turns, strict=True):
            assert torch.allclose(
                torch.tensor(ta.completion_logprobs), torch.tensor(tb.completion_logprobs),
                atol=1e-5,
            )  # fmt: skip


def test_a_continuation_runs_only_its_new_tokens(
    model: Any, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = TorchBackend(model, tokenizer)
    prompt = tuple(tokenizer.encode("What is the value of alpha? Look it up."))
    first = backend.generate_sync([GenerationRequest(prompt, 6, seed=1)])[0]
    follow = (*prompt, *first.token_ids, *tokenizer.encode(" It is 42."))
    seen: list[int] = []
    forward = model.forward

    def counting(*args: Any, **kwargs: Any) -> Any:
        seen.append(int(kwargs["input_ids"].shape[1]))
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", counting)
    again = backend.generate_sync([GenerationRequest(follow, 4, seed=2)])[0]
    new_tokens = len(follow) - (len(prompt) + len(first.token_ids) - 1)
    assert seen[0] == new_tokens  # the prefill ran only what the cache did not hold
    monkeypatch.setattr(model, "forward", forward)
    fresh = TorchBackend(model, tokenizer, reuse_history=False)
    expected = fresh.generate_sync([GenerationRequest(follow, 4, seed=2)])[0]
    assert again.token_ids == expected.token_ids
    assert torch.allclose(torch.tensor(again.logprobs), torch.tensor(expected.logprobs), atol=1e-5)


def test_new_weights_make_the_kept_history_stale(model: Any, tokenizer: Any) -> None:
    backend = TorchBackend(model, tokenizer)
    prompt = tuple(tokenizer.encode("What is the value of beta?"))
    out = backend.generate_sync([GenerationRequest(prompt, 5, seed=3)])[0]
    assert backend.prefix_cache is not None
    assert len(backend.prefix_cache) == 1
    backend.policy_version += 1  # the trainer stepped the optimizer
    follow = (*prompt, *out.token_ids, 5)
    backend.generate_sync([GenerationRequest(follow, 2, seed=4)])
    assert backend.prefix_cache.hits == 0


@given(
    stored=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), max_size=12),
    prompt=st.lists(st.integers(0, 3), min_size=1, max_size=10),
)
@PROPERTY
def test_the_lookup_finds_the_longest_stored_proper_prefix(
    stored: list[list[int]], prompt: list[int]
) -> None:
    cache = PrefixCache()
    for seq in stored:
        cache.put(seq, kv(len(seq)))
    expected = max(
        (len(s) for s in stored if len(s) < len(prompt) and prompt[: len(s)] == s), default=None
    )
    hit = cache.longest_prefix(prompt)
    assert (hit[0] if hit else None) == expected
