"""Whole steps, checked after: a decode step queued whole from row snapshots, redone where unsound.

Every MoE layer gathers its rows in the graph from a :class:`~asyncside.snapshot.RowSnapshot`
taken when the step was built; the host awaits only the logits, then checks the layers in order.
At the first layer with an unsound pair (an expert absent from its snapshot, or its row refilled
since) the layers after it computed from a wrong hidden state: their KV caches are trimmed by this
step's entry, the layer's unsound pairs are served again (reads, then recomputed), and the rest
of the step is queued whole again from fresh snapshots, until a round checks sound to the end.
Layers before the unsound one were computed from sound rows by the same ops, so the result is
bitwise the per-layer one.

A step is sound only if every routed expert of every MoE layer was present; with a hit rate h,
L MoE layers and top-k routing that is about h^(L*k), so for deep models with wide routing most
steps are redone. :mod:`.queued` serves misses where they occur instead; this mode stays for
comparison and for sources that offer snapshots but no fault tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
import numpy as np

from ..errors import CapacityError
from ..snapshot import SpeculativeSource
from .per_layer import Built, PerLayerSteps, quiesce_queued
from .pooled import combine
from .walk import StepContext


@dataclass(eq=False)
class _Whole:
    """A decode step (or its layers from one on) queued whole."""

    masks: list[Any]
    built: list[Built]
    out: mx.array  # logits


class WholeSteps:
    """Decode steps queued whole and checked after (see the module docstring)."""

    def __init__(self, per_layer: PerLayerSteps) -> None:
        self.per_layer = per_layer
        self.walk = per_layer.walk
        self.counters = per_layer.counters

    @staticmethod
    def can_run(ctx: StepContext, inputs: mx.array) -> bool:
        """Whether this step may be queued whole: one token, a snapshot source, trimmable caches."""
        source = ctx.source
        return (inputs.shape[-1] == 1 and inputs.size == 1
                and callable(getattr(source, "snapshot", None)) and callable(getattr(source, "unchanged", None))
                # Every cache must be able to take back this step's entry (a rotating cache
                # only before it wraps; one entry of margin).
                and all(c.is_trimmable() and (getattr(c, "max_size", None) is None or c.offset + 2 < c.max_size)
                        for c in ctx.cache))

    def _build(self, ctx: StepContext, h: mx.array, masks: list[Any], start: int) -> _Whole:
        """Layers ``start``.. built at once over ``h``, every MoE layer gathering from its snapshot."""
        built: list[Built] = []
        for i in range(start, len(self.walk.layers)):
            b, h = self.per_layer.attend_and_route(ctx, i, h, masks)
            if b is not None:
                assert b.out_spec is not None and b.snap is not None, "decode steps always gather"
                built.append(b)
                h = b.h_attn + b.out_spec
        return _Whole(masks, built, self.walk.logits(h))

    async def forward(self, ctx: StepContext, inputs: mx.array) -> mx.array:
        """One decode step queued whole, then checked; returns the logits, computed."""
        walk, pl = self.walk, self.per_layer
        await quiesce_queued(ctx.source)
        h = walk.embed(inputs)
        whole = self._build(ctx, h, walk.masks(h, ctx.cache), 0)
        await pl.schedule(whole.out)
        source, predictor, cache = ctx.source, ctx.predictor, ctx.cache
        speculative = cast(SpeculativeSource, source)  # can_run checked it offers snapshot and unchanged
        self.counters["optimistic"] += 1
        try:
            while True:
                await pl.completed(whole.out)
                routed = [np.array(b.inds, copy=True) for b in whole.built]
                bad = None
                for n, b in enumerate(whole.built):
                    uniq = np.unique(routed[n]).astype(np.int64)
                    assert b.snap is not None
                    if not np.asarray(speculative.unchanged(b.layer, b.snap, uniq), dtype=np.bool_).all():
                        bad = n
                        break
                    predictor.observe(b.layer, routed[n])
                    if ctx.record is not None:
                        ctx.record.record(b.layer, routed[n], None)
                    try:
                        await source.ensure(b.layer, uniq)  # all present: counts the hits for the policy
                    except CapacityError:
                        pass
                if bad is None:
                    break
                self.counters["optimistic_redone"] += 1
                b = whole.built[bad]
                # The ids the wrong round routed after the unsound layer are what the next round
                # will most likely route: the hidden state differs only by that layer's unsound pairs.
                for later in range(bad + 1, len(whole.built)):
                    source.prefetch(whole.built[later].layer, np.unique(routed[later]))
                for c in cache[b.layer + 1:]:
                    c.trim(1)
                predictor.observe(b.layer, routed[bad])
                if ctx.record is not None:
                    ctx.record.record(b.layer, routed[bad], None)
                block, attr = walk.moe[b.layer]
                assert b.y_spec is not None and b.out_spec is not None and b.snap is not None
                y = await pl.serve_speculated(ctx, b.layer, b.x_sw, routed[bad], b.y_spec, b.snap)
                forced = ctx.forced(b.layer, b.xn)
                h = b.h_attn + (b.out_spec if y is b.y_spec else combine(block, attr, b.xn, y, forced))
                whole = self._build(ctx, h, whole.masks, b.layer + 1)
                await pl.schedule(whole.out)
        except BaseException:
            source.release_after(mx.array(0), ctx.leases)
            raise
        # Outside the try: a release_after that raised after taking the leases must not see them
        # released a second time by the handler above.
        self.counters["forwards"] += 1
        source.release_after(whole.out, ctx.leases)
        return whole.out
