"""Dr. GRPO, REINFORCE++ (and -baseline), masked whitening and GiGPO: docs/algorithms.md
test values, hand-computed cases, naive Python loops and hypothesis properties (masked
slots change nothing, padding and permutation, group advantages sum to zero and ignore a shift)."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

from conftest import F64, NAN, PROPERTY, bools, t
from turnrl.algorithms import (
    discounted_step_returns,
    dr_grpo_advantages,
    gigpo_advantages,
    grpo_advantages,
    kl_k1,
    masked_whiten,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    step_group_advantages,
)

POISON = st.sampled_from([math.inf, -math.inf, math.nan, 1e30])


def quarters(draw: st.DrawFn, n: int, lo: int = -8, hi: int = 8) -> list[float]:
    """Floats on a grid of quarters: sums and shifts are exact in float64."""
    return [q / 4 for q in draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n))]


def masks(draw: st.DrawFn, rows: int, cols: int) -> Tensor:
    flat = draw(st.lists(st.booleans(), min_size=rows * cols, max_size=rows * cols))
    return torch.tensor(flat, dtype=torch.bool).reshape(rows, cols)


# --- Dr. GRPO -----------------------------------------------------------------------------


def test_dr_grpo_vector() -> None:
    out = dr_grpo_advantages(t([[1, 0, 0, 0]]))
    torch.testing.assert_close(out, t([[0.75, -0.25, -0.25, -0.25]]))
    assert torch.equal(dr_grpo_advantages(t([[0.1, 0.1, 0.1]])), torch.zeros(1, 3, dtype=F64))


@PROPERTY
@given(data=st.data(), num_prompts=st.integers(1, 4), group_size=st.integers(2, 6))
def test_dr_grpo_sums_to_zero_and_ignores_a_shift(
    data: st.DataObject, num_prompts: int, group_size: int
) -> None:
    rewards = t(quarters(data.draw, num_prompts * group_size)).reshape(num_prompts, group_size)
    shift = data.draw(st.integers(-8, 8)) / 4
    out = dr_grpo_advantages(rewards)
    torch.testing.assert_close(out.sum(dim=1), torch.zeros(num_prompts, dtype=F64))
    torch.testing.assert_close(dr_grpo_advantages(rewards + shift), out)


# --- masked_whiten ------------------------------------------------------------------------


def test_masked_whiten_uses_valid_positions_of_the_whole_batch() -> None:
    values = t([[1.0, NAN, 3.0], [5.0, math.inf, -1.0]])
    mask = bools([[True, False, True], [True, False, True]])
    valid = [1.0, 3.0, 5.0, -1.0]
    mean, std = statistics.fmean(valid), statistics.stdev(valid)
    expected = t(
        [[(1 - mean) / std, 0, (3 - mean) / std], [(5 - mean) / std, 0, (-1 - mean) / std]]
    )
    torch.testing.assert_close(masked_whiten(values, mask, eps=0.0), expected)


@pytest.mark.parametrize(
    "mask",
    [[[True, True, False]], [[True, False, False]], [[False, False, False]]],
    ids=["equal-values", "one-value", "empty"],
)
def test_masked_whiten_gives_exact_zeros_without_spread(mask: list[list[bool]]) -> None:
    out = masked_whiten(t([[0.1, 0.1, NAN]]), bools(mask))
    assert torch.equal(out, torch.zeros(1, 3, dtype=F64))


# --- REINFORCE++ ------------------------------------------------------------------------


def test_reinforce_pp_hand_computed() -> None:
    # Row 0: two turns (token 1 is tool output), outcome 1; row 1: one turn, outcome 0.
    # KL 0.1 on every sampled token with kl_coef 0.5: a penalty of 0.05 per token.
    rewards = t([1.0, 0.0])
    mask = bools([[True, False, True], [True, True, False]])
    kl = t([[0.1, NAN, 0.1], [0.1, 0.1, math.inf]])
    out = reinforce_pp_advantages(rewards, mask, kl=kl, kl_coef=0.5, eps=0.0)
    # Returns: row 0 (0.9, -, 0.95), row 1 (-0.1, -0.05, -); whitened over the 4 tokens.
    returns = [0.9, 0.95, -0.1, -0.05]
    mean, std = statistics.fmean(returns), statistics.stdev(returns)
    a, b, c, d = ((g - mean) / std for g in returns)
    torch.testing.assert_close(out, t([[a, 0.0, b], [c, d, 0.0]]))


def test_reinforce_pp_without_kl_puts_the_outcome_on_every_sampled_token() -> None:
    out = reinforce_pp_advantages(t([1.0, 0.0]), bools([[True, True], [True, True]]), eps=0.0)
    # Returns are 1, 1, 0, 0: whitened with the unbiased std 1/sqrt(3).
    k = 0.5 * math.sqrt(3)
    torch.testing.assert_close(out, t([[k, k], [-k, -k]]))


def test_reinforce_pp_baseline_subtracts_the_group_mean_first() -> None:
    # Two prompts; prompt 1's rewards are all equal, so its centred rewards are exact zeros.
    rewards = t([[1.0, 0.0], [0.3, 0.3]])
    mask = torch.ones(4, 2, dtype=torch.bool)
    out = reinforce_pp_baseline_advantages(rewards, mask, eps=0.0)
    expected = reinforce_pp_advantages(t([0.5, -0.5, 0.0, 0.0]), mask, eps=0.0)
    torch.testing.assert_close(out, expected)


def test_reinforce_pp_baseline_with_groups_of_one_uses_a_zero_baseline() -> None:
    # Like GRPO's groups of one: no group mean to subtract, so the rewards go in as they are
    # (the mean of one reward is the reward itself, which would zero every advantage).
    rewards = t([[1.0], [0.0], [0.0]])
    mask = torch.ones(3, 2, dtype=torch.bool)
    out = reinforce_pp_baseline_advantages(rewards, mask, eps=0.0)
    torch.testing.assert_close(out, reinforce_pp_advantages(t([1.0, 0.0, 0.0]), mask, eps=0.0))
    assert out.abs().sum() > 0


def test_reinforce_pp_rejects_bad_layouts() -> None:
    with pytest.raises(ValueError, match="rewards must be"):
        reinforce_pp_advantages(t([[1.0]]), torch.ones(1, 2))
    with pytest.raises(ValueError, match="kl must be"):
        reinforce_pp_advantages(t([1.0]), torch.ones(1, 2), kl=torch.zeros(1, 3))
    with pytest.raises(ValueError, match="P\\*G"):
        reinforce_pp_baseline_advantages(t([[1.0, 0.0]]), torch.ones(3, 2))


def naive_reinforce_pp(
    rewards: list[float], mask: list[list[bool]], kl: list[list[float]], kl_coef: float
) -> list[list[float]]:
    """Token rewards, returns and whitening, one Python float at a time."""
    returns: list[list[float | None]] = []
    for reward, m, k in zip(rewards, mask, kl, strict=True):
        valid = [i for i, v in enumerate(m) if v]
        row: list[float | None] = [None] * len(m)
        running = 0.0
        for i in reversed(valid):
            running += (reward if i == valid[-1] else 0.0) - kl_coef * k[i]
            row[i] = running
        returns.append(row)
    flat = [g for row in returns for g in row if g is not None]
    if len(flat) < 2 or max(flat) == min(flat):
        return [[0.0] * len(row) for row in returns]
    mean, std = statistics.fmean(flat), statistics.stdev(flat)
    return [[0.0 if g is None else (g - mean) / (std + 1e-8) for g in row] for row in returns]


@st.composite
def reinforce_inputs(draw: st.DrawFn) -> tuple[Tensor, Tensor, Tensor, float]:
    num_seqs, num_tokens = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    rewards = t(quarters(draw, num_seqs))
    kl = t(quarters(draw, num_seqs * num_tokens, -2, 2)).reshape(num_seqs, num_tokens)
    kl_coef = draw(st.sampled_from([0.0, 0.1, 1.0]))
    return rewards, masks(draw, num_seqs, num_tokens), kl, kl_coef


@PROPERTY
@given(inputs=reinforce_inputs())
def test_reinforce_pp_matches_naive_loop(inputs: tuple[Tensor, Tensor, Tensor, float]) -> None:
    rewards, mask, kl, kl_coef = inputs
    out = reinforce_pp_advantages(rewards, mask, kl=kl, kl_coef=kl_coef)
    expected = naive_reinforce_pp(rewards.tolist(), mask.tolist(), kl.tolist(), kl_coef)
    torch.testing.assert_close(out, t(expected))


@PROPERTY
@given(data=st.data(), inputs=reinforce_inputs(), junk=POISON)
def test_reinforce_pp_ignores_masked_slots_padding_and_order(
    data: st.DataObject, inputs: tuple[Tensor, Tensor, Tensor, float], junk: float
) -> None:
    rewards, mask, kl, kl_coef = inputs
    out = reinforce_pp_advantages(rewards, mask, kl=kl, kl_coef=kl_coef)
    poisoned = reinforce_pp_advantages(
        rewards, mask, kl=torch.where(mask, kl, junk), kl_coef=kl_coef
    )
    assert torch.equal(poisoned, out)
    rows, cols = data.draw(st.integers(0, 2)), data.draw(st.integers(0, 2))
    padded = reinforce_pp_advantages(
        torch.nn.functional.pad(rewards, (0, rows), value=junk),
        torch.nn.functional.pad(mask, (0, cols, 0, rows), value=False),
        kl=torch.nn.functional.pad(torch.where(mask, kl, junk), (0, cols, 0, rows), value=junk),
        kl_coef=kl_coef,
    )
    num_seqs, num_tokens = mask.shape
    # Padding changes the shape, so the batch sums may associate differently: rounding only.
    torch.testing.assert_close(padded[:num_seqs, :num_tokens], out, rtol=1e-12, atol=1e-12)
    assert not (padded[num_seqs:] != 0).any()
    assert not (padded[:, num_tokens:] != 0).any()
    perm = data.draw(st.permutations(range(num_seqs)))
    permuted = reinforce_pp_advantages(rewards[perm], mask[perm], kl=kl[perm], kl_coef=kl_coef)
    torch.testing.assert_close(permuted, out[perm], rtol=1e-12, atol=1e-12)


@PROPERTY
@given(data=st.data(), num_prompts=st.integers(1, 3), group_size=st.integers(1, 4))
def test_reinforce_pp_baseline_ignores_a_constant_shift(
    data: st.DataObject, num_prompts: int, group_size: int
) -> None:
    rewards = t(quarters(data.draw, num_prompts * group_size)).reshape(num_prompts, group_size)
    mask = masks(data.draw, num_prompts * group_size, 3)
    shift = data.draw(st.integers(-8, 8)) / 4
    out = reinforce_pp_baseline_advantages(rewards, mask)
    torch.testing.assert_close(reinforce_pp_baseline_advantages(rewards + shift, mask), out)


def test_reinforce_pp_takes_a_k1_penalty_from_the_kl_module() -> None:
    logprobs = t([[-1.0, -2.0]])
    ref = t([[-1.5, -1.0]])
    mask = bools([[True, True]])
    kl = kl_k1(logprobs, ref, mask)  # (0.5, -1.0)
    out = reinforce_pp_advantages(t([1.0]), mask, kl=kl, kl_coef=1.0, eps=0.0)
    # Token rewards (-0.5, 1 + 1.0): returns (1.5, 2.0), whitened.
    s = statistics.stdev([1.5, 2.0])
    torch.testing.assert_close(out, t([[-0.25 / s, 0.25 / s]]))


# --- GiGPO ------------------------------------------------------------------------------


def test_gigpo_hand_computed() -> None:
    # One task, two trajectories of two steps. Both start from observation 7; trajectory 0
    # then sees observation 8 and succeeds (reward 1), trajectory 1 sees 9 and fails.
    step_rewards = t([[0.0, 1.0], [0.0, 0.0]])
    anchors = torch.tensor([[7, 8], [7, 9]])
    step_mask = torch.ones(2, 2, dtype=torch.bool)
    # Episode returns (1, 0): GRPO gives +-0.5 / std 0.7071 = +-1/sqrt(2) (up to eps).
    # Discounted step returns (0.95, 1) and (0, 0); anchor 7 holds (0.95, 0), which also
    # normalises to +-1/sqrt(2); anchors 8 and 9 are alone, so their step part is 0.
    out = gigpo_advantages(step_rewards, anchors, step_mask, group_size=2)
    r = 1 / math.sqrt(2)
    torch.testing.assert_close(out, t([[2 * r, r], [-2 * r, -r]]), atol=1e-5, rtol=0)
    mean_only = gigpo_advantages(step_rewards, anchors, step_mask, group_size=2, scale_by_std=False)
    torch.testing.assert_close(mean_only, t([[0.975, 0.5], [-0.975, -0.5]]))
    half = gigpo_advantages(
        step_rewards, anchors, step_mask, group_size=2, scale_by_std=False, omega=0.5
    )
    torch.testing.assert_close(half, t([[0.7375, 0.5], [-0.7375, -0.5]]))


def test_gigpo_groups_anchors_within_one_task_only() -> None:
    # Two tasks with one trajectory each that share an anchor id: no step group forms.
    step_returns = t([[1.0], [0.0]])
    anchors = torch.tensor([[3], [3]])
    out = step_group_advantages(step_returns, anchors, torch.ones(2, 1), group_size=1)
    assert torch.equal(out, torch.zeros(2, 1, dtype=F64))
    together = step_group_advantages(step_returns, anchors, torch.ones(2, 1), group_size=2)
    r = 1 / math.sqrt(2)  # (+-0.5) / std 0.7071
    torch.testing.assert_close(together, t([[r], [-r]]), atol=1e-5, rtol=0)


def test_discounted_step_returns_skip_masked_steps() -> None:
    rewards = t([[1.0, NAN, 2.0, 4.0]])
    mask = bools([[True, False, True, False]])
    out = discounted_step_returns(rewards, mask, gamma=0.5)
    assert torch.equal(out, t([[2.0, 0.0, 2.0, 0.0]]))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"anchor_ids": torch.zeros(2, 2)}, "integer"),
        ({"anchor_ids": torch.zeros(2, 3, dtype=torch.long)}, "integer"),
        ({"group_size": 3}, "multiple"),
        ({"step_mask": torch.ones(2, 3)}, "share one"),
    ],
)
def test_step_group_advantages_rejects_bad_inputs(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {
        "step_returns": torch.zeros(2, 2),
        "anchor_ids": torch.zeros(2, 2, dtype=torch.long),
        "step_mask": torch.ones(2, 2),
        "group_size": 2,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        step_group_advantages(**args)  # type: ignore[arg-type]


def naive_gigpo(
    step_rewards: list[list[float]],
    anchors: list[list[int]],
    mask: list[list[bool]],
    group_size: int,
    gamma: float,
    omega: float,
    scale_by_std: bool,
) -> list[list[float]]:
    """Dictionaries and loops, following the paper's equations 3 and 5-8."""
    eps = 1e-6

    def normalise(values: list[float], value: float) -> float:
        if len(values) < 2 or max(values) == min(values):
            return 0.0
        centered = value - statistics.fmean(values)
        return centered / (statistics.stdev(values) + eps) if scale_by_std else centered

    episode = [
        sum(r for r, m in zip(rs, ms, strict=True) if m)
        for rs, ms in zip(step_rewards, mask, strict=True)
    ]
    returns = []
    for rs, ms in zip(step_rewards, mask, strict=True):
        row, running = [0.0] * len(rs), 0.0
        for s in reversed(range(len(rs))):
            if ms[s]:
                running = rs[s] + gamma * running
                row[s] = running
        returns.append(row)
    groups: dict[tuple[int, int], list[float]] = defaultdict(list)
    for b, (ids, ms) in enumerate(zip(anchors, mask, strict=True)):
        for s, (anchor, valid) in enumerate(zip(ids, ms, strict=True)):
            if valid:
                groups[(b // group_size, anchor)].append(returns[b][s])
    out = []
    for b, (ids, ms) in enumerate(zip(anchors, mask, strict=True)):
        task = b // group_size
        members = episode[task * group_size : (task + 1) * group_size]
        episode_adv = episode[b] if group_size == 1 else normalise(members, episode[b])
        row = []
        for s, (anchor, valid) in enumerate(zip(ids, ms, strict=True)):
            step_adv = normalise(groups[(task, anchor)], returns[b][s]) if valid else 0.0
            row.append(episode_adv + omega * step_adv if valid else 0.0)
        out.append(row)
    return out


@st.composite
def gigpo_inputs(draw: st.DrawFn) -> tuple[Tensor, Tensor, Tensor, int]:
    num_prompts, group_size = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    num_rows, num_steps = num_prompts * group_size, draw(st.integers(1, 4))
    rewards = t(quarters(draw, num_rows * num_steps, 0, 4)).reshape(num_rows, num_steps)
    flat_ids = draw(
        st.lists(st.integers(0, 3), min_size=num_rows * num_steps, max_size=num_rows * num_steps)
    )
    anchors = torch.tensor(flat_ids).reshape(num_rows, num_steps)
    return rewards, anchors, masks(draw, num_rows, num_steps), group_size


@PROPERTY
@given(
    inputs=gigpo_inputs(),
    gamma=st.sampled_from([0.95, 1.0, 0.5]),
    omega=st.sampled_from([1.0, 0.5]),
    scale_by_std=st.booleans(),
)
def test_gigpo_matches_naive_loop(
    inputs: tuple[Tensor, Tensor, Tensor, int], gamma: float, omega: float, scale_by_std: bool
) -> None:
    rewards, anchors, mask, group_size = inputs
    out = gigpo_advantages(
        rewards,
        anchors,
        mask,
        group_size=group_size,
        gamma=gamma,
        omega=omega,
        scale_by_std=scale_by_std,
    )
    expected = naive_gigpo(
        rewards.tolist(), anchors.tolist(), mask.tolist(), group_size, gamma, omega, scale_by_std
    )
    torch.testing.assert_close(out, t(expected))


@PROPERTY
@given(inputs=gigpo_inputs(), shift=st.integers(-8, 8), scale_by_std=st.booleans())
def test_step_group_advantages_sum_to_zero_and_ignore_a_shift(
    inputs: tuple[Tensor, Tensor, Tensor, int], shift: int, scale_by_std: bool
) -> None:
    returns, anchors, mask, group_size = inputs
    out = step_group_advantages(
        returns, anchors, mask, group_size=group_size, scale_by_std=scale_by_std
    )
    shifted = step_group_advantages(
        returns + shift / 4, anchors, mask, group_size=group_size, scale_by_std=scale_by_std
    )
    torch.testing.assert_close(shifted, out)
    task = (torch.arange(returns.shape[0]) // group_size)[:, None].expand_as(anchors)
    for key in {(int(p), int(a)) for p, a in zip(task[mask], anchors[mask], strict=True)}:
        members = mask & (task == key[0]) & (anchors == key[1])
        torch.testing.assert_close(out[members].sum(), torch.zeros((), dtype=F64))


@PROPERTY
@given(data=st.data(), inputs=gigpo_inputs(), junk=POISON)
def test_gigpo_ignores_masked_steps_and_permutations(
    data: st.DataObject, inputs: tuple[Tensor, Tensor, Tensor, int], junk: float
) -> None:
    rewards, anchors, mask, group_size = inputs
    out = gigpo_advantages(rewards, anchors, mask, group_size=group_size)
    poisoned = gigpo_advantages(
        torch.where(mask, rewards, junk),
        torch.where(mask, anchors, data.draw(st.integers(-5, 5))),
        mask,
        group_size=group_size,
    )
    assert torch.equal(poisoned, out)
    assert not (out[~mask] != 0).any()
    # Permute tasks, and trajectories within each task: advantages follow their rows.
    num_prompts = rewards.shape[0] // group_size
    task_perm = data.draw(st.permutations(range(num_prompts)))
    member_perm = data.draw(st.permutations(range(group_size)))
    rows = [p * group_size + g for p in task_perm for g in member_perm]
    permuted = gigpo_advantages(rewards[rows], anchors[rows], mask[rows], group_size=group_size)
    torch.testing.assert_close(permuted, out[rows])


def test_gigpo_episode_part_is_grpo_on_the_returns() -> None:
    # With every step alone in its anchor group, GiGPO reduces to GRPO on episode returns.
    rewards = t([[0.0, 1.0], [0.5, 0.0], [0.0, 0.0]])
    anchors = torch.tensor([[0, 1], [2, 3], [4, 5]])
    out = gigpo_advantages(rewards, anchors, torch.ones(3, 2), group_size=3)
    grpo = grpo_advantages(t([[1.0, 0.5, 0.0]])).reshape(3, 1).expand(3, 2)
    torch.testing.assert_close(out, grpo)
