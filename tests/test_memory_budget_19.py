"""The memory plan against what buffered reads leave in the page cache.

``asyncside demo --memory 1G`` over a store of 576 MiB, its pools holding half of it, planned
379.5 MiB of page cache for the 288 MiB of records outside the pools and read buffered. In a memory
cgroup that did not reclaim, the run was charged the pools and the whole store: buffered reads leave
every record they read in the page cache, the records copied into the pools' rows as well (a dynamic
row's record is read again once evicted). The plan now counts every record of the streamed layers
against the page cache's room, and reads past it (O_DIRECT) when they do not all fit.
"""

from __future__ import annotations

import os
import pathlib

import anyio
import numpy as np
import pytest
from _fault_helpers import cached_bytes

import asyncside.runtime._plan as plan_mod
from asyncside import memory
from asyncside.runtime import Runtime
from asyncside.store import ExpertStore

RECORD = 1 << 18  # one expert's bytes: a record of one segment
EXPERTS = 16
ROWS = 4  # the pools' rows a layer (min_side_rows, at resident=0.25)


def _store(path: pathlib.Path) -> ExpertStore:
    """Two layers of 16 experts of 256 KiB, written out and dropped from the page cache."""
    rng = np.random.default_rng(0)
    store = ExpertStore.create(path, {layer: {"w": rng.integers(0, 255, size=(EXPERTS, RECORD), dtype=np.uint8)}
                                      for layer in range(2)})
    for i in store.layers:
        fd = os.open(store.layer(i).path, os.O_RDONLY)
        try:
            os.fsync(fd)  # written pages are dirty: the advice below drops only clean ones
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return store


def _plan(store: ExpertStore, budget: int) -> plan_mod.MemoryPlan:
    return plan_mod.plan_memory(store, list(store.layers), resident=0.25, pinned=None, side_rows=None,
                                min_side_rows=ROWS, memory=budget, direct=None, host_tier="auto",
                                tier_possible=False)


@pytest.fixture
def no_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans made as if the process held nothing (the budget is the plan's alone) and the machine
    had a TiB free; the plan chooses how to read."""
    monkeypatch.setattr(plan_mod, "_resident_now", lambda: 0)
    monkeypatch.setattr(memory, "available_memory", lambda: memory.MemoryBudget(1 << 40, "test"))
    monkeypatch.delenv("ASYNCSIDE_DIRECT", raising=False)


def test_a_buffered_plan_leaves_room_for_every_record_of_the_store(tmp_path: pathlib.Path, no_process: None) -> None:
    """Whatever the budget, a plan that reads through the page cache holds its pools, headroom and
    the whole store within the budget; one whose page cache holds the records outside the pools but
    not the pools' own reads past it, saying why."""
    store = _store(tmp_path / "s")
    pools = 2 * ROWS * RECORD
    store_bytes = 2 * EXPERTS * RECORD
    for extra in range(0, store_bytes + 2 * RECORD + 1, RECORD // 2):
        plan = _plan(store, pools + memory.MIN_HEADROOM + extra)
        assert plan.pool_bytes == pools and plan.store_bytes == store_bytes
        if not plan.direct:
            assert plan.held_bytes + plan.headroom_bytes + plan.store_bytes <= plan.budget, extra
            assert plan.kv_spare_bytes == int((plan.page_cache_bytes - plan.store_bytes) * plan_mod.KV_SHARE)
    between = _plan(store, pools + memory.MIN_HEADROOM + store_bytes - pools + RECORD)
    assert between.page_cache_bytes > store_bytes - pools and between.direct
    assert "beside the pools' copies" in between.direct_reason
    assert not _plan(store, pools + memory.MIN_HEADROOM + store_bytes).direct  # the whole store fits


def test_the_page_cache_a_run_leaves_stays_within_the_plan(tmp_path: pathlib.Path, no_process: None) -> None:
    """Every expert read through the pools under a budget whose page cache holds the records
    outside the pools but not all of the store: the store's pages left cached stay within the page
    cache the plan counted (buffered reads had left all of them there, the pools' records too)."""
    store = _store(tmp_path / "s")
    try:
        os.close(os.open(store.layer(0).path, os.O_RDONLY | os.O_DIRECT))
    except (AttributeError, OSError):
        pytest.skip("this file system refuses O_DIRECT: the plan's reads past the page cache cannot be had")
    budget = 2 * ROWS * RECORD + memory.MIN_HEADROOM + 2 * (EXPERTS - ROWS) * RECORD + RECORD

    async def main() -> plan_mod.MemoryPlan:
        async with Runtime(store, reader="threads", resident=0.25, min_side_rows=ROWS, memory=budget) as rt:
            assert rt.plan is not None
            for layer in store.layers:
                for first in range(0, EXPERTS, ROWS):
                    await rt.ensure(layer, list(range(first, first + ROWS)))
            assert rt.stats()["misses"] == 2 * EXPERTS
            return rt.plan

    plan = anyio.run(main)
    cached = sum(cached_bytes(store.layer(i).path) for i in store.layers)
    assert cached <= plan.page_cache_bytes, (cached, plan.describe())

