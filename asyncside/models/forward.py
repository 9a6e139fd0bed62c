"""The async forward pass over an ExpertSource, and greedy generation.

Per MoE layer the forward: builds the block's routing lazily (:func:`pooled.route`), hands the
next MoE layer's *prediction* to ``source.prefetch`` (so reads overlap this layer's compute),
awaits the routed ids with the injected ``completed`` coroutine (never ``mx.eval`` on the loop),
``await source.ensure(layer, unique_ids)``, leases those rows, reads the expert->row table, builds
the gather over ``source.pools(layer)`` with physical rows, and calls ``source.release_after`` with
that layer's expert output so the rows are freed once it is computed. Results equal the plain
mlx-lm model's bit for bit (tests), whatever rows the source chose.

When the routed experts of one step cannot all be resident at once (``ensure`` raises
CapacityError, e.g. a long prefill over a small side region), they are served in groups: each
group is ensured, leased, computed over *all* routed pairs with its rows, awaited and released
before the next; the layer output takes each pair from the group that held its expert
(``mx.where``), which keeps the result bitwise exact.

On a GPU (``AsyncForward.optimistic``) a decode step is instead queued whole, every MoE layer
gathering rows from a snapshot, and checked after it computed; from its first unsound layer the
rest of the step is redone with the later layers' caches trimmed back (:meth:`AsyncForward._finish_whole`).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import anyio
import anyio.lowlevel
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from .. import _native
from ..errors import AsyncsideError, CapacityError
from .arch import Arch, decoder_layers, top_k_attribute
from ..snapshot import RowSnapshot
from .pooled import (
    SORT_THRESHOLD,
    SwitchSpec,
    combine,
    pooled_switch_apply,
    pooled_switch_pairs,
    pooled_switch_unsorted_pairs,
    route,
    route_and_apply,
)
from .predict import LookaheadPredictor, Predictor, TemporalPredictor, check_predictor
from .source import ExpertSource
from .trace import RoutingTrace

Completed = Callable[[mx.array], Awaitable[None]]

#: mlx-lm's generate_step default; the async path chunks prefill identically so numerics match.
PREFILL_STEP_SIZE = 2048


#: steps of at least this many tokens are scheduled block by block (keeps the loop responsive)
LONG_STEP_TOKENS = 16


class RowLookupError(AsyncsideError, RuntimeError):
    """The source returned from ensure() but an ensured expert has no valid row."""


async def eval_completed(x: mx.array) -> None:
    """Blocking stand-in for ``asyncside.bridge.completed``: evaluates ``x`` on the calling thread.

    Only for tests and synchronous tools; it blocks the event loop for the whole computation.
    """
    mx.eval(x)


def _checked_table(source: ExpertSource, layer: int, ids: np.ndarray) -> np.ndarray:
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


async def _async_eval(*arrays: mx.array) -> None:
    """``mx.async_eval`` for injected completions that are not the bridge's."""
    mx.async_eval(*arrays)


def default_completed() -> Completed:
    """``asyncside.bridge.completed`` (the native completion bridge), or a clear error if absent."""
    try:
        from ..bridge import completed
    except ImportError as exc:  # pragma: no cover - depends on the bridge module being present
        raise AsyncsideError(
            "asyncside.bridge is not available; pass completed=... (eval_completed blocks the loop)"
        ) from exc
    return completed


@dataclass(eq=False)
class _Built:
    """One MoE layer built up to its routing: what the host's check and serving of it need."""

    layer: int
    h_attn: mx.array  # the hidden state after the layer's attention
    xn: mx.array  # the block's input
    x_sw: mx.array  # the switch layer's input
    inds: mx.array  # routed ids
    y_spec: mx.array | None  # expert outputs gathered from the snapshot (None: no snapshot)
    out_spec: mx.array | None  # the block's output with them
    snap: RowSnapshot | None


@dataclass(eq=False)
class _Whole:
    """A decode step (or its layers from one on) queued whole: see AsyncForward._begin_whole."""

    masks: list[Any]
    built: list[_Built]
    out: mx.array  # logits


