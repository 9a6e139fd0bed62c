"""What the parts of the runtime share: each layer's state, and the loop-side context.

Everything here is touched on the event loop thread only. The parts (the host fill path, the
queued-step side, leases) each own some of the counters and some of the transitions; this module
holds what all of them read: the layers, the scheduler, the completion bridge, the task group and
the "something changed" event that waiting ensures and drains sleep on.
"""

from __future__ import annotations

import asyncio
import numbers
import os
import sys
import threading
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import mlx.core as mx
import numpy as np

import asyncside._native as _native  # absolute: a relative import resolves through the lazy front door in mypy

from ..errors import AsyncsideError, FillError
from ..ledger import Fill, Ledger
from ..pools import PoolSet
from ..scheduler import HostedTaskGroup, Scheduler
from ..snapshot import RowSnapshot
from ..store import ExpertStore, LayerSpec
from ._stats import CacheStats, QueuedStats, ReadStats

if TYPE_CHECKING:
    from ..bridge import Completed


def native_available(x: mx.array, *, failed: bool = True) -> bool:
    """True when x's computation finished; ``failed`` when it failed. A queued step's failed
    faults are learned from the fault log, not from MLX's error, so checking (and consuming) it
    there loses nothing; a prediction asks for False, so its lazy path meets the error."""
    try:
        return bool(_native.is_available(x))
    except Exception:
        return failed


def host_ids(ids: Any) -> np.ndarray:
    """Expert ids as a flat host array (an ``mx.array`` must be computed already)."""
    if isinstance(ids, mx.array):
        return np.array(ids, copy=True).reshape(-1)
    return np.asarray(ids).reshape(-1)


def running_loop() -> object | None:
    """The event loop running on this thread: asyncio's loop, or the trio run's token; None outside one."""
    loop = asyncio._get_running_loop()
    if loop is not None:
        return loop
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            token: object = trio.lowlevel.current_trio_token()
        except RuntimeError:  # not inside a trio run
            return None
        return token
    return None


class Pending:
    """One fill from reserve until its bytes are usable in the pool (read, and uploaded for device
    pools). Settled exactly once, on the loop thread, right after the ledger saw the outcome."""

    __slots__ = ("fill", "_event", "error")

    def __init__(self, fill: Fill) -> None:
        self.fill = fill
        self._event = anyio.Event()
        self.error: FillError | None = None

    def done(self) -> bool:
        return self._event.is_set()

    def settle(self, error: FillError | None) -> None:
        self.error = error
        self._event.set()

    async def wait(self) -> None:
        """Wait for the bytes; raise the fill's FillError if it failed."""
        await self._event.wait()
        if self.error is not None:
            raise self.error


@dataclass
class PrefetchHandle:
    """What ``Runtime.prefetch`` returns: await it to wait for the prefetch's own fills."""

    layer: int
    _done: anyio.Event
    fills: list[Fill] = field(default_factory=list)
    errors: list[Exception] = field(default_factory=list)

    def done(self) -> bool:
        return self._done.is_set()

    async def wait(self) -> None:
        """Wait for this prefetch's reads; raise an ExceptionGroup of its FillErrors, if any."""
        await self._done.wait()
        if self.errors:
            raise ExceptionGroup(f"prefetch of layer {self.layer} failed", list(self.errors))

    def __await__(self):  # type: ignore[no-untyped-def]
        return self.wait().__await__()


@dataclass
class LayerState:
    """Everything the runtime keeps for one layer."""

    spec: LayerSpec
    ledger: Ledger
    pools: PoolSet
    inflight: dict[int, Pending] = field(default_factory=dict)  # expert -> its fill in flight
    # op id -> holders. A prefetch's fills hold the prefetch's own op id, so a drain that began
    # before a lazy prefetch resolved still waits for the reads that prefetch starts later.
    outstanding: Counter[int] = field(default_factory=Counter)
    errors: list[FillError] = field(default_factory=list)  # failed fills since the last drain
    # Device pools: reads that landed in the mirror, waiting for one batched upload.
    uploads: list[tuple[Pending, int, float, Any]] = field(default_factory=list)
    table: mx.array | None = None
    table_version: int = -1
    snap: RowSnapshot | None = None
    snap_version: int = -1
    version: int = 0  # bumped on every row-state change that alters lookup()
    # Queued steps: the native fault table of this layer, and whether the ledger's table changed
    # by other means since the native one was last synced.
    faults: Any = None
    fault_fd: int = -1  # the fault table's descriptor of the layer's blob (the table closes it)
    # Device tables with a host tier: the whole-layer arrays staged resolves fill (one per segment
    # key, a row per expert; shared by the layers of one shape), or None.
    staging: dict[str, mx.array] | None = None
    native_dirty: bool = True
    native_order: str = ""  # the victim order and half-life the fault table was last told
    native_half_life: float = 0.0
    # ensure() calls that must reserve, oldest first, each with its wanted experts. An ensure
    # never evicts what an older one wants, and a prefetch evicts nothing any of them wants: the
    # oldest always makes progress (fair FIFO demand, no livelock between concurrent ensures).
    demands: list[np.ndarray] = field(default_factory=list)

    def changed(self) -> None:
        """The row state changed: lookup tables and snapshots are stale, the native table too."""
        self.version += 1
        self.native_dirty = True


