"""The runtime's counters: one dataclass per part, composed by :class:`RuntimeStats`.

Each part of the runtime owns the counters it moves; :meth:`asyncside.Runtime.stats` composes them
with the memory plan into one :class:`RuntimeStats`: a dict of flat counter names
(``stats["hits"]``), which is what the metrics endpoint, the demo's JSON and the benchmarks read,
carrying the typed parts (``stats.cache.hits``): one set of names for all of them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class CacheStats:
    """Where the experts a forward routed were found: moved by both read paths."""

    hits: int = 0
    misses: int = 0
    late: int = 0  # demanded while its prefetch was still in flight
    evictions: int = 0


@dataclass
class ReadStats:
    """Records read from the store (the host fill path, and the faults of queued steps)."""

    fills: int = 0
    failed_fills: int = 0
    bytes_read: int = 0
    prefetched: int = 0
    failed_predictions: int = 0
    skipped_prefetches: int = 0
    ensure_calls: int = 0
    read_time_s: float = 0.0
    stall_time_s: float = 0.0
    resident_bytes: int = 0  # pinned rows loaded at start
    warm_bytes: int = 0  # dynamic rows warmed up at start (not counted in bytes_read)


@dataclass
class QueuedStats:
    """Queued steps: faults served on the stream, the host tier and its staging arrays."""

    queued_steps: int = 0
    faults: int = 0
    fault_time_s: float = 0.0  # the stream's time reading faulted records itself
    streamed_faults: int = 0  # faults a streamed resolve read in the background (see models/queued.py)
    background_read_s: float = 0.0  # their reads' time, spent while the stream computed
    read_wait_s: float = 0.0  # the stream's time waiting for them
    prefetch_reads: int = 0  # predicted experts a queued step's prefetch read (verified; not misses)
    prefetch_failures: int = 0  # prefetch reads that failed (the row freed; the expert read again if routed)
    prefetch_hits: int = 0  # routed experts found in a row a queued step's prefetch filled
    tier_faults: int = 0  # faults whose bytes came from the host tier (a device copy, no read)
    staged_copies: int = 0  # experts a staged resolve copied from the host tier (misses, no row taken)
    host_tier_bytes: int = 0
    staging_bytes: int = 0


class RuntimeStats(dict[str, Any]):
    """A snapshot of every counter: a plain dict of flat names (``stats["hits"]``: JSON-ready, what
    /metrics and the benchmarks read) that also carries the typed parts it was composed from
    (``stats.cache.hits``, ``stats.reads.bytes_read``, ``stats.queued.faults``)."""

    def __init__(self, cache: CacheStats, reads: ReadStats, queued: QueuedStats, *, reader: str, direct: bool,
                 pool_bytes_planned: int, memory_budget: int) -> None:
        self.cache, self.reads, self.queued = cache, reads, queued
        flat: dict[str, Any] = {}
        for part in (cache, reads, queued):
            flat.update(asdict(part))
        total = cache.hits + cache.misses
        flat["hit_rate"] = cache.hits / total if total else 1.0
        flat.update(reader=reader, direct=direct, pool_bytes_planned=pool_bytes_planned, memory_budget=memory_budget)
        super().__init__(flat)

    @property
    def hit_rate(self) -> float:
        """Hits over hits plus misses (1.0 before anything was routed)."""
        return float(self["hit_rate"])

    def as_dict(self) -> dict[str, Any]:
        """The flat counters as a plain dict (a copy)."""
        return dict(self)


def snapshot(cache: CacheStats, reads: ReadStats, queued: QueuedStats, *, reader: str, direct: bool,
             pool_bytes_planned: int, memory_budget: int) -> RuntimeStats:
    """Copies of the live counters, composed (later changes to the parts do not show through)."""
    return RuntimeStats(CacheStats(**asdict(cache)), ReadStats(**asdict(reads)), QueuedStats(**asdict(queued)),
                        reader=reader, direct=direct, pool_bytes_planned=pool_bytes_planned,
                        memory_budget=memory_budget)
