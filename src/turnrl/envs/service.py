"""``service``: a customer-service agent under a written policy (tau-bench style, Yao et
al., 2024), with a scripted simulated user.

Each task seeds a small store database (customers, their orders with status and address)
and a user with one request: cancel a pending order, return a delivered one, or change a
pending order's address; some requests break the policy (cancel an order already
delivered) and must be refused. The user reveals what they know only when asked: their
email (or name and zip code), the order id, the reason, the new address; they say "yes"
when asked to confirm, and end the conversation ("###STOP###") once their request is done
or refused.

The agent's turn either calls tools (hermes format; results come back as ``tool``
messages) or, with no call, speaks to the user (the reply comes back as a ``user``
message). The tools read and change the database: ``find_customer_by_email``,
``find_customer_by_name_zip``, ``get_customer``, ``get_order``, ``cancel_order``,
``return_order``, ``update_address``. They refuse what the store cannot do (cancelling a
delivered order, an unknown reason); the policy rules the *agent* must keep are tracked:
authenticate the user before changing anything, change only the authenticated user's
orders, and change nothing without the user's "yes" in their latest message.

Reward 1 when the final database equals the expected one (the request applied, or nothing
changed for a request the policy refuses) and no rule was broken; else 0.
"""

from __future__ import annotations

import copy
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from turnrl.envs.env_card import EnvCard
from turnrl.envs.policy import Policy, demonstration_corpus
from turnrl.errors import ConfigError
from turnrl.formats import error_observation, get_format
from turnrl.protocols import ToolSchema
from turnrl.tools import Tool, ToolSet
from turnrl.types import Message, StepResult, Task, ToolCall, ToolCallRecord

POLICY = """You are a customer-service agent of an online store. Policy:
1. Before changing anything, authenticate the user: find them by email, or by name and zip.
2. Only act on orders of the authenticated user.
3. Only pending orders can be cancelled (reason: "no longer needed" or "ordered by
mistake") or have their address changed. Only delivered orders can be returned.
4. Before any change, state what you will do and ask the user to confirm; act only after
they say yes.
5. If a request breaks this policy, refuse it politely and change nothing."""
STOP = "###STOP###"
REASONS = ("no longer needed", "ordered by mistake")
_FIRST = ("ana", "ben", "cleo", "dev", "eli", "fay", "gus", "hana", "ivo", "jun", "kai", "lea")
_LAST = ("stone", "rivera", "okafor", "lind", "marsh", "tanaka", "berg", "cole", "park", "vance")
_ITEMS = ("blue mug", "desk lamp", "wool scarf", "notebook", "water bottle", "headphones",
          "backpack", "tea set", "yoga mat", "phone case")  # fmt: skip
_STREETS = ("Oak St", "Elm Ave", "Pine Rd", "Lake Dr", "Hill Ln", "Birch Way")
INTENTS = ("cancel", "return", "address", "cancel_delivered")


def _address(rng: random.Random) -> str:
    return f"{rng.randint(1, 999)} {rng.choice(_STREETS)}"


