"""The text games' rules, seeded task streams and oracles: Sokoban, FrozenLake, bandit.

Each rule is tested through the environment the model plays (``GameEnv`` and its tools),
on hand-made boards where the right answer is obvious.
"""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any

import pytest

from turnrl.envs import Bandit, FrozenLake, GameEnv, Sokoban
from turnrl.envs.games import sokoban_rules as rules
from turnrl.envs.games.frozen_lake import Lake, landing, success_tables
from turnrl.envs.games.grid import Direction, latest_board, move_call
from turnrl.envs.policy import Episode, play, replay
from turnrl.errors import ConfigError
from turnrl.formats import get_format
from turnrl.types import StepResult, Task, ToolCall

SOKOBAN = Sokoban()
LAKE = FrozenLake()
BANDIT = Bandit()


def sokoban_task(*board: str) -> Task:
    return Task(id="hand-made", prompt=({"role": "user", "content": "\n".join(board)},),
                metadata={"board": list(board)})  # fmt: skip


def lake_task(*rows: str) -> Task:
    return Task(id="hand-made", prompt=({"role": "user", "content": "\n".join(rows)},),
                metadata={"rows": list(rows)})  # fmt: skip


def moves(env: GameEnv, task: Task, *directions: Direction, seed: int = 0) -> list[StepResult]:
    """Reset ``env`` on ``task`` and play one move per turn."""

    async def run() -> list[StepResult]:
        await env.reset(task, seed)
        return [await env.step(move_call(d)) for d in directions]

    return asyncio.run(run())


def text(result: StepResult) -> str:
    return "\n".join(str(m["content"]) for m in result.observation)


def run_policy(spec: Any, task: Task, policy: Any, seed: int = 0) -> Episode:
    return asyncio.run(play(spec.make_env(), task, policy, seed=seed, max_steps=50))


def run_seeds(spec: Any, task: Task, turns: list[str], seeds: range) -> list[Episode]:
    """``turns`` replayed on ``task`` once per seed (one event loop for all)."""

    async def run() -> list[Episode]:
        return [
            await play(spec.make_env(), task, replay(turns), seed=s, max_steps=50) for s in seeds
        ]

    return asyncio.run(run())


# Sokoban ----------------------------------------------------------------------------------


def test_sokoban_walking_into_a_wall_is_refused_and_costs_a_move() -> None:
    env = SOKOBAN.make_env()
    [result] = moves(env, sokoban_task("#####", "#@$.#", "#___#", "#####"), "up")
    assert "Error" in text(result)
    assert "wall is in the way" in text(result)
    assert not result.terminated
    assert not result.truncated
    assert env.num_moves == 1


def test_sokoban_pushing_a_box_into_a_wall_is_refused() -> None:
    board = ("######", "#____#", "#_@$##", "#_.__#", "######")
    [result] = moves(SOKOBAN.make_env(), sokoban_task(*board), "right")
    assert "cannot push the box right: a wall is behind it" in text(result)
    level, state = rules.parse(board)
    with pytest.raises(rules.IllegalMove):
        rules.move(level, state, "right")


def test_sokoban_pushing_a_box_into_a_second_box_is_refused() -> None:
    board = ("#######", "#@$$..#", "#_____#", "#######")
    [result] = moves(SOKOBAN.make_env(), sokoban_task(*board), "right")
    assert "another box is behind it" in text(result)
    assert not result.terminated


def test_sokoban_boxes_cannot_be_pulled() -> None:
    board = ("######", "#.$@_#", "#____#", "######")
    level, state = rules.parse(board)
    after = rules.move(level, state, "right")  # walking away leaves the box behind
    assert after.boxes == state.boxes
    assert after.player == (1, 4)


