"""`asyncside serve`: an OpenAI-compatible HTTP server over one streaming model and one runtime.

Starlette application, served by uvicorn on a uvloop event loop. Endpoints:

- ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true`` answers with
  server-sent events ending in ``data: [DONE]``),
- ``GET /v1/models``, ``GET /v1/models/{id}``,
- ``GET /health`` (200 while the runtime's ledgers audit clean, 503 otherwise),
- ``GET /metrics`` (Prometheus text format 0.0.4).

Every request shares the one :class:`~asyncside.generation.GenerationService` (fair turns per
decode step). A client that disconnects, streaming or not, cancels its generation: each
generating request watches the ASGI receive channel for ``http.disconnect`` next to the work and
cancels it the moment the client goes away.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import re
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from . import openai_protocol as oai
from .errors import AsyncsideError
from .generation import GenerationService, StreamingModel, TextAssembler
from .prometheus import CONTENT_TYPE as PROMETHEUS_CONTENT_TYPE
from .prometheus import Gauge, Registry

log = logging.getLogger("asyncside.server")

DISCONNECTED_STATUS = 499  # nginx's "client closed request": the request ended because the client left
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServeError(AsyncsideError):
    """The server could not start (its startup failed; the cause was logged)."""


@dataclass
class Engine:
    """What the server serves: a model, the expert source it streams from, and runtime views."""

    model: StreamingModel
    source: Any
    stats: Callable[[], Mapping[str, Any]] | None = None
    audit: Callable[[], tuple[bool, list[str]]] | None = None
    description: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ServeSettings:
    """Limits and defaults of one server."""

    default_max_tokens: int = 16          # /v1/completions default, as OpenAI's
    default_chat_max_tokens: int = 128
    max_tokens_limit: int = 512
    max_prompt_tokens: int = 4096
    max_body_bytes: int = 1 << 20
    predictor: str = "lookahead"


EngineFactory = Callable[[], contextlib.AbstractAsyncContextManager[Engine]]


class _Metrics:
    def __init__(self, state: "_State") -> None:
        r = self.registry = Registry()
        self.requests = r.counter(
            "asyncside_http_requests_total", "HTTP requests answered, by endpoint and status", ("endpoint", "status")
        )
        self.prompt_tokens = r.counter("asyncside_prompt_tokens_total", "Prompt tokens processed", ("endpoint",))
        self.generated = r.counter("asyncside_generated_tokens_total", "Tokens generated", ("endpoint",))
        self.disconnects = r.counter(
            "asyncside_client_disconnects_total", "Generations cancelled because the client went away", ("endpoint",)
        )
        self.errors = r.counter(
            "asyncside_generation_errors_total", "Generations that failed with an error", ("endpoint",)
        )
        self.ttft = r.histogram(
            "asyncside_time_to_first_token_seconds", "Time from request to first generated token", TTFT_BUCKETS
        )
        self.duration = r.histogram(
            "asyncside_request_duration_seconds", "Time from request to last byte of generation", TTFT_BUCKETS
        )
        self.active = r.gauge("asyncside_active_requests", "Generating requests in flight")
        r.gauge(
            "asyncside_waiting_requests",
            "Generations waiting for their decode turn",
            lambda: state.service.waiting if state.service else 0,
        )
        r.add_collector(state.runtime_metrics)


def _runtime_samples(stats: Mapping[str, Any], prefix: str = "asyncside_runtime") -> dict[str, float]:
    """Flatten the numeric leaves of ``Runtime.stats()`` into metric names."""
    out: dict[str, float] = {}
    for key, value in stats.items():
        name = f"{prefix}_{re.sub(r'[^a-zA-Z0-9_]', '_', str(key))}"
        if isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, (int, float)) and math.isfinite(value):
            out[name] = float(value)
        elif isinstance(value, Mapping) and not any(str(k).isdigit() for k in value):
            out.update(_runtime_samples(value, name))
        # per-layer maps (digit keys) and non-numbers are left to /health and the stats API
    return out


class _State:
    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.engine: Engine | None = None
        self.service: GenerationService | None = None
        self.started = time.time()
        self.metrics = _Metrics(self)

    def runtime_metrics(self) -> list[Gauge]:
        if self.engine is None or self.engine.stats is None:
            return []
        try:
            samples = _runtime_samples(self.engine.stats())
        except Exception as exc:  # a metrics scrape must not take the server down
            log.warning("runtime stats failed: %s", exc)
            return []
        metrics = []
        for name, value in sorted(samples.items()):
            g = Gauge(name, "Runtime statistic (Runtime.stats())")
            g.set(value)
            metrics.append(g)
        return metrics


def _describe(exc: BaseException) -> str:
    """``Type: message`` of an error, looking through task-group wrappers of a single error."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"


