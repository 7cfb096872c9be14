"""``search_qa``: answer questions by searching a document collection (Search-R1 style).

By default the collection is a seeded fictional world, so no fact can come from a model's
pretraining: countries, cities, companies and people, each with one short article that
states its attributes and names related entities. Questions follow 1 to 3 relations,
e.g. 1 hop "In which city was Dara Velmon born?", 2 hops "In which country is the city
where Dara Velmon was born?", 3 hops "In which country is the city where the founder of
Tesk Labs was born?". Each hop needs a search for the entity the previous hop found
(BM25 retrieves an article by the entity's name; the question alone does not name the
later hops' entities), so the number of searches needed equals the number of hops.

The agent searches with ``search(query)`` (bm25s, top-k articles with a snippet each) in
the Search-R1 tag format (``<search>`` / ``<information>`` / ``<answer>``; ``hermes`` on
request) and answers once. Reward: normalised exact match (SQuAD normalisation, as
Search-R1); token F1 is logged beside it. A list of candidates or the answer inside a
sentence scores 0.

A user's data: ``corpus_path`` (jsonl documents: ``text`` or Search-R1's ``contents``,
optional ``title`` and ``id``) and ``qa_path`` (jsonl: ``question`` and ``answer``, a string
or a list of accepted strings; optional ``id``), with ``qa_test_path`` for the test split
(default: the same file). Tasks go through the file in a seeded order, a new order for
each pass.
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from turnrl.envs.env_card import EnvCard
from turnrl.envs.policy import Policy
from turnrl.envs.tool_env import ToolEnv
from turnrl.errors import ConfigError
from turnrl.formats import get_format
from turnrl.jsonl import read_jsonl_lines
from turnrl.protocols import Format
from turnrl.rewards import Verdict, qa_verdict
from turnrl.rewards.composite import CompositeReward
from turnrl.tools import SearchIndex, ToolSet
from turnrl.tools.search import render_hit
from turnrl.types import Message, Task, ToolCall

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br",
           "dr", "kr", "st", "tr", "sh")  # fmt: skip
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("", "", "n", "r", "l", "s", "k")
_PROFESSIONS = ("painter", "engineer", "teacher", "chemist", "sailor", "architect", "baker",
                "historian", "pilot", "composer")  # fmt: skip
_INDUSTRIES = ("shipping", "software", "textile", "mining", "publishing", "farming", "glass",
               "medical")  # fmt: skip
_COMPANY_SUFFIXES = ("Labs", "Works", "Group", "Systems", "Foundry", "Partners")

# relation: (from kind, to kind, phrase inside a longer question, question)
RELATIONS: dict[str, tuple[str, str, str, str]] = {
    "born_in": ("person", "city", "the city where {} was born", "In which city was {} born?"),
    "works_for": ("person", "company", "the company {} works for",
                  "Which company does {} work for?"),
    "founder": ("company", "person", "the founder of {}", "Who founded {}?"),
    "headquarters": ("company", "city", "the city where {} has its headquarters",
                     "In which city does {} have its headquarters?"),
    "country": ("city", "country", "the country {} is in", "In which country is {}?"),
    "capital": ("country", "city", "the capital of {}", "What is the capital of {}?"),
    "birth_year": ("person", "year", "", "In which year was {} born?"),
    "founded": ("city", "year", "", "In which year was {} founded?"),
}  # fmt: skip


@dataclass(frozen=True, eq=False)
class World:
    """The fictional world: entity name -> kind and attributes (relations hold names)."""

    kinds: dict[str, str]
    facts: dict[str, dict[str, str]]
    articles: list[dict[str, str]]

    def names(self, kind: str) -> list[str]:
        return [n for n, k in self.kinds.items() if k == kind]


@functools.lru_cache(maxsize=1024)
def build_world(seed: int | str, countries: int, cities: int, companies: int, people: int) -> World:
    """A seeded world; every name unique and no name a word of another."""
    rng = random.Random(f"search_qa-world/{seed}")
    used: set[str] = set()

    def word(syllables: int) -> str:
        while True:
            w = "".join(
                rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                for _ in range(syllables)
            ).capitalize()
            if w.lower() not in used:
                used.add(w.lower())
                return w

    kinds: dict[str, str] = {}
    facts: dict[str, dict[str, str]] = {}
    country_names = [word(2) + "ia" for _ in range(countries)]
    city_names = [word(rng.choice((2, 3))) for _ in range(cities)]
    for city in city_names:
        kinds[city] = "city"
        facts[city] = {"country": rng.choice(country_names), "founded": str(rng.randint(900, 1900))}
    for country in country_names:
        kinds[country] = "country"
        own = [c for c in city_names if facts[c]["country"] == country]
        facts[country] = {"capital": rng.choice(own)} if own else {}
    person_names = [f"{word(2)} {word(2)}" for _ in range(people)]
    company_names = [f"{word(2)} {rng.choice(_COMPANY_SUFFIXES)}" for _ in range(companies)]
    for company in company_names:
        kinds[company] = "company"
        facts[company] = {
            "founder": rng.choice(person_names),
            "headquarters": rng.choice(city_names),
            "industry": rng.choice(_INDUSTRIES),
        }
    for person in person_names:
        kinds[person] = "person"
        facts[person] = {
            "born_in": rng.choice(city_names),
            "birth_year": str(rng.randint(1900, 2000)),
            "works_for": rng.choice(company_names),
            "profession": rng.choice(_PROFESSIONS),
        }
    articles = [{"id": name, "title": name, "text": _article(name, kinds[name], facts[name])}
                for name in kinds]  # fmt: skip
    return World(kinds, facts, articles)


def _article(name: str, kind: str, f: dict[str, str]) -> str:
    if kind == "person":
        return (f"{name} is a {f['profession']} who was born in {f['born_in']} in "
                f"{f['birth_year']}. {name} works for {f['works_for']}.")  # fmt: skip
    if kind == "city":
        return f"{name} is a city in {f['country']}. It was founded in {f['founded']}."
    if kind == "company":
        return (f"{name} is a {f['industry']} company founded by {f['founder']}. Its "
                f"headquarters are in {f['headquarters']}.")  # fmt: skip
    capital = f" Its capital is {f['capital']}." if "capital" in f else ""
    return f"{name} is a country.{capital}"


@dataclass(frozen=True)
class SearchQA:
    """Search-R1-style question answering over a search engine; see the module docstring."""

    min_hops: int = 1
    """Fewest relations a question follows (1-3)."""
    max_hops: int = 3
    """Most relations a question follows (1-3); each task draws its count uniformly."""
    countries: int = 8
    cities: int = 40
    companies: int = 40
    people: int = 120
    """World size (one article per entity)."""
    relations: tuple[str, ...] = ()
    """Only these relations (names of ``RELATIONS``) in questions; empty: all. A curriculum
    knob, e.g. ``["born_in"]`` for one question shape."""
    top_k: int = 3
    """Articles per search."""
    snippet_chars: int = 200
    """Characters of each article shown (the generated articles are shorter)."""
    max_searches: int = 4
    """Search calls per episode."""
    search_reward: float = 0.0
    """Weight of a shaping term for the episode's searches (see ``search_shaping``); 0: the
    reward is the exact match alone. The outcome weight is 1 and stays dominant."""
    search_shaping: str = "toolrl"
    """The shaping term ``search_reward`` weighs. ``toolrl``: ``CompositeReward``'s ToolRL
    tool-call match in [-1, 1] between the searches and the gold ones (one per hop, the
    entity's exact name; any search earns 1/3, so it mostly pays for searching at all).
    ``retrieval``: the fraction of hops whose entity's article one of the searches brought
    back, in [0, 1]: a graded signal (a query with one word of the name already finds the
    article) for what a search is for. Paid only when the episode answers."""
    world_per_task: bool = False
    """A fresh world for every task (so no fact can be memorised across tasks: every
    answer must be searched); the default is one world for all tasks, like a corpus."""
    format: str = "search_r1"
    """Call format: ``search_r1`` tags or ``hermes`` <tool_call>."""
    corpus_path: str | None = None
    """A user's jsonl collection instead of the generated world (needs ``qa_path``)."""
    qa_path: str | None = None
    """A user's jsonl questions (train split; and test unless ``qa_test_path``)."""
    qa_test_path: str | None = None
    seed: int = 0
    """Seed of the world and of the task stream."""

    name = "search_qa"

    def __post_init__(self) -> None:
        if not 1 <= self.min_hops <= self.max_hops <= 3:
            raise ConfigError("search_qa: need 1 <= min_hops <= max_hops <= 3")
        if self.format not in ("search_r1", "hermes"):
            raise ConfigError(
                f"search_qa.format must be 'search_r1' or 'hermes', got {self.format!r}"
            )
        if (self.corpus_path is None) != (self.qa_path is None):
            raise ConfigError("search_qa: give corpus_path and qa_path together")
        if self.qa_test_path is not None and self.qa_path is None:
            raise ConfigError("search_qa: qa_test_path needs corpus_path and qa_path")
        if min(self.countries, self.cities, self.companies, self.people) < 2:
            raise ConfigError("search_qa: every entity kind needs at least 2 entities")
        unknown = sorted(set(self.relations) - set(RELATIONS))
        if unknown:
            raise ConfigError(
                f"search_qa.relations: unknown {unknown}; known: {', '.join(RELATIONS)}"
            )
        if not 0.0 <= self.search_reward <= 0.5:
            raise ConfigError("search_qa.search_reward must be in [0, 0.5]: the answer dominates")
        if self.search_shaping not in ("toolrl", "retrieval"):
            raise ConfigError(
                f"search_qa.search_shaping must be 'toolrl' or 'retrieval', "
                f"got {self.search_shaping!r}"
            )
        if self.search_shaping == "retrieval" and self.qa_path is not None:
            raise ConfigError(
                "search_qa.search_shaping = 'retrieval' needs the generated world (a user's "
                "QA file names no article per hop)"
            )
        if self.max_searches < 1 or self.top_k < 1:
            raise ConfigError("search_qa: max_searches and top_k must be >= 1")

    @functools.cached_property
    def world(self) -> World:
        """The shared world (with ``world_per_task``, the world of training task 0)."""
        return self._world("train", 0)

    def _world(self, split: str, index: int) -> World:
        key: int | str = f"{self.seed}/{split}/{index}" if self.world_per_task else self.seed
        return build_world(key, self.countries, self.cities, self.companies, self.people)

    def _index_for(self, task: Task) -> SearchIndex:
        if not self.world_per_task or self.qa_path is not None:
            return self.index
        return _world_index(self._world(*task.metadata["world"]))

    @functools.cached_property
    def index(self) -> SearchIndex:
        if self.corpus_path is not None:
            return SearchIndex.from_jsonl(self.corpus_path)
        return SearchIndex(self.world.articles)

    @functools.cached_property
    def _questions(self) -> dict[str, list[dict[str, Any]]]:
        assert self.qa_path is not None
        train = _load_qa(self.qa_path)
        return {"train": train, "test": _load_qa(self.qa_test_path) if self.qa_test_path else train}

    @property
    def reward_range(self) -> tuple[float, float]:
        """[0, 1], widened by the search-shaping term when it is on."""
        low = 0.0 if self.search_shaping == "retrieval" else -self.search_reward
        return (low, 1.0 + self.search_reward)

    @property
    def chance(self) -> float:
        """About the random policy's success: one answer among the world's names."""
        return 1.0 / len(self.world.kinds)

    def task(self, index: int, split: str = "train") -> Task:
        if self.qa_path is not None:
            rows = self._questions["test" if split == "test" else "train"]
            # each pass over the file in its own seeded order
            passes, position = divmod(index, len(rows))
            order = list(range(len(rows)))
            random.Random(f"search_qa/{self.seed}/{split}/{passes}").shuffle(order)
            row = rows[order[position]]
            golds = tuple(row["golds"])
            return Task(
                id=f"{split}-{index}",
                prompt=({"role": "user", "content": _prompt(row["question"])},),
                answer=golds[0] if len(golds) == 1 else golds,
                metadata={"question": row["question"], "source_id": row["id"]},
            )
        rng = random.Random(f"search_qa/{self.seed}/{split}/{index}")
        hops = rng.randint(self.min_hops, self.max_hops)
        world = self._world(split, index)
        for _attempt in range(10_000):
            start = rng.choice(sorted(world.kinds))
            chain = [start]
            relations: list[str] = []
            for hop in range(hops):
                kind = world.kinds[chain[-1]]
                options = [r for r, (src, dst, _, _) in RELATIONS.items()
                           if src == kind and r in world.facts[chain[-1]]
                           and (hop == hops - 1 or dst != "year")
                           and (not self.relations or r in self.relations)]  # fmt: skip
                if not options:
                    break
                relation = rng.choice(sorted(options))
                relations.append(relation)
                chain.append(world.facts[chain[-1]][relation])
            if len(relations) == hops and len(set(chain)) == len(chain):
                break
        else:
            raise ConfigError(
                f"search_qa: no {hops}-hop question can be built from relations "
                f"{list(self.relations) or 'all'} in this world"
            )
        phrase = start
        for relation in relations[:-1]:
            phrase = RELATIONS[relation][2].format(phrase)
        question = RELATIONS[relations[-1]][3].format(phrase)
        return Task(
            id=f"{split}-{index}",
            prompt=({"role": "user", "content": _prompt(question)},),
            answer=chain[-1],
            metadata={
                "question": question,
                "hops": hops,
                "chain": chain,
                "relations": relations,
                "world": [split, index],
                # the searches that find each hop: the tool-call term of a composite reward
                "gold_calls": [{"name": "search", "arguments": {"query": e}} for e in chain[:-1]],
            },
        )

    def make_env(self) -> ToolEnv:
        if self.search_reward > 0 and self.search_shaping == "retrieval":
            return self._retrieval_shaped_env()
        shaping = None
        if self.search_reward > 0:
            shaping = CompositeReward(format_weight=0.0, tool_weight=self.search_reward)
        return ToolEnv(self._tools, _verify, format=get_format(self.format),
                       max_tool_calls=self.max_searches, reward=shaping)  # fmt: skip

    def _retrieval_shaped_env(self) -> ToolEnv:
        """One episode's env whose verifier adds ``search_reward`` x the fraction of hops
        whose article the episode's searches (those that ran) brought back."""

        def verify(task: Task, answer: str) -> Verdict:
            verdict = _verify(task, answer)
            queries = [c.arguments.get("query") for c in env.calls if c.name == "search"]
            ran = [q for q in queries if isinstance(q, str)][: self.max_searches]
            hops = list(task.metadata["chain"][:-1])
            found = retrieved_fraction(self._index_for(task), ran, hops, self.top_k)
            components = {**verdict.components, "outcome": verdict.reward, "retrieved": found}
            return Verdict(verdict.reward + self.search_reward * found, verdict.success, components)

        env = ToolEnv(
            self._tools, verify, format=get_format(self.format), max_tool_calls=self.max_searches
        )
        return env

    def _tools(self, task: Task) -> ToolSet:
        """The task's search tool (its index is cached per world, so a verifier that searches
        again searches the same index)."""
        index = self._index_for(task)
        return ToolSet([index.as_tool(k=self.top_k, snippet_chars=self.snippet_chars)])

    def _shaping_text(self) -> str:
        if self.search_reward == 0:
            return ""
        if self.search_shaping == "retrieval":
            return (f"; + {self.search_reward:g} x the fraction of hops whose article a search "
                    "brought back")  # fmt: skip
        return f"; + {self.search_reward:g} x ToolRL's match of the searches to the gold ones"

    def oracle(self, task: Task) -> Policy:
        """Searches each hop's entity by name, in order, then answers with the gold answer
        if a search showed it (else "unknown": the collection would be at fault). For a
        user's data it searches the question itself."""
        fmt = get_format(self.format)
        golds = [task.answer] if isinstance(task.answer, str) else list(task.answer)
        chain = task.metadata.get("chain")
        remaining = list(chain[:-1]) if chain else [task.metadata["question"]]

        def policy(messages: Sequence[Message]) -> str:
            if remaining:
                return fmt.render_call(ToolCall("search", {"query": remaining.pop(0)}))
            seen = " ".join(str(m["content"]) for m in messages if m["role"] == "tool")
            found = next((g for g in golds if g in seen), None)
            if found is None:
                found = golds[0] if self.qa_path is not None else "unknown"
            return _answer(fmt, found)

        return policy

    def demonstration(self, task: Task, rng: random.Random) -> list[str]:
        """The format with random content that the context shows: a search for one random
        word of the question, then as the answer a random name (an entity of the world; a
        word, for a user's corpus) from what that search brings back (replayed, the random
        policy). Drawn from what the model can see, so a warm-up on these teaches copying
        from the context, never which word to copy; answers from outside the context would
        teach a model to make names up."""
        fmt = get_format(self.format)
        words = _words(str(task.metadata.get("question", task.prompt[-1]["content"])))
        query = rng.choice(words) if words else "unknown"
        hits = self._index_for(task).search(query, self.top_k)
        shown = " ".join(render_hit(h, self.snippet_chars) for h in hits)
        if self.qa_path is None:
            world = self._world(*task.metadata["world"]) if "world" in task.metadata else self.world
            names = [name for name in sorted(world.kinds) if name in shown]
        else:
            names = _words(shown)
        answer = rng.choice(names) if names else rng.choice(words or ["unknown"])
        search = fmt.render_call(ToolCall("search", {"query": query}))
        return [search, _answer(fmt, answer)]

    def corpus(self) -> list[str]:
        """Articles, questions, calls and answers, for a tiny tokenizer."""
        fmt = get_format(self.format)
        lines = []
        if self.qa_path is None:
            for i in range(20 if self.world_per_task else 1):
                lines += [a["text"] for a in self._world("corpus", i).articles]
        for i in range(200):
            task = self.task(i, "corpus")
            lines.append(str(task.prompt[0]["content"]))
            lines.append(fmt.render_call(ToolCall("search", {"query": str(task.answer)})))
            lines.append(_answer(fmt, str(task.answer)))
        return lines

    @property
    def card(self) -> EnvCard:
        source = (f"the jsonl collection {self.corpus_path}" if self.corpus_path else
                  f"a seeded fictional world of {len(self.world.kinds)} articles")  # fmt: skip
        return EnvCard(
            name=self.name,
            summary=f"answer {self.min_hops}- to {self.max_hops}-hop questions by searching "
            f"{source}",
            tools=(
                f"search(query: str) -> top {self.top_k} articles (title + "
                f"{self.snippet_chars}-char snippet), BM25",
            ),
            tool_budget=self.max_searches,
            turn_limit=None,
            scaffold=f"{self.format} format; the prompt asks for the answer in the format's "
            "final-answer syntax; each search's results come back as an observation",
            evaluator="reward = exact match after SQuAD normalisation (lower case, no "
            "punctuation or articles) with any accepted answer; token F1 logged"
            + self._shaping_text(),
            on_failure="a malformed turn or a search past the budget is an error observation "
            "and the episode goes on; a wrong answer ends it with 0",
            chance=self.chance,
        )


def retrieved_fraction(
    index: SearchIndex, queries: Sequence[str], entities: Sequence[str], k: int
) -> float:  # fmt: skip
    """The fraction of ``entities`` whose article (document id = the entity's name) is among
    the top ``k`` hits of at least one of ``queries``; 0 with no entities."""
    if not entities:
        return 0.0
    shown = {hit.document.id for hits in index.search_batch(list(queries), k) for hit in hits}
    return sum(e in shown for e in entities) / len(entities)


@functools.lru_cache(maxsize=256)
def _world_index(world: World) -> SearchIndex:
    return SearchIndex(world.articles)


def _words(text: str) -> list[str]:
    """The words of ``text``, without punctuation."""
    return re.findall(r"[^\W_]+(?:['-][^\W_]+)*", text)


def _prompt(question: str) -> str:
    return f"Answer the question. Search for what you need.\nQuestion: {question}"


def _answer(fmt: Format, text: str) -> str:
    """A final answer in the format's syntax."""
    if fmt.name == "search_r1":
        return f"<answer>{text}</answer>"
    return text


def _verify(task: Task, answer: str) -> Verdict:
    golds = [task.answer] if isinstance(task.answer, str) else list(task.answer)
    return qa_verdict(answer, golds)


def _load_qa(path: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for n, row in read_jsonl_lines(path):
        answer = row.get("answer", row.get("golden_answers")) if isinstance(row, dict) else None
        golds = [answer] if isinstance(answer, str) else answer
        if (
            not isinstance(row, dict)
            or not isinstance(row.get("question"), str)
            or not isinstance(golds, list)
            or not golds
            or not all(isinstance(g, str) and g.strip() for g in golds)
        ):
            raise ConfigError(
                f"{path}:{n}: expected an object with a string 'question' and an 'answer' "
                "(a non-empty string or list of strings)"
            )
        rows.append({"id": str(row.get("id", n)), "question": row["question"], "golds": golds})
    if not rows:
        raise ConfigError(f"{path}: no questions")
    return rows
