"""``check_env``: a contract check for environment families (``turnrl envs check NAME``),
in the spirit of Gymnasium's ``check_env``.

It plays up to three text-level policies on ``num_tasks`` seeded test tasks, each episode
twice with the same seed: the family's oracle (if it has ``oracle(task)``), the random
policy (its ``demonstration`` turns replayed) and a stalling policy (a call to a tool that
does not exist, every turn). What it checks:

- tasks: the same options give the same tasks (and a different seed other tasks); ids are
  unique across indices and splits; tasks are JSON data;
- runs: ``reset`` and ``step`` never raise (for the text these policies write);
- determinism: the same task and seed replay the same opening, observations, rewards and
  end flags;
- schemas: each tool schema is an OpenAI function whose parameters are a JSON schema object;
- messages: the opening messages and observations are ``{"role", "content": str}`` dicts;
- end flags: never terminated and truncated at once; a terminated step reports ``success``;
  a truncated one never succeeds; a stalling policy is never terminated; where the card
  declares a turn limit, every episode ends by it, and the stalling one is truncated with
  ``info["truncated_reason"]``;
- rewards: finite, within ``reward_range`` (default [0, 1]) per step and per episode;
- oracle: its success rate is at least 0.99 (or, for a family whose oracle cannot always
  win, e.g. on slippery ice, its declared ``oracle_success`` less three standard errors).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from turnrl.envs.policy import Episode, HasCard, HasOracle, Policy, play, replay
from turnrl.envs.registry import EnvSpec
from turnrl.formats import get_format
from turnrl.protocols import Env, Format
from turnrl.types import Message, Task, ToolCall

CHECKS = ("tasks", "runs", "determinism", "schemas", "messages", "end flags", "rewards", "oracle")
MAX_STEPS = 32
"""Steps per episode when the family declares no turn limit (the runner's limit then)."""
ROLES = ("system", "user", "assistant", "tool")
JSON_TYPES = ("string", "number", "integer", "boolean", "array", "object", "null")
PolicyMaker = Callable[[Env], "Policy | None"]
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class Check:
    """One row of the report: a named check, whether it passed, and the first problem."""

    name: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class EnvReport:
    """What ``check_env`` found, with the oracle's and the random policy's results."""

    name: str
    num_tasks: int
    checks: tuple[Check, ...]
    oracle_success: float | None
    oracle_reward: float | None
    random_success: float
    random_reward: float

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def table(self) -> str:
        """A markdown table of the checks, then a line of policy results."""
        rows = ["| check | result | detail |", "|---|---|---|"]
        rows += [f"| {c.name} | {'ok' if c.ok else 'FAIL'} | {c.detail} |" for c in self.checks]
        oracle = (
            "no oracle"
            if self.oracle_success is None
            else f"oracle success {self.oracle_success:.2f} (reward {self.oracle_reward:.3f})"
        )
        rows.append("")
        rows.append(
            f"{oracle}; random success {self.random_success:.2f} "
            f"(reward {self.random_reward:.3f}) over {self.num_tasks} tasks"
        )
        return "\n".join(rows)


def check_env(spec: EnvSpec, *, num_tasks: int = 20, seed: int = 0) -> EnvReport:
    """Check ``spec`` on ``num_tasks`` test tasks; ``seed`` seeds the episodes."""
    if num_tasks < 1:
        raise ValueError("num_tasks must be >= 1")
    return asyncio.run(_check(spec, num_tasks, seed))


async def _check(spec: EnvSpec, num_tasks: int, seed: int) -> EnvReport:
    found: dict[str, list[str]] = {name: [] for name in CHECKS}
    turn_limit = spec.card.turn_limit if isinstance(spec, HasCard) else None
    low, high = getattr(spec, "reward_range", (0.0, 1.0))
    try:
        found["tasks"] += _task_problems(spec, num_tasks)
    except Exception as exc:
        found["tasks"].append(f"building tasks raised {exc!r}")
    episodes: dict[str, list[Episode]] = {}
    tool_names: set[str] = set()
    steps = turn_limit + 1 if turn_limit else MAX_STEPS
    for index in range(num_tasks):
        task = spec.task(index, "test")
        for label, make_policy in _policies(spec, task, seed=f"{seed}/{index}").items():
            runs: list[Episode] = []
            for _ in range(2):
                env = spec.make_env()
                policy = make_policy(env)
                if policy is None:
                    break
                episode_seed = seed * 1_000_003 + index
                try:
                    runs.append(await play(env, task, policy, seed=episode_seed, max_steps=steps))
                except Exception as exc:  # a crash is a finding, not the checker's crash
                    found["runs"].append(f"{label} policy, task {task.id}: {exc!r}")
                    break
                schemas = env.tool_schemas()
                # A format that lists tools in its own system prompt (search_r1, react)
                # sends no schemas to the template; check the ToolEnv's tools themselves.
                own = getattr(getattr(env, "tools", None), "schemas", None)
                if isinstance(schemas, list) and not schemas and callable(own):
                    schemas = own()
                found["schemas"] += _schema_problems(schemas)
                tool_names |= {str(s.get("function", {}).get("name")) for s in schemas}
            if len(runs) < 2:
                continue
            where = f"{label} policy, task {task.id}"
            if _transcript(runs[0]) != _transcript(runs[1]):
                found["determinism"].append(f"{where}: the same seed gave a different episode")
            episode = runs[0]
            episodes.setdefault(label, []).append(episode)
            for check, problems in (
                ("messages", _message_problems(episode)),
                ("end flags", _flag_problems(episode, label, turn_limit)),
                ("rewards", _reward_problems(episode, low, high)),
            ):
                found[check] += [f"{where}: {p}" for p in problems]
    oracle = episodes.get("oracle", [])
    oracle_success = _rate(oracle, lambda e: float(e.success))
    required = _required_oracle_success(getattr(spec, "oracle_success", 1.0), num_tasks)
    if oracle_success is not None and oracle_success < required:
        found["oracle"].append(f"success {oracle_success:.3f} < required {required:.3f}")
    played = sum(len(e) for e in episodes.values())
    ends = Counter(
        e.results[-1].info.get("truncated_reason", e.ended_by) if e.results else e.ended_by
        for e in episodes.get("stall", [])
    )
    notes = {
        "tasks": f"{num_tasks} tasks x 2 splits, built twice; ids unique; seed matters",
        "determinism": f"{played} episodes ({', '.join(episodes)}), each replayed",
        "schemas": f"tools: {', '.join(sorted(tool_names)) or 'none'}",
        "runs": "reset and step never raised",
        "messages": "opening and observations are role/content messages",
        "end flags": f"turn limit: {turn_limit or 'none declared'}; stalling episodes: "
        + (", ".join(f"{k} {v}/{num_tasks}" for k, v in sorted(ends.items())) or "none"),
        "rewards": f"finite, in [{low:g}, {high:g}] per step and per episode",
        "oracle": "no oracle(task)"
        if oracle_success is None
        else f"success {oracle_success:.2f} >= {required:.2f}",
    }
    checks = tuple(
        Check(name, not problems, _detail(problems, notes[name]))
        for name, problems in found.items()
    )
    randoms = episodes.get("random", [])
    return EnvReport(
        name=str(getattr(spec, "name", type(spec).__name__)),
        num_tasks=num_tasks,
        checks=checks,
        oracle_success=oracle_success,
        oracle_reward=_rate(oracle, lambda e: e.reward),
        random_success=_rate(randoms, lambda e: float(e.success)) or 0.0,
        random_reward=_rate(randoms, lambda e: e.reward) or 0.0,
    )


def _detail(problems: list[str], note: str) -> str:
    if not problems:
        return note
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return problems[0].replace("|", "/") + more


def _rate(episodes: list[Episode], value: Callable[[Episode], float]) -> float | None:
    return sum(value(e) for e in episodes) / len(episodes) if episodes else None


def _required_oracle_success(expected: float, n: int) -> float:
    """0.99, or for an oracle that cannot always win, its expectation less 3 standard errors."""
    return min(0.99, expected - 3.0 * math.sqrt(expected * (1.0 - expected) / n))


def _policies(spec: EnvSpec, task: Task, *, seed: str) -> dict[str, PolicyMaker]:
    """The policies to play on ``task``, each made fresh per episode from its env."""

    def random_policy(env: Env) -> Policy:
        return replay(spec.demonstration(task, random.Random(seed)))

    makers: dict[str, PolicyMaker] = {"random": random_policy, "stall": _stall_policy}
    if isinstance(spec, HasOracle):
        oracle = spec
        makers["oracle"] = lambda env: oracle.oracle(task)
    return makers


def _stall_policy(env: Env) -> Policy | None:
    """Every turn, a call to a tool that does not exist, in the env's own call format."""
    fmt = getattr(env, "format", None)
    fmt = fmt if isinstance(fmt, Format) else get_format("hermes")
    try:
        text = fmt.render_call(ToolCall("no_such_tool", {}))
    except ValueError:
        return None
    return replay([], then=text)


def _task_problems(spec: EnvSpec, num_tasks: int) -> list[str]:
    problems: list[str] = []
    twin = dataclasses.replace(spec) if dataclasses.is_dataclass(spec) else spec  # type: ignore[type-var]
    ids: set[str] = set()
    prompts: set[str] = set()
    for split in ("train", "test"):
        for index in range(num_tasks):
            task = spec.task(index, split)
            if task != spec.task(index, split) or task != twin.task(index, split):
                problems.append(f"task {index} ({split}) differs between two builds")
            if task.id in ids:
                problems.append(f"task id {task.id!r} repeats")
            ids.add(task.id)
            prompts.add(json.dumps(task.prompt, sort_keys=True, default=str))
            try:
                json.dumps([task.prompt, task.answer, dict(task.metadata)])
            except (TypeError, ValueError) as exc:
                problems.append(f"task {task.id} is not JSON data ({exc})")
    if num_tasks > 1 and len(prompts) == 1:
        problems.append("every task has the same prompt")
    seed = getattr(spec, "seed", None)
    if dataclasses.is_dataclass(spec) and isinstance(seed, int):
        other = dataclasses.replace(spec, seed=seed + 1)  # type: ignore[type-var]
        if all(other.task(i, "test") == spec.task(i, "test") for i in range(max(num_tasks, 5))):
            problems.append("a different seed gives the same tasks")
    return problems


def _schema_problems(schemas: Any) -> list[str]:
    if not isinstance(schemas, list):
        return [f"tool_schemas() must return a list, got {type(schemas).__name__}"]
    problems: list[str] = []
    names: list[str] = []
    for schema in schemas:
        function = schema.get("function") if isinstance(schema, dict) else None
        if (
            not isinstance(schema, dict)
            or schema.get("type") != "function"
            or not isinstance(function, dict)
        ):
            problems.append(f"not an OpenAI function schema: {schema!r:.80}")
            continue
        name = function.get("name")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            problems.append(f"tool name {name!r} must match {_NAME_RE.pattern}")
            continue
        names.append(name)
        if not isinstance(function.get("description", ""), str):
            problems.append(f"{name}: description must be a string")
        problems += [f"{name}: {p}" for p in _parameters_problems(function.get("parameters"))]
        try:
            json.dumps(schema)
        except (TypeError, ValueError) as exc:
            problems.append(f"{name}: schema is not JSON ({exc})")
    if len(set(names)) != len(names):
        problems.append(f"duplicate tool names in {names}")
    return problems


def _parameters_problems(parameters: Any) -> list[str]:
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        return ['parameters must be a JSON schema with "type": "object"']
    properties = parameters.get("properties", {})
    if not isinstance(properties, dict):
        return ["parameters.properties must be an object"]
    problems = []
    for key, prop in properties.items():
        if not isinstance(prop, dict) or not {"type", "enum", "anyOf"} & set(prop):
            problems.append(f"property {key!r} needs a type, enum or anyOf")
        elif "type" in prop and prop["type"] not in JSON_TYPES:
            problems.append(f"property {key!r} has unknown type {prop['type']!r}")
        elif "enum" in prop and (not isinstance(prop["enum"], list) or not prop["enum"]):
            problems.append(f"property {key!r} has an empty or non-list enum")
    required = parameters.get("required", [])
    if not isinstance(required, list) or not set(required) <= set(properties):
        problems.append(f"required {required!r} must list properties")
    return problems


def _message_problems(episode: Episode) -> list[str]:
    messages: list[Message] = [*episode.opening]
    for result in episode.results:
        messages += result.observation
    if not episode.opening:
        return ["reset() returned no messages"]
    return [
        f"malformed message {m!r:.80}"
        for m in messages
        if not isinstance(m, dict)
        or m.get("role") not in ROLES
        or not isinstance(m.get("content"), str)
    ]


def _flag_problems(episode: Episode, label: str, turn_limit: int | None) -> list[str]:
    problems = []
    for turn, result in enumerate(episode.results, 1):
        if result.terminated and result.truncated:
            problems.append(f"turn {turn}: terminated and truncated at once")
        if result.terminated and not isinstance(result.info.get("success"), bool):
            problems.append(f"turn {turn}: terminated without a bool info['success']")
        if result.truncated and result.info.get("success"):
            problems.append(f"turn {turn}: truncated but reported success")
    if label == "stall" and episode.ended_by == "terminated":
        problems.append("calls to an unknown tool ended the episode as terminated")
    if turn_limit is not None:
        if len(episode.results) > turn_limit or episode.ended_by == "max_steps":
            problems.append(f"the episode went past the declared turn limit ({turn_limit})")
        elif (
            label == "stall"
            and episode.ended_by == "truncated"
            and not episode.results[-1].info.get("truncated_reason")
        ):
            problems.append("truncated without info['truncated_reason']")
    return problems


def _reward_problems(episode: Episode, low: float, high: float) -> list[str]:
    problems = []
    for turn, result in enumerate(episode.results, 1):
        reward = result.reward
        if not isinstance(reward, (int, float)) or not math.isfinite(reward):
            problems.append(f"turn {turn}: reward {reward!r} is not a finite number")
        elif not low <= reward <= high:
            problems.append(f"turn {turn}: reward {reward} outside [{low}, {high}]")
    total = episode.reward
    if not problems and not low <= total <= high:
        problems.append(f"episode reward {total} outside [{low}, {high}]")
    return problems


def _transcript(episode: Episode) -> Any:
    """What must replay exactly under the same seed (tool latencies excluded)."""
    steps = [
        (r.observation, r.reward, r.terminated, r.truncated, r.info.get("success"))
        for r in episode.results
    ]
    return episode.opening, episode.actions, steps
