"""A closed runtime's pools are freed: the process's pool-building thread kept the last pools it
built, and ``asyncside demo`` ran its slot-cache reference while the streaming run's pools were still
allocated (``demo --memory 1G`` over a store of 576 MiB, pools 288 MiB: its RSS rose by the pools'
size during the reference)."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import anyio
import numpy as np
import pytest

from asyncside.runtime import Runtime
from asyncside.store import ExpertStore

ROWS = 4


def _store(path: pathlib.Path) -> ExpertStore:
    rng = np.random.default_rng(0)
    return ExpertStore.create(path, {layer: {"w": rng.integers(0, 255, size=(16, 1 << 16), dtype=np.uint8)}
                                     for layer in range(2)})


def test_a_closed_runtimes_pools_are_freed(tmp_path: pathlib.Path) -> None:
    """A runtime's host pools are built on the process's pool-building thread, which kept the last
    build's finished future (and the pools it returned) while it waited for the next: the last
    layer's pools of a closed runtime stayed allocated in the process (the demo's slot-cache
    reference then ran beside them, past the memory budget). Once the runtime is closed and
    dropped, no pool array of it is left."""
    import gc
    import weakref

    store = _store(tmp_path / "s")

    async def main() -> list[weakref.ref[Any]]:
        async with Runtime(store, reader="threads", resident=0.25, min_side_rows=ROWS) as rt:
            await rt.ensure(1, [0, 1])
            return [weakref.ref(a) for i in store.layers for a in rt.pools(i).values()]

    held = anyio.run(main)
    gc.collect()
    assert held and [r() is None for r in held] == [True] * len(held)


def test_the_demos_slot_cache_reference_runs_without_the_streaming_runs_pools(
        quick_store: pathlib.Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``demo --reference slot-cache`` ran the slot cache, pools of the runtime's size, while the
    streaming run's pools were still allocated: ``demo --memory 1G`` peaked at the pools' size past
    the streaming run (choose_reference counts nothing for the slot cache, which runs after it). No
    pool of the streaming run is left when the reference starts."""
    import weakref

    from asyncside import demo, pools
    from asyncside.cli import main

    built: list[weakref.ref[Any]] = []
    init = pools.PoolSet.__init__

    def recorded(self: pools.PoolSet, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        built.append(weakref.ref(self))

    left: list[int] = []
    run = demo.slot_cache_run

    def reference(*args: Any, **kwargs: Any) -> Any:
        left.append(sum(r() is not None for r in built))
        return run(*args, **kwargs)

    monkeypatch.setattr(pools.PoolSet, "__init__", recorded)
    monkeypatch.setattr(demo, "slot_cache_run", reference)
    assert main(["demo", "--model", str(quick_store), "--tokens", "2", "--resident", "0.25", "--json",
                 "--reference", "slot-cache"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["reference"] == "slot-cache" and res["tokens_identical"] is True
    assert built and left == [0]
