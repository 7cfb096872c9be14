"""Advantage estimators and policy losses: docs/algorithms.md test values, one test per branch of
each clip, and hypothesis properties (masking, padding, permutation, on-policy reduction,
gradient accumulation, agreement with naive Python loops)."""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

import turnrl.algorithms
from conftest import F64, PROPERTY, t
from turnrl.algorithms import (
    PolicyLossOutput,
    clip_fraction,
    clipped_policy_loss,
    group_reward_std,
    grpo_advantages,
    masked_mean,
    masked_sum,
    policy_ratio,
    rloo_advantages,
    token_mean,
    zero_variance_groups,
)


def test_public_api_is_pinned() -> None:
    assert set(turnrl.algorithms.__all__) == {
        "KL_ESTIMATORS",
        "AdvantagesAndReturns",
        "ImportanceWeights",
        "MaskedWeights",
        "PolicyLossOutput",
        "SequenceMask",
        "ValueLossOutput",
        "cispo_policy_loss",
        "clip_fraction",
        "clipped_policy_loss",
        "clipped_value_loss",
        "decoupled_policy_loss",
        "discounted_step_returns",
        "distillation_advantages",
        "dr_grpo_advantages",
        "entropy_from_logits",
        "gae_advantages",
        "geometric_sequence_mask",
        "gigpo_advantages",
        "gmpo_policy_loss",
        "group_reward_std",
        "grpo_advantages",
        "gspo_policy_loss",
        "icepop_weights",
        "informative_groups",
        "kl_k1",
        "kl_k2",
        "kl_k3",
        "kl_k3_plus",
        "masked_mean",
        "masked_sum",
        "masked_whiten",
        "overlong_filter_mask",
        "overlong_penalty",
        "policy_lag_metrics",
        "policy_ratio",
        "reinforce_pp_advantages",
        "reinforce_pp_baseline_advantages",
        "rloo_advantages",
        "sapo_policy_loss",
        "seq_mean_token_mean",
        "seq_mean_token_sum",
        "seq_mean_token_sum_norm",
        "sequence_mis_weights",
        "sequence_ratio",
        "sequence_ratio_mask",
        "sequence_tis_weights",
        "step_group_advantages",
        "token_mean",
        "token_mis_weights",
        "token_tis_weights",
        "top_variance_groups",
        "turn_end_mask",
        "turn_index",
        "turn_level_gae_advantages",
        "turn_values_to_tokens",
        "zero_variance_groups",
    }


# --- Advantages: docs/algorithms.md test values -------------------------------------------------


def test_grpo_unbiased_vector() -> None:
    out = grpo_advantages(t([[1, 0, 0, 0]]))
    torch.testing.assert_close(out, t([[1.5, -0.5, -0.5, -0.5]]), atol=1e-5, rtol=0)


def test_grpo_population_std_vector() -> None:
    out = grpo_advantages(t([[1, 0, 0, 0]]), unbiased=False)
    torch.testing.assert_close(out, t([[1.7320, -0.5773, -0.5773, -0.5773]]), atol=1e-4, rtol=0)


def test_dr_grpo_vector() -> None:
    out = grpo_advantages(t([[1, 0, 0, 0]]), scale_by_std=False)
    torch.testing.assert_close(out, t([[0.75, -0.25, -0.25, -0.25]]))


def test_rloo_vector() -> None:
    out = rloo_advantages(t([[1, 0, 0, 0]]))
    torch.testing.assert_close(out, t([[1, -1 / 3, -1 / 3, -1 / 3]]))


def test_grpo_two_successes_vector() -> None:
    out = grpo_advantages(t([[1, 1, 0, 0]]))
    torch.testing.assert_close(out, t([[0.866, 0.866, -0.866, -0.866]]), atol=1e-3, rtol=0)


