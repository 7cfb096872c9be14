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
  win, e.g. on slippery ice, its declared ``oracle_success`` less three standard errors);
- probes: the reward-hacking probes of ``turnrl.envs.reward_hack_probes`` (an empty answer, every
  option listed, the gold buried among other candidates, the answer syntax alone, a very
  long answer, the prompt echoed back), each played once per task through the env's own
  format and verifier, on top of the three policies above.

The probes' rule. A probe that earns any reward above zero on some task is a *finding*: a
warning with its mean reward (partial credit shows as a reward between 0 and 1), its
success rate and what to fix; it does not fail the check on its own, since a verifier may
pay a little for a well-formed turn. A probe that *succeeds* on any task fails the
``probes`` check (exit status 1): a content-free answer solved a task, so training can
learn it instead of the task. An environment whose design makes that right (say, refusal
tasks that a blanket refusal solves) declares it: ``expected_probes``, a mapping from probe
name to the reason, turns those probes' success into a warning that quotes the reason;
naming an unknown probe there fails the check.

Optional parts of a user's environment (``package.module:factory``): without ``oracle`` the
oracle check is skipped, without ``demonstration`` the random policy, and where
``make_env()`` gives an env with no ``format`` (a ``turnrl.protocols.Format``) the rule that
the stalling policy (hermes calls then) is never terminated, while the probes write plain
text or the answer syntax the opening messages mention. Each skip is a note under the
table. ``card``, ``corpus``, ``chance`` and ``reward_range`` are read where present.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import json
import math
import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from turnrl.envs.policy import Episode, HasCard, HasOracle, Policy, play, replay
from turnrl.envs.registry import EnvFamily
from turnrl.envs.reward_hack_probes import (
    PROBES,
    Clues,
    Probe,
    ProbeResult,
    answer_space,
    probe_policy,
)
from turnrl.formats import get_format
from turnrl.protocols import Env, env_format, env_tools
from turnrl.types import Message, Task, ToolCall

CHECKS = (
    "tasks", "runs", "determinism", "schemas", "messages", "end flags", "rewards", "oracle",
    "probes",
)  # fmt: skip
ANSWER_SPACE_TASKS = 32
"""Training tasks whose answers the probes may list as candidates."""
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
    """What ``check_env`` found: the checks, the oracle's and the random policy's results
    (None where the family has no oracle or no demonstration), each probe's result and a
    note for each part of the family that was missing, so skipped."""

    name: str
    num_tasks: int
    checks: tuple[Check, ...]
    oracle_success: float | None
    oracle_reward: float | None
    random_success: float | None
    random_reward: float | None
    probes: tuple[ProbeResult, ...] = ()
    skipped: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def findings(self) -> tuple[ProbeResult, ...]:
        """The probes that scored (each one a warning; see the module docstring)."""
        return tuple(p for p in self.probes if p.finding)

    def table(self) -> str:
        """Markdown tables of the checks and the probes, the policies' results, then a line
        per skipped part and per finding."""
        rows = ["| check | result | detail |", "|---|---|---|"]
        rows += [f"| {c.name} | {'ok' if c.ok else 'FAIL'} | {c.detail} |" for c in self.checks]
        rows += ["", f"{_policy_line(self)} over {self.num_tasks} tasks", ""]
        rows += [
            "| probe | plays | tasks | reward | success | result |",
            "|---|---|---|---|---|---|",
        ]
        for p in self.probes:
            result = (
                f"skipped: {p.skipped}" if p.skipped
                else "FAIL" if p.failed
                else "expected" if p.finding and p.expected
                else "warning" if p.finding
                else "ok"
            )  # fmt: skip
            rows.append(
                f"| {p.name} | {p.plays} | {p.num_tasks} | {p.reward:.3f} | {p.success:.2f} "
                f"| {result} |"
            )
        rows += [""] * bool(self.skipped or self.findings)
        rows += [f"note: {s}" for s in self.skipped]
        rows += [f"{'FAIL' if p.failed else 'warning'}: {p.warning()}" for p in self.findings]
        return "\n".join(rows)


def _policy_line(report: EnvReport) -> str:
    def rate(label: str, success: float | None, reward: float | None) -> str:
        if success is None:
            return f"no {label}"
        return f"{label} success {success:.2f} (reward {reward or 0.0:.3f})"

    return (
        f"{rate('oracle', report.oracle_success, report.oracle_reward)}; "
        f"{rate('random', report.random_success, report.random_reward)}"
    )


def check_env(spec: EnvFamily, *, num_tasks: int = 20, seed: int = 0) -> EnvReport:
    """Check ``spec`` on ``num_tasks`` test tasks; ``seed`` seeds the episodes."""
    if num_tasks < 1:
        raise ValueError("num_tasks must be >= 1")
    return asyncio.run(_check(spec, num_tasks, seed))