def _error(exc: oai.RequestError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _read_json(request: Request, limit: int) -> Any:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise oai.RequestError(f"request body is {length} bytes; the limit is {limit}", status=413)
    chunks, size = [], 0
    async for piece in request.stream():
        size += len(piece)
        if size > limit:
            raise oai.RequestError(f"request body exceeds the limit of {limit} bytes", status=413)
        chunks.append(piece)
    raw = b"".join(chunks)
    if not raw:
        raise oai.RequestError("request body is empty; expected a JSON object")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise oai.RequestError(f"request body is not valid JSON: {exc}") from None


async def _watch_disconnect(receive: Receive, on_disconnect: Callable[[], None]) -> None:
    """Return when the client disconnects (after calling ``on_disconnect``)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


def _sse(payload: Mapping[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class _Generation:
    """One request's generation: prompt ids, token stream, text deltas, and its bookkeeping."""

    def __init__(self, state: _State, req: oai.CompletionRequest, endpoint: str, started: float) -> None:
        assert state.service is not None
        self.state = state
        self.service = state.service
        self.req = req
        self.endpoint = endpoint
        self.started = started
        self.rid = oai.new_id(req.kind)
        self.created = oai.now()
        tok = self.service.tokenizer
        if req.kind == "chat":
            ids = oai.chat_prompt_ids(tok, req.messages)
        elif req.prompt_ids is not None:
            ids = list(req.prompt_ids)
            vocab = getattr(tok, "vocab_size", None)
            if not isinstance(vocab, int):
                vocab = (getattr(self.service.model, "config", None) or {}).get("vocab_size")
            if isinstance(vocab, int) and max(ids) >= vocab:
                raise oai.RequestError(
                    f"'prompt' holds token id {max(ids)}; the vocabulary has {vocab} ids", param="prompt"
                )
        else:
            ids = list(tok.encode(req.prompt or ""))
        if not ids:
            raise oai.RequestError("the prompt encodes to no tokens", param="prompt")
        limit = state.settings.max_prompt_tokens
        if len(ids) > limit:
            raise oai.RequestError(f"the prompt is {len(ids)} tokens; this server allows at most {limit}", param="prompt")
        self.prompt_ids = ids
        self.text = TextAssembler(tok, req.stop)
        self.first_token_at: float | None = None
        self.tail = ""

    async def deltas(self) -> AsyncIterator[str]:
        """One text delta per generated token; at the end ``self.tail`` holds what was held back
        (sent with the final chunk) and ``self.text.finish_reason`` is set."""
        m = self.state.metrics
        m.prompt_tokens.inc(len(self.prompt_ids), endpoint=self.endpoint)
        async with contextlib.aclosing(self.service.tokens(self.prompt_ids, self.req.max_tokens)) as tokens:
            async for token in tokens:
                if self.first_token_at is None:
                    self.first_token_at = time.perf_counter()
                    m.ttft.observe(self.first_token_at - self.started)
                m.generated.inc(endpoint=self.endpoint)
                delta = self.text.push(token)
                if self.text.finished and not delta:
                    return  # the token completed a stop sequence: nothing of it is sent
                # One delta per token, possibly "" (a token that ends inside a multi-byte
                # character or a possible stop sequence), so streams show every decode step.
                yield delta
                if self.text.finished:
                    return
        self.tail = self.text.flush("length" if self.text.completion_tokens >= self.req.max_tokens else "stop")

    def usage(self) -> dict[str, int]:
        return oai.usage(len(self.prompt_ids), self.text.completion_tokens)


class _EventStream:
    """An ASGI response that streams SSE frames and cancels the producer when the client leaves."""

    def __init__(self, gen: _Generation, finish: Callable[[int], None]) -> None:
        self.gen = gen
        self.finish = finish

    async def _stream(self, scope: Scope, receive: Receive, send: Send) -> None:
        gen, req = self.gen, self.gen.req
        status = 200
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no"),
                ],
            }
        )

        async def frame(payload: Mapping[str, Any] | str) -> None:
            await send({"type": "http.response.body", "body": _sse(payload), "more_body": True})

        async def produce() -> None:
            if req.kind == "chat":
                await frame(oai.chunk(req, gen.rid, gen.created, text="", role=True))
            try:
                async for delta in gen.deltas():
                    await frame(oai.chunk(req, gen.rid, gen.created, text=delta))
            except Exception as exc:  # a failed fill or model error: tell the client in-band
                log.exception("generation failed")
                gen.state.metrics.errors.inc(endpoint=gen.endpoint)
                err = oai.RequestError(f"generation failed: {_describe(exc)}", status=500,
                                       type="server_error")
                await frame(err.body())
                await frame("[DONE]")
                return
            tail = gen.tail if (gen.tail or req.kind == "completion") else None
            last = oai.chunk(req, gen.rid, gen.created, text=tail, finish_reason=gen.text.finish_reason)
            await frame(last)
            if req.include_usage:
                await frame(oai.chunk(req, gen.rid, gen.created, usage_=gen.usage(), no_choices=True))
            await frame("[DONE]")

        disconnected = False

        async with anyio.create_task_group() as tg:

            def gone() -> None:
                nonlocal disconnected
                disconnected = True
                tg.cancel_scope.cancel()

            tg.start_soon(_watch_disconnect, receive, gone)
            try:
                await produce()
            except OSError:  # the transport broke under a send
                disconnected = True
            tg.cancel_scope.cancel()  # stop watching

        if disconnected:
            status = DISCONNECTED_STATUS
        else:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        self.finish(status)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._stream(scope, receive, send)
        finally:
            self.finish(DISCONNECTED_STATUS)  # no-op unless the stream ended before finishing


