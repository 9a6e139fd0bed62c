"""Runtime.reopen_blob: a blob replaced on disk by another file is read anew once re-opened; a path
the runtime does not read answers False; a runtime that is not running refuses with a clear error."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from asyncside import AsyncsideError, ExpertStore, Runtime


@pytest.fixture(params=[pytest.param(("asyncio", {}), id="asyncio"), pytest.param(("trio", {}), id="trio")])
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    return request.param  # type: ignore[no-any-return]


def _make_store(path: Path, seed: int) -> ExpertStore:
    rng = np.random.default_rng(seed)
    return ExpertStore.create(path, {0: {
        "w.weight": rng.integers(0, 2**32, size=(16, 5, 7), dtype=np.uint32),
        "tag": rng.integers(0, 255, size=(16, 3), dtype=np.uint8),
    }})


def _row(rt: Runtime, expert: int) -> dict[str, bytes]:
    row = int(np.array(rt.lookup(0))[expert])
    assert row >= 0, f"expert {expert} has no row"
    return {key: np.array(pool[row]).tobytes() for key, pool in rt.pools(0).items()}


def _record(store: ExpertStore, expert: int) -> dict[str, bytes]:
    record = store.read_record(0, expert)
    return {s.key: bytes(record[s.offset:s.offset + s.nbytes]) for s in store.layer(0).segments}


@pytest.mark.anyio
async def test_reopen_blob_serves_the_replaced_files_bytes(tmp_path: Path, reader: str) -> None:
    store = _make_store(tmp_path / "s", seed=0)
    other = _make_store(tmp_path / "other", seed=1)  # same shapes, other bytes
    blob = store.layer(0).path
    # verify=False: the new bytes do not match the store's checksums, and this test is about which file is read.
    async with Runtime(store, resident=0.25, side_rows=4, reader=reader, verify=False) as rt:
        await rt.ensure(0, [8])  # the reader has the blob open now
        assert _row(rt, 8) == _record(store, 8)
        old = {e: _record(store, e) for e in (9, 10)}
        shutil.copyfile(other.layer(0).path, str(blob) + ".new")
        os.replace(str(blob) + ".new", blob)  # another file (inode) at the same path

        assert await rt.reopen_blob(blob) is True
        await rt.ensure(0, [9, 10])
        for e in (9, 10):
            assert _row(rt, e) == _record(other, e) != old[e], e
        assert rt.audit()[0].ok

        assert await rt.reopen_blob(tmp_path / "elsewhere.bin") is False
        assert await rt.reopen_blob(str(blob)) is True  # a str names the same blob
    with pytest.raises(AsyncsideError, match=r"reopen_blob\(.*the runtime is not running"):
        await rt.reopen_blob(blob)


@pytest.mark.anyio
async def test_reopen_blob_before_entry_is_refused(tmp_path: Path) -> None:
    rt = Runtime(_make_store(tmp_path / "s", seed=0))
    with pytest.raises(AsyncsideError, match="not running"):
        await rt.reopen_blob(rt.store.layer(0).path)
