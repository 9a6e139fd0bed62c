"""Queued steps: one step queued per token, expert misses served inside the stream.

The step is built like mlx-lm's own forward, op for op, except that each MoE block gathers from
the pools through the source's ``expert_rows(layer, ids)`` node: when the stream reaches it, the
routed experts are mapped to pool rows, and an expert without a row is read into a row the ledger
lent for it right there, before the gather that depends on it runs (see
``native/expert_faults.h``). The host queues the whole step once and awaits only its token: no
host round trip between layers, no recomputation, no speculation to check.

The host's work per step besides building the graph: ``source.begin_step`` (learn what earlier
steps did, top up the lent rows) before the step is built, ``source.end_step`` after it is
scheduled, and ``source.after_step`` once its token was awaited.
"""

from __future__ import annotations

from typing import Any, Protocol, cast, runtime_checkable

import mlx.core as mx
import numpy as np

from .. import _native
from ..bridge import Completed
from .pooled import SORT_THRESHOLD, pooled_switch_apply, route_and_apply
from .walk import DecoderWalk, StepContext

#: a queued step routes at most this many tokens (B x L) at once; longer steps go per layer,
#: where experts can be served in groups when their union does not fit the pools
MAX_QUEUED_TOKENS = 64


@runtime_checkable
class QueuedSource(Protocol):
    """What an expert source offers for queued steps (``Runtime`` and ``ResidentSource`` do).

    - ``queued_ready(pairs)``: whether a step routing up to ``pairs`` pairs per layer can be queued.
    - ``queued_capacity()``: how many distinct experts every layer can hold for one expert
      resolve (a step whose batch routes more is split into resolves of that many at most).
    - ``begin_step(pairs)``: called before the step is built (never blocks).
    - ``expert_rows(layer, ids)``: lazy uint32 pool rows of the routed ids, resolved on the stream.
    - ``end_step(out)``: the step whose last output is ``out`` is built (called before it is scheduled).
    - ``after_step()``: a queued step's output was awaited; raises the FillError of a failed fault.
    - ``quiesce()``: await every queued step and give the rows back to the per-layer paths.
    """

    def queued_ready(self, pairs: int) -> bool: ...
    def queued_capacity(self) -> int: ...
    def begin_step(self, pairs: int) -> None: ...
    def expert_rows(self, layer: int, ids: mx.array) -> mx.array: ...
    def end_step(self, out: mx.array) -> None: ...
    def after_step(self) -> None: ...
    async def quiesce(self) -> None: ...


