"""The plain synchronous slot-cache baseline of ``asyncside bench generate``.

Written the simple way, as one would write it without asyncside: per MoE layer,
S slots (rows of pool arrays, one array per segment of the store's records) with LRU
replacement, and a synchronous model forward that, at every MoE block,

1. evaluates the routed expert ids (``mx.eval``: the graph up to the router is computed);
2. reads each missing expert's record from the store's blob straight into a free or least
   recently used slot's rows, on the calling thread (``os.preadv`` into the pools' memoryviews;
   with ``direct=True`` an ``O_DIRECT`` read of the whole record into an aligned buffer, then a
   copy per segment);
3. gathers the experts' outputs from the slots (:func:`asyncside.models.pooled.pooled_switch_apply`
   over the pools, with the slot rows) inside the block's own ``__call__``, so routing, score
   normalisation and shared experts are mlx-lm's.

No prefetch, no threads, no event loop, no step queued ahead. S is the number of rows asyncside's
:class:`~asyncside.Runtime` has per layer at the same residency (:func:`asyncside.runtime.plan_layer`:
resident plus side rows); the slots start holding what the runtime's rows start with: its
resident set, and its side rows' warm set (the store's next hottest experts, where the store
ranks them). On MLX CUDA the pools live on the device (:class:`PoolSet`): records
land in the pinned host mirror and are uploaded before the gather.

When one step routes more distinct experts to a layer than it has slots (a prefill), the layer
is served in groups of at most S experts, each group computed (and evaluated) before the next
one's reads reuse the slots; every pair of an expert lies in one group, so outputs stay bitwise
mlx-lm's (the same pair-subset gathers as the async forward's capacity splits).

Tokens equal mlx-lm's ``generate_step`` (greedy): same prefill chunks, same ops.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from ..errors import FillError
from ..models.arch import moe_layers
from ..models.forcing import cache_position
from ..models.pooled import (
    SORT_THRESHOLD,
    SwitchSpec,
    pooled_switch_apply,
    pooled_switch_pairs,
    pooled_switch_unsorted_pairs,
    route_and_apply,
)
from ..models.walk import DecoderWalk
from ..pools import PoolSet
from ..readers import DIRECT_ALIGN
from ..store import ExpertStore, LayerSpec

__all__ = ["SlotCache", "slot_forward", "slot_generate", "PREFILL_STEP_SIZE"]

#: mlx-lm's generate_step default prefill chunk
PREFILL_STEP_SIZE = 2048


@dataclass(eq=False)
class _Layer:
    """One MoE layer's slots: pools, which expert each slot holds, when it was last used."""

    spec: LayerSpec
    pools: PoolSet
    fd: int
    slot_of: np.ndarray  # expert -> slot, -1 when absent
    expert_at: np.ndarray  # slot -> expert, -1 when empty
    last_use: np.ndarray  # slot -> tick of its last use (-1: never)
    #: per slot, the iovecs of one record read straight into its rows (gaps read into a scratch)
    iovecs: list[list[memoryview]] = field(default_factory=list)
    read_bytes: int = 0  # bytes one buffered read transfers (the record up to its last segment)
    misses: int = 0

    @property
    def slots(self) -> int:
        return int(self.expert_at.size)


