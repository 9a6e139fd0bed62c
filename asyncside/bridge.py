"""Await MLX computations on the event loop through the native completion bridge.

``await completed(x)`` resolves once ``x`` has been computed on its stream. It never blocks the
event loop and never evaluates on another thread (MLX streams are thread-local): on the calling
(loop) thread it schedules ``x`` with ``async_eval`` plus a native *completion signal* right after
it on the same stream. When the stream reaches the signal, a native thread posts a ticket to a
:class:`CompletionQueue` and makes its eventfd readable; the loop reaps the ticket and wakes the
awaiter. When the awaiter resumes, ``x`` is marked available: reading it never waits.

One :class:`CompletionQueue` serves each event loop (an asyncio/uvloop loop, or a trio run),
created on the first ``completed()`` that has to wait: nothing needs opening or closing by the
caller. The eventfd is watched with the backend's own primitive rather than a reaper task in a
task group the caller would have to own:

* asyncio/uvloop: ``loop.add_reader`` (a plain callback). The queue closes, fd included, one loop
  iteration after its last outstanding ticket is reaped, so back-to-back awaits share one queue
  and an idle loop holds no descriptor.
* trio: the awaiters take turns waiting on the fd (``trio.lowlevel.wait_readable``; one at a time),
  so a completion wakes its own awaiter directly; a system task reaps tickets whose awaiters were
  all cancelled and closes the queue when the run ends.

A cancelled awaiter walks away at once; its ticket is still reaped, and discarded, when the stream
gets there. :func:`counters` exposes the native and Python counters that tests balance.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import threading
import weakref
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio.lowlevel
import mlx.core as mx

import asyncside._native as _native  # absolute: a relative import resolves through the lazy front door in mypy

from .errors import AsyncsideError

__all__ = [
    "Armed",
    "Completed",
    "ComputationError",
    "CompletionQueue",
    "StreamLike",
    "arm",
    "completed",
    "completed_at",
    "counters",
    "current_queue",
    "schedule",
]

StreamLike = mx.Stream | mx.Device | mx.DeviceType | None

#: The type of :func:`completed` as its users take it (injected into the runtime and the forward,
#: so tests can substitute a bridge).
Completed = Callable[[mx.array], Awaitable[None]]


class ComputationError(AsyncsideError, RuntimeError):
    """The MLX computation a ``completed()`` awaited failed on its stream (MLX's message attached)."""


# Process-wide Python-side counters (the native ones come from _native.bridge_counters()).
_stats: dict[str, int] = {
    "issued": 0,  # tickets whose signal was scheduled
    "resolved": 0,  # tickets that woke their awaiter
    "discarded": 0,  # tickets reaped after their awaiter was cancelled
    "failed_to_issue": 0,  # signal()/async_eval raised; no ticket outstanding
    "fast_path": 0,  # x was already available: no ticket at all
    "stray": 0,  # reaped tickets nobody issued successfully (issuing raised after MLX queued them)
}
_stats_lock = threading.Lock()  # loops in several threads may complete concurrently
_live_queues: weakref.WeakSet[CompletionQueue] = weakref.WeakSet()


def _bump(key: str) -> None:
    with _stats_lock:
        _stats[key] += 1


@dataclass(eq=False)
class _Waiter:
    """One outstanding ticket. Holds x and the signal so the graph lives until the ticket lands."""

    x: mx.array | None  # None: a barrier (the stream ran everything queued before it)
    signal: mx.array | None  # None: the post was queued directly on the stream
    wake: Any  # asyncio.Future (asyncio) or trio.Event (trio)
    posted_ns: int = 0
    done: bool = False  # trio: the ticket landed
    abandoned: bool = False  # the awaiter was cancelled: discard the ticket when it lands
    awaited: bool = True  # False while an armed ticket waits for its await (trio: never a leader)


class CompletionQueue(ABC):
    """The completion queue of one event loop: issues tickets, reaps them, wakes their awaiters.

    Obtain it with :func:`current_queue`; ``completed()`` does that itself. Not thread-safe: it
    belongs to its loop's thread (the native queue underneath is what other threads post to).
    """

    backend: str = "?"

    def __init__(self) -> None:
        self.native = _native.CompletionQueue()
        self.fd: int = self.native.fileno()
        self.outstanding = 0  # tickets issued and not yet reaped (cancelled ones included)
        self.closed = False
        self._tickets = itertools.count(1)
        self._waiters: dict[int, _Waiter] = {}
        # Tasks waiting for room under MLX's eval throttle, oldest first; only the first awaits
        # the stream, the others wait for their turn (see _schedule).
        self._line: deque[anyio.Event] = deque()
        with _stats_lock:
            _live_queues.add(self)

    # -- issuing -------------------------------------------------------------------------------

    def _issue(self, x: mx.array, stream: mx.Stream | None, wake: Any,
               then: Sequence[mx.array] = ()) -> _Waiter:
        ticket = next(self._tickets)
        then = list(then)
        try:
            signal, then_done = _native.signal(x, self.native, ticket, stream, then)
        except BaseException as exc:
            # Nothing waits for this ticket; if MLX queued the signal before raising, its late
            # post is reaped (or dropped once the queue closes) and counted, never delivered.
            self.native.abandon(ticket)
            _bump("failed_to_issue")
            if self.outstanding == 0:
                self._reaped_all()
            if isinstance(exc, RuntimeError) and not isinstance(exc, ComputationError):
                raise ComputationError(f"scheduling the computation failed: {exc}") from exc
            raise
        waiter = _Waiter(x, signal, wake)
        self._waiters[ticket] = waiter
        self.outstanding += 1
        _bump("issued")
        if then and not then_done:
            # Queued behind the signal: the stream goes on computing them while the awaiter wakes.
            # (On a GPU stream the signal's own async_eval took them: one command buffer, not two.)
            # One non-blocking step: what does not fit under MLX's throttle now is computed later,
            # when something that needs it is evaluated.
            try:
                _native.schedule_step(then)
            except BaseException:
                waiter.abandoned = True  # its ticket is reaped and discarded; nobody awaits it
                raise
        return waiter

    def _issue_barrier(self, stream: mx.Stream, wake: Any) -> _Waiter:
        ticket = next(self._tickets)
        try:
            _native.barrier(self.native, ticket, stream)
        except BaseException:
            self.native.abandon(ticket)
            _bump("failed_to_issue")
            if self.outstanding == 0:
                self._reaped_all()
            raise
        waiter = _Waiter(None, None, wake)
        self._waiters[ticket] = waiter
        self.outstanding += 1
        _bump("issued")
        return waiter

    # -- the line for room under MLX's throttle --------------------------------------------------

    def _join_line(self) -> anyio.Event:
        turn = anyio.Event()
        self._line.append(turn)
        if len(self._line) == 1:
            turn.set()  # first in line: its turn now
        return turn

    def _leave_line(self, turn: anyio.Event) -> None:
        was_first = bool(self._line) and self._line[0] is turn
        try:
            self._line.remove(turn)
        except ValueError:
            return
        if was_first and self._line:
            self._line[0].set()
        elif not self._line and self.outstanding == 0:
            self._reaped_all()  # the line kept an idle queue open: it may close now

    # -- reaping (runs on the loop thread) -----------------------------------------------------

    def _reap(self) -> None:
        for ticket, posted_ns in self.native.drain():
            waiter = self._waiters.pop(ticket, None)
            if waiter is None:  # a ticket whose issuing failed after MLX had queued it
                _bump("stray")
                continue
            self.outstanding -= 1
            if waiter.abandoned or not self._wake(waiter, posted_ns):
                _bump("discarded")
            else:
                _bump("resolved")
        if self.outstanding == 0:
            self._reaped_all()

    @abstractmethod
    def _wake(self, waiter: _Waiter, posted_ns: int) -> bool:
        """Backend-specific (asyncio/uvloop or trio)."""

    # -- lifetime -------------------------------------------------------------------------------

    def _close_if_idle(self) -> None:
        if self.outstanding == 0 and not self._line and not self.closed:
            self.close()

    def _reaped_all(self) -> None:
        """Every ticket is reaped: close, or (per backend) linger for the next one."""
        self._close_if_idle()

    def close(self) -> None:
        """Stop watching the fd and close the native queue. Idempotent.

        Called automatically when no ticket is outstanding (asyncio) or when the run ends (trio).
        Closing with tickets outstanding drops them (their late posts are counted as dropped
        natively) and wakes any awaiter still waiting with RuntimeError.
        """
        if self.closed:
            return
        self.closed = True
        self._unwatch()
        self.native.close()
        self._forget()
        for waiter in self._waiters.values():
            if not waiter.abandoned and not waiter.done:
                self._fail(waiter, RuntimeError("the completion queue was closed with this completion in flight"))
            waiter.abandoned = True
        self._waiters.clear()

    @abstractmethod
    def _fail(self, waiter: _Waiter, exc: BaseException) -> None:
        """Backend-specific (asyncio/uvloop or trio)."""

    @abstractmethod
    def _unwatch(self) -> None:
        """Backend-specific (asyncio/uvloop or trio)."""

    @abstractmethod
    def _forget(self) -> None:
        """Backend-specific (asyncio/uvloop or trio)."""

    @abstractmethod
    async def wait(self, x: mx.array, stream: mx.Stream | None = None, then: Sequence[mx.array] = ()) -> int:
        """Issue a ticket for x, schedule ``then`` behind it, and wait for x; returns the native
        post time (monotonic ns)."""

    @abstractmethod
    def arm(self, x: mx.array, stream: mx.Stream | None = None) -> _Waiter:
        """Issue a ticket for x (scheduled already) now; await it later with :meth:`wait_armed`."""

    @abstractmethod
    async def wait_armed(self, waiter: _Waiter) -> int:
        """Wait for a ticket :meth:`arm` issued; returns the native post time (monotonic ns)."""

    @abstractmethod
    def disarm(self, waiter: _Waiter) -> None:
        """Nobody will await this armed ticket: it is reaped and discarded when it lands."""

    @abstractmethod
    async def wait_stream(self, stream: mx.Stream) -> int:
        """Wait until the CPU ``stream`` has run everything queued on it so far (a barrier
        ticket); returns the native post time (monotonic ns)."""


class _AsyncioQueue(CompletionQueue):
    backend = "asyncio"

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        # Weak: the loop owns the queue (through the reader below), not the other way round.
        self._loop_ref = weakref.ref(loop)
        loop.add_reader(self.fd, self._reap)

    def _reaped_all(self) -> None:
        # Close one loop iteration later, and only if still idle: the awaiters just woken run
        # first (their wakeups were scheduled before this), so a task that awaits completions
        # back to back keeps one queue instead of opening and closing one per completion.
        loop = self._loop_ref()
        if loop is None or loop.is_closed():
            self.close()
        else:
            loop.call_soon(self._close_if_idle)

    def _wake(self, waiter: _Waiter, posted_ns: int) -> bool:
        fut: asyncio.Future[int] = waiter.wake
        if fut.done():  # cancelled while waiting
            return False
        fut.set_result(posted_ns)
        return True

    def _fail(self, waiter: _Waiter, exc: BaseException) -> None:
        fut: asyncio.Future[int] = waiter.wake
        if not fut.done():
            if not waiter.awaited:  # an armed ticket nobody awaits yet: no error left unretrieved
                fut.cancel()
                return
            try:
                fut.set_exception(exc)
            except RuntimeError:  # its loop is closed: nobody is waiting any more
                pass

    def _unwatch(self) -> None:
        loop = self._loop_ref()
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self.fd)

    def _forget(self) -> None:
        loop = self._loop_ref()
        if loop is not None and _asyncio_queues.get(id(loop)) is self:
            del _asyncio_queues[id(loop)]

    async def wait(self, x: mx.array, stream: mx.Stream | None = None, then: Sequence[mx.array] = ()) -> int:
        fut = asyncio.get_running_loop().create_future()
        waiter = self._issue(x, stream, fut, then)
        # Cancellation cancels fut; the waiter stays registered until its ticket is reaped.
        posted_ns: int = await fut
        if waiter.x is not None:
            _raise_if_failed(waiter.x)
        return posted_ns

    def arm(self, x: mx.array, stream: mx.Stream | None = None) -> _Waiter:
        waiter = self._issue(x, stream, asyncio.get_running_loop().create_future())
        waiter.awaited = False
        return waiter

    async def wait_armed(self, waiter: _Waiter) -> int:
        waiter.awaited = True
        if waiter.wake.cancelled() and self.closed:  # closed before its await began (see _fail)
            raise RuntimeError("the completion queue was closed with this completion in flight")
        posted_ns: int = await waiter.wake
        if waiter.x is not None:
            _raise_if_failed(waiter.x)
        return posted_ns

    def disarm(self, waiter: _Waiter) -> None:
        waiter.wake.cancel()  # (a future already done stays as it is)

    async def wait_stream(self, stream: mx.Stream) -> int:
        fut = asyncio.get_running_loop().create_future()
        self._issue_barrier(stream, fut)
        posted_ns: int = await fut
        return posted_ns


