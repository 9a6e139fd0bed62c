"""Catch blocking calls on the event loop thread: a watchdog for tests (asyncio, uvloop and trio).

:class:`BlockingDetector` runs a watchdog thread that keeps one *ping* in flight to the event loop
(``loop.call_soon_threadsafe`` on asyncio, ``TrioToken.run_sync_soon`` on trio). A responsive loop
answers within microseconds; a ping left unanswered for longer than ``threshold`` seconds means
the loop thread is stuck in something (``time.sleep``, ``mx.eval`` of unfinished work, a
synchronous read...). The watchdog then samples the loop thread's Python stack
(``sys._current_frames``), so the failure says *where* the loop was blocked. This works the same
on every backend, unlike asyncio's debug-mode ``slow_callback_duration``.

A late answer is not always a blocking call: on an overloaded machine a loop parked in its
selector may simply not get a CPU in time. When every stack sample shows the loop parked (asyncio's
``select``, trio's ``get_events``, or no callback running above a C loop such as uvloop), the
incident counts as *starved*: reported (``detector.starved``, a ``LoopStarvedWarning`` from the
fixture) but not a failure. When the watchdog itself could not run (the loop thread kept the GIL),
the loop thread's CPU clock decides: busy means blocked.

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
import gc
import inspect
import linecache
import os
import re
import sys
import threading
import time
import traceback
import warnings
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
    "LoopGcPauseWarning",
    "LoopStarvedWarning",
    "default_threshold",
    "no_blocking",
]


class LoopBlockedError(AssertionError):
    """The event loop thread was blocked longer than the threshold (the message holds the stack)."""


class BlockingCallError(RuntimeError):
    """Strict mode: a known blocking call was made on the event loop thread."""


class LoopStarvedWarning(UserWarning):
    """The loop was ready but got no CPU within the threshold (an overloaded machine)."""


class LoopGcPauseWarning(UserWarning):
    """The loop thread was stalled past the threshold by Python's garbage collector."""


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
    # The loop thread's Python stack(s), sampled while it was blocked (source lines are added
    # when :attr:`stack` is read: see _stack_of).
    frames: str
    answered: bool = False  # the loop answered the ping (the stretch ended) before stop
    call: str | None = None  # strict mode: the blocking call that was refused
    watchdog_lag_s: float = 0.0  # how late the watchdog itself woke meanwhile (see describe())
    # Every sample found the loop parked in its selector (or, unsampled, the loop thread used
    # next to no CPU): the loop was ready but did not get a CPU. That is an overloaded machine,
    # not a blocking call; such incidents are reported as warnings, not failures.
    starved: bool = False
    started: float = 0.0  # time.monotonic() when the stall began (the ping was sent)
    # Time the loop thread spent in Python's garbage collector during the stall. A stall that is
    # within the threshold once that is taken off is the collector's (the heap of the whole
    # process, e.g. a test session's), not a call on the loop: reported as a warning.
    gc_s: float = 0.0
    threshold_s: float = 0.0  # the detector's threshold (set when the incident is settled)

    @property
    def gc_pause(self) -> bool:
        """The stall was the garbage collector's: within the threshold without its time."""
        return self.gc_s > 0 and not self.call and self.blocked_s - self.gc_s <= self.threshold_s

    def describe(self) -> str:
        took = f"{'' if self.answered else 'at least '}{self.blocked_s * 1000:.1f} ms"
        gc_note = f", {self.gc_s * 1000:.1f} ms of it in Python's garbage collector" if self.gc_s > 0 else ""
        if self.call:
            head = f"strict mode refused {self.call} on the event loop thread"
        elif self.gc_pause:
            head = f"event loop thread stalled {took} by Python's garbage collector ({self.gc_s * 1000:.1f} ms)"
        elif self.starved:
            head = f"event loop thread waited {took} for a CPU (parked in its selector: machine overloaded){gc_note}"
        else:
            head = f"event loop thread blocked for {took}{gc_note}"
        note = ""
        if self.watchdog_lag_s > 0.5 * self.blocked_s > 0:
            note = (f" (the watchdog thread itself woke {self.watchdog_lag_s * 1000:.1f} ms late: the loop "
                    f"thread held the GIL, or the whole process was descheduled on a busy machine)")
        return f"{head}{note}; loop thread stack:\n{self.stack}"

    @property
    def stack(self) -> str:
        """The sampled stack(s) with their source lines."""
        return _with_source(self.frames)

    def add_sample(self, elapsed_s: float, stack: str) -> None:
        """Append a later stack sample of the same stretch, if it shows somewhere new."""
        if stack not in self.frames and self.frames.count("--- sampled") < _MAX_SAMPLES:
            self.frames += f"--- sampled again {elapsed_s * 1000:.1f} ms into the stall:\n{stack}"


