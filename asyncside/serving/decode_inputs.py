"""A decode step's input tokens, lazy from the step in flight where a request was in it (see
:meth:`.engine.Batcher._launch`)."""

from __future__ import annotations

from typing import Any

from .requests import Slot, Step


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
