"""``shop``: buy the product an instruction describes (WebShop style, Yao et al., 2022).

A seeded catalogue of products (category, brand, features, options such as colour and
size, price) sits behind four tools: ``search(query, page)`` (BM25 over titles, features
and options; five results a page, id, title and price), ``open(product_id)`` (the product
page: features, options, price), ``choose(option, value)`` (on the open product) and
``buy()`` (the open product with the chosen options; ends the episode). Each instruction is
written from one target product: its category, one or two of its features, one value of
each of its options and a price ceiling above its price, e.g. "I need a backpack that is
waterproof and lightweight, color: navy, size: large, price under $64". Any product that
satisfies it earns full reward, the target or another.

Reward (WebShop's attribute/option/price match): 0 if the bought product is of another
category, else the share of wanted features it has, option values chosen, and the price
condition met: (features + options + price) / (wanted features + wanted options + 1).
Success is reward 1. Running out of moves or turns, or stopping without buying, is 0.
"""

from __future__ import annotations

import functools
import math
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from turnrl.envs.env_card import EnvCard
from turnrl.envs.games.game_env import GameEnv, Outcome
from turnrl.envs.policy import Policy, demonstration_corpus
from turnrl.errors import ConfigError
from turnrl.formats import get_format
from turnrl.tools import SearchIndex, Tool, ToolSet
from turnrl.types import Message, Task, ToolCall

PAGE_SIZE = 5
CATEGORIES: dict[str, tuple[tuple[str, ...], dict[str, tuple[str, ...]]]] = {
    "backpack": (("waterproof", "lightweight", "padded", "anti-theft", "foldable"),
                 {"color": ("black", "navy", "olive", "grey", "red"),
                  "size": ("small", "medium", "large")}),
    "t-shirt": (("cotton", "organic", "slim-fit", "v-neck", "breathable"),
                {"color": ("white", "black", "blue", "green", "yellow"),
                 "size": ("xs", "s", "m", "l", "xl")}),
    "mug": (("ceramic", "insulated", "dishwasher-safe", "microwave-safe", "handmade"),
            {"color": ("white", "black", "teal", "pink"), "capacity": ("12oz", "16oz", "20oz")}),
    "headphones": (("wireless", "noise-cancelling", "over-ear", "foldable", "waterproof"),
                   {"color": ("black", "white", "silver", "blue")}),
    "lamp": (("led", "dimmable", "rechargeable", "clamp", "touch-control"),
             {"color": ("black", "white", "brass", "green"), "light": ("warm", "cool")}),
    "sneakers": (("leather", "breathable", "lightweight", "waterproof", "slip-on"),
                 {"color": ("white", "black", "grey", "red"),
                  "size": ("7", "8", "9", "10", "11")}),
}  # fmt: skip
_BRAND_PARTS = ("nor", "vel", "tas", "kor", "lum", "bri", "zan", "oro", "fel", "quin", "dax",
                "mira", "sol", "tev", "ula")  # fmt: skip


@dataclass(frozen=True)
class Product:
    id: str
    category: str
    brand: str
    features: tuple[str, ...]
    options: dict[str, tuple[str, ...]]
    price: float

    @property
    def title(self) -> str:
        return f"{self.brand} {' '.join(self.features[:2])} {self.category}"

    def page(self) -> str:
        options = "; ".join(f"{k}: {', '.join(v)}" for k, v in self.options.items())
        return (f"{self.id}: {self.title}\nprice: ${self.price:.2f}\n"
                f"features: {', '.join(self.features)}\noptions: {options}")  # fmt: skip


def build_catalogue(seed: int, size: int) -> list[Product]:
    """``size`` seeded products, categories in turn."""
    rng = random.Random(f"shop-catalogue/{seed}")
    brands = sorted({(rng.choice(_BRAND_PARTS) + rng.choice(_BRAND_PARTS)).capitalize()
                     for _ in range(40)})  # fmt: skip
    products = []
    names = sorted(CATEGORIES)
    for i in range(size):
        category = names[i % len(names)]
        features, options = CATEGORIES[category]
        products.append(
            Product(
                id=f"P{i:04d}",
                category=category,
                brand=rng.choice(brands),
                features=tuple(rng.sample(features, rng.randint(2, 3))),
                options={
                    k: tuple(sorted(rng.sample(v, rng.randint(2, len(v)))))
                    for k, v in options.items()
                },
                price=round(rng.uniform(8, 120), 2),
            )
        )
    return products


