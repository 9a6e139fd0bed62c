"""Faults on the read path, over all three readers: short reads continue, EAGAIN/EINTR retry, EIO
and a truncated blob fail exactly that fill with a FillError its awaiter sees, and a cancelled
await (or a cancelled scheduler) leaves the row FILLING until the read really completes. Every
test ends with the ledger's audit clean, no row leaked and the native counters balanced."""

from __future__ import annotations

import errno
import os
import shutil

import anyio
import numpy as np
import pytest

import asyncside._native as native
from asyncside.errors import FillError
from asyncside.ledger import Ledger
from asyncside.pools import PoolSet
from asyncside.readers import ReaderOptions
from asyncside.scheduler import FillHandle, Scheduler
from asyncside.store import ExpertStore, LayerSpec

from _read_helpers import assert_balanced, check_rows, rows_equal_store

pytestmark = pytest.mark.anyio

DIRECT = [pytest.param(False, id="buffered"), pytest.param(True, id="direct")]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _layer(n: int, seed: int, big: int) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    return {
        "w": g.integers(0, 2**32, size=(n, big // 4), dtype=np.uint32),
        "s": g.integers(0, 2**16, size=(n, 333), dtype=np.uint16),  # odd byte count, unaligned
        "b": g.integers(0, 256, size=(n, 1), dtype=np.uint8),  # 1 byte
    }


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> ExpertStore:
    """8 experts of ~96 KiB records (several ops each with small chunks)."""
    return ExpertStore.create(tmp_path_factory.mktemp("faults") / "s", {2: _layer(8, 5, 96 << 10)})


@pytest.fixture(scope="module")
def big_store(tmp_path_factory: pytest.TempPathFactory) -> ExpertStore:
    """2 experts of 16 MiB records: with 4 KiB reads a fill takes thousands of ops."""
    return ExpertStore.create(tmp_path_factory.mktemp("big") / "s", {0: _layer(2, 9, 16 << 20)}, checksum=None)


def wire(ledger: Ledger, handles: list[FillHandle]) -> None:
    """What the runtime does: publish on success, fail on error, on the loop thread."""
    for h in handles:
        h.add_done_callback(lambda h: ledger.fail(h.fill) if h.result_error() else ledger.publish(h.fill))


def assert_no_leak(ledger: Ledger) -> None:
    report = ledger.audit()
    assert report.ok, report.problems
    assert not ledger.pending()
    assert len(ledger.free_rows()) + len(ledger.live()) == ledger.side_rows  # every row FREE or LIVE


@pytest.mark.parametrize("direct", DIRECT)
async def test_short_reads_continue(reader: str, direct: bool, store: ExpertStore, no_blocking: object) -> None:
    spec = store.layer(2)
    ledger = Ledger(spec.n_experts, resident=[], side_rows=spec.n_experts)
    pools = await PoolSet.allocate(spec, rows=ledger.rows)
    options = ReaderOptions(direct=direct, queue_depth=3, chunk_bytes=32 << 10, buffered_chunk_bytes=32 << 10)
    async with Scheduler(reader, options) as sched:
        sched.set_faults(max_read_bytes=1000)  # every op returns <= 1000 bytes (4096 for O_DIRECT)
        hs = sched.submit(spec, pools, ledger.reserve(range(spec.n_experts)))
        wire(ledger, hs)
        await sched.join()
    c = sched.stats()["native"]
    assert all(h.result_error() is None for h in hs)
    await check_rows(store, 2, pools, ledger.live().items())
    assert c["short_reads"] > spec.n_experts, c
    assert_balanced(c)
    assert_no_leak(ledger)



@pytest.mark.parametrize("err", [errno.EAGAIN, errno.EINTR], ids=["EAGAIN", "EINTR"])
async def test_transient_errors_are_retried(reader: str, err: int, store: ExpertStore, no_blocking: object) -> None:
    spec = store.layer(2)
    ledger = Ledger(spec.n_experts, resident=[], side_rows=4)
    pools = await PoolSet.allocate(spec, rows=ledger.rows)
    options = ReaderOptions(queue_depth=4, chunk_bytes=16 << 10, buffered_chunk_bytes=16 << 10)
    async with Scheduler(reader, options) as sched:
        sched.set_faults(transient_every=3, transient_err=err)
        hs = sched.submit(spec, pools, ledger.reserve([0, 3, 5, 7]))
        wire(ledger, hs)
        for h in hs:
            await h.wait()  # none raises
    c = sched.stats()["native"]
    assert c["retries"] > 0 and c["retries"] == c["faults_injected"], c
    await check_rows(store, 2, pools, ledger.live().items())
    assert_balanced(c)
    assert_no_leak(ledger)


@pytest.mark.parametrize("direct", DIRECT)
async def test_eio_fails_exactly_that_fill(reader: str, direct: bool, store: ExpertStore, no_blocking: object) -> None:
    """An injected EIO inside expert 3's record: its awaiter gets FillError(errno=EIO) naming the
    file; the ledger returns its row; every other fill lands."""
    spec = store.layer(2)
    ledger = Ledger(spec.n_experts, resident=[], side_rows=5)
    pools = await PoolSet.allocate(spec, rows=ledger.rows)
    bad = 3
    lo = bad * spec.stride + spec.segments[0].nbytes // 2
    options = ReaderOptions(direct=direct, queue_depth=2, chunk_bytes=16 << 10, buffered_chunk_bytes=16 << 10)
    async with Scheduler(reader, options) as sched:
        sched.set_faults(path=str(spec.path), lo=lo, hi=lo + 1, err=errno.EIO)
        fills = ledger.reserve([1, bad, 4, 6, 0])
        hs = sched.submit(spec, pools, fills)
        wire(ledger, hs)
        for h in hs:
            if h.fill.expert == bad:
                with pytest.raises(FillError) as info:
                    await h.wait()
                assert info.value.errno == errno.EIO and info.value.expert == bad and info.value.layer == 2
                assert str(spec.path) in str(info.value) and "Input/output error" in str(info.value)
            else:
                await h.wait()
    c = sched.stats()["native"]
    assert c["fills_failed"] == 1, c
    assert ledger.row_of(bad) is None and not ledger.is_filling(bad)
    await check_rows(store, 2, pools, ledger.live().items())
    assert sorted(ledger.live()) == [0, 1, 4, 6]
    assert_balanced(c)
    assert_no_leak(ledger)


@pytest.mark.parametrize("direct", DIRECT)
async def test_truncated_blob_fails_with_end_of_file(reader: str, direct: bool, store: ExpertStore,
                                                     tmp_path: os.PathLike[str], no_blocking: object) -> None:
    """A real EOF: the blob is cut inside the last record (after the store was opened). Reading that
    record fails with FillError(errno=ENODATA, 'end of file'); earlier records still land."""

    def truncated_copy() -> ExpertStore:
        # Set-up (copies the store): run off the watched loop thread.
        copy = ExpertStore.open(shutil.copytree(store.path, os.path.join(tmp_path, "s")))
        spec = copy.layer(2)
        os.truncate(spec.path, (spec.n_experts - 1) * spec.stride + spec.segments[0].nbytes + 10)
        return copy

    copy = await anyio.to_thread.run_sync(truncated_copy)
    spec = copy.layer(2)
    last = spec.n_experts - 1
    ledger = Ledger(spec.n_experts, resident=[], side_rows=3)
    pools = await PoolSet.allocate(spec, rows=ledger.rows)
    options = ReaderOptions(direct=direct, chunk_bytes=16 << 10, buffered_chunk_bytes=16 << 10)
    async with Scheduler(reader, options) as sched:
        hs = sched.submit(spec, pools, ledger.reserve([last, 0, 2]))
        wire(ledger, hs)
        with pytest.raises(FillError, match="end of file") as info:
            await hs[0].wait()
        assert info.value.errno == errno.ENODATA and info.value.expert == last
        await hs[1].wait()
        await hs[2].wait()
    assert sorted(ledger.live()) == [0, 2]
    await check_rows(store, 2, pools, ledger.live().items())
    assert_balanced(sched.stats()["native"])
    assert_no_leak(ledger)


async def test_cancelled_await_keeps_row_filling_until_read_completes(reader: str, big_store: ExpertStore, no_blocking: object) -> None:
    """Cancel the awaiter mid-read: the handle is not done, the native read is still in flight and
    the ledger still has the row FILLING (a second reserve does not re-read it). The read then
    completes, the callback publishes, the bytes are right."""
    spec = big_store.layer(0)
    ledger = Ledger(spec.n_experts, resident=[], side_rows=2)
    pools = await PoolSet.allocate(spec, rows=ledger.rows)
    async with Scheduler(reader) as sched:
        await sched.prepare(spec, pools)  # the blob is open: the read starts inside submit
        # ~33,000 ops for this 16 MiB record: the read must still be going when the await below is
        # cancelled (with 4 KiB ops the threads reader sometimes finished first on a loaded VM).
        sched.set_faults(max_read_bytes=512)
        (h,) = hs = sched.submit(spec, pools, ledger.reserve([1]))
        wire(ledger, hs)
        with anyio.CancelScope() as scope:
            scope.cancel()
            await h.wait()
        assert scope.cancelled_caught
        assert not h.done() and ledger.is_filling(1)
        # Normally the reader is still on it; on a loaded machine (the loop descheduled, a long GC
        # pause) the native read may have finished already. Either way the row stays FILLING
        # until the completion reaches the loop, which is what this test is about.
        assert sched.stats()["native"]["in_flight"] in (0, 1)
        assert ledger.reserve([1]) == []  # FILLING counts as present: no second read, no second row
        await sched.join()
        assert h.done() and h.result_error() is None
    assert ledger.row_of(1) == h.fill.row
    await check_rows(big_store, 0, pools, [(1, h.fill.row)])
    assert_balanced(sched.stats()["native"])
    assert_no_leak(ledger)


async def test_cancelled_scheduler_waits_for_reads_in_flight(reader: str, big_store: ExpertStore, no_blocking: object) -> None:
    """Cancel the whole scope around the scheduler while reads are in flight: leaving the context
    still waits (shielded) for every read, runs every callback, and closes with counters balanced."""
    spec = big_store.layer(0)
    ledger = Ledger(spec.n_experts, resident=[], side_rows=2)
    pools = await PoolSet.allocate(spec, rows=ledger.rows)
    with anyio.CancelScope() as outer:
        async with Scheduler(reader) as sched:
            await sched.prepare(spec, pools)  # the blob is open: the reads start inside submit
            sched.set_faults(max_read_bytes=16384)
            hs = sched.submit(spec, pools, ledger.reserve([0, 1]))
            wire(ledger, hs)
            outer.cancel()
            await anyio.sleep(1)  # cancelled right here
    assert outer.cancelled_caught
    assert all(h.done() and h.result_error() is None for h in hs)
    await check_rows(big_store, 0, pools, [(e, ledger.row_of(e)) for e in (0, 1)])
    assert_balanced(sched.stats()["native"])
    assert_no_leak(ledger)


def test_native_close_waits_for_reads_and_staging(native_reader: str, store: ExpertStore) -> None:
    """The native safety net, without Python's scheduler: close() with fills in flight waits for
    them; staging (one slot for many staged fills: backpressure) all comes back; bytes are right."""
    spec: LayerSpec = store.layer(2)
    # Host pools on every device: the reader writes the MLX arrays themselves, which rows_equal_store
    # reads back (device pools would be read through their host mirror, which this layout bypasses).
    pools = PoolSet(spec, rows=spec.n_experts, device=False)
    r = native.Reader(native_reader, ReaderOptions(direct=True, staging_bytes=64 << 10, slot_bytes=64 << 10,
                                             chunk_bytes=64 << 10, buffered_chunk_bytes=64 << 10))
    lid = r.add_layout(str(spec.path), spec.stride, spec.n_experts, [s.offset for s in spec.segments],
                       [s.nbytes for s in spec.segments], [pools.arrays[s.key] for s in spec.segments])
    n = spec.n_experts
    r.submit(lid, list(range(n)), list(range(n)), list(reversed(range(n))))
    r.close()
    done = r.reap()
    assert sorted(t for t, _ in done) == list(range(n)) and all(res == 0 for _, res in done)
    c = r.counters()
    assert c["staging_slots"] == 1 and c["staging_waits"] > 0 and c["fills_staged"] == n
    assert_balanced(c)
    assert c["slab_allocs"] == c["slab_frees"] == 1
    for e in range(n):
        rows_equal_store(store, 2, pools, e, n - 1 - e)


def test_native_rejects_bad_input(store: ExpertStore) -> None:
    spec = store.layer(2)
    pools = PoolSet(spec, rows=2)
    arrays = [pools.arrays[s.key] for s in spec.segments]
    offs, nbs = [s.offset for s in spec.segments], [s.nbytes for s in spec.segments]
    r = native.Reader("threads")
    with pytest.raises(ValueError, match="backend: expected 'io_uring' or 'threads', got 'mmap'"):
        native.Reader("mmap")
    with pytest.raises(ValueError, match=r"pools\[1\]: holds .* bytes, expected rows"):
        r.add_layout(str(spec.path), spec.stride, spec.n_experts, offs, [nbs[0], nbs[1] + 1, nbs[2]], arrays)
    with pytest.raises(ValueError, match="past the record stride"):
        r.add_layout(str(spec.path), 64, spec.n_experts, offs, nbs, arrays)
    with pytest.raises(FileNotFoundError, match="cannot open"):
        r.add_layout("/nonexistent/blob", spec.stride, spec.n_experts, offs, nbs, arrays)
    lid = r.add_layout(str(spec.path), spec.stride, spec.n_experts, offs, nbs, arrays)
    with pytest.raises(IndexError, match="row 2 out of range"):
        r.submit(lid, [1], [0], [2])
    with pytest.raises(IndexError, match="expert 8 out of range"):
        r.submit(lid, [1], [8], [0])
    with pytest.raises(ValueError, match="transient_every: 1"):
        r.set_faults(transient_every=1, transient_err=errno.EAGAIN)
    r.close()
    assert_balanced(r.counters())
