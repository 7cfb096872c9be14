"""Key/value caches kept between generate calls, so a multi-turn episode's history is
never encoded twice.

After a completion, the backend stores the keys and values of every token the model read
or fed (the prompt and all sampled tokens but the last), under that token sequence. The
episode's next request starts with exactly those tokens (its context plus the tool's
answer), so only the new tokens need a forward pass. Entries are valid for one policy
version: new weights make every stored key and value stale, and the store empties.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

LayerKV = tuple[torch.Tensor, torch.Tensor]
"""One layer's keys and values for one sequence, each ``[heads, tokens, head_dim]``."""

_MOD = (1 << 61) - 1
_BASE = 1_000_003


def prefix_hashes(tokens: Sequence[int]) -> list[int]:
    """Polynomial hashes of every prefix of ``tokens``: ``out[n]`` hashes ``tokens[:n]``.
    One pass, so a lookup costs O(prompt) however many lengths are stored."""
    out = [0]
    h = 0
    for t in tokens:
        h = (h * _BASE + t + 1) % _MOD
        out.append(h)
    return out


class PrefixCache:
    """A bounded LRU store of per-sequence key/value caches, keyed by their token ids."""

    def __init__(self, max_tokens: int = 1 << 20) -> None:
        self.max_tokens = max_tokens
        self.version: int | None = None
        self._entries: OrderedDict[tuple[int, ...], list[LayerKV]] = OrderedDict()
        self._index: dict[tuple[int, int], tuple[int, ...]] = {}  # (length, hash) -> key
        self._lengths: dict[int, int] = {}  # cached length -> number of entries
        self._tokens = 0
        self.hits = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def sync(self, version: int) -> None:
        """Empty the store if the weights changed since its entries were computed."""
        if version != self.version:
            self.clear()
            self.version = version

    def clear(self) -> None:
        self._entries.clear()
        self._index.clear()
        self._lengths.clear()
        self._tokens = 0

    def put(self, tokens: Sequence[int], layers: list[LayerKV]) -> None:
        """Store the caches of ``tokens`` (one ``(K, V)`` per layer, all ``len(tokens)``
        long), evicting the least recently used entries beyond ``max_tokens``."""
        key = tuple(tokens)
        if not key or key in self._entries or len(key) > self.max_tokens:
            return
        if any(k.shape[1] != len(key) or v.shape[1] != len(key) for k, v in layers):
            raise ValueError("every layer's cache must cover exactly the stored tokens")
        self._entries[key] = layers
        self._index[(len(key), prefix_hashes(key)[-1])] = key
        self._lengths[len(key)] = self._lengths.get(len(key), 0) + 1
        self._tokens += len(key)
        while self._tokens > self.max_tokens:
            old, _ = self._entries.popitem(last=False)
            self._index.pop((len(old), prefix_hashes(old)[-1]), None)
            self._forget(len(old))

    def longest_prefix(self, prompt: Sequence[int]) -> tuple[int, list[LayerKV]] | None:
        """The longest stored sequence that is a proper prefix of ``prompt`` (at least one
        token of the prompt is left to run), and its caches; None if there is none."""
        hashes = prefix_hashes(prompt)
        for n in sorted(self._lengths, reverse=True):
            if n >= len(prompt):
                continue
            key = self._index.get((n, hashes[n]))
            if key is None or key != tuple(prompt[:n]):  # no entry, or a hash collision
                continue
            layers = self._entries.get(key)
            if layers is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                self.reused_tokens += n
                return n, layers
        return None

    def _forget(self, length: int) -> None:
        self._tokens -= length
        self._lengths[length] -= 1
        if not self._lengths[length]:
            del self._lengths[length]