def test_sokoban_box_in_a_corner_ends_the_episode_unsolvable() -> None:
    board = ("######", "#_$@.#", "#____#", "######")
    level, state = rules.parse(board)
    assert rules.solve(level, state) is not None  # solvable before the push
    [result] = moves(SOKOBAN.make_env(), sokoban_task(*board), "left")
    assert result.terminated
    assert not result.truncated
    assert result.reward == 0.0
    assert result.info["success"] is False
    assert "deadlock" in result.info["end_reason"]
    assert "can never reach a goal" in text(result)
    after = rules.move(level, state, "left")
    assert (1, 1) in level.dead_squares
    assert rules.solve(level, after) is None


def test_sokoban_solved_when_every_box_is_on_a_goal() -> None:
    board = ("#######", "#@$_._#", "#_____#", "#######")
    results = moves(SOKOBAN.make_env(), sokoban_task(*board), "right", "right")
    assert not results[0].terminated
    assert results[1].terminated
    assert results[1].reward == 1.0
    assert results[1].info["success"]
    assert results[1].info["reward_components"] == {"boxes_on_goals": 1.0}


def test_sokoban_board_text_round_trips() -> None:
    board = ("#######", "#+$*._#", "#__$__#", "#######")
    level, state = rules.parse(board)
    assert rules.render(level, state).splitlines() == list(board)
    assert latest_board(
        [{"role": "user", "content": "Hi.\n\n" + "\n".join(board)}], rules.ALPHABET
    ) == list(board)


def test_sokoban_levels_are_seeded_solvable_and_need_the_minimum_moves() -> None:
    for i in range(20):
        task = SOKOBAN.task(i)
        assert task == Sokoban().task(i)
        level, state = rules.parse(task.metadata["board"])
        plan = rules.solve(level, state)
        assert plan is not None
        assert len(plan) == task.answer
        assert SOKOBAN.min_solution <= len(plan) <= SOKOBAN.max_moves
        assert len(state.boxes) == len(level.goals) == SOKOBAN.num_boxes
    assert Sokoban(seed=1).task(0) != SOKOBAN.task(0)
    assert SOKOBAN.task(0, "test") != SOKOBAN.task(0)


def test_sokoban_two_box_levels_are_solvable() -> None:
    spec = Sokoban(height=7, width=7, num_boxes=2, max_moves=30, max_turns=30)
    for i in range(5):
        level, state = rules.parse(spec.task(i).metadata["board"])
        assert len(state.boxes) == 2
        assert rules.solve(level, state) is not None


# FrozenLake -------------------------------------------------------------------------------


def test_frozen_lake_a_hole_ends_the_episode_with_zero() -> None:
    [result] = moves(LAKE.make_env(), lake_task("SHFF", "FFFF", "FFFF", "FFFG"), "right")
    assert result.terminated
    assert not result.truncated
    assert result.reward == 0.0
    assert result.info["success"] is False
    assert "hole" in result.info["end_reason"]


def test_frozen_lake_the_goal_ends_the_episode_with_one() -> None:
    results = moves(LAKE.make_env(), lake_task("SHFF", "FFFF", "FFFF", "FFFG"),
                    "down", "down", "down", "right", "right", "right")  # fmt: skip
    assert not any(r.terminated or r.truncated for r in results[:-1])
    assert results[-1].terminated
    assert results[-1].reward == 1.0
    assert results[-1].info["success"]


def test_frozen_lake_edge_is_refused_and_budget_truncates_with_the_reason() -> None:
    spec = FrozenLake(max_moves=6, max_turns=10)
    results = moves(spec.make_env(), lake_task("SFFF", "FFFF", "FFFF", "FFFG"), *["up"] * 6)
    assert "edge of the lake" in text(results[0])
    assert [r.truncated for r in results] == [False] * 5 + [True]
    assert not results[-1].terminated
    assert results[-1].info["truncated_reason"] == "max_moves"