@pytest.mark.parametrize(
    "advantages",
    [
        grpo_advantages,
        lambda r: grpo_advantages(r, unbiased=False),
        lambda r: grpo_advantages(r, scale_by_std=False),
        rloo_advantages,
    ],
)
def test_equal_rewards_give_exact_zeros(advantages: Callable[[Tensor], Tensor]) -> None:
    # 0.1 is inexact in binary, so the group mean is not bit-equal to the rewards.
    rewards = t([[0.1, 0.1, 0.1], [7.0, 7.0, 7.0]])
    out = advantages(rewards)
    assert torch.equal(out, torch.zeros(2, 3, dtype=F64))


@pytest.mark.parametrize(
    "kwargs", [{}, {"unbiased": False}, {"scale_by_std": False}], ids=["grpo", "pop", "dr"]
)
def test_group_of_one_advantage_is_reward(kwargs: dict[str, bool]) -> None:
    rewards = t([[0.7], [-2.0], [0.0]])
    assert torch.equal(grpo_advantages(rewards, **kwargs), rewards)


def test_grpo_advantages_of_integer_rewards_are_float() -> None:
    out = grpo_advantages(torch.tensor([[1, 0, 0, 0]]))
    assert out.is_floating_point()
    torch.testing.assert_close(out, torch.tensor([[1.5, -0.5, -0.5, -0.5]]), atol=1e-5, rtol=0)


def test_rloo_needs_two_samples() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        rloo_advantages(t([[1.0], [0.0]]))


@pytest.mark.parametrize("shape", [(4,), (2, 2, 2), (3, 0)])
def test_advantages_reject_bad_layouts(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="rewards"):
        grpo_advantages(torch.zeros(shape))


