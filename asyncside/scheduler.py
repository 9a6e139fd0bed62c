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

import asyncio
import errno as _errno
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import anyio
import anyio.abc

from .errors import FillError
from .pools import PoolSet
from .readers import ReaderBackend, ReaderOptions, choose_reader, make_reader, reader_options
from .store import LayerSpec

log = logging.getLogger(__name__)


class HostedTaskGroup:
    """A task group that the task which opened it need not be the one to close it.

    On asyncio (uvloop too) the task group is entered in a task of its own, its host, so that an
    object holding one may be entered in one task and exited in another of the same loop:
    pytest-asyncio runs an async fixture's set-up and its teardown in two tasks, and a task group
    entered in the first refused to exit in the second ("Attempted to exit cancel scope in a
    different task than it was entered in"), leaving the runtime half closed. A task of the group
    that fails cancels the task that opened it, as a failure in a task group entered there did;
    :meth:`__aexit__` raises what the group's tasks raised. On trio, whose test runners keep a
    fixture in one task, it is the opening task's own task group.
    """

    def __init__(self) -> None:
        self._tg: anyio.abc.TaskGroup | None = None
        self._host: asyncio.Task[None] | None = None
        self._owner: asyncio.Task[Any] | None = None
        self._leave = anyio.Event()
        self._ended = anyio.Event()
        self._owner_cancelled = False

    @property
    def cancel_scope(self) -> anyio.CancelScope:
        """The group's cancel scope (cancelling it cancels the group's tasks, never the opener)."""
        assert self._tg is not None, "the task group is not open"
        return self._tg.cancel_scope

    def start_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Start ``fn(*args)`` as a task of the group."""
        assert self._tg is not None, "the task group is not open"
        self._tg.start_soon(fn, *args)

    async def __aenter__(self) -> HostedTaskGroup:
        loop = asyncio._get_running_loop()
        if loop is None:
            self._tg = anyio.create_task_group()
            await self._tg.__aenter__()
            return self
        self._owner = asyncio.current_task()
        opened = anyio.Event()

        async def host() -> None:
            try:
                async with anyio.create_task_group() as tg:
                    self._tg = tg
                    opened.set()
                    await self._leave.wait()
            finally:
                owner = self._owner
                if not self._leave.is_set() and owner is not None and not owner.done():
                    # A task of the group failed (or the host was cancelled) while the opener
                    # still runs: it hears of it as in a task group of its own.
                    self._owner_cancelled = True
                    owner.cancel()

        self._host = loop.create_task(host())
        self._host.add_done_callback(lambda _task: self._ended.set())
        try:
            await opened.wait()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> bool | None:
        """Wait for the group's tasks (cancel :attr:`cancel_scope` first to end them); raise what
        they raised. Cancelled meanwhile, it cancels them and still waits."""
        if self._host is None:
            assert self._tg is not None
            return await self._tg.__aexit__(None, None, None)
        self._leave.set()
        try:
            await self._ended.wait()
        except BaseException:
            if self._tg is not None:
                self._tg.cancel_scope.cancel()
            with anyio.CancelScope(shield=True):
                await self._ended.wait()
            raise
        finally:
            if self._owner_cancelled and self._owner is asyncio.current_task() and self._owner is not None:
                self._owner_cancelled = False
                self._owner.uncancel()  # the cancellation stood for the failure raised below
        if not self._host.cancelled() and (exc := self._host.exception()) is not None:
            raise exc
        return None


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


class _Ready:
    """The ``task_status`` a reader's serve() reports readiness through (sets an Event)."""

    __slots__ = ("_event",)

    def __init__(self, event: anyio.Event) -> None:
        self._event = event

    def started(self, value: object = None) -> None:
        self._event.set()


class _Layout:
    """A layer blob and its pools, as registered with the reader (``id``) or being opened.

    Opening happens in a worker thread (``opening`` is set until it finished). Fills submitted
    meanwhile wait in ``waiting``; if the open fails, ``error`` holds the OSError and every fill
    of the layout fails with it.
    """

    __slots__ = ("spec", "pools", "id", "opening", "error", "waiting", "scope")

    def __init__(self, spec: LayerSpec, pools: PoolSet) -> None:
        self.spec = spec
        self.pools = pools
        self.id = -1
        self.opening: anyio.Event | None = None
        self.error: OSError | None = None
        self.waiting: list[tuple[int, FillHandle]] = []
        self.scope = anyio.CancelScope()  # cancelled when the scheduler closes mid-open


