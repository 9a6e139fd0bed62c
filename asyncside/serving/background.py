"""Running the application: a listening socket, ``serve()`` on the running loop, and
:class:`BackgroundServer` (a uvloop loop in a daemon thread, for tests, benchmarks and embedding).

Both shut down gracefully: SIGTERM/SIGINT/SIGHUP (``serve``; a SIGHUP the parent ignored stays
ignored) or :meth:`BackgroundServer.stop` first drains the application
(:meth:`~.app.ServerState.drain`: new requests get 503, requests in flight get the grace period,
the rest end with an error event and ``[DONE]``), then stops uvicorn. A second signal skips what
is left of the grace (the requests still running end with their error at once); a third stops
without waiting for anything. ``serve`` returns normally after a signal, so the command exits 0.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import signal
import socket
import threading
import time
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from starlette.applications import Starlette

from ..errors import AsyncsideError
from .settings import ServeSettings


class ServeError(AsyncsideError):
    """The server could not start (its startup failed; the cause was logged). ``startup_error`` is
    the application's own error when it said one (bad input is an :class:`AsyncsideError`), else
    None."""

    def __init__(self, message: str, startup_error: BaseException | None = None) -> None:
        super().__init__(message)
        self.startup_error = startup_error


class BindError(AsyncsideError, OSError):
    """The listening socket could not be bound; ``str()`` is the line to show (no errno prefix)."""

    def __str__(self) -> str:
        return str(self.strerror)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket; port 0 picks a free port (read it back with ``getsockname``).
    :class:`BindError` naming the address and the cause when it cannot be bound."""
    import errno

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        said = f"cannot bind {f'[{host}]' if ':' in host else host}:{port}: {exc.strerror}"
        if exc.errno == errno.EADDRINUSE:
            said += " (another process listens there: choose another port, or 0 for a free one)"
        raise BindError(exc.errno, said) from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


def _state(app: Starlette) -> Any:
    """The application's :class:`~.app.ServerState` (None for an app not made by ``create_app``)."""
    return getattr(app.state, "asyncside", None)


