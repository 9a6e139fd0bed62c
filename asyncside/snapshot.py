"""Row snapshots: where a layer's experts were at one moment, for forwards that gather speculatively.

A forward that waits for the routed ids on the host before gathering rows leaves the stream idle
while the host looks them up. With a :class:`RowSnapshot` the forward gathers ``rows[ids]`` in the
graph instead, so the stream computes the expert outputs straight after the router; the host then
checks (:meth:`SpeculativeSource.unchanged`) that each routed expert really was in its row and that
nothing was written there since, and recomputes only the pairs that were not. No I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import mlx.core as mx
import numpy as np

__all__ = ["RowSnapshot", "SpeculativeSource", "make_snapshot"]


@dataclass(frozen=True)
class RowSnapshot:
    """Where every expert of one layer was, at one moment, for a forward that gathers speculatively.

    ``table`` is ``lookup()`` then (int32, -1 absent) and ``generations`` the ledger's per-row fill
    counts then; ``rows`` is ``table`` as an ``mx.array`` with absent experts sent to row 0, so an
    in-graph gather ``rows[ids]`` is always in bounds. A pair whose expert was absent computes
    garbage from row 0; the forward keeps a pair's result only once the source confirms
    (``unchanged``) that its expert was present and its row untouched since the snapshot.
    """

    table: np.ndarray
    generations: np.ndarray
    rows: mx.array


@runtime_checkable
class SpeculativeSource(Protocol):
    """Optional extension of :class:`ExpertSource`: lets the forward gather rows before it knows
    the routed ids (in the graph, from a snapshot), so the stream never waits for the host on a hit.

    - ``snapshot(layer)``: a :class:`RowSnapshot` of the layer now (cheap; cached between changes).
    - ``unchanged(layer, snap, experts)``: bool per expert, True iff the expert had a row in
      ``snap`` and has held it since with no fill into that row. Only such rows may be trusted for
      reads the stream may already have made.
    """

    def snapshot(self, layer: int) -> RowSnapshot: ...
    def unchanged(self, layer: int, snap: RowSnapshot, experts: np.ndarray) -> np.ndarray: ...


def make_snapshot(table: np.ndarray, generations: np.ndarray) -> RowSnapshot:
    """A :class:`RowSnapshot` from a lookup table and the row generations of the same moment."""
    rows = mx.array(np.maximum(table, 0).astype(np.int32))
    return RowSnapshot(table, generations, rows)
