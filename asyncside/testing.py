"""pytest plugin: fixtures for testing code that uses asyncside, under pytest-asyncio or anyio's plugin.

Installed with asyncside and registered through the ``pytest11`` entry point, so the fixtures are
available in any pytest run once ``asyncside`` is installed (disable with ``-p no:asyncside``):

``make_expert_store(...)``
    factory: writes a small expert store with random contents into a temporary directory and
    returns it opened (:class:`asyncside.ExpertStore`).
``expert_store``
    ``make_expert_store()`` with the default layout (2 layers x 8 experts, 3 float16 segments).
``asyncside_runtime``
    a :class:`asyncside.runtime.Runtime` over ``expert_store``, entered by the test's own task on
    the test's own event loop (any pytest-asyncio ``loop_scope``; anyio's plugin on asyncio, uvloop
    or trio) for the duration of the test function; then drained, closed, and every layer's ledger
    must audit clean (the test fails otherwise). Options come from the
    ``@pytest.mark.asyncside_runtime(resident=..., reader=..., ...)`` marker. The test runs under
    a deadline (``@pytest.mark.asyncside_deadline(seconds)``, ``ASYNCSIDE_TEST_DEADLINE_S``, the
    ``asyncside_deadline`` ini option; 300 s by default): past it the test fails with where it was
    stuck instead of hanging.
``faulty_reader``
    injects read faults into ``asyncside_runtime``'s reader: an errno for one expert's record,
    short reads, transient EAGAIN/EINTR; see :class:`FaultyReader`.
``no_blocking``
    fails an async test whose event loop thread blocks longer than a threshold (a watchdog; see
    :mod:`asyncside.testing_blocking`); ``@pytest.mark.no_blocking(threshold=..., strict=...)``.

The module is imported by every pytest run in an environment where asyncside is installed, so it
imports nothing heavy at import time: MLX, numpy and the runtime are imported inside fixtures.
No fixture here is an async fixture, so none depends on which plugin (pytest-asyncio, anyio) or
which loop scope would run one; it works in pytest-asyncio's strict mode.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import itertools
import linecache
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import pytest

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Runtime
    from .store import ExpertStore

#: segment key -> (row shape, dtype) of the default store: the shape of a small SwitchGLU.
DEFAULT_SEGMENTS: dict[str, tuple[tuple[int, ...], str]] = {
    "gate_proj.weight": ((32, 16), "float16"),
    "up_proj.weight": ((32, 16), "float16"),
    "down_proj.weight": ((16, 32), "float16"),
}

from .audit import audit_problems  # noqa: E402  (re-exported; the server's /health uses it too)
from .testing_blocking import no_blocking  # noqa: E402,F401  (re-exported fixture; imports no MLX)

RUNTIME_MARKER = "asyncside_runtime"
DEADLINE_MARKER = "asyncside_deadline"
#: ini option and environment variable (which wins) for the per-test deadline, in seconds.
DEADLINE_INI = "asyncside_deadline"
DEADLINE_ENV = "ASYNCSIDE_TEST_DEADLINE_S"
#: Long enough for any honest test of a small store on a loaded machine; short enough that a hung
#: CI job still reports where it hung rather than being killed blind by the CI's own timeout.
DEFAULT_DEADLINE_S = 300.0

# A copy of the process's stderr taken at configure time: a report written while the loop is
# stuck must reach the terminal even when pytest is capturing, and even if the process then exits.
_report_fd: int | None = None


class DeadlineExceeded(AssertionError):
    """A test using ``asyncside_runtime`` ran past its deadline; the message says where it waited."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        DEADLINE_INI,
        f"seconds a test using asyncside_runtime may take (entry, body, close) before it is cancelled and "
        f"fails with where it was stuck; 0 turns it off. {DEADLINE_ENV} overrides it (default {DEFAULT_DEADLINE_S:g})",
        default=None,
    )


