"""The syntax-only warm-up: supervised training on format demonstrations.

A fresh model cannot emit a well-formed tool call, so RL would never see a reward. The
environment supplies demonstrations that follow the format with *random content* (random
tool arguments, random answers): they teach grammar, not the solution, which RL must find.
Demonstrations are played through the real environment by a scripted backend, so their
tokens and loss masks come from exactly the code path RL uses.
"""

from __future__ import annotations

import asyncio
import inspect
import random
from typing import Any

import torch
from tqdm import tqdm

from turnrl.backends.scripted import ScriptedBackend
from turnrl.envs import EnvFamily
from turnrl.rollout.batch import pack, trainable
from turnrl.rollout.chat import ChatRenderer
from turnrl.rollout.episode import EpisodeLimits, SamplingParams, run_episode
from turnrl.trainer.config import WarmupConfig
from turnrl.trainer.learner import token_logprobs
from turnrl.types import Completion, GenerationRequest, Sample, Trajectory


def demonstration_trajectories(
    spec: EnvFamily,
    tokenizer: Any,
    renderer: ChatRenderer,
    *,
    count: int,
    limits: EpisodeLimits,
    sampling: SamplingParams,
    seed: int,
) -> list[Trajectory]:
    """Play ``count`` scripted demonstrations of ``spec`` through its real environment."""
    rng = random.Random(seed)
    end_id = sampling.stop_token_ids[0]

    async def one(index: int) -> Trajectory:
        task = spec.task(index, split="warmup")
        turns = spec.demonstration(task, rng)  # drawn in task order: deterministic
        if inspect.isawaitable(turns):  # a derived demonstration asks the environment first
            turns = await turns
        backend = ScriptedBackend(tokenizer, turns, end_token_id=end_id)

        async def generate(request: GenerationRequest) -> Completion:
            return (await backend.generate([request]))[0]

        env = spec.make_env()
        return await run_episode(
            env, task, generate, renderer, limits=limits, sampling=sampling, seed=index
        )

    async def play() -> list[Trajectory]:
        return await asyncio.gather(*(one(i) for i in range(count)))

    return asyncio.run(play())


def supervised_warmup(
    model: Any,
    samples: list[Sample],
    config: WarmupConfig,
    *,
    pad_id: int,
    seed: int,
    progress: bool = False,
) -> list[float]:
    """Fit the sampled-token positions of ``samples`` by cross-entropy; return the losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    rng = random.Random(seed)
    losses: list[float] = []
    model.train()
    for _ in tqdm(range(config.steps), desc="warm-up", disable=not progress, leave=False):
        chosen = rng.sample(samples, min(config.batch_size, len(samples)))
        batch = pack(chosen, [0.0] * len(chosen), pad_id).to(next(model.parameters()).device)
        mask = batch.loss_mask
        logprobs, _ = token_logprobs(
            model, batch.input_ids, batch.attention_mask, mask, 1.0, with_entropy=False
        )
        loss = -torch.where(mask, logprobs, 0.0).sum() / mask.sum().clamp(min=1)
        optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
    optimizer.zero_grad(set_to_none=True)  # no stale gradients for what trains next
    return losses


def warmup_samples(trajectories: list[Trajectory]) -> list[Sample]:
    """Training sequences of the demonstrations that ran cleanly."""
    return [s for t in trainable(trajectories) for s in t.samples()]
