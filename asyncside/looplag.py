"""How late the event loop runs: a ticker that asks to wake every ``interval`` and records lateness.

A loop that is never blocked wakes a sleeping task within a fraction of a millisecond of its
deadline; anything that holds the loop thread (a blocking read, a synchronous ``mx.eval``, MLX's
scheduler throttle inside ``async_eval``) shows up here as lag. Works on asyncio, uvloop and trio.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
import numpy as np

__all__ = ["LoopLag", "measure_loop_lag"]

#: the latest samples kept for the median and the 99th percentile (at the default interval, the last
#: minutes); ticks, the maximum and the ticks over 10 ms count every sample
SAMPLES_KEPT = 1 << 16


@dataclass
class LoopLag:
    """Lateness samples (seconds) of one ticker; ``summary()`` gives the figures in ms.

    ``samples`` keeps the latest :data:`SAMPLES_KEPT` (a run of hours held a float per tick);
    ``ticks``, ``max_s`` and ``over_10ms`` count them all."""

    interval: float
    samples: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLES_KEPT))
    ticks: int = 0
    max_s: float = 0.0
    over_10ms: int = 0

    def add(self, lateness: float) -> None:
        """Count one tick ``lateness`` seconds late."""
        self.samples.append(lateness)
        self.ticks += 1
        self.max_s = max(self.max_s, lateness)
        self.over_10ms += lateness > 0.010

    def summary(self) -> dict[str, float]:
        if not self.samples:
            return {"ticks": 0, "max_ms": 0.0, "p99_ms": 0.0, "median_ms": 0.0, "over_10ms": 0}
        a = np.asarray(self.samples) * 1e3
        return {
            "ticks": self.ticks,
            "max_ms": self.max_s * 1e3,
            "p99_ms": float(np.percentile(a, 99)),
            "median_ms": float(np.median(a)),
            "over_10ms": self.over_10ms,
        }


async def _tick(lag: LoopLag) -> None:
    while True:
        due = time.perf_counter() + lag.interval
        await anyio.sleep(lag.interval)
        lag.add(max(0.0, time.perf_counter() - due))


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
