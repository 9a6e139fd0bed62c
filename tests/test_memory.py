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