@dataclass(frozen=True)
class Service:
    """tau-bench-style customer service; see the module docstring."""

    customers: int = 6
    """Customers in each task's database (2-3 orders each)."""
    max_turns: int = 16
    """Agent turns per episode (tool turns and messages to the user)."""
    max_tool_calls: int = 12
    """Tool calls per episode."""
    seed: int = 0
    """Seed of the task stream."""

    name = "service"
    chance = 0.0
    """A random agent never completes a request under the rules."""

    def __post_init__(self) -> None:
        if not 2 <= self.customers <= len(_FIRST):
            raise ConfigError(f"service.customers must be in 2..{len(_FIRST)}")
        if self.max_turns < 4 or self.max_tool_calls < 3:
            raise ConfigError("service: max_turns >= 4 and max_tool_calls >= 3")

    def task(self, index: int, split: str = "train") -> Task:
        rng = random.Random(f"service/{self.seed}/{split}/{index}")
        names = rng.sample([(f, la) for f in _FIRST for la in _LAST], self.customers)
        db: dict[str, Any] = {"customers": {}, "orders": {}}
        order_no = rng.randint(100, 800) * 10
        for c, (first, last) in enumerate(names):
            cid = f"C{c + 1:03d}"
            db["customers"][cid] = {
                "name": f"{first.capitalize()} {last.capitalize()}",
                "email": f"{first}.{last}@example.com", "zip": f"{rng.randint(10000, 99999)}",
                "orders": [],
            }  # fmt: skip
            for _ in range(rng.randint(2, 3)):
                order_no += rng.randint(1, 9)
                oid = f"O{order_no}"
                db["orders"][oid] = {
                    "customer": cid, "items": sorted(rng.sample(_ITEMS, rng.randint(1, 2))),
                    "status": rng.choice(("pending", "delivered")), "address": _address(rng),
                }  # fmt: skip
                db["customers"][cid]["orders"].append(oid)
        intent = rng.choice(INTENTS)
        wanted_status = "pending" if intent in ("cancel", "address") else "delivered"
        candidates = sorted(o for o, v in db["orders"].items() if v["status"] == wanted_status)
        if not candidates:  # make one
            candidates = [sorted(db["orders"])[0]]
            db["orders"][candidates[0]]["status"] = wanted_status
        order_id = rng.choice(candidates)
        user = db["customers"][db["orders"][order_id]["customer"]]
        goal = {"intent": intent, "order": order_id, "email": user["email"],
                "name": user["name"], "zip": user["zip"], "reason": rng.choice(REASONS),
                "address": _address(rng)}  # fmt: skip
        expected = _apply(db, goal)
        opening = {
            "cancel": "Hi, I'd like to cancel one of my orders.",
            "return": "Hello, I want to return an order I received.",
            "address": "Hi, I need to change the shipping address of an order.",
            "cancel_delivered": "Hi, I'd like to cancel one of my orders.",
        }[intent]
        return Task(
            id=f"{split}-{index}",
            prompt=({"role": "system", "content": POLICY}, {"role": "user", "content": opening}),
            answer=expected,
            metadata={"db": db, "goal": goal},
        )

    def make_env(self) -> ServiceEnv:
        return ServiceEnv(self)

    def oracle(self, task: Task) -> Policy:
        """A scripted agent that follows the policy, reading only the conversation: asks for
        the email, looks the user up, asks for the order, reads it, refuses what the policy
        forbids, else gathers the reason or address, asks to confirm, acts, reports."""
        hermes = get_format("hermes")
        opening = str(task.prompt[-1]["content"])
        intent = "cancel" if "cancel" in opening else "return" if "return" in opening else "address"
        notes: dict[str, str] = {}

        def call(name: str, **arguments: Any) -> str:
            return hermes.render_call(ToolCall(name, arguments))

        def policy(messages: Sequence[Message]) -> str:
            last = messages[-1]
            text = str(last["content"])
            if last["role"] == "tool":
                if "customer_id" in text and "id" not in notes:
                    notes["id"] = re.findall(r'"customer_id": "(C\d+)"', text)[0]
                    return "Thank you. Which order is it? Please give me the order id."
                if '"status"' in text and "status" not in notes:
                    notes["status"] = re.findall(r'"status": "(\w+)"', text)[0]
                    allowed = {"cancel": "pending", "address": "pending", "return": "delivered"}
                    if notes["status"] != allowed[intent]:
                        return (f"I'm sorry, I cannot do that: the order is {notes['status']}, "
                                f"and only {allowed[intent]} orders qualify.")  # fmt: skip
                    if intent == "cancel":
                        return "What is the reason for the cancellation?"
                    if intent == "address":
                        return "What is the new address?"
                    return f"Please confirm: return order {notes['order']}? (yes/no)"
                return "It is done. Is there anything else?"
            found = re.search(r"[\w.]+@example\.com", text)
            if found and "email" not in notes:
                notes["email"] = found[0]
                return call("find_customer_by_email", email=notes["email"])
            found = re.search(r"order (O\d+)", text)
            if found and "order" not in notes:
                notes["order"] = found[1]
                return call("get_order", order_id=notes["order"])
            for reason in REASONS:
                if reason in text and "reason" not in notes:
                    notes["reason"] = reason
                    return (f"Please confirm: cancel order {notes['order']} because it is "
                            f"{reason}? (yes/no)")  # fmt: skip
            found = re.search(r"new address is (.+)\.$", text)
            if found and "address" not in notes:
                notes["address"] = found[1]
                return (f"Please confirm: ship order {notes['order']} to {notes['address']}? "
                        "(yes/no)")  # fmt: skip
            if text.startswith("Yes") and "order" in notes:
                if intent == "cancel":
                    return call("cancel_order", order_id=notes["order"], reason=notes["reason"])
                if intent == "return":
                    return call("return_order", order_id=notes["order"])
                return call("update_address", order_id=notes["order"], address=notes["address"])
            return "Could you give me the email address of your account?"

        return policy

    def demonstration(self, task: Task, rng: random.Random) -> list[str]:
        """Format-only turns with random content (replayed, the random policy): a lookup of
        a made-up email, a random order read, a cancellation, a message."""
        hermes = get_format("hermes")
        order = rng.choice(sorted(task.metadata["db"]["orders"]))
        return [
            hermes.render_call(ToolCall("find_customer_by_email",
                                        {"email": f"{rng.choice(_FIRST)}@example.com"})),
            hermes.render_call(ToolCall("get_order", {"order_id": order})),
            hermes.render_call(ToolCall("cancel_order",
                                        {"order_id": order, "reason": rng.choice(REASONS)})),
            "Your request is done.",
        ]  # fmt: skip

    def corpus(self) -> list[str]:
        return [POLICY, *demonstration_corpus(self, 50)]

    @property
    def card(self) -> EnvCard:
        return EnvCard(
            name=self.name,
            summary="serve a simulated customer's request (cancel, return, change address) "
            "under a written policy, refusing what it forbids",
            tools=(
                "find_customer_by_email(email)",
                "find_customer_by_name_zip(name, zip)",
                "get_customer(customer_id)",
                "get_order(order_id)",
                "cancel_order(order_id, reason)",
                "return_order(order_id)",
                "update_address(order_id, address)",
            ),
            tool_budget=self.max_tool_calls,
            turn_limit=self.max_turns,
            scaffold="hermes <tool_call> format; the system prompt holds the policy; a turn "
            "without a call is a message to the user, whose reply comes back",
            evaluator="reward 1 iff the final database equals the expected one and no policy "
            "rule (authenticate first, only the user's orders, act only after a yes) broke",
            on_failure="a refused or malformed call is an error observation; the episode ends "
            "when the user stops or at the turn limit (0)",
            chance=self.chance,
        )


