"""Helpers shared by the read-path tests (imported by test_readers*.py)."""

from __future__ import annotations

import pytest

from asyncside.pools import PoolSet
from asyncside.readers import io_uring_status
from asyncside.store import ExpertStore

HAVE_URING = io_uring_status()[0]
READERS = [
    pytest.param("io_uring", marks=pytest.mark.skipif(not HAVE_URING, reason="io_uring unavailable here")),
    "threads",
    "aiofiles",
]


def rows_equal_store(store: ExpertStore, spec_index: int, pools: PoolSet, expert: int, row: int) -> None:
    truth = store.read_expert(spec_index, expert)
    for key, want in truth.items():
        got = pools.arrays[key][row]
        assert got.dtype == want.dtype and got.shape == want.shape, key
        assert bytes(pools.row_view(key, row)) == bytes(memoryview(want).cast("B")), (
            f"layer {spec_index} expert {expert} row {row} key {key}: bytes differ")


def assert_balanced(c: dict[str, int]) -> None:
    """Every submitted op completed, every staging buffer came back, nothing leaked."""
    assert c["fills_submitted"] == c["fills_completed"], c
    assert c["ops_submitted"] == c["ops_completed"], c
    assert c["staging_acquired"] == c["staging_released"], c
    assert c.get("chunks_created", 0) == c.get("chunks_destroyed", 0), c
    assert c.get("slab_allocs", 0) == c.get("slab_frees", 0), c
    assert c["in_flight"] == 0, c
