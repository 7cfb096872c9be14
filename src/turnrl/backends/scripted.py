"""A backend that emits chosen text through a real tokenizer: a test double and a teacher.

Tests use it to drive real environments and chat templates with known tokens; the
syntax warm-up uses it to produce demonstration traces through the same rollout code that
RL uses, so demonstrations are token-exact in exactly the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any, TypeVar

from turnrl.protocols import TurnSync
from turnrl.types import Completion, FinishReason, GenerationRequest

T = TypeVar("T")


class ScriptedBackend:
    """Replies to successive requests with successive scripted texts.

    Each reply is the text's token ids followed by ``end_token_id`` (the model "stops"), or
    the text up to and including the request's first stop string, cut to ``max_new_tokens`` (then the finish reason is ``length``). Log-probs are
    0.0: the script is deterministic. Every request is kept in ``requests`` for inspection.
    """

    def __init__(self, tokenizer: Any, texts: Iterable[str], *, end_token_id: int | None = None):
        self.tokenizer = tokenizer
        self.texts = list(texts)
        self.end_token_id = (
            end_token_id if end_token_id is not None else int(tokenizer.eos_token_id)
        )
        self.requests: list[GenerationRequest] = []
        self.policy_version = 0
        self.turn_sync: TurnSync | None = None
        """New weights wanted mid-batch: taken (``apply``) before the next reply, nothing
        being decoded between two."""
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id: int = int(pad if pad is not None else self.end_token_id)

    def submit(
        self, requests: Sequence[GenerationRequest], quiet: Callable[[], bool] | None = None
    ) -> list[asyncio.Future[Completion]] | None:
        """No running batch: callers use ``generate``."""
        return None

    def run(self, program: Coroutine[Any, Any, T]) -> T:
        return asyncio.run(program)

    def sync(self, model: Any) -> None:
        """The script has no weights; only the version moves."""
        self.policy_version += 1

    def sleep_metrics(self) -> dict[str, float]:
        """Nothing: the script holds no memory to release."""
        return {}

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        if self.turn_sync is not None and self.turn_sync.wanted():
            self.turn_sync.apply()
        return [self._reply(r) for r in requests]

    def _reply(self, request: GenerationRequest) -> Completion:
        index = len(self.requests)
        self.requests.append(request)
        if index >= len(self.texts):
            raise IndexError(f"scripted backend ran out of texts after {len(self.texts)} replies")
        text = self.texts[index]
        cut = [text.index(s) + len(s) for s in request.stop_strings if s in text]
        ids = [*self.tokenizer.encode(text[: min(cut)] if cut else text, add_special_tokens=False)]
        if not cut:  # a stop string ends the turn without the end token, as a sampler does
            ids.append(self.end_token_id)
        finish: FinishReason = "stop"
        if len(ids) > request.max_new_tokens:
            ids, finish = ids[: request.max_new_tokens], "length"
        return Completion(
            token_ids=tuple(ids),
            logprobs=tuple(0.0 for _ in ids),
            finish_reason=finish,
            text=self.tokenizer.decode(ids, skip_special_tokens=False),
        )
