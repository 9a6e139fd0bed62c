"""The pinned and warm rows' file pages, dropped from the page cache once the rows hold them.

The rows read at start (pinned experts, and the dynamic rows warmed with the store's hottest) went
through the page cache under buffered reads and stayed there, charged to a memory cgroup beside
the pools' copies, as the non-expert weights' pages did before they were dropped after loading. A
pinned row's record is never read again, a warm row's only once it is evicted: their pages are
now advised away once the rows hold them, but only the records that had no page cached before
this process read them (another process, or an earlier run, may read those again).
"""

from __future__ import annotations

import os
import pathlib

import anyio
import numpy as np
from _fault_helpers import cached_bytes

from asyncside import memory
from asyncside.runtime import Runtime
from asyncside.store import ExpertStore

RECORD = 1 << 18
EXPERTS = 16


def _uncached(store: ExpertStore) -> ExpertStore:
    for i in store.layers:
        fd = os.open(store.layer(i).path, os.O_RDONLY)
        try:
            os.fsync(fd)  # written pages are dirty: the advice drops only clean ones
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        assert cached_bytes(store.layer(i).path) == 0
    return store


def _store(path: pathlib.Path) -> ExpertStore:
    """Two layers of 16 experts of 256 KiB, none of their pages cached."""
    rng = np.random.default_rng(0)
    return _uncached(ExpertStore.create(path, {layer: {"w": rng.integers(0, 255, size=(EXPERTS, RECORD),
                                                                        dtype=np.uint8)} for layer in range(2)}))


def _enter(store: ExpertStore, **kw: object) -> tuple[dict[int, int], int]:
    """Enter a buffered runtime; (bytes of each blob cached once entered, bytes the runtime dropped)."""
    async def main() -> tuple[dict[int, int], int]:
        async with Runtime(store, reader="threads", direct=False, **kw) as rt:  # type: ignore[arg-type]
            assert not rt.plan.direct if rt.plan is not None else False
            return {i: cached_bytes(store.layer(i).path) for i in store.layers}, rt._fills.dropped_start_bytes

    return anyio.run(main)


def test_pinned_rows_leave_no_pages_in_the_page_cache(tmp_path: pathlib.Path) -> None:
    """Six pinned experts a layer read buffered: their 1.5 MiB a layer were left cached; none now."""
    store = _store(tmp_path / "s")
    cached, dropped = _enter(store, pinned={0: [0, 1, 2, 3, 4, 5], 1: [6, 7, 8, 9, 10, 11]}, side_rows=2)
    assert cached == {0: 0, 1: 0}, cached
    assert dropped >= 2 * 6 * store.layer(0).stride  # the records, and what readahead read past them


def test_warm_rows_leave_no_pages_in_the_page_cache(quick_store: pathlib.Path) -> None:
    """The embedded model's store ranks its experts: the dynamic rows are warmed at start, and
    their records' pages are dropped once the rows hold them."""
    store = _uncached(ExpertStore.open(quick_store))
    cached, dropped = _enter(store, resident=0.25)
    assert dropped > 0
    assert sum(cached.values()) == 0, cached


def test_records_cached_before_the_run_keep_their_pages(tmp_path: pathlib.Path) -> None:
    """A pinned record whose pages were cached before the runtime read it (another reader of the
    store; with what its readahead read) stays cached; what the runtime's reads brought in is
    dropped."""
    store = _store(tmp_path / "s")
    spec = store.layer(0)
    with open(spec.path, "rb") as f:
        f.seek(spec.record_offset(2))
        f.read(spec.stride)  # expert 2 of layer 0, read by someone else first
    kept = memory.cached_pages(spec.path)
    assert kept is not None and sum(kept) * os.sysconf("SC_PAGE_SIZE") >= spec.stride
    cached, dropped = _enter(store, pinned={0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}, side_rows=2)
    assert cached[1] == 0 and dropped >= 4 * spec.stride, (cached, dropped)
    assert memory.cached_pages(spec.path) == kept  # exactly the pages cached before, no more, no fewer
