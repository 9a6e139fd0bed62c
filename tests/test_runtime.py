"""The runtime end to end: lazy predictions drive fills, demand fills, errors, leases, cancellation.

Every test ends by auditing every ledger: no row owned twice, no fill left pending, no leak.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import mlx.core as mx
import numpy as np
import pytest

from asyncside import ExpertStore
from asyncside.errors import FillError, LedgerError
from asyncside.runtime import Runtime


def _make_store(path: Path, *, n_layers: int = 2, n_experts: int = 16, seed: int = 0) -> ExpertStore:
    rng = np.random.default_rng(seed)
    layers = {}
    for layer in range(n_layers):
        layers[layer] = {
            # Odd shapes on purpose: rows that are not multiples of 8 bytes.
            "w.weight": rng.integers(0, 2**32, size=(n_experts, 5, 7), dtype=np.uint32),
            "w.scales": rng.standard_normal((n_experts, 3)).astype(np.float16),
            "tag": rng.integers(0, 255, size=(n_experts, 1), dtype=np.uint8),
        }
    return ExpertStore.create(path, layers)


def _row_bytes(rt: Runtime, layer: int, row: int) -> dict[str, bytes]:
    pools = rt._s.layer(layer).pools  # private on purpose: the tests check the bytes themselves
    return {key: pools.row_bytes(key, row) for key in pools.arrays}


def _expected(store: ExpertStore, layer: int, expert: int) -> dict[str, bytes]:
    record = store.read_record(layer, expert)
    return {s.key: bytes(record[s.offset : s.offset + s.nbytes]) for s in store.layer(layer).segments}


def _assert_rows_match(rt: Runtime, store: ExpertStore) -> int:
    """Every resident or LIVE row holds exactly its expert's bytes; returns rows checked."""
    checked = 0
    for layer in store.layers:
        table = np.array(rt.lookup(layer))
        for expert, row in enumerate(table.tolist()):
            if row >= 0:
                assert _row_bytes(rt, layer, row) == _expected(store, layer, expert), (layer, expert, row)
                checked += 1
    return checked


async def _assert_rows_match_off_loop(rt: Runtime, store: ExpertStore) -> int:
    """``_assert_rows_match`` in a worker thread, for tests that watch their loop for blocking.

    Device pools are read back by an MLX copy, and on a GPU the first one compiles its kernel
    (seconds on a cold machine): the test's own check must not count as the loop blocking.
    """
    return await anyio.to_thread.run_sync(_assert_rows_match, rt, store)


def _assert_clean(rt: Runtime) -> None:
    for layer, report in rt.audit().items():
        assert report.ok, (layer, report.problems)
        assert not rt.ledger(layer).pending(), (layer, rt.ledger(layer).pending())


@pytest.fixture
def store(tmp_path: Path) -> ExpertStore:
    return _make_store(tmp_path / "store")


@pytest.mark.anyio
async def test_lazy_prediction_drives_fills(store: ExpertStore, reader: str, no_blocking) -> None:
    async with Runtime(store, resident=0.5, side_rows=4, reader=reader) as rt:
        assert rt.reader == reader
        # The ids come out of a computation the loop never waits for synchronously.
        logits = mx.array(np.arange(16, dtype=np.float32)[::-1].copy()) * mx.ones((16,))
        ids = mx.argsort(logits)[:3]  # experts 15, 14, 13: not resident (resident are hot-first 0..3)
        handle = rt.prefetch(0, ids)
        await rt.drain(0)
        assert handle.done()
        table = np.array(rt.lookup(0))
        assert all(table[e] >= 0 for e in (13, 14, 15))
        assert await _assert_rows_match_off_loop(rt, store) >= 3 + 4 + 4
        _assert_clean(rt)
        assert rt.stats()["bytes_read"] == 3 * store.layer(0).stride


@pytest.mark.anyio
async def test_ensure_random_sequences(store: ExpertStore, reader: str, no_blocking) -> None:
    rng = np.random.default_rng(1)
    async with Runtime(store, resident=0.25, side_rows=3, reader=reader) as rt:
        for _ in range(40):
            layer = int(rng.integers(0, 2))
            ids = rng.choice(16, size=int(rng.integers(1, 4)), replace=False)
            if rng.random() < 0.5:
                rt.prefetch(layer, rng.choice(16, size=2, replace=False).tolist())
            await rt.ensure(layer, ids.tolist())
            table = np.array(rt.lookup(layer))
            assert (table[ids] >= 0).all()
            lease = rt.lease(layer, ids.tolist())
            for e in ids.tolist():
                got = await anyio.to_thread.run_sync(_row_bytes, rt, layer, int(table[e]))
                assert got == _expected(store, layer, e)
            rt.release(layer, lease)
        await rt.drain()
        await _assert_rows_match_off_loop(rt, store)
        _assert_clean(rt)
        stats = rt.stats()
        assert stats["hits"] + stats["misses"] > 0
        assert stats["fills"] >= stats["misses"] - stats["late"]