class _TrioQueue(CompletionQueue):
    """trio: the awaiters take turns watching the fd, so a completion wakes its awaiter directly.

    At most one task waits on the fd at a time (trio raises BusyResourceError otherwise): the
    *leader*. A waiter that finds no leader becomes it; it reaps every completion that lands,
    wakes their awaiters, and when its own ticket is done (or it is cancelled) hands the role to
    another live waiter. If no live waiter is left while tickets are still outstanding (their
    awaiters were cancelled), a system task (the *keeper*) leads until they are reaped. The keeper
    otherwise sleeps; trio cancels it when the run ends, and that closes the queue.
    """

    backend = "trio"
    _KEEPER = object()

    def __init__(self) -> None:
        import trio

        super().__init__()
        self._trio = trio
        self._leader: object | None = None  # a _Waiter, _KEEPER, or None
        self._orphans = trio.Event()  # set when the keeper must lead
        trio.lowlevel.spawn_system_task(self._keeper, name="asyncside.bridge keeper")

    async def _lead(self, me: object, until: Any) -> None:
        """Wait on the fd and reap until until() is true; then hand the role on."""
        trio = self._trio
        self._leader = me
        try:
            while not until() and not self.closed:
                try:
                    await trio.lowlevel.wait_readable(self.fd)
                except trio.ClosedResourceError:  # the queue was closed under us
                    return
                self._reap()
        finally:
            self._leader = None
            self._hand_over()

    def _hand_over(self) -> None:
        if self.closed or self._leader is not None:
            return
        for waiter in self._waiters.values():
            if not waiter.done and not waiter.abandoned and waiter.awaited:
                waiter.wake.set()  # not done: it wakes up to lead
                return
        if self.outstanding > 0:
            self._orphans.set()

    async def _keeper(self) -> None:
        try:
            while not self.closed:
                await self._orphans.wait()
                self._orphans = self._trio.Event()
                if self._leader is None:
                    await self._lead(self._KEEPER, lambda: self.outstanding == 0)
        finally:
            self.close()  # the run is ending (or the queue was closed)

    def _reaped_all(self) -> None:
        pass  # the queue lives as long as the run: the keeper closes it

    def _fail(self, waiter: _Waiter, exc: BaseException) -> None:
        waiter.wake.set()  # not done: wait() sees the queue closed and raises

    def _wake(self, waiter: _Waiter, posted_ns: int) -> bool:
        waiter.done = True
        waiter.posted_ns = posted_ns
        waiter.wake.set()
        return True

    def _unwatch(self) -> None:
        # Wake whoever is parked on the fd (it then stops leading); harmless if nobody is.
        try:
            self._trio.lowlevel.notify_closing(self.fd)
        except RuntimeError:  # outside the run (interpreter shutdown)
            pass
        self._orphans.set()

    def _forget(self) -> None:
        try:
            if _trio_queue_var().get(None) is self:
                _trio_queue_var().set(None)
        except RuntimeError:  # outside the run (shutdown)
            pass

    async def wait(self, x: mx.array, stream: mx.Stream | None = None, then: Sequence[mx.array] = ()) -> int:
        waiter = self._issue(x, stream, self._trio.Event(), then)
        return await self._await(waiter)

    def arm(self, x: mx.array, stream: mx.Stream | None = None) -> _Waiter:
        waiter = self._issue(x, stream, self._trio.Event())
        waiter.awaited = False  # until wait_armed: the keeper reaps it if nobody else leads
        return waiter

    async def wait_armed(self, waiter: _Waiter) -> int:
        waiter.awaited = True
        return await self._await(waiter)

    def disarm(self, waiter: _Waiter) -> None:
        if not waiter.done:
            waiter.abandoned = True
            self._hand_over()

    async def wait_stream(self, stream: mx.Stream) -> int:
        return await self._await(self._issue_barrier(stream, self._trio.Event()))

    async def _await(self, waiter: _Waiter) -> int:
        try:
            while not waiter.done:
                if self.closed:
                    raise RuntimeError("the completion queue was closed with this completion in flight")
                if self._leader is None:
                    await self._lead(waiter, lambda: waiter.done)
                else:
                    await waiter.wake.wait()
                    if not waiter.done:  # woken to lead: re-arm for the next wait
                        waiter.wake = self._trio.Event()
        except BaseException:
            if not waiter.done:
                waiter.abandoned = True
                self._hand_over()
            raise
        if waiter.x is not None:
            _raise_if_failed(waiter.x)
        return waiter.posted_ns