def test_group_reward_std_and_zero_variance_groups() -> None:
    rewards = t([[1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    torch.testing.assert_close(group_reward_std(rewards), t([0.5, 0.0, math.sqrt(1 / 3)]))
    assert zero_variance_groups(rewards).tolist() == [False, True, False]


def test_group_of_one_has_zero_std_without_warning() -> None:
    # Warnings are errors here: torch's std of one sample would warn and return NaN.
    rewards = t([[3.0], [1.0]])
    assert torch.equal(group_reward_std(rewards), t([0.0, 0.0]))
    assert zero_variance_groups(rewards).tolist() == [True, True]


# --- Advantages: properties ------------------------------------------------------------


@st.composite
def reward_groups(draw: st.DrawFn, min_group: int = 2) -> Tensor:
    """[P, G] rewards on a grid of quarters, so shifts and sums are exact in float64."""
    num_prompts = draw(st.integers(1, 4))
    group_size = draw(st.integers(min_group, 6))
    quarters = draw(
        st.lists(
            st.integers(-12, 12),
            min_size=num_prompts * group_size,
            max_size=num_prompts * group_size,
        )
    )
    return torch.tensor(quarters, dtype=F64).reshape(num_prompts, group_size) / 4


GROUP_ESTIMATORS = {
    "grpo": grpo_advantages,
    "grpo_population": lambda r: grpo_advantages(r, unbiased=False),
    "dr_grpo": lambda r: grpo_advantages(r, scale_by_std=False),
    "rloo": rloo_advantages,
}


@PROPERTY
@given(rewards=reward_groups(), name=st.sampled_from(sorted(GROUP_ESTIMATORS)))
def test_group_advantages_sum_to_zero(rewards: Tensor, name: str) -> None:
    out = GROUP_ESTIMATORS[name](rewards)
    torch.testing.assert_close(out.sum(dim=1), torch.zeros(rewards.shape[0], dtype=F64))


@PROPERTY
@given(
    rewards=reward_groups(),
    shift=st.integers(-20, 20).map(lambda q: q / 4),
    name=st.sampled_from(sorted(GROUP_ESTIMATORS)),
)
def test_group_advantages_ignore_constant_shift(rewards: Tensor, shift: float, name: str) -> None:
    estimator = GROUP_ESTIMATORS[name]
    torch.testing.assert_close(estimator(rewards + shift), estimator(rewards))


@PROPERTY
@given(data=st.data(), rewards=reward_groups(), name=st.sampled_from(sorted(GROUP_ESTIMATORS)))
def test_group_advantages_follow_permutations(
    data: st.DataObject, rewards: Tensor, name: str
) -> None:
    num_prompts, group_size = rewards.shape
    prompt_perm = data.draw(st.permutations(range(num_prompts)))
    member_perm = data.draw(st.permutations(range(group_size)))
    permuted = rewards[prompt_perm][:, member_perm]
    estimator = GROUP_ESTIMATORS[name]
    torch.testing.assert_close(estimator(permuted), estimator(rewards)[prompt_perm][:, member_perm])


def naive_grpo(rewards: list[list[float]], eps: float, unbiased: bool) -> list[list[float]]:
    out = []
    for group in rewards:
        if len(group) == 1:
            out.append(list(group))
            continue
        mean = statistics.fmean(group)
        std = statistics.stdev(group) if unbiased else statistics.pstdev(group)
        if all(r == group[0] for r in group):
            out.append([0.0] * len(group))
        else:
            out.append([(r - mean) / (std + eps) for r in group])
    return out


def naive_rloo(rewards: list[list[float]]) -> list[list[float]]:
    return [
        [r - (sum(group) - r) / (len(group) - 1) for r in group]  # leave-one-out mean
        for group in rewards
    ]


@PROPERTY
@given(
    data=st.data(),
    num_prompts=st.integers(1, 4),
    group_size=st.integers(1, 6),
    unbiased=st.booleans(),
)
def test_grpo_matches_naive_loop(
    data: st.DataObject, num_prompts: int, group_size: int, unbiased: bool
) -> None:
    rows = data.draw(
        st.lists(
            st.lists(st.floats(-5, 5), min_size=group_size, max_size=group_size),
            min_size=num_prompts,
            max_size=num_prompts,
        )
    )
    out = grpo_advantages(t(rows), eps=1e-6, unbiased=unbiased)
    torch.testing.assert_close(out, t(naive_grpo(rows, 1e-6, unbiased)), atol=1e-6, rtol=1e-6)


@PROPERTY
@given(data=st.data(), num_prompts=st.integers(1, 4), group_size=st.integers(2, 6))
def test_rloo_matches_naive_loop(data: st.DataObject, num_prompts: int, group_size: int) -> None:
    rows = data.draw(
        st.lists(
            st.lists(
                st.integers(-12, 12).map(lambda q: q / 4), min_size=group_size, max_size=group_size
            ),
            min_size=num_prompts,
            max_size=num_prompts,
        )
    )
    torch.testing.assert_close(rloo_advantages(t(rows)), t(naive_rloo(rows)))


# --- Policy loss: docs/algorithms.md test values, one test per branch ---------------------------


def loss_at(
    ratio: float,
    advantage: float,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip: float | None = None,
) -> PolicyLossOutput:
    """The loss of one token whose ratio and advantage are given."""
    old = t([[-1.0]])
    return clipped_policy_loss(
        old + math.log(ratio),
        old,
        t([[advantage]]),
        torch.ones(1, 1, dtype=torch.bool),
        eps_low=eps_low,
        eps_high=eps_high,
        dual_clip=dual_clip,
    )


@pytest.mark.parametrize(
    ("ratio", "advantage", "eps_high", "dual_clip", "loss", "clipped"),
    [
        # A > 0, r above 1 + eps_high: the clipped term wins (clip-higher, then symmetric).
        pytest.param(1.5, 1.0, 0.28, None, -1.28, True, id="pos-adv-high-ratio-clipped"),
        pytest.param(1.5, 1.0, 0.2, None, -1.2, True, id="pos-adv-high-ratio-symmetric"),
        # A > 0, r below 1 - eps_low: min picks r A (unclipped).
        pytest.param(0.5, 1.0, 0.28, None, -0.5, False, id="pos-adv-low-ratio-unclipped"),
        # A < 0, r above 1 + eps_high: min picks r A (unclipped).
        pytest.param(1.5, -1.0, 0.28, None, 1.5, False, id="neg-adv-high-ratio-unclipped"),
        # A < 0, r below 1 - eps_low: the clipped term wins.
        pytest.param(0.5, -1.0, 0.28, None, 0.8, True, id="neg-adv-low-ratio-clipped"),
        # r inside the range: both terms agree, nothing is clipped.
        pytest.param(1.1, 1.0, 0.28, None, -1.1, False, id="pos-adv-inside"),
        pytest.param(0.9, -1.0, 0.28, None, 0.9, False, id="neg-adv-inside"),
        # A = 0: loss 0 whatever the ratio, and no clip is counted.
        pytest.param(5.0, 0.0, 0.28, None, 0.0, False, id="zero-adv"),
        # Dual clip, A < 0 and r > c: min(-A c, ...) picks -A c = 3 instead of 5.
        pytest.param(5.0, -1.0, 0.28, 3.0, 3.0, True, id="dual-clip-active"),
        # Dual clip, A < 0 and 1 + eps_high < r < c: the PPO term (-A r) stays.
        pytest.param(2.0, -1.0, 0.28, 3.0, 2.0, False, id="dual-clip-below-c"),
        # Dual clip, A < 0 and r below 1 - eps_low: the PPO clipped term stays.
        pytest.param(0.5, -1.0, 0.28, 3.0, 0.8, True, id="dual-clip-low-ratio"),
        # Dual clip never touches A > 0.
        pytest.param(5.0, 1.0, 0.28, 3.0, -1.28, True, id="dual-clip-pos-adv"),
    ],
)
def test_clip_branches(
    ratio: float,
    advantage: float,
    eps_high: float,
    dual_clip: float | None,
    loss: float,
    clipped: bool,
) -> None:
    out = loss_at(ratio, advantage, eps_high=eps_high, dual_clip=dual_clip)
    torch.testing.assert_close(out.per_token_loss, t([[loss]]))
    torch.testing.assert_close(out.ratio, t([[ratio]]))
    assert out.clipped.tolist() == [[clipped]]


@pytest.mark.parametrize(
    ("ratio", "advantage", "dual_clip", "grad_is_zero"),
    [
        (1.5, 1.0, None, True),  # clipped: no gradient
        (0.5, 1.0, None, False),  # unclipped: gradient -A r
        (0.5, -1.0, None, True),
        (5.0, -1.0, 3.0, True),  # dual clip: constant -A c
        (2.0, -1.0, 3.0, False),
    ],
)
def test_clipped_tokens_get_no_gradient(
    ratio: float, advantage: float, dual_clip: float | None, grad_is_zero: bool
) -> None:
    old = t([[-1.0]])
    logprobs = (old + math.log(ratio)).requires_grad_()
    out = clipped_policy_loss(
        logprobs, old, t([[advantage]]), torch.ones(1, 1), eps_high=0.28, dual_clip=dual_clip
    )
    out.per_token_loss.sum().backward()
    assert logprobs.grad is not None
    expected = 0.0 if grad_is_zero else -advantage * ratio  # d(-A r)/d logp = -A r
    torch.testing.assert_close(logprobs.grad, t([[expected]]))


def test_policy_ratio_is_clamped_and_one_where_masked() -> None:
    logprobs = t([[0.0, 0.0, 0.0]])
    old = t([[-100.0, 100.0, math.nan]])
    ratio = policy_ratio(logprobs, old, torch.tensor([[True, True, False]]))
    torch.testing.assert_close(ratio, t([[math.exp(20), math.exp(-20), 1.0]]))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"advantages": torch.zeros(2)}, "advantages"),
        ({"advantages": torch.zeros(2, 2)}, "advantages"),
        ({"old_logprobs": torch.zeros(2, 4)}, "share"),
        ({"loss_mask": torch.ones(2, 4)}, "share"),
        ({"logprobs": torch.zeros(6), "old_logprobs": torch.zeros(6)}, r"\[B, T\]"),
        ({"eps_low": -0.1}, "clip ranges"),
        ({"dual_clip": 1.0}, "dual_clip"),
    ],
)
def test_clipped_policy_loss_rejects_bad_inputs(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {
        "logprobs": torch.zeros(2, 3),
        "old_logprobs": torch.zeros(2, 3),
        "advantages": torch.zeros(2, 1),
        "loss_mask": torch.ones(2, 3),
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        clipped_policy_loss(**args)  # type: ignore[arg-type]


def test_clip_fraction_counts_valid_tokens_only() -> None:
    # ratios 1.5, 1.5, 1.0, 1.5 with A = +1; the last token is masked.
    old = torch.zeros(1, 4, dtype=F64)
    logprobs = torch.log(t([[1.5, 1.5, 1.0, 1.5]]))
    mask = torch.tensor([[True, True, True, False]])
    out = clipped_policy_loss(logprobs, old, t([[1.0]]), mask)
    torch.testing.assert_close(clip_fraction(out, mask), torch.tensor(2 / 3, dtype=F64))
    assert clip_fraction(out, torch.zeros_like(mask)).item() == 0.0


# --- Reductions --------------------------------------------------------------------------


def test_masked_reductions_ignore_nan_and_empty_masks() -> None:
    x = t([[1.0, math.nan, 3.0], [math.inf, 5.0, -math.inf]]).requires_grad_()
    mask = torch.tensor([[True, False, True], [False, True, False]])
    assert masked_sum(x, mask).item() == 9.0
    assert masked_mean(x, mask).item() == 3.0
    torch.testing.assert_close(masked_mean(x, mask, dim=1), t([2.0, 5.0]))
    torch.testing.assert_close(masked_sum(x, mask, dim=0), t([1.0, 5.0, 3.0]))
    masked_mean(x, mask).backward()
    assert x.grad is not None
    assert torch.equal(x.grad, t([[1 / 3, 0.0, 1 / 3], [0.0, 1 / 3, 0.0]]))
    empty = torch.zeros_like(mask)
    assert masked_mean(x, empty).item() == 0.0
    row_mask = torch.tensor([[True, False, True], [False, False, False]])
    assert masked_mean(x, row_mask, dim=1).tolist() == [2.0, 0.0]


def test_masked_mean_accepts_float_masks() -> None:
    x = t([[1.0, math.nan, 3.0]])
    assert masked_mean(x, t([[1.0, 0.0, 1.0]])).item() == 2.0


@pytest.mark.parametrize("num_tokens", [0, 0.0, torch.tensor(0)], ids=["int", "float", "tensor"])
def test_token_mean_with_zero_tokens_is_zero_with_a_gradient(num_tokens: object) -> None:
    loss = t([[1.0, math.nan]]).requires_grad_()
    mask = torch.zeros(1, 2, dtype=torch.bool)
    out = token_mean(loss, mask, num_tokens)  # type: ignore[arg-type]
    assert out.item() == 0.0
    out.backward()
    assert loss.grad is not None
    assert torch.equal(loss.grad, torch.zeros(1, 2, dtype=F64))


def test_token_mean_default_and_explicit_counts() -> None:
    loss = t([[1.0, 2.0, 100.0], [3.0, math.inf, 4.0]])
    mask = torch.tensor([[True, True, False], [True, False, True]])
    assert token_mean(loss, mask).item() == 2.5
    assert token_mean(loss, mask, num_tokens=10).item() == 1.0
    assert token_mean(loss, mask, num_tokens=torch.tensor(5)).item() == 2.0
    with pytest.raises(ValueError, match="num_tokens"):
        token_mean(loss, mask, num_tokens=-1)


# --- Policy loss: properties -------------------------------------------------------------


@dataclass(frozen=True)
class Batch:
    logprobs: Tensor  # [B, T]
    old_logprobs: Tensor  # [B, T]
    advantages: Tensor  # [B, T] or [B, 1]
    loss_mask: Tensor  # [B, T] bool
    eps_low: float
    eps_high: float
    dual_clip: float | None

    def loss(self, **overrides: Any) -> tuple[PolicyLossOutput, Tensor, dict[str, Tensor]]:
        """Per-token output, token-mean loss, and leaf tensors (with grads after backward)."""
        batch = replace(self, **overrides)
        leaves = {
            "logprobs": batch.logprobs.clone().requires_grad_(),
            "old_logprobs": batch.old_logprobs.clone().requires_grad_(),
            "advantages": batch.advantages.clone().requires_grad_(),
        }
        out = clipped_policy_loss(
            leaves["logprobs"],
            leaves["old_logprobs"],
            leaves["advantages"],
            batch.loss_mask,
            eps_low=batch.eps_low,
            eps_high=batch.eps_high,
            dual_clip=batch.dual_clip,
        )
        total = token_mean(out.per_token_loss, batch.loss_mask)
        total.backward()
        return out, total, leaves


def grad(leaves: dict[str, Tensor], name: str) -> Tensor:
    g = leaves[name].grad
    assert g is not None
    return g


@st.composite
def batches(draw: st.DrawFn, max_batch: int = 4, max_tokens: int = 6) -> Batch:
    num_seqs = draw(st.integers(1, max_batch))
    num_tokens = draw(st.integers(1, max_tokens))
    n = num_seqs * num_tokens

    def floats(lo: float, hi: float, size: int) -> list[float]:
        return draw(st.lists(st.floats(lo, hi), min_size=size, max_size=size))

    logprobs = t(floats(-4.0, 0.0, n)).reshape(num_seqs, num_tokens)
    # log-ratios up to ±1.5 reach past every clip boundary and the dual clip c = 3.
    old_logprobs = logprobs - t(floats(-1.5, 1.5, n)).reshape(num_seqs, num_tokens)
    per_sequence = draw(st.booleans())
    advantages = (
        t(floats(-2.0, 2.0, num_seqs)).reshape(num_seqs, 1)
        if per_sequence
        else t(floats(-2.0, 2.0, n)).reshape(num_seqs, num_tokens)
    )
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n))).reshape(
        num_seqs, num_tokens
    )
    return Batch(
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
        loss_mask=mask,
        eps_low=0.2,
        eps_high=draw(st.sampled_from([0.2, 0.28])),
        dual_clip=draw(st.sampled_from([None, 3.0])),
    )