@pytest.mark.anyio
async def test_failed_fill_reaches_awaiters_and_returns_row(tmp_path: Path, reader: str) -> None:
    store = _make_store(tmp_path / "store", n_layers=1)
    # Truncate the blob after a valid open: experts in the last records now read past EOF.
    spec = store.layer(0)
    async with Runtime(store, resident=0.25, side_rows=4, reader=reader) as rt:
        os.truncate(spec.path, spec.stride * 10)
        with pytest.raises(FillError) as info:
            await rt.ensure(0, [12])
        assert info.value.expert == 12
        rt.prefetch(0, [13, 14])
        with pytest.raises(ExceptionGroup) as group:
            await rt.drain(0)
        assert sorted(e.expert for e in group.value.exceptions) == [12, 13, 14]
        # The rows came back: three fresh experts still fit in the 4-row side region.
        await rt.ensure(0, [5, 6, 7])
        _assert_rows_match(rt, store)
        _assert_clean(rt)
        assert rt.ledger(0).lookup()[[12, 13, 14]].tolist() == [-1, -1, -1]


@pytest.mark.anyio
async def test_cancelled_ensure_leaves_ledger_consistent(store: ExpertStore, reader: str) -> None:
    async with Runtime(store, resident=0.25, side_rows=4, reader=reader) as rt:
        with anyio.CancelScope() as scope:
            scope.cancel()
            await rt.ensure(0, [9, 10, 11])
        await rt.drain()
        _assert_clean(rt)
        _assert_rows_match(rt, store)
        # The reads ran to completion: their rows are LIVE, not leaked, not half-written.
        assert (np.array(rt.lookup(0))[[9, 10, 11]] >= 0).sum() in (0, 3)
        await rt.ensure(0, [9, 10, 11])
        _assert_clean(rt)


@pytest.mark.anyio
async def test_leased_rows_are_not_evicted_until_computation_completes(store: ExpertStore) -> None:
    async with Runtime(store, resident=0.25, side_rows=2, policy="lru") as rt:
        await rt.ensure(0, [10, 11])
        rows = np.array(rt.lookup(0))[[10, 11]].tolist()
        lease = rt.lease(0, [10, 11])
        # A lazy computation "reads" the rows; the lease goes when it has been computed.
        x = mx.matmul(mx.ones((256, 256)), mx.ones((256, 256))).sum()
        rt.release_after(x, [(0, lease)])
        # Demand for two other experts must wait for the release, then take those rows.
        await rt.ensure(0, [12, 13])
        table = np.array(rt.lookup(0))
        assert sorted(table[[12, 13]].tolist()) == sorted(rows)
        assert (table[[10, 11]] == -1).all()
        _assert_rows_match(rt, store)
        _assert_clean(rt)


@pytest.mark.anyio
async def test_bad_ids_are_rejected_with_the_value(store: ExpertStore) -> None:
    async with Runtime(store, resident=0.25, side_rows=2) as rt:
        with pytest.raises(LedgerError, match="16"):
            await rt.ensure(0, [16])
        with pytest.raises(LedgerError, match="-1"):
            await rt.ensure(0, [-1])
        with pytest.raises(LedgerError, match="float"):
            await rt.ensure(0, np.array([1.5]))
        _assert_clean(rt)


@pytest.mark.anyio
async def test_ensure_never_evicts_a_member_of_its_own_batch(store: ExpertStore) -> None:
    # LRU with two side rows: 10 then 11 are LIVE, 10 the least recent. A demand for {10, 12}
    # must evict 11 (not 10, which it also needs) and return with both present.
    async with Runtime(store, resident=0.25, side_rows=2, policy="lru") as rt:
        await rt.ensure(0, [10])
        await rt.ensure(0, [11])
        await rt.ensure(0, [10, 12])
        table = np.array(rt.lookup(0))
        assert (table[[10, 12]] >= 0).all() and table[11] == -1
        _assert_rows_match(rt, store)
        _assert_clean(rt)


