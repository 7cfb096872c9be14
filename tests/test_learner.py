"""The sampler and the learner agree: per-request seeds, the on-policy ratio, exact zero
gradient on masked tokens, and micro-batching that does not change the update."""

from __future__ import annotations

import asyncio
import copy
import math
import re
from typing import Any

import pytest
import torch

from turnrl.backends import torch_backend
from turnrl.backends.torch_backend import TorchBackend
from turnrl.envs import SecretLookup
from turnrl.models.loading import stop_token_ids
from turnrl.rollout.batch import Batch, pack
from turnrl.rollout.chat import ChatRenderer
from turnrl.rollout.episode import EpisodeLimits, SamplingParams
from turnrl.rollout.groups import GroupSpec, collect_groups
from turnrl.trainer import forward
from turnrl.trainer import learner as learner_module
from turnrl.trainer.config import AlgorithmConfig, build
from turnrl.trainer.forward import pack_rows, token_logprobs
from turnrl.trainer.learner import (
    MIN_SHARED_PREFIX,
    Learner,
    auto_token_budget,
    common_prefix_length,
    hidden_states,
)
from turnrl.types import GenerationRequest, Sample

SPEC = SecretLookup()


def rollout_batch(model: Any, tokenizer: Any, *, tasks: int = 4, group: int = 4) -> Batch:
    backend = TorchBackend(model, tokenizer)
    spec = GroupSpec(
        group,
        EpisodeLimits(max_tokens_per_turn=24),
        SamplingParams(stop_token_ids=stop_token_ids(tokenizer)),
        seed=3,
    )
    groups = asyncio.run(
        collect_groups(
            [SPEC.task(i) for i in range(tasks)],
            SPEC.make_env,
            backend,
            ChatRenderer(tokenizer),
            spec,
        )
    )
    samples = [s for g in groups for t in g for s in t.samples()]
    advantages = [float((-1) ** i) * 0.5 for i in range(len(samples))]
    return pack(samples, advantages, backend.pad_id)


def grads_after_step(
    model: Any, batch: Batch, micro_batch_size: int = 64, **algorithm: Any
) -> dict[str, torch.Tensor]:
    config = algo(lr=1e-3, micro_batch__size=micro_batch_size, **algorithm)
    learner = Learner(model, config, temperature=1.0, max_length=64)
    learner.optimizer.step = lambda *a, **k: None  # type: ignore[method-assign]  # keep grads, skip the update
    learner.step(batch)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def algo(**settings: Any) -> AlgorithmConfig:
    """An AlgorithmConfig from keyword settings, ``__`` for a section (``kl__coef=0.1``)."""
    data: dict[str, Any] = {}
    for key, value in settings.items():
        *sections, name = key.split("__")
        node = data
        for section in sections:
            node = node.setdefault(section, {})
        node[name] = value
    config: AlgorithmConfig = build(AlgorithmConfig, data, "algorithm")
    return config


def test_a_request_samples_the_same_alone_or_in_a_batch(model: Any, tokenizer: Any) -> None:
    backend = TorchBackend(model, tokenizer)
    ids = tuple(tokenizer.encode("What is the value of beta?"))
    mine = GenerationRequest(prompt_ids=ids, max_new_tokens=12, seed=7)
    others = [
        GenerationRequest(prompt_ids=ids[: 3 + i], max_new_tokens=20, seed=i) for i in range(5)
    ]
    alone = backend.generate_sync([mine])[0]
    batched = backend.generate_sync([*others[:2], mine, *others[2:]])[2]
    assert alone.token_ids == batched.token_ids
    assert torch.allclose(torch.tensor(alone.logprobs), torch.tensor(batched.logprobs), atol=1e-5)
    other_seed = backend.generate_sync([GenerationRequest(ids, 12, seed=8)])[0]
    assert other_seed.token_ids != alone.token_ids


def test_stop_tokens_end_a_completion(model: Any, tokenizer: Any) -> None:
    backend = TorchBackend(model, tokenizer)
    ids = tuple(tokenizer.encode("What is"))
    every = tuple(range(len(tokenizer)))  # any token stops: one-token completions
    out = backend.generate_sync([GenerationRequest(ids, 10, seed=1, stop_token_ids=every)])[0]
    assert len(out.token_ids) == 1
    assert out.finish_reason == "stop"
    out = backend.generate_sync([GenerationRequest(ids, 5, seed=1)])[0]
    assert len(out.token_ids) == 5
    assert out.finish_reason == "length"