class Shared:
    """The loop-side context every part of one runtime works in."""

    def __init__(self, store: ExpertStore, scheduler: Scheduler) -> None:
        self.store = store
        self.scheduler = scheduler
        self.layers: dict[int, LayerState] = {}
        self.completed: Completed | None = None
        self.tg: HostedTaskGroup | None = None
        self.closed = False
        self.exited = False  # closing finished: every read landed, every task is gone
        self.loop_thread: int | None = None  # the thread whose event loop entered the runtime
        self.pid = os.getpid()  # the process it runs in: a forked child has none of its threads or rings
        self.loop: object | None = None  # that event loop (asyncio's loop, trio's run token)
        self.cache = CacheStats()
        self.reads = ReadStats()
        self.queued = QueuedStats()
        self._changed: anyio.Event | None = None
        self._next_op = 0

    def start(self, completed: Completed) -> None:
        self.completed = completed
        self._changed = anyio.Event()

    def layer(self, layer: int) -> LayerState:
        st = self.layers.get(layer) if type(layer) is int else None
        if st is not None:
            return st
        # A bool or a float equal to an index (True, 1.0) reached that layer through the dict's
        # hashing, and "1" was said to be "layer 1 ... not streamed (layers: [0, 1])".
        if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, numbers.Integral):
            raise AsyncsideError(f"layer {layer!r}: expected a layer index, an integer (layers: {sorted(self.layers)})")
        try:
            return self.layers[int(layer)]
        except KeyError:
            raise AsyncsideError(
                f"layer {layer} is not streamed by this runtime (layers: {sorted(self.layers)})"
            ) from None

    def check_running(self) -> None:
        """AsyncsideError unless the runtime is entered and not closing (before any ledger change)."""
        if self.closed:
            raise AsyncsideError("the runtime is closed: no more prefetch/ensure/lease (it was used after "
                                 "`async with Runtime(...)` ended, or its entry failed)")
        if self.tg is None:
            raise AsyncsideError("the runtime is not running (use `async with Runtime(...) as rt`)")
        self.check_thread()

    def check_thread(self) -> None:
        """AsyncsideError when called from another thread than the one whose event loop entered the
        runtime: its events, tasks and ledgers belong to that loop (another loop's await of them
        hung on asyncio, and failed inside anyio with a lease left open on trio)."""
        if self.pid != os.getpid():
            # A fork keeps the forking thread's id and leaves no running loop: the checks below
            # passed, and a prefetch went into the parent's reader (its io_uring ring is shared).
            raise AsyncsideError(
                f"the runtime was created in process {self.pid}, and this process was forked from it: its "
                "reads, reader threads and rings stayed in that process; enter a Runtime of its own here")
        if self.loop_thread is not None and threading.get_ident() != self.loop_thread:
            raise AsyncsideError(
                f"the runtime is used from thread {threading.current_thread().name!r}, but it runs on the event "
                "loop that entered it (another thread's): call it from that loop (anyio.from_thread.run, "
                "asyncio.run_coroutine_threadsafe), or enter a Runtime of its own on this loop")
        loop = running_loop()
        if loop is not None and self.loop is not None and loop is not self.loop:
            # The same thread, another loop (a second asyncio.run, a pytest-asyncio fixture on another
            # loop scope than its test's): the reads complete on the loop that entered it, which
            # nobody runs now, so the await hung.
            raise AsyncsideError(
                "the runtime is used from another event loop than the one that entered it (this thread ran "
                "both): its reads complete on that loop only; enter a Runtime on this loop, or give a "
                "pytest-asyncio fixture that opens one the loop scope of the tests that use it")

    def notify(self) -> None:
        """Wake every task waiting for a change (a fill settled, a lease went, an ensure ended)."""
        if self._changed is not None:
            self._changed.set()
            self._changed = anyio.Event()

    async def wait_change(self) -> None:
        assert self._changed is not None
        await self._changed.wait()

    async def computed(self, x: mx.array) -> None:
        """Wait until ``x`` has been computed on its stream (the completion bridge)."""
        assert self.completed is not None, "the runtime is not entered"
        await self.completed(x)

    def spawn(self, fn: Callable[..., Coroutine[Any, Any, None]], *args: Any) -> None:
        if self.tg is None or self.closed:
            raise AsyncsideError("the runtime is not running (use `async with Runtime(...)`)")
        self.tg.start_soon(fn, *args)

    @property
    def horizon(self) -> int:
        """The next op id: every op held so far is older."""
        return self._next_op

    def hold(self, st: LayerState, op: int | None = None) -> int:
        """Hold ``op`` (a new one when None) outstanding on ``st`` until :meth:`finish`."""
        if op is None:
            op = self._next_op
            self._next_op += 1
        st.outstanding[op] += 1
        return op

    def finish(self, st: LayerState, op: int) -> None:
        st.outstanding[op] -= 1
        if st.outstanding[op] <= 0:
            del st.outstanding[op]
        self.notify()