def test_frozen_lake_unparseable_turns_truncate_at_the_turn_limit() -> None:
    async def run() -> list[StepResult]:
        env = FrozenLake(size=2, max_turns=3).make_env()
        await env.reset(lake_task("SF", "FG"), 0)
        return [await env.step("<tool_call>{oops</tool_call>") for _ in range(3)]

    results = asyncio.run(run())
    assert "could not be understood" in text(results[0])
    assert [r.truncated for r in results] == [False, False, True]
    assert results[-1].info["truncated_reason"] == "max_turns"


def test_a_turn_without_a_call_ends_the_game_with_zero() -> None:
    async def run() -> StepResult:
        env = LAKE.make_env()
        await env.reset(LAKE.task(0), 0)
        return await env.step("I would rather not.")

    result = asyncio.run(run())
    assert result.terminated
    assert result.reward == 0.0
    assert result.info["success"] is False


def test_frozen_lake_maps_are_seeded_and_have_a_path_within_the_budget() -> None:
    for i in range(30):
        task = LAKE.task(i)
        assert task == FrozenLake().task(i)
        path = Lake(tuple(task.metadata["rows"])).shortest_path()
        assert path is not None
        assert path <= LAKE.max_moves
    assert FrozenLake(seed=1).task(0) != LAKE.task(0)


def test_slippery_ice_is_seeded_per_episode() -> None:
    spec = FrozenLake(slip_prob=0.5, max_moves=40, max_turns=40)
    task = lake_task("SFFF", "FFFF", "FFFF", "FFFF")  # no hole, no goal: it never ends
    directions: list[Direction] = ["right", "left", "down", "up"] * 10

    def transcript(seed: int) -> list[str]:
        return [text(r) for r in moves(spec.make_env(), task, *directions, seed=seed)]

    assert transcript(0) == transcript(0)
    assert transcript(0) != transcript(1)
    slips = sum("slipped" in t for seed in range(5) for t in transcript(seed))
    moved = sum(1 for seed in range(5) for t in transcript(seed) if "Error" not in t)
    assert 0.4 < slips / moved < 0.6  # slip_prob, up to sampling noise (about 190 moves)


def test_frozen_lake_dynamics_and_success_tables_by_hand() -> None:
    lake = Lake(("SF", "FG"))
    for cell in lake.cells():
        for d in ("up", "down", "left", "right"):
            assert math.isclose(sum(p for p, _ in landing(lake, cell, d, 0.3)), 1.0)
    # Random play, no slip: the first move must go right or down (1/2), the second into
    # G (1/4): 1/8 within two moves. The optimal policy always makes it.
    assert success_tables(lake, 0.0, 2, best=False)[2][(0, 0)] == pytest.approx(1 / 8)
    assert success_tables(lake, 0.0, 2, best=True)[2][(0, 0)] == 1.0
    assert success_tables(lake, 0.0, 1, best=True)[1][(0, 0)] == 0.0


def test_frozen_lake_slippery_oracle_matches_its_expected_success() -> None:
    spec = FrozenLake(slip_prob=0.2)
    wins = [
        run_policy(spec, spec.task(i, "test"), spec.oracle(spec.task(i, "test")), seed=i).success
        for i in range(60)
    ]
    expected = spec.oracle_success
    assert 0.6 < expected < 1.0
    assert abs(sum(wins) / len(wins) - expected) < 3 * math.sqrt(expected * (1 - expected) / 60)


# Bandit -----------------------------------------------------------------------------------


def pull(arm: str) -> str:
    return get_format("hermes").render_call(ToolCall("pull", {"arm": arm}))


def test_bandit_payout_means_over_many_pulls() -> None:
    assert BANDIT.expected_payouts == {"safe": 0.15, "risky": 0.25}
    assert BANDIT.best_arm == "risky"
    assert BANDIT.chance == 0.5
    task = BANDIT.task(0)
    arms = {kind: arm for arm, kind in task.metadata["arms"].items()}
    n = 2000
    payouts = {
        kind: [e.reward for e in run_seeds(BANDIT, task, [pull(arms[kind])], range(n))]
        for kind in ("safe", "risky")
    }
    assert set(payouts["safe"]) == {0.15}
    assert set(payouts["risky"]) == {0.0, 1.0}
    assert abs(sum(payouts["risky"]) / n - 0.25) < 3 * math.sqrt(0.25 * 0.75 / n)


