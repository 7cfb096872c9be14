"""A short generic instruction-tuning stage for the tiny model: repeat what was said.

Real base models arrive able to copy a word from their context into their reply. A tiny
model initialised from scratch cannot, and RL would have to discover copying from a sparse
reward. This stage teaches that one generic ability on task-free chats ("Say tulip." ->
"tulip", "Repeat: a b c" -> "a b c"): no tools, no tool calls, no tool responses, no
questions about tables. Loss on the assistant's tokens only.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch
from tqdm import tqdm

_PROMPTS = (
    ("Say {w}.", "{w}"),
    ("Repeat: {s}", "{s}"),
    ("The word is {w}. What is the word?", "{w}"),
    ("Please write {w}", "{w}"),
    ("{s}", "{s}"),
)


def echo_chats(words: Sequence[str], count: int, seed: int) -> list[list[dict[str, str]]]:
    """``count`` task-free chats in which the assistant repeats words from the user."""
    rng = random.Random(seed)
    chats = []
    for _ in range(count):
        prompt, reply = rng.choice(_PROMPTS)
        word = rng.choice(words)
        span = " ".join(rng.choice(words) for _ in range(rng.randint(1, 4)))
        chats.append(
            [
                {"role": "user", "content": prompt.format(w=word, s=span)},
                {"role": "assistant", "content": reply.format(w=word, s=span)},
            ]
        )
    return chats


def pretrain_echo(
    model: Any,
    tokenizer: Any,
    words: Sequence[str],
    *,
    steps: int,
    seed: int,
    lr: float = 3e-3,
    progress: bool = False,
) -> list[float]:
    """Train ``model`` in place on echo chats; return the loss of every step."""
    chats = echo_chats(words, steps * 32, seed)
    encoded = []
    for chat in chats:
        head = tokenizer.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(chat, tokenize=False)
        head_ids = tokenizer.encode(head, add_special_tokens=False)
        reply_ids = tokenizer.encode(full[len(head) :].rstrip("\n"), add_special_tokens=False)
        encoded.append((head_ids, reply_ids))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    losses: list[float] = []
    model.train()
    for step in tqdm(range(steps), desc="echo tuning", disable=not progress, leave=False):
        batch = encoded[step * 32 : (step + 1) * 32]
        T = max(len(h) + len(r) for h, r in batch)
        ids = torch.full((len(batch), T), pad, dtype=torch.long)
        attention = torch.zeros_like(ids)
        labels = torch.full_like(ids, -100)
        for i, (h, r) in enumerate(batch):
            n = len(h) + len(r)
            ids[i, :n] = torch.tensor(h + r)
            attention[i, :n] = 1
            labels[i, len(h) : n] = torch.tensor(r)
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
        )
        optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses
