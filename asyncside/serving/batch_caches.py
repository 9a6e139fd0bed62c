"""The KV caches of requests decoding together: mlx-lm's batch caches kept merged across steps
(:class:`BatchCaches`), the rows of a joint prefill's cache, and :func:`rows_step` for caches
without a batched form. No request bookkeeping here: that is the engine loop's (:mod:`.engine`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, cast

from .loading import ServedModel

log = logging.getLogger("asyncside.serving")


def fresh_cache(slot: Any) -> bool:
    """Whether a request's cache is fresh mlx-lm ``KVCache`` layers (nothing fed: no cached
    prefix), the caches a joint prefill can take rows of."""
    from mlx_lm.models.cache import KVCache

    cache = slot.cache
    return bool(cache) and not slot.fed and all(type(c) is KVCache and c.keys is None for c in cache)


def row_cache(c: Any, row: int, start: int, stop: int) -> Any:
    """Positions ``[start, stop)`` of row ``row`` of a batch layer cache (a joint prefill's
    ``KVCache`` of B rows, or a ``BatchKVCache``), copied into a ``KVCache`` of its own; an
    empty one if nothing was fed to that layer yet."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    one = KVCache()
    if c.keys is None:
        return one
    one.keys = mx.contiguous(c.keys[row:row + 1, :, start:stop])
    one.values = mx.contiguous(c.values[row:row + 1, :, start:stop])
    one.offset = stop - start
    return one


def mergeable(cache: list[Any]) -> bool:
    """Whether a request's KV cache has a batched form: every layer's cache can ``merge`` (mlx-lm's
    batch caches), or is llama4's ``ChunkedKVCache``, which merges into asyncside's
    :class:`~asyncside.models.chunked_batch.BatchChunkedKVCache`."""
    from mlx_lm.models.cache import ChunkedKVCache

    return all(hasattr(c, "merge") or isinstance(c, ChunkedKVCache) for c in cache)


def merge_layer(caches: Sequence[Any]) -> Any:
    """One layer's caches of several requests merged into its batch cache (rows in order)."""
    from mlx_lm.models.cache import ChunkedKVCache

    from ..models.chunked_batch import BatchChunkedKVCache

    if isinstance(caches[0], ChunkedKVCache):
        return BatchChunkedKVCache.merge(caches)
    return caches[0].merge(caches)


def unbatched_note(model: ServedModel) -> str | None:
    """Why ``model``'s requests decoding together run one after the other within each step: its KV
    caches have no batched form (:func:`mergeable`); the tokens are exactly each one's alone
    (:func:`rows_step`). None where they merge, or for a model without ``make_cache`` (a pipeline
    of ranks keeps no caches here)."""
    make = getattr(model, "make_cache", None)
    cache = make() if make is not None else []
    if not cache or mergeable(cache):
        return None
    kinds = ", ".join(sorted({type(c).__name__ for c in cache if not mergeable([c])}))
    name = (getattr(model, "config", None) or {}).get("model_type") or getattr(model, "model_id", "the model")
    return (f"{name}: its KV caches ({kinds}) have no batched form: requests decoding together run one "
            "after the other within each step (exact tokens, one forward per request)")


def announce_unbatched(model: ServedModel) -> bool:
    """Whether ``model``'s KV caches lack mlx-lm's batched form (:func:`unbatched_note`), logged
    once per engine (the engine calls it when it starts)."""
    note = unbatched_note(model)
    if note is not None:
        log.info("%s", note)
    return note is not None


async def rows_step(sm: ServedModel, tokens: Any, caches: Sequence[list[Any]], source: Any,
                    predictors: Sequence[Any], sample: Callable[[Any], Any],
                    routings: Sequence[Any] | None = None) -> Any:
    """One decode step of ``B`` requests, each through its own KV cache ``caches[i]``, one after the
    other (a batch of one: the single-stream step itself; caches without a batched form).

    ``tokens`` (B, 1); ``sample`` builds, from the last position's logits (B, vocab), what the
    caller reads (lazy). Returns it, computed: one completion for the last row's forward and the
    sampling together. ``routings``: each row's routing replay (a one-row
    :class:`~asyncside.models.forcing.RowsReplay`), or None.
    """
    import mlx.core as mx

    fwd = sm.forward
    rows = []
    n = tokens.shape[0]
    for i in range(n):
        ctx = fwd.context(caches[i], source, predictors[i])
        if routings is not None:
            ctx.routing, ctx.position = routings[i], 0
        last = (await fwd.step(ctx, tokens[i:i + 1]))[:, -1, :]
        rows.append(last)
        if i < n - 1:
            await fwd.finish(ctx, last)
    y = sample(rows[0] if n == 1 else mx.concatenate(rows, axis=0))
    await fwd.finish(ctx, y)
    return y


