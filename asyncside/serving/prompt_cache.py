"""Reuse of finished requests' KV caches for prompts that share a prefix.

:class:`PrefixCache` keeps the KV caches of the last few finished requests with the tokens they
hold (prompt + generated). A new prompt takes a copy of the entry with the longest common prefix,
trimmed back to that prefix with mlx-lm's ``trim_prompt_cache``, and only the rest of the prompt
is prefilled; the number of tokens reused is reported as
``usage.prompt_tokens_details.cached_tokens``. At least one prompt token is always left to run,
since its logits give the first generated token. An entry is reused only where its cache gives
back exactly the shared prefix (:func:`trims_back_to`): a chunked-attention cache (llama4's
``ChunkedKVCache``) drops the keys before its window, so a trim reaching behind them would resume
on keys of other positions.

Entries are few (a handful of conversations) and prompts short next to a linear scan, so the
lookup compares token lists directly rather than keeping a trie.

The cache is bounded twice: at most ``max_entries`` entries and at most ``max_bytes`` bytes of
keys and values in all (the least recently used go first; an entry larger than the whole bound
is not kept). ``nbytes`` is what it holds now.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from mlx_lm.models.cache import ChunkedKVCache, trim_prompt_cache


def cache_nbytes(cache: list[Any]) -> int:
    """Bytes of keys and values a request's KV cache holds (0 for layers that cannot say)."""
    total = 0
    for c in cache:
        try:
            total += int(c.nbytes)
        except (AttributeError, NotImplementedError, TypeError):
            continue
    return total


def trims_back_to(cache: list[Any], n: int) -> bool:
    """Whether ``cache``, holding more than ``n`` positions, trims back to exactly its first ``n``:
    every layer trimmable, and a chunked-attention layer still holding every key of the chunk
    position ``n`` falls in (it dropped the keys before ``start_position``, and the next forward's
    chunk mask attends back to that chunk's start; ``ChunkedKVCache.trim`` stops at
    ``start_position`` without saying so)."""
    for c in cache:
        if not c.is_trimmable():
            return False
        if isinstance(c, ChunkedKVCache) and c.start_position > n - n % c.chunk_size:
            return False
    return bool(cache)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Up to ``max_entries`` (tokens, KV cache) pairs and ``max_bytes`` bytes of them, least
    recently used dropped first."""

    def __init__(self, max_entries: int = 8, min_tokens: int = 16, max_bytes: int = 256 << 20) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.min_tokens = max(1, min_tokens)
        self._entries: OrderedDict[int, tuple[tuple[int, ...], list[Any]]] = OrderedDict()
        self._sizes: dict[int, int] = {}
        self.nbytes = 0
        self._next = 0
        self.hits = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def fetch(self, prompt: Sequence[int]) -> tuple[list[Any] | None, int]:
        """A private copy of the best cache for ``prompt`` and how many of its tokens it holds
        (None, 0 when no entry shares at least ``min_tokens``)."""
        best, best_n = None, 0
        for key, (tokens, cache) in self._entries.items():
            # One prompt token always runs: its logits start the answer.
            n = min(_common_prefix(tokens, prompt), len(prompt) - 1)
            if n > best_n and (n == len(tokens) or trims_back_to(cache, n)):
                best, best_n = key, n
        if best is None or best_n < self.min_tokens:
            return None, 0
        tokens, cache = self._entries[best]
        self._entries.move_to_end(best)
        mine = copy.deepcopy(cache)
        if best_n < len(tokens):
            trim_prompt_cache(mine, len(tokens) - best_n)
        self.hits += 1
        self.reused_tokens += best_n
        return mine, best_n

    @property
    def enabled(self) -> bool:
        """Whether anything is kept (``max_entries`` > 0)."""
        return self.max_entries > 0

    def insert(self, tokens: Sequence[int], cache: list[Any]) -> None:
        """Keep ``cache`` (holding exactly ``tokens``); the caller gives it up."""
        if self.max_entries <= 0 or not tokens:
            return
        size = cache_nbytes(cache)
        if size > self.max_bytes:
            return
        tokens = tuple(tokens)
        for key, (held, _c) in list(self._entries.items()):
            # An entry that is a prefix of the new one adds nothing a trim cannot give back.
            if len(held) <= len(tokens) and tokens[: len(held)] == held and (
                    len(held) == len(tokens) or trims_back_to(cache, len(held))):
                self._drop(key)
        self._entries[self._next] = (tokens, cache)
        self._sizes[self._next] = size
        self.nbytes += size
        self._next += 1
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def drop_oldest(self) -> None:
        """Drop the least recently used entry (nothing when empty): room for served requests' KV caches."""
        if self._entries:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: int) -> None:
        del self._entries[key]
        self.nbytes -= self._sizes.pop(key)

    def clear(self) -> None:
        self._entries.clear()
        self._sizes.clear()
        self.nbytes = 0