def test_bandit_expected_reward_pays_the_arms_mean_without_the_draw() -> None:
    spec = Bandit(reward="expected")
    task = spec.task(0)
    arms = {kind: arm for arm, kind in task.metadata["arms"].items()}
    for kind, mean in (("safe", 0.15), ("risky", 0.25)):
        episodes = run_seeds(spec, task, [pull(arms[kind])], range(50))
        assert {e.reward for e in episodes} == {mean}
    payouts = {e.results[-1].info["reward_components"]["payout"]
               for e in run_seeds(spec, task, [pull(arms["risky"])], range(50))}  # fmt: skip
    assert payouts == {0.0, 1.0}  # the draw is still recorded
    with pytest.raises(ConfigError, match=r"bandit\.reward"):
        Bandit(reward="best")


def test_bandit_success_means_the_better_arm_and_the_pull_ends_the_episode() -> None:
    task = BANDIT.task(1)
    [safe] = [arm for arm, kind in task.metadata["arms"].items() if kind == "safe"]
    episode = run_policy(BANDIT, task, replay([pull(safe)]))
    assert episode.ended_by == "terminated"
    assert not episode.success
    episode = run_policy(BANDIT, task, replay([pull(str(task.answer))]))
    assert episode.ended_by == "terminated"
    assert episode.success
    assert episode.results[-1].info["reward_components"]["best_arm"] == 1.0


def test_bandit_unknown_arm_is_an_error_and_the_single_pull_is_spent() -> None:
    episode = run_policy(BANDIT, BANDIT.task(0), replay([pull("purple")]))
    [result] = episode.results
    assert "must be one of" in text(result)
    assert result.truncated
    assert not result.terminated
    assert result.reward == 0.0


def test_bandit_tasks_name_and_order_the_arms_at_random() -> None:
    tasks = [BANDIT.task(i) for i in range(200)]
    risky_first = sum(next(iter(t.metadata["arms"].values())) == "risky" for t in tasks)
    assert 70 < risky_first < 130
    assert len({tuple(t.metadata["arms"]) for t in tasks}) > 20
    assert all(t == Bandit().task(i) for i, t in enumerate(tasks[:20]))


# All games --------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [SOKOBAN, LAKE, BANDIT], ids=lambda s: s.name)
def test_oracle_solves_every_seeded_task(spec: Any) -> None:
    for i in range(30):
        task = spec.task(i, "test")
        episode = run_policy(spec, task, spec.oracle(task), seed=i)
        assert episode.ended_by == "terminated", (task.id, episode.actions)
        assert episode.success, (task.id, episode.actions)


@pytest.mark.parametrize("spec", [SOKOBAN, LAKE, BANDIT], ids=lambda s: s.name)
def test_demonstrations_are_valid_calls_with_random_content(spec: Any) -> None:
    task = spec.task(0)
    demos = {tuple(spec.demonstration(task, random.Random(s))) for s in range(10)}
    assert len(demos) > 1  # random content, not the solution
    for turn in next(iter(demos)):
        assert get_format("hermes").parse(turn).tool_calls


@pytest.mark.parametrize("spec", [SOKOBAN, LAKE, BANDIT], ids=lambda s: s.name)
def test_cards_describe_budget_limits_and_chance(spec: Any) -> None:
    card = spec.card
    assert card.name == spec.name
    assert card.tool_budget
    assert card.turn_limit
    assert 0.0 <= card.chance < 0.6
    assert any(line.startswith("  on failure:") for line in card.lines())
    assert spec.corpus()