class AsyncForward:
    """One forward pass of an mlx-lm MoE model whose switch layers are PooledSwitch modules."""

    def __init__(self, model: nn.Module, arch: Arch, moe: dict[int, tuple[nn.Module, str]],
                 specs: dict[int, SwitchSpec], completed: Completed) -> None:
        self.model = model
        self.arch = arch
        self.moe = dict(sorted(moe.items()))
        self.specs = specs
        self.completed = completed
        order = list(self.moe)
        self.first_moe = order[0]
        #: decoder layer index -> the next MoE layer after it (None after the last)
        self.next_moe: dict[int, int | None] = {}
        for i in range(len(decoder_layers(model))):
            later = [m for m in order if m > i]
            self.next_moe[i] = later[0] if later else None
        self.counters = {"forwards": 0, "capacity_splits": 0, "groups": 0, "subset_groups": 0,
                         "speculated": 0, "speculation_misses": 0, "optimistic": 0, "optimistic_redone": 0}
        #: gather rows in the graph from a RowSnapshot when the source offers one (decode steps)
        self.speculate = True
        #: the lookahead predictor names this many experts beyond the router's k (0: exactly k)
        self.lookahead_extra = 0
        #: decode steps queued whole and checked after (see _optimistic); on by default on a GPU,
        #: where a layer computes faster than the host's round trip per layer
        self.optimistic = mx.default_device() == mx.gpu
        # A completion that takes `then` is the bridge's (or wraps it): queue work through the
        # bridge too, which never lets MLX's async_eval throttle block the loop.
        try:
            self._then_ok = "then" in inspect.signature(completed).parameters
        except (TypeError, ValueError):  # a callable without a signature
            self._then_ok = False
        self._schedule: Callable[..., Awaitable[None]] = _async_eval
        if self._then_ok:
            from ..bridge import schedule

            self._schedule = schedule

    # -- predictor plumbing ---------------------------------------------------------------------

    def route_ids(self, layer: int, x: mx.array, extra: int = 0) -> mx.array:
        """Layer ``layer``'s routed ids for MoE input ``x`` (lazy), via the block's own router.

        ``extra`` > 0 asks the router for that many more experts than it routes to (a wider
        prediction); blocks without a known top-k attribute give their usual k.
        """
        block, attr = self.moe[layer]
        where = top_k_attribute(block) if extra > 0 else None
        if where is None:
            return route(block, attr, x)[1]
        obj, name = where
        k = getattr(obj, name)
        setattr(obj, name, k + extra)  # read while the graph is built, restored right after
        try:
            return route(block, attr, x)[1]
        finally:
            setattr(obj, name, k)

    def first_norm(self, layer: int, embeddings: mx.array) -> mx.array:
        return decoder_layers(self.model)[layer].post_attention_layernorm(embeddings)

    def make_predictor(self, name: str) -> Predictor:
        check_predictor(name)
        if name == "lookahead":
            extra = self.lookahead_extra
            return LookaheadPredictor(lambda layer, x: self.route_ids(layer, x, extra), self.first_norm)
        if name == "temporal":
            return TemporalPredictor()
        return Predictor()

    # -- the forward --------------------------------------------------------------------------

    async def __call__(self, inputs: mx.array, cache: list[Any], source: ExpertSource, predictor: Predictor,
                       *, trace: RoutingTrace | None = None, logits: bool = True) -> mx.array:
        """Run ``inputs`` (1, L) through the model, updating ``cache``.

        Returns the logits (1, L, vocab), lazy, or with ``logits=False`` the final hidden state
        (already computed; used for prefill chunks, whose logits nobody reads).
        """
        if logits and self._optimistic_ok(inputs, cache, source):
            begun = await self._begin_whole(inputs, cache, source)
            return await self._finish_whole(begun, cache, source, predictor, trace=trace)
        model = self.model
        inner = model.model
        h = inner.embed_tokens(inputs)
        masks = self.arch.masks(model, h, cache)
        predicted: dict[int, Any] = {}
        step = trace.begin(predictor.name) if trace is not None else None
        # Leases of this forward's rows, released together once its output has been computed.
        leases: list[tuple[int, int]] = []

        #: many tokens at once (prefill): schedule the graph block by block, see below
        long_step = inputs.shape[-1] >= LONG_STEP_TOKENS
        p = predictor.first(self.first_moe, h)
        if p is not None:
            source.prefetch(self.first_moe, p)
            predicted[self.first_moe] = p
        try:
            h = await self._layers(0, h, masks, cache, source, predictor, step, predicted, leases, long_step)
        except BaseException:
            # Nothing reads these rows any more once the forward is abandoned.
            source.release_after(mx.array(0), leases)
            raise
        return await self._head(h, source, leases, logits)

    def _optimistic_ok(self, inputs: mx.array, cache: list[Any], source: ExpertSource) -> bool:
        """Whether this step may be queued whole (:meth:`_begin_whole`)."""
        return (self.optimistic and self.speculate and inputs.shape[-1] == 1
                and callable(getattr(source, "snapshot", None)) and callable(getattr(source, "unchanged", None))
                # Every cache must be able to take back this step's entry (a rotating cache
                # only before it wraps; one entry of margin).
                and all(c.is_trimmable() and (getattr(c, "max_size", None) is None or c.offset + 2 < c.max_size)
                        for c in cache))

    def _attend_and_route(self, i: int, h: mx.array, masks: list[Any], cache: list[Any],
                          source: ExpertSource) -> tuple["_Built | None", mx.array]:
        """Layer ``i`` built over ``h`` (lazy): its attention, then a dense block's output, or an MoE
        block's routing and, where a snapshot allows, its speculative outputs. Returns (None, the
        layer's output) for a dense layer, else (the MoE layer built so far, the hidden state after
        attention)."""
        layer = decoder_layers(self.model)[i]
        block = getattr(layer, self.arch.block_attr)
        h = h + layer.self_attn(layer.input_layernorm(h), masks[i], cache[i])
        xn = layer.post_attention_layernorm(h)
        if i not in self.moe:
            return None, h + block(xn)
        attr = self.moe[i][1]
        taken: list[RowSnapshot] = []
        # One call of the block routes and, when a snapshot allows, combines the speculative
        # outputs too (out_spec): its router is built and computed once.
        out_spec, x_sw, inds, y_spec = route_and_apply(
            block, attr, xn, functools.partial(self._gather_from_snapshot, source, i, taken))
        return _Built(i, h, xn, x_sw, inds, y_spec, out_spec, taken[0] if taken else None), h

    def _build_whole(self, h: mx.array, masks: list[Any], cache: list[Any], source: ExpertSource,
                     start: int) -> "_Whole":
        """Layers ``start``.. built at once over ``h``, every MoE layer gathering from its snapshot."""
        layers = decoder_layers(self.model)
        built: list[_Built] = []
        for i in range(start, len(layers)):
            b, h = self._attend_and_route(i, h, masks, cache, source)
            if b is not None:
                assert b.out_spec is not None and b.snap is not None, "decode steps always gather"
                built.append(b)
                h = b.h_attn + b.out_spec
        return _Whole(masks, built, self._logits(h))

    async def _begin_whole(self, inputs: mx.array, cache: list[Any], source: ExpertSource) -> "_Whole":
        """Queue a decode step whole (no host round trip per layer); :meth:`_finish_whole` checks it.

        Nothing is leased; the caches get this step's entry. Only for steps that pass
        :meth:`_optimistic_ok`.
        """
        h = self.model.model.embed_tokens(inputs)
        whole = self._build_whole(h, self.arch.masks(self.model, h, cache), cache, source, 0)
        await self._schedule(whole.out)
        return whole

    async def _finish_whole(self, whole: "_Whole", cache: list[Any], source: ExpertSource, predictor: Predictor,
                           *, trace: RoutingTrace | None = None) -> mx.array:
        """Check a step begun whole and redo it from its first unsound layer until it is sound.

        Returns the logits, computed. The layers are checked in order, as the per-layer path
        would. At the first layer with an unsound pair (an expert absent from its snapshot, or
        its row refilled since) the layers after it computed from a wrong hidden state: their caches are trimmed by this step's entry, the layer's unsound
        pairs are served again (demand reads, then recomputed), and the layers after it are
        queued whole again, from fresh snapshots, until a round checks sound to the end. Layers
        before the unsound one were computed from sound rows by the same ops, so the result is
        bitwise the per-layer one. The ids the wrong round routed after the unsound layer are
        prefetched for the next round: the hidden state differs only by that layer's unsound
        pairs, so they mostly route the same (they land beside the unsound layer's own reads, which
        the redo awaits).
        """
        step = trace.begin(predictor.name) if trace is not None else None
        leases: list[tuple[int, int]] = []  # released once, with the final output
        self.counters["optimistic"] += 1
        try:
            while True:
                await self.completed(whole.out)
                routed = [np.array(b.inds, copy=True) for b in whole.built]
                bad = None
                for n, b in enumerate(whole.built):
                    uniq = np.unique(routed[n]).astype(np.int64)
                    if not np.asarray(source.unchanged(b.layer, b.snap, uniq), dtype=bool).all():
                        bad = n
                        break
                    predictor.observe(b.layer, routed[n])
                    if step is not None:
                        step.record(b.layer, routed[n], None)
                    try:
                        await source.ensure(b.layer, uniq)  # all present: counts the hits for the policy
                    except CapacityError:
                        pass
                if bad is None:
                    self.counters["forwards"] += 1
                    source.release_after(whole.out, leases)
                    return whole.out
                self.counters["optimistic_redone"] += 1
                b = whole.built[bad]
                for later in range(bad + 1, len(whole.built)):  # what the next round will most likely route
                    source.prefetch(whole.built[later].layer, np.unique(routed[later]))
                for c in cache[b.layer + 1:]:
                    c.trim(1)
                predictor.observe(b.layer, routed[bad])
                if step is not None:
                    step.record(b.layer, routed[bad], None)
                block, attr = self.moe[b.layer]
                y = await self._serve_speculated(b.layer, source, b.x_sw, routed[bad], b.y_spec, b.snap, leases)
                h = b.h_attn + (b.out_spec if y is b.y_spec else combine(block, attr, b.xn, y))
                whole = self._build_whole(h, whole.masks, cache, source, b.layer + 1)
                await self._schedule(whole.out)
        except BaseException:
            source.release_after(mx.array(0), leases)
            raise

    async def _head(self, h: mx.array, source: ExpertSource, leases: list[tuple[int, int]],
                    logits: bool) -> mx.array:
        """The forward's end: the logits (lazy), or the computed final hidden state."""
        self.counters["forwards"] += 1
        if not logits:
            source.release_after(h, leases)
            await self.completed(h)
            return h
        out = self._logits(h)
        source.release_after(out, leases)
        return out

    def _logits(self, h: mx.array) -> mx.array:
        """The model's final norm and output head over the last hidden state (lazy)."""
        model = self.model
        h = model.model.norm(h)
        return model.lm_head(h) if "lm_head" in model else model.model.embed_tokens.as_linear(h)

    async def _layers(self, start: int, h: mx.array, masks: list[Any], cache: list[Any], source: ExpertSource,
                      predictor: Predictor, step: Any, predicted: dict[int, Any],
                      leases: list[tuple[int, int]], long_step: bool) -> mx.array:
        """Decoder layers ``start``.. over hidden state ``h``, one MoE layer at a time: each awaits its
        routed ids, then serves its experts. Returns the last layer's output (lazy)."""
        for i in range(start, len(decoder_layers(self.model))):
            b, h = self._attend_and_route(i, h, masks, cache, source)
            if long_step:
                await self.completed(h)  # see the await after the MoE output below
            if b is None:
                continue
            block, attr = self.moe[i]
            xn, x_sw, inds, y_spec, out_spec, snap = b.xn, b.x_sw, b.inds, b.y_spec, b.out_spec, b.snap
            nxt = self.next_moe[i]
            p = predictor.next(nxt, xn) if nxt is not None else None
            if isinstance(p, mx.array):
                # Schedule the prediction before the routed ids: the stream computes it first, so
                # once the ids are in, the prediction is too and its prefetch needs no completion
                # signal of its own (one signal per layer, not two). Both in one call: on a GPU
                # each scheduling call commits a command buffer.
                await self._schedule(p, inds)
            if snap is not None:
                assert out_spec is not None and y_spec is not None
                await self._completed_then(inds, out_spec)
            else:
                await self.completed(inds)
            if p is not None:
                if isinstance(p, mx.array) and _native.is_available(p):
                    p = np.array(p, copy=True)
                source.prefetch(nxt, p)
                predicted[nxt] = p
            inds_np = np.array(inds, copy=True)
            predictor.observe(i, inds_np)
            if step is not None:
                pred = predicted.get(i)
                if isinstance(pred, mx.array):
                    await self.completed(pred)
                step.record(i, inds_np, None if pred is None else np.asarray(pred))
            if snap is not None:
                assert y_spec is not None
                y = await self._serve_speculated(i, source, x_sw, inds_np, y_spec, snap, leases)
                # Every pair sound: the block output built with the speculative outputs stands.
                h = h + (out_spec if y is y_spec else combine(block, attr, xn, y))
            else:
                y = await self._serve(i, source, x_sw, inds_np, leases)
                h = h + combine(block, attr, xn, y)
            if long_step:
                # A prefill chunk: let the stream finish each block before scheduling the next.
                # The bridge queues graphs in groups of nodes under MLX's eval throttle, but a
                # long prefill's nodes can each be many dispatches, so a group on top of a
                # queued layer could still cross it and hold the loop (up to 125 ms measured
                # on the embedded model without these awaits, 19-44 ms with them, same TTFT).
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
        block, attr = self.moe[layer]
        return pooled_switch_apply(self.specs[layer], getattr(block, attr).activation, x_sw,
                                   mx.take(snap.rows, inds), source.pools(layer))

    def _snapshot(self, source: ExpertSource, layer: int, inds: mx.array) -> RowSnapshot | None:
        """The layer's row snapshot when this step can gather speculatively, else None."""
        if not self.speculate or inds.size >= SORT_THRESHOLD:
            # Many pairs take the sorted path, whose order is decided on the host.
            return None
        take = getattr(source, "snapshot", None)  # SpeculativeSource; None opts a source out
        if take is None or not callable(getattr(source, "unchanged", None)):
            return None
        return take(layer)

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

    async def _serve_speculated(self, layer: int, source: Any, x_sw: mx.array, inds: np.ndarray,
                                y_spec: mx.array, snap: RowSnapshot, leases: list[tuple[int, int]]) -> mx.array:
        """Keep the speculative outputs of pairs whose rows were sound; recompute the others.

        Sound: the expert was in its snapshot row and the row was not refilled since, so whatever
        the stream read from it was that expert's bytes. Those rows are leased at once, before any
        await. The other experts are ensured, leased, and only their pairs recomputed; each pair's
        product is independent of the others, so the merged output is bitwise the unsorted gather.
        """
        uniq = np.unique(inds).astype(np.int64)
        sound = np.asarray(source.unchanged(layer, snap, uniq), dtype=bool)
        self.counters["speculated"] += 1
        held: list[tuple[int, int]] = []
        if sound.any():
            held.append((layer, source.lease(layer, uniq[sound])))
        if sound.all():
            leases.extend(held)
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
            # can reuse them (keeping them leased to the end of the forward could block forever).
            source.release_after(y_spec, held)
            return await self._serve(layer, source, x_sw, inds, leases)
        except BaseException:
            source.release_after(y_spec, held)
            raise
        leases.extend(held)
        leases.append((layer, source.lease(layer, redo)))
        table = _checked_table(source, layer, redo)
        flat = inds.reshape(-1)
        pos = np.flatnonzero(np.isin(flat, redo))
        block, attr = self.moe[layer]
        y_new = pooled_switch_unsorted_pairs(self.specs[layer], getattr(block, attr).activation, x_sw,
                                             pos // inds.shape[-1], table[flat[pos]], source.pools(layer))
        # Pair j of the result: y_spec's own, or the recomputed one where its expert was unsound.
        n = flat.size
        pick = np.arange(n)
        pick[pos] = n + np.arange(pos.size)
        out_shape = y_spec.shape
        both = mx.concatenate([y_spec.reshape(n, -1), y_new], axis=0)
        return both[mx.array(pick)].reshape(out_shape)

    async def _serve(self, layer: int, source: ExpertSource, x_sw: mx.array, inds: np.ndarray,
                     leases: list[tuple[int, int]]) -> mx.array:
        """Expert outputs of one MoE layer, every pair served from a leased, present row."""
        block, attr = self.moe[layer]
        spec = self.specs[layer]
        activation = getattr(block, attr).activation
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
                table = _checked_table(source, layer, ids)
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
                # Released with the whole forward's output (one completion per forward, not one per
                # layer); the rows stay pinned until the token's logits have been computed.
                leases.append((layer, lease_id))
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


def _greedy(logits: mx.array) -> mx.array:
    """The greedy token of the last position (lazy), as mlx-lm's generate_step computes it."""
    logits = logits[:, -1, :]
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    return mx.argmax(logprobs, axis=-1)


class StreamingModel:
    """An mlx-lm MoE model whose experts come from an ExpertSource; greedy async generation.

    ``model`` is the mlx-lm module with every switch layer replaced by a PooledSwitch (no expert
    weights). Concurrent :meth:`generate` calls are safe: each decode step (and each prefill
    chunk) runs under one fair lock, so requests interleave token by token.
    """

    def __init__(self, model: nn.Module, *, arch: Arch, moe: dict[int, tuple[nn.Module, str]],
                 specs: dict[int, SwitchSpec], tokenizer: Any, config: dict[str, Any], model_id: str,
                 store: Any = None, completed: Completed | None = None,
                 prefill_step_size: int = PREFILL_STEP_SIZE) -> None:
        self.model = model
        self.arch = arch
        self.tokenizer = tokenizer
        self.config = config
        self.model_id = model_id
        self.store = store
        self.prefill_step_size = prefill_step_size
        self._completed = completed
        self._forward: AsyncForward | None = None
        self._moe = moe
        self._specs = specs
        self._lock: tuple[object, anyio.Lock] | None = None

    @property
    def moe_layers(self) -> list[int]:
        """Decoder layer indices that route experts (the store's layer indices)."""
        return sorted(self._moe)

    @property
    def forward(self) -> AsyncForward:
        if self._forward is None:
            completed = self._completed or default_completed()
            self._forward = AsyncForward(self.model, self.arch, self._moe, self._specs, completed)
        return self._forward

    def make_cache(self) -> list[Any]:
        return make_prompt_cache(self.model)

    def resident_source(self) -> Any:
        """All-resident baseline source: every expert of the store read into pools."""
        from .source import ResidentSource

        if self.store is None:
            raise AsyncsideError("this StreamingModel has no expert store to read the experts from")
        return ResidentSource.from_store(self.store)

    def _step_lock(self) -> anyio.Lock:
        """The fair per-step lock of the current event loop (a new loop gets a new lock)."""
        token = anyio.lowlevel.current_token()
        if self._lock is None or self._lock[0] != token:
            self._lock = (token, anyio.Lock())
        return self._lock[1]

    async def generate(self, prompt_ids: Sequence[int], *, max_tokens: int, source: ExpertSource,
                       predictor: str = "lookahead", trace: RoutingTrace | None = None,
                       stop_at_eos: bool = True) -> AsyncIterator[int]:
        """Greedy generation; yields token ids (an EOS token ends the stream and is not yielded).

        Mirrors mlx-lm's ``generate_step`` (prefill ``prompt[:-1]`` in chunks of
        ``prefill_step_size``, then the last prompt token, then one token per step; argmax of
        log-probabilities), so tokens equal :func:`reference_generate` on the full model.
        """
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise ValueError("prompt_ids is empty: generation needs at least one prompt token")
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        check_predictor(predictor)
        fwd = self.forward
        pred = fwd.make_predictor(predictor)
        lock = self._step_lock()
        eos = set(getattr(self.tokenizer, "eos_token_ids", ()) or ()) if stop_at_eos else set()
        cache = self.make_cache()
        prompt = mx.array(ids)
        while prompt.size > 1:
            n = min(self.prefill_step_size, prompt.size - 1)
            async with lock:
                await fwd(prompt[:n][None], cache, source, pred, trace=trace, logits=False)
            prompt = prompt[n:]
        inputs = prompt
        for _ in range(max_tokens):
            async with lock:
                # A step queued whole (the GPU default) is not run ahead on the previous step's
                # lazy token: a dropped step would hold the stream in front of the redo rounds
                # (measured on the H200: 1.17x instead of 1.52x over per-layer steps at 50%).
                y = _greedy(await fwd(inputs[None], cache, source, pred, trace=trace))
                await fwd.completed(y)
            tok = int(y.item())
            if tok in eos:
                return
            yield tok
            inputs = mx.array([tok])