class _ExpectedFailureFilter(logging.Filter):
    """Drops uvicorn's "Application startup failed" line when the application already recorded
    an expected error its caller says in one line (``ServerState.startup_error``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith("Application startup failed"):
            return not any(s.startup_error is not None for s in list(_STATES))
        return True


_STATES: weakref.WeakSet[Any] = weakref.WeakSet()


def _quiet_expected_startup_failures() -> None:
    target = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _ExpectedFailureFilter) for f in target.filters):
        target.addFilter(_ExpectedFailureFilter())


def _ending_signals() -> list[int]:
    """The signals that shut the server down gracefully: SIGINT, SIGTERM, and SIGHUP (the terminal or
    ssh session gone, whose default ended the process where it stood, streams cut off mid-body)
    unless the parent ignored it (``nohup``), as every other asyncside command treats it."""
    sigs: list[int] = [signal.SIGINT, signal.SIGTERM]
    hup = getattr(signal, "SIGHUP", None)
    if hup is not None and signal.getsignal(hup) is not signal.SIG_IGN:
        sigs.append(hup)
    return sigs


def _read_timed_h11(seconds: float) -> type[Any]:
    """uvicorn's h11 protocol, closing a connection that has not sent a whole request (head and
    body) within ``seconds`` of opening, or of the first byte of a request that follows an answer.

    uvicorn times out only the idle gap after an answer, and any byte cancels that: a client that
    opened connections and sent nothing, or a header line at a time, held each one for good, and
    enough of them used up the process's file descriptors, after which every new client was
    refused (and a replaced blob could not be re-opened). Between an answer and the next request's
    first byte the connection is idle, which uvicorn's keep-alive timeout bounds: timed from the
    answer's end, this timeout closed idle connections sooner than the keep-alive said, and a
    proxy in front reused them (a 502)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class ReadTimedH11(H11Protocol):
        _read_timer: Any = None
        _idle = False  # between an answer and the next request's first byte

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_read_timer()

        def data_received(self, data: bytes) -> None:
            if self._idle:
                self._arm_read_timer()
            super().data_received(data)

        def on_response_complete(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None
            self._idle = True
            super().on_response_complete()
            # A request already received in part (pipelined, or a body the answer did not wait
            # for) is timed at once: no byte may come to start its timer.
            if self._idle and (self.conn.their_state is not h11.IDLE or self.conn.trailing_data[0]):
                self._arm_read_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None
            super().connection_lost(exc)

        def _arm_read_timer(self) -> None:
            self._idle = False
            if self._read_timer is not None:
                self._read_timer.cancel()
            self._read_timer = self.loop.call_later(seconds, self._read_timed_out)

        def _read_timed_out(self) -> None:
            self._read_timer = None
            if self.transport.is_closing() or self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
                return  # the request is in: its answer may take as long as it takes
            if self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete:
                return  # answered before its body was read (a 413, say): uvicorn ends the cycle
            # The handler waiting for the body sees the client leave (499).
            self.transport.close()

    return ReadTimedH11


def _uvicorn_server(app: Starlette, log_level: str) -> Any:
    import uvicorn

    state = _state(app)
    if state is not None:
        _STATES.add(state)
    max_header = state.settings.max_header_bytes if state is not None else 16 * 1024
    read_timeout = state.settings.request_read_timeout if state is not None else 30.0
    keep_alive = (state.settings if state is not None else ServeSettings()).keep_alive

    class GracefulServer(uvicorn.Server):
        """uvicorn's server, whose signals drain the application first and are not re-raised."""

        draining: Any = None  # the drain task once a signal arrived
        signals = 0

        @contextlib.contextmanager
        def capture_signals(self) -> Any:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in _ending_signals()}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig: int, frame: Any) -> None:
            import asyncio

            self.signals += 1
            if state is None or not self.started or self.signals > 2:
                self.should_exit = True  # no app state, not serving yet, or a third signal: stop now
                self.force_exit = self.signals > 2
                if self.draining is not None:
                    self.draining.cancel()
                return
            # A signal handler may interrupt the loop anywhere: the drain starts from a callback.
            loop = asyncio.get_running_loop()
            if self.signals == 1:
                loop.call_soon_threadsafe(self._start_drain)
            else:
                # The second skips what is left of the grace; the drain still ends the requests in
                # flight with their error event (cancelling it left them to uvicorn, which cut the
                # streams off mid-body after its own timeout, logging a traceback for each).
                loop.call_soon_threadsafe(state.end_grace)

        def _start_drain(self) -> None:
            import asyncio

            self.draining = asyncio.ensure_future(self.drain())

        async def drain(self) -> None:
            try:
                await state.drain()
            finally:
                self.should_exit = True

    _quiet_expected_startup_failures()
    # h11 refuses a request head past its limit before the application sees it (431 there too).
    # The keep-alive may be a fraction of a second: uvicorn annotates it int, but only hands it to
    # call_later.
    config = uvicorn.Config(app, loop="uvloop", lifespan="on", log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=5, h11_max_incomplete_event_size=max_header + 1024,
                            timeout_keep_alive=keep_alive,  # type: ignore[arg-type]
                            http=_read_timed_h11(read_timeout))
    return GracefulServer(config)


def _new_uvloop() -> Any:
    import uvloop

    return uvloop.new_event_loop()


T = TypeVar("T")


