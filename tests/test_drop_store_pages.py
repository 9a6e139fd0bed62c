"""A plan that reads past the page cache evicts the store directory's pages that loading left.

Loading a model reads its non-expert weights through the page cache; a memory cgroup charges
those pages until reclaim, so under such a plan the runtime drops them when it is entered."""

from __future__ import annotations

import os
import pathlib

import anyio
import numpy as np
import pytest

from asyncside import ExpertStore
from asyncside.runtime import Runtime, drop_store_pages


def _store(tmp_path: pathlib.Path) -> ExpertStore:
    rng = np.random.default_rng(0)
    store = ExpertStore.create(tmp_path / "s", {0: {"w": rng.standard_normal((8, 1024)).astype(np.float32)}})
    (store.path / "model.safetensors").write_bytes(b"\0" * 8192)  # stands for the non-expert weights
    os.mkfifo(store.path / "a-fifo")  # never opened: an open() of a FIFO would block
    return store


def _advised(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record the files posix_fadvise(DONTNEED) is called on (by their descriptor's path)."""
    seen: list[str] = []
    real = os.posix_fadvise

    def spy(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_DONTNEED:
            seen.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    return seen


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise on this platform")
def test_drop_store_pages_advises_every_regular_file(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store(tmp_path)
    seen = _advised(monkeypatch)
    done = drop_store_pages(store.path)
    assert "model.safetensors" in seen and "manifest.json" in seen
    assert "a-fifo" not in seen
    assert sorted(p.name for p in done) == sorted(seen)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise on this platform")
@pytest.mark.parametrize("direct", [True, False])
def test_runtime_drops_the_store_pages_only_when_it_reads_past_the_page_cache(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, direct: bool) -> None:
    store = _store(tmp_path)
    seen = _advised(monkeypatch)

    async def main() -> bool:
        async with Runtime(store, resident=0.5, direct=direct) as rt:
            return bool(rt.memory["direct"])

    assert anyio.run(main) is direct
    assert ("model.safetensors" in seen) is direct
