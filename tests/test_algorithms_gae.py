"""GAE and turn-level GAE over multi-turn sequences, and the turn helpers: docs/algorithms.md
vectors, hand-computed cases, naive per-token loops, and hypothesis properties (masked
observation tokens are skipped, whatever they hold; padding and permutation change nothing)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

from conftest import F64, NAN, PROPERTY, bools, t
from turnrl.algorithms import (
    gae_advantages,
    turn_end_mask,
    turn_index,
    turn_level_gae_advantages,
    turn_values_to_tokens,
)

# --- docs/algorithms.md test values and hand-computed cases ---------------------------------------


@pytest.mark.parametrize(
    ("lam", "expected"),
    [(1.0, [0.5, 0.4, 0.3]), (0.95, [0.46575, 0.385, 0.3])],
)
def test_gae_vectors(lam: float, expected: list[float]) -> None:
    out = gae_advantages(
        t([[0, 0, 1]]), t([[0.5, 0.6, 0.7]]), torch.ones(1, 3, dtype=torch.bool), gamma=1.0, lam=lam
    )
    torch.testing.assert_close(out.advantages, t([expected]))
    torch.testing.assert_close(out.returns, t([expected]) + t([[0.5, 0.6, 0.7]]))


@pytest.mark.parametrize(
    ("lam", "expected"),
    [(1.0, [0.5, 0.4, 0.3]), (0.95, [0.46575, 0.385, 0.3])],
)
def test_gae_vectors_with_observation_tokens_between_turns(
    lam: float, expected: list[float]
) -> None:
    # The same three sampled tokens with tool output (junk rewards and values) in between:
    # the recursion skips it, so the advantages of the sampled tokens are unchanged.
    rewards = t([[0, NAN, 0, math.inf, -5.0, 1, 7.0]])
    values = t([[0.5, math.inf, 0.6, NAN, 3.0, 0.7, NAN]])
    mask = bools([[True, False, True, False, False, True, False]])
    out = gae_advantages(rewards, values, mask, gamma=1.0, lam=lam)
    a, b, c = expected
    torch.testing.assert_close(out.advantages, t([[a, 0, b, 0, 0, c, 0]]))
    torch.testing.assert_close(out.returns, t([[a + 0.5, 0, b + 0.6, 0, 0, c + 0.7, 0]]))


def test_last_token_of_a_turn_bootstraps_from_the_next_turn() -> None:
    # Turn 1 is token 0, turn 2 is token 3; gamma applies once between them (not 3 times).
    rewards = t([[0.0, NAN, NAN, 1.0]])
    values = t([[0.5, NAN, NAN, 0.7]])
    mask = bools([[True, False, False, True]])
    out = gae_advantages(rewards, values, mask, gamma=0.9, lam=1.0)
    # A_3 = 1 - 0.7 = 0.3; A_0 = 0 + 0.9 * 0.7 - 0.5 + 0.9 * 0.3 = 0.4.
    torch.testing.assert_close(out.advantages, t([[0.4, 0.0, 0.0, 0.3]]))


def test_gae_of_an_empty_row_is_zero() -> None:
    out = gae_advantages(t([[NAN, 1.0]]), t([[1.0, NAN]]), bools([[False, False]]))
    assert torch.equal(out.advantages, torch.zeros(1, 2, dtype=F64))
    assert torch.equal(out.returns, torch.zeros(1, 2, dtype=F64))


def test_gae_carries_no_gradient() -> None:
    values = t([[0.5, 0.6]]).requires_grad_()
    out = gae_advantages(t([[0.0, 1.0]]), values, bools([[True, True]]))
    assert not out.advantages.requires_grad
    assert not out.returns.requires_grad


def test_gae_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="share one"):
        gae_advantages(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="share one"):
        turn_level_gae_advantages(torch.zeros(3), torch.zeros(3), torch.ones(3))


def test_turn_level_gae_hand_computed() -> None:
    # Two turns: tokens 0-1 (reward 0.5 at its end) and 3-4 (reward 1 at its end).
    rewards = t([[0.0, 0.5, NAN, 0.0, 1.0]])
    values = t([[0.1, 0.2, NAN, 0.3, 0.4]])
    mask = bools([[True, True, False, True, True]])
    out = turn_level_gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0, turn_gamma=0.95)
    # High level: A_2 = 1 - 0.4 = 0.6, G_2 = 1.0; A_1 = 0.5 + 0.95 * 0.4 - 0.2 + 0.95 * 0.6
    # = 1.25, G_1 = 1.45. Low level with gamma = lambda = 1: A_t = G_k - V_t.
    torch.testing.assert_close(out.advantages, t([[1.35, 1.25, 0.0, 0.7, 0.6]]))
    torch.testing.assert_close(out.returns, t([[1.45, 1.45, 0.0, 1.0, 1.0]]))


def test_turn_level_gae_resets_the_token_recursion_at_each_turn_end() -> None:
    # With turn_gamma = 0 the first turn sees nothing of the second turn's reward, although
    # token-level gamma = lambda = 1 would carry it across in plain GAE.
    rewards = t([[0.0, 0.0, NAN, 0.0, 1.0]])
    values = torch.zeros(1, 5, dtype=F64)
    mask = bools([[True, True, False, True, True]])
    bilevel = turn_level_gae_advantages(rewards, values, mask, turn_gamma=0.0)
    plain = gae_advantages(rewards, values, mask)
    torch.testing.assert_close(bilevel.advantages, t([[0.0, 0.0, 0.0, 1.0, 1.0]]))
    torch.testing.assert_close(plain.advantages, t([[1.0, 1.0, 0.0, 1.0, 1.0]]))


# --- Turn helpers -----------------------------------------------------------------------


def test_turn_helpers() -> None:
    mask = bools([[True, True, False, True, False, True], [False, False, True, True, True, False]])
    assert turn_end_mask(mask).tolist() == [
        [False, True, False, True, False, True],
        [False, False, False, False, True, False],
    ]
    assert turn_index(mask).tolist() == [[0, 0, -1, 1, -1, 2], [-1, -1, 0, 0, 0, -1]]
    spread = turn_values_to_tokens(t([[1.0, 2.0, 3.0], [4.0, NAN, NAN]]), mask)
    assert torch.equal(spread, t([[1, 1, 0, 2, 0, 3], [0, 0, 4, 4, 4, 0]]))


def test_turn_values_to_tokens_needs_a_value_per_turn() -> None:
    mask = bools([[True, False, True]])
    with pytest.raises(ValueError, match="2 turns"):
        turn_values_to_tokens(t([[1.0]]), mask)
    with pytest.raises(ValueError, match=r"\[B, S\]"):
        turn_values_to_tokens(t([1.0, 2.0]), mask)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        turn_index(bools([True]))


def test_turn_values_to_tokens_of_an_empty_mask() -> None:
    out = turn_values_to_tokens(torch.zeros(2, 0, dtype=F64), torch.zeros(2, 3, dtype=torch.bool))
    assert torch.equal(out, torch.zeros(2, 3, dtype=F64))


# --- Naive references and properties ------------------------------------------------------


@dataclass(frozen=True)
class Sequences:
    rewards: Tensor  # [B, T]
    values: Tensor  # [B, T]
    mask: Tensor  # [B, T] bool
    gamma: float
    lam: float


@st.composite
def sequences(draw: st.DrawFn) -> Sequences:
    num_seqs = draw(st.integers(1, 4))
    num_tokens = draw(st.integers(1, 8))
    n = num_seqs * num_tokens

    def floats() -> Tensor:
        return t(draw(st.lists(st.floats(-2, 2), min_size=n, max_size=n))).reshape(
            num_seqs, num_tokens
        )

    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n))).reshape(
        num_seqs, num_tokens
    )
    return Sequences(
        rewards=floats(),
        values=floats(),
        mask=mask,
        gamma=draw(st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.0])),
        lam=draw(st.sampled_from([1.0, 0.95, 0.5, 0.0])),
    )


def naive_gae(s: Sequences) -> list[list[float]]:
    """Per-sequence loop over the sampled positions only, one Python float at a time."""
    rewards, values, mask = s.rewards.tolist(), s.values.tolist(), s.mask.tolist()
    out = []
    for r, v, m in zip(rewards, values, mask, strict=True):
        row = [0.0] * len(r)
        next_value = next_advantage = 0.0
        for i in reversed([i for i, valid in enumerate(m) if valid]):
            delta = r[i] + s.gamma * next_value - v[i]
            row[i] = delta + s.gamma * s.lam * next_advantage
            next_value, next_advantage = v[i], row[i]
        out.append(row)
    return out


def runs(mask_row: list[bool]) -> list[list[int]]:
    """The turns of a row: maximal runs of sampled positions."""
    out: list[list[int]] = []
    for i, valid in enumerate(mask_row):
        if valid:
            if i > 0 and mask_row[i - 1]:
                out[-1].append(i)
            else:
                out.append([i])
    return out


def naive_turn_level_gae(s: Sequences, turn_gamma: float) -> list[list[float]]:
    rewards, values, mask = s.rewards.tolist(), s.values.tolist(), s.mask.tolist()
    out = []
    for r, v, m in zip(rewards, values, mask, strict=True):
        row = [0.0] * len(r)
        turns = runs(m)
        turn_return = {}
        next_value = next_advantage = 0.0
        for turn in reversed(turns):
            end = turn[-1]
            advantage = (
                r[end] + turn_gamma * next_value - v[end] + turn_gamma * s.lam * next_advantage
            )
            turn_return[end] = advantage + v[end]
            next_value, next_advantage = v[end], advantage
        for turn in turns:
            next_value = next_advantage = 0.0
            for i in reversed(turn):
                reward = turn_return[i] if i == turn[-1] else r[i]
                row[i] = reward + s.gamma * next_value - v[i] + s.gamma * s.lam * next_advantage
                next_value, next_advantage = v[i], row[i]
        out.append(row)
    return out


@PROPERTY
@given(s=sequences())
def test_gae_matches_naive_loop(s: Sequences) -> None:
    out = gae_advantages(s.rewards, s.values, s.mask, gamma=s.gamma, lam=s.lam)
    expected = t(naive_gae(s))
    torch.testing.assert_close(out.advantages, expected)
    torch.testing.assert_close(out.returns, torch.where(s.mask, expected + s.values, 0.0))


@PROPERTY
@given(s=sequences(), turn_gamma=st.sampled_from([0.95, 1.0, 0.5, 0.0]))
def test_turn_level_gae_matches_naive_loop(s: Sequences, turn_gamma: float) -> None:
    out = turn_level_gae_advantages(
        s.rewards, s.values, s.mask, gamma=s.gamma, lam=s.lam, turn_gamma=turn_gamma
    )
    expected = t(naive_turn_level_gae(s, turn_gamma))
    torch.testing.assert_close(out.advantages, expected)
    torch.testing.assert_close(out.returns, torch.where(s.mask, expected + s.values, 0.0))


@PROPERTY
@given(s=sequences(), turn_gamma=st.sampled_from([0.95, 0.5]))
def test_turn_level_gae_of_single_turn_sequences_is_gae(s: Sequences, turn_gamma: float) -> None:
    # Keep only the first turn of each row: with one turn the two levels collapse into GAE.
    first_turn = turn_index(s.mask) == 0
    bilevel = turn_level_gae_advantages(
        s.rewards, s.values, first_turn, gamma=s.gamma, lam=s.lam, turn_gamma=turn_gamma
    )
    plain = gae_advantages(s.rewards, s.values, first_turn, gamma=s.gamma, lam=s.lam)
    torch.testing.assert_close(bilevel.advantages, plain.advantages)


POISON = st.sampled_from([math.inf, -math.inf, math.nan, 1e30])
ESTIMATORS = {
    "gae": lambda r, v, m, g, lam: gae_advantages(r, v, m, gamma=g, lam=lam),
    "turn_level_gae": lambda r, v, m, g, lam: turn_level_gae_advantages(r, v, m, gamma=g, lam=lam),
}


@PROPERTY
@given(
    data=st.data(),
    s=sequences(),
    junk=POISON,
    name=st.sampled_from(sorted(ESTIMATORS)),
)
def test_inserted_observation_tokens_change_nothing(
    data: st.DataObject, s: Sequences, junk: float, name: str
) -> None:
    """Masked tokens (between turns, as padding) are skipped, whatever they hold."""
    estimator = ESTIMATORS[name]
    num_tokens = s.mask.shape[1]
    # Where to insert masked junk columns: before position i for each drawn i (T = append).
    inserts = data.draw(st.lists(st.integers(0, num_tokens), max_size=4))
    if name == "turn_level_gae":
        # A masked token between two sampled ones splits a turn, which is meant to matter;
        # insert only where no row has two sampled tokens side by side.
        row_mask = s.mask.tolist()
        inserts = [
            i
            for i in inserts
            if i in (0, num_tokens) or not any(m[i - 1] and m[i] for m in row_mask)
        ]
    order = sorted([(i, 0, True) for i in inserts] + [(i, 1, False) for i in range(num_tokens)])
    columns = [None if junk_col else i for i, _, junk_col in order]

    def widen(x: Tensor, fill: float | bool) -> Tensor:
        parts = [
            x[:, i : i + 1] if i is not None else torch.full_like(x[:, :1], fill) for i in columns
        ]
        return torch.cat(parts, dim=1)

    extra_rows = data.draw(st.integers(0, 2))
    wide_mask = widen(s.mask, False)
    wide = estimator(widen(s.rewards, junk), widen(s.values, junk), wide_mask, s.gamma, s.lam)
    wide_mask = torch.nn.functional.pad(wide_mask, (0, 0, 0, extra_rows), value=False)
    padded = estimator(
        torch.nn.functional.pad(widen(s.rewards, junk), (0, 0, 0, extra_rows), value=junk),
        torch.nn.functional.pad(widen(s.values, junk), (0, 0, 0, extra_rows), value=junk),
        wide_mask,
        s.gamma,
        s.lam,
    )
    out = estimator(s.rewards, s.values, s.mask, s.gamma, s.lam)
    for field in ("advantages", "returns"):
        narrow = getattr(out, field)
        assert torch.equal(getattr(wide, field)[widen(s.mask, False)], narrow[s.mask]), field
        assert torch.equal(getattr(padded, field)[wide_mask], narrow[s.mask]), field
        assert torch.isfinite(getattr(padded, field)).all()
        assert not (getattr(padded, field)[~wide_mask] != 0).any()


@PROPERTY
@given(data=st.data(), s=sequences(), name=st.sampled_from(sorted(ESTIMATORS)))
def test_permuting_sequences_permutes_advantages(
    data: st.DataObject, s: Sequences, name: str
) -> None:
    perm = data.draw(st.permutations(range(s.mask.shape[0])))
    estimator = ESTIMATORS[name]
    out = estimator(s.rewards, s.values, s.mask, s.gamma, s.lam)
    permuted = estimator(s.rewards[perm], s.values[perm], s.mask[perm], s.gamma, s.lam)
    assert torch.equal(permuted.advantages, out.advantages[perm])
    assert torch.equal(permuted.returns, out.returns[perm])