class BackgroundServer:
    """Serve ``app`` on a uvloop loop in a daemon thread (tests, benchmarks, embedding).

    ``with BackgroundServer(app) as srv: srv.url`` -- startup (the engine factory) runs on the
    server's loop; ``srv.call(fn)`` runs ``await fn()`` on that loop and returns its result, for
    inspecting the runtime from outside without racing it.
    """

    def __init__(self, app: Starlette, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning",
                 startup_timeout: float = 600.0) -> None:
        self.app = app
        self.sock = bind_socket(host, port)
        self.host = host
        self.port = self.sock.getsockname()[1]
        self.server = _uvicorn_server(app, log_level)
        self.startup_timeout = startup_timeout
        self.loop: Any = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        import asyncio

        try:
            with asyncio.Runner(loop_factory=_new_uvloop) as runner:
                self.loop = runner.get_loop()
                runner.run(self.server.serve(sockets=[self.sock]))
        except BaseException as exc:  # surfaced by start()/stop()
            self._error = exc
        finally:
            # A thread that used MLX (mx.random: building a model, sampling) holds a thread-local
            # whose destructor takes the GIL; dropped here, while this is still a Python thread,
            # it cannot abort the interpreter's exit.
            import mlx.core as mx

            mx.clear_streams()

    def start(self) -> BackgroundServer:
        self._thread = threading.Thread(target=self._run, name="asyncside-serve", daemon=True)
        self._thread.start()
        # A server still running at interpreter exit is stopped (its thread joined) before
        # finalization, which would otherwise kill a thread holding MLX state.
        atexit.register(self._stop_at_exit)
        deadline = time.monotonic() + self.startup_timeout
        while not self.server.started:
            if not self._thread.is_alive() or self.server.should_exit:
                self._thread.join(timeout=5)
                state = _state(self.app)
                if state is not None and state.startup_error is not None:  # expected: said in one line
                    atexit.unregister(self._stop_at_exit)
                    self.sock.close()
                    raise ServeError(str(state.startup_error), state.startup_error) from None
                raise RuntimeError(f"asyncside server failed to start: {self._error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"asyncside server did not start within {self.startup_timeout}s")
            time.sleep(0.01)
        return self

    def call(self, fn: Callable[[], Coroutine[Any, Any, T]], timeout: float = 60.0) -> T:
        import asyncio

        return asyncio.run_coroutine_threadsafe(fn(), self.loop).result(timeout)

    def _stop_at_exit(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)

    def stop(self, grace: float | None = None) -> None:
        """Drain (see the module docstring; ``grace`` seconds, the settings' when None), then stop."""
        atexit.unregister(self._stop_at_exit)
        state = _state(self.app)
        if state is not None and self.server.started and self._thread is not None and self._thread.is_alive() \
                and self.loop is not None:
            # The drain waits the drain delay first (a stop() of a server behind a load balancer too)
            wait = (state.settings.shutdown_grace if grace is None else grace) + state.settings.drain_delay + 30.0
            self.call(lambda: state.drain(grace), timeout=wait)
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
            if self._thread.is_alive():
                raise RuntimeError("asyncside server thread did not stop within 30s")
        self.sock.close()
        if self._error is not None and not isinstance(self._error, (KeyboardInterrupt, SystemExit)):
            raise RuntimeError("asyncside server thread failed") from self._error

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def serve(
    app: Starlette,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    log_level: str = "warning",
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve ``app`` with uvicorn on the running loop until SIGINT/SIGTERM (or cancellation).

    ``on_ready(url)`` is called once startup (model load, runtime) is done and the socket
    accepts connections; with ``port=0`` the URL carries the port the system picked.
    """
    import asyncio

    sock = bind_socket(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    url = f"http://{shown}:{bound_port}"
    server = _uvicorn_server(app, log_level)

    async def announce() -> None:
        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.02)
        if on_ready is not None:
            on_ready(url)

    announcer = asyncio.ensure_future(announce())
    state = _state(app)
    try:
        await server.serve(sockets=[sock])
    except SystemExit:  # uvicorn's way of saying the application's startup failed
        pass
    finally:
        announcer.cancel()
        sock.close()
    if not server.started:
        expected = state.startup_error if state is not None else None
        if expected is not None:
            raise ServeError(str(expected), expected) from None
        raise ServeError("startup failed (see the log above)")