POISON = st.sampled_from([math.inf, -math.inf, math.nan, 1e30, -1e30])


@PROPERTY
@given(batch=batches(), a=POISON, b=POISON, c=POISON)
def test_masked_slots_change_nothing_and_get_zero_gradient(
    batch: Batch, a: float, b: float, c: float
) -> None:
    mask = batch.loss_mask
    out, total, leaves = batch.loss()
    adv = batch.advantages
    # A per-sequence advantage is "masked" when its whole row is.
    adv_mask = mask if adv.shape == mask.shape else mask.any(dim=1, keepdim=True)
    # Anomaly mode raises if any backward step yields NaN, even one blocked further back.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "anomaly detection enabled"
        with torch.autograd.detect_anomaly(check_nan=True):
            poisoned_out, poisoned_total, poisoned = batch.loss(
                logprobs=torch.where(mask, batch.logprobs, a),
                old_logprobs=torch.where(mask, batch.old_logprobs, b),
                advantages=torch.where(adv_mask, adv, c),
            )
    assert torch.equal(poisoned_out.per_token_loss, out.per_token_loss)
    assert torch.equal(poisoned_out.clipped, out.clipped)
    assert torch.equal(poisoned_out.ratio, out.ratio)
    assert torch.equal(poisoned_total, total)
    assert not (out.per_token_loss[~mask] != 0).any()
    assert not out.clipped[~mask].any()
    for name in leaves:
        assert torch.equal(grad(poisoned, name), grad(leaves, name)), name
    for name in ("logprobs", "old_logprobs"):
        assert torch.equal(grad(poisoned, name)[~mask], torch.zeros_like(mask[~mask], dtype=F64))
    assert not (grad(poisoned, "advantages")[~adv_mask] != 0).any()


