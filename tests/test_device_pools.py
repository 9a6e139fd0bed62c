"""Device pools (MLX CUDA): reads land in a host mirror, uploads copy rows to the device pools.

The mirror read path runs everywhere (it is plain host memory); the upload and the whole runtime
on device pools need an MLX CUDA device and are marked ``gpu`` (skipped elsewhere).
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

import anyio
import mlx.core as mx
import numpy as np
import pytest

import asyncside._native as native
from asyncside import ExpertStore
from asyncside.pools import PoolSet, device_pools_default
from asyncside.readers import ReaderOptions
from asyncside.runtime import Runtime
from asyncside.scheduler import Scheduler

CUDA = bool(getattr(mx, "cuda", None) and mx.cuda.is_available() and native.cuda_upload_available())
gpu = pytest.mark.skipif(not CUDA, reason="needs MLX CUDA and a CUDA build of asyncside._native")


def _store(path: Path, n_experts: int = 12) -> ExpertStore:
    rng = np.random.default_rng(7)
    return ExpertStore.create(path, {
        0: {
            "w": rng.integers(0, 2**32, size=(n_experts, 33, 5), dtype=np.uint32),
            "s": rng.standard_normal((n_experts, 3)).astype(np.float16),
            "b": rng.integers(0, 255, size=(n_experts, 1), dtype=np.uint8),
        },
        3: {
            "w": rng.integers(0, 2**32, size=(n_experts, 7), dtype=np.uint32),
            "s": rng.standard_normal((n_experts, 129)).astype(np.float32),
            "b": rng.integers(0, 255, size=(n_experts, 3), dtype=np.uint8),
        },
    })


def _expected(store: ExpertStore, layer: int, expert: int) -> dict[str, bytes]:
    record = store.read_record(layer, expert)
    return {s.key: bytes(record[s.offset : s.offset + s.nbytes]) for s in store.layer(layer).segments}


def test_host_mirror_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="rows"):
        native.HostMirror(0, [8])
    with pytest.raises(ValueError, match=r"segment_nbytes\[1\]"):
        native.HostMirror(4, [8, 0])
    m = native.HostMirror(3, [5, 7])
    with pytest.raises(IndexError, match="row 3"):
        m.row_view(0, 3)
    with pytest.raises(IndexError, match="segment 2"):
        m.row_view(2, 0)


@pytest.mark.anyio
@pytest.mark.parametrize("direct", [False, True])
async def test_reads_land_in_the_host_mirror(tmp_path: Path, reader: str, direct: bool) -> None:
    if reader == "aiofiles" and direct:
        pytest.skip("covered by the aiofiles reader's own O_DIRECT tests")
    store = _store(tmp_path / "store")
    gc.collect()  # mirrors of earlier tests that are garbage go now, not during this test
    before = native.mirror_counters()
    for layer in store.layers:
        spec = store.layer(layer)
        # device=True needs MLX CUDA for the pools themselves; here the mirror alone is under
        # test, so build a host PoolSet and give it a mirror exactly as a device PoolSet has.
        pools = PoolSet(spec, 5, device=False)
        pools.mirror = native.HostMirror(5, [s.nbytes for s in spec.segments])
        pools.device = True  # row_view now answers from the mirror, like on a GPU
        async with Scheduler(reader, ReaderOptions(direct=direct)) as sched:
            fills = [type("F", (), {"fill_id": i, "expert": e, "row": r})() for i, (e, r) in
                     enumerate([(11, 0), (0, 4), (5, 2), (7, 1)])]
            for h in sched.submit(spec, pools, fills):
                await h.wait()
        for f in fills:
            got = {s.key: bytes(pools.row_view(s.key, f.row)) for s in spec.segments}
            assert got == _expected(store, layer, f.expert), (layer, f.expert)
        del pools, sched  # the closed reader held the mirror until it goes
    # No mirror of this test outlives it (earlier tests' mirrors may be freed meanwhile: <=).
    # The reader was closed on an anyio worker thread, which reports the result to the loop
    # *before* it drops its own references to the call (the bound close -> reader -> mirror): the
    # loop can get here first. So the last reference goes within moments, not necessarily before
    # this line; wait for it (bounded), then check. A mirror that really leaks fails after 10 s.
    live_before = before["created"] - before["destroyed"]
    bytes_before = before["bytes_allocated"] - before["bytes_freed"]
    with anyio.move_on_after(10):
        while True:
            gc.collect()
            after = native.mirror_counters()
            if after["created"] - after["destroyed"] <= live_before:
                break
            await anyio.sleep(0.01)
    assert after["created"] - before["created"] == 2
    assert after["created"] - after["destroyed"] <= live_before
    assert after["bytes_allocated"] - after["bytes_freed"] <= bytes_before


def test_native_holders_of_a_mirror_hold_no_python_reference(tmp_path: Path) -> None:
    """A mirror given to a reader layout is held by the C++ owner made with it, not by a holder
    that keeps the Python object alive: such a holder takes the GIL when dropped, and a reader's
    close() drops its layouts' holders while callers wait on its lock (on the GPU a cancelled
    entry hung there: close() waited for the GIL, held by a thread waiting for close()'s lock).
    So the Python object's references do not change, and the memory outlives it until close()."""
    store = _store(tmp_path / "store")
    spec = store.layer(0)
    gc.collect()
    before = native.mirror_counters()
    m = native.HostMirror(4, [s.nbytes for s in spec.segments])
    refs = sys.getrefcount(m)
    r = native.Reader("threads", native.ReaderOptions())
    r.add_layout_mirror(str(spec.path), spec.stride, spec.n_experts, [s.offset for s in spec.segments],
                        [s.nbytes for s in spec.segments], m)
    assert sys.getrefcount(m) == refs
    del m
    gc.collect()
    assert native.mirror_counters()["destroyed"] == before["destroyed"]  # the reader still holds it
    r.close()
    assert native.mirror_counters()["destroyed"] == before["destroyed"] + 1