class SlotCache:
    """Per MoE layer of ``store``: slots with LRU replacement, filled synchronously on demand.

    ``resident`` sizes the slots like :class:`asyncside.Runtime` (a fraction of each layer's
    experts, or explicit resident sets; ``side_rows`` as the runtime takes it). The slots start
    as the runtime's rows do: the resident set, and with ``warm`` the other slots holding the
    store's next hottest experts (:func:`asyncside.runtime.warm_experts`). Counters
    (:meth:`stats`): per layer visit, each distinct routed expert is a hit or a miss; reads and
    bytes are those of the misses (the initial resident set is counted apart, ``preload_*``).
    Close it (or use it as a context manager) to close the blob files.
    """

    def __init__(self, store: ExpertStore, resident: float | Mapping[int, Sequence[int]] = 0.25, *,
                 side_rows: int | None = None, direct: bool = False, warm: bool = True) -> None:
        from ..runtime import plan_layer, warm_experts

        self.store = store
        self.direct = bool(direct)
        self.layers: dict[int, _Layer] = {}
        self._tick = 0
        self.counts: dict[str, float] = {"hits": 0, "misses": 0, "reads": 0, "bytes_read": 0,
                                         "read_time_s": 0.0, "evictions": 0, "layer_visits": 0,
                                         "groups": 0, "preload_reads": 0, "preload_bytes": 0}
        stride = max(s.stride for s in store.layers.values())
        # The scratch that segment gaps are read into (buffered), or the aligned record buffer of
        # O_DIRECT reads (mmap memory is page-aligned).
        # An O_DIRECT read covers the record from the block at or below its offset to the block
        # boundary past its end: a store of a smaller alignment has records that start mid-block.
        self._buf = mmap.mmap(-1, max(stride + (2 * DIRECT_ALIGN if self.direct else 0), mmap.PAGESIZE))
        try:
            for index, spec in store.layers.items():
                chosen, side = (plan_layer(store, index, 0.0, side_rows, pinned=resident)
                                if isinstance(resident, Mapping) else plan_layer(store, index, resident, side_rows))
                n = len(chosen) + side
                if n < 1:
                    raise ValueError(f"layer {index}: a slot cache needs at least one slot (resident {resident!r})")
                flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if self.direct else 0)
                if self.direct and not getattr(os, "O_DIRECT", 0):
                    raise OSError(f"{spec.path}: O_DIRECT is not available on this platform")
                pools = PoolSet(spec, n)
                layer = _Layer(spec, pools, -1, np.full(spec.n_experts, -1, np.int64),
                               np.full(n, -1, np.int64), np.full(n, -1, np.int64))
                self.layers[index] = layer
                layer.fd = os.open(spec.path, flags)
                self._plan_iovecs(layer)
                # As the runtime starts: its resident set, then its dynamic rows warmed with the
                # store's next hottest experts (a cold start here was a handicap of the baseline's).
                start = list(chosen) + (warm_experts(store, index, side, exclude=chosen) if warm else [])
                for slot, expert in enumerate(start):
                    self._read(layer, int(expert), slot)
                    layer.slot_of[expert] = slot
                    layer.expert_at[slot] = expert
                    self.counts["preload_reads"] += 1
                    self.counts["preload_bytes"] += self._bytes_per_read(layer)
                if start and pools.device:
                    mx.eval(pools.upload(range(len(start))))
        except BaseException:
            self.close()
            raise
        # Preload reads are not demand reads: start the demand counters at zero.
        self.counts["reads"] = 0
        self.counts["bytes_read"] = 0
        self.counts["read_time_s"] = 0.0

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the blob files and drop the row views (idempotent)."""
        for layer in self.layers.values():
            for views in layer.iovecs:
                for v in views:
                    v.release()
            layer.iovecs = []
            if layer.fd >= 0:
                os.close(layer.fd)
                layer.fd = -1
        if not self._buf.closed:
            self._buf.close()

    def __enter__(self) -> SlotCache:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- reads ----------------------------------------------------------------------------------

    def _plan_iovecs(self, layer: _Layer) -> None:
        """Per slot: the record's segments in file order, each a view of the slot's row of its
        pool, the gaps between them views of the scratch buffer (read and discarded)."""
        segs = sorted(layer.spec.segments, key=lambda s: s.offset)
        scratch = memoryview(self._buf)
        for slot in range(layer.slots):
            views: list[memoryview] = []
            pos = 0
            for seg in segs:
                if seg.offset > pos:
                    views.append(scratch[: seg.offset - pos])
                views.append(layer.pools.row_view(seg.key, slot))
                pos = seg.end
            layer.iovecs.append(views)
            layer.read_bytes = pos
        scratch.release()

    def _bytes_per_read(self, layer: _Layer) -> int:
        return layer.spec.stride if self.direct else layer.read_bytes

    def _read(self, layer: _Layer, expert: int, slot: int) -> None:
        """Read ``expert``'s record into ``slot``'s rows, on the calling thread."""
        spec = layer.spec
        t0 = time.perf_counter()
        offset = expert * spec.stride
        if self.direct:
            # O_DIRECT needs an aligned buffer, offset and length: the blocks that hold the whole
            # record (the record itself in a store of the default alignment), then one copy per segment.
            start = offset // DIRECT_ALIGN * DIRECT_ALIGN
            end = offset + spec.stride
            view = memoryview(self._buf)[: -(-end // DIRECT_ALIGN) * DIRECT_ALIGN - start]
            try:
                got = os.preadv(layer.fd, [view], start)
                # The blob may end short of the last block boundary, never before the record's end.
                if got < end - start:
                    raise FillError(spec.index, expert, slot,
                                    f"short read: {got} of {view.nbytes} bytes at offset {start} of {spec.path}")
                skip = offset - start
                for seg in spec.segments:
                    layer.pools.row_view(seg.key, slot)[:] = view[skip + seg.offset: skip + seg.end]
            finally:
                view.release()
            nbytes = got
        else:
            nbytes = layer.read_bytes
            got = os.preadv(layer.fd, layer.iovecs[slot], offset)
            if got != nbytes:
                raise FillError(spec.index, expert, slot,
                                f"short read: {got} of {nbytes} bytes at offset {offset} of {spec.path}")
        self.counts["read_time_s"] += time.perf_counter() - t0
        self.counts["reads"] += 1
        self.counts["bytes_read"] += nbytes

    # -- slots ----------------------------------------------------------------------------------

    def ensure(self, index: int, experts: np.ndarray) -> np.ndarray:
        """Make every expert of ``experts`` (distinct ids, at most the layer's slots) present;
        returns the layer's expert -> slot table (read-only use).

        Misses go to empty slots first, then to the least recently used slots that hold none of
        ``experts``.
        """
        layer = self.layers[index]
        experts = np.asarray(experts, dtype=np.int64)
        if experts.size > layer.slots:
            raise ValueError(f"layer {index}: {experts.size} experts at once, the layer has {layer.slots} slots")
        self._tick += 1
        self.counts["layer_visits"] += 1
        slots = layer.slot_of[experts]
        missing = experts[slots < 0]
        self.counts["hits"] += int(experts.size - missing.size)
        self.counts["misses"] += int(missing.size)
        layer.misses += int(missing.size)
        if missing.size:
            free = np.ones(layer.slots, dtype=bool)
            free[slots[slots >= 0]] = False
            candidates = np.flatnonzero(free)
            victims = candidates[np.argsort(layer.last_use[candidates], kind="stable")[: missing.size]]
            for expert, slot in zip(missing.tolist(), victims.tolist()):
                old = int(layer.expert_at[slot])
                if old >= 0:
                    layer.slot_of[old] = -1
                    self.counts["evictions"] += 1
                layer.expert_at[slot] = -1  # its bytes are being replaced: nobody's until the read ends
                self._read(layer, expert, slot)
                layer.expert_at[slot] = expert
                layer.slot_of[expert] = slot
            if layer.pools.device:
                mx.eval(layer.pools.upload(victims.tolist()))
        layer.last_use[layer.slot_of[experts]] = self._tick
        return layer.slot_of

    def gather(self, index: int, spec: SwitchSpec, activation: nn.Module, x: mx.array,
               inds: mx.array) -> mx.array:
        """The switch layer's output for input ``x`` and routed ids ``inds``, from the slots.

        Evaluates ``inds`` (and so the graph up to the router), reads the misses, then builds the
        gather (lazy). More distinct experts than slots: served in groups, each evaluated before
        the next group's reads.
        """
        mx.eval(inds)
        ids = np.array(inds, copy=True).astype(np.int64)
        uniq = np.unique(ids)
        layer = self.layers[index]
        pools = layer.pools.arrays
        if uniq.size <= layer.slots:
            table = self.ensure(index, uniq)
            return pooled_switch_apply(spec, activation, x, table[ids], pools)
        k = ids.shape[-1]
        flat = ids.reshape(-1)
        parts: list[mx.array] = []
        positions: list[np.ndarray] = []
        for start in range(0, uniq.size, layer.slots):
            group = uniq[start: start + layer.slots]
            table = self.ensure(index, group)
            pos = np.flatnonzero(np.isin(flat, group))
            rows = table[flat[pos]]
            if ids.size >= SORT_THRESHOLD:
                # The sorted path: rows in ascending order (stable), as pooled_switch_apply sorts them.
                order = np.argsort(rows, kind="stable")
                pos, rows = pos[order], rows[order]
                part = pooled_switch_pairs(spec, activation, x, pos // k, rows, pools)
                part = part.reshape(pos.size, -1)
            else:
                part = pooled_switch_unsorted_pairs(spec, activation, x, pos // k, rows, pools)
            mx.eval(part)  # the next group's reads may reuse these slots
            self.counts["groups"] += 1
            parts.append(part)
            positions.append(pos)
        where = np.concatenate(positions)
        inv = np.empty_like(where)
        inv[where] = np.arange(where.size)
        y = mx.concatenate(parts, axis=0)[mx.array(inv)]
        return y.reshape(*ids.shape, -1)

    # -- figures --------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters since construction (demand reads only), hit rate, the reader used."""
        out: dict[str, Any] = dict(self.counts)
        total = out["hits"] + out["misses"]
        out["hit_rate"] = out["hits"] / total if total else 1.0
        out["stall_time_s"] = out["read_time_s"]  # every read blocks the caller
        out["slots"] = {index: layer.slots for index, layer in self.layers.items()}
        out["misses_per_layer"] = {index: layer.misses for index, layer in self.layers.items()}
        out["reader"] = ("sync pread+memcpy (O_DIRECT)" if self.direct else "sync preadv into slots")
        return out

    def holds(self, index: int) -> dict[int, int]:
        """expert -> slot of every expert present in layer ``index``."""
        layer = self.layers[index]
        return {int(e): int(s) for s, e in enumerate(layer.expert_at.tolist()) if e >= 0}


# ---------------------------------------------------------------------------------------------
# The synchronous forward and greedy generation


def slot_forward(model: nn.Module, arch: Any, cache_: SlotCache, inputs: mx.array, kv_cache: list[Any], *,
                 logits: bool = True, moe: Mapping[int, tuple[nn.Module, str]] | None = None,
                 routing: Any = None) -> mx.array:
    """One forward of ``inputs`` (1, L) through a model whose switch layers are PooledSwitch modules,
    every MoE block's experts served by ``cache_``; updates ``kv_cache``.

    Walks the model as mlx-lm's ``__call__`` does (embedding; per decoder layer attention, then its
    MLP or MoE block; final norm; head). Returns the logits (1, L, vocab), lazy. With
    ``logits=False`` (a prefill chunk, whose logits nobody reads) it stops after the last layer's
    attention, the last point the KV caches need, and returns that hidden state, lazy. ``moe``
    (``asyncside.models.arch.moe_layers`` of the model) saves looking the MoE blocks up per call.
    ``routing``: a routing replay (``asyncside.models.forcing.RoutingReplay``) forcing every MoE
    layer's ids, as asyncside's forward does.
    """
    position = cache_position(kv_cache) if routing is not None else 0
    if moe is None:
        moe = moe_layers(model, arch)
    # The walk asyncside's forward takes: each architecture's embedding, attention call, masks,
    # multipliers and head (specs are read by the streaming steps only).
    walk = DecoderWalk(model, arch, dict(moe), {})
    h = walk.embed(inputs)
    masks = walk.masks(h, kv_cache)
    last = len(walk.layers) - 1
    for i in range(len(walk.layers)):
        h_attn, xn = walk.attend(i, h, masks, kv_cache)
        if not logits and i == last:
            return h_attn
        if i not in walk.moe:
            h = h_attn + walk.block(i)(xn)
            continue
        block, attr = walk.moe[i]
        switch = getattr(block, attr)

        def apply(x_sw: mx.array, inds: mx.array, i: int = i, switch: Any = switch) -> mx.array:
            return cache_.gather(i, switch.spec, switch.activation, x_sw, inds)

        forced = None if routing is None else routing.step_ids(i, position, xn.shape[:-1])
        out, _x, _inds, _y = route_and_apply(block, attr, xn, apply, forced)
        assert out is not None
        h = h_attn + out
    return walk.logits(h)


def slot_generate(sm: Any, cache_: SlotCache, prompt_ids: Sequence[int], *, max_tokens: int,
                  eos_token_ids: set[int] | None = None,
                  prefill_step_size: int = PREFILL_STEP_SIZE) -> Iterator[int]:
    """Greedy tokens of a :class:`asyncside.models.StreamingModel`'s model over ``cache_``, synchronously.

    Mirrors mlx-lm's ``generate_step``: ``prompt[:-1]`` prefilled in chunks of
    ``prefill_step_size`` (KV caches evaluated after each), then the last prompt token, then one
    token per step, the argmax of the log-probabilities. Stops before an EOS token.
    """
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise ValueError("prompt_ids is empty: generation needs at least one prompt token")
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    eos = eos_token_ids or set()
    model, arch = sm.model, sm.arch
    routing = getattr(sm, "routing", None)  # the model's routing replay, forced here too
    moe = moe_layers(model, arch)
    kv = make_prompt_cache(model)
    prompt = mx.array(ids)
    while prompt.size > 1:
        n = min(prefill_step_size, prompt.size - 1)
        slot_forward(model, arch, cache_, prompt[:n][None], kv, logits=False, moe=moe, routing=routing)
        mx.eval([c.state for c in kv])
        prompt = prompt[n:]
    inputs = prompt
    for _ in range(max_tokens):
        out = slot_forward(model, arch, cache_, inputs[None], kv, moe=moe, routing=routing)[:, -1, :]
        y = mx.argmax(out - mx.logsumexp(out, keepdims=True), axis=-1)
        tok = int(y.item())  # type: ignore[arg-type]  # an argmax: always an int
        if tok in eos:
            return
        yield tok
        inputs = mx.array([tok])
