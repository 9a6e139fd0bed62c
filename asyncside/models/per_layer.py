"""Per-layer steps: each MoE layer's routed ids come back to the host before its experts are served.

Per MoE layer the step builds the block's routing lazily, hands the next MoE layer's *prediction*
to ``source.prefetch`` (so reads overlap this layer's compute), awaits the routed ids with the
injected ``completed`` (never ``mx.eval`` on the loop), ``await source.ensure(layer, ids)``, leases
those rows, builds the gather over ``source.pools(layer)`` with physical rows, and releases the
leases once the step's output is computed. This is the path for prefill chunks (many tokens: the
union of their experts may not fit the pools at once) and for sources without queued steps.

*Speculative gathers*: when the source offers row snapshots (:class:`~asyncside.snapshot.
SpeculativeSource`), the layer's expert outputs are gathered in the graph from the snapshot, so
the stream computes them right after the router while the host checks the ids; only pairs whose
rows were not sound are recomputed.

*Predictions*: each MoE layer's prediction (made one MoE layer earlier) is counted against the ids
the layer then routed into the forward's counters (:func:`.predict.count_prediction`; precision
and recall: :class:`.predict.PredictionQuality`), and recorded beside them when a trace records.

*Capacity groups*: when the routed experts of one step cannot all be resident at once (``ensure``
raises CapacityError, e.g. a long prefill over a small side region), they are served in groups:
each group is ensured, leased, computed, awaited and released before the next; the layer output
takes each pair from the group that held its expert, which keeps the result bitwise exact.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
import numpy as np

import asyncside._native as _native  # absolute: a relative import resolves through the lazy front door in mypy

from ..bridge import Completed
from ..errors import AsyncsideError, CapacityError
from ..snapshot import RowSnapshot, SpeculativeSource
from .pooled import (
    SORT_THRESHOLD,
    combine,
    pooled_switch_apply,
    pooled_switch_pairs,
    pooled_switch_unsorted_pairs,
    route_and_apply,
)
from .predict import PREDICTION_COUNTERS, count_prediction
from .source import ExpertSource
from .walk import DecoderWalk, StepContext

#: steps of at least this many tokens are scheduled block by block (keeps the loop responsive)
LONG_STEP_TOKENS = 16


class RowLookupError(AsyncsideError, RuntimeError):
    """The source returned from ensure() but an ensured expert has no valid row."""


def checked_table(source: ExpertSource, layer: int, ids: np.ndarray) -> np.ndarray:
    """The layer's expert -> row table (host copy), or RowLookupError if an ensured id has no row."""
    table = np.asarray(source.lookup(layer))
    n_rows = next(iter(source.pools(layer).values())).shape[0]
    own = table[ids]
    bad = (own < 0) | (own >= n_rows)
    if bad.any():
        raise RowLookupError(
            f"layer {layer}: ensure() returned but expert(s) {ids[bad].tolist()} map to rows "
            f"{own[bad].tolist()} (pool has {n_rows} rows)"
        )
    return table


@dataclass(eq=False)
class Built:
    """One MoE layer built up to its routing: what the host's check and serving of it need."""

    layer: int
    h_attn: mx.array  # the hidden state after the layer's attention
    xn: mx.array  # the block's input
    x_sw: mx.array  # the switch layer's input
    inds: mx.array  # routed ids
    y_spec: mx.array | None  # expert outputs gathered from the snapshot (None: no snapshot)
    out_spec: mx.array | None  # the block's output with them
    snap: RowSnapshot | None


async def quiesce_queued(source: ExpertSource) -> None:
    """Before a step that serves experts from the host: let queued steps finish and give their
    rows back (leases, snapshots and ensure need the ledger to own every row again)."""
    quiesce = getattr(source, "quiesce", None)  # a QueuedSource
    if quiesce is not None and getattr(source, "queued_active", True):
        await quiesce()