def pytest_configure(config: pytest.Config) -> None:
    global _report_fd
    config.addinivalue_line(
        "markers",
        f"{RUNTIME_MARKER}(**kwargs): keyword arguments for the Runtime built by the asyncside_runtime fixture "
        "(resident=, side_rows=, policy=, reader=, reader_options=, ...)",
    )
    config.addinivalue_line(
        "markers", "no_blocking(threshold=0.05, strict=False, interval=None): configure the no_blocking fixture"
    )
    config.addinivalue_line(
        "markers",
        f"{DEADLINE_MARKER}(seconds): the deadline of a test using asyncside_runtime (0: none); "
        f"overrides {DEADLINE_ENV} and the {DEADLINE_INI} ini option",
    )
    if _report_fd is None:
        try:
            _report_fd = os.dup(sys.__stderr__.fileno() if sys.__stderr__ is not None else 2)
        except (OSError, ValueError):
            _report_fd = None


def pytest_unconfigure(config: pytest.Config) -> None:
    global _report_fd
    if _report_fd is not None:
        os.close(_report_fd)
        _report_fd = None


def _seconds(raw: object, where: str) -> float:
    try:
        seconds = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise pytest.UsageError(f"{where}: expected a number of seconds >= 0 (0: no deadline), got {raw!r}") from None
    if not seconds >= 0 or seconds == float("inf"):
        raise pytest.UsageError(f"{where}: expected a number of seconds >= 0 (0: no deadline), got {raw!r}")
    return seconds


def deadline_of(item: pytest.Item) -> float:
    """Seconds the test may take; 0 for none.

    The closest ``@pytest.mark.asyncside_deadline(seconds)`` wins, then the environment variable
    ``ASYNCSIDE_TEST_DEADLINE_S``, then the ``asyncside_deadline`` ini option, then
    :data:`DEFAULT_DEADLINE_S`.
    """
    marker = item.get_closest_marker(DEADLINE_MARKER)
    if marker is not None:
        if len(marker.args) + len(marker.kwargs) != 1 or set(marker.kwargs) - {"seconds"}:
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.{DEADLINE_MARKER} takes one argument, seconds; "
                                    f"got args={marker.args!r} kwargs={marker.kwargs!r}")
        raw = marker.args[0] if marker.args else marker.kwargs["seconds"]
        return _seconds(raw, f"{item.nodeid}: @pytest.mark.{DEADLINE_MARKER}")
    env = os.environ.get(DEADLINE_ENV)
    if env is not None and env.strip():
        return _seconds(env, f"environment variable {DEADLINE_ENV}")
    ini = item.config.getini(DEADLINE_INI)
    if ini not in (None, ""):
        return _seconds(ini, f"ini option {DEADLINE_INI} ({item.config.inipath or 'no ini file'})")
    return DEFAULT_DEADLINE_S


def _await_chain(coro: Any) -> str:
    """Where a task's coroutine waits: each frame of its ``await`` chain, outermost first, with source."""
    lines: list[str] = []
    obj, depth = coro, 0
    while obj is not None and depth < 200:
        depth += 1
        frame = getattr(obj, "cr_frame", None) or getattr(obj, "gi_frame", None) or getattr(obj, "ag_frame", None)
        if frame is not None:
            code = frame.f_code
            lines.append(f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}\n')
            source = linecache.getline(code.co_filename, frame.f_lineno).strip()
            if source:
                lines.append(f"    {source}\n")
        nxt = None
        for attr in ("cr_await", "gi_yieldfrom", "ag_await"):
            if hasattr(obj, attr):
                nxt = getattr(obj, attr)
                break
        if nxt is None and frame is None:
            lines.append(f"  awaiting {obj!r}\n")
        obj = nxt
    return "".join(lines) or "  (no coroutine frames: the task had finished)\n"