def test_first_pass_ratio_is_one(model: Any, tokenizer: Any) -> None:
    batch = rollout_batch(model, tokenizer)
    assert int(batch.loss_mask.sum()) > 0
    metrics = Learner(model, AlgorithmConfig(), temperature=1.0).step(batch)
    assert metrics["train/logprob_mismatch_max"] < 1e-4
    assert metrics["train/clip_frac"] == 0.0


def test_masked_tokens_get_exactly_zero_gradient(model: Any, tokenizer: Any) -> None:
    batch = rollout_batch(model, tokenizer, tasks=2, group=2)
    clean = grads_after_step(copy.deepcopy(model), batch)
    # Garbage where the mask is 0 must not reach the gradient, not even as NaN.
    poisoned_old = torch.where(batch.loss_mask, batch.old_logprobs, torch.nan)
    poisoned_adv = torch.where(batch.loss_mask, batch.advantages, torch.nan)
    poisoned = Batch(
        batch.input_ids, batch.attention_mask, batch.loss_mask, poisoned_old, poisoned_adv
    )
    dirty = grads_after_step(copy.deepcopy(model), poisoned)
    assert clean.keys() == dirty.keys()
    for name in clean:
        assert torch.equal(clean[name], dirty[name]), name
    # A fully masked extra row (a prompt with nothing sampled) changes nothing either.
    pad_row = Batch(
        torch.cat([batch.input_ids, batch.input_ids[:1]]),
        torch.cat([batch.attention_mask, batch.attention_mask[:1]]),
        torch.cat([batch.loss_mask, torch.zeros_like(batch.loss_mask[:1])]),
        torch.cat([batch.old_logprobs, batch.old_logprobs[:1]]),
        torch.cat([batch.advantages, torch.full_like(batch.advantages[:1], 5.0)]),
    )
    padded = grads_after_step(copy.deepcopy(model), pad_row)
    for name in clean:
        assert torch.allclose(clean[name], padded[name], atol=1e-7), name


@pytest.mark.parametrize(
    "reduction",
    ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"],
)
@pytest.mark.parametrize("kl", ["k1", "k3+"])
def test_micro_batching_gives_the_same_gradient(
    model: Any, tokenizer: Any, reduction: str, kl: str
) -> None:
    batch = rollout_batch(model, tokenizer, tasks=2, group=3)
    options = {"loss_reduction": reduction, "kl__estimator": kl, "kl__coef": 0.5}
    whole = grads_after_step(copy.deepcopy(model), batch, micro_batch_size=64, **options)
    pieces = grads_after_step(copy.deepcopy(model), batch, micro_batch_size=1, **options)
    assert any(g.abs().sum() > 0 for g in whole.values())
    for name in whole:
        assert torch.allclose(whole[name], pieces[name], atol=1e-6), name


def test_reference_model_exists_only_with_a_kl_coefficient(model: Any, tokenizer: Any) -> None:
    assert Learner(model, AlgorithmConfig(), temperature=1.0).ref_model is None
    learner = Learner(model, algo(kl__coef=0.1, lr=1e-2), temperature=1.0)
    assert learner.ref_model is not None
    batch = rollout_batch(model, tokenizer, tasks=2, group=2)
    first = learner.step(batch)
    assert abs(first["loss/kl"]) < 1e-6  # the policy is still the reference
    second = learner.step(batch)
    assert second["loss/kl"] > 0.0  # one large step later they differ