async def _check(spec: EnvFamily, num_tasks: int, seed: int) -> EnvReport:
    found: dict[str, list[str]] = {name: [] for name in CHECKS}
    skipped: list[str] = []
    turn_limit = spec.card.turn_limit if isinstance(spec, HasCard) else None
    low, high = getattr(spec, "reward_range", (0.0, 1.0))
    try:
        found["tasks"] += _task_problems(spec, num_tasks)
    except Exception as exc:
        found["tasks"].append(f"building tasks raised {exc!r}")
    clues = Clues()
    try:
        clues = Clues(answer_space(spec, ANSWER_SPACE_TASKS))
    except Exception as exc:
        found["tasks"].append(f"building training tasks raised {exc!r}")
    episodes: dict[str, list[Episode]] = {}
    tool_names: set[str] = set()
    formatless = False
    steps = turn_limit + 1 if turn_limit else MAX_STEPS
    for index in range(num_tasks):
        task = spec.task(index, "test")
        plays = {
            label: (maker, 2)
            for label, maker in (await _policies(spec, task, seed=f"{seed}/{index}")).items()
        }
        for probe in PROBES:
            plays[f"probe {probe.name}"] = (_probe_maker(probe, task, clues), 1)
        for label, (make_policy, num_runs) in plays.items():
            runs: list[Episode] = []
            for _ in range(num_runs):
                env = spec.make_env()
                formatless |= env_format(env) is None
                episode_seed = seed * 1_000_003 + index
                try:
                    policy = make_policy(env)
                    if policy is None:
                        break
                    runs.append(await play(env, task, policy, seed=episode_seed, max_steps=steps))
                except Exception as exc:  # a crash is a finding, not the checker's crash
                    found["runs"].append(f"{label} policy, task {task.id}: {exc!r}")
                    break
                schemas = _tool_schemas(env)
                found["schemas"] += _schema_problems(schemas)
                if isinstance(schemas, list):
                    tool_names |= {str(s.get("function", {}).get("name")) for s in schemas}
            if len(runs) < num_runs:
                continue
            where = f"{label} policy, task {task.id}"
            if num_runs == 2 and _transcript(runs[0]) != _transcript(runs[1]):
                found["determinism"].append(f"{where}: the same seed gave a different episode")
            episode = runs[0]
            episodes.setdefault(label, []).append(episode)
            for check, problems in (
                ("messages", _message_problems(episode)),
                ("end flags", _flag_problems(episode, label, turn_limit, formatless)),
                ("rewards", _reward_problems(episode, low, high)),
            ):
                found[check] += [f"{where}: {p}" for p in problems]
    if not isinstance(spec, HasOracle):
        skipped.append("no oracle(task): the oracle check is skipped")
    if not callable(getattr(spec, "demonstration", None)):
        skipped.append("no demonstration(task, rng): the random policy is skipped")
    if formatless:
        skipped.append(
            "the env has no format (turnrl.protocols.Format): the stalling policy writes "
            "hermes calls, which may end an episode (not checked), and the probes answer in "
            "plain text or the answer syntax the opening mentions"
        )
    oracle = episodes.get("oracle", [])
    oracle_success = _rate(oracle, lambda e: float(e.success))
    required = _required_oracle_success(getattr(spec, "oracle_success", 1.0), num_tasks)
    if oracle_success is not None and oracle_success < required:
        found["oracle"].append(f"success {oracle_success:.3f} < required {required:.3f}")
    probes, found["probes"] = _probe_results(spec, episodes)
    replayed = [label for label in episodes if not label.startswith("probe ")]
    played = sum(len(episodes[label]) for label in replayed)
    ends = Counter(
        e.results[-1].info.get("truncated_reason", e.ended_by) if e.results else e.ended_by
        for e in episodes.get("stall", [])
    )
    scored = [p.name for p in probes if p.finding]
    notes = {
        "tasks": f"{num_tasks} tasks x 2 splits, built twice; ids unique; seed matters",
        "determinism": f"{played} episodes ({', '.join(replayed)}), each replayed",
        "schemas": f"tools: {', '.join(sorted(tool_names)) or 'none'}",
        "runs": "reset and step never raised",
        "messages": "opening and observations are role/content messages",
        "end flags": f"turn limit: {turn_limit or 'none declared'}; stalling episodes: "
        + (", ".join(f"{k} {v}/{num_tasks}" for k, v in sorted(ends.items())) or "none"),
        "rewards": f"finite, in [{low:g}, {high:g}] per step and per episode",
        "oracle": "no oracle(task)"
        if oracle_success is None
        else f"success {oracle_success:.2f} >= {required:.2f}",
        "probes": f"{len(probes)} probes, no unexpected success"
        + (f"; scored: {', '.join(scored)} (see the warnings)" if scored else "; none scored"),
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
        random_success=_rate(randoms, lambda e: float(e.success)),
        random_reward=_rate(randoms, lambda e: e.reward),
        probes=probes,
        skipped=tuple(skipped),
    )


