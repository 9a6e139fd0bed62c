"""How late the event loop runs: a ticker that asks to wake every ``interval`` and records lateness.

A loop that is never blocked wakes a sleeping task within a fraction of a millisecond of its
deadline; anything that holds the loop thread (a blocking read, a synchronous ``mx.eval``, MLX's
scheduler throttle inside ``async_eval``) shows up here as lag. Works on asyncio, uvloop and trio.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
import numpy as np

__all__ = ["LoopLag", "measure_loop_lag"]


@dataclass
class LoopLag:
    """Lateness samples (seconds) of one ticker; ``summary()`` gives the figures in ms."""

    interval: float
    samples: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        if not self.samples:
            return {"ticks": 0, "max_ms": 0.0, "p99_ms": 0.0, "median_ms": 0.0, "over_10ms": 0}
        a = np.asarray(self.samples) * 1e3
        return {
            "ticks": int(a.size),
            "max_ms": float(a.max()),
            "p99_ms": float(np.percentile(a, 99)),
            "median_ms": float(np.median(a)),
            "over_10ms": int((a > 10.0).sum()),
        }


async def _tick(lag: LoopLag) -> None:
    while True:
        due = time.perf_counter() + lag.interval
        await anyio.sleep(lag.interval)
        lag.samples.append(max(0.0, time.perf_counter() - due))


@contextlib.asynccontextmanager
async def measure_loop_lag(interval: float = 0.005) -> AsyncIterator[LoopLag]:
    """Measure loop lag while the body runs (one short wake-up of the loop per ``interval``)."""
    if interval <= 0:
        raise ValueError(f"interval must be > 0, got {interval}")
    lag = LoopLag(interval)
    tg = anyio.create_task_group()
    await tg.__aenter__()
    try:
        tg.start_soon(_tick, lag)
        yield lag
    finally:
        tg.cancel_scope.cancel()
        # Not the body's exception: the task group would wrap it in an ExceptionGroup, and its
        # caller expects it as raised (a refusal the command line prints), as Runtime does.
        await tg.__aexit__(None, None, None)