def test_the_reference_runs_once_per_micro_batch_whatever_the_epochs(
    model: Any, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = rollout_batch(model, tokenizer, tasks=2, group=2)
    learner = Learner(model, algo(kl__coef=0.1, epochs=3, micro_batch__size=2), temperature=1.0)
    forwards: list[Any] = []

    def counted(net: Any, *args: Any, **kwargs: Any) -> Any:
        forwards.append(net)
        return token_logprobs(net, *args, **kwargs)

    monkeypatch.setattr(learner_module, "token_logprobs", counted)
    learner.step(batch)
    micro = len(learner.micro_batches(batch))
    assert micro == 2
    assert sum(net is learner.ref_model for net in forwards) == micro  # not 3 passes x 2
    assert sum(net is learner.model for net in forwards) == 3 * micro


def test_later_epochs_reuse_the_batch_under_the_clip(model: Any, tokenizer: Any) -> None:
    batch = rollout_batch(model, tokenizer, tasks=2, group=2)
    config = algo(epochs=3, lr=5e-2, clip__low=0.01, clip__high=0.01)
    metrics = Learner(model, config, temperature=1.0).step(batch)
    assert metrics["train/logprob_mismatch_max"] < 1e-4  # pass 0 is still on-policy
    assert metrics["train/clip_frac"] > 0.0  # passes 1 and 2 moved past the clip range


def test_a_given_reference_is_the_kl_anchor(model: Any, tokenizer: Any) -> None:
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = rollout_batch(model, tokenizer, tasks=2, group=2)
    config = algo(kl__coef=0.1)
    anchored = Learner(copy.deepcopy(model), config, temperature=1.0, reference=reference)
    assert anchored.step(batch)["loss/kl"] > 1e-4  # the policy differs from its given anchor
    fresh = Learner(model, config, temperature=1.0)
    assert abs(fresh.step(batch)["loss/kl"]) < 1e-6  # default anchor: the policy itself


def test_a_shared_prefix_computed_once_gives_the_plain_forward(model: Any, tokenizer: Any) -> None:
    batch = rollout_batch(model, tokenizer)
    ids, att = batch.input_ids, batch.attention_mask
    shared = common_prefix_length(ids, att)
    assert shared >= MIN_SHARED_PREFIX  # system prompt and tool list are common to all rows
    assert not (ids[:, shared] == ids[0, shared]).all()  # and it stops where rows differ
    mask = att.bool()

    plain = model.base_model(input_ids=ids, attention_mask=att).last_hidden_state
    fast = hidden_states(model, ids, att)
    assert torch.allclose(plain[mask], fast[mask], atol=1e-5)

    params = [p for p in model.parameters() if p.requires_grad]
    g_plain = torch.autograd.grad((plain[mask] ** 2).sum(), params)
    g_fast = torch.autograd.grad((fast[mask] ** 2).sum(), params)
    for a, b in zip(g_plain, g_fast, strict=True):
        assert (a - b).abs().max() <= 1e-4 * a.abs().max()


def test_common_prefix_length_stops_at_the_first_difference_or_padding() -> None:
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 4]])
    assert common_prefix_length(ids, torch.ones_like(ids)) == 3
    att = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]])
    assert common_prefix_length(ids, att) == 2
    same = torch.tensor([[7, 8, 9], [7, 8, 9]])
    assert common_prefix_length(same, torch.ones_like(same)) == 2  # one token left to run


def test_the_sampler_computes_a_shared_prompt_prefix_once_with_the_same_result(
    model: Any, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = TorchBackend(model, tokenizer)
    head = tuple(tokenizer.encode("You are a helpful assistant. Look the value up, then answer."))
    tails = ["What is the value of beta?", "alpha?", "What is it", "x"]
    requests = [
        GenerationRequest(head + tuple(tokenizer.encode(t)), max_new_tokens=10, seed=i)
        for i, t in enumerate(tails)
    ]
    assert torch_backend._common_prefix([r.prompt_ids for r in requests]) >= len(head)
    shared = backend.generate_sync(requests)
    monkeypatch.setattr(torch_backend, "MIN_SHARED_PREFIX", 10**9)  # the plain path
    plain = backend.generate_sync(requests)
    for a, b in zip(shared, plain, strict=True):
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


@pytest.mark.parametrize(
    "options",
    [
        {"policy_loss": "gspo", "clip__low": 3e-4, "clip__high": 4e-4},
        {"policy_loss": "gspo", "loss_reduction": "seq_mean_token_mean"},
        {"clip__dual": 3.0},
        {"off_policy__correction": "token_tis"},
        {"off_policy__correction": "sequence_tis"},
        {"off_policy__correction": "sequence_mask"},
        {"entropy_coef": 0.01},
    ],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()),
)
def test_every_loss_option_accumulates_exactly_over_micro_batches(
    model: Any, tokenizer: Any, options: dict[str, Any]
) -> None:
    batch = skewed(rollout_batch(model, tokenizer, tasks=2, group=3))
    whole = grads_after_step(copy.deepcopy(model), batch, micro_batch_size=64, **options)
    pieces = grads_after_step(copy.deepcopy(model), batch, micro_batch_size=1, **options)
    assert any(g.abs().sum() > 0 for g in whole.values())
    for name in whole:
        assert torch.allclose(whole[name], pieces[name], atol=1e-6), name