@PROPERTY
@given(batch=batches(), extra_rows=st.integers(0, 3), extra_cols=st.integers(0, 3), junk=POISON)
def test_appending_masked_rows_and_columns_changes_nothing(
    batch: Batch, extra_rows: int, extra_cols: int, junk: float
) -> None:
    num_seqs, num_tokens = batch.loss_mask.shape

    def pad(x: Tensor, value: float | bool) -> Tensor:
        cols = 0 if x.shape[1] == 1 else extra_cols  # a [B, 1] advantage gains rows only
        return torch.nn.functional.pad(x, (0, cols, 0, extra_rows), value=value)

    out, total, leaves = batch.loss()
    padded_out, padded_total, padded = batch.loss(
        logprobs=pad(batch.logprobs, junk),
        old_logprobs=pad(batch.old_logprobs, junk),
        advantages=pad(batch.advantages, junk),
        loss_mask=pad(batch.loss_mask, False),
    )
    assert torch.equal(padded_out.per_token_loss[:num_seqs, :num_tokens], out.per_token_loss)
    assert not (padded_out.per_token_loss[num_seqs:] != 0).any()
    assert not (padded_out.per_token_loss[:, num_tokens:] != 0).any()
    torch.testing.assert_close(padded_total, total, rtol=1e-12, atol=1e-12)
    for name in ("logprobs", "old_logprobs"):
        padded_grad = grad(padded, name)
        torch.testing.assert_close(padded_grad[:num_seqs, :num_tokens], grad(leaves, name))
        assert not (padded_grad[num_seqs:] != 0).any()
        assert not (padded_grad[:, num_tokens:] != 0).any()


