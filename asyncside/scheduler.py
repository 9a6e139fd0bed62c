"""The submission side of the read path: fills in, FillHandles out, completions on the loop thread.

``Scheduler.submit`` turns a reservation batch (ledger :class:`~asyncside.ledger.Fill` objects,
or anything with ``.fill_id``, ``.expert``, ``.row``) into reads on the chosen reader backend. At
most ``queue_depth`` fills are in flight; the rest wait in a FIFO backlog (backpressure) and start
as earlier fills complete. Completions arrive through the backend's eventfd, watched with
``anyio.wait_readable`` (asyncio, uvloop and trio alike), and are reaped after every submit and on
every wakeup. Each handle's done-callbacks (the runtime's ledger publish/fail) run on the loop
thread, whether or not anyone awaits the handle.

Cancelling ``await handle.wait()`` never cancels the read: the row stays reserved until the read
completes, then the callbacks run. Leaving the ``async with`` waits (shielded) until every read
submitted so far has completed, so no read ever outlives the pools it writes into.
"""

from __future__ import annotations

import errno as _errno
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import anyio
from anyio.abc import TaskStatus

from .errors import FillError
from .pools import PoolSet
from .readers import ReaderBackend, ReaderOptions, choose_reader, make_reader, reader_options
from .store import LayerSpec

log = logging.getLogger(__name__)


class FillLike(Protocol):
    """What the scheduler reads from a fill (a ledger :class:`~asyncside.ledger.Fill` or any alike)."""

    @property
    def fill_id(self) -> int: ...
    @property
    def expert(self) -> int: ...
    @property
    def row(self) -> int: ...


class FillHandle:
    """The future of one fill: done once the record's bytes landed in the row, or the read failed."""

    __slots__ = ("fill", "layer", "_done", "_error", "_event", "_callbacks")

    def __init__(self, fill: FillLike, layer: int) -> None:
        self.fill = fill
        self.layer = layer
        self._done = False
        self._error: FillError | None = None
        self._event: anyio.Event | None = None
        self._callbacks: list[Callable[[FillHandle], None]] = []

    def __repr__(self) -> str:
        state = "pending" if not self._done else ("failed" if self._error else "done")
        return f"FillHandle(layer={self.layer}, expert={self.fill.expert}, row={self.fill.row}, {state})"

    def done(self) -> bool:
        """True once the read finished (successfully or not)."""
        return self._done

    def result_error(self) -> FillError | None:
        """The FillError of a failed read, None if it succeeded (or is not done yet)."""
        return self._error

    async def wait(self) -> None:
        """Wait for the read; raise its FillError if it failed. Cancelling this wait does not
        cancel the read."""
        if not self._done:
            if self._event is None:
                self._event = anyio.Event()
            await self._event.wait()
        if self._error is not None:
            raise self._error

    def add_done_callback(self, fn: Callable[[FillHandle], None]) -> None:
        """Call ``fn(handle)`` on the loop thread when the read finishes (now, if it already has)."""
        if self._done:
            fn(self)
        else:
            self._callbacks.append(fn)

    def _finish(self, error: FillError | None) -> list[BaseException]:
        self._done = True
        self._error = error
        errors: list[BaseException] = []
        callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception as exc:  # a broken callback must not stop other completions
                log.exception("fill done-callback %r raised", fn)
                errors.append(exc)
        if self._event is not None:
            self._event.set()
        return errors


class _Layout:
    __slots__ = ("spec", "pools", "id")

    def __init__(self, spec: LayerSpec, pools: PoolSet, layout_id: int) -> None:
        self.spec = spec
        self.pools = pools
        self.id = layout_id