@dataclass
class _Ping:
    sent: float
    answered: float | None = None
    incident: Incident | None = None
    watchdog_lag_s: float = 0.0
    last_sample: float = 0.0
    cpu_at_send: float = 0.0


@dataclass
class _LoopHandle:
    thread_id: int
    post: Callable[[Callable[[], object]], object]  # thread-safe "run this on the loop soon"
    # Frames under the running task when the detector started (the loop runner's caller and,
    # for a loop written in C such as uvloop, nothing above it while the loop is parked).
    outer_frames: tuple[Any, ...] = ()


def _answer(ping: _Ping) -> None:
    """Runs on the loop: the ping the watchdog sent has been answered."""
    ping.answered = time.monotonic()


_TASK_FLAGS = inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE


def _frames_under_the_task(frame: Any) -> tuple[Any, ...]:
    """The frames below the outermost coroutine frame of the running task."""
    below, seen_task = [], False
    while frame is not None:
        if frame.f_code.co_flags & _TASK_FLAGS:
            seen_task = True
        elif seen_task:
            below.append(frame)
        frame = frame.f_back
    return tuple(below)


_WAITING_MODULES = frozenset({"selectors.py", "threading.py", "queue.py"})


def _parked(loop: _LoopHandle) -> bool | None:
    """Whether the loop thread sits in its event loop's wait for I/O (None: thread not found)."""
    frame = sys._current_frames().get(loop.thread_id)
    if frame is None:
        return None
    # Climb out of the standard library's waiting code (a guest-mode trio host waits on a queue).
    while frame is not None and os.path.basename(frame.f_code.co_filename) in _WAITING_MODULES:
        if frame.f_code.co_filename.endswith("selectors.py"):  # asyncio's selector loop: select()
            return True
        frame = frame.f_back
    if frame is None:
        return False
    code = frame.f_code
    if code.co_name == "get_events" and "trio" in code.co_filename:  # trio's I/O wait
        return True
    # No task or callback frame above the runner: a loop written in C (uvloop) parked in its
    # wait, or a trio guest-mode host waiting for its next step.
    return any(frame is f for f in loop.outer_frames)


def _thread_cpu_clock(thread_id: int) -> Callable[[], float] | None:
    """A reader of the CPU time the given thread has used (None where unsupported)."""
    try:
        clock = time.pthread_getcpuclockid(thread_id)
        time.clock_gettime(clock)
    except (AttributeError, OSError):
        return None
    return lambda: time.clock_gettime(clock)


def _current_loop_handle() -> _LoopHandle:
    outer = _frames_under_the_task(sys._getframe(1))
    loop = asyncio._get_running_loop()
    if loop is not None:
        return _LoopHandle(threading.get_ident(), loop.call_soon_threadsafe, outer)
    if "trio" in sys.modules:
        import trio

        try:
            token = trio.lowlevel.current_trio_token()
        except RuntimeError:
            pass
        else:
            return _LoopHandle(threading.get_ident(), token.run_sync_soon, outer)
    raise RuntimeError("BlockingDetector must be entered inside an asyncio or trio event loop")