# -- registry: one queue per event loop ----------------------------------------------------------

# Keyed by id(loop), holding queues weakly: a queue is kept alive by its loop (the reader it
# registered) and by its awaiters, never by this registry. A strong value would pin the loop
# through the awaiters' futures, and a loop that closed with a ticket in flight would never be
# collected, nor its eventfd closed.
_asyncio_queues: weakref.WeakValueDictionary[int, _AsyncioQueue] = weakref.WeakValueDictionary()
_trio_var: Any = None


def _trio_queue_var() -> Any:
    global _trio_var
    if _trio_var is None:
        import trio

        _trio_var = trio.lowlevel.RunVar("asyncside_bridge_queue")
    return _trio_var


def current_queue() -> CompletionQueue:
    """The completion queue of the running event loop, created if it has none (or closed it).

    Raises RuntimeError outside an asyncio/uvloop loop or a trio run.
    """
    loop = asyncio._get_running_loop()
    if loop is not None:
        q = _asyncio_queues.get(id(loop))
        if q is None or q.closed or q._loop_ref() is not loop:
            q = _asyncio_queues[id(loop)] = _AsyncioQueue(loop)
        return q
    if "trio" in sys.modules:
        var = _trio_queue_var()
        try:
            tq: _TrioQueue | None = var.get(None)
        except RuntimeError:  # not inside a trio run
            pass
        else:
            if tq is None or tq.closed:
                tq = _TrioQueue()
                var.set(tq)
            return tq
    raise RuntimeError("asyncside.completed() must be awaited inside an asyncio or trio event loop")


