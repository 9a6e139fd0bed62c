"""Where the model gets expert rows from: the ExpertSource protocol and the all-resident source.

``Runtime`` (streaming) and :class:`ResidentSource` (every expert of every layer in the pools,
lookup = identity) both implement :class:`ExpertSource`; the async forward only talks to it.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx
import numpy as np

from ..errors import LedgerError
from ..ledger import validate_ids
from ..snapshot import RowSnapshot, make_snapshot


@runtime_checkable
class ExpertSource(Protocol):
    """The contract between the model and whatever serves expert rows (docs/ARCHITECTURE.md).

    - ``pools(layer)``: segment key -> pool array ``(rows, *row_shape)``.
    - ``lookup(layer)``: int32 ``(n_experts,)`` expert -> physical row (-1: not present). Must be a
      *snapshot*: later ensures/prefetches must not change an array already returned.
    - ``ensure(layer, ids)``: on return every id is resident or LIVE (raises CapacityError when the
      ids can never fit at once; the forward then serves them in smaller groups).
    - ``prefetch(layer, ids)``: a hint (ids may be a lazy mx.array); never blocks.
    - ``lease(layer, experts)`` pins rows until ``release_after(x, [(layer, lease_id), ...])`` sees
      ``x`` computed.
    """

    def pools(self, layer: int) -> dict[str, mx.array]: ...
    def lookup(self, layer: int) -> mx.array: ...
    async def ensure(self, layer: int, ids: Any) -> None: ...
    def prefetch(self, layer: int, ids: Any) -> object: ...
    def lease(self, layer: int, experts: Any) -> int: ...
    def release_after(self, x: mx.array, leases: list[tuple[int, int]]) -> None: ...


def _ids_array(ids: Any, n_experts: int, layer: int) -> np.ndarray:
    return np.asarray(validate_ids(ids, n_experts, layer=layer), dtype=np.int64)


class ResidentSource:
    """Every expert of every MoE layer lives in its pools (row e = expert e): the baseline.

    Nothing is ever read or evicted; ``ensure`` only validates ids, ``prefetch`` does nothing,
    leases are counted so tests can check the forward balances them.
    """

    def __init__(self, pools: Mapping[int, Mapping[str, mx.array]]) -> None:
        if not pools:
            raise ValueError("ResidentSource needs at least one layer")
        self._pools: dict[int, dict[str, mx.array]] = {}
        self._lookup: dict[int, mx.array] = {}
        self._n: dict[int, int] = {}
        for layer, arrays in pools.items():
            counts = {k: a.shape[0] for k, a in arrays.items()}
            if len(set(counts.values())) != 1:
                raise ValueError(f"layer {layer}: pool arrays disagree on the expert count: {counts}")
            n = next(iter(counts.values()))
            self._pools[layer] = dict(arrays)
            self._n[layer] = n
            self._lookup[layer] = mx.arange(n, dtype=mx.int32)
        self._snapshots = {
            layer: make_snapshot(np.arange(n, dtype=np.int32), np.zeros(n, dtype=np.int64))
            for layer, n in self._n.items()
        }
        mx.eval(list(self._lookup.values()), [s.rows for s in self._snapshots.values()],
                [list(p.values()) for p in self._pools.values()])
        self._lease_ids = itertools.count(1)
        self.open_leases: dict[int, tuple[int, np.ndarray]] = {}
        self.counts = {"ensure": 0, "prefetch": 0, "lease": 0, "release": 0}

    @classmethod
    def from_store(cls, store: Any) -> ResidentSource:
        """Read every expert of every layer of an ExpertStore into pools (all-resident baseline)."""
        pools: dict[int, dict[str, mx.array]] = {}
        for index, spec in store.layers.items():
            per_key: dict[str, list[np.ndarray]] = {s.key: [] for s in spec.segments}
            for e in range(spec.n_experts):
                for k, a in store.read_expert_numpy(index, e).items():
                    per_key[k].append(a)
            arrays = {}
            for seg in spec.segments:
                a = mx.array(np.stack(per_key[seg.key]))
                arrays[seg.key] = a.view(mx.bfloat16) if seg.dtype == "bfloat16" else a
            pools[index] = arrays
        return cls(pools)

    @property
    def layers(self) -> list[int]:
        return list(self._pools)

    def n_experts(self, layer: int) -> int:
        return self._n[self._check_layer(layer)]

    def _check_layer(self, layer: int) -> int:
        if layer not in self._pools:
            raise LedgerError(f"no MoE layer {layer!r} in this source; layers: {list(self._pools)}")
        return layer

    def pools(self, layer: int) -> dict[str, mx.array]:
        return self._pools[self._check_layer(layer)]

    def lookup(self, layer: int) -> mx.array:
        return self._lookup[self._check_layer(layer)]

    async def ensure(self, layer: int, ids: Any) -> None:
        _ids_array(ids, self.n_experts(layer), layer)
        self.counts["ensure"] += 1

    def snapshot(self, layer: int) -> RowSnapshot:
        return self._snapshots[self._check_layer(layer)]

    def unchanged(self, layer: int, snap: RowSnapshot, experts: np.ndarray) -> np.ndarray:
        # Rows never move here: every valid expert is where any snapshot put it.
        arr = _ids_array(experts, self.n_experts(layer), layer)
        same: np.ndarray = snap.table[arr] == arr
        return same

    def prefetch(self, layer: int, ids: Any) -> None:
        self._check_layer(layer)
        self.counts["prefetch"] += 1
        return None

    def lease(self, layer: int, experts: Any) -> int:
        arr = _ids_array(experts, self.n_experts(layer), layer)
        lid = next(self._lease_ids)
        self.open_leases[lid] = (layer, arr)
        self.counts["lease"] += 1
        return lid

    def release_after(self, x: mx.array, leases: Sequence[tuple[int, int]]) -> None:
        # Rows never move here, so releasing at once is safe (nothing can overwrite them).
        for layer, lid in leases:
            held = self.open_leases.pop(lid, None)
            if held is None or held[0] != layer:
                raise LedgerError(f"lease {lid} of layer {layer} is not held")
            self.counts["release"] += 1

    # -- queued steps: row e holds expert e, so the rows are the routed ids themselves -----------

    def queued_ready(self, pairs: int) -> bool:
        return True

    def queued_capacity(self, decode_tokens: int | None = None) -> int:
        return min(self._n.values())

    def begin_step(self, pairs: int) -> int | None:
        self.counts["steps"] = self.counts.get("steps", 0) + 1
        return None

    def expert_rows(self, layer: int, ids: mx.array) -> mx.array:
        self._check_layer(layer)
        return ids

    def end_step(self, out: mx.array) -> None:
        pass

    def abandon_step(self) -> None:
        pass

    def after_step(self, step: int | None = None) -> None:
        pass

    async def quiesce(self) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {"source": "resident", **self.counts, "open_leases": len(self.open_leases)}
