"""One episode: the model and an environment take turns until the episode ends.

``run_episode`` is the whole multi-turn loop, token-exact (docs/design.md, invariants 1, 2, 4):
the context is the first rendered prompt followed by each completion's sampled ids and the
template's tokens for each observation, never re-tokenized; every limit that ends an
episode is recorded as its ``stop_reason``; an exception from the environment or the
backend is recorded on the trajectory (``error``), not raised, and so is an episode that
runs past its wall-clock deadline (``EpisodeLimits.timeout_s``), naming what it waited on.
"""

from __future__ import annotations

import asyncio
import hashlib
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from turnrl.protocols import Env, close_env, env_format, env_turn_observer
from turnrl.rollout.chat import ChatRenderer
from turnrl.types import (
    Completion,
    GenerationRequest,
    StopReason,
    Task,
    ToolCallRecord,
    Trajectory,
    Turn,
)

Generate = Callable[[GenerationRequest], Awaitable[Completion]]


@dataclass(frozen=True)
class EpisodeLimits:
    """Limits that end an episode early (each one is recorded as the stop reason)."""

    max_turns: int = 4
    """Model turns per episode."""
    max_tokens_per_turn: int = 64
    """Tokens one completion may sample."""
    max_episode_tokens: int = 256
    """Tokens the model may sample over the whole episode."""
    max_context_tokens: int = 1024
    """Prompt plus everything after it; keep within the model's context window."""
    timeout_s: float | None = None
    """Wall-clock limit of the whole episode (None: none). Past it the episode is recorded
    as failed (``error`` names what it was waiting for: the model, the environment, a
    tool, an agent), never left blocking its batch."""


@dataclass(frozen=True)
class SamplingParams:
    """How completions are sampled."""

    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from (run seed, step, task, sample, turn, ...): stable across runs."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


async def run_episode(
    env: Env,
    task: Task,
    generate: Generate,
    renderer: ChatRenderer,
    *,
    limits: EpisodeLimits,
    sampling: SamplingParams,
    seed: int,
    sample_index: int = 0,
    policy_version: int = 0,
) -> Trajectory:
    """Play one episode of ``task`` in ``env`` and return its token-exact trajectory.

    When the episode ends, however it ends, the env's ``close()`` runs if it has one. An
    env that wants each sampled turn (token ids and log-probs, e.g. to return them to an
    agent) defines ``observe_turn(turn)``; it is called before ``step`` with that turn.
    """
    traj = Trajectory(task_id=task.id, sample_index=sample_index, policy_version=policy_version)
    waiting = ["env.reset"]  # what the episode waits on now, for the deadline's message
    try:
        await asyncio.wait_for(
            _play(traj, env, task, generate, renderer, limits, sampling, seed, waiting),
            limits.timeout_s,
        )
    except asyncio.TimeoutError:
        traj.error = (
            f"TimeoutError: the episode ran past its {limits.timeout_s:g} s deadline "
            f"(rollout.episode_timeout_s) while waiting for {waiting[0]}"
        )
        _end(traj, "error", truncated=False)
    except Exception as exc:  # a bad rollout is data: record it, never crash the batch
        notes = "".join(f" ({note})" for note in getattr(exc, "__notes__", ()))
        traj.error = f"{type(exc).__name__}: {exc}{notes}"
        traj.info["traceback"] = traceback.format_exc(limit=-12)  # the innermost frames: the bug
        _end(traj, "error", truncated=False)
    finally:
        await _close(env, traj)
    return traj


async def _close(env: Env, traj: Trajectory) -> None:
    """Let the env release its tools (an optional ``close`` coroutine method). A failure
    to close is recorded on the trajectory, not raised: the episode's data stands."""
    try:
        await close_env(env)
    except Exception as exc:
        traj.info["close_error"] = f"{type(exc).__name__}: {exc}"


def _end(traj: Trajectory, reason: StopReason, *, truncated: bool) -> None:
    traj.stop_reason = reason
    traj.truncated = truncated
    traj.terminated = reason == "answered"