@PROPERTY
@given(data=st.data(), batch=batches())
def test_permuting_sequences_changes_nothing(data: st.DataObject, batch: Batch) -> None:
    perm = data.draw(st.permutations(range(batch.loss_mask.shape[0])))
    out, total, leaves = batch.loss()
    permuted_out, permuted_total, permuted = batch.loss(
        logprobs=batch.logprobs[perm],
        old_logprobs=batch.old_logprobs[perm],
        advantages=batch.advantages[perm],
        loss_mask=batch.loss_mask[perm],
    )
    assert torch.equal(permuted_out.per_token_loss, out.per_token_loss[perm])
    assert torch.equal(permuted_out.clipped, out.clipped[perm])
    torch.testing.assert_close(permuted_total, total, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad(permuted, "logprobs"), grad(leaves, "logprobs")[perm])


@PROPERTY
@given(batch=batches())
def test_on_policy_loss_is_the_policy_gradient_surrogate(batch: Batch) -> None:
    mask = batch.loss_mask
    out, _, leaves = batch.loss(old_logprobs=batch.logprobs)
    adv = batch.advantages.expand_as(mask)
    expected = torch.where(mask, -adv, 0.0)  # -A r with r = 1
    assert torch.equal(out.per_token_loss, expected)
    assert clip_fraction(out, mask).item() == 0.0
    # d/dlogp of -A r at r = 1 is -A, spread over the valid tokens by the token mean.
    num_valid = max(int(mask.sum()), 1)
    torch.testing.assert_close(grad(leaves, "logprobs"), expected / num_valid)