@dataclass(frozen=True)
class Shop:
    """WebShop-style shopping over a seeded catalogue; see the module docstring."""

    catalogue_size: int = 300
    """Products in the catalogue (categories in turn)."""
    max_moves: int = 20
    """Tool calls per episode."""
    max_turns: int = 12
    """Model turns per episode."""
    seed: int = 0
    """Seed of the catalogue and of the task stream."""

    name = "shop"

    def __post_init__(self) -> None:
        if self.catalogue_size < 2 * len(CATEGORIES):
            raise ConfigError(f"shop.catalogue_size must be >= {2 * len(CATEGORIES)}")
        if self.max_moves < 4 or self.max_turns < 2:
            raise ConfigError("shop: max_moves >= 4 and max_turns >= 2 (search, open, choose, buy)")

    @functools.cached_property
    def products(self) -> dict[str, Product]:
        return {p.id: p for p in build_catalogue(self.seed, self.catalogue_size)}

    @functools.cached_property
    def index(self) -> SearchIndex:
        return SearchIndex(
            {"id": p.id, "title": p.title,
             "text": f"{p.category} {' '.join(p.features)} "
                     + " ".join(v for vs in p.options.values() for v in vs)}
            for p in self.products.values()
        )  # fmt: skip

    chance = 0.0
    """A random product with random options almost never meets every condition."""

    def task(self, index: int, split: str = "train") -> Task:
        rng = random.Random(f"shop/{self.seed}/{split}/{index}")
        target = self.products[rng.choice(sorted(self.products))]
        wanted_features = sorted(rng.sample(target.features, rng.randint(1, 2)))
        wanted_options = {k: rng.choice(v) for k, v in target.options.items()}
        ceiling = math.ceil(target.price * rng.uniform(1.1, 1.5))
        options_text = ", ".join(f"{k}: {v}" for k, v in wanted_options.items())
        instruction = (f"I need a {target.category} that is {' and '.join(wanted_features)}, "
                       f"{options_text}, price under ${ceiling}.")  # fmt: skip
        prompt = (f"{instruction}\nFind it in the shop with the tools: search, open a product, "
                  "choose its options, then buy it.")  # fmt: skip
        return Task(
            id=f"{split}-{index}",
            prompt=({"role": "user", "content": prompt},),
            answer=target.id,
            metadata={
                "category": target.category,
                "features": wanted_features,
                "options": wanted_options,
                "ceiling": ceiling,
            },
        )

    def make_env(self) -> GameEnv:
        return GameEnv(lambda task, seed: _Session(self, task), max_moves=self.max_moves,
                       max_turns=self.max_turns)  # fmt: skip

    def score(self, task: Task, product: Product, chosen: dict[str, str]) -> Outcome:
        """The WebShop-style match of a purchase against the task's instruction."""
        m = task.metadata
        if product.category != m["category"]:
            return Outcome(0.0, False, f"bought a {product.category}, not a {m['category']}",
                           {"category": 0.0})  # fmt: skip
        features = sum(f in product.features for f in m["features"])
        options = sum(chosen.get(k) == v for k, v in m["options"].items())
        price = float(product.price < m["ceiling"])
        total = len(m["features"]) + len(m["options"]) + 1
        reward = (features + options + price) / total
        return Outcome(
            reward, reward == 1.0, f"bought {product.id}",
            {"category": 1.0, "features": features / len(m["features"]),
             "options": options / len(m["options"]), "price": price},
        )  # fmt: skip

    def oracle(self, task: Task) -> Policy:
        """Searches the instruction's words, opens the results of a page that are under the
        price ceiling at once, and buys the first product whose page meets every condition
        (else the next page)."""
        m = task.metadata
        query = " ".join([*m["features"], m["category"], *m["options"].values()])
        state: dict[str, Any] = {"page": 0, "opened": False}

        def policy(messages: Sequence[Message]) -> str:
            last = [str(x["content"]) for x in _last_observations(messages)]
            if state["opened"]:
                for page in last:
                    if _meets(page, m):
                        pid = page.split(":", 1)[0]
                        calls = [ToolCall("open", {"product_id": pid})]
                        calls += [ToolCall("choose", {"option": k, "value": v})
                                  for k, v in m["options"].items()]  # fmt: skip
                        return _calls([*calls, ToolCall("buy", {})])
                state["opened"] = False
            if state["page"] and last and not state["opened"] and "[P" in last[0]:
                # open the results under the price ceiling, all in one turn
                listed = re.findall(r"\[(P\d{4})\] .* \$([\d.]+)", last[0])
                ids = [i for i, price in listed if float(price) < m["ceiling"]]
                if ids:
                    state["opened"] = True
                    return _calls([ToolCall("open", {"product_id": i}) for i in ids])
            state["page"] += 1
            return _calls([ToolCall("search", {"query": query, "page": state["page"]})])

        return policy

    def demonstration(self, task: Task, rng: random.Random) -> list[str]:
        """The format with random content: a search, opening a random product, a random
        option value, buying (replayed, the random policy)."""
        product = self.products[rng.choice(sorted(self.products))]
        option = rng.choice(sorted(product.options))
        return [
            _calls([ToolCall("search", {"query": rng.choice(sorted(CATEGORIES)), "page": 1})]),
            _calls([ToolCall("open", {"product_id": product.id})]),
            _calls(
                [
                    ToolCall(
                        "choose", {"option": option, "value": rng.choice(product.options[option])}
                    )
                ]
            ),
            _calls([ToolCall("buy", {})]),
        ]

    def corpus(self) -> list[str]:
        return [p.page() for p in self.products.values()] + demonstration_corpus(self, 100)

    @property
    def card(self) -> EnvCard:
        return EnvCard(
            name=self.name,
            summary=f"buy the product an instruction describes, from a catalogue of "
            f"{self.catalogue_size}",
            tools=(
                "search(query: str, page: int = 1) -> 5 results a page",
                "open(product_id: str) -> the product page",
                "choose(option: str, value: str)",
                "buy() -> ends the episode",
            ),
            tool_budget=self.max_moves,
            turn_limit=self.max_turns,
            scaffold="hermes <tool_call> format (several calls per turn allowed); the prompt "
            "holds the instruction",
            evaluator="0 for another category, else (wanted features present + option values "
            "chosen + price under the ceiling) / (their count + 1); success = 1",
            on_failure="a bad id, option or value is an error result and the episode goes on; "
            "no purchase by the move or turn limit, or a turn without a call, is 0",
            chance=self.chance,
        )


