"""Sample selection: DAPO dynamic-sampling filter, overlong shaping and filtering, StarPO-S
variance filter. docs/algorithms.md test values, one test per branch, and hypothesis properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import F64, PROPERTY, t
from turnrl.algorithms import (
    group_reward_std,
    informative_groups,
    overlong_filter_mask,
    overlong_penalty,
    top_variance_groups,
)

# --- DAPO dynamic sampling ---------------------------------------------------------------


def test_informative_groups_drop_all_equal_groups() -> None:
    rewards = t([[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0.1, 0.1, 0.1, 0.2]])
    assert informative_groups(rewards).tolist() == [True, False, False, True]
    assert informative_groups(t([[3.0]])).tolist() == [False]  # a group of one has no spread


# --- DAPO overlong shaping ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("length", "expected"),
    [
        pytest.param(16000, 0.0, id="short"),
        pytest.param(16384, 0.0, id="at-soft-limit"),
        pytest.param(18432, -0.5, id="inside-cache"),
        pytest.param(20480, -1.0, id="at-max"),
        pytest.param(21000, -1.0, id="beyond-max"),
    ],
)
def test_overlong_penalty_vectors(length: int, expected: float) -> None:
    out = overlong_penalty(torch.tensor([length]), max_length=20480, cache_length=4096)
    assert out.tolist() == [expected]


def test_overlong_penalty_is_continuous_and_monotone() -> None:
    lengths = torch.arange(15000, 22000)
    out = overlong_penalty(lengths, max_length=20480, cache_length=4096)
    assert out.is_floating_point()
    assert (out[1:] <= out[:-1]).all()
    assert out.diff().abs().max().item() <= 1 / 4096 + 1e-12


@pytest.mark.parametrize(("max_length", "cache_length"), [(100, 0), (100, 101), (100, -5)])
def test_overlong_penalty_rejects_bad_limits(max_length: int, cache_length: int) -> None:
    with pytest.raises(ValueError, match="cache_length"):
        overlong_penalty(torch.tensor([1]), max_length=max_length, cache_length=cache_length)


def test_overlong_filter_mask_removes_truncated_samples() -> None:
    mask = torch.tensor([[True, False, True], [True, True, False], [False, True, True]])
    truncated = torch.tensor([False, True, False])
    out = overlong_filter_mask(mask, truncated)
    assert out.tolist() == [[True, False, True], [False, False, False], [False, True, True]]
    assert out.dtype == torch.bool
    with pytest.raises(ValueError, match="truncated"):
        overlong_filter_mask(mask, torch.tensor([True]))


# --- StarPO-S variance filter ------------------------------------------------------------


def test_top_variance_groups_keeps_the_highest_std_groups() -> None:
    # Stds: 0, 0.5, 0.577, 0.577, 0 (two successes of four spread the most).
    rewards = t([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 0, 0]])
    assert top_variance_groups(rewards, 0.25).tolist() == [False, False, True, True, False]
    assert top_variance_groups(rewards, 0.5).tolist() == [False, True, True, True, False]
    assert top_variance_groups(rewards, 1.0).tolist() == [True] * 5


@pytest.mark.parametrize(
    ("num_groups", "keep_fraction", "num_kept"),
    [(8, 0.25, 2), (4, 0.25, 1), (3, 0.25, 1), (10, 0.3, 3), (5, 0.5, 3), (1, 0.01, 1)],
)
def test_top_variance_groups_count(num_groups: int, keep_fraction: float, num_kept: int) -> None:
    rewards = torch.arange(num_groups * 2, dtype=F64).reshape(num_groups, 2) ** 2
    assert int(top_variance_groups(rewards, keep_fraction).sum()) == num_kept


def test_top_variance_groups_breaks_ties_by_position() -> None:
    rewards = t([[0, 1], [0, 1], [0, 1], [0, 1]])
    assert top_variance_groups(rewards, 0.5).tolist() == [True, True, False, False]


@pytest.mark.parametrize("keep_fraction", [0.0, -0.1, 1.5])
def test_top_variance_groups_rejects_bad_fractions(keep_fraction: float) -> None:
    with pytest.raises(ValueError, match="keep_fraction"):
        top_variance_groups(t([[0, 1]]), keep_fraction)


@PROPERTY
@given(
    data=st.data(),
    num_prompts=st.integers(1, 8),
    group_size=st.integers(1, 5),
    keep_fraction=st.sampled_from([0.25, 0.5, 0.1, 1.0]),
)
def test_top_variance_groups_properties(
    data: st.DataObject, num_prompts: int, group_size: int, keep_fraction: float
) -> None:
    n = num_prompts * group_size
    quarters = data.draw(st.lists(st.integers(-4, 4), min_size=n, max_size=n))
    rewards = t(quarters).reshape(num_prompts, group_size) / 4
    keep = top_variance_groups(rewards, keep_fraction)
    std = group_reward_std(rewards)
    assert int(keep.sum()) == max(1, math.ceil(keep_fraction * num_prompts - 1e-9))
    if (~keep).any():
        assert std[keep].min() >= std[~keep].max()
    # A shift or a permutation of the groups changes nothing but which of equal-std groups
    # is kept (ties, or rounding of the shifted stds), so compare the kept stds as a multiset.
    kept_stds = t(sorted(std[keep].tolist()))
    shifted = top_variance_groups(rewards + 1.25, keep_fraction)
    torch.testing.assert_close(t(sorted(std[shifted].tolist())), kept_stds)
    perm = data.draw(st.permutations(range(num_prompts)))
    permuted = top_variance_groups(rewards[perm], keep_fraction)
    torch.testing.assert_close(t(sorted(std[perm][permuted].tolist())), kept_stds)
