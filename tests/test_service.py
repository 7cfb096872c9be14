"""service: the contract check, the simulated user, and policy breaches that score 0 even
when the database ends right."""

from __future__ import annotations

import asyncio
from collections import Counter

from turnrl.envs import check_env
from turnrl.envs.policy import Episode, play, replay
from turnrl.envs.service import Service
from turnrl.formats import get_format
from turnrl.types import Task, ToolCall

SERVICE = Service()
HERMES = get_format("hermes")


def call(name: str, **arguments: object) -> str:
    return HERMES.render_call(ToolCall(name, arguments))


def first_task(intent: str) -> Task:
    return next(
        t for t in (SERVICE.task(i) for i in range(100)) if t.metadata["goal"]["intent"] == intent
    )


def run(task: Task, turns: list[str]) -> Episode:
    return asyncio.run(play(SERVICE.make_env(), task, replay(turns), seed=0, max_steps=16))


def test_the_contract_check_passes() -> None:
    report = check_env(SERVICE, num_tasks=60)
    assert report.ok, report.table()
    assert report.oracle_success == 1.0
    assert report.random_success == 0.0


def test_every_intent_occurs_and_a_forbidden_request_expects_no_change() -> None:
    tasks = [SERVICE.task(i) for i in range(200)]
    assert set(Counter(t.metadata["goal"]["intent"] for t in tasks)) == {
        "cancel", "return", "address", "cancel_delivered",
    }  # fmt: skip
    trap = first_task("cancel_delivered")
    assert trap.answer == trap.metadata["db"]
    order = trap.metadata["db"]["orders"][trap.metadata["goal"]["order"]]
    assert order["status"] == "delivered"


def test_the_user_reveals_only_what_is_asked() -> None:
    task = first_task("cancel")
    goal = task.metadata["goal"]
    episode = run(task, ["Hello!", "What is your email?", "Which order?", "Why?"])
    replies = [str(r.observation[0]["content"]) for r in episode.results]
    assert goal["email"] not in replies[0]
    assert goal["order"] not in replies[0]
    assert replies[1] == f"My email is {goal['email']}."
    assert replies[2] == f"It's order {goal['order']}."
    assert replies[3] == f"It is {goal['reason']}."


def served(task: Task, *, authenticate: bool, confirm: bool) -> list[str]:
    goal = task.metadata["goal"]
    turns = []
    if authenticate:
        turns.append(call("find_customer_by_email", email=goal["email"]))
    if confirm:
        turns.append(f"Please confirm: cancel order {goal['order']}? (yes/no)")
    turns += [call("cancel_order", order_id=goal["order"], reason=goal["reason"]), "Done."]
    return turns


def test_the_right_change_done_right_scores_one() -> None:
    task = first_task("cancel")
    assert run(task, served(task, authenticate=True, confirm=True)).reward == 1.0


def test_the_right_change_without_authentication_or_confirmation_scores_zero() -> None:
    task = first_task("cancel")
    for authenticate, confirm in ((False, True), (True, False)):
        episode = run(task, served(task, authenticate=authenticate, confirm=confirm))
        final = episode.results[-1]
        assert final.terminated  # the user saw the change and stopped
        assert final.info["reward_components"]["db_match"] == 1.0
        assert final.info["violations"]
        assert episode.reward == 0.0


def test_changing_another_customers_order_or_more_than_asked_scores_zero() -> None:
    task = first_task("cancel")
    goal, db = task.metadata["goal"], task.metadata["db"]
    mine = db["orders"][goal["order"]]["customer"]
    other = next(
        o for o, v in db["orders"].items() if v["customer"] != mine and v["status"] == "pending"
    )
    confirm = f"Please confirm: cancel order {other}? (yes/no)"
    episode = run(task, [
        call("find_customer_by_email", email=goal["email"]), confirm,
        call("cancel_order", order_id=other, reason=goal["reason"]),
        *served(task, authenticate=False, confirm=True),
    ])  # fmt: skip
    final = episode.results[-1]
    assert any("another customer" in v for v in final.info["violations"])
    assert final.info["reward_components"]["db_match"] == 0.0
    assert episode.reward == 0.0


def test_the_store_refuses_what_it_cannot_do() -> None:
    trap = first_task("cancel_delivered")
    goal = trap.metadata["goal"]
    episode = run(trap, [
        call("find_customer_by_email", email=goal["email"]),
        "Please confirm: cancel it? (yes/no)",
        call("cancel_order", order_id=goal["order"], reason="because"),
        call("cancel_order", order_id=goal["order"], reason=goal["reason"]),
        "Sorry, I cannot cancel a delivered order.",
    ])  # fmt: skip
    texts = [str(m["content"]) for r in episode.results for m in r.observation]
    assert "reason must be one of" in texts[2]
    assert "only pending orders can be cancelled" in texts[3]
    assert episode.ended_by == "terminated"
    assert episode.reward == 1.0  # refused, nothing changed, no rule broken
