"""Everything a pipeline stage needs from the model: the embedding, a range of decoder layers, the head.

The distributed code calls only :func:`embed`, :func:`run_layers` and :func:`head` (and
:func:`greedy`, the sampling of one-process generation) for model work, so that where these come
from can change in this one module. They are built on the per-layer steps of
:class:`asyncside.models.forward.AsyncForward` (:mod:`asyncside.models.per_layer`): a stage's
forward sees the model through a view whose decoder layers end at the stage's last layer, and
starts its layer loop at the stage's first. (Queued and whole steps end in the head, which only
the last stage has.)
Layer ids are the model's (and the expert store's) own.

Attention masks: each architecture builds its masks from the cache of a fixed layer (layer 0 for
most; gpt_oss the first full and the first sliding-window layer). A later stage never runs those
layers, so their caches stay empty; the masks are built with each such cache replaced by the
stage's own first cache of the same kind, whose offset is the same as in one process (every stage
layer sees every token).
"""

from __future__ import annotations

import weakref
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..models.arch import decoder_layers
from ..models.forward import AsyncForward, ForwardOptions, StepMode
from ..models.per_layer import LONG_STEP_TOKENS
from ..models.predict import Predictor
from ..models.streaming import StreamingModel

__all__ = ["embed", "greedy", "head", "run_layers"]


class _StageView:
    """The model as one stage sees it: its decoder layers end at ``stop``; everything else is the model's."""

    def __init__(self, model: nn.Module, stop: int) -> None:
        self._model = model
        self.layers = list(decoder_layers(model))[:stop]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __contains__(self, key: object) -> bool:
        return key in self._model


#: StreamingModel -> {stop: the stage forward ending at that layer}
_FORWARDS: weakref.WeakKeyDictionary[StreamingModel, dict[int, AsyncForward]] = weakref.WeakKeyDictionary()


def _stage_forward(sm: StreamingModel, stop: int) -> AsyncForward:
    per_model = _FORWARDS.setdefault(sm, {})
    fwd = per_model.get(stop)
    if fwd is None:
        base = sm.forward
        # No speculative gathers on the CPU: a misprediction's recompute runs on the rank's own
        # core, the one its next step needs: without them the MLX thread spent less time per run
        # and the aggregate over one process rose (BENCHMARKS.md, "Pipeline stages over MLX's ring").
        spec = base.options.speculate and mx.default_device() == mx.gpu
        options = ForwardOptions(mode=StepMode.PER_LAYER, speculate=spec,
                                 lookahead_extra=base.options.lookahead_extra)
        view: Any = _StageView(sm.model, stop)  # the model's interface, its layers cut at ``stop`` (duck-typed)
        fwd = AsyncForward(view, sm.arch, base.walk.moe, base.walk.specs, base.completed, options)
        per_model[stop] = fwd
    return fwd


def _mask_cache(cache: list[Any], start: int) -> list[Any]:
    """``cache`` with each entry before ``start`` replaced by the stage's first cache of the same kind."""
    if start == 0:
        return cache
    out = list(cache)
    for j in range(start):
        for k in range(start, len(cache)):
            same_kind = type(cache[k]) is type(cache[j])
            if same_kind and getattr(cache[k], "max_size", None) == getattr(cache[j], "max_size", None):
                out[j] = cache[k]
                break
    return out


def embed(sm: StreamingModel, tokens: mx.array) -> mx.array:
    """The token embeddings of ``tokens`` (1, L) (lazy): the first stage's input."""
    return sm.forward.walk.embed(tokens)


async def run_layers(sm: StreamingModel, h: mx.array, cache: list[Any], source: Any, predictor: Predictor, *,
                     start: int, stop: int, prefill_end: bool = False) -> mx.array:
    """Decoder layers ``[start, stop)`` over hidden state ``h`` (1, L, hidden); returns their output, computed.

    ``cache`` is the model's whole per-layer cache list (only entries ``[start, stop)`` are used).
    The first MoE layer of the range is predicted from ``h`` and prefetched; each MoE layer then
    predicts the next MoE layer, which may lie past ``stop`` (``source.prefetch`` of a layer this
    stage does not own is how a stage learns its successor's prediction). Rows leased by the range
    are released once the output has been computed. The output is bitwise what the same layers
    compute inside one whole forward.

    ``prefill_end``: the range ends the model (``stop`` is its last layer + 1) and ``h`` is a
    prefill chunk, whose output nobody reads: the caches are complete after the last layer's
    attention, so the last block is not served and that hidden state is returned, as a one-process
    prefill chunk does.
    """
    n = len(decoder_layers(sm.model))
    if not 0 <= start < stop <= n:
        raise ValueError(f"run_layers: need 0 <= start < stop <= {n} (the model's decoder layers), "
                         f"got [{start}, {stop})")
    if prefill_end and stop != n:
        raise ValueError(f"run_layers: prefill_end needs the range to end the model (stop={n}), got stop={stop}")
    fwd = _stage_forward(sm, stop)
    masks = sm.arch.masks(fwd.walk.model, h, _mask_cache(cache, start))
    first = next((m for m in fwd.walk.moe if start <= m < stop), None)
    if first is not None:
        p = predictor.first(first, h)
        if p is not None:
            source.prefetch(first, p)
    ctx = fwd.context(cache, source, predictor)
    try:
        h = await fwd.per_layer.layers(ctx, start, h, masks, h.shape[1] >= LONG_STEP_TOKENS,
                                       stop_before_last=prefill_end)
    except BaseException:
        source.release_after(mx.array(0), ctx.leases)
        raise
    try:
        await fwd.completed(h)
    finally:
        source.release_after(h, ctx.leases)
    fwd.counters["forwards"] += 1
    return h


def head(sm: StreamingModel, h: mx.array) -> mx.array:
    """The final norm and output head over the last stage's output: logits (1, L, vocab), lazy."""
    return sm.forward.walk.logits(h)


def greedy(logits: mx.array) -> mx.array:
    """The greedy token of the last position (lazy, uint32 (1,)), as one-process generation picks it."""
    logits = logits[:, -1, :]
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    return mx.argmax(logprobs, axis=-1)
