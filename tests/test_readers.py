"""The read path, parametrized over all three readers (io_uring, threads, aiofiles), buffered and
O_DIRECT: every pool row equals ``ExpertStore.read_expert`` after a fill, for random layouts with
odd and 1-byte segments and strides that are not multiples of 8; native counters balance."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from asyncside.ledger import Ledger
from asyncside.pools import POOL_ALIGNMENT, PoolSet
from asyncside.readers import ReaderOptions, choose_reader
from asyncside.scheduler import Scheduler
from asyncside.store import ExpertStore

from _read_helpers import assert_balanced, check_rows
from conftest import HAVE_URING

pytestmark = pytest.mark.anyio


_DTYPES = ["uint8", "int8", "uint16", "float16", "bfloat16", "uint32", "float32", "int64"]


def random_layer(rng: random.Random, n_experts: int) -> dict[str, np.ndarray]:
    """A layer with 1..7 segments of random dtypes and shapes, always one 1-byte segment and one odd one."""
    arrays: dict[str, np.ndarray] = {}
    nseg = rng.randint(1, 6)
    shapes = [(1,), (rng.choice([3, 5, 7, 13, 4095]),)]  # a 1-byte and an odd uint8 segment
    for i in range(nseg):
        dt = rng.choice(_DTYPES)
        shape = tuple(rng.randint(1, 40) for _ in range(rng.randint(1, 3)))
        arrays[f"s{i}.{dt}"] = _fill(rng, (n_experts, *shape), dt)
    for j, shape in enumerate(shapes):
        arrays[f"odd{j}"] = _fill(rng, (n_experts, *shape), "uint8")
    keys = list(arrays)
    rng.shuffle(keys)
    return {k: arrays[k] for k in keys}


def _fill(rng: random.Random, shape: tuple[int, ...], dt: str) -> np.ndarray:
    g = np.random.default_rng(rng.randrange(2**32))
    raw = g.integers(0, 256, size=int(np.prod(shape)) * np.dtype(_np_dtype(dt)).itemsize, dtype=np.uint8)
    arr = raw.view(_np_dtype(dt)).reshape(shape)
    if dt == "bfloat16":
        return mx.array(arr).view(mx.bfloat16)  # type: ignore[return-value]
    return arr


def _np_dtype(dt: str) -> str:
    return "uint16" if dt == "bfloat16" else dt


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> list[ExpertStore]:
    """Three stores: random layouts with alignment 1 (odd strides), 64, and the default 4096."""
    out = []
    root = tmp_path_factory.mktemp("stores")
    for seed, alignment in [(1, 1), (2, 64), (3, 4096)]:
        rng = random.Random(seed)
        layers = {idx: random_layer(rng, n_experts=rng.randint(5, 9)) for idx in (0, 3)}
        out.append(ExpertStore.create(root / f"s{seed}", layers, alignment=alignment))
    assert any(spec.stride % 8 for s in out for spec in s.layers.values()), "want a stride not a multiple of 8"
    return out


@pytest.fixture(scope="module")
def aligned_store(tmp_path_factory: pytest.TempPathFactory) -> ExpertStore:
    """Qwen-like segments whose sizes are multiples of 4096: O_DIRECT can land in the rows."""
    g = np.random.default_rng(7)
    n = 6
    layer = {
        "gate.weight": g.integers(0, 2**32, size=(n, 64, 32), dtype=np.uint32),  # 8192 B
        "gate.scales": g.integers(0, 2**16, size=(n, 64, 32), dtype=np.uint16),  # 4096 B
        "down.weight": g.integers(0, 2**32, size=(n, 1024, 80), dtype=np.uint32),  # 327680 B
    }
    return ExpertStore.create(tmp_path_factory.mktemp("aligned") / "s", {5: layer})


def test_pools_are_aligned_views(stores: list[ExpertStore]) -> None:
    spec = next(iter(stores[2].layers.values()))
    # Host pools on every device: their carving out of an aligned buffer is the subject (device
    # pools, MLX CUDA's default, take reads in their host mirror instead).
    pools = PoolSet(spec, rows=3, device=False)
    assert pools.aligned
    for seg in spec.segments:
        a = pools.arrays[seg.key]
        assert a.shape == (3, *seg.shape) and str(a.dtype).endswith(seg.dtype if seg.dtype != "bool" else "bool")
        assert pools.row_address(seg.key, 0) % POOL_ALIGNMENT == 0
    # memoryview writes land in the MLX array (no copy in between).
    key = spec.segments[0].key
    pools.row_view(key, 1)[:] = b"\xab" * spec.segments[0].nbytes
    assert bytes(memoryview(pools.arrays[key][1]).cast("B")) == b"\xab" * spec.segments[0].nbytes
    with pytest.raises(IndexError, match="row 3 out of range"):
        pools.row_view(key, 3)


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
async def test_rows_equal_read_expert(reader: str, direct: bool, stores: list[ExpertStore], no_blocking: object) -> None:
    """Random layouts: every expert of every layer read into rows (more experts than rows, in
    rounds, rows reused) equals read_expert; chunking is tiny so records span several ops."""
    rng = random.Random(11)
    options = ReaderOptions(queue_depth=4, direct=direct, chunk_bytes=4096, buffered_chunk_bytes=4096,
                            slot_bytes=8192, staging_bytes=3 * 8192)
    async with Scheduler(reader, options) as sched:
        for store in stores:
            for index, spec in store.layers.items():
                pools = await PoolSet.allocate(spec, rows=3)
                experts = list(range(spec.n_experts))
                rng.shuffle(experts)
                for start in range(0, len(experts), 3):
                    batch = experts[start:start + 3]
                    fills = [_F(i, e, r) for i, (e, r) in enumerate(zip(batch, rng.sample(range(3), len(batch))))]
                    handles = sched.submit(spec, pools, fills)
                    for h in handles:
                        await h.wait()
                    await check_rows(store, index, pools, [(f.expert, f.row) for f in fills])
    counters = sched.stats()["native"]  # after close: the slab is freed too
    assert_balanced(counters)
    assert counters["fills_failed"] == 0


class _F:
    """A fill as the ledger makes them (anything with fill_id, expert, row works)."""

    def __init__(self, fill_id: int, expert: int, row: int) -> None:
        self.fill_id, self.expert, self.row = fill_id, expert, row


async def test_direct_reads_land_in_aligned_rows(reader: str, aligned_store: ExpertStore, no_blocking: object) -> None:
    """With 4096-multiple segments and aligned pools, native O_DIRECT reads go straight into the
    rows (no staging); the bytes are still exactly read_expert's."""
    spec = aligned_store.layer(5)
    pools = await PoolSet.allocate(spec, rows=6)
    # Device pools (MLX CUDA) take reads in their host mirror, which is page-aligned by construction.
    assert pools.aligned or pools.device
    options = ReaderOptions(direct=True, chunk_bytes=64 << 10, buffered_chunk_bytes=64 << 10)
    async with Scheduler(reader, options) as sched:
        hs = sched.submit(spec, pools, [_F(e, e, 5 - e) for e in range(6)])
        for h in hs:
            await h.wait()
    c = sched.stats()["native"]
    await check_rows(aligned_store, 5, pools, [(e, 5 - e) for e in range(6)])
    assert_balanced(c)
    if reader != "aiofiles":
        assert c["fills_direct_rows"] == 6 and c["fills_staged"] == 0, c