# -- public API ----------------------------------------------------------------------------------


def _as_stream(stream: StreamLike) -> mx.Stream | None:
    if stream is None or isinstance(stream, mx.Stream):
        return stream
    if isinstance(stream, mx.Device):
        return mx.default_stream(stream)
    if isinstance(stream, mx.DeviceType):
        return mx.default_stream(mx.Device(stream))
    raise TypeError(
        f"stream must be an mlx.core.Stream, Device or DeviceType (or None), got {type(stream).__name__}"
    )


def _raise_if_failed(x: mx.array) -> bool:
    try:
        return bool(_native.is_available(x))
    except RuntimeError as exc:
        raise ComputationError(f"the computation failed on its stream: {exc}") from exc


async def completed_at(x: mx.array, *, stream: StreamLike = None, then: Sequence[mx.array] = ()) -> int | None:
    """Like :func:`completed`, and return when the stream reached x.

    Returns the ``time.monotonic_ns()`` clock reading taken by the native thread that posted the
    ticket, or None when x was already available (no ticket was needed).
    """
    if not isinstance(x, mx.array):
        raise TypeError(f"completed() expects an mlx.core.array, got {type(x).__name__}")
    then = list(then)
    if not all(isinstance(t, mx.array) for t in then):
        raise TypeError("completed(then=...) expects a sequence of mlx.core.array")
    s = _as_stream(stream)
    if _raise_if_failed(x):
        _bump("fast_path")
        if then:
            _native.schedule_step(then)
        await anyio.lowlevel.checkpoint()
        return None
    queue = current_queue()
    await _schedule(queue, [x])
    return await queue.wait(x, s, then)