@pytest.mark.parametrize("correction", ["token_tis", "sequence_tis"])
def test_off_policy_metrics_are_the_whole_batch_s_whatever_the_micro_batches(
    model: Any, tokenizer: Any, correction: str
) -> None:
    """Extremes are the batch's (not a token-weighted mean of each micro-batch's), means
    over sequences are weighted by sequences, and a micro-batch with no sampled token
    changes nothing: one micro-batch, or one row each, give the same metrics.

    A float comparison across batch shapes (one micro-batch of 6 rows against 6 of one row
    pick different kernels), so not bitwise: each metric is held to a tolerance set by the
    scale of its family (``_min``, ``_max`` and ``_mean`` of one quantity), not by float32's
    noise floor. Row 0's log-ratio is 0 up to round-off, which differs from CPU to CPU
    (1.4e-6 on an AVX-512 Xeon); what is checked is that it is the batch's minimum."""
    shift = 0.2
    batch = skewed(rollout_batch(model, tokenizer, tasks=2, group=3), shift=shift)
    dead = Batch(
        batch.input_ids[:1], batch.attention_mask[:1], torch.zeros_like(batch.loss_mask[:1]),
        batch.old_logprobs[:1], batch.advantages[:1],
    )  # fmt: skip
    got = {}
    for size in (64, 1):
        learner = Learner(
            copy.deepcopy(model), algo(off_policy__correction=correction, micro_batch__size=size),
            temperature=1.0,
        )  # fmt: skip
        rows = [batch.select(slice(i, i + size)) for i in range(0, batch.num_sequences, size)]
        got[size] = learner.step([*rows, dead] if size == 1 else rows)
    keys = [k for k in got[64] if k.startswith("off_policy/")]
    assert any(k.endswith("_max") for k in keys)
    assert any(k.endswith("_min") for k in keys)

    def family_scale(key: str) -> float:
        stem = re.sub(r"_(min|max|mean)$", "", key)
        return max(1.0, *(abs(got[64][k]) for k in keys if k.startswith(stem)))

    for key in keys:
        assert got[1][key] == pytest.approx(got[64][key], rel=0, abs=1e-5 * family_scale(key))
    # What the extremes mean, from the skew itself: row i's sampled tokens had their
    # sampler log-probs lowered by i * shift, so log rho is i * shift per token (and
    # i * shift * n_i over the row's n_i tokens), up to round-off.
    sampled = batch.loss_mask.sum(-1).tolist()
    per_row = [
        i * shift * (n if correction == "sequence_tis" else 1) for i, n in enumerate(sampled)
    ]
    spread = "tis_ratio" if correction == "token_tis" else "seq_tis_log_ratio"
    if correction == "token_tis":
        per_row = [math.exp(v) for v in per_row]
    present = [v for v, n in zip(per_row, sampled, strict=True) if n > 0]
    for size in (64, 1):
        extremes = got[size][f"off_policy/{spread}_max"], got[size][f"off_policy/{spread}_min"]
        tolerance = 1e-5 * family_scale(f"off_policy/{spread}_max")
        assert extremes == pytest.approx((max(present), min(present)), rel=0, abs=tolerance)
    assert got[1][f"off_policy/{spread}_max"] > got[1][f"off_policy/{spread}_mean"]


def skewed(batch: Batch, shift: float = 0.0) -> Batch:
    """The batch as if a sampler had given row i's tokens log-probs lower by i * shift."""
    rows = torch.arange(batch.num_sequences, dtype=torch.float32)[:, None]
    old = torch.where(batch.loss_mask, batch.old_logprobs - rows * shift, 0.0)
    return Batch(batch.input_ids, batch.attention_mask, batch.loss_mask, old, batch.advantages)