async def test_with_ledger_on_every_loop(reader: str, anyio_backend: object, stores: list[ExpertStore], no_blocking: object) -> None:
    """The runtime's wiring in miniature: ledger.reserve -> submit -> done callbacks publish/fail on
    the loop thread, on asyncio, uvloop and trio; the ledger audits clean and lookup() maps to rows
    holding the right bytes."""
    store = stores[0]
    spec = next(iter(store.layers.values()))
    ledger = Ledger(spec.n_experts, resident=[0], side_rows=3)
    pools = await PoolSet.allocate(spec, rows=ledger.rows)
    async with Scheduler(reader, ReaderOptions(queue_depth=2)) as sched:
        for ids in ([1, 2, 3], [2, 4], [4, 1, spec.n_experts - 1]):
            fills = ledger.reserve(ids)
            for h in sched.submit(spec, pools, fills):
                h.add_done_callback(lambda h: ledger.fail(h.fill) if h.result_error() else ledger.publish(h.fill))
            await sched.join()
            assert not ledger.pending()
            lut = ledger.lookup()
            await check_rows(store, spec.index, pools, [(e, int(lut[e])) for e in ids if lut[e] >= ledger.cap])
    assert_balanced(sched.stats()["native"])
    assert ledger.audit().ok, ledger.audit().problems


