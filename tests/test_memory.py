"""Memory planning: the pools' size is stated, `resident="auto"` fits them to what is available,
and a residency that cannot fit is refused at start with both figures named."""

from __future__ import annotations

import pathlib

import anyio
import numpy as np
import pytest

from asyncside import ExpertStore, memory
from asyncside.errors import AsyncsideError
from asyncside.runtime import Runtime


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

    async def open_with(resident: float | str) -> dict:
        async with Runtime(store, resident=resident, reader="threads") as rt:
            return rt.memory

    mem = anyio.run(open_with, 0.25)
    assert mem["pool_bytes"] == memory.pool_bytes(store, 0.25) and mem["available_bytes"] > mem["pool_bytes"]
    tight = memory.MemoryBudget(memory.MIN_HEADROOM + (1 << 20), "a test limit")
    monkeypatch.setattr(memory, "available_memory", lambda: tight)
    with pytest.raises(AsyncsideError, match=r"the pools need .* GiB \(resident=1.0\).*a test limit"):
        anyio.run(open_with, 1.0)
    roomy = memory.MemoryBudget(memory.MIN_HEADROOM * 4, "a test limit")
    monkeypatch.setattr(memory, "available_memory", lambda: roomy)
    mem = anyio.run(open_with, "auto")
    assert 0.0 < mem["resident"] <= 1.0 and mem["pool_bytes"] <= roomy.available * memory.AUTO_SHARE


def test_host_tier_sizes_parse_and_bad_ones_are_refused() -> None:
    assert memory.parse_host_tier("auto") == "auto" and memory.parse_host_tier(" AUTO ") == "auto"
    assert memory.parse_host_tier("0") == 0 and memory.parse_host_tier("4096") == 4096
    assert memory.parse_host_tier("512M") == 512 << 20 and memory.parse_host_tier("1.5g") == 3 << 29
    for bad in ("", "x", "2GB", "-1", "nan", "inf", "1e400"):
        with pytest.raises(ValueError, match="host tier"):
            memory.parse_host_tier(bad)
    for bad in (-1, "some", True, 1.5):
        with pytest.raises(ValueError, match="host_tier: expected 'auto' or a number of bytes"):
            Runtime(ExpertStore.__new__(ExpertStore), host_tier=bad)  # type: ignore[arg-type]


def test_host_tier_plan_takes_whole_layers_within_its_bound(tmp_path: pathlib.Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The tier holds whole layers, in order, while they fit (each a page-rounded block of one row
    per expert a segment); "auto" takes a quarter of the room beside the pools (none when there is
    none); no tier unless the pools live on a CUDA device with the fault path."""
    from asyncside import _native, pools

    store = _store(tmp_path / "s")
    layer = 64 * (1 << 16)  # 64 experts of one 64 KiB segment
    monkeypatch.setattr(pools, "device_pools_default", lambda: False)
    assert Runtime(store, host_tier="auto")._plan_tier(1 << 40) == (set(), 0)  # host pools
    monkeypatch.setattr(pools, "device_pools_default", lambda: True)
    monkeypatch.setattr(_native, "device_faults_available", lambda: True)
    assert Runtime(store, host_tier=0)._plan_tier(1 << 40) == (set(), 0)
    assert Runtime(store, host_tier=layer)._plan_tier(1 << 40) == ({0}, layer)
    assert Runtime(store, host_tier=2 * layer - 1)._plan_tier(1 << 40) == ({0}, layer)
    assert Runtime(store, host_tier=2 * layer)._plan_tier(1 << 40) == ({0, 1}, 2 * layer)
    assert Runtime(store, host_tier="auto")._plan_tier(int(2 * layer / memory.TIER_SHARE)) == ({0, 1}, 2 * layer)
    assert Runtime(store, host_tier="auto")._plan_tier(int(layer / memory.TIER_SHARE)) == ({0}, layer)
    assert Runtime(store, host_tier="auto", layers=[1])._plan_tier(1 << 40) == ({1}, layer)
    assert Runtime(store, host_tier="auto")._plan_tier(-(1 << 30)) == (set(), 0)  # pools left no room