def _apply(db: dict[str, Any], goal: dict[str, str]) -> dict[str, Any]:
    """The database after the user's request is served as the policy says."""
    out = copy.deepcopy(db)
    order = out["orders"][goal["order"]]
    if goal["intent"] == "cancel":
        order["status"] = "cancelled"
    elif goal["intent"] == "return":
        order["status"] = "returned"
    elif goal["intent"] == "address":
        order["address"] = goal["address"]
    return out  # cancel_delivered: refused, nothing changes


class ServiceEnv:
    """One conversation between the agent, the tools and the simulated user."""

    def __init__(self, spec: Service) -> None:
        self.spec = spec
        self.format = get_format("hermes")
        self.tools = ToolSet([])
        self.task: Task | None = None

    def stop_strings(self) -> tuple[str, ...]:
        return self.format.stop_strings

    def tool_schemas(self) -> list[ToolSchema]:
        return self.tools.schemas()

    async def reset(self, task: Task, seed: int) -> list[Message]:
        self.task = task
        self.db: dict[str, Any] = copy.deepcopy(dict(task.metadata["db"]))
        self.goal: dict[str, str] = dict(task.metadata["goal"])
        self.authenticated: str | None = None
        self.checked: set[str] = set()  # orders whose status the agent saw, owner authenticated
        self.confirmed = False  # the user's latest message said yes
        self.violations: list[str] = []
        self.turns = self.calls = 0
        self.tools = self._tools()
        return [dict(m) for m in task.prompt]

    async def step(self, action: str) -> StepResult:
        if self.task is None:
            raise RuntimeError("step() called before reset()")
        self.turns += 1
        parsed = self.format.parse(action)
        if parsed.errors:
            return self._next(tuple(error_observation(parsed.errors)), {"format_error": True})
        if parsed.tool_calls:
            observation, records = await self._run(parsed.tool_calls)
            return self._next(observation, {"tool_calls": records})
        reply = self._user_reply(parsed.answer or "")
        if reply == STOP:
            return self._finish()
        return self._next(({"role": "user", "content": reply},), {})

    def _next(self, observation: tuple[Message, ...], info: dict[str, Any]) -> StepResult:
        if self.turns >= self.spec.max_turns:
            info |= {"success": False, "truncated_reason": "max_turns"}
            return StepResult(observation, truncated=True, info=info)
        return StepResult(observation, info=info)

    def _finish(self) -> StepResult:
        assert self.task is not None
        db_ok = self.db == self.task.answer
        ok = db_ok and not self.violations
        info = {
            "success": ok,
            "reward_components": {"db_match": float(db_ok), "violations": float(len(self.violations))},
            "violations": list(self.violations),
        }  # fmt: skip
        return StepResult(reward=float(ok), terminated=True, info=info)

    async def _run(
        self, calls: Sequence[ToolCall]
    ) -> tuple[tuple[Message, ...], list[ToolCallRecord]]:
        results: list[tuple[ToolCall, str]] = []
        records: list[ToolCallRecord] = []
        for call in calls:
            if self.calls >= self.spec.max_tool_calls:
                text = f"Error: tool budget exhausted ({self.spec.max_tool_calls} calls)."
                record = ToolCallRecord(call.name, dict(call.arguments), 0.0, False, "budget")
            else:
                self.calls += 1
                result, record = await self.tools.run(call)
                text = result.content
            results.append((call, text))
            records.append(record)
        return tuple(self.format.render_results(results)), records

    def _user_reply(self, message: str) -> str:
        """The simulated user: answers what is asked, confirms when asked, stops once the
        request is done or refused."""
        g, text = self.goal, message.lower()
        self.confirmed = False
        order = self.db["orders"][g["order"]]
        done = {  # what the user can see: their request went through
            "cancel": order["status"] == "cancelled",
            "return": order["status"] == "returned",
            "address": order["address"] == g["address"],
            "cancel_delivered": False,
        }[g["intent"]]
        # A refusal counts once the agent has authenticated the user and read the order it
        # refuses: a policy that says "I cannot" to everything is not following the policy
        # (``turnrl envs check``'s echo probe won every refusal task before this).
        refused = (
            g["intent"] == "cancel_delivered"
            and g["order"] in self.checked
            and any(w in text for w in ("cannot", "can't", "unable", "not able", "only pending"))
        )
        if done or refused:
            return STOP
        if "email" in text:
            return f"My email is {g['email']}."
        if "zip" in text or "name" in text:
            return f"I'm {g['name']}, zip code {g['zip']}."
        if "confirm" in text or "yes/no" in text or "proceed" in text:
            self.confirmed = True
            return "Yes, please go ahead."
        if "reason" in text or "why" in text:
            return f"It is {g['reason']}."
        if "address" in text and g["intent"] == "address":
            return f"The new address is {g['address']}."
        if "order" in text:
            return f"It's order {g['order']}."
        return {"cancel": "I want to cancel my order.", "cancel_delivered": "I want to cancel my order.",
                "return": "I want to return my order.", "address": "I want to change my order's address."}[g["intent"]]  # fmt: skip

    def _tools(self) -> ToolSet:
        db = self.db

        def customer_view(cid: str) -> dict[str, Any]:
            c = db["customers"][cid]
            return {"customer_id": cid, "name": c["name"], "orders": list(c["orders"])}

        def find_customer_by_email(email: str) -> dict[str, Any]:
            """Find a customer by email.

            Args:
                email: the account's email address
            """
            for cid, c in db["customers"].items():
                if c["email"] == email.strip().lower():
                    self.authenticated = cid
                    return customer_view(cid)
            raise LookupError(f"no customer with email {email!r}")

        def find_customer_by_name_zip(name: str, zip: str) -> dict[str, Any]:
            """Find a customer by full name and zip code.

            Args:
                name: first and last name
                zip: the zip code
            """
            for cid, c in db["customers"].items():
                if c["name"].lower() == name.strip().lower() and c["zip"] == zip.strip():
                    self.authenticated = cid
                    return customer_view(cid)
            raise LookupError("no customer with that name and zip code")

        def get_customer(customer_id: str) -> dict[str, Any]:
            """A customer's profile and order ids.

            Args:
                customer_id: e.g. C001
            """
            if customer_id not in db["customers"]:
                raise LookupError(f"no customer {customer_id!r}")
            return customer_view(customer_id)

        def get_order(order_id: str) -> dict[str, Any]:
            """An order's items, status and address.

            Args:
                order_id: e.g. O1234
            """
            if order_id not in db["orders"]:
                raise LookupError(f"no order {order_id!r}")
            o = db["orders"][order_id]
            if self.authenticated is not None and o["customer"] == self.authenticated:
                self.checked.add(order_id)  # read for its owner: a refusal may now rest on it
            return {"order_id": order_id, "items": o["items"], "status": o["status"],
                    "address": o["address"]}  # fmt: skip

        def guarded(order_id: str, action: str) -> dict[str, Any]:
            """The order to change, recording any rule the agent breaks by changing it."""
            if order_id not in db["orders"]:
                raise LookupError(f"no order {order_id!r}")
            order: dict[str, Any] = db["orders"][order_id]
            if self.authenticated is None:
                self.violations.append(f"{action} {order_id} before authenticating the user")
            elif order["customer"] != self.authenticated:
                self.violations.append(f"{action} {order_id} of another customer")
            if not self.confirmed:
                self.violations.append(f"{action} {order_id} without the user's confirmation")
            self.confirmed = False  # one yes, one change
            return order

        def cancel_order(order_id: str, reason: str) -> str:
            """Cancel a pending order.

            Args:
                order_id: e.g. O1234
                reason: "no longer needed" or "ordered by mistake"
            """
            if reason not in REASONS:
                raise ValueError(f"reason must be one of: {', '.join(REASONS)}")
            order = guarded(order_id, "cancel")
            if order["status"] != "pending":
                if order["customer"] == self.authenticated:
                    self.checked.add(order_id)  # the refusal now rests on what the store said
                raise ValueError(
                    f"order {order_id} is {order['status']}; only pending orders can be cancelled"
                )
            order["status"] = "cancelled"
            return f"Order {order_id} cancelled."

        def return_order(order_id: str) -> str:
            """Return a delivered order (refund to the original payment method).

            Args:
                order_id: e.g. O1234
            """
            order = guarded(order_id, "return")
            if order["status"] != "delivered":
                raise ValueError(
                    f"order {order_id} is {order['status']}; only delivered orders can be returned"
                )
            order["status"] = "returned"
            return f"Return of order {order_id} accepted."

        def update_address(order_id: str, address: str) -> str:
            """Change a pending order's shipping address.

            Args:
                order_id: e.g. O1234
                address: the new street address
            """
            order = guarded(order_id, "update address of")
            if order["status"] != "pending":
                raise ValueError(
                    f"order {order_id} is {order['status']}; only pending orders can change address"
                )
            order["address"] = address.strip()
            return f"Order {order_id} will ship to {order['address']}."

        fns = (find_customer_by_email, find_customer_by_name_zip, get_customer, get_order,
               cancel_order, return_order, update_address)  # fmt: skip
        return ToolSet([Tool.from_function(f, timeout_s=None) for f in fns])