async def test_backpressure_bounds_in_flight(reader: str, stores: list[ExpertStore], no_blocking: object) -> None:
    """queue_depth=2 with 12 fills: never more than 2 at the reader, the rest wait in the backlog."""
    store = stores[1]
    spec = next(iter(store.layers.values()))
    pools = await PoolSet.allocate(spec, rows=12)
    seen: list[int] = []
    async with Scheduler(reader, ReaderOptions(queue_depth=2)) as sched:
        fills = [_F(i, i % spec.n_experts, i) for i in range(12)]
        hs = sched.submit(spec, pools, fills)
        assert sched.in_flight <= 2 and sched.in_flight + sched.backlog == 12 - sum(h.done() for h in hs)
        for h in hs:
            h.add_done_callback(lambda h: seen.append(sched.in_flight))
        await sched.join()
        assert sched.stats()["max_backlog"] >= 8
    assert max(seen) <= 2
    await check_rows(store, spec.index, pools, [(f.expert, f.row) for f in fills])


def test_reader_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Auto prefers io_uring when the kernel allows it; $ASYNCSIDE_READER overrides auto; an explicit
    argument wins over both; bad names are named in the error."""
    monkeypatch.delenv("ASYNCSIDE_READER", raising=False)
    assert choose_reader("auto") == ("io_uring" if HAVE_URING else "threads")
    monkeypatch.setenv("ASYNCSIDE_READER", "aiofiles")
    assert choose_reader("auto") == "aiofiles"
    assert choose_reader("threads") == "threads"
    monkeypatch.setenv("ASYNCSIDE_READER", "mmap")
    with pytest.raises(ValueError, match="ASYNCSIDE_READER.*'mmap'"):
        choose_reader("auto")
    with pytest.raises(ValueError, match="'uring'"):
        choose_reader("uring")


async def test_submit_rejects_bad_rows_and_pools(stores: list[ExpertStore], no_blocking: object) -> None:
    store = stores[0]
    specs = list(store.layers.values())
    pools = await PoolSet.allocate(specs[0], rows=2)
    async with Scheduler("threads") as sched:
        with pytest.raises(ValueError, match="row 2 out of range"):
            sched.submit(specs[0], pools, [_F(0, 0, 2)])
        with pytest.raises(ValueError, match=f"expert {specs[0].n_experts} out of range"):
            sched.submit(specs[0], pools, [_F(0, specs[0].n_experts, 0)])
        with pytest.raises(ValueError, match="pools belong to layer"):
            sched.submit(specs[1], pools, [_F(0, 0, 0)])
        assert sched.in_flight == 0 and sched.backlog == 0


def test_reader_options_are_defined_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """One options struct for every layer: its defaults are the native struct's, the Scheduler and
    the native Reader run with exactly what they were given (machine-dependent defaults resolved
    natively), and bad fields are refused by name."""
    import os

    import asyncside._native as native
    from asyncside.readers import reader_options

    d = ReaderOptions()
    assert ReaderOptions is native.ReaderOptions
    assert d.workers == 0 and d.iowq_max_workers == -1  # resolved per backend and machine
    assert set(d.as_dict()) == set(ReaderOptions.field_names())
    o = ReaderOptions(queue_depth=7, chunk_bytes=8192)
    assert (o.queue_depth, o.chunk_bytes, o.slot_bytes) == (7, 8192, d.slot_bytes)

    monkeypatch.delenv("ASYNCSIDE_DIRECT", raising=False)
    sched = Scheduler("threads", o)
    assert sched.options == o and sched.options is not o and sched.queue_depth == 7 and not sched.direct
    assert Scheduler("threads", o, direct=True).options.direct and not o.direct
    monkeypatch.setenv("ASYNCSIDE_DIRECT", "1")
    assert reader_options().direct  # the environment applies only when no options are given
    assert not reader_options(o).direct and not reader_options(direct=False).direct

    ncpu = os.cpu_count() or 1
    threads = native.Reader("threads", d)
    assert threads.options.workers == min(4, 2 * ncpu) and threads.options.iowq_max_workers == ncpu
    threads.close()
    if HAVE_URING:
        uring = native.Reader("io_uring", ReaderOptions(workers=3, iowq_max_workers=0))
        assert (uring.options.workers, uring.options.iowq_max_workers) == (3, 0)
        uring.close()

    with pytest.raises(TypeError, match="unknown field 'depth'"):
        ReaderOptions(depth=4)
    with pytest.raises(TypeError, match=r"queue_depth: expected an int, got True"):
        ReaderOptions(queue_depth=True)
    with pytest.raises(TypeError, match=r"chunk_bytes: expected a non-negative int, got -1"):
        o.chunk_bytes = -1
    with pytest.raises(ValueError, match="queue_depth: expected an int >= 1, got 0"):
        Scheduler("threads", ReaderOptions(queue_depth=0))
    with pytest.raises(ValueError, match="workers: expected >= 1"):
        native.Reader("threads", ReaderOptions(workers=-2))
