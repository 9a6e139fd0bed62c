"""A batched form of mlx-lm's ``ChunkedKVCache`` (llama4's chunked attention), which mlx-lm lacks.

llama4 attends, in three layers of every four, only to the keys of the query's own chunk of
``chunk_size`` positions: a query at position ``p`` sees positions ``[p - p % chunk_size, p]``.
mlx-lm's ``ChunkedKVCache`` keeps one sequence's keys from ``start_position`` on (it drops the
front, :meth:`ChunkedKVCache.maybe_trim_front`), and llama4's ``__call__`` builds one chunk mask
from ``cache[0]``'s scalar positions. :class:`BatchChunkedKVCache` holds several sequences at
their own positions, as mlx-lm's ``BatchKVCache`` holds plain attention caches: each row's keys
right-aligned at a common column, left-padded to the longest row, its positions and the start of
what its own cache would keep tracked on the host, and a mask per row (:meth:`make_mask`) that
attends exactly the keys that row's own ``ChunkedKVCache`` would attend. The walk builds it in
:func:`asyncside.models.arch._masks_llama4`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ChunkedKVCache


class BatchChunkedKVCache:
    """The chunked-attention caches of several sequences decoding together, merged.

    Holds, per row, the keys and values its own ``ChunkedKVCache`` would hold (positions
    ``[starts[b], offsets[b])``), right-aligned at column ``_idx`` and left-padded to the longest
    row; plus, to copy the buffer only once every :attr:`step` steps rather than at every step
    as a lone ``ChunkedKVCache`` does past its first chunk, up to :attr:`step` columns of keys
    every row has dropped already (never attended: :meth:`make_mask` attends a row's keys from
    its start on). So it holds at most the longest row's window plus padding plus ``step``
    columns per row. Positions, starts and the common column live on the host: merging, dropping
    and extracting rows never read the device.
    """

    step = 256

    def __init__(self, chunk_size: int, offsets: Sequence[int], starts: Sequence[int]) -> None:
        self.chunk_size = chunk_size
        self.offsets = [int(o) for o in offsets]  # per row: positions fed
        self.starts = [int(s) for s in starts]    # per row: its own cache's start_position
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self._idx = 0  # columns written; row b's position p is at column p - offsets[b] + _idx
        self._offset: mx.array | None = None

    @property
    def offset(self) -> mx.array:
        """Each row's positions fed, (B,): the rotary offsets of the row's next tokens."""
        if self._offset is None:
            self._offset = mx.array(self.offsets)
        return self._offset

    @classmethod
    def merge(cls, caches: Sequence[ChunkedKVCache]) -> BatchChunkedKVCache:
        """One batch cache of single-sequence ``caches`` (rows in order); they are left as they are."""
        if not caches:
            raise ValueError("BatchChunkedKVCache.merge: no caches to merge")
        chunk = caches[0].chunk_size
        if any(c.chunk_size != chunk for c in caches):
            raise ValueError(f"BatchChunkedKVCache.merge: caches of different chunk sizes "
                             f"{sorted({c.chunk_size for c in caches})}")
        out = cls(chunk, [c.offset for c in caches], [c.start_position for c in caches])
        held = [c for c in caches if c.keys is not None and c.offset > c.start_position]
        if not held:
            return out
        width = max(c.offset - c.start_position for c in held)
        first = held[0]
        assert first.keys is not None and first.values is not None
        _, heads, _, dk = first.keys.shape
        dv = first.values.shape[3]
        dtype = first.keys.dtype
        keys, values = [], []
        for c in caches:
            n = c.offset - c.start_position if c.keys is not None else 0
            k = c.keys[..., :n, :] if n > 0 else mx.zeros((1, heads, 0, dk), dtype)
            v = c.values[..., :n, :] if n > 0 else mx.zeros((1, heads, 0, dv), dtype)
            if n < width:
                pad = [(0, 0), (0, 0), (width - n, 0), (0, 0)]
                k, v = mx.pad(k, pad), mx.pad(v, pad)
            keys.append(k)
            values.append(v)
        out.keys, out.values = mx.concatenate(keys), mx.concatenate(values)
        out._idx = width
        return out

    def _first_needed(self) -> int:
        """The first column any row still needs (the one of the earliest row start)."""
        return min((s - o for s, o in zip(self.starts, self.offsets)), default=0) + self._idx

    def maybe_trim_front(self) -> None:
        """Drop each row's keys before its chunk window, as its own cache would (llama4's forward
        calls it before building the masks): the row starts move on the host; the buffer's
        front columns no row needs any more go only when the buffer is full (the next write
        copies it anyway)."""
        self.starts = [max(s, o - self.chunk_size) for s, o in zip(self.starts, self.offsets)]
        if self.keys is None or self._idx < self.keys.shape[2]:
            return
        self._cut_front()

    def _cut_front(self) -> None:
        """Drop the buffer's front columns no row needs any more."""
        cut = self._first_needed()
        if cut > 0 and self.keys is not None and self.values is not None:
            self.keys = self.keys[..., cut:self._idx, :]
            self.values = self.values[..., cut:self._idx, :]
            self._idx -= cut

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``keys``/``values`` (B, heads, L, dims) at each row's next positions; returns
        every column held so far (what :meth:`make_mask` masks)."""
        n = keys.shape[2]
        prev = self._idx
        if self.keys is None or prev + n > self.keys.shape[2]:
            b, heads, _, dk = keys.shape
            grow = (self.step + n - 1) // self.step * self.step
            new_k = mx.zeros((b, heads, grow, dk), keys.dtype)
            new_v = mx.zeros((b, heads, grow, values.shape[3]), values.dtype)
            if self.keys is None or self.values is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys = mx.concatenate([self.keys[..., :prev, :], new_k], axis=2)
                self.values = mx.concatenate([self.values[..., :prev, :], new_v], axis=2)
        assert self.keys is not None and self.values is not None
        self._idx += n
        self.offsets = [o + n for o in self.offsets]
        self._offset = None
        self.keys[..., prev:self._idx, :] = keys
        self.values[..., prev:self._idx, :] = values
        return self.keys[..., :self._idx, :], self.values[..., :self._idx, :]

    def make_mask(self, n: int) -> mx.array:
        """The chunk mask of ``n`` new tokens per row, (B, 1, n, columns after they are written):
        row ``b``'s query at position ``p`` attends the keys at positions ``[max(chunk start of
        p, the row's start), p]``, what its own cache and llama4's chunk mask give it alone."""
        cols = self._idx + n
        offsets = mx.array(self.offsets)[:, None, None, None]
        starts = mx.array(self.starts)[:, None, None, None]
        # Positions of the queries (B, 1, n, 1) and of the columns (B, 1, 1, cols).
        q = offsets + mx.arange(n)[None, None, :, None]
        k = offsets + n - cols + mx.arange(cols)[None, None, None, :]
        chunk_start = q - q % self.chunk_size
        return (k >= starts) & (k >= chunk_start) & (k <= q)

    def filter(self, batch_indices: Sequence[int]) -> None:
        """Keep only rows ``batch_indices`` (in that order); front columns no kept row needs go."""
        keep = [int(i) for i in batch_indices]
        self.offsets = [self.offsets[i] for i in keep]
        self.starts = [self.starts[i] for i in keep]
        self._offset = None
        if self.keys is None or self.values is None:
            return
        index = mx.array(keep)
        self.keys, self.values = self.keys[index], self.values[index]
        self._cut_front()

    def extend(self, other: BatchChunkedKVCache) -> None:
        """Append ``other``'s rows after these (both right-aligned at the longer one's column)."""
        if other.chunk_size != self.chunk_size:
            raise ValueError(f"BatchChunkedKVCache.extend: chunk sizes {self.chunk_size} and {other.chunk_size}")
        width = max(self._idx, other._idx)
        parts = [p for p in (self, other) if p.keys is not None]
        if parts:
            ref = parts[0]
            assert ref.keys is not None and ref.values is not None
            heads, dk, dv, dtype = ref.keys.shape[1], ref.keys.shape[3], ref.values.shape[3], ref.keys.dtype

            def aligned(c: BatchChunkedKVCache, which: str) -> mx.array:
                rows, d = len(c.offsets), dk if which == "keys" else dv
                a = getattr(c, which)
                a = mx.zeros((rows, heads, 0, d), dtype) if a is None else a[..., :c._idx, :]
                return mx.pad(a, [(0, 0), (0, 0), (width - c._idx, 0), (0, 0)]) if c._idx < width else a

            self.keys = mx.concatenate([aligned(self, "keys"), aligned(other, "keys")])
            self.values = mx.concatenate([aligned(self, "values"), aligned(other, "values")])
        self._idx = width
        self.offsets = self.offsets + other.offsets
        self.starts = self.starts + other.starts
        self._offset = None

    def extract(self, idx: int) -> ChunkedKVCache:
        """Row ``idx``'s own cache: the ``ChunkedKVCache`` that sequence would hold alone (its
        start position, offset and the keys and values from its start on); a copy."""
        c = ChunkedKVCache(self.chunk_size)  # type: ignore[no-untyped-call]  # mlx-lm's class is unannotated
        c.offset, c.start_position = self.offsets[idx], self.starts[idx]
        if self.keys is not None and self.values is not None and c.offset > c.start_position:
            first = c.start_position - c.offset + self._idx
            c.keys = mx.contiguous(self.keys[idx:idx + 1, :, first:self._idx])
            c.values = mx.contiguous(self.values[idx:idx + 1, :, first:self._idx])
        return c

    def size(self) -> int:
        """Columns held (every row's, padding included)."""
        return self._idx

    def empty(self) -> bool:
        """Whether nothing was written yet."""
        return self.keys is None

    def is_trimmable(self) -> bool:
        """Never: a batch cache is not trimmed back (rows leave through :meth:`filter`)."""
        return False

    @property
    def nbytes(self) -> int:
        """Bytes of the key and value buffers."""
        if self.keys is None or self.values is None:
            return 0
        return int(self.keys.nbytes + self.values.nbytes)

    @property
    def state(self) -> Any:
        """The buffers and the host bookkeeping (offsets, starts, column)."""
        return self.keys, self.values, self.offsets, self.starts, self._idx
