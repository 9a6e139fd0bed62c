"""Helpers shared by the read-path tests (imported by test_readers*.py)."""

from __future__ import annotations

from collections.abc import Iterable

from asyncside.pools import PoolSet
from asyncside.store import ExpertStore


def rows_equal_store(store: ExpertStore, spec_index: int, pools: PoolSet, expert: int, row: int) -> None:
    """Every pool row of ``expert`` holds exactly ``store.read_expert``'s bytes (synchronous: call it
    off the loop, through :func:`check_rows`, when records are big)."""
    truth = store.read_expert(spec_index, expert)
    for key, want in truth.items():
        pool = pools.arrays[key]
        assert pool.dtype == want.dtype and tuple(pool.shape[1:]) == tuple(want.shape), key
        assert bytes(pools.row_view(key, row)) == bytes(memoryview(want).cast("B")), (
            f"layer {spec_index} expert {expert} row {row} key {key}: bytes differ")


async def check_rows(store: ExpertStore, spec_index: int, pools: PoolSet, pairs: Iterable[tuple[int, int]]) -> None:
    """rows_equal_store for each (expert, row) in ``pairs``, in a worker thread (reading the ground
    truth is synchronous file I/O and must not block the loop the tests watch)."""
    import anyio

    pairs = list(pairs)

    def check() -> None:
        for e, r in pairs:
            rows_equal_store(store, spec_index, pools, e, r)

    await anyio.to_thread.run_sync(check)


def assert_balanced(c: dict[str, int]) -> None:
    """Every submitted op completed, every staging buffer came back, nothing leaked."""
    assert c["fills_submitted"] == c["fills_completed"], c
    assert c["ops_submitted"] == c["ops_completed"], c
    assert c["staging_acquired"] == c["staging_released"], c
    assert c.get("chunks_created", 0) == c.get("chunks_destroyed", 0), c
    assert c.get("slab_allocs", 0) == c.get("slab_frees", 0), c
    assert c["in_flight"] == 0, c
