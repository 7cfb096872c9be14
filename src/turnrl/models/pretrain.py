"""A short generic instruction-tuning stage for the tiny model: repeat what was said.

Real base models arrive able to copy a word from their context into their reply. A tiny
model initialised from scratch cannot, and RL would have to discover copying from a sparse
reward. This stage teaches that one generic ability on task-free chats ("Say tulip." ->
"tulip", "Repeat: a b c" -> "a b c"): no tools, no tool calls, no tool responses, no
questions about tables. Loss on the assistant's tokens only.

With ``novel_fraction`` > 0, that share of the chats repeat made-up words (random
syllables over the whole alphabet, made afresh per chat) instead of known ones: the model
then learns to copy token sequences it has never seen (a new name cut into several BPE
pieces), not only words it has a single token for. Real base models can; a task whose
answers are unseen names (``search_qa`` with a fresh world per task) needs it.
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


_CONSONANTS = "bcdfghjklmnpqrstvwxz"
_VOWELS = "aeiouy"


def made_up_word(rng: random.Random) -> str:
    """A pronounceable non-word: 1-4 random syllables (an onset of one consonant or a
    two-consonant cluster, a vowel, sometimes a final consonant), capitalised half of the
    time (names are). The words echo tuning's ``novel_fraction`` of chats repeat
    (``TinyModelConfig.echo_novel``); drawn from an ``rng`` of your own, words the model
    never saw, to test that copying."""
    syllables = []
    for _ in range(rng.randint(1, 4)):
        onset = rng.choice(_CONSONANTS)
        if rng.random() < 0.3:
            onset += rng.choice("hlrstw")
        coda = rng.choice(_CONSONANTS) if rng.random() < 0.4 else ""
        syllables.append(onset + rng.choice(_VOWELS) + coda)
    word = "".join(syllables)
    return word.capitalize() if rng.random() < 0.5 else word


def echo_chats(
    words: Sequence[str], count: int, seed: int, novel_fraction: float = 0.0
) -> list[list[dict[str, str]]]:
    """``count`` task-free chats in which the assistant repeats words from the user; a
    ``novel_fraction`` of them repeat made-up words instead (see the module docstring)."""
    rng = random.Random(seed)
    novel = random.Random(f"{seed}/novel")  # its own stream: fraction 0 leaves chats as they were
    chats = []
    for _ in range(count):
        prompt, reply = rng.choice(_PROMPTS)
        word = rng.choice(words)
        span = " ".join(rng.choice(words) for _ in range(rng.randint(1, 4)))
        if novel_fraction > 0 and novel.random() < novel_fraction:
            word = made_up_word(novel)
            span = " ".join(made_up_word(novel) for _ in range(novel.randint(1, 4)))
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
    novel_fraction: float = 0.0,
    progress: bool = False,
) -> list[float]:
    """Train ``model`` in place on echo chats; return the loss of every step."""
    chats = echo_chats(words, steps * 32, seed, novel_fraction)
    if not chats:
        return []
    # rendered and encoded as batches: the same ids as chat by chat, in a third of the time
    heads = tokenizer.apply_chat_template(
        [chat[:1] for chat in chats], tokenize=False, add_generation_prompt=True
    )
    fulls = tokenizer.apply_chat_template(chats, tokenize=False)
    replies = [full[len(head) :].rstrip("\n") for head, full in zip(heads, fulls, strict=True)]
    encoded = list(
        zip(
            tokenizer(heads, add_special_tokens=False)["input_ids"],
            tokenizer(replies, add_special_tokens=False)["input_ids"],
            strict=True,
        )
    )
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