@pytest.mark.anyio
async def test_lazy_prediction_reads_start_without_further_calls(store: ExpertStore) -> None:
    async with Runtime(store, resident=0.25, side_rows=4) as rt:
        ids = mx.array([13, 14], dtype=mx.int32) + mx.zeros((2,), dtype=mx.int32)  # lazy
        handle = rt.prefetch(0, ids)
        with anyio.fail_after(10):
            while not handle.done():  # nothing but the runtime itself gets the reads going
                await anyio.sleep(0.001)
        assert (rt.ledger(0).lookup()[[13, 14]] >= 0).all()
        handle = rt.prefetch(1, mx.array([9], dtype=mx.int32) * 1)
        await handle
        assert rt.ledger(1).lookup()[9] >= 0
        _assert_rows_match(rt, store)
        _assert_clean(rt)


@pytest.mark.anyio
async def test_release_after_an_array_nobody_evaluates(store: ExpertStore) -> None:
    # The forward normally evaluates what it hands to release_after; if nothing does, the rows
    # must still come back (the runtime awaits, hence schedules, the array) rather than stay pinned.
    async with Runtime(store, resident=0.25, side_rows=2) as rt:
        await rt.ensure(0, [10, 11])
        lease = rt.lease(0, [10, 11])
        rt.release_after(mx.ones((64, 64)).sum() * 2, [(0, lease)])
        with anyio.fail_after(10):
            await rt.ensure(0, [12, 13])  # needs both leased rows
        assert not rt.ledger(0).pinned_rows()
        await rt.drain()
        _assert_clean(rt)


@pytest.mark.anyio
async def test_a_bad_prediction_fails_its_handle_not_the_runtime(store: ExpertStore) -> None:
    async with Runtime(store, resident=0.25, side_rows=2) as rt:
        # 99 is out of range. A lazy prediction is computed, then rejected; one computed already
        # (a prediction that crossed a pipeline boundary) is rejected at once; both fail only
        # their handle.
        for n, ids in enumerate([mx.array([3, 80]) + mx.array([0, 19]), mx.array([3, 99])], start=1):
            bad = rt.prefetch(0, ids)
            with pytest.raises(ExceptionGroup) as group:
                await bad.wait()
            assert any("99" in str(e) for e in group.value.exceptions)
            assert rt.stats()["failed_predictions"] == n
        # The runtime goes on serving.
        await rt.ensure(0, [12])
        await rt.drain()
        _assert_clean(rt)


@pytest.mark.anyio
async def test_a_demand_that_can_never_fit_counts_no_hits_or_misses(store: ExpertStore) -> None:
    # The forward retries a CapacityError in smaller groups; counting the refused batch too would
    # count its experts twice.
    from asyncside.errors import CapacityError

    async with Runtime(store, resident=0.25, side_rows=2) as rt:
        with pytest.raises(CapacityError):
            await rt.ensure(0, [9, 10, 11])
        assert (rt.stats()["hits"], rt.stats()["misses"]) == (0, 0)
        await rt.ensure(0, [0, 9, 10])  # expert 0 is resident
        assert (rt.stats()["hits"], rt.stats()["misses"]) == (1, 2)
        _assert_clean(rt)


def test_importing_the_runtime_pays_numpys_lazy_import_up_front() -> None:
    """numpy imports numpy.ma on the first np.unique (10-17 ms on the dev VM), which a step's
    routing calls: the runtime imports it itself, so that is not paid on the event loop."""
    code = "import sys, asyncside.runtime; print('numpy.ma' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "True"


@pytest.mark.anyio
async def test_an_error_of_the_body_reaches_the_caller_as_raised(store: ExpertStore) -> None:
    # The runtime's task group is its own: the caller's error is not wrapped in an ExceptionGroup
    # (a command line catching a refusal would print a traceback instead of the message).
    with pytest.raises(KeyError, match="mine"):
        async with Runtime(store, resident=0.25, side_rows=4, reader="threads"):
            raise KeyError("mine")
    with pytest.raises(LedgerError):
        async with Runtime(store, resident=0.25, side_rows=4, reader="threads") as rt:
            await rt.ensure(0, [store.layer(0).n_experts])  # an id past the layer's experts
    from asyncside.looplag import measure_loop_lag

    with pytest.raises(KeyError, match="mine"):
        async with measure_loop_lag():
            raise KeyError("mine")
