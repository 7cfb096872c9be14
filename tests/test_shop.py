"""shop: the contract check, the WebShop-style score, and the tools' refusals."""

from __future__ import annotations

import asyncio

import pytest

from turnrl.envs import check_env
from turnrl.envs.policy import Episode, play, replay
from turnrl.envs.shop import Product, Shop
from turnrl.formats import get_format
from turnrl.types import Task, ToolCall

SHOP = Shop()


def calls(*items: tuple[str, dict[str, object]]) -> str:
    hermes = get_format("hermes")
    return "\n".join(hermes.render_call(ToolCall(n, a)) for n, a in items)


def run(task: Task, turns: list[str]) -> Episode:
    return asyncio.run(play(SHOP.make_env(), task, replay(turns), seed=0, max_steps=12))


def test_the_contract_check_passes() -> None:
    report = check_env(SHOP, num_tasks=60)
    assert report.ok, report.table()
    assert report.oracle_success == 1.0
    assert report.random_success <= 0.02


def test_tasks_are_seeded_and_satisfiable_by_their_target() -> None:
    task = SHOP.task(3, "test")
    assert task == Shop().task(3, "test")
    assert task != Shop(seed=1).task(3, "test")
    target = SHOP.products[task.answer]
    outcome = SHOP.score(task, target, dict(task.metadata["options"]))
    assert (outcome.reward, outcome.success) == (1.0, True)
    assert task.answer not in str(task.prompt[0]["content"])  # the id is never given


def test_any_product_meeting_the_instruction_earns_full_reward() -> None:
    task = SHOP.task(0)
    m = task.metadata
    other = Product("X", m["category"], "Other", tuple(m["features"]),
                    {k: (v,) for k, v in m["options"].items()}, m["ceiling"] - 0.01)  # fmt: skip
    assert SHOP.score(task, other, dict(m["options"])).reward == 1.0


def test_partial_matches_score_a_share_and_another_category_scores_zero() -> None:
    task = SHOP.task(0)
    m = task.metadata
    features, options = tuple(m["features"]), dict(m["options"])
    total = len(features) + len(options) + 1
    pricey = Product("X", m["category"], "B", features, {k: (v,) for k, v in options.items()},
                     m["ceiling"] + 1)  # fmt: skip
    assert SHOP.score(task, pricey, options).reward == pytest.approx((total - 1) / total)
    unchosen = {k: "none" for k in options}
    assert SHOP.score(task, pricey, unchosen).reward == pytest.approx(len(features) / total)
    other = next(c for c in ("mug", "lamp") if c != m["category"])
    wrong = Product("Y", other, "B", features, {k: (v,) for k, v in options.items()}, 1.0)
    outcome = SHOP.score(task, wrong, options)
    assert (outcome.reward, outcome.success) == (0.0, False)


def test_the_tools_refuse_out_of_order_and_invalid_actions() -> None:
    task = SHOP.task(1)
    target = SHOP.products[task.answer]
    option = next(iter(target.options))
    episode = run(task, [
        calls(("buy", {})),  # nothing open
        calls(("choose", {"option": option, "value": target.options[option][0]})),
        calls(("open", {"product_id": "P9999"})),
        calls(("open", {"product_id": target.id}), ("buy", {})),  # options not chosen
        calls(("choose", {"option": "flavour", "value": "x"}),
              ("choose", {"option": option, "value": "no-such-value"})),
        calls(("search", {"query": "anything", "page": 0})),
        "I give up",  # a turn without a call ends the episode with 0
    ])  # fmt: skip
    texts = [str(m["content"]) for r in episode.results for m in r.observation]
    assert "open a product first" in texts[0]
    assert "open a product first" in texts[1]
    assert "no product 'P9999'" in texts[2]
    assert texts[4].startswith("Error")
    assert "choose" in texts[4]
    assert f"has no option 'flavour'; options: {', '.join(target.options)}" in texts[5]
    assert "must be one of" in texts[6]
    assert "page starts at 1" in texts[7]
    assert episode.ended_by == "terminated"
    assert episode.reward == 0.0


def test_search_pages_do_not_overlap() -> None:
    session_tools = SHOP.make_env()
    task = SHOP.task(2)
    episode = asyncio.run(
        play(session_tools, task, replay([
            calls(("search", {"query": "waterproof backpack", "page": 1}),
                  ("search", {"query": "waterproof backpack", "page": 2})),
        ]), seed=0, max_steps=1)
    )  # fmt: skip
    first, second = (str(m["content"]) for m in episode.results[0].observation)
    ids = [line.split("]")[0] for line in first.splitlines()]
    assert len(ids) == 5
    assert not set(ids) & {line.split("]")[0] for line in second.splitlines()}
