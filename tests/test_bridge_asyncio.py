"""The bridge under pytest-asyncio (strict mode) beside anyio's plugin, and asyncio-only lifetime."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import numpy as np
import pytest

import asyncside._native as native
from asyncside import bridge
from asyncside.bridge import completed


def _delta(before: dict[str, int]) -> dict[str, int]:
    after = bridge.counters()
    return {k: after[k] - before.get(k, 0) for k in after}


@pytest.mark.asyncio
async def test_queue_lives_only_while_tickets_are_outstanding(no_blocking: object) -> None:
    before = bridge.counters()
    xs = [mx.array(np.ones(8, np.float32)) * float(i) for i in range(3)]
    for x in xs:  # back to back: one queue serves them all
        await completed(x)
    assert bridge.counters()["open_queues"] == 1
    await asyncio.sleep(0)  # the idle check runs one loop iteration after the last reap
    d = _delta(before)
    assert bridge.counters()["open_queues"] == 0
    assert d["queues_created"] == d["queues_closed"] == 1
    assert d["tickets_posted"] == d["tickets_reaped"] == 3
    assert all(native.is_available(x) for x in xs)


@pytest.mark.asyncio
async def test_gather_of_completions(no_blocking: object) -> None:
    base = mx.array(np.arange(4, dtype=np.float32))
    xs = [base + float(i) for i in range(20)]
    await asyncio.gather(*(completed(x) for x in xs))
    for i, x in enumerate(xs):
        np.testing.assert_array_equal(np.array(x), np.arange(4, dtype=np.float32) + i)