class Scheduler:
    """Bounded submission queue over one reader backend; see the module docstring."""

    def __init__(self, reader: str = "auto", options: ReaderOptions | None = None, *,
                 direct: bool | None = None) -> None:
        """``reader``: a backend name or ``"auto"`` (see :func:`asyncside.readers.choose_reader`).
        ``options``: reader tuning, :class:`~asyncside.readers.ReaderOptions` defaults when None.
        ``direct``: O_DIRECT reads; None keeps ``options.direct``, or, without options, takes
        $ASYNCSIDE_DIRECT (see :func:`asyncside.readers.reader_options`)."""
        self.options = reader_options(options, direct=direct)
        queue_depth = self.options.queue_depth
        if queue_depth < 1:
            raise ValueError(f"queue_depth: expected an int >= 1, got {queue_depth!r}")
        self.name = choose_reader(reader)
        self.queue_depth: int = queue_depth
        self.direct = bool(self.options.direct)
        self.reader: ReaderBackend | None = None
        self._tokens = itertools.count(1)
        self._layouts: dict[int, _Layout] = {}
        self._inflight: dict[int, tuple[FillHandle, _Layout]] = {}
        self._backlog: deque[tuple[int, FillHandle, _Layout]] = deque()
        self._tg: Any = None
        self._serve_scope: anyio.CancelScope | None = None
        self._idle: anyio.Event | None = None
        self._callback_errors: list[BaseException] = []
        self._closed = False
        self._pumping = False
        self._repump = False
        self._stats: dict[str, Any] = {"submitted": 0, "completed": 0, "failed": 0, "backlogged": 0, "max_backlog": 0,
                                       "submit_calls": 0, "submit_s_total": 0.0, "submit_s_max": 0.0}

    def __repr__(self) -> str:
        return (f"Scheduler(reader={self.name!r}, queue_depth={self.queue_depth}, direct={self.direct}, "
                f"in_flight={len(self._inflight)}, backlog={len(self._backlog)})")

    # ---- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> Scheduler:
        if self.reader is not None or self._closed:
            raise RuntimeError("a Scheduler can be entered once")
        # Building a native reader sets up a ring and allocates/registers staging: off the loop.
        self.reader = await anyio.to_thread.run_sync(make_reader, self.name, self.options)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        try:
            await self._tg.start(self._serve)
        except BaseException:
            await self._tg.__aexit__(None, None, None)
            raise
        return self

    async def _serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        # Shielded: completions must keep flowing while __aexit__ waits out in-flight reads, even
        # when the surrounding scope is being cancelled. __aexit__ cancels this scope itself.
        with anyio.CancelScope(shield=True) as scope:
            self._serve_scope = scope
            assert self.reader is not None
            await self.reader.serve(self._deliver, task_status=task_status)

    async def __aexit__(self, *exc_info: object) -> bool | None:
        try:
            # Reads in flight write into pool rows: wait them out even when being cancelled.
            with anyio.CancelScope(shield=True):
                await self.join()
        finally:
            if self._serve_scope is not None:
                self._serve_scope.cancel()
            try:
                await self._tg.__aexit__(None, None, None)
            finally:
                with anyio.CancelScope(shield=True):
                    assert self.reader is not None
                    await self.reader.aclose()  # native close also waits for any read still in flight
                self._closed = True
        if self._callback_errors and exc_info[0] is None:
            errors, self._callback_errors = self._callback_errors, []
            raise BaseExceptionGroup("fill done-callbacks raised", errors)
        return None

    async def join(self) -> None:
        """Wait until every fill submitted so far has completed (successfully or not)."""
        while self._inflight or self._backlog:
            if self._idle is None or self._idle.is_set():
                self._idle = anyio.Event()
            await self._idle.wait()

    # ---- submission ----------------------------------------------------------------------

    def layout_for(self, spec: LayerSpec, pools: PoolSet) -> int:
        """Register (once) the layer blob and its pools with the reader; returns the layout id."""
        if self.reader is None or self._closed:
            raise RuntimeError("Scheduler is not running: use `async with Scheduler(...)`")
        if pools.spec != spec:
            raise ValueError(f"pools belong to layer {pools.spec.index} ({pools.spec.path}), "
                             f"not layer {spec.index} ({spec.path})")
        lay = self._layouts.get(id(pools))
        if lay is not None and lay.pools is pools:
            return lay.id
        lay = _Layout(spec, pools, self.reader.add_layout(spec, pools))
        self._layouts[id(pools)] = lay
        return lay.id

    def submit(self, spec: LayerSpec, pools: PoolSet, fills: Sequence[FillLike]) -> list[FillHandle]:
        """Start reading each fill's record into its row; returns one handle per fill, in order.

        Never blocks: beyond ``queue_depth`` fills in flight the rest wait in a backlog. Bad
        experts/rows raise ValueError before anything starts.
        """
        self.layout_for(spec, pools)
        lay = self._layouts[id(pools)]
        for f in fills:
            if not 0 <= int(f.expert) < spec.n_experts:
                raise ValueError(f"layer {spec.index}: fill {f.fill_id} expert {f.expert} out of range "
                                 f"[0, {spec.n_experts})")
            if not 0 <= int(f.row) < pools.rows:
                raise ValueError(f"layer {spec.index}: fill {f.fill_id} row {f.row} out of range [0, {pools.rows})")
        handles = []
        for f in fills:
            h = FillHandle(f, spec.index)
            self._backlog.append((next(self._tokens), h, lay))
            handles.append(h)
        self._stats["submitted"] += len(handles)
        self._pump()
        return handles

    def _pump(self) -> None:
        """Move backlog into the reader up to queue_depth, grouped per layout; then reap.

        Not re-entrant: completions delivered by the reap inside (which free room) ask for another
        round instead of recursing.
        """
        if self._pumping:
            self._repump = True
            return
        assert self.reader is not None
        self._pumping = True
        try:
            while True:
                self._repump = False
                room = self.queue_depth - len(self._inflight)
                batches: dict[int, tuple[_Layout, list[int], list[int], list[int]]] = {}
                while room > 0 and self._backlog:
                    tok, h, lay = self._backlog.popleft()
                    self._inflight[tok] = (h, lay)
                    b = batches.setdefault(lay.id, (lay, [], [], []))
                    b[1].append(tok)
                    b[2].append(int(h.fill.expert))
                    b[3].append(int(h.fill.row))
                    room -= 1
                if self._backlog:
                    self._stats["backlogged"] += 1
                    self._stats["max_backlog"] = max(self._stats["max_backlog"], len(self._backlog))
                t0 = time.perf_counter()
                for lay, toks, experts, rows in batches.values():
                    self.reader.submit(lay.id, toks, experts, rows)
                t1 = time.perf_counter()
                # Reads that completed inside submit posted their completions already.
                self.reader.kick(self._deliver)
                if batches:
                    # Time the loop thread spent inside the reader's submit (syscalls included).
                    self._stats["submit_calls"] += 1
                    self._stats["submit_s_total"] += t1 - t0
                    self._stats["submit_s_max"] = max(self._stats["submit_s_max"], t1 - t0)
                if not (self._repump and self._backlog):
                    break
        finally:
            self._pumping = False

    def _deliver(self, done: list[tuple[int, int]]) -> None:
        """Completions, on the loop thread: settle handles (callbacks run), then refill the queue."""
        for tok, res in done:
            h, lay = self._inflight.pop(tok)
            err = None
            if res != 0:
                err = self._error(lay.spec, h, -res)
                self._stats["failed"] += 1
            self._stats["completed"] += 1
            self._callback_errors.extend(h._finish(err))
        if self._backlog and self.reader is not None:
            self._pump()
        if not self._inflight and not self._backlog and self._idle is not None:
            self._idle.set()

    @staticmethod
    def _error(spec: LayerSpec, h: FillHandle, err: int) -> FillError:
        e, row = int(h.fill.expert), int(h.fill.row)
        where = f"read of {spec.path} record {e} (bytes [{e * spec.stride}, {(e + 1) * spec.stride}))"
        if err == _errno.ENODATA:
            msg = f"{where}: end of file before the record's last byte (truncated blob?)"
        else:
            msg = f"{where}: {os.strerror(err)}"
        return FillError(spec.index, e, row, msg, errno=err)

    # ---- introspection -------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Fills handed to the reader and not completed yet."""
        return len(self._inflight)

    @property
    def backlog(self) -> int:
        """Fills waiting for queue room."""
        return len(self._backlog)

    def stats(self) -> dict[str, Any]:
        """Scheduler counts plus the reader's native counters."""
        s: dict[str, Any] = dict(self._stats, reader=self.name, direct=self.direct, queue_depth=self.queue_depth,
                                 in_flight=len(self._inflight), backlog=len(self._backlog))
        if self.reader is not None:
            s["native"] = self.reader.counters()
        return s

    def set_faults(self, **kw: Any) -> None:
        """Test hooks of the reader (see ReaderBackend.set_faults)."""
        if self.reader is None:
            raise RuntimeError("Scheduler is not running")
        self.reader.set_faults(**kw)