def test_off_policy_corrections_act_only_on_a_sampler_mismatch(model: Any, tokenizer: Any) -> None:
    batch = rollout_batch(model, tokenizer, tasks=2, group=2)
    plain = grads_after_step(copy.deepcopy(model), batch)
    for mode in ("token_tis", "sequence_tis", "sequence_mask"):
        same = grads_after_step(copy.deepcopy(model), batch, off_policy__correction=mode)
        for name in plain:  # no mismatch: weights 1, nothing masked
            assert torch.allclose(plain[name], same[name], atol=1e-6), (mode, name)
    # A sampler that under-weighted the later rows' tokens: rho = pi_learner / pi_sampler > 1.
    far = skewed(batch, shift=0.5)
    learner = Learner(
        copy.deepcopy(model), algo(off_policy__correction="token_tis"), temperature=1.0
    )
    metrics = learner.step(far)
    assert metrics["off_policy/tis_truncated_fraction"] > 0.0
    assert metrics["train/logprob_mismatch"] > 0.1
    unclipped = {"max_grad_norm": 1e9}  # compare raw gradients, not clipped ones
    masked = grads_after_step(
        copy.deepcopy(model),
        far,
        off_policy__correction="sequence_mask",
        off_policy__cap=2.0,
        **unclipped,
    )
    # Row 0 (no shift) survives the mask; rows with prod rho > 2 contribute nothing.
    keep_first = Batch(
        far.input_ids[:1], far.attention_mask[:1], far.loss_mask[:1], far.old_logprobs[:1],
        far.advantages[:1],
    )  # fmt: skip
    alone = grads_after_step(copy.deepcopy(model), keep_first, **unclipped)
    tokens_all, tokens_first = float(far.loss_mask.sum()), float(far.loss_mask[0].sum())
    for name in alone:  # token_mean divides by the whole batch's tokens
        assert torch.allclose(masked[name], alone[name] * tokens_first / tokens_all, atol=1e-6)


def test_the_entropy_bonus_raises_entropy(model: Any, tokenizer: Any) -> None:
    batch = rollout_batch(model, tokenizer, tasks=2, group=2)
    zero = Batch(
        batch.input_ids, batch.attention_mask, batch.loss_mask, batch.old_logprobs,
        torch.zeros_like(batch.advantages),
    )  # fmt: skip
    learner = Learner(
        copy.deepcopy(model), AlgorithmConfig(entropy_coef=1.0, lr=1e-2), temperature=1.0
    )
    before = learner.step(zero)["loss/entropy"]
    after = learner.step(zero)["loss/entropy"]
    assert after > before