class PerLayerSteps:
    """Forward steps that serve each MoE layer after its routed ids reached the host."""

    def __init__(self, walk: DecoderWalk, completed: Completed, schedule: Callable[..., Awaitable[None]],
                 counters: dict[str, int], *, speculate: bool, then_ok: bool) -> None:
        self.walk = walk
        self.completed = completed
        self.schedule = schedule
        self.counters = counters
        self.speculate = speculate
        self._then_ok = then_ok
        for key in PREDICTION_COUNTERS:  # the forward's counters: precision and recall of the predictions
            counters.setdefault(key, 0)

    async def forward(self, ctx: StepContext, inputs: mx.array, *, logits: bool) -> mx.array:
        """Run ``inputs`` (B, L) through the model; the logits (lazy), or with ``logits=False`` the
        hidden state after the last layer's attention (computed; prefill chunks, whose logits nobody
        reads: their caches are complete there, so the last block is not served, as mlx-lm's
        prefill never computes it either; unless a routing trace records, which gets every layer)."""
        walk = self.walk
        await quiesce_queued(ctx.source)
        h = walk.embed(inputs)
        masks = walk.masks(h, ctx.cache)
        #: many tokens at once (prefill): schedule the graph block by block, see below
        long_step = inputs.shape[-1] >= LONG_STEP_TOKENS
        ctx.predictor.begin(ctx.routing, ctx.position)
        p = ctx.predictor.first(walk.first_moe, h)
        if p is not None:
            ctx.source.prefetch(walk.first_moe, p)
            ctx.predicted[walk.first_moe] = p
        try:
            h = await self.layers(ctx, 0, h, masks, long_step, stop_before_last=not logits and ctx.record is None)
            # The head is the model's own code too: a raise there (or an interrupt) must not keep
            # the step's leases, which the output built below would otherwise release.
            out = walk.logits(h) if logits else h
        except BaseException:
            # Nothing reads these rows any more once the step is abandoned.
            ctx.source.release_after(mx.array(0), ctx.leases)
            raise
        self.counters["forwards"] += 1
        if not logits:
            try:
                await self.completed(h)
            finally:
                # Computed (or abandoned): a source may release these at once.
                ctx.source.release_after(h, ctx.leases)
            return h
        ctx.source.release_after(out, ctx.leases)
        return out

    def attend_and_route(self, ctx: StepContext, i: int, h: mx.array,
                         masks: list[Any]) -> tuple[Built | None, mx.array]:
        """Layer ``i`` built over ``h`` (lazy): its attention, then a dense block's output, or an MoE
        block's routing and, where a snapshot allows, its speculative outputs. Returns (None, the
        layer's output) for a dense layer, else (the MoE layer built so far, the hidden state after
        attention)."""
        walk = self.walk
        h, xn = walk.attend(i, h, masks, ctx.cache)
        if i not in walk.moe:
            return None, h + walk.block(i)(xn)
        block, attr = walk.moe[i]
        taken: list[RowSnapshot] = []
        # One call of the block routes and, when a snapshot allows, combines the speculative
        # outputs too (out_spec): its router is built and computed once.
        out_spec, x_sw, inds, y_spec = route_and_apply(
            block, attr, xn, functools.partial(self._gather_from_snapshot, ctx.source, i, taken), ctx.forced(i, xn))
        return Built(i, h, xn, x_sw, inds, y_spec, out_spec, taken[0] if taken else None), h

    async def layers(self, ctx: StepContext, start: int, h: mx.array, masks: list[Any], long_step: bool, *,
                     stop_before_last: bool = False) -> mx.array:
        """Decoder layers ``start``.. over hidden state ``h``, one MoE layer at a time: each awaits its
        routed ids, then serves its experts. Returns the last layer's output (lazy), or with
        ``stop_before_last`` the hidden state after the last layer's attention (a prefill chunk's
        caches are complete there; its block, which would route, read and compute a whole layer's
        experts for an output nobody reads, is not built)."""
        walk, source, predictor = self.walk, ctx.source, ctx.predictor
        last = len(walk.layers) - 1
        for i in range(start, len(walk.layers)):
            if stop_before_last and i == last:
                return walk.attend(i, h, masks, ctx.cache)[0]
            b, h = self.attend_and_route(ctx, i, h, masks)
            if long_step:
                await self.completed(h)  # see the await after the MoE output below
            if b is None:
                continue
            block, attr = walk.moe[i]
            xn, x_sw, inds, y_spec, out_spec, snap = b.xn, b.x_sw, b.inds, b.y_spec, b.out_spec, b.snap
            nxt = walk.next_moe[i]
            if stop_before_last and nxt == last:
                nxt = None  # not served in this step: nothing to predict or prefetch for it
            p = predictor.next(nxt, xn) if nxt is not None else None
            if isinstance(p, mx.array):
                # Schedule the prediction before the routed ids: the stream computes it first, so
                # once the ids are in, the prediction is too and its prefetch needs no completion
                # signal of its own (one signal per layer, not two). Both in one call: on a GPU
                # each scheduling call commits a command buffer.
                await self.schedule(p, inds)
            if snap is not None:
                assert out_spec is not None
                await self._completed_then(inds, out_spec)
            else:
                await self.completed(inds)
            if p is not None and nxt is not None:  # p is made only for a next MoE layer (narrows nxt)
                if isinstance(p, mx.array) and _native.is_available(p):
                    p = np.array(p, copy=True)
                source.prefetch(nxt, p)
                ctx.predicted[nxt] = p
            inds_np = np.array(inds, copy=True)
            predictor.observe(i, inds_np)
            pred = ctx.predicted.get(i)
            if isinstance(pred, mx.array):
                # The first MoE layer's (made from the embeddings), or any where the native module is
                # absent: computed by now or soon (scheduled before these ids); read on the host after.
                await self.completed(pred)
                pred = ctx.predicted[i] = np.array(pred, copy=True)
            if pred is not None:
                count_prediction(self.counters, pred, inds_np)
            if ctx.record is not None:
                ctx.record.record(i, inds_np, pred)
            if snap is not None:
                assert out_spec is not None and y_spec is not None  # a snapshot gather made both
                y = await self.serve_speculated(ctx, i, x_sw, inds_np, y_spec, snap)
                # Every pair sound: the block output built with the speculative outputs stands.
                h = h + (out_spec if y is y_spec else combine(block, attr, xn, y, ctx.forced(i, xn)))
            else:
                y = await self.serve(ctx, i, x_sw, inds_np)
                h = h + combine(block, attr, xn, y, ctx.forced(i, xn))
            if long_step:
                # A prefill chunk: let the stream finish each block before scheduling the next.
                # The bridge queues graphs in groups of nodes under MLX's eval throttle, but a
                # long prefill's nodes can each be many dispatches, so a group on top of a queued
                # layer could still cross it and hold the loop; awaiting each block bounds that.
                await self.completed(h)
        return h

    def _gather_from_snapshot(self, source: ExpertSource, layer: int, taken: list[RowSnapshot],
                              x_sw: mx.array, inds: mx.array) -> mx.array | None:
        """The layer's expert outputs gathered in the graph from where the experts are now (the
        stream computes them right after the router, while the host checks the ids); None when this
        step cannot gather speculatively. The snapshot used is appended to ``taken``."""
        snap = self._snapshot(source, layer, inds)
        if snap is None:
            return None
        taken.append(snap)
        return pooled_switch_apply(self.walk.specs[layer], self.walk.activation(layer), x_sw,
                                   mx.take(snap.rows, inds), source.pools(layer))

    def _snapshot(self, source: ExpertSource, layer: int, inds: mx.array) -> RowSnapshot | None:
        """The layer's row snapshot when this step can gather speculatively, else None."""
        if not self.speculate or inds.size >= SORT_THRESHOLD:
            # Many pairs take the sorted path, whose order is decided on the host.
            return None
        take = getattr(source, "snapshot", None)  # SpeculativeSource; None opts a source out
        if take is None or not callable(getattr(source, "unchanged", None)):
            return None
        return cast(RowSnapshot, take(layer))

    async def _completed_then(self, x: mx.array, then: mx.array) -> None:
        """Await x with ``then`` queued behind its completion signal (where the bridge allows)."""
        if self._then_ok:
            await self.completed(x, then=[then])  # type: ignore[call-arg]
            return
        # An injected completion without `then`: schedule x first so the stream still computes the
        # ids before the speculative outputs; the wake-up may then come after both.
        mx.async_eval(x)
        mx.async_eval(then)
        await self.completed(x)

    async def serve_speculated(self, ctx: StepContext, layer: int, x_sw: mx.array, inds: np.ndarray,
                               y_spec: mx.array, snap: RowSnapshot) -> mx.array:
        """Keep the speculative outputs of pairs whose rows were sound; recompute the others.

        Sound: the expert was in its snapshot row and the row was not refilled since, so whatever
        the stream read from it was that expert's bytes. Those rows are leased at once, before any
        await. The other experts are ensured, leased, and only their pairs recomputed; each pair's
        product is independent of the others, so the merged output is bitwise the unsorted gather.
        """
        source = ctx.source
        uniq = np.unique(inds).astype(np.int64)
        # A snapshot was taken, so the source is a SpeculativeSource (_snapshot checked).
        sound = np.asarray(cast(SpeculativeSource, source).unchanged(layer, snap, uniq), dtype=np.bool_)
        self.counters["speculated"] += 1
        held: list[tuple[int, int]] = []
        if sound.any():
            held.append((layer, source.lease(layer, uniq[sound])))
        if sound.all():
            ctx.leases.extend(held)
            try:
                await source.ensure(layer, uniq)  # all present: counts the hits for the policy, no wait
            except CapacityError:
                pass  # more experts than the side region at once: nothing to place, all are here
            return y_spec
        self.counters["speculation_misses"] += 1
        redo = uniq[~sound]
        try:
            await source.ensure(layer, uniq)
        except CapacityError:
            # The whole set does not fit at once: serve it in groups, dropping the speculative
            # result. Its rows are released once the stream is done reading them, so the groups
            # can reuse them (keeping them leased to the end of the step could block forever).
            source.release_after(y_spec, held)
            return await self.serve(ctx, layer, x_sw, inds)
        except BaseException:
            source.release_after(y_spec, held)
            raise
        ctx.leases.extend(held)
        ctx.leases.append((layer, source.lease(layer, redo)))
        table = checked_table(source, layer, redo)
        flat = inds.reshape(-1)
        pos = np.flatnonzero(np.isin(flat, redo))
        y_new = pooled_switch_unsorted_pairs(self.walk.specs[layer], self.walk.activation(layer), x_sw,
                                             pos // inds.shape[-1], table[flat[pos]], source.pools(layer))
        # Pair j of the result: y_spec's own, or the recomputed one where its expert was unsound.
        n = flat.size
        pick = np.arange(n)
        pick[pos] = n + np.arange(pos.size)
        out_shape = y_spec.shape
        both = mx.concatenate([y_spec.reshape(n, -1), y_new], axis=0)
        return both[mx.array(pick)].reshape(out_shape)

    async def serve(self, ctx: StepContext, layer: int, x_sw: mx.array, inds: np.ndarray) -> mx.array:
        """Expert outputs of one MoE layer, every pair served from a leased, present row."""
        source = ctx.source
        spec = self.walk.specs[layer]
        activation = self.walk.activation(layer)
        pending = [np.unique(inds).astype(np.int64)]
        y: mx.array | None = None
        split = False
        # Split groups on the sorted path: each group computes only its own pairs (parts), put
        # back in pair order at the end. Every pair of an expert is in one group, so each expert's
        # block of rows is the same as in the unsplit sorted gather, and results stay bitwise equal.
        subset = inds.size >= SORT_THRESHOLD
        parts: list[mx.array] = []
        positions: list[np.ndarray] = []
        while pending:
            ids = pending.pop(0)
            try:
                await source.ensure(layer, ids)
            except CapacityError:
                if len(ids) <= 1:
                    raise
                half = len(ids) // 2
                pending[:0] = [ids[:half], ids[half:]]
                if not split:
                    split = True
                    self.counters["capacity_splits"] += 1
                continue
            # No await between ensure() returning and lease(): nothing can evict in between.
            lease_id = source.lease(layer, ids)
            try:
                pools = source.pools(layer)
                table = checked_table(source, layer, ids)
                own = table[ids]
                if not split:
                    y_g = pooled_switch_apply(spec, activation, x_sw, table[inds], pools)
                    y = y_g
                elif subset:
                    flat = inds.reshape(-1)
                    pos = np.nonzero(np.isin(flat, ids))[0]
                    rows_g = table[flat[pos]]
                    order = np.argsort(rows_g, kind="stable")
                    pos = pos[order]
                    y_g = pooled_switch_pairs(spec, activation, x_sw, pos // inds.shape[-1], rows_g[order], pools)
                    parts.append(y_g)
                    positions.append(pos)
                    self.counters["subset_groups"] += 1
                else:
                    member = np.isin(inds, ids)
                    # Pairs of other groups point at a row this group leased; their results are discarded.
                    rows = np.where(member, table[inds], own[0])
                    y_g = pooled_switch_apply(spec, activation, x_sw, rows, pools)
                    y = y_g if y is None else mx.where(mx.array(member)[..., None], y_g, y)
                self.counters["groups"] += 1
            except BaseException:
                source.release_after(mx.array(0), [(layer, lease_id)])
                raise
            if split:
                source.release_after(y_g, [(layer, lease_id)])
            else:
                # Released with the whole step's output (one completion per step, not one per
                # layer); the rows stay pinned until the token's logits have been computed.
                ctx.leases.append((layer, lease_id))
            if pending:
                # The next group may need these rows: its reads must wait until this group is computed.
                await self.completed(y_g)
        if parts:
            where = np.concatenate(positions)
            inv = np.empty_like(where)
            inv[where] = np.arange(where.size)
            y = mx.concatenate(parts, axis=0)[mx.array(inv)]
            y = mx.unflatten(y, 0, inds.shape).squeeze(-2)
        assert y is not None
        return y
