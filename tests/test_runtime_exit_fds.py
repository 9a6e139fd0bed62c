"""A runtime lets go of the store's blobs when it exits, even while it is still referenced.

The queued steps' fault tables own a descriptor of each layer blob and close it when they are
freed, which for a runtime kept in a variable (or in a traceback, or a list of results) is whenever
it is collected: until then a store deleted or replaced on disk kept its space and its files. At
exit each descriptor is now pointed at /dev/null in place (closing it would let the number be
reused while the table still holds it).
"""

from __future__ import annotations

import os
import pathlib

import anyio
import mlx.core as mx

from asyncside.bridge import completed
from asyncside.models import load_streaming_model
from asyncside.runtime import Runtime


def _blob_fds(store: pathlib.Path) -> list[str]:
    """Descriptors of this process on ``store``'s files (Linux: /proc/self/fd)."""
    root = str(store.resolve())
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith(root + os.sep):
            out.append(f"{name} -> {target}")
    return out


def test_an_exited_runtime_still_referenced_holds_no_blob_open(quick_store: pathlib.Path) -> None:
    sm = load_streaming_model(quick_store, completed=completed)
    assert not _blob_fds(quick_store)  # loading the model reads the non-expert weights and closes them

    async def main() -> Runtime:
        async with Runtime(sm.store, resident=0.25) as rt:
            assert _blob_fds(quick_store)  # the fault tables and the reader hold the blobs
            cache = sm.make_cache()
            mx.eval(await sm(mx.array([[1, 2, 3, 4]]), cache, source=rt))
            mx.eval(await sm(mx.array([[5]]), cache, source=rt))
            assert rt.stats()["queued_steps"] > 0  # a queued step ran: its fault tables read
        return rt

    rt = anyio.run(main)  # still referenced, not collected
    assert not _blob_fds(quick_store), _blob_fds(quick_store)
    assert all(r.ok for r in rt.audit().values())

