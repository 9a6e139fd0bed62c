"""Fault classes found by trying the runtime as a new user would, each on real files.

Every test here failed on the code before its fix: a hang (cancelled entry, two demands evicting
each other), a blocked loop (a FIFO blob opened on the loop thread), leaked FILLING rows and raw
RuntimeError/FileNotFoundError (errors while starting a read), a stale lookup table (one-shot
drops), rejected empty/uint64 ids, a reader holding its eventfd after close, a lease never
released passing the audit. Each ends with the ledgers auditing clean and descriptors balanced.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import anyio
import anyio.lowlevel
import mlx.core as mx
import numpy as np
import pytest
from _fault_helpers import LOOPS, assert_ledgers_clean, describe_fds, open_fds, run_guarded

import asyncside._native as native
from asyncside import ExpertStore
from asyncside.errors import AsyncsideError, FillError, LedgerError, StoreError
from asyncside.ledger import Ledger
from asyncside.pools import PoolSet
from asyncside.runtime import Runtime
from asyncside.scheduler import Scheduler
from asyncside.testing import audit_problems, random_layers

from conftest import HAVE_URING

READERS = [
    pytest.param("io_uring", marks=pytest.mark.skipif(not HAVE_URING, reason="io_uring unavailable here")),
    "threads",
    "aiofiles",
]


def _store(path: Path, n_layers: int = 2, n_experts: int = 16) -> ExpertStore:
    return ExpertStore.create(path, random_layers(n_layers, n_experts, seed=3))


@pytest.fixture
def store(tmp_path: Path) -> ExpertStore:
    return _store(tmp_path / "store")


# ---- 1. cancelling while `async with Runtime(...)` is entering ------------------------------------


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("loop", LOOPS)
def test_cancel_during_entry_never_hangs(loop: tuple[str, dict], reader: str, store: ExpertStore) -> None:
    """Cancel the entry after 0..39 scheduling steps and after sleeps that land inside the thread
    hops (reader construction, pool allocation, blob opens, resident reads): every attempt ends,
    cancelled or entered, and leaves no descriptor behind."""

    async def attempt(cancel_after: int | None, delay: float | None, counts: dict[str, int]) -> None:
        scope = anyio.CancelScope()

        async def canceller() -> None:
            if cancel_after is not None:
                for _ in range(cancel_after):
                    await anyio.lowlevel.checkpoint()
            else:
                await anyio.sleep(delay or 0)
            scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(canceller)
            with scope:
                async with Runtime(store, resident=0.25, side_rows=4, reader=reader) as rt:
                    counts["entered"] += 1
                    await rt.ensure(0, [12, 13])
                    assert_ledgers_clean(rt)
                    await anyio.sleep_forever()
            counts["cancelled"] += scope.cancelled_caught

    async def sweep() -> dict[str, int]:
        counts = {"entered": 0, "cancelled": 0}
        await attempt(None, 0.5, counts)  # warm up: the loop's own descriptors now exist
        for _ in range(3):
            await anyio.lowlevel.checkpoint()
        before = open_fds()
        for k in range(40):
            await attempt(k, None, counts)
        for i in range(30):
            await attempt(None, i * 0.0004, counts)
        for _ in range(3):
            await anyio.lowlevel.checkpoint()
        leaked = open_fds() - before
        assert not leaked, describe_fds(leaked)
        return counts

    counts = run_guarded(sweep, loop=loop)
    assert counts["cancelled"] == 71  # every attempt ended by its cancellation, none hung


# ---- 2. a blob whose open() blocks (a FIFO) --------------------------------------------------------


def _replace_with_fifo(path: Path) -> None:
    """Set-up work for a watched test, run off the loop thread: unlinking a blob waits on the
    filesystem (on a busy machine, once, 0.5 s: two suites at once), which is not the code under test."""
    os.unlink(path)
    os.mkfifo(path)


class _FifoUnblocker:
    """Opens a FIFO for writing after ``after_s``, so that code stuck in open() of it for reading
    returns (and the test then fails on the blocked loop instead of hanging)."""

    def __init__(self, path: Path, after_s: float = 1.0) -> None:
        self.path, self.after_s = path, after_s
        self._stop = threading.Event()
        self._fds: list[int] = []
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        if self._stop.wait(self.after_s):
            return
        while not self._stop.wait(0.01):
            try:
                self._fds.append(os.open(self.path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # ENXIO: nobody has it open for reading (yet)
                pass

    def stop(self) -> None:
        self._stop.set()
        self._t.join()
        for fd in self._fds:
            os.close(fd)


@pytest.mark.anyio
@pytest.mark.parametrize("reader", READERS)
async def test_fifo_blob_fails_runtime_entry_without_blocking_the_loop(
    store: ExpertStore, reader: str, no_blocking: object
) -> None:
    spec = store.layer(1)
    await anyio.to_thread.run_sync(_replace_with_fifo, spec.path)
    unblock = _FifoUnblocker(spec.path)
    before = open_fds()
    try:
        with pytest.raises(StoreError, match="not a regular file") as info:
            async with Runtime(store, resident=0.25, side_rows=4, reader=reader):
                pass
    finally:
        unblock.stop()
    assert str(spec.path) in str(info.value) and info.value.errno == errno.EINVAL
    leaked = open_fds() - before
    assert not leaked, describe_fds(leaked)


@pytest.mark.anyio
@pytest.mark.parametrize("reader", READERS)
async def test_fifo_blob_fails_scheduler_fills_without_blocking_the_loop(
    store: ExpertStore, reader: str, no_blocking: object
) -> None:
    spec = store.layer(0)
    ledger = Ledger(spec.n_experts, resident=[], side_rows=4)
    pools = await PoolSet.allocate(spec, ledger.rows)
    await anyio.to_thread.run_sync(_replace_with_fifo, spec.path)
    unblock = _FifoUnblocker(spec.path)
    try:
        async with Scheduler(reader) as sched:
            hs = sched.submit(spec, pools, ledger.reserve([1, 2]))
            for h in hs:
                h.add_done_callback(lambda h: ledger.fail(h.fill) if h.result_error() else ledger.publish(h.fill))
            for h in hs:
                with pytest.raises(FillError, match="not a regular file") as info:
                    await h.wait()
                assert info.value.errno == errno.EINVAL and str(spec.path) in str(info.value)
            with pytest.raises(OSError, match="not a regular file"):
                await sched.prepare(spec, pools)
    finally:
        unblock.stop()
    assert ledger.audit().ok and not ledger.pending() and len(ledger.free_rows()) == 4


# ---- 3. errors while starting a fill ------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("reader", READERS)
async def test_missing_blob_at_first_use_fails_fills_with_fill_error(
    store: ExpertStore, reader: str, no_blocking: object
) -> None:
    """The blob vanished between ExpertStore.open and the first fill: the fills fail with a
    FillError (ENOENT, naming the file), rows go back to FREE, the scheduler closes cleanly; the
    blob renamed back, the next submit opens it and reads."""
    spec = store.layer(0)
    ledger = Ledger(spec.n_experts, resident=[], side_rows=4)
    pools = await PoolSet.allocate(spec, ledger.rows)
    hidden = spec.path.with_name("hidden.bin")
    await anyio.to_thread.run_sync(os.rename, spec.path, hidden)  # set-up: off the watched loop thread

    def wire(hs: list) -> None:
        for h in hs:
            h.add_done_callback(lambda h: ledger.fail(h.fill) if h.result_error() else ledger.publish(h.fill))

    async with Scheduler(reader) as sched:
        hs = sched.submit(spec, pools, ledger.reserve([3, 4]))
        wire(hs)
        await sched.join()
        for h in hs:
            err = h.result_error()
            assert isinstance(err, FillError) and err.errno == errno.ENOENT and str(spec.path) in str(err)
        assert not ledger.pending() and len(ledger.free_rows()) == 4
        await anyio.to_thread.run_sync(os.rename, hidden, spec.path)
        hs = sched.submit(spec, pools, ledger.reserve([3, 4]))
        wire(hs)
        for h in hs:
            await h.wait()
    assert ledger.audit().ok and sorted(ledger.live()) == [3, 4]


@pytest.mark.anyio
@pytest.mark.parametrize("reader", READERS)
async def test_missing_blob_fails_runtime_entry_with_store_error(store: ExpertStore, reader: str) -> None:
    spec = store.layer(1)
    os.unlink(spec.path)
    before = open_fds()
    with pytest.raises(StoreError, match="cannot open the blob") as info:
        async with Runtime(store, resident=0.25, side_rows=4, reader=reader):
            pass
    assert info.value.errno == errno.ENOENT and str(spec.path) in str(info.value)
    leaked = open_fds() - before
    assert not leaked, describe_fds(leaked)


@pytest.mark.anyio
@pytest.mark.parametrize("reader", READERS)
async def test_unreadable_blob_fails_fills_and_frees_rows(tmp_path: Path, reader: str, no_blocking: object) -> None:
    """Reads that fail on a real file: as root a blob replaced by /proc/self/mem (a regular file
    whose reads at these offsets fail with EIO; root ignores permission bits), else a chmod 000
    blob. ensure() raises FillError, drain() reports every failure and returns, rows are FREE."""
    # Writing the store fsyncs: set-up work, done off the watched loop thread.
    store = await anyio.to_thread.run_sync(_store, tmp_path / "s")
    spec = store.layer(0)
    if os.geteuid() == 0:

        def to_proc_mem() -> None:
            os.unlink(spec.path)
            os.symlink("/proc/self/mem", spec.path)

        await anyio.to_thread.run_sync(to_proc_mem)  # set-up: off the watched loop thread
        expect_errno = errno.EIO
    else:
        os.chmod(spec.path, 0)
        expect_errno = errno.EACCES
    try:
        if expect_errno == errno.EACCES:
            with pytest.raises(StoreError, match="Permission denied"):
                async with Runtime(store, pinned={0: [], 1: []}, side_rows=4, reader=reader):
                    pass
            return
        async with Runtime(store, pinned={0: [], 1: []}, side_rows=4, reader=reader) as rt:
            with pytest.raises(FillError) as info:
                await rt.ensure(0, [2, 3])
            assert info.value.errno == expect_errno and info.value.layer == 0
            rt.prefetch(0, [4, 5])
            with pytest.raises(ExceptionGroup) as group:
                await rt.drain(0)
            assert all(isinstance(e, FillError) for e in group.value.exceptions)
            assert {e.expert for e in group.value.exceptions} >= {4, 5}
            await rt.drain()  # reported once: nothing left
            await rt.ensure(1, [2, 3])  # the other layer is fine
            assert len(rt.ledger(0).free_rows()) == 4
            assert_ledgers_clean(rt)
    finally:
        if expect_errno == errno.EACCES:
            os.chmod(spec.path, 0o644)


@pytest.mark.anyio
async def test_use_after_close_is_a_clear_error(store: ExpertStore) -> None:
    async with Runtime(store, resident=0.25, side_rows=4) as rt:
        await rt.ensure(0, [12])
        table = np.array(rt.lookup(0))
    with pytest.raises(AsyncsideError, match="closed"):
        rt.prefetch(0, [13, 14])
    with pytest.raises(AsyncsideError, match="closed"):
        rt.prefetch(0, mx.array([13, 14]))
    with pytest.raises(AsyncsideError, match="closed"):
        await rt.ensure(0, [13])
    await rt.drain()  # returns: nothing outstanding
    assert np.array_equal(np.array(rt.lookup(0)), table)
    assert_ledgers_clean(rt)


@pytest.mark.anyio
async def test_a_prediction_pending_at_close_fails_its_handle(store: ExpertStore) -> None:
    gate = native.testing.StreamGate()
    async with Runtime(store, resident=0.25, side_rows=4) as rt:
        # Computed only once the gate opens. The sum stays on the gate's CPU stream: on MLX CUDA a
        # GPU op on a CPU stream's output makes async_eval wait for that output on the calling
        # thread (the event loop), and the gate then held the loop, not the prediction.
        handle = rt.prefetch(0, mx.add(gate.hold(mx.array([13, 14])), 0, stream=mx.cpu))
        await anyio.sleep(0.01)
    gate.open()
    assert handle.done()
    with pytest.raises(ExceptionGroup) as group:
        await handle.wait()
    assert "closed" in str(group.value.exceptions[0])
    assert_ledgers_clean(rt)


@pytest.mark.anyio
@pytest.mark.parametrize("reader", READERS)
async def test_o_direct_refused_by_the_filesystem(ramfs: Path, reader: str, no_blocking: object) -> None:
    store = await anyio.to_thread.run_sync(_store, ramfs / "s")
    with pytest.raises(StoreError, match="O_DIRECT") as info:
        async with Runtime(store, resident=0.25, side_rows=4, reader=reader, direct=True):
            pass
    assert info.value.errno == errno.EINVAL
    spec = store.layer(0)
    ledger = Ledger(spec.n_experts, resident=[], side_rows=2)
    pools = await PoolSet.allocate(spec, ledger.rows)
    async with Scheduler(reader, direct=True) as sched:
        hs = sched.submit(spec, pools, ledger.reserve([5, 6]))
        for h in hs:
            h.add_done_callback(lambda h: ledger.fail(h.fill) if h.result_error() else ledger.publish(h.fill))
        await sched.join()
    assert all(h.result_error() is not None and h.result_error().errno == errno.EINVAL for h in hs)
    assert "O_DIRECT" in str(hs[0].result_error())
    assert ledger.audit().ok and len(ledger.free_rows()) == 2
    async with Runtime(store, resident=0.25, side_rows=4, reader=reader, direct=False) as rt:
        await rt.ensure(0, [12, 13])  # buffered reads work on the same filesystem
        assert_ledgers_clean(rt)


# ---- 4. concurrent demands must make progress ------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("policy,side_rows", [("lfu", 2), ("lru", 2), ("aging-lfu", 2), ("oneshot", 2), ("oneshot", 4)])
async def test_concurrent_ensures_that_cannot_be_held_together_make_progress(
    store: ExpertStore, policy: str, side_rows: int
) -> None:
    """Two tasks each want two experts of one layer, over and over; with two side rows the sets
    cannot be held together (with one-shot and four rows they can, but each reserve used to drop
    the other's). A livelock shows as fills without end: the watchdog fails the test once far more
    fills happened than the work needs (a count, not a time)."""
    rounds = 6
    async with Runtime(store, pinned={0: [], 1: []}, side_rows=side_rows, policy=policy) as rt:
        done: list[list[int]] = []

        async def want(ids: list[int], lease: bool) -> None:
            for _ in range(rounds):
                await rt.ensure(0, ids)
                assert (np.array(rt.lookup(0))[ids] >= 0).all()
                if lease:  # what a forward does right after
                    lid = rt.lease(0, ids)
                    await anyio.lowlevel.checkpoint()
                    rt.release(0, lid)
            done.append(ids)

        async def watchdog() -> None:
            while len(done) < 4:
                assert rt.stats()["fills"] < 50 * rounds, f"livelock: {rt.stats()['fills']} fills"
                await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tg:
            tg.start_soon(watchdog)
            tg.start_soon(want, [0, 1], False)
            tg.start_soon(want, [2, 3], False)
            tg.start_soon(want, [4, 5], True)
            tg.start_soon(want, [0, 6], True)
        await rt.drain()
        assert_ledgers_clean(rt)


# ---- 5. a record with a flipped byte ------------------------------------------------------------------


def _flip(spec, expert: int, segment: int = 0, at: int = 5) -> None:  # type: ignore[no-untyped-def]
    with open(spec.path, "r+b") as fh:
        fh.seek(expert * spec.stride + spec.segments[segment].offset + at)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 0x01]))


@pytest.mark.anyio
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("checksum", ["crc32c", "crc32"])
async def test_flipped_byte_is_never_served(tmp_path: Path, reader: str, direct: bool, checksum: str,
                                            no_blocking: object) -> None:
    """One bit flipped in a record (after the store was written): the fill fails with a FillError
    naming layer, expert, row, expected and got (errno EBADMSG); its row goes back to FREE and the
    lookup table never lists it; the intact records are served. crc32: a version-1 store."""

    def damaged_store() -> ExpertStore:
        # Set-up (writes and fsyncs): run off the watched loop thread.
        store = ExpertStore.create(tmp_path / "s", random_layers(2, 16, seed=5), checksum=checksum)
        if checksum == "crc32":
            manifest = store.path / "manifest.json"
            manifest.write_text(manifest.read_text().replace('"version": 2', '"version": 1'))
            store = ExpertStore.open(store.path)
            assert store.version == 1
        _flip(store.layer(0), 13, segment=2, at=100)
        return store

    store = await anyio.to_thread.run_sync(damaged_store)
    spec = store.layer(0)
    async with Runtime(store, pinned={0: [], 1: []}, side_rows=4, reader=reader, direct=direct) as rt:
        with pytest.raises(FillError, match="checksum mismatch") as info:
            await rt.ensure(0, [12, 13])
        err = info.value
        assert (err.layer, err.expert, err.errno) == (0, 13, errno.EBADMSG)
        assert err.expected == spec.checksums[13] and err.got != err.expected
        assert f"{err.expected:#010x}" in str(err) and f"{err.got:#010x}" in str(err) and f"row {err.row}" in str(err)
        # ensure() raised the first failure it met; 12's read may still be in flight: drain first.
        with pytest.raises(ExceptionGroup) as group:
            await rt.drain(0)
        assert [e.expert for e in group.value.exceptions] == [13]
        table = np.array(rt.lookup(0))
        assert table[13] == -1 and table[12] >= 0
        assert err.row in rt.ledger(0).free_rows()
        await rt.ensure(1, [13])  # the other layer's record 13 is intact
        assert_ledgers_clean(rt)
    # Opting out serves whatever the disk holds.
    async with Runtime(store, pinned={0: [], 1: []}, side_rows=4, reader=reader, direct=direct,
                       verify=False) as rt:
        await rt.ensure(0, [13])
        row = int(np.array(rt.lookup(0))[13])
        seg = spec.segments[2]
        record = await anyio.to_thread.run_sync(lambda: store.read_record(0, 13, verify=False))
        on_disk = record[seg.offset : seg.end]  # the flipped bytes
        assert rt._s.layer(0).pools.row_bytes(seg.key, row) == on_disk
        assert rt.stats()["fills"] == 1


@pytest.mark.anyio
async def test_flipped_byte_in_a_resident_record_fails_entry(store: ExpertStore) -> None:
    resident = {0: [0, 1, 2, 3], 1: []}
    _flip(store.layer(0), 2)
    with pytest.raises(ExceptionGroup) as group:
        async with Runtime(store, pinned=resident, side_rows=4):
            pass
    (err,) = group.value.exceptions
    assert isinstance(err, FillError) and err.expert == 2 and err.errno == errno.EBADMSG


# ---- 6. one-shot drops without a fill ---------------------------------------------------------------------


@pytest.mark.anyio
async def test_oneshot_drop_without_a_fill_updates_lookup(store: ExpertStore) -> None:
    async with Runtime(store, pinned={0: [], 1: []}, side_rows=4, policy="oneshot") as rt:
        await rt.ensure(0, [9, 10])
        assert (np.array(rt.lookup(0))[[9, 10]] >= 0).all()
        await rt.prefetch(0, [9])  # 9 is LIVE: no fill; one-shot drops 10
        table = np.array(rt.lookup(0))
        assert table[10] == -1 and table[9] >= 0
        with pytest.raises(LedgerError, match="expert 10"):
            rt.lease(0, [10])  # the table said so: nobody leases it
        assert_ledgers_clean(rt)


# ---- 7. empty and out-of-range ids -------------------------------------------------------------------------


@pytest.mark.anyio
async def test_empty_ids_do_nothing_and_uint64_ids_are_reported_as_given(store: ExpertStore) -> None:
    async with Runtime(store, resident=0.25, side_rows=4) as rt:
        before = rt.stats()
        await rt.ensure(0, [])
        await rt.ensure(0, np.array([], dtype=np.int32))
        await rt.ensure(0, mx.array([], dtype=mx.int32))
        await rt.prefetch(0, [])
        await rt.prefetch(0, mx.array([], dtype=mx.int32))
        after = rt.stats()
        assert (after["fills"], after["hits"], after["misses"]) == (before["fills"], before["hits"], before["misses"])
        big = np.array([3, 2**64 - 1], dtype=np.uint64)
        with pytest.raises(LedgerError, match="18446744073709551615"):
            await rt.ensure(0, big)
        with pytest.raises(LedgerError, match="18446744073709551615"):
            await rt.prefetch(0, big)
        assert_ledgers_clean(rt)


# ---- 8. a closed reader holds no descriptor ---------------------------------------------------------------


@pytest.mark.parametrize("backend", ["io_uring", "threads"])
def test_native_reader_close_releases_its_eventfd(backend: str) -> None:
    if backend == "io_uring" and not HAVE_URING:
        pytest.skip("io_uring unavailable here")
    before = open_fds()
    r = native.Reader(backend)
    fd = r.event_fd
    assert fd in open_fds() - before
    r.close()
    assert r.event_fd == -1
    leaked = open_fds() - before
    assert not leaked, describe_fds(leaked)  # r is still referenced: not the garbage collector
    assert r.reap() == [] and r.wait(0) is False
    r.close()  # idempotent
    del r


# ---- 11. a lease never released -------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_lease_never_released_fails_the_audit_after_close(store: ExpertStore) -> None:
    async with Runtime(store, resident=0.25, side_rows=4) as rt:
        await rt.ensure(0, [12])
        rt.lease(0, [12])  # never released
        assert not audit_problems(rt)  # while running, an open lease is normal
    problems = audit_problems(rt)
    assert problems and "lease" in problems[0] and "never released" in problems[0], problems
    assert not rt.audit()[0].ok and rt.audit()[1].ok
