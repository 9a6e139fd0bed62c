"""Testing code that uses asyncside, with pytest-asyncio and the asyncside pytest plugin.

The plugin is registered when asyncside is installed; nothing to import or configure. Run:

    pytest examples/test_example_pytest_asyncio.py

Fixtures used here: ``expert_store`` (a small random store in a temporary directory),
``asyncside_runtime`` (a Runtime open on the test's event loop while the test runs, audited
clean after it), ``faulty_reader`` (inject read faults into that runtime's reader) and
``no_blocking`` (fail a test whose event loop thread blocks).
"""

from __future__ import annotations

import errno

import numpy as np
import pytest

from asyncside import FillError


def bytes_of_row(runtime, layer: int, expert: int) -> dict[str, np.ndarray]:
    """What the pools hold for ``expert`` now (the row the runtime maps it to)."""
    row = int(np.array(runtime.lookup(layer))[expert])
    assert row >= 0, f"expert {expert} has no row"
    return {key: np.array(pool[row]) for key, pool in runtime.pools(layer).items()}


@pytest.mark.asyncio
@pytest.mark.no_blocking(threshold=0.25)  # fail if the event loop thread is blocked > 250 ms
async def test_ensure_loads_the_experts_bytes(asyncside_runtime, expert_store, no_blocking) -> None:
    layer = next(iter(expert_store.layers))
    await asyncside_runtime.ensure(layer, [5, 6, 7])
    for expert in (5, 6, 7):
        want = expert_store.read_expert(layer, expert)
        got = bytes_of_row(asyncside_runtime, layer, expert)
        for key in want:
            assert np.array_equal(got[key], np.array(want[key])), (expert, key)


@pytest.mark.asyncio
@pytest.mark.asyncside_runtime(reader="threads", policy="lru")  # options for the fixture's Runtime
async def test_marker_sets_runtime_options(asyncside_runtime, expert_store) -> None:
    assert asyncside_runtime.reader == "threads"
    layer = next(iter(expert_store.layers))
    await asyncside_runtime.ensure(layer, [0, 1])
    assert asyncside_runtime.stats()["bytes_read"] >= 0


@pytest.mark.asyncio
async def test_a_failed_read_reaches_the_awaiter_and_publishes_nothing(
    asyncside_runtime, faulty_reader, expert_store
) -> None:
    layer = next(iter(expert_store.layers))
    victim = expert_store.layer(layer).n_experts - 1  # not resident with the default 25%
    faulty_reader.fail(layer, victim, errno.EIO)
    with pytest.raises((FillError, ExceptionGroup)) as info:
        await asyncside_runtime.ensure(layer, [victim])
    errors = info.value.exceptions if isinstance(info.value, ExceptionGroup) else [info.value]
    assert any(isinstance(e, FillError) and e.expert == victim and e.errno == errno.EIO for e in errors)
    assert int(np.array(asyncside_runtime.lookup(layer))[victim]) == -1  # no row was published

    faulty_reader.clear()  # the fault is gone: the same expert now loads
    await asyncside_runtime.ensure(layer, [victim])
    assert int(np.array(asyncside_runtime.lookup(layer))[victim]) >= 0


@pytest.mark.asyncio
async def test_short_reads_still_deliver_whole_records(asyncside_runtime, faulty_reader, expert_store) -> None:
    layer = next(iter(expert_store.layers))
    faulty_reader.short_reads(max_bytes=512)
    experts = list(range(expert_store.layer(layer).n_experts))
    await asyncside_runtime.ensure(layer, experts[-3:])
    for expert in experts[-3:]:
        want = expert_store.read_expert(layer, expert)
        got = bytes_of_row(asyncside_runtime, layer, expert)
        assert all(np.array_equal(got[k], np.array(want[k])) for k in want)