def test_the_entropy_is_computed_only_where_it_is_used(
    model: Any, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The KL reference's forward and a second epoch would throw the entropy away: it is
    computed on the first pass only (the logged value), and on every pass when a bonus
    trains on it. The log-probs are the same without it."""
    batch = rollout_batch(model, tokenizer, tasks=2, group=2)
    args = (batch.input_ids, batch.attention_mask, batch.loss_mask, 1.0)
    with torch.no_grad():
        both, alone = token_logprobs(model, *args), token_logprobs(model, *args, with_entropy=False)
    assert alone[1] is None
    assert torch.equal(both[0], alone[0])
    assert both[1] is not None
    assert float(both[1].sum()) > 0
    calls: list[int] = []
    entropy_of = forward.entropy_of
    monkeypatch.setattr(forward, "entropy_of", lambda x: calls.append(len(x)) or entropy_of(x))
    for coef, passes in ((0.0, 1), (0.01, 2)):
        calls.clear()
        config = algo(epochs=2, kl__coef=0.1, entropy_coef=coef, micro_batch__size=64)
        metrics = Learner(copy.deepcopy(model), config, temperature=1.0).step(batch)
        assert calls == [int(batch.loss_mask[:, 1:].sum())] * passes  # one micro-batch
        assert metrics["loss/entropy"] > 0


def test_gspo_takes_one_advantage_per_sequence_from_per_token_values(
    model: Any, tokenizer: Any
) -> None:
    batch = rollout_batch(model, tokenizer, tasks=2, group=2)
    options = {"policy_loss": "gspo", "loss_reduction": "seq_mean_token_mean"}
    per_sequence = grads_after_step(copy.deepcopy(model), batch, **options)
    flat = Batch(
        batch.input_ids, batch.attention_mask, batch.loss_mask, batch.old_logprobs,
        batch.advantages[:, 0],
    )  # fmt: skip  # the [B] form of the same constant-per-row advantages
    same = grads_after_step(copy.deepcopy(model), flat, **options)
    for name in per_sequence:
        assert torch.allclose(per_sequence[name], same[name], atol=1e-7), name


def test_loss_options_are_validated() -> None:
    from turnrl.errors import ConfigError
    from turnrl.trainer.config import load_config

    for bad, match in [
        ("algorithm.clip.dual=0.5", "clip.dual"),
        ("algorithm.off_policy.cap=0", "off_policy.cap"),
        ("algorithm.entropy_coef=-1", "entropy_coef"),
        ("algorithm.off_policy.correction=magic", "off_policy"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_config("quickstart", [bad])
    with pytest.raises(ConfigError, match=r"clip\.dual"):
        load_config("quickstart", ["algorithm.policy_loss=gspo", "algorithm.clip.dual=3"])


def on_last_token(samples: list[Any], rewards: list[float]) -> list[list[float]]:
    """Per-token rewards: each sample's reward on its last sampled token."""
    rows = []
    for sample, reward in zip(samples, rewards, strict=True):
        row = [0.0] * len(sample.input_ids)
        row[max(i for i, m in enumerate(sample.loss_mask) if m)] = reward
        rows.append(row)
    return rows


def gae_samples(model: Any, tokenizer: Any) -> tuple[list[Any], list[float], int]:
    backend = TorchBackend(model, tokenizer)
    spec = GroupSpec(
        2, EpisodeLimits(max_tokens_per_turn=24),
        SamplingParams(stop_token_ids=stop_token_ids(tokenizer)), seed=5,
    )  # fmt: skip
    groups = asyncio.run(
        collect_groups(
            [SPEC.task(i) for i in range(2)], SPEC.make_env, backend, ChatRenderer(tokenizer), spec
        )
    )
    samples = [s for g in groups for t in g for s in t.samples()]
    rewards = [float(i % 2) for i in range(len(samples))]
    return samples, rewards, backend.pad_id


def test_ppo_with_a_fresh_critic_equals_whitened_returns(model: Any, tokenizer: Any) -> None:
    from turnrl.algorithms import masked_whiten

    samples, rewards, pad = gae_samples(model, tokenizer)
    config = AlgorithmConfig(advantage="gae", max_grad_norm=1e9)
    ppo = Learner(copy.deepcopy(model), config, temperature=1.0)
    ppo.optimizer.step = lambda *a, **k: None  # type: ignore[method-assign]
    ppo.step_samples_gae(samples, on_last_token(samples, rewards), pad)
    # V = 0 (zero-initialised head), gamma = lambda = 1: every sampled token's advantage is
    # its sequence's reward, whitened over all sampled tokens of the batch.
    batch = pack(samples, rewards, pad)
    whitened = masked_whiten(batch.advantages, batch.loss_mask)
    plain = Learner(copy.deepcopy(model), AlgorithmConfig(max_grad_norm=1e9), temperature=1.0)
    plain.optimizer.step = lambda *a, **k: None  # type: ignore[method-assign]
    plain.step(Batch(batch.input_ids, batch.attention_mask, batch.loss_mask,
                     batch.old_logprobs, whitened))  # fmt: skip
    grads = {n: p.grad for n, p in ppo.model.named_parameters() if p.grad is not None}
    expected = {n: p.grad for n, p in plain.model.named_parameters() if p.grad is not None}
    assert grads.keys() == expected.keys()
    for name in grads:
        assert torch.allclose(grads[name], expected[name], atol=1e-6), name


def two_turns(sample: Sample) -> Sample:
    """The sample with its middle sampled token unmasked (as if an observation sat there),
    so that its sampled tokens form two turns."""
    sampled = [i for i, m in enumerate(sample.loss_mask) if m]
    cut = sampled[len(sampled) // 2]
    mask = tuple(0 if i == cut else m for i, m in enumerate(sample.loss_mask))
    logprobs = tuple(0.0 if i == cut else lp for i, lp in enumerate(sample.logprobs))
    return Sample(sample.input_ids, mask, logprobs)


def test_turn_level_gae_is_wired_to_the_bi_level_estimator(model: Any, tokenizer: Any) -> None:
    from turnrl.algorithms import gae_advantages, masked_whiten, turn_level_gae_advantages

    samples, rewards, pad = gae_samples(model, tokenizer)
    samples = [two_turns(s) for s in samples]
    config = algo(advantage="gae", gae__level="turn", gae__turn_gamma=0.5, max_grad_norm=1e9)  # fmt: skip
    ppo = Learner(copy.deepcopy(model), config, temperature=1.0)
    ppo.optimizer.step = lambda *a, **k: None  # type: ignore[method-assign]
    ppo.step_samples_gae(samples, on_last_token(samples, rewards), pad)
    # V = 0 (fresh head): the advantages are the bi-level estimator's on zero values.
    batch = pack(samples, rewards, pad)
    token_rewards = pack(samples, [0.0] * len(samples), pad).advantages.clone()
    for i, row in enumerate(on_last_token(samples, rewards)):
        token_rewards[i, : len(row)] = torch.tensor(row)
    turn = turn_level_gae_advantages(token_rewards, torch.zeros_like(token_rewards),
                                     batch.loss_mask, turn_gamma=0.5)  # fmt: skip
    token = gae_advantages(token_rewards, torch.zeros_like(token_rewards), batch.loss_mask)
    assert not torch.allclose(turn.advantages, token.advantages)  # multi-turn: they differ
    whitened = masked_whiten(turn.advantages, batch.loss_mask)
    plain = Learner(copy.deepcopy(model), AlgorithmConfig(max_grad_norm=1e9), temperature=1.0)
    plain.optimizer.step = lambda *a, **k: None  # type: ignore[method-assign]
    plain.step(Batch(batch.input_ids, batch.attention_mask, batch.loss_mask,
                     batch.old_logprobs, whitened.float()))  # fmt: skip
    for name, param in ppo.model.named_parameters():
        if param.grad is not None:
            assert torch.allclose(param.grad, dict(plain.model.named_parameters())[name].grad,
                                  atol=1e-6), name  # fmt: skip


@pytest.mark.parametrize("critic", ["head", "model"])
def test_the_critic_learns_the_returns_and_leaves_the_policy_alone(
    model: Any, tokenizer: Any, critic: str
) -> None:
    samples, _, pad = gae_samples(model, tokenizer)
    rewards = [1.0] * len(samples)  # a target every critic can reach: V = 1 everywhere
    config = algo(advantage="gae", critic__placement=critic, critic__lr=5e-2, critic__epochs=4)
    learner = Learner(copy.deepcopy(model), config, temperature=1.0)
    learner.optimizer.step = lambda *a, **k: None  # type: ignore[method-assign]  # freeze policy
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    token_rewards = on_last_token(samples, rewards)
    errors = [learner.step_samples_gae(samples, token_rewards, pad)["critic/abs_error"]]
    for _ in range(4):
        errors.append(learner.step_samples_gae(samples, token_rewards, pad)["critic/abs_error"])
    assert errors[0] == pytest.approx(1.0)  # V = 0 to start
    assert errors[-1] < 0.5  # the values moved toward the returns
    for name, param in learner.model.named_parameters():  # the value loss never moved them
        assert torch.equal(param, before[name]), name
    assert learner.critic is not None
    assert (learner.critic.trunk is learner.model) == (critic == "head")


def test_packed_sequences_give_the_padded_log_probs_and_gradients(
    model: Any, tokenizer: Any
) -> None:
    batch = rollout_batch(model, tokenizer, tasks=3, group=3)
    # Cut the tails of some rows: lengths from the full width down to about half of it.
    width = batch.input_ids.shape[1]
    for i in range(1, batch.num_sequences, 2):
        cut = width // 2 + i
        batch.attention_mask[i, cut:] = 0
        batch.loss_mask[i, cut:] = False
    rows = pack_rows(batch.input_ids, batch.attention_mask)
    assert rows.input_ids.shape[0] < batch.num_sequences  # fewer rows than sequences
    assert rows.input_ids.numel() < batch.input_ids.numel()  # less padding
    assert batch.loss_mask.sum() > 0
    params = [p for p in model.parameters() if p.requires_grad]
    outs = {}
    for packed in (False, True):
        logp, ent = token_logprobs(
            model, batch.input_ids, batch.attention_mask, batch.loss_mask, 1.0,
            entropy_grad=True, layout="packed" if packed else "padded",
        )  # fmt: skip
        grads = torch.autograd.grad((logp * batch.advantages).sum() + ent.sum(), params)
        outs[packed] = (logp.detach(), ent.detach(), grads)
    assert torch.allclose(outs[True][0], outs[False][0], atol=1e-5)
    assert torch.allclose(outs[True][1], outs[False][1], atol=1e-5)
    for a, b in zip(outs[False][2], outs[True][2], strict=True):
        assert (a - b).abs().max() <= 1e-4 * a.abs().max() + 1e-8


def test_a_packed_learner_step_is_the_padded_one(model: Any, tokenizer: Any) -> None:
    batch = skewed(rollout_batch(model, tokenizer, tasks=2, group=3))
    options = {"kl__coef": 0.5, "loss_reduction": "seq_mean_token_mean"}
    padded = grads_after_step(copy.deepcopy(model), batch, **options)
    packed = grads_after_step(copy.deepcopy(model), batch, micro_batch__layout="packed", **options)
    for name in padded:
        assert torch.allclose(padded[name], packed[name], atol=1e-5), name


def test_micro_batches_respect_the_token_budget(model: Any) -> None:
    lengths = [50, 10, 30, 10, 45, 20, 5]
    for pack_sequences in (False, True):
        config = algo(
            micro_batch__size=3, micro_batch__tokens=90,
            micro_batch__layout="packed" if pack_sequences else "padded",
        )  # fmt: skip
        learner = Learner(model, config, temperature=1.0)
        parts = learner._parts(lengths)
        assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
        for part in parts:
            assert len(part) <= 3
            cost = (
                sum(lengths[i] for i in part)
                if pack_sequences
                else len(part) * max(lengths[i] for i in part)
            )
            assert cost <= 90 or len(part) == 1
    too_long = Learner(model, algo(micro_batch__tokens=8), temperature=1.0)
    assert too_long._parts([20, 30]) == [[0], [1]]  # a sequence over budget runs alone


def test_the_default_token_budget_follows_free_memory(model: Any) -> None:
    assert auto_token_budget(model) == 0  # on CPU: no budget, micro_batch_size alone
    small = auto_token_budget(model, free_bytes=1 << 30)
    large = auto_token_budget(model, free_bytes=8 << 30)
    assert 256 <= small < large
    assert abs(large / small - 8) < 0.01
    learner = Learner(model, algo(micro_batch__tokens=1234), temperature=1.0)
    assert learner.token_budget == 1234


def test_a_token_budget_gives_the_same_gradient(model: Any, tokenizer: Any) -> None:
    batch = rollout_batch(model, tokenizer, tasks=2, group=3)
    samples = [
        Sample(
            input_ids=tuple(batch.input_ids[i, : int(n)].tolist()),
            loss_mask=tuple(batch.loss_mask[i, : int(n)].tolist()),
            logprobs=tuple(batch.old_logprobs[i, : int(n)].tolist()),
        )
        for i, n in enumerate(batch.attention_mask.sum(-1))
    ]
    advantages = [float(batch.advantages[i, 0]) for i in range(len(samples))]

    def grads(**options: Any) -> dict[str, torch.Tensor]:
        m = copy.deepcopy(model)
        learner = Learner(m, algo(lr=1e-3, **options), temperature=1.0)
        learner.optimizer.step = lambda *a, **k: None  # type: ignore[method-assign]
        learner.step_samples(samples, advantages, pad_id=0)
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    whole = grads()
    budgeted = grads(micro_batch__tokens=2 * max(len(s.input_ids) for s in samples))
    for name in whole:
        assert torch.allclose(whole[name], budgeted[name], atol=1e-6), name


def test_auto_layout_pads_shared_prompts_and_packs_varied_lengths(
    model: Any, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    used: list[str] = []
    original = forward.pack_rows

    def spy(*args: Any, **kwargs: Any) -> Any:
        rows = original(*args, **kwargs)
        used.append("considered")
        return rows

    monkeypatch.setattr(forward, "pack_rows", spy)
    calls: list[int] = []
    base = model.base_model.forward

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(int(kwargs["input_ids"].numel()))
        return base(*args, **kwargs)

    monkeypatch.setattr(model.base_model, "forward", counting)
    agent = rollout_batch(model, tokenizer, tasks=2, group=3)  # one shared system prompt
    calls.clear()
    token_logprobs(model, agent.input_ids, agent.attention_mask, agent.loss_mask, 1.0,
                   layout="auto")  # fmt: skip
    assert len(calls) == 2  # the shared prefix once, then the rest of every row
    assert calls[0] < agent.input_ids.shape[1]
    varied = torch.zeros((4, 40), dtype=torch.long)
    mask = torch.zeros_like(varied)
    for i, n in enumerate((40, 10, 12, 30)):
        varied[i, :n] = torch.arange(5 + i, 5 + i + n)  # no common prefix
        mask[i, :n] = 1
    calls.clear()
    token_logprobs(model, varied, mask, mask.bool(), 1.0, layout="auto")
    assert len(calls) == 1  # one packed forward
    assert calls[0] == 3 * 40  # (40) (30 + 10) (12): three rows of 40 instead of four
    assert used