def _cpu_stream_of(roots: list[mx.array]) -> mx.Stream:
    """The stream a barrier for ``roots`` goes on: the first unscheduled root's, if on the CPU."""
    for r in roots:
        if _native.array_status(r) == "unscheduled":
            s = _native.stream_of(r)
            if s is not None and s.device == mx.cpu:
                return s  # type: ignore[no-any-return]  # the native extension is untyped
            break
    return mx.default_stream(mx.cpu)


async def _schedule(queue: CompletionQueue, roots: list[mx.array]) -> None:
    """Schedule ``roots`` piece by piece, awaiting the stream between pieces.

    MLX's ``async_eval`` blocks its caller while more than its limit of task groups is queued, and
    a long prefill layer queued at once held the event loop for a long time (BENCHMARKS.md,
    measurements behind code choices). Each step schedules only what fits
    (never blocking) and otherwise names an array already on the stream to await first. When
    nothing fits and nothing of the graph is on the stream (many independent completions at once),
    the task waits in the queue's line: the first in line awaits a barrier on the stream, the rest
    their turn, so each gets room in arrival order and none blocks the loop.
    """
    turn: anyio.Event | None = None
    try:
        while True:
            if turn is None and queue._line:  # others wait for room: behind them
                turn = queue._join_line()
            if turn is not None and not turn.is_set():
                await turn.wait()
            done, wait_on = _native.schedule_step(roots)
            if done:
                return
            if queue.closed and turn is None:
                # An asyncio queue closes itself once idle, a loop iteration after its last ticket
                # was reaped. A pipeline rank's step once found the one it started with closed
                # between two pieces (four requests taking turns under uvloop; the
                # exact interleaving was not pinned down): take the loop's current one. (A task in
                # the line keeps its queue open, so `turn` is None whenever this happens.)
                queue = current_queue()
            if wait_on is not None:
                await queue.wait(wait_on)
                continue
            if turn is None:
                turn = queue._join_line()
                if not turn.is_set():
                    continue
            await queue.wait_stream(_cpu_stream_of(roots))
    finally:
        if turn is not None:
            queue._leave_line(turn)