class BatchCaches:
    """The KV caches of the requests decoding together, merged into mlx-lm's batch caches
    (left-padded, with the masks mlx-lm's own batched generation uses) and kept merged across
    steps, as mlx-lm's ``BatchGenerator`` keeps them.

    Merging every request's cache at every step and extracting them back after costs host time
    that grows with the batch, on the order of a whole decode step on a GPU (BENCHMARKS.md,
    "Measurements behind code choices"). Kept merged, a step pays nothing for its caches: a
    request that joins is merged in once (:meth:`join`), one that leaves is dropped (:meth:`drop`), and its own cache is
    extracted (:meth:`extract`) only when something still needs it (the prefix cache).

    mlx-lm's ``BatchKVCache.filter`` and ``extract`` read the left padding back to the host
    (``tolist``), which waits for every step queued on the stream: with a step in flight that
    would block the event loop for the rest of that step. For ``BatchKVCache`` layers (every
    plain attention cache) the padding is therefore mirrored here on the host and ``drop`` /
    ``extract`` do the same work without reading the device (:attr:`tracked`); the results are
    mlx-lm's bit for bit (tests).
    """

    def __init__(self) -> None:
        self.layers: list[Any] | None = None  # one mlx-lm batch cache per layer
        self.size = 0
        # Per layer, each row's left padding as mlx-lm's cache holds it (BatchKVCache layers).
        self._pads: list[list[int]] = []

    @property
    def tracked(self) -> bool:
        """Whether rows can be dropped and extracted without reading the device (every layer is a
        ``BatchKVCache``, whose padding is mirrored here, or a ``BatchChunkedKVCache``, which keeps
        its own on the host), so with a step still in flight."""
        from mlx_lm.models.cache import BatchKVCache

        from ..models.chunked_batch import BatchChunkedKVCache

        return self.layers is None or all(type(c) in (BatchKVCache, BatchChunkedKVCache) for c in self.layers)

    def join(self, caches: Sequence[list[Any]]) -> None:
        """Merge requests' caches in as the last rows, in order."""
        if not caches:
            return
        new = [merge_layer([c[i] for c in caches]) for i in range(len(caches[0]))]
        # A fresh merge's padding is a constant array: reading it costs nothing.
        new_pads = [self._host_pads(c) for c in new]
        if self.layers is None:
            self.layers, self._pads = new, new_pads
        else:
            pads = []
            for mine, theirs, p_mine, p_theirs in zip(self.layers, new, self._pads, new_pads):
                idx_mine, idx_theirs = getattr(mine, "_idx", 0), getattr(theirs, "_idx", 0)
                mine.extend(theirs)
                # BatchKVCache.extend right-justifies both at the longer one's index.
                top = max(idx_mine, idx_theirs)
                pads.append([p + top - idx_mine for p in p_mine] + [p + top - idx_theirs for p in p_theirs])
            self._pads = pads
        self.size += len(caches)

    @staticmethod
    def _host_pads(c: Any) -> list[int]:
        from mlx_lm.models.cache import BatchKVCache

        if type(c) is not BatchKVCache:
            return []
        return [int(x) for x in cast(list[int], c.left_padding.tolist())]

    def drop(self, rows: Sequence[int]) -> None:
        """Keep only the other rows (in their order)."""
        import mlx.core as mx
        from mlx_lm.models.cache import BatchKVCache

        gone = set(rows)
        keep = [i for i in range(self.size) if i not in gone]
        if not keep:
            self.layers, self.size, self._pads = None, 0, []
            return
        assert self.layers is not None
        index = mx.array(keep)
        for n, c in enumerate(self.layers):
            if type(c) is not BatchKVCache:
                c.filter(keep)
                continue
            # BatchKVCache.filter, with the padding taken from the host mirror.
            if c.keys is not None:
                c.keys, c.values = c.keys[index], c.values[index]
            c.offset = c.offset[index]
            pads = [self._pads[n][i] for i in keep]
            shift = min(pads)
            if shift > 0:
                if c.keys is not None:
                    c.keys, c.values = c.keys[..., shift:, :], c.values[..., shift:, :]
                c._idx -= shift
                pads = [p - shift for p in pads]
            c.left_padding = mx.array(pads)
            self._pads[n] = pads
        self.size = len(keep)

    def extract(self, row: int) -> list[Any]:
        """Row ``row``'s own cache (a copy; the batch keeps its row)."""
        from mlx_lm.models.cache import BatchKVCache

        assert self.layers is not None
        out = []
        for n, c in enumerate(self.layers):
            if type(c) is not BatchKVCache:
                out.append(c.extract(row))
                continue
            # BatchKVCache.extract, with the padding taken from the host mirror.
            out.append(row_cache(c, row, self._pads[n][row], c._idx))
        return out

    async def launch(self, sm: ServedModel, tokens: Any, source: Any, sample: Callable[[Any], Any],
                     routing: Any = None) -> tuple[Any, Any]:
        """Queue one forward of the whole batch (``tokens``: (size, 1)); ``sample`` builds, from the
        last position's logits (size, vocab), what the caller reads. Returns the step's context
        and that (lazy, scheduled where the step was queued): pass both to ``forward.finish``.

        A queued step (the batch's switches resolving their experts in parts when they may not
        fit a layer's rows at once), else per layer with the union of the batch's experts served
        in groups. ``routing``: the step's routing replay (a
        :class:`~asyncside.models.forcing.RowsReplay` of the rows in order), or None.
        """
        assert self.layers is not None and tokens.shape[0] == self.size
        fwd = sm.forward
        ctx = fwd.context(self.layers, source)
        if routing is not None:
            ctx.routing, ctx.position = routing, 0
        return ctx, await fwd.step(ctx, tokens, head=lambda logits: sample(logits[:, -1, :]))
