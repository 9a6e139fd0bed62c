"""Catch blocking calls on the event loop thread: a watchdog for tests (asyncio, uvloop and trio).

:class:`BlockingDetector` runs a watchdog thread that keeps one *ping* in flight to the event loop
(``loop.call_soon_threadsafe`` on asyncio, ``TrioToken.run_sync_soon`` on trio). A responsive loop
answers within microseconds; a ping left unanswered for longer than ``threshold`` seconds means
the loop thread is stuck in something (``time.sleep``, ``mx.eval`` of unfinished work, a
synchronous read...). The watchdog then samples the loop thread's Python stack
(``sys._current_frames``), so the failure says *where* the loop was blocked. This works the same
on every backend, unlike asyncio's debug-mode ``slow_callback_duration``.

Strict mode additionally patches ``mx.eval`` (of arrays that are not yet available),
``mx.synchronize`` and ``time.sleep`` to raise :class:`BlockingCallError` when called on the loop
thread while the detector watches, catching the call itself even when it happens to be quick.

For pytest, :func:`no_blocking` is a fixture (import it into a ``conftest.py``) that wraps an async
test so its whole body runs under a detector, on pytest-asyncio and anyio's plugin alike::

    async def test_x(no_blocking): ...                               # default 50 ms threshold
    @pytest.mark.no_blocking(threshold=0.1, strict=True)             # per test configuration
    async def test_y(no_blocking): ...

The default threshold comes from ``ASYNCSIDE_BLOCKING_THRESHOLD_MS`` when set (CI is noisy).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import anyio.lowlevel

__all__ = [
    "BlockingCallError",
    "BlockingDetector",
    "Incident",
    "LoopBlockedError",
    "default_threshold",
    "no_blocking",
]


class LoopBlockedError(AssertionError):
    """The event loop thread was blocked longer than the threshold (the message holds the stack)."""


class BlockingCallError(RuntimeError):
    """Strict mode: a known blocking call was made on the event loop thread."""


def default_threshold() -> float:
    """Seconds: ``ASYNCSIDE_BLOCKING_THRESHOLD_MS`` if set, else 50 ms."""
    raw = os.environ.get("ASYNCSIDE_BLOCKING_THRESHOLD_MS")
    if raw is None:
        return 0.05
    try:
        ms = float(raw)
    except ValueError:
        raise ValueError(f"ASYNCSIDE_BLOCKING_THRESHOLD_MS must be a number of ms, got {raw!r}") from None
    if ms <= 0:
        raise ValueError(f"ASYNCSIDE_BLOCKING_THRESHOLD_MS must be > 0, got {raw!r}")
    return ms / 1000.0


@dataclass
class Incident:
    """One stretch during which the loop did not answer a ping within the threshold."""

    blocked_s: float  # how long the ping waited (at least; final once the loop answered)
    stack: str  # the loop thread's Python stack, sampled while it was blocked
    answered: bool = False  # the loop answered the ping (the stretch ended) before stop
    call: str | None = None  # strict mode: the blocking call that was refused
    watchdog_lag_s: float = 0.0  # how late the watchdog itself woke meanwhile (see describe())

    def describe(self) -> str:
        head = (
            f"strict mode refused {self.call} on the event loop thread"
            if self.call
            else f"event loop thread blocked for {'' if self.answered else 'at least '}"
            f"{self.blocked_s * 1000:.1f} ms"
        )
        note = ""
        if self.watchdog_lag_s > 0.5 * self.blocked_s > 0:
            note = (f" (the watchdog thread itself woke {self.watchdog_lag_s * 1000:.1f} ms late: the loop "
                    f"thread held the GIL, or the whole process was descheduled on a busy machine)")
        return f"{head}{note}; loop thread stack:\n{self.stack}"


@dataclass
class _Ping:
    sent: float
    answered: float | None = None
    incident: Incident | None = None
    watchdog_lag_s: float = 0.0


@dataclass
class _LoopHandle:
    thread_id: int
    post: Callable[[Callable[[], None]], None]  # thread-safe "run this on the loop soon"


def _thread_cpu_clock(thread_id: int) -> Callable[[], float] | None:
    """A reader of the CPU time the given thread has used (None where unsupported)."""
    try:
        clock = time.pthread_getcpuclockid(thread_id)
        time.clock_gettime(clock)
    except (AttributeError, OSError):
        return None
    return lambda: time.clock_gettime(clock)


def _current_loop_handle() -> _LoopHandle:
    loop = asyncio._get_running_loop()
    if loop is not None:
        return _LoopHandle(threading.get_ident(), loop.call_soon_threadsafe)
    if "trio" in sys.modules:
        import trio

        try:
            token = trio.lowlevel.current_trio_token()
        except RuntimeError:
            pass
        else:
            return _LoopHandle(threading.get_ident(), token.run_sync_soon)
    raise RuntimeError("BlockingDetector must be entered inside an asyncio or trio event loop")


def _stack_of(thread_id: int) -> str:
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return "  (loop thread not found)\n"
    return "".join(traceback.format_stack(frame))


@dataclass(eq=False)
class BlockingDetector:
    """Watches the running event loop for blocking; enter it (``async with``) on the loop.

    ``threshold``: seconds a ping may wait before the loop counts as blocked. ``interval``: how
    often the watchdog looks (default: a fifth of the threshold, at most 5 ms). ``strict``: also
    refuse known blocking calls on the loop thread. After exit, :attr:`incidents` lists what
    happened; leaving the block without an exception raises :class:`LoopBlockedError` if any
    incident was recorded and ``raise_on_exit`` is true.
    """

    threshold: float = field(default_factory=default_threshold)
    strict: bool = False
    interval: float | None = None
    raise_on_exit: bool = True
    incidents: list[Incident] = field(default_factory=list)
    max_ping_s: float = 0.0  # the slowest answered ping: how responsive the loop was
    pings_answered: int = 0  # how many times the loop answered (proof the watchdog watched)

    def __post_init__(self) -> None:
        if not self.threshold > 0:
            raise ValueError(f"threshold must be > 0 seconds, got {self.threshold!r}")
        if self.interval is None:
            self.interval = min(self.threshold / 5, 0.005)
        if not self.interval > 0:
            raise ValueError(f"interval must be > 0 seconds, got {self.interval!r}")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: _LoopHandle | None = None
        self._unpatch: Callable[[], None] | None = None

    # -- lifetime ---------------------------------------------------------------------------------

    async def __aenter__(self) -> BlockingDetector:
        self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        if et is None:
            # Let the loop answer a ping that a block just before exit left waiting, so the
            # incident gets its real duration.
            await anyio.lowlevel.checkpoint()
        self.stop()
        if et is None and self.raise_on_exit:
            self.check()

    def start(self) -> None:
        """Attach to the running loop (call on the loop thread) and start the watchdog."""
        if self._thread is not None:
            raise RuntimeError("this BlockingDetector is already watching")
        self._loop = _current_loop_handle()
        self._stop.clear()
        if self.strict:
            self._unpatch = _install_strict(self)
        self._thread = threading.Thread(target=self._watch, name="asyncside-blocking-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the watchdog and undo strict-mode patches. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._unpatch is not None:
            self._unpatch()
            self._unpatch = None

    def check(self) -> None:
        """Raise :class:`LoopBlockedError` describing every incident, if there was any."""
        if self.incidents:
            parts = [f"{len(self.incidents)} blocking incident(s) on the event loop thread "
                     f"(threshold {self.threshold * 1000:.0f} ms):"]
            parts += [f"--- incident {i + 1}: {inc.describe()}" for i, inc in enumerate(self.incidents)]
            raise LoopBlockedError("\n".join(parts))

    @property
    def loop_thread_id(self) -> int | None:
        """The thread id of the loop being watched (None when not watching)."""
        return self._loop.thread_id if self._thread is not None and self._loop is not None else None

    # -- the watchdog thread ----------------------------------------------------------------------

    def _watch(self) -> None:
        assert self._loop is not None and self.interval is not None
        loop = self._loop
        ping: _Ping | None = None
        last = time.monotonic()
        loop_cpu = _thread_cpu_clock(loop.thread_id)
        cpu_last = loop_cpu() if loop_cpu else 0.0
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            # How late this thread woke: the whole process being descheduled (a noisy machine) or
            # the loop thread holding the GIL. Reported with an incident, never used to excuse it.
            lag = max(0.0, now - last - self.interval)
            last = now
            cpu_now = loop_cpu() if loop_cpu else 0.0
            cpu_used, cpu_last = cpu_now - cpu_last, cpu_now
            if ping is not None:
                ping.watchdog_lag_s = max(ping.watchdog_lag_s, lag)
            # A ping still waiting, or answered late, reports this stretch itself (below).
            covered = ping is not None and (ping.answered is None or ping.answered - ping.sent > self.threshold)
            if not covered and lag > self.threshold and cpu_used > 0.5 * lag:
                # No ping was in flight, and we could not run to send one: the loop thread was
                # busy (it burnt the CPU time) and kept the GIL the whole while.
                self._record(
                    Incident(lag, f"  (not sampled: the loop thread kept the GIL, busy for "
                                  f"{cpu_used * 1000:.1f} ms of CPU)\n", True, watchdog_lag_s=lag)
                )
            if ping is not None and ping.answered is not None:
                waited = ping.answered - ping.sent
                self.max_ping_s = max(self.max_ping_s, waited)
                self.pings_answered += 1
                if ping.incident is not None:
                    ping.incident.blocked_s = waited
                    ping.incident.answered = True
                elif waited > self.threshold:
                    # Blocked while this thread could not run (GIL held, or process descheduled).
                    self._record(
                        Incident(waited, "  (not sampled: the watchdog could not run while the loop was blocked)\n",
                                 True, watchdog_lag_s=ping.watchdog_lag_s)
                    )
                ping = None
            if ping is None:
                ping = _Ping(now)
                current = ping
                try:
                    loop.post(lambda p=current: setattr(p, "answered", time.monotonic()))
                except Exception:  # the loop closed under us: nothing left to watch
                    return
                continue
            waited = now - ping.sent
            if waited > self.threshold:
                if ping.incident is None:
                    ping.incident = Incident(waited, _stack_of(loop.thread_id))
                    self._record(ping.incident)
                else:
                    ping.incident.blocked_s = waited
                ping.incident.watchdog_lag_s = ping.watchdog_lag_s
        if ping is not None and ping.incident is not None:
            if ping.answered is not None:
                ping.incident.blocked_s = ping.answered - ping.sent
                ping.incident.answered = True
            else:
                ping.incident.blocked_s = time.monotonic() - ping.sent

    def _record(self, incident: Incident) -> None:
        with self._lock:
            self.incidents.append(incident)

    # -- strict mode ------------------------------------------------------------------------------

    def _refuse(self, call: str) -> None:
        incident = Incident(0.0, "".join(traceback.format_stack(sys._getframe(2))), call=call)
        self._record(incident)
        raise BlockingCallError(f"{call} called on the event loop thread; await asyncside.completed() "
                                f"or move it to a worker thread")


_strict_owner: BlockingDetector | None = None


def _install_strict(det: BlockingDetector) -> Callable[[], None]:
    """Patch mx.eval, mx.synchronize and time.sleep; return the undo function."""
    global _strict_owner
    if _strict_owner is not None:
        raise RuntimeError("only one strict BlockingDetector can watch at a time")
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from . import _native

    orig_eval, orig_sync, orig_sleep = mx.eval, mx.synchronize, time.sleep

    def on_loop() -> bool:
        return _strict_owner is det and threading.get_ident() == det.loop_thread_id

    @functools.wraps(orig_eval)
    def eval_guard(*args: Any) -> None:
        if on_loop():
            arrays = [v for _, v in tree_flatten(list(args)) if isinstance(v, mx.array)]
            if not all(_native.is_available(a) for a in arrays):
                det._refuse("mx.eval() of arrays that are not yet available")
        return orig_eval(*args)

    @functools.wraps(orig_sync)
    def sync_guard(*args: Any, **kwargs: Any) -> None:
        if on_loop():
            det._refuse("mx.synchronize()")
        return orig_sync(*args, **kwargs)

    @functools.wraps(orig_sleep)
    def sleep_guard(seconds: float) -> None:
        if on_loop() and seconds > 0:
            det._refuse(f"time.sleep({seconds!r})")
        return orig_sleep(seconds)

    mx.eval, mx.synchronize, time.sleep = eval_guard, sync_guard, sleep_guard
    _strict_owner = det

    def undo() -> None:
        global _strict_owner
        mx.eval, mx.synchronize, time.sleep = orig_eval, orig_sync, orig_sleep
        _strict_owner = None

    return undo


# -- pytest fixture ---------------------------------------------------------------------------------

try:
    import pytest
except ImportError:  # pragma: no cover - the fixture needs pytest, the detector does not
    pytest = None  # type: ignore[assignment]

if pytest is not None:

    @pytest.fixture
    def no_blocking(request: Any) -> Iterator[BlockingDetector]:
        """Fail the (async) test if its event loop thread blocks beyond the threshold.

        Configure with ``@pytest.mark.no_blocking(threshold=..., strict=..., interval=...)``.
        The test body runs inside the detector, whichever plugin (pytest-asyncio or anyio) runs it.
        """
        marker = request.node.get_closest_marker("no_blocking")
        options = dict(marker.kwargs) if marker is not None else {}
        detector = BlockingDetector(**options)
        item = request.node
        original = item.obj
        if not inspect.iscoroutinefunction(original):
            raise pytest.UsageError(f"{item.nodeid}: the no_blocking fixture needs an async test function")

        @functools.wraps(original)
        async def watched(*args: Any, **kwargs: Any) -> Any:
            async with detector:
                return await original(*args, **kwargs)

        item.obj = watched
        try:
            yield detector
        finally:
            item.obj = original