async def schedule(*arrays: mx.array) -> None:
    """Schedule ``arrays`` for computation (like ``mx.async_eval``) without ever blocking the loop.

    Returns once everything is queued on its stream (not computed); awaits the stream in between
    when MLX's throttle would otherwise make ``async_eval`` wait on the calling thread.
    """
    if not all(isinstance(a, mx.array) for a in arrays):
        raise TypeError("schedule() expects mlx.core.array arguments")
    if arrays:
        await _schedule(current_queue(), list(arrays))


async def completed(x: mx.array, *, stream: StreamLike = None, then: Sequence[mx.array] = ()) -> None:
    """Resolve once x has been computed on its stream; never blocks the loop.

    x is scheduled (``async_eval``) if it was not yet. ``stream`` picks the stream the completion
    signal runs on (default: x's own stream; with no native GPU path compiled, a GPU x is signalled
    from the CPU stream, which MLX makes wait for x). On return, x is available: reading it does
    not wait. Raises :class:`ComputationError` if x's computation failed on its stream.
    Cancellable: a cancelled await leaves nothing behind but a ticket that is reaped and discarded.

    ``then``: arrays to schedule right *behind* x's completion signal, so the stream keeps
    computing them while the awaiter wakes and reads x (the forward passes its speculative expert
    outputs here). They are only scheduled, never awaited; scheduling x after them instead would
    delay x's signal until they are done.
    """
    await completed_at(x, stream=stream, then=then)