_NOT_PLAYED = {
    "buried": "no task has a text answer (task.answer)",
    "options": "no task shows two options or words",
    "echo": "every prompt is empty",
}


def _probe_maker(probe: Probe, task: Task, clues: Clues) -> PolicyMaker:
    return lambda env: probe_policy(probe, task, clues, env)


def _probe_results(
    spec: EnvFamily, episodes: dict[str, list[Episode]]
) -> tuple[tuple[ProbeResult, ...], list[str]]:
    """Each probe's result over the tasks it was played on, and the ``probes`` problems:
    a success the env does not expect, an unknown name in ``expected_probes``."""
    expected: dict[str, str] = dict(getattr(spec, "expected_probes", None) or {})
    problems = [
        f"expected_probes names unknown probe {name!r} (probes: "
        f"{', '.join(p.name for p in PROBES)})"
        for name in sorted(set(expected) - {p.name for p in PROBES})
    ]
    results: list[ProbeResult] = []
    for probe in PROBES:
        played = episodes.get(f"probe {probe.name}", [])
        rewards = [e.reward for e in played] or [0.0]
        result = ProbeResult(
            name=probe.name,
            plays=probe.plays,
            fix=probe.fix,
            num_tasks=len(played),
            reward=sum(rewards) / len(rewards),
            max_reward=max(rewards),
            success=_rate(played, lambda e: float(e.success)) or 0.0,
            expected=expected.get(probe.name),
            skipped=None if played else _NOT_PLAYED.get(probe.name, "it applies to no task"),
        )
        results.append(result)
        if result.failed:
            problems.append(
                f"probe {probe.name!r} ({probe.plays}) succeeded on "
                f"{round(result.success * result.num_tasks)} of {result.num_tasks} tasks"
            )
    return tuple(results), problems


def _tool_schemas(env: Env) -> Any:
    """The env's tool schemas; for a format that lists tools in its own system prompt
    (search_r1, react), which sends no schemas to the template, the ToolEnv's tools."""
    method = getattr(env, "tool_schemas", None)
    if not callable(method):
        return None
    schemas = method()
    own = env_tools(env)
    if isinstance(schemas, list) and not schemas and own is not None:
        schemas = own.schemas()
    return schemas


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


async def _policies(spec: EnvFamily, task: Task, *, seed: str) -> dict[str, PolicyMaker]:
    """The policies to play on ``task``, each made fresh per episode from its env."""
    makers: dict[str, PolicyMaker] = {"stall": _stall_policy}
    if callable(getattr(spec, "demonstration", None)):
        try:
            turns = spec.demonstration(task, random.Random(seed))
            # a derived demonstration (turnrl.envs.custom) opens an env to read its tools
            demonstration = await turns if inspect.isawaitable(turns) else turns
            makers["random"] = lambda env: replay(demonstration)
        except Exception as exc:  # reported on the "runs" row, as the policy's crash
            makers["random"] = functools.partial(_raise, exc)
    if isinstance(spec, HasOracle):
        oracle = spec
        makers["oracle"] = lambda env: oracle.oracle(task)
    return makers


def _raise(exc: Exception, env: Env) -> Policy | None:
    raise exc


def _stall_policy(env: Env) -> Policy | None:
    """Every turn, a call to a tool that does not exist, in the env's own call format
    (hermes where it has none)."""
    fmt = env_format(env) or get_format("hermes")
    try:
        text = fmt.render_call(ToolCall("no_such_tool", {}))
    except ValueError:
        return None
    return replay([], then=text)


def _task_problems(spec: EnvFamily, num_tasks: int) -> list[str]:
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
    if schemas is None:
        return ["the env has no tool_schemas() method (see turnrl.protocols.Env)"]
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


def _flag_problems(
    episode: Episode, label: str, turn_limit: int | None, formatless: bool
) -> list[str]:
    problems = []
    for turn, result in enumerate(episode.results, 1):
        if result.terminated and result.truncated:
            problems.append(f"turn {turn}: terminated and truncated at once")
        if result.terminated and not isinstance(result.info.get("success"), bool):
            problems.append(f"turn {turn}: terminated without a bool info['success']")
        if result.truncated and result.info.get("success"):
            problems.append(f"turn {turn}: truncated but reported success")
    # without its own format, an env may read the hermes call as its final answer
    if label == "stall" and episode.ended_by == "terminated" and not formatless:
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
