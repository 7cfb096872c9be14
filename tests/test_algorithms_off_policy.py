"""Off-policy correction: token and sequence truncated importance sampling, sequence masking,
decoupled PPO and policy-lag metrics. docs/algorithms.md test values, one test per branch, naive
loops and hypothesis properties (masked slots, on-policy identity, detached weights)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

from conftest import F64, NAN, PROPERTY, bools, t
from turnrl.algorithms import (
    clip_fraction,
    clipped_policy_loss,
    decoupled_policy_loss,
    policy_lag_metrics,
    sequence_ratio_mask,
    sequence_tis_weights,
    token_mean,
    token_tis_weights,
)

POISON = st.sampled_from([math.inf, -math.inf, math.nan, 1e30, -1e30])


def logprobs_with_ratios(ratios: list[list[float]]) -> tuple[Tensor, Tensor]:
    """(old_logprobs, sampler_logprobs) whose ratios old / sampler are ``ratios``."""
    sampler = torch.full((len(ratios), len(ratios[0])), -1.5, dtype=F64)
    return sampler + torch.log(t(ratios)), sampler


# --- Token TIS ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ratio", "weight"),
    [
        pytest.param(3.0, 2.0, id="above-cap-truncated"),
        pytest.param(0.4, 0.4, id="below-one-kept"),
        pytest.param(2.0, 2.0, id="at-cap"),
    ],
)
def test_token_tis_vectors(ratio: float, weight: float) -> None:
    old, sampler = logprobs_with_ratios([[ratio]])
    out = token_tis_weights(old, sampler, bools([[True]]), cap=2.0)
    torch.testing.assert_close(out.weights, t([[weight]]))


def test_token_tis_weights_are_detached_and_one_where_masked() -> None:
    old, sampler = logprobs_with_ratios([[3.0, 0.4, 1.0]])
    old = torch.where(bools([[True, True, False]]), old, NAN).requires_grad_()
    out = token_tis_weights(old, sampler, bools([[True, True, False]]))
    assert not out.weights.requires_grad
    torch.testing.assert_close(out.weights, t([[2.0, 0.4, 1.0]]))
    torch.testing.assert_close(out.metrics["tis_ratio_mean"], t(1.7))
    torch.testing.assert_close(out.metrics["tis_ratio_max"], t(3.0))
    torch.testing.assert_close(out.metrics["tis_ratio_min"], t(0.4))
    torch.testing.assert_close(out.metrics["tis_truncated_fraction"], t(0.5))
    d = [math.log(3.0), math.log(0.4)]
    torch.testing.assert_close(out.metrics["mismatch_kl_k1"], t(-sum(d) / 2))
    k3 = sum(math.exp(x) - 1 - x for x in d) / 2
    torch.testing.assert_close(out.metrics["mismatch_kl_k3"], t(k3))
    assert all(not m.requires_grad and m.ndim == 0 for m in out.metrics.values())


def test_token_tis_without_cap_keeps_the_full_ratio() -> None:
    old, sampler = logprobs_with_ratios([[3.0]])
    out = token_tis_weights(old, sampler, bools([[True]]), cap=None)
    torch.testing.assert_close(out.weights, t([[3.0]]))
    assert out.metrics["tis_truncated_fraction"].item() == 0.0


def test_token_tis_metrics_of_an_empty_mask_are_zero() -> None:
    old, sampler = logprobs_with_ratios([[3.0]])
    out = token_tis_weights(old, sampler, bools([[False]]))
    assert torch.equal(out.weights, t([[1.0]]))
    assert all(m.item() == 0.0 for m in out.metrics.values())


def test_off_policy_functions_reject_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="share one"):
        token_tis_weights(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="share one"):
        sequence_tis_weights(torch.zeros(3), torch.zeros(3), torch.ones(3))
    with pytest.raises(ValueError, match="cap"):
        token_tis_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), cap=0.0)
    with pytest.raises(ValueError, match="cap"):
        sequence_tis_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), cap=-1.0)


# --- Sequence TIS and masking -------------------------------------------------------------


@pytest.mark.parametrize(
    ("ratios", "weight", "truncated"),
    [
        pytest.param([1.5, 1.5, 1.0], 2.0, True, id="product-above-cap"),
        pytest.param([1.2, 0.5, 1.0], 0.6, False, id="product-below-cap"),
    ],
)
def test_sequence_tis_vectors(ratios: list[float], weight: float, truncated: bool) -> None:
    old, sampler = logprobs_with_ratios([ratios])
    mask = bools([[True, True, False]])  # the third token is masked: the product is of two
    old = torch.where(mask, old, math.inf)
    out = sequence_tis_weights(old, sampler, mask, cap=2.0)
    torch.testing.assert_close(out.weights, t([[weight]]))
    assert out.metrics["seq_tis_truncated_fraction"].item() == float(truncated)
    product = ratios[0] * ratios[1]
    torch.testing.assert_close(out.metrics["seq_tis_log_ratio_mean"], t(math.log(product)))


def test_sequence_tis_does_not_overflow_on_long_sequences() -> None:
    old, sampler = logprobs_with_ratios([[1.5] * 3000, [0.5] * 3000])
    out = sequence_tis_weights(old, sampler, torch.ones(2, 3000, dtype=torch.bool))
    assert torch.isfinite(out.weights).all()
    torch.testing.assert_close(out.weights, t([[2.0], [0.0]]))


@pytest.mark.parametrize(
    ("ratios", "max_ratio", "min_ratio", "kept"),
    [
        pytest.param([1.5, 1.5], 2.0, None, False, id="above-max-dropped"),
        pytest.param([1.2, 1.5], 2.0, None, True, id="below-max-kept"),
        pytest.param([0.1, 0.5], 2.0, None, True, id="low-kept-without-min"),
        pytest.param([0.1, 0.5], 2.0, 0.5, False, id="below-min-dropped"),
        pytest.param([0.8, 0.9], 2.0, 0.5, True, id="inside-both-bounds"),
    ],
)
def test_sequence_ratio_mask_branches(
    ratios: list[float], max_ratio: float, min_ratio: float | None, kept: bool
) -> None:
    old, sampler = logprobs_with_ratios([ratios, [1.0, 1.0]])
    out = sequence_ratio_mask(
        old, sampler, torch.ones(2, 2, dtype=torch.bool), max_ratio=max_ratio, min_ratio=min_ratio
    )
    assert out.keep.tolist() == [kept, True]
    assert out.metrics["seq_mask_masked_fraction"].item() == (0.0 if kept else 0.5)


def test_sequence_ratio_mask_keeps_empty_sequences_and_checks_bounds() -> None:
    old, sampler = logprobs_with_ratios([[9.0, 9.0]])
    out = sequence_ratio_mask(old, sampler, bools([[False, False]]))
    assert out.keep.tolist() == [True]
    assert out.metrics["seq_mask_masked_fraction"].item() == 0.0
    with pytest.raises(ValueError, match="min_ratio"):
        sequence_ratio_mask(old, sampler, bools([[True, True]]), max_ratio=1.0, min_ratio=2.0)


# --- Decoupled PPO ----------------------------------------------------------------------


def test_decoupled_policy_loss_weights_the_ppo_loss_against_the_proximal_policy() -> None:
    # u = pi_theta / pi_prox = 1.5 (clipped at 1.2 for A > 0); pi_prox / pi_behav = 0.5.
    prox = t([[-1.0, -1.0]])
    logprobs = (prox + math.log(1.5)).requires_grad_()
    sampler = prox - math.log(0.5)
    mask = bools([[True, False]])
    out = decoupled_policy_loss(logprobs, prox, sampler, t([[1.0]]), mask)
    torch.testing.assert_close(out.per_token_loss, t([[-0.5 * 1.2, 0.0]]))
    assert out.clipped.tolist() == [[True, False]]
    torch.testing.assert_close(out.ratio, t([[1.5, 1.0]]))
    capped = decoupled_policy_loss(
        logprobs, prox, prox - math.log(4.0), t([[-1.0]]), mask, max_weight=2.0
    )
    # A < 0, u = 1.5 above the range: unclipped -A u = 1.5, weight min(4, 2) = 2.
    torch.testing.assert_close(capped.per_token_loss, t([[3.0, 0.0]]))
    token_mean(capped.per_token_loss, mask).backward()
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad, t([[2.0 * 1.5, 0.0]]))  # w * (-A) * u


@st.composite
def batches(draw: st.DrawFn) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    rows, cols = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    n = rows * cols

    def floats(lo: float, hi: float, size: int = n) -> Tensor:
        return t(draw(st.lists(st.floats(lo, hi), min_size=size, max_size=size)))

    logprobs = floats(-4, 0).reshape(rows, cols)
    old = logprobs - floats(-1, 1).reshape(rows, cols)
    sampler = old - floats(-1.5, 1.5).reshape(rows, cols)
    advantages = floats(-2, 2, rows).reshape(rows, 1)
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n))).reshape(rows, cols)
    return logprobs, old, sampler, advantages, mask


@PROPERTY
@given(batch=batches(), cap=st.sampled_from([None, 2.0, 1.5]))
def test_decoupled_loss_and_tis_match_naive_loop(
    batch: tuple[Tensor, Tensor, Tensor, Tensor, Tensor], cap: float | None
) -> None:
    logprobs, old, sampler, advantages, mask = batch
    out = decoupled_policy_loss(
        logprobs, old, sampler, advantages, mask, eps_high=0.28, max_weight=cap
    )
    weights = token_tis_weights(old, sampler, mask, cap=cap).weights
    expected_loss, expected_weights = [], []
    for b, mask_row in enumerate(mask.tolist()):
        loss_row, weight_row = [], []
        for i, valid in enumerate(mask_row):
            rho = math.exp(float(old[b, i]) - float(sampler[b, i]))
            w = rho if cap is None else min(rho, cap)
            u = math.exp(float(logprobs[b, i]) - float(old[b, i]))
            a = float(advantages[b, 0])
            ppo = -min(u * a, min(max(u, 0.8), 1.28) * a)
            loss_row.append(w * ppo if valid else 0.0)
            weight_row.append(w if valid else 1.0)
        expected_loss.append(loss_row)
        expected_weights.append(weight_row)
    torch.testing.assert_close(out.per_token_loss, t(expected_loss))
    torch.testing.assert_close(weights, t(expected_weights))


@PROPERTY
@given(batch=batches(), a=POISON, b=POISON, c=POISON)
def test_masked_slots_change_nothing(
    batch: tuple[Tensor, Tensor, Tensor, Tensor, Tensor], a: float, b: float, c: float
) -> None:
    logprobs, old, sampler, advantages, mask = batch
    poisoned = (
        torch.where(mask, logprobs, a),
        torch.where(mask, old, b),
        torch.where(mask, sampler, c),
    )

    def run(lp: Tensor, o: Tensor, s: Tensor) -> tuple[Tensor, ...]:
        leaf = lp.clone().requires_grad_()
        loss = decoupled_policy_loss(leaf, o, s, advantages, mask, max_weight=2.0)
        token_mean(loss.per_token_loss, mask).backward()
        assert leaf.grad is not None
        token = token_tis_weights(o, s, mask)
        seq = sequence_tis_weights(o, s, mask)
        seq_mask = sequence_ratio_mask(o, s, mask)
        return (
            loss.per_token_loss.detach(),
            leaf.grad,
            token.weights,
            *token.metrics.values(),
            seq.weights,
            *seq.metrics.values(),
            seq_mask.keep,
            *seq_mask.metrics.values(),
        )

    clean = run(logprobs, old, sampler)
    dirty = run(*poisoned)
    for x, y in zip(clean, dirty, strict=True):
        assert torch.equal(x, y)
    assert not (clean[1][~mask] != 0).any()


@PROPERTY
@given(batch=batches())
def test_on_policy_identity(batch: tuple[Tensor, Tensor, Tensor, Tensor, Tensor]) -> None:
    logprobs, _, _, advantages, mask = batch
    token = token_tis_weights(logprobs, logprobs, mask)
    assert torch.equal(token.weights, torch.ones_like(logprobs))
    assert token.metrics["tis_truncated_fraction"].item() == 0.0
    assert token.metrics["mismatch_kl_k3"].item() == 0.0
    seq = sequence_tis_weights(logprobs, logprobs, mask)
    assert torch.equal(seq.weights, torch.ones(logprobs.shape[0], 1, dtype=F64))
    assert sequence_ratio_mask(logprobs, logprobs, mask).keep.all()
    out = decoupled_policy_loss(logprobs, logprobs, logprobs, advantages, mask)
    plain = clipped_policy_loss(logprobs, logprobs, advantages, mask)
    assert torch.equal(out.per_token_loss, plain.per_token_loss)
    assert torch.equal(out.per_token_loss, torch.where(mask, -advantages, 0.0))
    assert clip_fraction(out, mask).item() == 0.0


# --- Policy lag -------------------------------------------------------------------------


def test_policy_lag_metrics() -> None:
    out = policy_lag_metrics(torch.tensor([5, 4, 5, 2]), learner_version=5)
    assert out["policy_lag_mean"].item() == 1.0
    assert out["policy_lag_max"].item() == 3.0
    empty = policy_lag_metrics(torch.tensor([], dtype=torch.long), learner_version=5)
    assert empty["policy_lag_mean"].item() == 0.0
    with pytest.raises(ValueError, match="newer policy"):
        policy_lag_metrics(torch.tensor([6]), learner_version=5)
    with pytest.raises(ValueError, match=r"\[B\]"):
        policy_lag_metrics(torch.tensor([[1]]), learner_version=5)
