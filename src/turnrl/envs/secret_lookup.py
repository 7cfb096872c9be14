"""The probe environment "secret lookup": success needs the tool, by construction.

Each episode holds a hidden table mapping a few keys to values drawn uniformly from
``num_values`` words. The question asks for one key's value; only ``lookup(key)`` reveals
it. A policy that never calls the tool (or calls it with the wrong key) succeeds only by
chance, 1 / num_values. To succeed, a model must copy the key from the question into the
call and copy the value from the tool's response into its answer: two skills that RL has
to find, because the warm-up demonstrations use random keys and random answers.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass

from turnrl.envs.env_card import EnvCard
from turnrl.envs.policy import Policy
from turnrl.envs.tool_env import ToolEnv
from turnrl.errors import ConfigError
from turnrl.formats import get_format
from turnrl.rewards import Verdict, exact_match
from turnrl.tools import Tool, ToolSet
from turnrl.types import Message, Task, ToolCall

KEY_NAMES = (
    "alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta",
    "iota", "kappa", "lambda", "mu", "nu", "xi", "omicron", "pi",
)  # fmt: skip
VALUE_NAMES = (
    "cat", "dog", "fox", "owl", "bee", "cow", "pig", "hen",
    "ant", "elk", "yak", "bat", "eel", "emu", "ram", "rat",
)  # fmt: skip


@dataclass(frozen=True)
class SecretLookup:
    """Task source, environment factory and warm-up teacher for the secret-lookup probe."""

    num_keys: int = 4
    """Keys in each episode's hidden table."""
    key_pool: int = 8
    """Distinct key names the tables draw from (the warm-up calls use any of them)."""
    num_values: int = 12
    """Distinct values; chance success is 1 / num_values."""
    tools_enabled: bool = True
    """False removes the lookup tool (a control: nothing can then beat chance)."""
    seed: int = 0
    """Seed of the task stream (tasks are a pure function of seed, split and index)."""
    format: str = "hermes"
    """The tool-call format (``turnrl.formats``): ``hermes`` for Qwen-style templates,
    ``llama3_json`` or ``mistral`` for those families' models."""
    latency_s: float = 0.0
    """Seconds each lookup takes (a slow API: benchmarks of overlap and concurrency)."""

    name = "secret_lookup"

    def __post_init__(self) -> None:
        if not 1 <= self.key_pool <= len(KEY_NAMES):
            raise ConfigError(f"secret_lookup.key_pool must be in 1..{len(KEY_NAMES)}")
        if not 1 <= self.num_keys <= self.key_pool:
            raise ConfigError("secret_lookup.num_keys must be in 1..key_pool")
        if not 10 <= self.num_values <= len(VALUE_NAMES):
            raise ConfigError(
                f"secret_lookup.num_values must be in 10..{len(VALUE_NAMES)} "
                "(chance success must stay at or below 10%)"
            )
        if not 0.0 <= self.latency_s <= 4.0:
            raise ConfigError("secret_lookup.latency_s must be in 0..4 (the tool's limit is 5 s)")
        get_format(self.format)  # an unknown name fails here, naming the known ones

    @property
    def chance(self) -> float:
        """Success rate of any policy that does not read the tool's output."""
        return 1.0 / self.num_values

    def task(self, index: int, split: str = "train") -> Task:
        rng = random.Random(f"{self.seed}/{split}/{index}")
        keys = rng.sample(KEY_NAMES[: self.key_pool], self.num_keys)
        table = {k: rng.choice(VALUE_NAMES[: self.num_values]) for k in keys}
        asked = rng.choice(keys)
        return Task(
            id=f"{split}-{index}",
            prompt=({"role": "user", "content": f"What is the value of {asked}?"},),
            answer=table[asked],
            metadata={"table": table, "key": asked},
        )

    def make_env(self) -> ToolEnv:
        return ToolEnv(self._tools, _verify, format=get_format(self.format), max_tool_calls=4)

    def _tools(self, task: Task) -> ToolSet:
        if not self.tools_enabled:
            return ToolSet([])
        table: dict[str, str] = dict(task.metadata["table"])
        latency = self.latency_s

        async def lookup(key: str) -> str:
            """Look up a key.

            Args:
                key: The key.
            """
            if latency:
                await asyncio.sleep(latency)
            if key not in table:
                raise LookupError(f"no key {key!r} in the table")
            return table[key]

        return ToolSet([Tool.from_function(lookup, timeout_s=5.0)])

    def oracle(self, task: Task) -> Policy:
        """Looks up the asked key, then answers with what the tool returned."""
        call = get_format(self.format).render_call(
            ToolCall("lookup", {"key": task.metadata["key"]})
        )

        guess = VALUE_NAMES[0]  # without the tool nothing beats chance

        def policy(messages: Sequence[Message]) -> str:
            if not any(m["role"] == "tool" for m in messages):
                return call if self.tools_enabled else guess
            return str(messages[-1]["content"]).strip()

        return policy

    @property
    def oracle_success(self) -> float:
        """1, or chance when the tool is removed (the no-tools control)."""
        return 1.0 if self.tools_enabled else self.chance

    @property
    def card(self) -> EnvCard:
        return EnvCard(
            name=self.name,
            summary=f"answer the value of the asked key (of {self.num_keys}) in a hidden table; "
            "only lookup(key) reveals it",
            tools=("lookup(key: str) -> the key's value",) if self.tools_enabled else (),
            tool_budget=4,
            turn_limit=None,
            scaffold=f"{self.format} tool-call format; the question names the key",
            evaluator="reward = exact match of the answer with the key's value",
            on_failure="an unknown key is an error result and the episode goes on; a wrong "
            "answer ends it with 0",
            chance=self.chance,
        )

    def demonstration(self, task: Task, rng: random.Random) -> list[str]:
        """Assistant turns that show the format only: a call with a random key, then a
        random answer. They teach grammar, never the solution (the warm-up's job)."""
        key = rng.choice(KEY_NAMES[: self.key_pool])
        call = get_format(self.format).render_call(ToolCall("lookup", {"key": key}))
        return [call, rng.choice(VALUE_NAMES[: self.num_values])]

    def corpus(self) -> list[str]:
        """Text for a tiny tokenizer: every key and value, questions and calls."""
        calls = get_format(self.format)
        lines = [f"What is the value of {k}?" for k in KEY_NAMES]
        lines += [calls.render_call(ToolCall("lookup", {"key": k})) for k in KEY_NAMES]
        lines += [" ".join(VALUE_NAMES), *VALUE_NAMES, *KEY_NAMES]
        return lines * 20


def _verify(task: Task, answer: str) -> Verdict:
    return exact_match(answer, str(task.answer))