class Armed:
    """A completion ticket issued when its array was scheduled, awaited later: see :func:`arm`."""

    __slots__ = ("x", "_queue", "_waiter", "_used")

    def __init__(self, x: mx.array, queue: CompletionQueue | None, waiter: _Waiter | None) -> None:
        self.x = x
        self._queue = queue
        self._waiter = waiter  # None: x was available when armed
        self._used = False

    async def wait(self) -> None:
        """Resolve once x is computed (raises ComputationError if its computation failed).

        Awaited at most once. Cancellable like :func:`completed`: the ticket is then discarded
        when it lands."""
        if self._used:
            raise RuntimeError("an armed completion is awaited at most once")
        self._used = True
        if self._queue is None or self._waiter is None:
            _raise_if_failed(self.x)
            await anyio.lowlevel.checkpoint()
            return
        await self._queue.wait_armed(self._waiter)

    def disarm(self) -> None:
        """Say that nobody will await it (its ticket is discarded when the stream gets there)."""
        if not self._used:
            self._used = True
            if self._queue is not None and self._waiter is not None and not self._queue.closed:
                self._queue.disarm(self._waiter)


def arm(x: mx.array, *, stream: StreamLike = None) -> Armed:
    """Issue ``x``'s completion signal now, right behind ``x`` on its stream; await it later with
    :meth:`Armed.wait`.

    ``await completed(x)`` queues its signal behind whatever the stream holds when it is called.
    A caller that queues more work on the stream before it awaits ``x`` (a decode step queued on
    the previous step's lazy token before that token is awaited) would hear of ``x`` only once
    that work is done too, and build the next step while the stream stands idle. ``x`` must be
    scheduled already (``arm`` never schedules, so it never waits for room under MLX's
    throttle); must be called on the event loop's thread.
    """
    if not isinstance(x, mx.array):
        raise TypeError(f"arm() expects an mlx.core.array, got {type(x).__name__}")
    if _native.array_status(x) == "unscheduled":
        raise ValueError("arm(): x is not scheduled yet (schedule it first, e.g. with asyncside.bridge.schedule)")
    if _raise_if_failed(x):
        _bump("fast_path")
        return Armed(x, None, None)
    queue = current_queue()
    return Armed(x, queue, queue.arm(x, _as_stream(stream)))


def counters() -> dict[str, int]:
    """Native and Python-side bridge counters, plus the tickets outstanding right now.

    Balance (once nothing is in flight): ``tickets_posted == tickets_reaped + tickets_dropped``,
    ``queues_created == queues_closed``, ``issued == resolved + discarded`` and ``outstanding == 0``.
    """
    c: dict[str, int] = dict(_native.bridge_counters())
    with _stats_lock:
        c.update(_stats)
    with _stats_lock:
        live = [q for q in _live_queues if not q.closed]
    c["outstanding"] = sum(q.outstanding for q in live)
    c["open_queues"] = len(live)
    return c
