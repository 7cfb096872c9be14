"""Credit assignment in the loop (trainer/credit.py): GiGPO turn advantages from real
trajectory structure, exact anchor contexts, token alignment with Trajectory.samples."""

from __future__ import annotations

import pytest
import torch

from turnrl.algorithms import gigpo_advantages
from turnrl.rollout.batch import pack
from turnrl.trainer.credit import (
    gigpo_turn_advantages,
    token_advantages,
    turn_contexts,
)
from turnrl.types import Trajectory, Turn


def turn(prompt: tuple[int, ...], completion: tuple[int, ...], new_sample: bool = False) -> Turn:
    return Turn(prompt, completion, tuple(-0.5 for _ in completion), "stop", new_sample=new_sample)


def lookup_episode(index: int, key: int, value: int, answer: int) -> Trajectory:
    """Question (1, 2), a call for ``key``, the tool's ``value``, then ``answer``."""
    return Trajectory(
        task_id="t",
        sample_index=index,
        turns=[turn((1, 2), (10, key)), turn((20, value), (answer, 99))],
        reward=float(answer == 7),
    )


def test_turn_contexts_are_the_exact_tokens_seen_before_each_turn() -> None:
    traj = lookup_episode(0, key=3, value=7, answer=7)
    assert turn_contexts(traj) == [(1, 2), (1, 2, 10, 3, 20, 7)]
    broken = Trajectory("t", 0, turns=[turn((1,), (2,)), turn((5, 6), (7,), new_sample=True)])
    assert turn_contexts(broken) == [(1,), (5, 6)]


def test_gigpo_gives_answer_turns_credit_among_equal_observations_only() -> None:
    # Members 0-2 called key 3 and saw value 7; member 3 called key 4 and saw value 8.
    group = [
        lookup_episode(0, key=3, value=7, answer=7),  # copied: reward 1
        lookup_episode(1, key=3, value=7, answer=5),
        lookup_episode(2, key=3, value=7, answer=6),
        lookup_episode(3, key=4, value=8, answer=8),  # copied the wrong key's value
    ]
    (adv,) = gigpo_turn_advantages([group], gamma=1.0, omega=1.0)
    # Reference: the pure function on the same [B, S] layout, anchors by hand.
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    anchors = torch.tensor([[0, 1], [0, 1], [0, 1], [0, 2]])
    expected = gigpo_advantages(
        rewards, anchors, torch.ones(4, 2, dtype=torch.bool), group_size=4, gamma=1.0
    )
    assert torch.tensor(adv, dtype=torch.float64) == pytest.approx(
        expected, abs=1e-6
    )  # episode term in float32
    # The lone member 3 has no step-level partner at its answer: only its episode term.
    assert adv[3][1] == pytest.approx(adv[3][0] - expected[3, 0].item() + expected[3, 1].item())


def test_gigpo_skips_errored_members_and_shuffles_like_the_group_estimators() -> None:
    group = [lookup_episode(i, key=3, value=7, answer=7 if i == 0 else 5) for i in range(3)]
    group.append(Trajectory("t", 3, turns=[turn((1, 2), (10,))], error="backend died"))
    (adv,) = gigpo_turn_advantages([group])
    assert adv[3] == [0.0]
    assert sum(a[0] for a in adv[:3]) == pytest.approx(0.0, abs=1e-6)
    groups = [group, [lookup_episode(i, 3, 7, 5) for i in range(4)]]
    shuffled = gigpo_turn_advantages(groups, shuffle_seed=1)
    plain = gigpo_turn_advantages(groups)
    assert shuffled != plain  # the lone reward-1 member moved to another slot
    for group_adv in shuffled:  # still group-relative: each group's first turns sum to 0
        assert sum(a[0] for a in group_adv) == pytest.approx(0.0, abs=1e-6)


def test_gigpo_needs_equal_group_sizes() -> None:
    a = [lookup_episode(i, 3, 7, 7) for i in range(2)]
    b = [lookup_episode(i, 3, 7, 7) for i in range(3)]
    with pytest.raises(ValueError, match="groups of one size"):
        gigpo_turn_advantages([a, b])