class QueuedSteps:
    """Decode steps queued whole, misses served by the source inside the stream."""

    def __init__(self, walk: DecoderWalk, completed: Completed, counters: dict[str, int], *, bridged: bool) -> None:
        self.walk = walk
        self.completed = completed
        self.counters = counters
        self._bridged = bridged
        self._is_queued: dict[type, bool] = {}

    def pairs(self, inputs: mx.array) -> int:
        """(token, expert) pairs one MoE layer routes for ``inputs`` at most."""
        return int(inputs.size) * self.walk.top_k

    def can_run(self, ctx: StepContext, inputs: mx.array) -> bool:
        source = ctx.source
        kind = type(source)
        queued = self._is_queued.get(kind)
        if queued is None:  # a Protocol isinstance walks every method: once per source type
            queued = self._is_queued[kind] = isinstance(source, QueuedSource)
        if not queued or inputs.size > MAX_QUEUED_TOKENS:
            return False
        qsource = cast(QueuedSource, source)  # `queued` is the cached isinstance, True here
        if qsource.queued_ready(self.pairs(inputs)):
            ctx.split = None
            return True
        # A batch whose experts may not fit a layer's rows at once: its switch resolves the
        # experts of `split` tokens at a time, each part computed before the next may evict
        # its rows (see forward). Distinct experts per part <= split * top_k <= capacity.
        split = qsource.queued_capacity() // self.walk.top_k
        if split >= 1 and qsource.queued_ready(split * self.walk.top_k):
            ctx.split = split
            return True
        return False

    async def forward(self, ctx: StepContext, inputs: mx.array) -> mx.array:
        """Queue one step over ``inputs`` (B, L); returns its logits, scheduled, not awaited.

        The routing of every MoE layer is kept in ``ctx.routed``: read it only after the logits
        were awaited.
        """
        walk, source = self.walk, ctx.source
        assert isinstance(source, QueuedSource)
        source.begin_step(self.pairs(inputs))
        h = walk.embed(inputs)
        masks = walk.masks(h, ctx.cache)
        routed, split = ctx.routed, ctx.split
        for i in range(len(walk.layers)):
            h_attn, xn = walk.attend(i, h, masks, ctx.cache)
            if i not in walk.moe:
                h = h_attn + walk.block(i)(xn)
                continue
            block, attr = walk.moe[i]
            spec, activation, pools = walk.specs[i], walk.activation(i), source.pools(i)

            def apply(x_sw: mx.array, inds: mx.array, i: int = i, spec: Any = spec, activation: Any = activation,
                      pools: Any = pools) -> mx.array:
                if split is None or inds.size <= split * inds.shape[-1]:
                    return pooled_switch_apply(spec, activation, x_sw, source.expert_rows(i, inds), pools)
                return _split_switch(source, i, spec, activation, x_sw, inds, pools, split)

            out, _x_sw, inds, _y = route_and_apply(block, attr, xn, apply)
            assert out is not None
            routed.append((i, inds))
            h = h_attn + out
        logits = walk.logits(h)
        # Registered before scheduling: _schedule awaits between pieces of the graph, and a
        # quiesce() meanwhile (another task's ensure, the runtime closing, a cancel) must wait
        # for this step too before it takes the lent rows back; the stream may be faulting rows
        # in for its first layers already. quiesce() schedules what this task did not get to.
        source.end_step(logits)
        await self._schedule(logits)
        self.counters["queued"] += 1
        self.counters["forwards"] += 1
        return logits

    async def _schedule(self, out: mx.array) -> None:
        """Hand the step to MLX without blocking the loop: in chunks that fit under MLX's eval
        throttle, awaiting a node in the middle of each chunk before the next (native StepPlan:
        one walk of the graph per step)."""
        if not self._bridged:
            mx.async_eval(out)  # an injected completion (tests): MLX may block the caller
            return
        plan = _native.StepPlan([out])
        while True:
            done, wait_on = plan.advance()
            if done:
                return
            await self.completed(wait_on)

    @staticmethod
    def record_routes(ctx: StepContext) -> None:
        """Trace the routing of a queued step whose logits were awaited (only when tracing)."""
        if ctx.record is None:
            return
        for layer, inds in ctx.routed:
            ctx.record.record(layer, np.array(inds, copy=True), None)


def _split_switch(source: QueuedSource, layer: int, spec: Any, activation: Any, x_sw: mx.array, inds: mx.array,
                  pools: Any, split: int) -> mx.array:
    """A switch layer's output computed ``split`` tokens at a time, for a batch whose routed
    experts may not all fit the layer's lent rows at once.

    Each part resolves its own experts (faulting absent ones into lent rows, possibly evicting
    rows an earlier part used), so each part's ids are made to depend on the previous part's
    output through data: the graph cannot resolve them before the rows they may evict were read.
    A data dependency, not ``mx.depends``: MLX CUDA orders the nodes of its command graphs by the
    buffers they read and write, and a ``depends`` moves no data, so there the parts' fault nodes
    ran beside the previous part's products (and shared the layer's staging buffers): wrong
    logits on the H200. ``where(c, ids, ids)`` is ``ids`` whatever ``c``. Every part sorts as the
    whole switch input would, and each pair's product does not depend on which part it is in, so
    the output is bitwise the unsplit one.
    """
    k = inds.shape[-1]
    ids = inds.reshape(-1, k)
    x = x_sw.reshape(-1, x_sw.shape[-1])
    sort = inds.size >= SORT_THRESHOLD
    outs: list[mx.array] = []
    for start in range(0, ids.shape[0], split):
        part = ids[start:start + split]
        if outs:
            prev = outs[-1].reshape(-1)[:1]
            part = mx.where(prev == prev, part, part)
        rows = source.expert_rows(layer, part)
        outs.append(pooled_switch_apply(spec, activation, x[start:start + split], rows, pools, sort=sort))
    y = mx.concatenate(outs, axis=0)
    return y.reshape(*inds.shape, y.shape[-1])