async def _play(
    traj: Trajectory,
    env: Env,
    task: Task,
    generate: Generate,
    renderer: ChatRenderer,
    limits: EpisodeLimits,
    sampling: SamplingParams,
    seed: int,
    waiting: list[str],
) -> None:
    messages = list(await env.reset(task, seed))
    # the env knows its tools after reset; its format writes them where the template cannot
    renderer = renderer.with_tools(env.tool_schemas(), env_format(env))
    traj.messages = messages
    new_ids = renderer.prompt(messages)
    context: list[int] = list(new_ids)
    new_sample = False
    sampled = 0
    while True:
        room = limits.max_context_tokens - len(context)
        budget = min(limits.max_tokens_per_turn, limits.max_episode_tokens - sampled, room)
        if budget <= 0:
            _end(traj, "max_context" if room <= 0 else "max_episode_tokens", truncated=True)
            return
        request = GenerationRequest(
            prompt_ids=tuple(context),
            max_new_tokens=budget,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=derive_seed(seed, len(traj.turns)),
            stop_token_ids=sampling.stop_token_ids,
            stop_strings=env.stop_strings(),
        )
        waiting[0] = "the model (generate)"
        completion = await generate(request)
        ids = completion.token_ids
        if len(ids) != len(completion.logprobs):
            raise ValueError("backend returned token ids and log-probs of different lengths")
        # The assistant's text, without the end-of-turn token the template adds itself.
        ended = completion.finish_reason == "stop" and ids and ids[-1] in sampling.stop_token_ids
        text = renderer.decode(ids[:-1] if ended else ids)
        turn = Turn(
            prompt_ids=tuple(new_ids),
            completion_ids=ids,
            completion_logprobs=completion.logprobs,
            finish_reason=completion.finish_reason,
            text=text,
            new_sample=new_sample,
            policy_version=(
                completion.policy_version
                if completion.policy_version is not None
                else traj.policy_version
            ),
        )
        traj.turns.append(turn)
        context.extend(ids)
        sampled += len(ids)
        messages.append({"role": "assistant", "content": text})
        if completion.finish_reason == "length":
            reason: StopReason = "max_tokens_per_turn"
            if budget < limits.max_tokens_per_turn:
                reason = "max_context" if budget == room else "max_episode_tokens"
            _end(traj, reason, truncated=True)
            return
        observe = env_turn_observer(env)
        if observe is not None:
            observe(turn)
        waiting[0] = "env.step (the environment, its tools or its agent)"
        result = await env.step(text)
        traj.reward += float(result.reward)
        _absorb_info(traj, result.info)
        if result.terminated:
            _end(traj, "answered", truncated=False)
            return
        if result.truncated:
            _end(traj, "env_truncated", truncated=True)
            return
        if len(traj.turns) >= limits.max_turns:
            _end(traj, "max_turns", truncated=True)
            return
        if result.context is not None:  # the env rewrote the history: a new sample
            traj.info.setdefault("earlier_contexts", []).append(messages)
            messages = list(result.context)
            traj.messages = messages
            traj.context_rewrites += 1
            new_ids = renderer.prompt(messages)
            context, new_sample = list(new_ids), True
            continue
        cont = renderer.continuation(messages, result.observation, context)
        messages.extend(result.observation)
        new_sample = cont.template_break
        if cont.template_break:
            traj.template_breaks += 1
            context = list(cont.ids)
        else:
            context.extend(cont.ids)
        new_ids = cont.ids


def _absorb_info(traj: Trajectory, info: object) -> None:
    """Copy the well-known keys of a step's ``info`` onto the trajectory."""
    if not isinstance(info, dict):
        return
    if "success" in info:
        traj.success = bool(info["success"])
    if "model_error" in info:  # an agent framework raised for the model's own mistake
        traj.info["model_error"] = info["model_error"]
    components = info.get("reward_components")
    if isinstance(components, dict):
        for key, value in components.items():
            traj.reward_components[str(key)] = traj.reward_components.get(str(key), 0.0) + float(
                value
            )
    for record in info.get("tool_calls", ()):
        if isinstance(record, ToolCallRecord):
            traj.tool_calls.append(record)