@PROPERTY
@given(data=st.data(), batch=batches(max_batch=6))
def test_micro_batches_with_the_global_count_match_one_batch(
    data: st.DataObject, batch: Batch
) -> None:
    num_seqs = batch.loss_mask.shape[0]
    cuts = sorted(data.draw(st.sets(st.integers(1, num_seqs), max_size=3)) - {num_seqs})
    _, total, leaves = batch.loss()
    global_count = batch.loss_mask.sum()
    logprobs = batch.logprobs.clone().requires_grad_()
    accumulated = torch.zeros((), dtype=F64)
    for lo, hi in zip([0, *cuts], [*cuts, num_seqs], strict=True):
        out = clipped_policy_loss(
            logprobs[lo:hi],
            batch.old_logprobs[lo:hi],
            batch.advantages[lo:hi],
            batch.loss_mask[lo:hi],
            eps_low=batch.eps_low,
            eps_high=batch.eps_high,
            dual_clip=batch.dual_clip,
        )
        micro = token_mean(out.per_token_loss, batch.loss_mask[lo:hi], num_tokens=global_count)
        micro.backward()  # gradient accumulation, one backward per micro-batch
        accumulated = accumulated + micro.detach()
    torch.testing.assert_close(accumulated, total.detach(), rtol=1e-12, atol=1e-12)
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad, grad(leaves, "logprobs"), rtol=1e-12, atol=1e-12)


