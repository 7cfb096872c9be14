"""``turnrl eval``: an environment's test tasks against a local checkpoint or any
OpenAI-compatible server, with success, pass@k, rewards, turns, tool use and tokens.

Each (task, sample) episode is one line of ``episodes.jsonl`` in the output directory,
written as soon as it ends, so an interrupted evaluation resumes where it stopped: finished
episodes are read back and only the missing ones run (a half-written last line is
dropped). Seeds derive from (seed, task id, sample), so a resumed evaluation of a local
model gives the episodes an uninterrupted one would.

- Local checkpoint (``model_path``): the rollout engine and the torch backend, exactly as in
  training (token-exact; the episode limits apply as in ``[rollout]``).
- Endpoint (``endpoint``, e.g. ``http://127.0.0.1:8000/v1``): text-level episodes over
  ``/chat/completions``; the server's chat template renders the messages and tools. A
  server that parses tool calls (vLLM with ``--tool-call-parser``, SGLang, OpenAI) returns
  them in ``message.tool_calls``: each turn's text is rebuilt in the env's call format
  (``assistant_text``; the env's ``format``, hermes where it has none), and that text is
  what ``env.step`` reads and the conversation keeps, as in a local episode. Stop strings,
  where the env has any, are asked to be kept in the output (``include_stop_str_in_output``,
  as vLLM names it) because call formats need their closing tags; only then, because vLLM
  would also keep the end-of-turn token (it decodes special tokens to parse tool calls).
  A turn cut off at ``max_tokens_per_turn`` ends the episode, as in a local one. A request
  that fails is an episode with stop reason ``error``, not a crash.

``summary.json``: episodes, success (the mean over episodes), pass@k (the share of tasks
with at least one success among their k samples), mean reward and reward components,
turns, tool calls, tool-error rate, completion tokens, stop reasons, errors.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from turnrl.envs import make_env_family
from turnrl.envs.policy import HasCard
from turnrl.errors import ConfigError
from turnrl.formats import get_format
from turnrl.formats.openai_message import assistant_text
from turnrl.protocols import Env, close_env, env_format
from turnrl.rollout.episode import EpisodeLimits, SamplingParams, derive_seed
from turnrl.types import Message, Task, Trajectory

EPISODES = "episodes.jsonl"
SUMMARY = "summary.json"


@dataclass(frozen=True)
class EvalConfig:
    """What to evaluate and how (the CLI's flags)."""

    env: str
    env_options: dict[str, Any] = field(default_factory=dict)
    n: int = 64
    """Test tasks (indices 0..n-1 of ``split``)."""
    k: int = 1
    """Samples per task (pass@k)."""
    split: str = "test"
    seed: int = 0
    max_turns: int = 4
    max_tokens_per_turn: int = 64
    max_episode_tokens: int = 256
    max_context_tokens: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    concurrency: int = 8
    """Episodes in flight against an endpoint."""
    timeout_s: float = 120.0
    """Per request to an endpoint."""

    def __post_init__(self) -> None:
        if self.n < 1 or self.k < 1:
            raise ConfigError("eval: --n and --k must be >= 1")
        if self.concurrency < 1:
            raise ConfigError("eval: concurrency must be >= 1")


def evaluate(
    config: EvalConfig,
    out_dir: str | Path,
    *,
    model_path: str | Path | None = None,
    endpoint: str | None = None,
    model_name: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run (or resume) the evaluation into ``out_dir``; return the summary."""
    if (model_path is None) == (endpoint is None):
        raise ConfigError("eval: give exactly one of a model path or an endpoint")
    spec = make_env_family(config.env, **config.env_options)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _check_same_config(out, config, model_path, endpoint)
    rows = read_episodes(out / EPISODES)
    tasks = [spec.task(i, config.split) for i in range(config.n)]
    done = {(r["task_id"], r["sample"]) for r in rows}
    todo = [(t, s) for t in tasks for s in range(config.k) if (t.id, s) not in done]
    bar = tqdm(total=len(tasks) * config.k, initial=len(tasks) * config.k - len(todo),
               desc="eval", unit="episode", disable=not progress)  # fmt: skip
    with (out / EPISODES).open("a", encoding="utf-8") as sink:

        def record(row: dict[str, Any]) -> None:
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            rows.append(row)
            bar.update(1)

        if todo and model_path is not None:
            _run_local(config, spec.make_env, todo, str(model_path), record)
        elif todo and endpoint is not None:
            asyncio.run(_run_remote(config, spec.make_env, todo, endpoint, model_name, record))
    bar.close()
    wanted = {(t.id, s) for t in tasks for s in range(config.k)}
    summary = summarize([r for r in rows if (r["task_id"], r["sample"]) in wanted], config.k)
    summary["card"] = spec.card.lines() if isinstance(spec, HasCard) else []
    summary["source"] = str(model_path) if model_path is not None else endpoint
    (out / SUMMARY).write_text(json.dumps(summary, indent=2))
    return summary


def read_episodes(path: Path) -> list[dict[str, Any]]:
    """Finished episodes of an earlier (possibly interrupted) run; a torn last line is
    dropped and the file rewritten without it."""
    if not path.exists():
        return []
    rows: list[dict[str, Any]] = []
    good = 0
    raw = path.read_bytes()
    for line in raw.splitlines(keepends=True):
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            break
        if not line.endswith(b"\n") or not isinstance(row, dict):
            break
        rows.append(row)
        good += len(line)
    if good != len(raw):
        path.write_bytes(raw[:good])
    return rows


def summarize(rows: Sequence[dict[str, Any]], k: int) -> dict[str, Any]:
    """The evaluation's numbers from its episode rows."""
    n = max(1, len(rows))
    by_task: dict[str, list[bool]] = {}
    for r in rows:
        by_task.setdefault(r["task_id"], []).append(bool(r["success"]))
    components: dict[str, list[float]] = {}
    for r in rows:
        for name, value in r["components"].items():
            components.setdefault(name, []).append(float(value))
    calls = sum(r["tool_calls"] for r in rows)
    return {
        "episodes": len(rows),
        "tasks": len(by_task),
        "k": k,
        "success": sum(r["success"] for r in rows) / n,
        f"pass@{k}": sum(any(v) for v in by_task.values()) / max(1, len(by_task)),
        "reward_mean": sum(r["reward"] for r in rows) / n,
        "reward_components": {c: sum(v) / len(v) for c, v in sorted(components.items())},
        "turns_mean": sum(r["turns"] for r in rows) / n,
        "tool_calls_mean": calls / n,
        "tool_error_rate": sum(r["tool_errors"] for r in rows) / max(1, calls),
        "completion_tokens_mean": sum(r["completion_tokens"] for r in rows) / n,
        "stop_reasons": dict(Counter(str(r["stop_reason"]) for r in rows)),
        "errors": sum(r["error"] is not None for r in rows),
        "error_messages": dict(Counter(r["error"] for r in rows if r["error"]).most_common()),
    }


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The summary as the CLI prints it: the environment's card, then the numbers."""
    k = summary["k"]
    lines = [*summary.get("card", []), ""]
    lines += [
        f"| episodes | success | pass@{k} | reward | turns | tool calls | tool errors | tokens |",
        "|---|---|---|---|---|---|---|---|",
        f"| {summary['episodes']} | {summary['success']:.3f} | {summary[f'pass@{k}']:.3f} | "
        f"{summary['reward_mean']:.3f} | {summary['turns_mean']:.2f} | "
        f"{summary['tool_calls_mean']:.2f} | {summary['tool_error_rate']:.3f} | "
        f"{summary['completion_tokens_mean']:.1f} |",
        "",
        "reward components: "
        + (", ".join(f"{c} {v:.3f}" for c, v in summary["reward_components"].items()) or "none"),
        "stop reasons: "
        + ", ".join(f"{r} {c}" for r, c in sorted(summary["stop_reasons"].items())),
    ]
    if summary["errors"]:
        lines.append(f"errors: {summary['errors']} episode(s) failed (see episodes.jsonl):")
        for message, count in summary.get("error_messages", {}).items():
            lines.append(f"  {count}x {message[:300]}")
            lines += [f"     -> {hint}" for hint in error_hints(message)]
    return lines


KNOWN_CAUSES = (
    (
        "tool choice requires",  # vLLM's 400 for tools without --enable-auto-tool-choice
        "the server does not parse tool calls: start vLLM with --enable-auto-tool-choice "
        "--tool-call-parser hermes (or the parser of your model's family)",
    ),
    (
        "Connection refused",
        "nothing listens at the endpoint: is the server up, and is --endpoint its base URL "
        "(ending in /v1)?",
    ),
    (
        "HTTP 404",
        "the endpoint has no such route: --endpoint is the server's base URL, ending in /v1",
    ),
    ("HTTP 401", "the server wants an API key, which turnrl eval does not send: serve without one"),
    ("timed out", "the server answered too slowly: lower --concurrency"),
)
"""Substrings of error messages whose cause is known, and what to do about each."""


def error_hints(message: str) -> list[str]:
    """What to do about an episode's error, where its cause is known."""
    return [hint for needle, hint in KNOWN_CAUSES if needle in message]


def _check_same_config(out: Path, config: EvalConfig, model: Any, endpoint: str | None) -> None:
    """Refuse to resume into a directory evaluated with other settings."""
    meta = {"config": asdict(config), "model": str(model) if model else None, "endpoint": endpoint}
    path = out / "eval_config.json"
    if path.exists():
        before = json.loads(path.read_text())
        if before != json.loads(json.dumps(meta)):
            raise ConfigError(
                f"{out} holds an evaluation with other settings; use another --out "
                "(or delete it) rather than mixing the two"
            )
    else:
        path.write_text(json.dumps(meta, indent=2))


def _row(task: Task, sample: int, **fields: Any) -> dict[str, Any]:
    return {"task_id": task.id, "sample": sample, **fields}


def _trajectory_row(task: Task, traj: Trajectory) -> dict[str, Any]:
    return _row(
        task, traj.sample_index, reward=traj.reward, success=traj.success,
        components=dict(traj.reward_components), turns=len(traj.turns),
        tool_calls=len(traj.tool_calls), tool_errors=sum(not c.ok for c in traj.tool_calls),
        completion_tokens=traj.num_completion_tokens, stop_reason=traj.stop_reason,
        error=traj.error, messages=list(traj.messages),
    )  # fmt: skip


def _run_local(
    config: EvalConfig,
    make_env: Callable[[], Env],
    todo: Sequence[tuple[Task, int]],
    model_path: str,
    record: Callable[[dict[str, Any]], None],
) -> None:
    from turnrl.backends.torch_backend import TorchBackend
    from turnrl.models.loading import load_model, load_tokenizer, stop_token_ids
    from turnrl.rollout.chat import ChatRenderer
    from turnrl.rollout.episode import run_episode
    from turnrl.rollout.groups import BatchingClient

    tokenizer = load_tokenizer(model_path)
    backend = TorchBackend(load_model(model_path), tokenizer)
    renderer = ChatRenderer(tokenizer)
    limits = EpisodeLimits(config.max_turns, config.max_tokens_per_turn,
                           config.max_episode_tokens, config.max_context_tokens)  # fmt: skip
    sampling = SamplingParams(config.temperature, config.top_p, stop_token_ids(tokenizer))

    async def main() -> None:
        client = BatchingClient(backend)

        async def one(task: Task, sample: int) -> None:
            client.live += 1
            try:
                traj = await run_episode(
                    make_env(), task, client.generate, renderer, limits=limits,
                    sampling=sampling, seed=derive_seed(config.seed, task.id, sample),
                    sample_index=sample,
                )  # fmt: skip
            finally:
                client.live -= 1
            record(_trajectory_row(task, traj))

        await asyncio.gather(*(one(t, s) for t, s in todo))

    backend.run(main())


async def _run_remote(
    config: EvalConfig,
    make_env: Callable[[], Env],
    todo: Sequence[tuple[Task, int]],
    endpoint: str,
    model_name: str | None,
    record: Callable[[dict[str, Any]], None],
) -> None:
    base = endpoint.rstrip("/")
    if model_name is None:
        listed = await asyncio.to_thread(_http, "GET", f"{base}/models", None, config.timeout_s)
        model_name = str(listed["data"][0]["id"])
    slots = asyncio.Semaphore(config.concurrency)

    async def one(task: Task, sample: int) -> None:
        async with slots:
            record(await _remote_episode(config, make_env(), task, sample, base, str(model_name)))

    await asyncio.gather(*(one(t, s) for t, s in todo))


async def _remote_episode(
    config: EvalConfig, env: Env, task: Task, sample: int, base: str, model: str
) -> dict[str, Any]:
    """One text-level episode against the endpoint; failures become the row's error."""
    messages: list[Message] = []
    reward, success, components = 0.0, False, {}
    turns = calls = tool_errors = tokens = 0
    stop_reason, error = "max_turns", None
    fmt = env_format(env) or get_format("hermes")  # the call format of tool_calls replies
    try:
        messages = list(await env.reset(task, derive_seed(config.seed, task.id, sample)))
        for turn in range(config.max_turns):
            body = {
                "model": model, "messages": messages, "max_tokens": config.max_tokens_per_turn,
                "temperature": config.temperature, "top_p": config.top_p,
                "seed": derive_seed(config.seed, task.id, sample, turn) % (2**31),
            }  # fmt: skip
            if tools := env.tool_schemas():
                body["tools"] = tools
            if stops := env.stop_strings():
                body["stop"] = list(stops)
                body["include_stop_str_in_output"] = True
            reply = await asyncio.to_thread(
                _http, "POST", f"{base}/chat/completions", body, config.timeout_s
            )
            choice = reply["choices"][0]
            text = assistant_text(choice["message"], fmt)
            tokens += int(reply.get("usage", {}).get("completion_tokens", 0))
            turns += 1
            if choice.get("finish_reason") == "length":  # cut off: ends as a local episode does
                messages.append({"role": "assistant", "content": text})
                stop_reason = "max_tokens_per_turn"
                break
            result = await env.step(text)
            records = result.info.get("tool_calls", [])
            calls += len(records)
            tool_errors += sum(not r.ok for r in records)
            messages += [{"role": "assistant", "content": text}, *result.observation]
            if result.terminated or result.truncated:
                reward = result.reward
                success = bool(result.info.get("success", False))
                components = dict(result.info.get("reward_components", {}))
                stop_reason = "answered" if result.terminated else "env_truncated"
                break
    except Exception as exc:  # a failed request or env is this episode's data
        stop_reason, error = "error", f"{type(exc).__name__}: {exc}"
    finally:
        try:
            await close_env(env)
        except Exception as exc:
            error = error or f"close failed: {type(exc).__name__}: {exc}"
    return _row(
        task, sample, reward=reward, success=success, components=components, turns=turns,
        tool_calls=calls, tool_errors=tool_errors, completion_tokens=tokens,
        stop_reason=stop_reason, error=error, messages=messages,
    )  # fmt: skip


def _http(method: str, url: str, body: Any, timeout: float) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:300]
        raise RuntimeError(f"{method} {url}: HTTP {exc.code}: {detail}") from None
