"""What an engine step's forwards run (see :meth:`.engine.Batcher.step`): which prefill chunks
share a forward, and a decode step's input tokens, lazy from the step in flight where a request
was in it."""

from __future__ import annotations

from typing import Any

from .batch_caches import fresh_cache
from .requests import Slot, Step


def prefill_groups(picked: list[tuple[Slot, int]], joint: bool, budget: int) -> list[list[tuple[Slot, int]]]:
    """An engine step's chunks (each request and its tokens) as forwards, in order: with ``joint``,
    requests whose chunk is the first of a fresh prompt (an empty cache of mlx-lm's plain
    ``KVCache``) share one joint forward while its padded size (requests x the longest chunk)
    stays within ``budget`` (the prefill chunk); every other chunk is a forward of its own."""
    if not joint:
        return [[p] for p in picked]
    fresh = sorted((p for p in picked if fresh_cache(p[0])), key=lambda p: p[1])
    group: list[tuple[Slot, int]] = []
    for p in fresh:  # shortest first: the most requests per padded token
        if (len(group) + 1) * p[1] > budget:
            break
        group.append(p)
    if len(group) < 2:
        return [[p] for p in picked]
    inside = {id(p[0]) for p in group}
    return [group] + [[p] for p in picked if id(p[0]) not in inside]


def decode_inputs(batch: list[Slot], prev: Step | None) -> Any:
    """The step's input tokens (B, 1): each request's last token, lazy from ``prev`` for the
    requests in it (their token as ``prev`` sampled it, exactly: ids below 2**24 are exact in
    the packed float32 draws), from the host for the others."""
    import mlx.core as mx

    if prev is None:
        return mx.array([[s.todo[0]] for s in batch])
    at = {s: lay[0] for s, lay in zip(prev.batch, prev.layout)}
    host = [s.todo[0] for s in batch if s not in at]
    index, extra = [], prev.values.shape[0]
    for s in batch:
        if s in at:
            index.append(at[s])
        else:
            index.append(extra)
            extra += 1
    values = prev.values if not host else mx.concatenate([prev.values, mx.array(host, dtype=mx.float32)])
    return values[mx.array(index)].astype(mx.int32).reshape(-1, 1)
