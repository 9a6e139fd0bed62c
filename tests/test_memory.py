"""Memory planning: the pools' size is stated, `resident="auto"` fits them to what is available,
and a residency that cannot fit is refused at start with both figures named."""

from __future__ import annotations

import os
import pathlib

import anyio
import numpy as np
import pytest

from asyncside import ExpertStore, memory
from asyncside.errors import AsyncsideError
from asyncside.runtime import Runtime
from asyncside.runtime import _plan as plan_mod


@pytest.fixture(autouse=True)
def _nothing_held(monkeypatch: pytest.MonkeyPatch) -> None:
    """An explicit budget is the process's whole: these tests plan as if it held nothing yet."""
    monkeypatch.setattr(plan_mod, "_resident_now", lambda: 0)


def _store(path: pathlib.Path) -> ExpertStore:
    rng = np.random.default_rng(0)
    return ExpertStore.create(path, {layer: {"w": rng.integers(0, 255, size=(64, 1 << 16), dtype=np.uint8)}
                                     for layer in range(2)})


def test_available_memory_is_read() -> None:
    budget = memory.available_memory()
    assert budget.available > 0 and budget.source
    assert "GiB available" in budget.describe()


def test_pool_bytes_and_auto_fraction(tmp_path: pathlib.Path) -> None:
    store = _store(tmp_path / "s")
    record = 1 << 16
    assert memory.pool_bytes(store, 0.25) == 2 * 16 * record
    assert memory.pool_bytes(store, 0.01) == 2 * 8 * record  # at least min_rows rows
    small = memory.MemoryBudget(2 * 24 * record * 2, "test")  # room for 24 rows a layer at AUTO_SHARE
    f = memory.auto_fraction(store, small)
    assert memory.pool_bytes(store, f) <= small.available * memory.AUTO_SHARE
    assert memory.pool_bytes(store, f + 0.02) > small.available * memory.AUTO_SHARE
    assert memory.auto_fraction(store, memory.MemoryBudget(1 << 40, "test")) == 1.0


def test_runtime_states_refuses_and_fits(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store(tmp_path / "s")

    async def open_with(resident: float | str, memory_arg: int | str | None = None) -> dict:
        async with Runtime(store, resident=resident, reader="threads", memory=memory_arg) as rt:
            return rt.memory

    mem = anyio.run(open_with, 0.25)
    assert mem["pool_bytes"] == memory.pool_bytes(store, 0.25) and mem["available_bytes"] > mem["pool_bytes"]
    tight = memory.MemoryBudget(memory.MIN_HEADROOM + (1 << 20), "a test limit")
    monkeypatch.setattr(memory, "available_memory", lambda: tight)
    with pytest.raises(AsyncsideError, match=r"the pools need 8.0 MiB \(resident=1.0\).*a test limit"):
        anyio.run(open_with, 1.0)
    roomy = memory.MemoryBudget(memory.MIN_HEADROOM * 4, "a test limit")
    monkeypatch.setattr(memory, "available_memory", lambda: roomy)
    mem = anyio.run(open_with, "auto")
    assert 0.0 < mem["resident"] <= 1.0
    assert mem["pool_bytes"] <= (roomy.available - memory.MIN_HEADROOM) * memory.AUTO_SHARE
    # An explicit budget is planned against, capped by what is available, and named in the refusal.
    with pytest.raises(AsyncsideError, match=r"budget is 256.5 MiB \(memory=256.5 MiB, 0.0 MiB of it held"):
        anyio.run(open_with, 1.0, (256 << 20) + (512 << 10))


def test_resident_means_the_pools_size_and_pinned_names_experts(tmp_path: pathlib.Path) -> None:
    store = _store(tmp_path / "s")
    with pytest.raises(TypeError, match=r"pinned=\{layer: \[experts\]\}"):
        Runtime(store, resident={0: [1, 2]})  # type: ignore[arg-type]

    async def main() -> None:
        async with Runtime(store, pinned={0: [3, 5], 1: []}, side_rows=4, reader="threads") as rt:
            assert rt.plan is not None and rt.plan.rows == {0: 6, 1: 4}
            assert rt.lookup(0).tolist()[3] == 0 and rt.lookup(0).tolist()[5] == 1
            assert rt.memory["resident"] == "pinned"

    anyio.run(main)


def test_sizes_parse_and_bad_ones_are_refused() -> None:
    assert memory.parse_host_tier("auto") == "auto" and memory.parse_host_tier(" AUTO ") == "auto"
    assert memory.parse_host_tier("0") == 0 and memory.parse_host_tier("4096") == 4096
    assert memory.parse_host_tier("512M") == 512 << 20 and memory.parse_host_tier("1.5g") == 3 << 29
    assert memory.parse_size("2GiB") == 2 << 30 and memory.parse_size("800MB") == 800 << 20
    assert memory.parse_size(12345) == 12345
    for bad in ("", "x", "2QB", "-1", "nan", "inf", "1e400", "1.2.3G"):
        with pytest.raises(ValueError, match="host tier"):
            memory.parse_host_tier(bad)
        with pytest.raises(ValueError, match=r"memory .*expected a (finite )?size"):
            memory.parse_size(bad, what="memory")
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="host_tier: expected 'auto' or a number of bytes"):
            Runtime(ExpertStore.__new__(ExpertStore), host_tier=bad)  # type: ignore[arg-type]
    for bad in ("some", "-1G", ""):  # a string is a size as --host-tier takes it (docs/api.md, "Sizes")
        with pytest.raises(ValueError, match="host tier"):
            Runtime(ExpertStore.__new__(ExpertStore), host_tier=bad)