def test_upload_without_cuda_says_what_is_missing() -> None:
    if CUDA:
        pytest.skip("this build has the CUDA upload path")
    m = native.HostMirror(2, [4])
    with pytest.raises(RuntimeError, match="ASYNCSIDE_CUDA"):
        native.upload_rows(m, [mx.zeros((2, 4), dtype=mx.uint8)], [0], mx.default_stream(mx.cpu))
    assert device_pools_default() is False


@gpu
@pytest.mark.gpu
@pytest.mark.anyio
async def test_runtime_on_device_pools_matches_the_store(tmp_path: Path, reader: str) -> None:
    store = _store(tmp_path / "store")
    async with Runtime(store, resident=0.25, side_rows=3, reader=reader) as rt:
        for layer in store.layers:
            assert rt._s.layer(layer).pools.device
        rng = np.random.default_rng(3)
        for _ in range(12):
            layer = int(rng.choice(list(store.layers)))
            ids = rng.choice(12, size=2, replace=False).tolist()
            rt.prefetch(layer, mx.array(rng.choice(12, size=2, replace=False)))
            await rt.ensure(layer, ids)
            table = np.array(rt.lookup(layer))
            lease = rt.lease(layer, ids)
            pools = rt._s.layer(layer).pools
            for e in ids:
                got = {k: pools.row_bytes(k, int(table[e])) for k in pools.arrays}
                assert got == _expected(store, layer, e)
            # A device computation reads the rows; the lease is released when it completed.
            y = sum(pools.arrays[k][int(table[e])].astype(mx.float32).sum() for k in pools.arrays for e in ids)
            rt.release_after(y, [(layer, lease)])
        await rt.drain()
        for report in rt.audit().values():
            assert report.ok, report.problems


@pytest.mark.anyio
async def test_reads_whose_upload_the_close_cancels_fail_and_free_their_rows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On device pools a landed read waits for its layer's upload task; the runtime's close cancels
    that task before it uploads. The task's fills were left FILLING and their prefetch never woke:
    a runtime exited while a prefetch's reads landed (by another task, as pytest-asyncio tears a
    fixture down) hung on MLX CUDA. They now fail ("the runtime closed before the upload"), their
    rows go back and the awaiter sees the error. Device pools without a GPU: the mirror is the
    same, and the upload (not reached) is stood in for."""
    from asyncside import pools as pools_module
    from asyncside.audit import audit_problems

    monkeypatch.setattr(pools_module, "device_pools_default", lambda: True)
    monkeypatch.setattr(PoolSet, "upload", lambda self, rows: mx.array(0))
    rt = Runtime(_store(tmp_path / "store"), resident=0.5)
    async with rt:
        st = rt._s.layers[0]
        flushes: list[tuple[Any, tuple[Any, ...]]] = []
        monkeypatch.setattr(rt._s, "spawn", lambda fn, *args: flushes.append((fn, args)))  # held by the test
        prefetch = rt.prefetch(0, [5, 6])
        with anyio.fail_after(30):  # a hang guard
            while len(st.uploads) < 2:  # both reads are in the mirror, waiting for the upload task
                await anyio.sleep(0.005)
        assert len(flushes) == 1
        flush, args = flushes[0]
        with anyio.CancelScope() as scope:
            scope.cancel()  # as the close cancels the runtime's tasks
            await flush(*args)
        with anyio.fail_after(30), pytest.raises(ExceptionGroup, match="prefetch of layer 0 failed") as info:
            await prefetch
        assert len(info.value.exceptions) == 2
        assert all("the runtime closed before the upload" in str(e) for e in info.value.exceptions)
    assert audit_problems(rt) == []
