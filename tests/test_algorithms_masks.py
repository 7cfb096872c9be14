"""Off-policy masks: token and sequence MIS, IcePop, geometric-mean sequence rejection.
Hand-computed vectors, the masked share by reason, naive loops, poisoned masked slots,
overflow, bad bands."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

from conftest import F64, NAN, PROPERTY, bools, t
from turnrl.algorithms import (
    geometric_sequence_mask,
    icepop_weights,
    sequence_mis_weights,
    token_mis_weights,
)


def logprobs_with_ratios(ratios: list[list[float]]) -> tuple[Tensor, Tensor]:
    """(old_logprobs, sampler_logprobs) whose ratios old / sampler are ``ratios``."""
    sampler = torch.full((len(ratios), len(ratios[0])), -1.5, dtype=F64)
    return sampler + torch.log(t(ratios)), sampler


def metric(out: object, name: str) -> float:
    return float(out.metrics[name])  # type: ignore[attr-defined]


# --- Token MIS and IcePop ------------------------------------------------------------------


def test_token_mis_drops_what_tis_would_truncate_and_keeps_the_ratio_inside() -> None:
    old, sampler = logprobs_with_ratios([[3.0, 0.4, 1.5, 1.99]])
    out = token_mis_weights(old, sampler, bools([[True] * 4]), max_ratio=2.0)
    torch.testing.assert_close(out.weights, t([[0.0, 0.4, 1.5, 1.99]]))
    assert out.keep.tolist() == [[False, True, True, True]]
    assert metric(out, "mis_masked_fraction") == pytest.approx(0.25)
    assert metric(out, "mis_masked_high_fraction") == pytest.approx(0.25)
    assert metric(out, "mis_masked_low_fraction") == 0.0
    assert metric(out, "mis_ratio_max") == pytest.approx(3.0)
    assert metric(out, "mis_ratio_min") == pytest.approx(0.4)
    two_sided = token_mis_weights(old, sampler, bools([[True] * 4]), min_ratio=0.5)
    torch.testing.assert_close(two_sided.weights, t([[0.0, 0.0, 1.5, 1.99]]))
    assert metric(two_sided, "mis_masked_low_fraction") == pytest.approx(0.25)
    assert not out.weights.requires_grad


def test_icepop_is_a_two_sided_band_of_half_to_five() -> None:
    old, sampler = logprobs_with_ratios([[6.0, 0.4, 0.51, 4.9, 1.2, 1.0]])
    mask = bools([[True, True, True, True, True, False]])
    out = icepop_weights(old, sampler, mask)
    torch.testing.assert_close(out.weights, t([[0.0, 0.0, 0.51, 4.9, 1.2, 1.0]]))
    assert out.keep.tolist() == [[False, False, True, True, True, False]]
    assert metric(out, "icepop_masked_fraction") == pytest.approx(0.4)
    assert metric(out, "icepop_masked_high_fraction") == pytest.approx(0.2)
    assert metric(out, "icepop_masked_low_fraction") == pytest.approx(0.2)
    assert metric(out, "icepop_ratio_mean") == pytest.approx((6 + 0.4 + 0.51 + 4.9 + 1.2) / 5)


def test_token_masks_ignore_poison_in_masked_slots() -> None:
    old, sampler = logprobs_with_ratios([[1.5, 1.0, 1.0]])
    mask = bools([[True, False, False]])
    old[0, 1], sampler[0, 2] = NAN, math.inf
    for out in (token_mis_weights(old, sampler, mask), icepop_weights(old, sampler, mask)):
        torch.testing.assert_close(out.weights, t([[1.5, 1.0, 1.0]]))
        assert all(math.isfinite(float(v)) for v in out.metrics.values())


def test_a_batch_without_sampled_tokens_masks_nothing_and_reports_zeros() -> None:
    old, sampler = logprobs_with_ratios([[30.0]])
    out = token_mis_weights(old, sampler, bools([[False]]))
    assert out.weights.tolist() == [[1.0]]
    assert out.keep.tolist() == [[False]]
    assert all(float(v) == 0.0 for v in out.metrics.values())


# --- Sequence MIS and the geometric mask ----------------------------------------------------


def test_sequence_mis_weights_the_product_and_drops_whole_sequences() -> None:
    old, sampler = logprobs_with_ratios(
        [[1.5, 2.0], [1.5, 1.0], [0.5, 1.0], [1.0, 1.0]]
    )  # products 3.0, 1.5, 0.5, (empty row)
    mask = bools([[True, True], [True, False], [True, True], [False, False]])
    out = sequence_mis_weights(old, sampler, mask, max_ratio=2.0, min_ratio=0.6)
    torch.testing.assert_close(out.weights, t([[0.0], [1.5], [0.0], [1.0]]))
    assert out.keep.tolist() == [[False, False], [True, False], [False, False], [False, False]]
    assert metric(out, "seq_mis_masked_fraction") == pytest.approx(2 / 3)
    assert metric(out, "seq_mis_masked_high_fraction") == pytest.approx(1 / 3)
    assert metric(out, "seq_mis_masked_low_fraction") == pytest.approx(1 / 3)
    assert metric(out, "masked_token_fraction") == pytest.approx(4 / 5)
    assert metric(out, "seq_mis_log_ratio_max") == pytest.approx(math.log(3.0))
    assert metric(out, "seq_mis_log_ratio_min") == pytest.approx(math.log(0.5))


def test_sequence_mis_does_not_overflow_on_long_sequences() -> None:
    old = torch.full((2, 400), 0.0, dtype=F64)
    sampler = torch.full((2, 400), -1.0, dtype=F64)  # prod rho = e^400 on row 0
    sampler[1] = 0.0
    out = sequence_mis_weights(old, sampler, torch.ones(2, 400, dtype=torch.bool))
    assert out.weights.tolist() == [[0.0], [1.0]]
    assert metric(out, "seq_mis_log_ratio_max") == pytest.approx(400.0)


@pytest.mark.parametrize(
    ("ratios", "kept", "reason"),
    [
        pytest.param([1.002, 1.002], True, None, id="inside-wide"),
        pytest.param([1.0005, 0.9995], True, None, id="drift-cancels"),
        pytest.param([1.0015, 1.0015], False, "high", id="above"),
        pytest.param([0.99, 1.0], False, "low", id="below"),
    ],
)
def test_geometric_mask_bounds_the_per_token_geometric_mean(
    ratios: list[float], kept: bool, reason: str | None
) -> None:
    old, sampler = logprobs_with_ratios([ratios])
    wide = kept and reason is None and ratios[0] == 1.002
    band = {"min_ratio": 0.99, "max_ratio": 1.01} if wide else {}
    out = geometric_sequence_mask(old, sampler, bools([[True, True]]), **band)
    assert out.keep.tolist() == [kept]
    for side in ("high", "low"):
        share = metric(out, f"seq_geo_masked_{side}_fraction")
        assert share == (1.0 if side == reason else 0.0)
    g = math.log(math.prod(ratios)) / 2
    assert metric(out, "seq_geo_log_ratio_mean") == pytest.approx(g)


def test_the_geometric_mean_is_length_normalised_where_the_product_is_not() -> None:
    """Every token 1.5% off: the product leaves a [0.5, 2] band after 47 tokens, the
    geometric mean never leaves [0.98, 1.02] whatever the length."""
    for n in (10, 100):
        old, sampler = logprobs_with_ratios([[1.015] * n])
        mask = torch.ones(1, n, dtype=torch.bool)
        geo = geometric_sequence_mask(old, sampler, mask, min_ratio=0.98, max_ratio=1.02)
        seq = sequence_mis_weights(old, sampler, mask, min_ratio=0.5, max_ratio=2.0)
        assert geo.keep.tolist() == [True]
        assert seq.keep.any().item() is (n == 10)


@pytest.mark.parametrize("fn", [token_mis_weights, sequence_mis_weights, icepop_weights])
def test_a_band_must_be_positive_and_ordered(fn: object) -> None:
    old, sampler = logprobs_with_ratios([[1.0]])
    for bad in ({"max_ratio": 0.0}, {"min_ratio": 3.0, "max_ratio": 2.0}, {"min_ratio": -1.0}):
        with pytest.raises(ValueError, match="min_ratio <= max_ratio"):
            fn(old, sampler, bools([[True]]), **bad)  # type: ignore[operator]
    with pytest.raises(ValueError, match="min_ratio <= max_ratio"):
        geometric_sequence_mask(old, sampler, bools([[True]]), min_ratio=1.1, max_ratio=1.0)


def test_masks_reject_mismatched_shapes() -> None:
    old, sampler = logprobs_with_ratios([[1.0, 1.0]])
    for fn in (token_mis_weights, sequence_mis_weights, icepop_weights, geometric_sequence_mask):
        with pytest.raises(ValueError, match="one \\[B, T\\] shape"):
            fn(old, sampler[:, :1], bools([[True, True]]))


# --- Against a naive loop -------------------------------------------------------------------


@st.composite
def batches(draw: st.DrawFn) -> tuple[Tensor, Tensor, Tensor]:
    rows, cols = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    n = rows * cols
    log_rho = draw(st.lists(st.floats(-1.5, 1.5), min_size=n, max_size=n))
    mask = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    sampler = torch.full((rows, cols), -2.0, dtype=F64)
    return sampler + t(log_rho).reshape(rows, cols), sampler, bools(mask).reshape(rows, cols)


@PROPERTY
@given(batch=batches(), low=st.sampled_from([None, 0.5, 0.8]), high=st.sampled_from([1.2, 2.0]))
def test_masks_match_a_naive_loop(
    batch: tuple[Tensor, Tensor, Tensor], low: float | None, high: float
) -> None:
    old, sampler, mask = batch
    token = token_mis_weights(old, sampler, mask, min_ratio=low, max_ratio=high)
    seq = sequence_mis_weights(old, sampler, mask, min_ratio=low, max_ratio=high)
    geo = geometric_sequence_mask(old, sampler, mask, min_ratio=low, max_ratio=high)
    lo = low or 0.0
    dropped_tokens = 0
    for i in range(old.shape[0]):
        logs = [float(old[i, j] - sampler[i, j]) for j in range(old.shape[1]) if mask[i, j]]
        for j in range(old.shape[1]):
            if not mask[i, j]:
                assert token.weights[i, j] == 1.0
                continue
            rho = math.exp(float(old[i, j] - sampler[i, j]))
            inside = lo <= rho <= high
            assert token.weights[i, j].item() == pytest.approx(rho if inside else 0.0)
        product = math.exp(sum(logs))
        inside = not logs or lo <= product <= high
        assert seq.weights[i, 0].item() == pytest.approx(
            product if inside and logs else 1.0 if not logs else 0.0
        )
        dropped_tokens += 0 if inside else len(logs)
        mean = math.exp(sum(logs) / len(logs)) if logs else 1.0
        assert geo.keep[i].item() == (not logs or lo <= mean <= high)
    total = int(mask.sum())
    assert metric(seq, "masked_token_fraction") == pytest.approx(
        dropped_tokens / total if total else 0.0
    )