def _loop_thread_stack(thread_id: int) -> str:
    """The thread's stack from its first coroutine frame (the running task) down, with source."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return "  (the thread is gone)\n"
    summary = traceback.extract_stack(frame)
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    frames.reverse()
    first = next((i for i, f in enumerate(frames) if f.f_code.co_flags & inspect.CO_COROUTINE), 0)
    return "".join(traceback.format_list(summary[first:]))


class _DeadlineInterrupt(BaseException):
    """Raised by the deadline watchdog's SIGINT in a call that blocks the test's event loop thread.

    Not a KeyboardInterrupt: pytest stops the whole run at one of those, and asyncio lets one
    escape its loop; this one ends the test (as :class:`DeadlineExceeded`) and the run goes on."""


class _SigintHook:
    """The SIGINT handler of the main thread while a deadline test runs on an asyncio loop there.

    It raises :class:`_DeadlineInterrupt` only when the watchdog asked for it (:meth:`arm`) and
    only where that is safe: inside the test's own task (its coroutine frame is on the interrupted
    stack) or inside one of the loop's callbacks (asyncio reports the exception and runs on). In
    the loop's own machinery (its wait for I/O, between callbacks) it lets the loop go on: the
    loop then takes the cancellation already posted to it. Any other SIGINT (a user's Ctrl-C) goes
    to the handler it replaced, so the runner's own SIGINT behaviour is unchanged.
    """

    def __init__(self, task_frame: Any) -> None:
        self.task_frame = task_frame
        self.previous: Any = signal.getsignal(signal.SIGINT)
        self.armed = False
        self.taken = 0     # armed interrupts the handler has run for
        self.raised = False
        self.declined_in = ""  # where an armed interrupt found the loop (when it did not raise)

    def install(self) -> None:
        signal.signal(signal.SIGINT, self)

    def uninstall(self) -> None:
        current: object = signal.getsignal(signal.SIGINT)
        previous = self.previous if self.previous is not None else signal.default_int_handler
        if current is self:
            signal.signal(signal.SIGINT, previous)

    def arm(self) -> None:
        self.armed = True

    def _safe_to_raise(self, frame: Any) -> bool:
        while frame is not None:
            if frame is self.task_frame:
                return True
            code = frame.f_code
            if code.co_name == "_run" and code.co_filename.endswith(os.path.join("asyncio", "events.py")):
                return True  # a callback of the loop's: Handle._run reports what it raises and goes on
            frame = frame.f_back
        return False

    def __call__(self, signum: int, frame: Any) -> Any:
        if self.armed:
            self.armed = False
            self.taken += 1
            if self._safe_to_raise(frame):
                self.raised = True
                raise _DeadlineInterrupt("the asyncside deadline interrupted a call that blocked the event loop")
            self.declined_in = f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"
            return None
        previous = self.previous
        if callable(previous):
            return previous(signum, frame)
        if previous == signal.SIG_IGN:
            return None
        return signal.default_int_handler(signum, frame)


class _Deadline:
    """A watchdog thread that ends a test which runs past ``seconds``, saying where it was stuck.

    At the deadline it asks the loop (thread-safely) to record the test task's ``await`` chain and
    cancel the test's scope: a test waiting for something that never comes (the usual hang) then
    fails with :class:`DeadlineExceeded`. A loop that does not answer within the grace period is
    blocked in a call; a test still running a grace period after the cancellation ignores it
    (a shielded wait). Either way the stacks of every thread go to stderr, and then:

    - on an asyncio loop (uvloop too) that answers, the test's task is cancelled natively
      (``Task.cancel``, posted to the loop), which a shield does not stop; no signal is sent;
    - on an asyncio loop blocked in a call in the main thread, one SIGINT to the main thread,
      taken by :class:`_SigintHook`, raises in the blocked call inside the test's task;
    - elsewhere (trio; a loop outside the main thread) the main thread gets SIGINT, twice if need
      be (the runner's own handler takes it: trio raises KeyboardInterrupt in the task).

    Each ends the test with :class:`DeadlineExceeded`. A process that survives even that writes its
    stacks again and exits with status 1. Never a silent hang.
    """

    def __init__(self, nodeid: str, seconds: float) -> None:
        self.nodeid = nodeid
        self.seconds = seconds
        # Time for a responsive loop to take the cancellation and close the runtime.
        self.grace = min(max(seconds / 4, 2.0), 30.0)
        self.fired = False
        self.where = ""  # the report's "where": the task's await chain, or the blocked loop thread's stack
        self._lock = threading.Lock()
        self._answered = threading.Event()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._asyncio_task: asyncio.Task[Any] | None = None
        self._asyncio_loop: asyncio.AbstractEventLoop | None = None
        self._hook: _SigintHook | None = None

    def start(self, scope: anyio.CancelScope) -> None:
        from .testing_blocking import _current_loop_handle

        handle = _current_loop_handle()
        task = anyio.get_current_task()
        loop = asyncio._get_running_loop()
        if loop is not None:
            self._asyncio_loop, self._asyncio_task = loop, asyncio.current_task()
            coro = self._asyncio_task.get_coro() if self._asyncio_task is not None else None
            frame = getattr(coro, "cr_frame", None)
            if threading.current_thread() is threading.main_thread() and frame is not None:
                self._hook = _SigintHook(frame)
                self._hook.install()

        def expire() -> None:  # on the loop
            with self._lock:
                if not self.where:  # else the watchdog already took the stack of the blocked loop
                    self.where = "Where its task was waiting, outermost first:\n" + _await_chain(task.coro)
            self.fired = True
            self._answered.set()
            scope.cancel()

        def watch() -> None:
            if self._done.wait(self.seconds):
                return
            try:
                handle.post(expire)
            except Exception:  # the loop is gone (closed): nothing to cancel on it
                pass
            if not self._answered.wait(self.grace):
                with self._lock:
                    stack = _loop_thread_stack(handle.thread_id)
                    self.where = "Where its event loop thread was blocked (its stack), outermost first:\n" + stack
                self.fired = True
                why = f"its event loop thread did not answer for {self.grace:g} s more: it is blocked in a call"
                blocked = True
            elif not self._done.wait(self.grace):
                why = (f"it was cancelled but did not end within {self.grace:g} s: it ignores cancellation "
                       "(a shielded wait?)")
                blocked = False
            else:
                return
            self._hard_stop(why, blocked)

        self._thread = threading.Thread(target=watch, name=f"asyncside deadline {self.nodeid}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """The test has ended (on the loop thread): the watchdog stands down, the SIGINT hook goes."""
        self._done.set()
        if self._hook is not None and threading.current_thread() is threading.main_thread():
            self._hook.uninstall()

    def report(self) -> str:
        return (f"{self.nodeid} ran past its deadline of {self.seconds:g} s and was cancelled "
                f"(@pytest.mark.{DEADLINE_MARKER}, {DEADLINE_ENV} or the {DEADLINE_INI} ini option set it). "
                f"{self.where}")

    def _write(self, text: str) -> None:
        fd = _report_fd if _report_fd is not None else 2
        try:
            os.write(fd, text.encode(errors="replace"))
        except OSError:
            pass

    def _hard_stop(self, why: str, blocked: bool) -> None:
        import faulthandler

        fd = _report_fd if _report_fd is not None else 2
        self._write(f"\n\nasyncside deadline: {self.nodeid} ran past its deadline of {self.seconds:g} s, and {why}.\n")
        if self.where:
            self._write(self.where)
        self._write("Every thread's stack:\n")
        faulthandler.dump_traceback(file=fd, all_threads=True)
        # However it is ended, the test gets time for its teardown: exiting the process is the last
        # resort, and it loses every later test's report.
        wait_s = max(self.grace, INTERRUPT_WAIT_S)
        if not blocked and self._asyncio_task is not None and self._asyncio_loop is not None:
            how = "a native cancellation of its task (Task.cancel)"
            self._write(f"asyncside deadline: ending it with {how}.\n")
            try:
                self._asyncio_loop.call_soon_threadsafe(self._asyncio_task.cancel)
            except RuntimeError:  # the loop is closed
                pass
            ended = self._done.wait(wait_s)
        elif blocked and self._hook is not None:
            how = "SIGINT to the main thread (raised in the blocked call)"
            self._write(f"asyncside deadline: ending it with {how}. " + _signal_state())
            ended = self._interrupt_blocked(self._hook, wait_s)
        else:
            how = "SIGINT to the main thread, twice if need be"
            self._write(f"asyncside deadline: ending it with {how}. " + _signal_state())
            # A runner's first SIGINT may only cancel its main task (asyncio.Runner's does). A real
            # signal, not _thread.interrupt_main(): a main thread parked in a wait only runs the
            # handler once a signal interrupts the call.
            ended = False
            for wait in (min(self.grace, 1.0), wait_s):
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
                if self._done.wait(wait):
                    ended = True
                    break
        if ended:
            return
        hook = self._hook
        taken = (f" (the SIGINT hook: taken {hook.taken} time(s), raised {hook.raised}"
                 f"{', declined in ' + hook.declined_in if hook.declined_in else ''})") if hook is not None else ""
        self._write(f"\nasyncside deadline: {self.nodeid} still runs {wait_s:g} s after {how}{taken}; "
                    "every thread's stack, then exit status 1. " + _signal_state())
        faulthandler.dump_traceback(file=fd, all_threads=True)
        os._exit(1)

    def _interrupt_blocked(self, hook: _SigintHook, wait_s: float) -> bool:
        """SIGINT to the main thread until the hook has raised in the blocked call (an interrupt it
        declined, the loop being in its own code, is sent again a second later); then up to
        ``wait_s`` for the test to end. Whether it ended."""
        end = time.monotonic() + wait_s
        while not hook.raised and time.monotonic() < end:
            hook.arm()
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
            if self._done.wait(1.0):
                return True
        return self._done.wait(max(0.0, end - time.monotonic()))


#: how long the deadline watchdog waits, after it has interrupted or cancelled a test that ran past
#: its deadline, for the test to end before it exits the process
INTERRUPT_WAIT_S = 15.0


def _signal_state() -> str:
    """SIGINT as this process holds it, for the watchdog's report: the Python-level handler, and
    each thread's blocked / ignored / caught masks from /proc (Linux; elsewhere only the handler)."""
    try:
        handler = repr(signal.getsignal(signal.SIGINT))
    except Exception as exc:  # the report must not fail on a diagnostic
        handler = f"(unknown: {exc!r})"
    main = threading.main_thread().native_id
    try:
        cpus = f"{sorted(os.sched_getaffinity(0))}"  # of the calling (watchdog) thread: inherited like the rest
    except (AttributeError, OSError):
        cpus = "?"
    lines = [f"SIGINT handler: {handler}; main thread tid {main}; cpus {cpus}; load {os.getloadavg()}\n"]
    try:
        tids = sorted(int(t) for t in os.listdir("/proc/self/task"))
    except OSError:
        return "".join(lines)
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                fields = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
        except OSError:
            continue
        masks = " ".join(f"{k}={fields.get(k, '?')}" for k in ("SigBlk", "SigIgn", "SigCgt"))
        lines.append(f"  tid {tid}{' (main)' if tid == main else ''} {fields.get('Name', '?')}: "
                     f"ShdPnd={fields.get('ShdPnd', '?')} SigPnd={fields.get('SigPnd', '?')} {masks}\n")
    return "".join(lines)


def random_layers(
    layers: Sequence[int] | int = 2,
    n_experts: int = 8,
    segments: Mapping[str, tuple[Sequence[int], str]] | None = None,
    seed: int = 0,
) -> dict[int, dict[str, Any]]:
    """Random expert weights: layer -> {key: numpy array (n_experts, *shape)}; deterministic per seed."""
    import numpy as np

    if isinstance(layers, int):
        layers = list(range(layers))
    if n_experts < 1:
        raise ValueError(f"n_experts must be at least 1, got {n_experts}")
    segments = DEFAULT_SEGMENTS if segments is None else segments
    rng = np.random.default_rng(seed)
    out: dict[int, dict[str, Any]] = {}
    for layer in layers:
        arrays = {}
        for key, (shape, dtype) in segments.items():
            full = (n_experts, *shape)
            if np.dtype(dtype).kind in "iu":
                info = np.iinfo(dtype)
                arrays[key] = rng.integers(info.min, info.max, size=full, dtype=dtype, endpoint=True)
            else:
                arrays[key] = rng.standard_normal(full).astype(dtype)
        out[int(layer)] = arrays
    return out


@pytest.fixture
def make_expert_store(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., ExpertStore]:
    """Factory fixture: ``make_expert_store(layers=2, n_experts=8, segments=None, seed=0, **create_kwargs)``.

    ``layers`` is a count or a list of layer indices; ``segments`` maps key -> (row shape, dtype);
    further keywords (``alignment``, ``checksum``, ``metadata``) go to ``ExpertStore.create``.
    Each call writes a new store in its own temporary directory.
    """
    from .store import ExpertStore

    counter = itertools.count()

    def make(
        layers: Sequence[int] | int = 2,
        n_experts: int = 8,
        segments: Mapping[str, tuple[Sequence[int], str]] | None = None,
        seed: int = 0,
        **create_kwargs: Any,
    ) -> ExpertStore:
        root = tmp_path_factory.mktemp("asyncside-store")
        data = random_layers(layers, n_experts, segments, seed)
        return ExpertStore.create(root / f"store{next(counter)}", data, **create_kwargs)

    return make


@pytest.fixture
def expert_store(make_expert_store: Callable[..., ExpertStore]) -> ExpertStore:
    """A small expert store with random contents (2 layers x 8 experts, checksummed)."""
    return make_expert_store()


@pytest.fixture
def asyncside_runtime(request: pytest.FixtureRequest, expert_store: ExpertStore) -> Iterator[Runtime]:
    """A Runtime over ``expert_store``, open for the test's body on the test's own event loop.

    The runtime is entered and closed by the test's own task, around the test function, so it
    lives on whichever loop runs the test: pytest-asyncio's at any ``loop_scope``, anyio's plugin
    on asyncio, uvloop or trio. After the body it is drained (fills that failed on purpose do not
    fail the test), closed, and every layer's ledger must audit clean (the test fails otherwise).
    All of it runs under the test's deadline (:func:`deadline_of`). The value is the Runtime
    object; it is open only while the test function runs.
    """
    from .runtime import Runtime

    kwargs: dict[str, Any] = {}
    for marker in reversed(list(request.node.iter_markers(RUNTIME_MARKER))):
        kwargs.update(marker.kwargs)  # the closest marker wins
    item = request.node
    if not isinstance(item, pytest.Function) or not inspect.iscoroutinefunction(item.obj):
        raise pytest.UsageError(f"{item.nodeid}: the asyncside_runtime fixture needs an async test function "
                                "(@pytest.mark.asyncio or @pytest.mark.anyio)")
    runtime = Runtime(expert_store, **kwargs)
    seconds = deadline_of(item)
    test_fn = item.obj

    # Why around the test function and not an async fixture: an async fixture runs on the loop of
    # its own loop scope (pytest-asyncio), or on whichever plugin's loop claims it first (anyio's
    # and pytest-asyncio's fixture hooks both may), which need not be the loop the test runs on. A
    # runtime entered on another loop leaves the test awaiting reads that loop never completes,
    # because nobody runs it: the test sits idle in select() for ever.
    @functools.wraps(test_fn)
    async def with_runtime(*args: Any, **kw: Any) -> Any:
        body = with_runtime.asyncside_body  # type: ignore[attr-defined]
        watchdog = _Deadline(item.nodeid, seconds) if seconds > 0 else None
        result = None
        try:
            with anyio.CancelScope() as scope:
                if watchdog is not None:
                    watchdog.start(scope)
                try:
                    async with runtime:
                        try:
                            result = await body(*args, **kw)
                        finally:
                            try:
                                await runtime.drain()
                            except BaseExceptionGroup:
                                pass  # failed fills are the test's business; the audit is the plugin's
                finally:
                    if watchdog is not None:
                        watchdog.stop()
        except BaseException as exc:
            if watchdog is not None and watchdog.fired:
                raise DeadlineExceeded(watchdog.report()) from exc
            if isinstance(exc, Exception):
                _note_audit(exc, runtime)
            raise
        if watchdog is not None and watchdog.fired:
            raise DeadlineExceeded(watchdog.report())
        problems = audit_problems(runtime)
        if problems:
            pytest.fail("asyncside_runtime: ledger audit after close found:\n  " + "\n  ".join(problems))
        return result

    # The test body proper. no_blocking swaps its watched version in here, so the runtime's entry
    # and close stay outside the blocking detector whichever of the two fixtures was set up first.
    with_runtime.asyncside_body = test_fn  # type: ignore[attr-defined]
    item.obj = with_runtime
    try:
        yield runtime
    finally:
        item.obj = test_fn


def _note_audit(exc: BaseException, runtime: Runtime) -> None:
    """Add the ledger audit to a failing test's exception (a dirty ledger is worth knowing then too)."""
    try:
        problems = audit_problems(runtime)
    except Exception as audit_exc:  # a runtime that never opened may have nothing to audit
        problems = [f"(the audit itself failed: {audit_exc!r})"]
    if problems:
        exc.add_note("asyncside_runtime: ledger audit after close found:\n  " + "\n  ".join(problems))


def _scheduler_of(runtime: Any) -> Any:
    """The read scheduler of ``runtime`` (:attr:`Runtime.scheduler`), looked up at each use: entering
    the runtime may replace it."""
    scheduler = getattr(runtime, "scheduler", None)
    if scheduler is None or not hasattr(scheduler, "set_faults"):
        raise RuntimeError("this Runtime exposes no scheduler with fault hooks (Runtime.scheduler.set_faults)")
    return scheduler


class FaultyReader:
    """Fault injection into a running Runtime's reader (the read backends' test hooks).

    The hooks act below the scheduler, in the reader itself (native io_uring / thread pool, or
    aiofiles), so everything above -- scheduler, ledger, runtime, model -- sees a real failure.
    One failing range is active at a time: :meth:`fail` replaces the previous one. Settings
    combine: ``fail`` + ``short_reads`` + ``transient`` may all be on together. :meth:`fail`
    reaches queued steps' reads too (their fault tables read the blobs themselves, not through
    the reader); short and transient reads are the reader's alone.
    """

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self._settings: dict[str, Any] = {}

    def _apply(self) -> None:
        _scheduler_of(self.runtime).set_faults(**self._settings)
        queued = getattr(self.runtime, "queued", None)
        if queued is not None and hasattr(queued, "set_fault"):
            st = self._settings
            queued.set_fault(st.get("path", ""), st.get("lo", 0), st.get("hi", 0), st.get("err", 0))

    def fail(self, layer: int, expert: int, errno: int = 5) -> None:
        """Every read of ``expert``'s record in ``layer`` fails with ``errno`` (default EIO)."""
        spec = self.runtime.store.layer(layer)
        if not 0 <= expert < spec.n_experts:
            raise ValueError(f"layer {layer}: expert {expert} is out of range [0, {spec.n_experts})")
        lo = spec.record_offset(expert)
        self._settings.update(path=str(spec.path), lo=lo, hi=lo + spec.stride, err=int(errno))
        self._apply()

    def short_reads(self, max_bytes: int = 512) -> None:
        """Cap every read operation at ``max_bytes`` (the reader must loop to complete records)."""
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be at least 1, got {max_bytes}")
        self._settings["max_read_bytes"] = int(max_bytes)
        self._apply()

    def transient(self, every: int = 3, errno: int = 11) -> None:
        """Every ``every``-th read fails once with ``errno`` (EAGAIN by default) and is retried."""
        if every < 1:
            raise ValueError(f"every must be at least 1, got {every}")
        self._settings.update(transient_every=int(every), transient_err=int(errno))
        self._apply()

    def clear(self) -> None:
        """Turn every fault off."""
        self._settings = {}
        self._apply()

    def counters(self) -> dict[str, int]:
        """The reader's counters (``faults_injected``, ``short_reads``, ``retries``, ...);
        ``faults_injected`` counts queued steps' failed reads too."""
        out = dict(_scheduler_of(self.runtime).reader.counters())
        queued = getattr(self.runtime, "queued", None)
        if queued is not None and hasattr(queued, "faults_injected"):
            out["faults_injected"] = int(out.get("faults_injected", 0)) + queued.faults_injected()
        return out


@pytest.fixture
def faulty_reader(asyncside_runtime: Runtime) -> Iterator[FaultyReader]:
    """Fault injection into ``asyncside_runtime``'s reader, for use in the test's body (the runtime
    is open only then); the faults go with the reader when the runtime closes."""
    yield FaultyReader(asyncside_runtime)