def create_app(engine_factory: EngineFactory, settings: ServeSettings | None = None) -> Starlette:
    """The ASGI application. ``engine_factory`` is entered at startup, on the serving loop."""
    settings = settings or ServeSettings()
    state = _State(settings)
    metrics = state.metrics

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with engine_factory() as engine:
            state.engine = engine
            state.service = GenerationService(engine.model, engine.source, predictor=settings.predictor)
            try:
                yield
            finally:
                state.engine = None
                state.service = None

    def record(endpoint: str, status: int) -> None:
        metrics.requests.inc(endpoint=endpoint, status=str(status))

    async def generate_endpoint(request: Request, endpoint: str, parse: oai.Parser, default_max: int) -> Response:
        started = time.perf_counter()
        assert state.service is not None
        try:
            body = await _read_json(request, settings.max_body_bytes)
            req = parse(
                body,
                served_models=[state.service.model_id],
                default_max_tokens=default_max,
                max_tokens_limit=settings.max_tokens_limit,
            )
            gen = _Generation(state, req, endpoint, started)
        except oai.RequestError as exc:
            record(endpoint, exc.status)
            return _error(exc)

        metrics.active.inc()
        finished = False

        def finish(status: int) -> None:
            nonlocal finished
            if finished:
                return
            finished = True
            metrics.active.dec()
            record(endpoint, status)
            metrics.duration.observe(time.perf_counter() - started)
            if status == DISCONNECTED_STATUS:
                metrics.disconnects.inc(endpoint=endpoint)

        if req.stream:
            return _EventStream(gen, finish)  # type: ignore[return-value]  # an ASGI response

        # Non-streaming: race the whole generation against the client leaving.
        disconnected = False
        pieces: list[str] = []
        try:
            async with anyio.create_task_group() as tg:

                def gone() -> None:
                    nonlocal disconnected
                    disconnected = True
                    tg.cancel_scope.cancel()

                tg.start_soon(_watch_disconnect, request.receive, gone)
                async for delta in gen.deltas():
                    pieces.append(delta)
                tg.cancel_scope.cancel()
        except Exception as exc:
            log.exception("generation failed")
            metrics.errors.inc(endpoint=endpoint)
            finish(500)
            err = oai.RequestError(f"generation failed: {_describe(exc)}", status=500, type="server_error")
            return _error(err)
        if disconnected:
            finish(DISCONNECTED_STATUS)
            return Response(status_code=DISCONNECTED_STATUS)  # nobody is listening
        finish(200)
        return JSONResponse(
            oai.full_response(
                req, gen.rid, gen.created, "".join(pieces) + gen.tail, gen.text.finish_reason or "stop",
                len(gen.prompt_ids), gen.text.completion_tokens,
            )
        )

    async def completions(request: Request) -> Response:
        return await generate_endpoint(request, "/v1/completions", oai.parse_completion, settings.default_max_tokens)

    async def chat(request: Request) -> Response:
        return await generate_endpoint(
            request, "/v1/chat/completions", oai.parse_chat, settings.default_chat_max_tokens
        )

    def model_card() -> dict[str, Any]:
        assert state.service is not None
        return {"id": state.service.model_id, "object": "model", "created": int(state.started), "owned_by": "asyncside"}

    async def models(request: Request) -> Response:
        record("/v1/models", 200)
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request: Request) -> Response:
        assert state.service is not None
        wanted = request.path_params["model_id"]
        if wanted != state.service.model_id:
            record("/v1/models/{id}", 404)
            return _error(oai.RequestError(f"model {wanted!r} does not exist", status=404, param="model",
                                           code="model_not_found"))
        record("/v1/models/{id}", 200)
        return JSONResponse(model_card())

    async def health(request: Request) -> Response:
        assert state.engine is not None and state.service is not None
        ok, problems = state.engine.audit() if state.engine.audit else (True, [])
        status = 200 if ok else 503
        record("/health", status)
        return JSONResponse(
            {
                "status": "ok" if ok else "degraded",
                "model": state.service.model_id,
                "active_requests": state.service.active,
                "waiting_requests": state.service.waiting,
                "decode_steps": state.service.steps,
                "audit": {"ok": ok, "problems": problems},
                "engine": state.engine.description,
            },
            status_code=status,
        )

    async def metrics_endpoint(request: Request) -> Response:
        record("/metrics", 200)
        return Response(metrics.registry.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        message = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed on {request.url.path}"}
        record("unmatched" if exc.status_code == 404 else request.url.path, exc.status_code)
        return _error(oai.RequestError(message.get(exc.status_code, str(exc.detail)), status=exc.status_code))

    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error")
        return _error(oai.RequestError(f"internal error: {type(exc).__name__}: {exc}", status=500, type="server_error"))

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error, Exception: server_error},
    )
    app.state.asyncside = state
    return app