def test_token_advantages_line_up_with_samples_and_pack() -> None:
    traj = Trajectory(
        "t", 0,
        turns=[turn((1, 2), (3,)), turn((4,), (5, 6)), turn((7, 8), (9,), new_sample=True)],
    )  # fmt: skip
    per_token = token_advantages(traj, [0.5, -1.0, 2.0])
    samples = traj.samples()
    assert [len(a) for a in per_token] == [len(s.input_ids) for s in samples] == [6, 3]
    assert per_token[0] == [0.5, 0.5, 0.5, -1.0, -1.0, -1.0]
    batch = pack(samples, per_token, pad_id=0)
    assert batch.advantages.shape == batch.input_ids.shape
    trained = batch.advantages[batch.loss_mask].tolist()
    assert trained == [0.5, -1.0, -1.0, 2.0]  # each sampled token carries its own turn's value
    with pytest.raises(ValueError, match="turn values"):
        token_advantages(traj, [1.0])
    with pytest.raises(ValueError, match="per-token values"):
        pack(samples, [[1.0], per_token[1]], pad_id=0)


def episode(index: int, reward: float, tokens: int) -> Trajectory:
    return Trajectory("t", index, turns=[turn((1,), tuple(range(tokens)))], reward=reward)


def sampled(traj: Trajectory, values: list[float | list[float]]) -> list[float]:
    """The values on the sampled tokens of a trajectory's samples, in order."""
    out: list[float] = []
    for sample, value in zip(traj.samples(), values, strict=True):
        assert isinstance(value, list)
        out += [v for v, m in zip(value, sample.loss_mask, strict=True) if m]
    return out


def test_reinforce_pp_whitens_rewards_over_every_sampled_token() -> None:
    from turnrl.trainer.credit import reinforce_pp_sample_advantages

    groups = [[episode(0, 1.0, 3), episode(1, 0.0, 1)], [episode(0, 0.0, 2), episode(1, 0.0, 2)]]
    out = reinforce_pp_sample_advantages(groups)
    tokens = torch.tensor([1.0] * 3 + [0.0] * 1 + [0.0] * 4)  # each token carries its R
    mean, std = tokens.mean(), tokens.std()
    hi, lo = float((1 - mean) / std), float(-mean / std)
    assert sampled(groups[0][0], out[0][0]) == pytest.approx([hi] * 3, abs=1e-6)
    assert sampled(groups[0][1], out[0][1]) == pytest.approx([lo], abs=1e-6)
    assert sampled(groups[1][0], out[1][0]) == pytest.approx([lo] * 2, abs=1e-6)
    # The baseline variant centres each group first: group 2 is flat, group 1 is not.
    base = reinforce_pp_sample_advantages(groups, baseline=True)
    centred = torch.tensor([0.5] * 3 + [-0.5] + [0.0] * 4)
    cm, cs = centred.mean(), centred.std()
    assert sampled(groups[0][0], base[0][0]) == pytest.approx([float((0.5 - cm) / cs)] * 3)
    assert sampled(groups[1][1], base[1][1]) == pytest.approx([float(-cm / cs)] * 2)
    errored = [[episode(0, 1.0, 2), Trajectory("t", 1, error="boom")]]
    assert reinforce_pp_sample_advantages(errored)[0][1] == []


def test_reinforce_pp_with_the_kl_in_the_reward_matches_the_pure_function() -> None:
    from turnrl.algorithms import reinforce_pp_advantages
    from turnrl.trainer.credit import reinforce_pp_sample_advantages

    a, b = episode(0, 1.0, 3), episode(1, 0.0, 2)
    kl = {id(a): [[0.0, 0.1, 0.2, 0.3]], id(b): [[0.0, 0.5, -0.1]]}  # prompt token first
    out = reinforce_pp_sample_advantages([[a, b]], kl=kl, kl_coef=0.5)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    expected = reinforce_pp_advantages(
        torch.tensor([1.0, 0.0], dtype=torch.float64), mask,
        kl=torch.tensor([[0.1, 0.2, 0.3], [0.5, -0.1, 0.0]], dtype=torch.float64), kl_coef=0.5,
    )  # fmt: skip
    assert sampled(a, out[0][0]) == pytest.approx(expected[0].tolist(), abs=1e-9)
    assert sampled(b, out[0][1]) == pytest.approx(expected[1, :2].tolist(), abs=1e-9)
    first, *rest = sampled(a, out[0][0])
    assert all(first < x for x in rest)  # earlier tokens pay more of the KL to come