def naive_clipped_loss(batch: Batch) -> list[list[float]]:
    """PPO / clip-higher / dual-clip loss of each token, one Python float at a time."""
    rows = []
    for b, mask_row in enumerate(batch.loss_mask.tolist()):
        row = []
        for i, valid in enumerate(mask_row):
            if not valid:
                row.append(0.0)
                continue
            log_ratio = float(batch.logprobs[b, i]) - float(batch.old_logprobs[b, i])
            r = math.exp(min(max(log_ratio, -20.0), 20.0))
            a = float(batch.advantages[b, 0 if batch.advantages.shape[1] == 1 else i])
            r_clip = min(max(r, 1 - batch.eps_low), 1 + batch.eps_high)
            loss = -min(r * a, r_clip * a)
            if batch.dual_clip is not None and a < 0:
                loss = min(-a * batch.dual_clip, loss)
            row.append(loss)
        rows.append(row)
    return rows


@PROPERTY
@given(batch=batches())
def test_clipped_loss_matches_naive_loop(batch: Batch) -> None:
    out, _, _ = batch.loss()
    torch.testing.assert_close(out.per_token_loss, t(naive_clipped_loss(batch)))


# --- KL to a reference policy: docs/algorithms.md test values -----------------------------------


@pytest.mark.parametrize(
    ("pi_theta", "pi_ref", "expected"),
    [(0.5, 0.25, 0.193147), (0.25, 0.5, 0.306853), (0.3, 0.3, 0.0)],
)
def test_kl_k3_vectors(pi_theta: float, pi_ref: float, expected: float) -> None:
    logp = torch.tensor([[math.log(pi_theta)]], dtype=F64)
    ref = torch.tensor([[math.log(pi_ref)]], dtype=F64)
    value = turnrl.algorithms.kl_k3(logp, ref, torch.ones_like(logp, dtype=torch.bool))
    assert value.item() == pytest.approx(expected, abs=1e-6)


def test_kl_k3_is_zero_and_gradient_free_where_masked() -> None:
    logp = torch.tensor([[-1.0, float("nan"), -2.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.5, float("inf"), -0.5]], dtype=F64)
    mask = torch.tensor([[True, False, True]])
    kl = turnrl.algorithms.kl_k3(logp, ref, mask)
    assert kl[0, 1].item() == 0.0
    assert torch.isfinite(kl).all()
    kl.sum().backward()
    assert logp.grad is not None
    assert logp.grad[0, 1].item() == 0.0
    assert torch.isfinite(logp.grad).all()
