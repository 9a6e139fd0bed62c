"""Mapped reads (``ReaderOptions.mapped_reads``): buffered chunks whose pages are in the page cache
are copied from a read-only mapping of the blob in one pass that also folds the checksum.

The path must be indistinguishable from preadv except in speed: the rows hold exactly the store's
bytes (odd lengths, unaligned rows, padding between segments), a flipped byte still fails the fill
with EBADMSG, a file truncated under the mapping fails the fill with ENODATA instead of killing the
process with SIGBUS, a SIGBUS anywhere else still does what it did before, chunks not in the page
cache go through preadv, and closing the reader unmaps every blob."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import asyncside._native as native
from asyncside.errors import FillError
from asyncside.ledger import Ledger
from asyncside.pools import PoolSet
from asyncside.readers import ReaderOptions
from asyncside.scheduler import Scheduler
from asyncside.store import ExpertStore, LayerSpec

from _read_helpers import assert_balanced, rows_equal_store
from conftest import NATIVE_READERS

N_EXPERTS = 6


def _layer(n: int, seed: int) -> dict[str, np.ndarray]:
    """Segment lengths around the copy's 256- and 64-byte blocks, odd ones (pool rows at odd
    addresses: no streaming stores there) and one over 1 MiB."""
    g = np.random.default_rng(seed)
    return {
        "w": g.integers(0, 2**32, size=(n, (1 << 18) + 5), dtype=np.uint32),  # 1 MiB + 20 bytes
        "s": g.integers(0, 2**16, size=(n, 333), dtype=np.uint16),  # 666 bytes
        "b": g.integers(0, 256, size=(n, 1), dtype=np.uint8),  # 1 byte
        "c": g.integers(0, 256, size=(n, 257), dtype=np.uint8),
        "d": g.integers(0, 256, size=(n, 256), dtype=np.uint8),
        "e": g.integers(0, 256, size=(n, 255), dtype=np.uint8),
    }


@pytest.fixture
def store(tmp_path: Path) -> ExpertStore:
    return ExpertStore.create(tmp_path / "s", {0: _layer(N_EXPERTS, 3)})


def _warm(spec: LayerSpec) -> None:
    with open(spec.path, "rb") as fh:
        while fh.read(8 << 20):
            pass


def _evict(spec: LayerSpec) -> None:
    fd = os.open(spec.path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _flip(spec: LayerSpec, at: int) -> None:
    with open(spec.path, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0x01]))


def _open(backend: str, spec: LayerSpec, pools: PoolSet, *, verify: bool = True, **kw: Any) -> tuple[Any, int]:
    r = native.Reader(backend, native.ReaderOptions(verify=verify, **kw))
    segs = spec.segments
    if pools.mirror is not None:
        # Device pools (MLX CUDA): reads land in the host mirror, as the runtime's readers have them
        # (rows_equal_store reads the mirror's rows there).
        lid = r.add_layout_mirror(str(spec.path), spec.stride, spec.n_experts, [s.offset for s in segs],
                                  [s.nbytes for s in segs], pools.mirror)
    else:
        lid = r.add_layout(str(spec.path), spec.stride, spec.n_experts, [s.offset for s in segs],
                           [s.nbytes for s in segs], [pools.arrays[s.key] for s in segs])
    if verify:
        r.set_checksums(lid, spec.checksum, list(spec.checksums))
    return r, lid


def _read_all(r: Any, lid: int, experts: list[int]) -> dict[int, int]:
    """Fill row i with experts[i]; returns {expert: result}."""
    r.submit(lid, list(range(len(experts))), experts, list(range(len(experts))))
    out: dict[int, int] = {}
    while len(out) < len(experts):
        r.wait(1000)
        for tok, res in r.reap():
            out[experts[tok]] = res
    return out


def _maps_of(path: Path) -> int:
    with open("/proc/self/maps") as fh:
        return sum(1 for line in fh if line.rstrip().endswith(str(path)))


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
@pytest.mark.parametrize("backend", NATIVE_READERS)
def test_mapped_reads_land_the_stores_bytes(backend: str, verify: bool, store: ExpertStore) -> None:
    spec = store.layer(0)
    pools = PoolSet(spec, N_EXPERTS)
    # map_unchecked: every chunk takes the mapped path, whatever proactive reclaim did to the cache.
    r, lid = _open(backend, spec, pools, verify=verify)
    r.set_faults(map_unchecked=True)
    assert _maps_of(spec.path) == 1
    assert _read_all(r, lid, list(range(N_EXPERTS))) == dict.fromkeys(range(N_EXPERTS), 0)
    c = r.counters()
    r.close()
    for e in range(N_EXPERTS):
        rows_equal_store(store, 0, pools, e, e)
    # The threads backend copies every buffered chunk itself; io_uring only the verified ones (its
    # unverified buffered reads stay in the ring).
    mapped = verify or backend == "threads"
    assert (c["mapped_chunks"] > 0) == mapped, c
    assert (c["mapped_bytes"] > 0) == mapped, c
    assert c["checksums_verified"] == (N_EXPERTS if verify else 0) and c["checksum_mismatches"] == 0, c
    assert c["map_errors"] == 0, c
    after = r.counters()
    assert after["maps_created"] == after["maps_released"] == 1, after
    assert_balanced(after)
    assert _maps_of(spec.path) == 0


@pytest.mark.parametrize("backend", NATIVE_READERS)
def test_mapped_reads_off_uses_preadv_only(backend: str, store: ExpertStore) -> None:
    spec = store.layer(0)
    pools = PoolSet(spec, N_EXPERTS)
    _warm(spec)
    r, lid = _open(backend, spec, pools, mapped_reads=False)
    assert _maps_of(spec.path) == 0
    assert _read_all(r, lid, list(range(N_EXPERTS))) == dict.fromkeys(range(N_EXPERTS), 0)
    r.close()
    c = r.counters()
    assert c["maps_created"] == c["mapped_chunks"] == 0 and c["checksums_verified"] == N_EXPERTS, c
    for e in range(N_EXPERTS):
        rows_equal_store(store, 0, pools, e, e)


@pytest.mark.parametrize("backend", NATIVE_READERS)
def test_resident_chunks_are_mapped_and_cold_ones_use_preadv(backend: str, store: ExpertStore) -> None:
    spec = store.layer(0)
    pools = PoolSet(spec, N_EXPERTS)
    _evict(spec)
    r, lid = _open(backend, spec, pools)
    # One record (one chunk): the readahead of its preadv may bring the next records in.
    assert _read_all(r, lid, [0]) == {0: 0}
    c = r.counters()
    assert c["mapped_chunks"] == 0 and c["map_fallbacks"] == 1 and c["ops_submitted"] > 0, c
    assert _read_all(r, lid, [0, 1]) == {0: 0, 1: 0}
    _warm(spec)  # now in the page cache: the same reader copies from its mapping
    r.submit(lid, [2, 3], [2, 3], [2, 3])
    got: dict[int, int] = {}
    while len(got) < 2:
        r.wait(1000)
        got.update(r.reap())
    assert got == {2: 0, 3: 0}
    c = r.counters()
    r.close()
    assert c["mapped_chunks"] > 0, c
    for e in range(4):
        rows_equal_store(store, 0, pools, e, e)


@pytest.mark.parametrize("backend", NATIVE_READERS)
def test_flipped_byte_is_caught_by_the_mapped_copy(backend: str, store: ExpertStore) -> None:
    spec = store.layer(0)
    seg = spec.segments[-1]
    _flip(spec, 4 * spec.stride + seg.offset + seg.nbytes - 1)  # the record's last segment byte
    pools = PoolSet(spec, N_EXPERTS)
    r, lid = _open(backend, spec, pools)
    r.set_faults(map_unchecked=True)
    got = _read_all(r, lid, list(range(N_EXPERTS)))
    assert got == {**dict.fromkeys(range(N_EXPERTS), 0), 4: -errno.EBADMSG}
    expected, actual = r.take_mismatch(4)
    c = r.counters()
    r.close()
    assert expected == spec.checksums[4] and actual != expected
    assert c["mapped_chunks"] > 0 and c["checksum_mismatches"] == 1, c


@pytest.mark.parametrize("backend", NATIVE_READERS)
def test_padding_is_neither_copied_nor_checksummed(backend: str, store: ExpertStore) -> None:
    spec = store.layer(0)
    segs = sorted(spec.segments, key=lambda s: s.offset)
    gaps = [(a.offset + a.nbytes, b.offset) for a, b in zip(segs, segs[1:]) if b.offset > a.offset + a.nbytes]
    assert gaps, "the store format pads segments"
    _flip(spec, 2 * spec.stride + gaps[0][0])
    pools = PoolSet(spec, N_EXPERTS)
    r, lid = _open(backend, spec, pools)
    r.set_faults(map_unchecked=True)
    assert _read_all(r, lid, [2]) == {2: 0}
    c = r.counters()
    r.close()
    assert c["mapped_chunks"] > 0, c
    rows_equal_store(store, 0, pools, 2, 0)


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
@pytest.mark.parametrize("backend", NATIVE_READERS)
def test_file_truncated_under_the_mapping_fails_the_fill_not_the_process(
        backend: str, verify: bool, store: ExpertStore) -> None:
    """The blob is cut inside the last record after the reader mapped it; the copy meets SIGBUS,
    which fails that fill with ENODATA. Without the handler this kills the test process."""
    spec = store.layer(0)
    pools = PoolSet(spec, N_EXPERTS)
    r, lid = _open(backend, spec, pools, verify=verify)
    last = N_EXPERTS - 1
    os.truncate(spec.path, last * spec.stride + spec.segments[0].nbytes // 2)
    r.set_faults(map_unchecked=True)  # copy without looking at the page cache first
    got = _read_all(r, lid, [last, 0])
    c = r.counters()
    r.close()
    if verify or backend == "threads":  # the mapped path met the cut
        assert got == {last: -errno.ENODATA, 0: 0} and c["map_errors"] == 1, (got, c)
    else:  # io_uring's unverified buffered reads stay in the ring: a plain short read
        assert got == {last: -errno.ENODATA, 0: 0} and c["map_errors"] == 0, (got, c)
    rows_equal_store(store, 0, pools, 0, 1)
    # The thread that met SIGBUS goes on reading.
    r2, lid2 = _open(backend, spec, pools, verify=verify, workers=1)
    r2.set_faults(map_unchecked=True)
    assert _read_all(r2, lid2, [1, 2]) == {1: 0, 2: 0}
    r2.close()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_truncated_under_the_mapping_is_a_fill_error(native_reader: str, tmp_path: Path,
                                                           store: ExpertStore) -> None:
    copy = ExpertStore.open(shutil.copytree(store.path, tmp_path / "copy"))
    spec = copy.layer(0)
    last = spec.n_experts - 1
    ledger = Ledger(spec.n_experts, resident=[], side_rows=3)
    pools = await PoolSet.allocate(spec, rows=ledger.rows)
    async with Scheduler(native_reader, ReaderOptions()) as sched:
        await sched.prepare(spec, pools)
        await anyio.to_thread.run_sync(os.truncate, spec.path, last * spec.stride + 100)
        sched.reader._r.set_faults(map_unchecked=True)  # type: ignore[union-attr]
        fills = ledger.reserve([last, 0])
        hs = sched.submit(spec, pools, fills)
        for h in hs:
            h.add_done_callback(lambda h: ledger.fail(h.fill) if h.result_error() else ledger.publish(h.fill))
        with pytest.raises(FillError, match="end of file") as info:
            await hs[0].wait()
        await hs[1].wait()
        assert info.value.errno == errno.ENODATA and info.value.expert == last
        assert str(spec.path) in str(info.value)
        await sched.join()
        assert sched.stats()["native"]["map_errors"] == 1
    assert ledger.audit().ok
    assert last not in ledger.live() and 0 in ledger.live()


_SIGBUS_ELSEWHERE = """
import faulthandler, mmap, os, sys
if sys.argv[2] == "faulthandler":
    faulthandler.enable()