class Scheduler:
    """Bounded submission queue over one reader backend; see the module docstring."""

    def __init__(self, reader: str = "auto", options: ReaderOptions | None = None, *,
                 direct: bool | None = None, verify: bool | None = None) -> None:
        """``reader``: a backend name or ``"auto"`` (see :func:`asyncside.readers.choose_reader`).
        ``options``: reader tuning, :class:`~asyncside.readers.ReaderOptions` defaults when None.
        ``direct``: O_DIRECT reads; None keeps ``options.direct``, or, without options, takes
        $ASYNCSIDE_DIRECT (see :func:`asyncside.readers.reader_options`). ``verify``: check each
        record's checksum before its fill completes; None keeps ``options.verify``."""
        self.options = reader_options(options, direct=direct)
        if verify is not None:
            self.options.verify = bool(verify)
        queue_depth = self.options.queue_depth
        if queue_depth < 1:
            raise ValueError(f"queue_depth: expected an int >= 1, got {queue_depth!r}")
        self.name = choose_reader(reader)
        self.queue_depth: int = queue_depth
        self.direct = bool(self.options.direct)
        self.verify = bool(self.options.verify)
        self.reader: ReaderBackend | None = None
        self._tokens = itertools.count(1)
        self._layouts: dict[int, _Layout] = {}
        self._inflight: dict[int, tuple[FillHandle, _Layout]] = {}
        self._backlog: deque[tuple[int, FillHandle, _Layout]] = deque()
        self._tg: HostedTaskGroup | None = None
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
        # Shielded: a reader built in the worker thread must not be dropped by a cancellation
        # (its eventfd and threads would live until garbage collection); it is closed below.
        with anyio.CancelScope(shield=True):
            reader = await anyio.to_thread.run_sync(make_reader, self.name, self.options)
        self.reader = reader
        # The serve task shields itself (completions must flow while __aexit__ waits out reads),
        # so it is never started with TaskGroup.start: a start cancelled before the task reports
        # ready would wait forever for a shielded task. Its scope is created (and cancelled)
        # here, and the wait for readiness is an ordinary cancellable wait.
        self._serve_scope = anyio.CancelScope(shield=True)
        ready = anyio.Event()
        tg = HostedTaskGroup()  # exited by whichever task exits the scheduler
        await tg.__aenter__()
        self._tg = tg
        try:
            tg.start_soon(self._serve, ready)
            await ready.wait()
        except BaseException:
            # The task group is exited in its own scope (not inside a new one): it waits for the
            # serve task, which leaves at once now that its scope is cancelled.
            self._serve_scope.cancel()
            try:
                await tg.__aexit__(None, None, None)
            finally:
                with anyio.CancelScope(shield=True):
                    await reader.aclose()
                self._closed = True
            raise
        return self

    async def _serve(self, ready: anyio.Event) -> None:
        # Shielded (self._serve_scope): completions must keep flowing while __aexit__ waits out
        # in-flight reads, even when the surrounding scope is being cancelled. Only __aexit__ (or
        # a failed __aenter__) cancels this scope.
        assert self._serve_scope is not None and self.reader is not None
        with self._serve_scope:
            await self.reader.serve(self._deliver, task_status=_Ready(ready))

    async def __aexit__(self, *exc_info: object) -> bool | None:
        try:
            try:
                # Fills waiting for their blob to open are waited for, but cancellably: an open
                # that hangs (a stale mount) is abandoned and those fills fail.
                for lay in list(self._layouts.values()):
                    if lay.waiting and lay.opening is not None:
                        await lay.opening.wait()
            finally:
                for lay in self._layouts.values():
                    lay.scope.cancel()
                # Reads in flight write into pool rows: wait them out even when being cancelled.
                with anyio.CancelScope(shield=True):
                    await self.join()
        finally:
            if self._serve_scope is not None:
                self._serve_scope.cancel()
            try:
                if self._tg is not None:
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
        while self._inflight or self._backlog or self._opening_fills():
            if self._idle is None or self._idle.is_set():
                self._idle = anyio.Event()
            await self._idle.wait()

    # ---- submission ----------------------------------------------------------------------

    def _check_layout(self, spec: LayerSpec, pools: PoolSet) -> _Layout:
        if self.reader is None or self._closed:
            raise RuntimeError("Scheduler is not running: use `async with Scheduler(...)`")
        if pools.spec != spec:
            raise ValueError(f"pools belong to layer {pools.spec.index} ({pools.spec.path}), "
                             f"not layer {spec.index} ({spec.path})")
        lay = self._layouts.get(id(pools))
        if lay is None or lay.pools is not pools:
            lay = self._layouts[id(pools)] = _Layout(spec, pools)
        return lay

    def _open_layout(self, lay: _Layout) -> anyio.Event:
        """Start opening ``lay``'s blob in a worker thread (once); returns the Event set when done.

        The open never runs on the loop thread: open() of a FIFO, or of a file on a stale network
        mount, blocks. The reader opens with O_NONBLOCK and refuses anything but a regular file;
        a mount that hangs in open() keeps only the worker thread, which the awaiter may abandon.
        """
        if lay.opening is None:
            lay.opening = anyio.Event()
            assert self._tg is not None, "the scheduler is not entered"
            self._tg.start_soon(self._opener, lay)
        return lay.opening

    async def _opener(self, lay: _Layout) -> None:
        assert self.reader is not None and lay.opening is not None
        reader = self.reader
        try:
            with lay.scope:
                # abandon_on_cancel: a scheduler closing while an open hangs (a stale mount)
                # walks away from the worker thread rather than hanging with it.
                lay.id = await anyio.to_thread.run_sync(reader.add_layout, lay.spec, lay.pools,
                                                        abandon_on_cancel=True)
        except OSError as exc:
            lay.error = exc
        except Exception as exc:  # a refused layout (or a bug): every waiting fill still settles
            lay.error = OSError(_errno.EINVAL, f"cannot register the blob with the reader: {exc}")
        finally:
            if lay.id < 0 and lay.error is None:
                lay.error = OSError(_errno.ECANCELED, "the scheduler closed before the blob was opened")
            lay.opening.set()
            waiting, lay.waiting = lay.waiting, []
            if lay.error is not None:
                for _tok, h in waiting:
                    self._fail_handle(lay.spec, h, lay.error)
                self._signal_idle()
            elif waiting:
                self._backlog.extend((tok, h, lay) for tok, h in waiting)
                self._pump()

    async def prepare(self, spec: LayerSpec, pools: PoolSet) -> None:
        """Open ``spec``'s blob for reads into ``pools`` now (in a worker thread), so that the
        first fill need not wait for it. Raises OSError (naming the file) if it cannot be opened:
        missing, unreadable, not a regular file, or O_DIRECT refused by its filesystem."""
        lay = self._check_layout(spec, pools)
        await self._open_layout(lay).wait()
        if lay.error is not None:
            raise lay.error

    async def reopen(self, path: str) -> int:
        """Open the blob at ``path`` again for every layout reading it (a blob replaced on disk by
        another file): fills submitted from now on read the file now at ``path``; fills in flight
        finish on the old one, whose handle the reader keeps until it closes. Returns how many
        layouts were re-opened; one that fails to open keeps reading the old file."""
        if self.reader is None or self._closed:
            return 0
        reader, n = self.reader, 0
        for lay in list(self._layouts.values()):
            if str(lay.spec.path) != str(path) or lay.id < 0 or lay.opening is None or not lay.opening.is_set():
                continue
            try:
                lay.id = await anyio.to_thread.run_sync(reader.add_layout, lay.spec, lay.pools)
            except OSError:
                continue
            n += 1
        return n

    def layout_for(self, spec: LayerSpec, pools: PoolSet) -> int:
        """The reader's layout id of an already prepared layer (see :meth:`prepare`), else -1."""
        lay = self._check_layout(spec, pools)
        return lay.id if lay.opening is not None and lay.opening.is_set() and lay.error is None else -1

    def submit(self, spec: LayerSpec, pools: PoolSet, fills: Sequence[FillLike]) -> list[FillHandle]:
        """Start reading each fill's record into its row; returns one handle per fill, in order.

        Never blocks: beyond ``queue_depth`` fills in flight the rest wait in a backlog, and a
        layer not yet prepared is opened in a worker thread first. Bad experts/rows raise
        ValueError before anything starts; anything that goes wrong later (the blob cannot be
        opened, the reader refuses the read) fails the fills' handles with a FillError.
        """
        lay = self._check_layout(spec, pools)
        for f in fills:
            if not 0 <= int(f.expert) < spec.n_experts:
                raise ValueError(f"layer {spec.index}: fill {f.fill_id} expert {f.expert} out of range "
                                 f"[0, {spec.n_experts})")
            if not 0 <= int(f.row) < pools.rows:
                raise ValueError(f"layer {spec.index}: fill {f.fill_id} row {f.row} out of range [0, {pools.rows})")
        handles = [FillHandle(f, spec.index) for f in fills]
        self._stats["submitted"] += len(handles)
        if lay.opening is not None and lay.opening.is_set() and lay.error is not None:
            # The last open failed: try again (a blob renamed back, a mount that came back).
            lay.opening, lay.error, lay.scope = None, None, anyio.CancelScope()
        if lay.opening is None or not lay.opening.is_set():
            lay.waiting.extend((next(self._tokens), h) for h in handles)
            self._open_layout(lay)
            return handles
        for h in handles:
            self._backlog.append((next(self._tokens), h, lay))
        self._pump()
        return handles

    def _fail_handle(self, spec: LayerSpec, h: FillHandle, exc: OSError) -> None:
        """Settle a fill that never reached the reader (its callbacks run now, on the loop thread)."""
        code = exc.errno or _errno.EIO
        e, row = int(h.fill.expert), int(h.fill.row)
        what = exc.strerror or str(exc)
        msg = f"cannot read {spec.path} record {e}: {what} (errno {code})"
        self._stats["failed"] += 1
        self._stats["completed"] += 1
        self._callback_errors.extend(h._finish(FillError(spec.index, e, row, msg, errno=code)))

    def _signal_idle(self) -> None:
        if not self._inflight and not self._backlog and not self._opening_fills() and self._idle is not None:
            self._idle.set()

    def _opening_fills(self) -> int:
        return sum(len(lay.waiting) for lay in self._layouts.values())

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
                    try:
                        self.reader.submit(lay.id, toks, experts, rows)
                    except Exception as exc:  # refused before any read started: fail these fills
                        err = exc if isinstance(exc, OSError) else OSError(
                            _errno.EIO, f"the reader refused the reads: {exc}")
                        for tok in toks:
                            h, _ = self._inflight.pop(tok)
                            self._fail_handle(lay.spec, h, err)
                        self._repump = True  # their room is free again
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
        self._signal_idle()

    def _deliver(self, done: list[tuple[int, int]]) -> None:
        """Completions, on the loop thread: settle handles (callbacks run), then refill the queue."""
        for tok, res in done:
            h, lay = self._inflight.pop(tok)
            err = None
            if res != 0:
                err = self._error(lay.spec, h, -res, self.reader.take_mismatch(tok) if self.reader else None)
                self._stats["failed"] += 1
            self._stats["completed"] += 1
            self._callback_errors.extend(h._finish(err))
        if self._backlog and self.reader is not None:
            self._pump()
        self._signal_idle()

    @staticmethod
    def _error(spec: LayerSpec, h: FillHandle, err: int, mismatch: tuple[int, int] | None = None) -> FillError:
        e, row = int(h.fill.expert), int(h.fill.row)
        where = f"read of {spec.path} record {e} (bytes [{e * spec.stride}, {(e + 1) * spec.stride}))"
        if err == _errno.ENODATA:
            msg = f"{where}: end of file before the record's last byte (truncated blob?)"
        elif err == _errno.EBADMSG and mismatch is not None:
            expected, got = mismatch
            msg = (f"{where}: {spec.checksum} checksum mismatch: expected {expected:#010x}, got {got:#010x} "
                   f"(the bytes on disk are not what the store was written with)")
            return FillError(spec.index, e, row, msg, errno=err, expected=expected, got=got)
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
        """Fills waiting for queue room (or for their blob to be opened)."""
        return len(self._backlog) + self._opening_fills()

    def stats(self) -> dict[str, Any]:
        """Scheduler counts plus the reader's native counters."""
        s: dict[str, Any] = dict(self._stats, reader=self.name, direct=self.direct, queue_depth=self.queue_depth,
                                 in_flight=len(self._inflight), backlog=self.backlog)
        if self.reader is not None:
            s["native"] = self.reader.counters()
        return s

    def set_faults(self, **kw: Any) -> None:
        """Test hooks of the reader (see ReaderBackend.set_faults)."""
        if self.reader is None:
            raise RuntimeError("Scheduler is not running")
        self.reader.set_faults(**kw)
