"""The aiofiles reader reads through aiofiles on asyncio whether sniffio is installed or not.

anyio no longer installs sniffio; the reader asked sniffio which loop it ran on, and without it
took anyio's thread pool on asyncio as on trio, silently not the reader the user chose."""

from __future__ import annotations

import sys
from typing import Any

import aiofiles.os
import pytest

from asyncside.pools import PoolSet
from asyncside.readers import ReaderOptions
from asyncside.scheduler import Scheduler
from asyncside.store import ExpertStore

from _read_helpers import check_rows

pytestmark = pytest.mark.anyio


class _F:
    def __init__(self, fill_id: int, expert: int, row: int) -> None:
        self.fill_id, self.expert, self.row = fill_id, expert, row


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.mark.parametrize("sniffio", ["installed", "missing"])
async def test_aiofiles_carries_the_reads_on_asyncio_only(sniffio: str, anyio_backend: str, monkeypatch: pytest.MonkeyPatch,
                                                          expert_store: ExpertStore) -> None:
    if sniffio == "missing":
        monkeypatch.setitem(sys.modules, "sniffio", None)  # import sniffio: ImportError
    wrapped: list[Any] = []
    real = aiofiles.os.wrap

    def wrap(fn: Any) -> Any:
        wrapped.append(fn)
        return real(fn)

    monkeypatch.setattr(aiofiles.os, "wrap", wrap)
    index, spec = next(iter(expert_store.layers.items()))
    async with Scheduler("aiofiles", ReaderOptions()) as sched:
        pools = await PoolSet.allocate(spec, rows=2)
        for h in sched.submit(spec, pools, [_F(0, 3, 0), _F(1, 5, 1)]):
            await h.wait()
        await check_rows(expert_store, index, pools, [(3, 0), (5, 1)])
    assert bool(wrapped) == (anyio_backend == "asyncio")