def _calls(calls: list[ToolCall]) -> str:
    hermes = get_format("hermes")
    return "\n".join(hermes.render_call(c) for c in calls)


def _last_observations(messages: Sequence[Message]) -> list[Message]:
    out: list[Message] = []
    for m in reversed(messages):
        if m["role"] != "tool":
            break
        out.append(m)
    return out[::-1]


def _meets(page: str, m: Mapping[str, Any]) -> bool:
    """Whether a product page (as ``open`` shows it) satisfies every condition."""
    found = re.match(r"P\d{4}: .*\nprice: \$([\d.]+)\nfeatures: (.*)\noptions: (.*)", page)
    if found is None:
        return False
    price, features, options = float(found[1]), found[2].split(", "), found[3]
    offered = {k: v.split(", ") for k, v in (o.split(": ", 1) for o in options.split("; "))}
    return (
        f" {m['category']}\n" in page.split("\nprice")[0] + "\n"
        and price < m["ceiling"]
        and all(f in features for f in m["features"])
        and all(v in offered.get(k, []) for k, v in m["options"].items())
    )


class _Session:
    """One episode in the shop: the open product and the chosen options."""

    def __init__(self, shop: Shop, task: Task) -> None:
        self.shop, self.task = shop, task
        self.current: Product | None = None
        self.chosen: dict[str, str] = {}
        self.bought: Outcome | None = None

    def tools(self) -> ToolSet:
        shop = self.shop

        def search(query: str, page: int = 1) -> str:
            """Search the shop.

            Args:
                query: words describing the product
                page: result page, from 1
            """
            if page < 1:
                raise ValueError("page starts at 1")
            hits = shop.index.search(query, k=PAGE_SIZE * page)[PAGE_SIZE * (page - 1) :]
            if not hits:
                return f"No results on page {page} for {query!r}."
            return "\n".join(
                f"[{h.document.id}] {h.document.title} ${shop.products[h.document.id].price:.2f}"
                for h in hits
            )

        def open(product_id: str) -> str:
            """Open a product page.

            Args:
                product_id: the id shown in search results, e.g. P0042
            """
            if product_id not in shop.products:
                raise KeyError(f"no product {product_id!r}")
            self.current, self.chosen = shop.products[product_id], {}
            return self.current.page()

        def choose(option: str, value: str) -> str:
            """Choose an option of the open product.

            Args:
                option: the option's name, e.g. color
                value: one of the option's values
            """
            if self.current is None:
                raise RuntimeError("open a product first")
            values = self.current.options.get(option)
            if values is None:
                raise ValueError(f"{self.current.id} has no option {option!r}; "
                                 f"options: {', '.join(self.current.options)}")  # fmt: skip
            if value not in values:
                raise ValueError(f"{option} must be one of {', '.join(values)}")
            self.chosen[option] = value
            return f"{option}: {value}"

        def buy() -> str:
            """Buy the open product with the chosen options."""
            if self.current is None:
                raise RuntimeError("open a product first")
            missing = [k for k in self.current.options if k not in self.chosen]
            if missing:
                raise ValueError(f"choose {', '.join(missing)} first")
            self.bought = shop.score(self.task, self.current, self.chosen)
            return f"Bought {self.current.id}."

        return ToolSet([Tool.from_function(f, timeout_s=None) for f in (search, open, choose, buy)])

    def outcome(self) -> Outcome | None:
        return self.bought