# --- running it --------------------------------------------------------------------------------


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket; port 0 picks a free port (read it back with ``getsockname``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot bind {host}:{port}: {exc.strerror}") from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


def _uvicorn_server(app: Starlette, log_level: str) -> Any:
    import uvicorn

    config = uvicorn.Config(app, loop="uvloop", lifespan="on", log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=5)
    return uvicorn.Server(config)


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

    def start(self) -> "BackgroundServer":
        self._thread = threading.Thread(target=self._run, name="asyncside-serve", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self.server.started:
            if not self._thread.is_alive() or self.server.should_exit:
                self._thread.join(timeout=5)
                raise RuntimeError(f"asyncside server failed to start: {self._error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"asyncside server did not start within {self.startup_timeout}s")
            time.sleep(0.01)
        return self

    def call(self, fn: Callable[[], Coroutine[Any, Any, T]], timeout: float = 60.0) -> T:
        import asyncio

        return asyncio.run_coroutine_threadsafe(fn(), self.loop).result(timeout)

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
            if self._thread.is_alive():
                raise RuntimeError("asyncside server thread did not stop within 30s")
        self.sock.close()
        if self._error is not None and not isinstance(self._error, (KeyboardInterrupt, SystemExit)):
            raise RuntimeError("asyncside server thread failed") from self._error

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- the real engine and the `asyncside serve` command -----------------------------------------


def runtime_audit(runtime: Any) -> tuple[bool, list[str]]:
    """(ok, problems) over every layer ledger of ``runtime``."""
    problems: list[str] = []
    for layer, report in runtime.audit().items():
        if not report.ok:
            problems.extend(f"layer {layer}: {p}" for p in report.problems)
    return (not problems, problems)


def _embedded_store_dir(cache_dir: str | None) -> str:
    from .models.embedded import ensure_embedded_default

    built = ensure_embedded_default(cache_dir)
    # (model_dir, store_dir): the store directory is what the streaming model loads from
    return str(built[1] if isinstance(built, tuple) else built)


@contextlib.asynccontextmanager
async def open_engine(
    model: str | None = None,
    *,
    resident: float = 0.25,
    reader: str = "auto",
    policy: str = "lfu",
    cache_dir: str | None = None,
) -> AsyncIterator[Engine]:
    """Load a converted model (the embedded default when ``model`` is None) and open its Runtime.

    ``model`` is a directory written by ``asyncside convert`` (expert store + non-expert weights
    + config + tokenizer). Runs on the serving loop: the Runtime's reap task and completion
    bridge belong to that loop. Loading is synchronous and happens before the server accepts
    connections, so it blocks nothing that is waiting.
    """
    from .models import load_streaming_model
    from .runtime import Runtime

    store_dir = model if model is not None else _embedded_store_dir(cache_dir)
    streaming = load_streaming_model(store_dir)
    store = streaming.store
    async with Runtime(store, resident=resident, reader=reader, policy=policy) as runtime:
        yield Engine(
            model=streaming,
            source=runtime,
            stats=runtime.stats,
            audit=lambda: runtime_audit(runtime),
            description={
                "model": str(store_dir),
                "layers": len(store.layers),
                "resident": resident,
                "reader": runtime.reader,
                "policy": policy,
            },
        )


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Which model to serve and how its runtime streams experts (shared with `bench serve`)."""
    parser.add_argument("--model", metavar="DIR", default=None,
                        help="a model directory written by `asyncside convert` "
                             "(default: the embedded model, built on first run)")
    parser.add_argument("--resident", type=float, default=0.25,
                        help="fraction of each layer's experts kept in the pools (default 0.25)")
    parser.add_argument("--reader", default="auto", choices=["auto", "io_uring", "threads", "aiofiles"],
                        help="expert read backend (default auto)")
    parser.add_argument("--policy", default="lfu", help="side-region eviction policy (default lfu)")
    parser.add_argument("--predictor", default="lookahead", help="expert predictor (default lookahead)")
    parser.add_argument("--cache-dir", default=None,
                        help="where the embedded model is built (default: ASYNCSIDE_CACHE or the user cache)")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `asyncside serve`."""
    add_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="interface to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    parser.add_argument("--max-tokens-limit", type=int, default=ServeSettings.max_tokens_limit,
                        help="largest max_tokens a request may ask for")
    parser.add_argument("--log-level", default="warning",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])


def _check_args(args: argparse.Namespace) -> None:
    if not 0.0 <= args.resident <= 1.0:
        raise SystemExit(f"--resident must be a fraction in [0, 1], got {args.resident}")
    port = getattr(args, "port", 0)
    if not 0 <= port <= 65535:
        raise SystemExit(f"--port must be in [0, 65535], got {port}")
    if getattr(args, "max_tokens_limit", 1) < 1:
        raise SystemExit(f"--max-tokens-limit must be at least 1, got {args.max_tokens_limit}")


def engine_factory_from_args(args: argparse.Namespace) -> EngineFactory:
    _check_args(args)
    return lambda: open_engine(args.model, resident=args.resident, reader=args.reader, policy=args.policy,
                               cache_dir=args.cache_dir)


def app_from_args(args: argparse.Namespace) -> Starlette:
    settings = ServeSettings(max_tokens_limit=args.max_tokens_limit, predictor=args.predictor)
    return create_app(engine_factory_from_args(args), settings)


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
    try:
        await server.serve(sockets=[sock])
    finally:
        announcer.cancel()
        sock.close()
    if not server.started:
        raise ServeError("asyncside serve: startup failed (see the log above)")


async def run_serve(args: argparse.Namespace) -> None:
    """`asyncside serve` on the running loop; prints one line with the URL once the model is loaded."""
    app = app_from_args(args)

    def ready(url: str) -> None:
        st = app.state.asyncside
        print(f"asyncside serve: {url} model={st.service.model_id} reader={st.engine.description.get('reader')}",
              flush=True)

    await serve(app, args.host, args.port, log_level=args.log_level, on_ready=ready)


def serve_main(args: argparse.Namespace) -> int:
    """`asyncside serve`: run the server on a uvloop event loop; 0 on a clean shutdown."""
    import uvloop

    _check_args(args)
    try:
        uvloop.run(run_serve(args))
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled, after a graceful shutdown
        pass
    except (ServeError, OSError) as exc:
        print(f"asyncside serve: {exc}", file=sys.stderr)
        return 1
    return 0