import asyncside._native as native
from asyncside.pools import PoolSet
from asyncside.store import ExpertStore
spec = ExpertStore.open(sys.argv[1]).layer(0)
pools = PoolSet(spec, 1)
r = native.Reader("threads", native.ReaderOptions())
segs = spec.segments
r.add_layout(str(spec.path), spec.stride, spec.n_experts, [s.offset for s in segs], [s.nbytes for s in segs],
             [pools.arrays[s.key] for s in segs])  # installs the handler
path = os.path.join(os.path.dirname(sys.argv[1]), "other")
with open(path, "wb") as fh:
    fh.write(b"x" * 65536)
fd = os.open(path, os.O_RDONLY)
m = mmap.mmap(fd, 65536, prot=mmap.PROT_READ)
os.truncate(path, 0)
print("touching", flush=True)
m[40000]  # SIGBUS outside any mapped read
print("survived", flush=True)
"""


@pytest.mark.parametrize("mode", ["default", "faulthandler"])
def test_sigbus_outside_a_mapped_read_still_kills(store: ExpertStore, tmp_path: Path, mode: str) -> None:
    """The handler takes only faults inside its own copies; any other SIGBUS gets the previous
    disposition (the default action, or Python's faulthandler, which then re-raises)."""
    script = tmp_path / "bus.py"
    script.write_text(textwrap.dedent(_SIGBUS_ELSEWHERE))
    out = subprocess.run([sys.executable, str(script), str(store.path), mode], capture_output=True, text=True,
                         timeout=120)
    assert "touching" in out.stdout and "survived" not in out.stdout, (out.stdout, out.stderr)
    assert out.returncode == -signal.SIGBUS, (out.returncode, out.stderr[-2000:])
    if mode == "faulthandler":
        assert "Bus error" in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("backend", NATIVE_READERS)
def test_preadv_windows_verify_across_short_reads(backend: str, store: ExpertStore) -> None:
    """Without mapped reads a verified buffered chunk lands in 256 KiB windows, each checksummed as
    it lands; short reads (the hook caps every op at 1000 bytes) continue the running checksum."""
    spec = store.layer(0)
    _flip(spec, 3 * spec.stride + spec.segments[0].offset + (700 << 10))  # past the first windows
    pools = PoolSet(spec, N_EXPERTS)
    r, lid = _open(backend, spec, pools, mapped_reads=False)
    r.set_faults(max_read_bytes=100_000)
    got = _read_all(r, lid, list(range(N_EXPERTS)))
    c = r.counters()
    r.close()
    assert got == {**dict.fromkeys(range(N_EXPERTS), 0), 3: -errno.EBADMSG}
    assert c["short_reads"] > 0 and c["mapped_chunks"] == 0 and c["checksums_verified"] == N_EXPERTS, c
    for e in (0, 1, 2, 4, 5):
        rows_equal_store(store, 0, pools, e, e)