_MAX_SAMPLES = 4  # later samples kept per incident (the first one, where it began, always)


_FRAME_LINE = re.compile(r'^  File "(?P<file>.+)", line (?P<line>\d+), in .*$')


def _stack_of(thread_id: int) -> str:
    """The thread's stack as ``File ..., line ..., in ...`` lines, without source text.

    The watchdog samples while the test runs: reading source lines here would open files from
    this thread at unpredictable moments (a test counting its open descriptors would see them).
    :func:`_with_source` adds the text later, when the report is read."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return "  (loop thread not found)\n"
    summary = traceback.StackSummary.extract(traceback.walk_stack(frame), lookup_lines=False)
    summary.reverse()
    return "".join(f'  File "{f.filename}", line {f.lineno}, in {f.name}\n' for f in summary)


def _with_source(stack: str) -> str:
    """``stack`` with each frame's source line under it (as :func:`traceback.format_stack` has)."""
    out = []
    lines = stack.splitlines(keepends=True)
    for i, text in enumerate(lines):
        out.append(text)
        m = _FRAME_LINE.match(text.rstrip("\n"))
        if m is None or (i + 1 < len(lines) and lines[i + 1].startswith("    ")):
            continue  # not a frame, or its source is there already
        source = linecache.getline(m["file"], int(m["line"])).strip()
        if source:
            out.append(f"    {source}\n")
    return "".join(out)


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
        self._gc_spans: list[tuple[float, float]] = []  # (start, end) of collections on the loop thread
        self._gc_started: float | None = None

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
        gc.callbacks.append(self._on_gc)
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
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self._unpatch is not None:
            self._unpatch()
            self._unpatch = None
        self._attribute_gc()

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        # Runs in the collecting thread, with the GIL: only the loop thread's collections count.
        if self._loop is None or threading.get_ident() != self._loop.thread_id:
            return
        if phase == "start":
            self._gc_started = time.monotonic()
        elif self._gc_started is not None:
            with self._lock:
                self._gc_spans.append((self._gc_started, time.monotonic()))
            self._gc_started = None

    def _attribute_gc(self) -> None:
        """Credit each incident with the collector time on the loop thread during its stall."""
        with self._lock:
            spans = list(self._gc_spans)
            for inc in self.incidents:
                inc.threshold_s = self.threshold
                if inc.started <= 0:
                    continue
                end = inc.started + inc.blocked_s
                inc.gc_s = sum(max(0.0, min(b, end) - max(a, inc.started)) for a, b in spans)

    @property
    def blocked(self) -> list[Incident]:
        """Incidents that fail :meth:`check`: the loop thread was busy or stuck in a call."""
        with self._lock:
            return [inc for inc in self.incidents if not inc.starved and not inc.gc_pause]

    @property
    def starved(self) -> list[Incident]:
        """Incidents where the loop was ready (parked in its selector) but got no CPU in time."""
        with self._lock:
            return [inc for inc in self.incidents if inc.starved and not inc.gc_pause]

    @property
    def gc_pauses(self) -> list[Incident]:
        """Incidents that were Python's garbage collector on the loop thread (within the threshold
        once the collector's time is taken off): the process heap, not a call on the loop."""
        with self._lock:
            return [inc for inc in self.incidents if inc.gc_pause]

    def check(self) -> None:
        """Raise :class:`LoopBlockedError` describing every blocking incident, if there was any.

        Starved incidents (an overloaded machine, not a call on the loop) do not fail: see
        :attr:`starved`; the pytest fixture turns them into warnings.
        """
        blocked = self.blocked
        if blocked:
            parts = [f"{len(blocked)} blocking incident(s) on the event loop thread "
                     f"(threshold {self.threshold * 1000:.0f} ms):"]
            parts += [f"--- incident {i + 1}: {inc.describe()}" for i, inc in enumerate(blocked)]
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
            if not covered and lag > self.threshold and cpu_used > 0.1 * lag:
                # No ping was in flight, and we could not run to send one, while the loop thread
                # burnt CPU: it kept the GIL. (A tenth, not all, of the stall: on a loaded machine
                # the busy thread itself gets only a share of a CPU. A loop idle in its selector
                # uses none, so a merely descheduled idle process is not reported here.)
                self._record(
                    Incident(lag, f"  (not sampled: the loop thread kept the GIL, busy for "
                                  f"{cpu_used * 1000:.1f} ms of CPU)\n", True, watchdog_lag_s=lag,
                             started=now - lag)
                )
            if ping is not None and ping.answered is not None:
                waited = ping.answered - ping.sent
                self.max_ping_s = max(self.max_ping_s, waited)
                self.pings_answered += 1
                if ping.incident is not None:
                    ping.incident.blocked_s = waited
                    ping.incident.answered = True
                elif waited > self.threshold:
                    # Late, and the watchdog could not run to see it: the loop thread kept the GIL,
                    # or the whole process was descheduled. Its CPU time tells which.
                    busy = cpu_now - ping.cpu_at_send > 0.1 * waited if loop_cpu else True
                    self._record(
                        Incident(waited, "  (not sampled: the watchdog could not run while the loop was late)\n",
                                 True, watchdog_lag_s=ping.watchdog_lag_s, starved=not busy, started=ping.sent)
                    )
                ping = None
            if ping is None:
                ping = _Ping(now, cpu_at_send=cpu_now)
                try:
                    loop.post(functools.partial(_answer, ping))
                except Exception:  # the loop closed under us: nothing left to watch
                    return
                continue
            waited = now - ping.sent
            if waited > self.threshold:
                if ping.incident is None:
                    parked = _parked(loop)
                    ping.incident = Incident(waited, _stack_of(loop.thread_id), starved=bool(parked),
                                             started=ping.sent)
                    ping.last_sample = now
                    self._record(ping.incident)
                else:
                    ping.incident.blocked_s = waited
                    # One stall can span several calls (the ping may have been sent just before
                    # the one that blocks for long): sample again now and then.
                    if now - ping.last_sample >= max(self.threshold, 0.02):
                        ping.incident.starved = ping.incident.starved and bool(_parked(loop))
                        ping.incident.add_sample(waited, _stack_of(loop.thread_id))
                        ping.last_sample = now
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
            leaves = tree_flatten(list(args))
            arrays = [kv[1] for kv in leaves if isinstance(kv[1], mx.array)]  # list(args) flattens to pairs
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

    # The guards take what the patched functions take at runtime (the stubs spell it more widely).
    mx.eval, mx.synchronize, time.sleep = eval_guard, sync_guard, sleep_guard  # type: ignore[assignment]
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
        # asyncside_runtime wraps the test function to open its runtime around it; when it was set
        # up first, watch its body (its ``asyncside_body``), not the runtime's entry and close.
        holder = item.obj if hasattr(item.obj, "asyncside_body") else None
        test_fn = holder.asyncside_body if holder is not None else item.obj
        if not inspect.iscoroutinefunction(test_fn):
            raise pytest.UsageError(f"{item.nodeid}: the no_blocking fixture needs an async test function")

        @functools.wraps(test_fn)
        async def watched(*args: Any, **kwargs: Any) -> Any:
            try:
                async with detector:
                    return await test_fn(*args, **kwargs)
            finally:
                for inc in detector.starved:
                    warnings.warn(LoopStarvedWarning(inc.describe()), stacklevel=1)
                for inc in detector.gc_pauses:
                    warnings.warn(LoopGcPauseWarning(inc.describe()), stacklevel=1)

        if holder is not None:
            holder.asyncside_body = watched
        else:
            item.obj = watched
        try:
            yield detector
        finally:
            if holder is not None:
                holder.asyncside_body = test_fn
            else:
                item.obj = test_fn