def _plan(store: ExpertStore, **kw: object) -> plan_mod.MemoryPlan:
    args: dict[str, object] = dict(resident=0.25, pinned=None, side_rows=None, min_side_rows=8, memory=None,
                                   direct=None, host_tier="auto", tier_possible=True)
    args.update(kw)
    return plan_mod.plan_memory(store, list(store.layers), **args)  # type: ignore[arg-type]


def test_host_tier_plan_takes_whole_layers_within_its_bound(tmp_path: pathlib.Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The tier holds whole layers, in order, while they fit (each a page-rounded block of one row
    per expert a segment); "auto" takes a quarter of the room beside the pools (none when there is
    none); no tier unless the pools live on a device with the fault path."""
    store = _store(tmp_path / "s")
    layer = 64 * (1 << 16)  # 64 experts of one 64 KiB segment
    pools = memory.pool_bytes(store, 0.25)
    big = memory.MemoryBudget(1 << 40, "test")
    monkeypatch.setattr(memory, "available_memory", lambda: big)

    def tier(**kw: object) -> tuple[set[int], int]:
        plan = _plan(store, **kw)
        return set(plan.host_tier_layers), plan.host_tier_bytes

    assert tier(tier_possible=False) == (set(), 0)  # host pools
    assert tier(host_tier=0) == (set(), 0)
    assert tier(host_tier=layer) == ({0}, layer)
    assert tier(host_tier=2 * layer - 1) == ({0}, layer)
    assert tier(host_tier=2 * layer) == ({0, 1}, 2 * layer)
    room = pools + memory.MIN_HEADROOM  # what the pools and their headroom take before the tier
    for layers, want in ((2, {0, 1}), (1, {0})):
        budget = memory.MemoryBudget(room + int(layers * layer / memory.TIER_SHARE) + 1, "test")
        monkeypatch.setattr(memory, "available_memory", lambda b=budget: b)
        assert tier(host_tier="auto") == (want, layers * layer)
    assert set(plan_mod.plan_memory(store, [1], resident=0.25, pinned=None, side_rows=None, min_side_rows=8,
                                    memory=None, direct=None, host_tier=layer,
                                    tier_possible=True).host_tier_layers) == {1}


def test_a_host_tier_the_budget_cannot_hold_is_refused(tmp_path: pathlib.Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The tier is held like the pools: an explicit size that the budget cannot hold beside the
    pools, the tier's staging and the headroom is refused, naming both figures; one that fits is
    planned with everything it holds inside the budget; "auto" never passes the budget."""
    store = _store(tmp_path / "s")
    layer = 64 * (1 << 16)  # one layer's tier (and, the layer's shape, its staging)
    pools = memory.pool_bytes(store, 0.25)
    fits = pools + memory.MIN_HEADROOM + 2 * layer  # a layer's tier and its staging, no more
    monkeypatch.setattr(memory, "available_memory", lambda: memory.MemoryBudget(fits, "a test limit"))
    plan = _plan(store, host_tier=layer)
    assert set(plan.host_tier_layers) == {0}
    assert plan.held_bytes + plan.headroom_bytes <= plan.budget
    with pytest.raises(AsyncsideError, match=r"host tier \(host_tier=\d+\) takes 8.0 MiB \(2 layers\).*a test limit"):
        _plan(store, host_tier=2 * layer)
    auto = _plan(store, host_tier="auto")
    assert auto.held_bytes + auto.headroom_bytes <= auto.budget


def test_an_explicit_budget_is_the_whole_process(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the process holds already (the model loaded first) comes out of an explicit budget."""
    store = _store(tmp_path / "s")
    monkeypatch.setattr(plan_mod, "_resident_now", lambda: 100 << 20)
    plan = _plan(store, memory=(1 << 30))
    assert plan.budget == (1 << 30) - (100 << 20) and "100.0 MiB of it held by the process" in plan.source
    fixed = memory.MemoryBudget(5 << 30, "a test limit")
    monkeypatch.setattr(memory, "available_memory", lambda: fixed)
    assert plan_mod.resolve_budget(None) == fixed  # no budget: what is available, usage counted there
    assert plan_mod.resolve_budget(8 << 30).available == 5 << 30  # capped by it


def test_reads_bypass_the_page_cache_when_the_store_does_not_fit_the_budget(tmp_path: pathlib.Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """O_DIRECT is chosen when the store's records exceed what the budget leaves for the
    page cache, stated with the reason; an explicit choice (argument or $ASYNCSIDE_DIRECT) wins."""
    monkeypatch.delenv("ASYNCSIDE_DIRECT", raising=False)
    store = _store(tmp_path / "s")  # 8 MiB of records, 2 MiB of them in the pools at 0.25
    pools = memory.pool_bytes(store, 0.25)
    fits = _plan(store, memory=pools + memory.MIN_HEADROOM + (8 << 20))
    assert not fits.direct and "fit" in fits.direct_reason
    tight = _plan(store, memory=pools + memory.MIN_HEADROOM + (1 << 20))
    assert tight.direct and "exceed" in tight.direct_reason and tight.page_cache_bytes == 1 << 20
    assert "O_DIRECT" in tight.describe() and "page cache 1.0 MiB" in tight.describe()
    assert not _plan(store, memory=pools + memory.MIN_HEADROOM + (1 << 20), direct=False).direct
    monkeypatch.setenv("ASYNCSIDE_DIRECT", "0")
    assert not _plan(store, memory=pools + memory.MIN_HEADROOM + (1 << 20)).direct

    async def main() -> None:
        monkeypatch.delenv("ASYNCSIDE_DIRECT", raising=False)
        async with Runtime(store, reader="threads", memory=pools + memory.MIN_HEADROOM + (1 << 20)) as rt:
            assert rt.stats()["direct"] is True and rt.memory["direct"] is True
            await rt.ensure(0, [1, 2, 40])
            assert rt.stats()["misses"] == 3 and rt.stats().cache.misses == 3

    anyio.run(main)


def _cached_pages(path: pathlib.Path, offset: int, length: int) -> int:
    """Pages of ``path[offset:offset+length]`` in the page cache (mincore over a read-only mapping)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    start = offset - offset % page
    span = offset + length - start
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, span, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        try:
            vec = (ctypes.c_ubyte * (-(-span // page)))()
            if libc.mincore(addr, span, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
            return sum(v & 1 for v in vec)
        finally:
            libc.munmap(addr, span)
    finally:
        os.close(fd)


def _opened_direct(path: pathlib.Path) -> bool:
    """Whether this process holds ``path`` open with O_DIRECT (/proc/self/fdinfo's flags)."""
    found = False
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != str(path):
                continue
            with open(f"/proc/self/fdinfo/{fd}") as f:
                flags = int(next(line for line in f if line.startswith("flags:")).split()[1], 8)
        except (OSError, StopIteration):
            continue
        found = found or bool(flags & getattr(os, "O_DIRECT", 0))
    return found


@pytest.mark.parametrize("drop", [False, True])
def test_queued_faults_leave_no_page_cache_when_the_plan_bypasses_it(tmp_path: pathlib.Path, drop: bool,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget the store does not fit: faulted records are dropped from the page cache once read
    (and stay cached without the budget), with the same bytes in the rows either way."""
    import mlx.core as mx

    monkeypatch.delenv("ASYNCSIDE_DIRECT", raising=False)
    store = _store(tmp_path / "s")
    spec = store.layer(0)
    record = spec.stride
    for layer in store.layers:  # start from nothing cached
        fd = os.open(store.layer(layer).path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    budget = memory.pool_bytes(store, 0.25) + memory.MIN_HEADROOM + (1 << 20) if drop else None
    experts = [5, 9, 33]

    async def main() -> None:
        async with Runtime(store, reader="threads", memory=budget) as rt:
            assert rt.memory["direct"] is drop
            rt.begin_step(len(experts))
            rows = rt.expert_rows(0, mx.array(experts, dtype=mx.int32))
            mx.eval(rows)
            rt.end_step(rows)
            await rt.quiesce()
            assert rt.stats()["faults"] == len(experts)
            assert _opened_direct(spec.path) is drop  # the fault table's descriptor
            # Before anything else reads the records (the check below caches them).
            cached = sum(_cached_pages(spec.path, e * record, record) for e in experts)
            pages = len(experts) * -(-record // 4096)
            assert (cached == 0) if drop else (cached == pages), (cached, pages)
            for e, row in zip(experts, rows.tolist()):
                seg = spec.segments[0]
                assert bytes(rt.pools(0)[seg.key][row]) == store.read_record(0, e)[seg.offset:seg.offset + seg.nbytes]

    anyio.run(main)


def test_direct_from_the_environment_and_the_auto_refusal(tmp_path: pathlib.Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """$ASYNCSIDE_DIRECT is read as the readers read it (yes is 1; a value that is neither is
    refused, never taken as 0); resident='auto' that cannot fit says only memory helps (its pools
    are the smallest already), not to try 'auto'."""
    store = _store(tmp_path / "s")
    roomy = memory.pool_bytes(store, 0.25) + memory.MIN_HEADROOM + (64 << 20)
    monkeypatch.setenv("ASYNCSIDE_DIRECT", "yes")
    assert _plan(store, memory=roomy).direct_reason == "ASYNCSIDE_DIRECT" and _plan(store, memory=roomy).direct
    monkeypatch.setenv("ASYNCSIDE_DIRECT", "maybe")
    with pytest.raises(AsyncsideError, match=r"ASYNCSIDE_DIRECT: expected 0 or 1, got 'maybe'"):
        _plan(store, memory=roomy)
    monkeypatch.delenv("ASYNCSIDE_DIRECT")
    # min_side_rows=8 as given (the helper's default): a smaller one is named as what helps too.
    with pytest.raises(AsyncsideError, match=r"resident=auto.*8 rows a layer \(min_side_rows=8 as given\)") as info:
        _plan(store, resident="auto", memory=memory.MIN_HEADROOM + (512 << 10))  # 8 rows: 1 MiB
    assert "resident fraction" not in str(info.value)
    with pytest.raises(AsyncsideError, match=r"resident=auto.*smallest pools \(8 rows a layer") as info:
        _plan(store, resident="auto", min_side_rows=None, memory=memory.MIN_HEADROOM + (512 << 10))
    assert "resident fraction" not in str(info.value)


def test_a_refusal_names_the_memory_and_the_fraction_that_fit(tmp_path: pathlib.Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Pools that do not fit say what would: the memory= (what the process holds counted, as a
    budget counts it) and the largest resident fraction; both are taken when given back."""
    import re

    store = _store(tmp_path / "s")
    monkeypatch.setattr(plan_mod, "_resident_now", lambda: 100 << 20)  # what the process holds
    asked = (100 << 20) + memory.MIN_HEADROOM + memory.pool_bytes(store, 0.5)  # fits 0.5, not 0.9
    with pytest.raises(AsyncsideError) as info:
        _plan(store, resident=0.9, memory=asked)
    text = str(info.value)
    fraction = float(re.search(r"use resident=([0-9.]+) or less", text).group(1))  # type: ignore[union-attr]
    assert 0.5 <= fraction < 0.9
    assert _plan(store, resident=fraction, memory=asked).pool_bytes <= asked - (100 << 20) - memory.MIN_HEADROOM
    wanted = re.search(r"memory=([0-9.]+) MiB or more", text)
    assert wanted is not None
    _plan(store, resident=0.9, memory=f"{float(wanted.group(1)) + 0.1}M")  # the memory= it names fits
    with pytest.raises(AsyncsideError, match=r"no resident fraction fits beside the headroom.*for the smallest pools"):
        _plan(store, resident=0.9, memory=(100 << 20) + memory.MIN_HEADROOM // 2)
    # A memory= below what the process holds: the memory= named still counts all it holds (it named
    # the pools and headroom on top of the memory= asked, 50 MiB short).
    with pytest.raises(AsyncsideError) as info:
        _plan(store, resident=0.9, memory=50 << 20)
    wanted = re.search(r"memory=([0-9.]+) MiB or more for these", str(info.value))
    assert wanted is not None, str(info.value)
    _plan(store, resident=0.9, memory=f"{float(wanted.group(1)) + 0.1}M")


@pytest.mark.parametrize("text", ["2G", "2GB", "2Gi", "2GiB", "2 gib", "2048M"])
def test_size_spellings(text: str) -> None:
    assert memory.parse_size(text) == 2 << 30


def test_an_overflowing_size_says_so() -> None:
    with pytest.raises(ValueError, match="finite"):
        memory.parse_size("1e400")


def test_a_refusal_of_rows_given_names_them_and_its_memory_leaves_a_margin(tmp_path: pathlib.Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """resident='auto' whose pools hold the side_rows given (not the model's top-k) says so, and that
    a smaller side_rows helps; the memory= a refusal names still fits a later run of the command
    whose process holds a few MiB more before it plans."""
    import re

    store = _store(tmp_path / "s")
    monkeypatch.setattr(plan_mod, "_resident_now", lambda: 100 << 20)
    with pytest.raises(AsyncsideError) as info:
        _plan(store, resident="auto", side_rows=48, memory=(100 << 20) + memory.MIN_HEADROOM + (512 << 10))
    text = str(info.value)
    assert "these pools hold 48 rows a layer (side_rows=48 as given)" in text and "a smaller side_rows" in text
    assert "top-k" not in text and "smallest pools" not in text
    wanted = re.search(r"memory=([0-9.]+) MiB or more", text)
    assert wanted is not None, text
    monkeypatch.setattr(plan_mod, "_resident_now", lambda: 108 << 20)  # the next run holds 8 MiB more
    _plan(store, resident="auto", side_rows=48, memory=f"{wanted.group(1)}M")
