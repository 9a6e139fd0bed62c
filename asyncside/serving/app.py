"""The ASGI application of `asyncside serve` (Starlette): routes, the life of one request, metrics.

Endpoints:

- ``POST /v1/completions`` and ``POST /v1/chat/completions`` (also without the ``/v1`` prefix;
  ``stream: true`` answers with server-sent events ending in ``data: [DONE]``),
- ``GET /v1/models``, ``GET /v1/models/{id}``,
- ``GET /health`` (200 while the runtime's ledgers audit clean and no expert failed its read,
  503 otherwise, and 503 "draining" once shutdown began; open to every client, but naming no file
  of the host to one without the key),
- ``GET /metrics`` (Prometheus text format 0.0.4).

With an API key every other endpoint wants ``Authorization: Bearer <key>`` (:mod:`.security`).

Every generating request is parsed (:mod:`.protocol`), turned into prompt ids, checked against
the model's context, and submitted to the one :class:`~.engine.Batcher`, which steps all requests
together; its tokens become text (:mod:`.text`) sent as one JSON answer or as SSE chunks
(:mod:`.streaming`). A client that disconnects cancels its request; a request past the timeout
is ended with 504. One access-log line per request goes to the ``asyncside.access`` logger.

Shutting down (:meth:`ServerState.drain`): new generating requests and ``/health`` get 503 with ``Retry-After``,
requests in flight have ``shutdown_grace`` seconds to finish, and the rest are ended with an error
(an ``{"error": ...}`` event and ``[DONE]`` on a stream) before the server stops.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ..errors import AsyncsideError
from . import protocol as oai
from .engine import Batcher, Engine, Generation, GenerationFailed, QueueFull
from .health import HealthRegistry
from .metrics import CONTENT_TYPE as PROMETHEUS_CONTENT_TYPE
from .metrics import ServerMetrics
from .security import Guard, public_text
from .settings import ServeSettings, default_body_limit
from .streaming import DISCONNECTED_STATUS, ClientGone, EventStream, Frame, read_json, run_unless_disconnected
from .text import TextAssembler, ToolCallSplitter, parse_tool_calls, token_bytes

log = logging.getLogger("asyncside.serving")
access_log = logging.getLogger("asyncside.access")

EngineFactory = Callable[[], contextlib.AbstractAsyncContextManager[Engine]]

TIMEOUT_STATUS = 504
SHUTDOWN_STATUS = 503


class ServerState:
    """What the application holds while it runs: the engine (after startup) and the metrics."""

    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.engine: Engine | None = None
        self.batcher: Batcher | None = None
        self.started = time.time()
        #: the bound on MLX's cache of freed buffers in force (the setting, or under a memory
        #: budget what the headroom leaves beside the KV allowance); None: MLX's default
        self.mlx_cache_limit: int | None = settings.mlx_cache_bytes

        def stats() -> Any:
            return self.engine.stats() if self.engine is not None and self.engine.stats is not None else None

        self.metrics = ServerMetrics(lambda: self.batcher, stats, lambda: self.health, self._memory)
        #: set once shutdown began: /health answers 503 "draining" (through the drain delay too)
        self.stopping = False
        #: set once the drain proper began: new generating requests are refused with 503
        self.draining = False
        #: an expected error (a bad store, a missing file) the engine's startup failed with
        self.startup_error: BaseException | None = None
        #: the store's bad experts (after startup)
        self.health: HealthRegistry | None = None
        self._runs: set[anyio.CancelScope] = set()
        self._runs_left: anyio.Event | None = None
        #: the drain's wait for the requests in flight; cancelled to end the grace early
        self._grace: anyio.CancelScope | None = None
        self._grace_ended = False

    @contextlib.contextmanager
    def generating(self) -> Any:
        """A cancel scope around one request's generation, cancelled if shutdown's grace runs out
        (check its ``cancelled_caught`` after the block)."""
        scope = anyio.CancelScope()
        self._runs.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._runs.discard(scope)
            if not self._runs and self._runs_left is not None:
                self._runs_left.set()

    @property
    def in_flight(self) -> int:
        """Requests generating now (what a shutdown waits for)."""
        return len(self._runs)

    async def drain(self, grace: float | None = None) -> int:
        """Stop admitting, give the requests in flight ``grace`` seconds (the settings' when None)
        to finish, then end the rest with an error; returns how many were ended that way. Before
        that, ``/health`` says "draining" for the settings' ``drain_delay`` while requests are still
        taken (:meth:`end_grace` ends the delay too)."""
        self.stopping = True
        if self.settings.drain_delay > 0 and not self._grace_ended:
            # A load balancer polls /health every few seconds: refusing at once would send the
            # requests it routes meanwhile to a server that turns them away.
            with anyio.move_on_after(self.settings.drain_delay) as self._grace:
                await anyio.sleep_forever()
            self._grace = None
        self.draining = True
        grace = 0.0 if self._grace_ended else self.settings.shutdown_grace if grace is None else grace
        with anyio.move_on_after(grace) as self._grace:
            while self._runs:
                self._runs_left = anyio.Event()
                await self._runs_left.wait()
        self._grace = None
        ended = len(self._runs)
        for scope in list(self._runs):
            scope.cancel()
        # The ended requests send their last event; a client that reads nothing cannot hold this.
        with anyio.move_on_after(2.0):
            while self._runs:
                self._runs_left = anyio.Event()
                await self._runs_left.wait()
        return ended

    def end_grace(self) -> None:
        """End what is left of the drain's delay and grace now (a second signal): the requests in
        flight are ended with their error at once, as when the grace runs out. Call on the server's
        loop."""
        self._grace_ended = True
        if self._grace is not None:
            self._grace.cancel()

    def shutdown_error(self) -> oai.RequestError:
        return oai.RequestError("the server is shutting down; retry against another instance or after it restarts",
                                status=SHUTDOWN_STATUS, type="server_error", code="server_shutting_down",
                                headers={"Retry-After": str(max(1, math.ceil(self.settings.shutdown_grace)))})

    def private_dirs(self) -> list[str]:
        """Directories of the host that client-facing text must not name (the model's)."""
        model = self.engine.description.get("model") if self.engine is not None else None
        return [model] if isinstance(model, str) else []

    def public(self, text: str) -> str:
        """``text`` without absolute paths of the host (see :func:`.security.public_text`)."""
        return public_text(text, self.private_dirs())

    def _memory(self) -> dict[str, float]:
        """What the server's caches hold and their bounds, in bytes (for /metrics)."""
        import mlx.core as mx

        out: dict[str, float] = {"mlx_active_bytes": mx.get_active_memory(), "mlx_cache_bytes": mx.get_cache_memory(),
                                 "mlx_cache_limit_bytes": float(self.mlx_cache_limit or 0)}
        if self.batcher is not None:
            out["prompt_cache_bytes"] = self.batcher.prefix_cache.nbytes
            out["prompt_cache_limit_bytes"] = self.batcher.prefix_cache.max_bytes
            if self.batcher.kv_admission is not None and self.batcher.kv_admission.allowance is not None:
                out["kv_reserved_bytes"] = self.batcher.kv_reserved()
                out["kv_allowance_bytes"] = self.batcher.kv_admission.allowance
                if self.batcher.kv_admission.max_active is not None:
                    out["max_active_by_rows"] = self.batcher.kv_admission.max_active
                limit = self.batcher.kv_admission.limit
                if limit is not None:
                    out["active_limit"] = limit
        if self.engine is not None:
            for key in ("staging_bytes", "host_tier_bytes"):
                value = self.engine.description.get(key)
                if isinstance(value, (int, float)):
                    out[key] = value
        return out

    @property
    def model_id(self) -> str:
        assert self.batcher is not None, "the server has not started"
        return self.batcher.model_id

    @property
    def context_length(self) -> int | None:
        assert self.batcher is not None
        return self.settings.max_context or self.batcher.context_length

    @property
    def body_limit(self) -> int:
        """The largest request body taken: the setting, else room for a prompt of the context."""
        if self.settings.max_body_bytes is not None:
            return self.settings.max_body_bytes
        assert self.batcher is not None
        return default_body_limit(self.context_length, self.batcher.vocab_size)


def _error(exc: oai.RequestError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers or None)


@dataclass
class Piece:
    """What one generated token adds to the answer."""

    text: str
    logprobs: list[oai.TokenLogprob] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class Completion:
    """One request's generation: its prompt ids, its engine handle, and the answer built from the tokens."""

    def __init__(self, state: ServerState, req: oai.CompletionRequest, endpoint: str, started: float) -> None:
        assert state.batcher is not None
        self.state = state
        self.batcher = state.batcher
        self.req = req
        self.endpoint = endpoint
        self.started = started
        self.rid = oai.new_id(req.kind)
        self.created = oai.now()
        tok = self.batcher.tokenizer
        self.tokenizer = tok
        if req.kind == "chat":
            ids = oai.chat_prompt_ids(tok, req.messages, tools=req.tools, template_kwargs=req.chat_template_kwargs)
        elif req.prompt_ids is not None:
            ids = list(req.prompt_ids)
        else:
            ids = list(tok.encode(req.prompt or ""))
        if not ids:
            raise oai.RequestError("the prompt encodes to no tokens", param="prompt")
        context = state.context_length
        self.max_tokens = req.max_tokens
        if context is not None and not req.max_tokens_given and len(ids) < context:
            # The server's default, not the client's ask: generate up to the context's end, as OpenAI does.
            self.max_tokens = min(req.max_tokens, context - len(ids))
        if context is not None and len(ids) + self.max_tokens > context:
            param = "messages" if req.kind == "chat" else "prompt"
            total = len(ids) + self.max_tokens
            said = (f"the prompt is {len(ids)} tokens and max_tokens is {self.max_tokens}: {total} tokens in all, "
                    f"past the model's context of {context}" if req.max_tokens_given else
                    f"the prompt is {len(ids)} tokens: the model's context of {context} leaves no room for a token")
            raise oai.RequestError(said, param=param, code="context_length_exceeded")
        admission = self.batcher.kv_admission
        if admission is not None and not req.max_tokens_given:
            # Likewise what the memory budget's KV allowance admits beside the prompt.
            self.max_tokens = admission.most_tokens(len(ids), self.max_tokens)
        self.prompt_ids = ids
        self.text = TextAssembler(tok, req.stop)
        self.splitter: ToolCallSplitter | None = None
        self.tool_parser = None
        if req.tools:
            start, end = getattr(tok, "tool_call_start", None), getattr(tok, "tool_call_end", None)
            parser = getattr(tok, "tool_parser", None)
            if not (start and end and parser):
                raise oai.RequestError("'tools' is not supported by this model: its tokenizer has no tool-call "
                                       "format (mlx-lm infers one from the chat template)", param="tools")
            self.splitter = ToolCallSplitter(start, end)
            self.tool_parser = parser
        self.tool_calls: list[dict[str, Any]] = []
        self.gen: Generation | None = None
        self.first_token_at: float | None = None
        self.finish_reason: str | None = None

    def start(self) -> None:
        """Queue the request in the engine (QueueFull when it is at capacity)."""
        self.gen = self.batcher.submit(self.prompt_ids, self.max_tokens, self.req.sampling)
        m = self.state.metrics
        m.prompt_tokens.inc(len(self.prompt_ids), endpoint=self.endpoint)

    def cancel(self) -> None:
        if self.gen is not None:
            self.gen.cancel()

    def _entry(self, token: int, logprob: float, top: tuple[tuple[int, float], ...],
               offset: int | None) -> oai.TokenLogprob:
        tok = self.tokenizer
        text, alternatives = tok.decode([token]), tuple((tok.decode([t]), lp) for t, lp in top)
        if self.req.kind != "chat":  # completions' logprobs carry no bytes, but an offset in the text
            return oai.TokenLogprob(text, logprob, alternatives, offset=offset)
        return oai.TokenLogprob(text, logprob, alternatives, token_bytes(tok, token),
                                tuple(token_bytes(tok, t) for t, _ in top))

    def _content(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """Content and newly closed tool calls of released text."""
        if self.splitter is None:
            return text, []
        content = self.splitter.push(text)
        if final:
            content += self.splitter.flush()
        bodies, self.splitter.calls = self.splitter.calls, []
        if not bodies:
            return content, []
        assert self.tool_parser is not None
        calls, failed = parse_tool_calls(bodies, self.tool_parser, self.req.tools, first_index=len(self.tool_calls),
                                         streaming=self.req.stream)
        if calls and not self.req.parallel_tool_calls:
            calls = calls[: max(0, 1 - len(self.tool_calls))]
        self.tool_calls.extend(calls)
        # A call that does not parse is not lost: it stays in the content, markers included.
        for body in failed:
            content += f"{self.splitter.start}{body}{self.splitter.end}"
        return content, calls

    async def pieces(self) -> AsyncIterator[Piece]:
        """One piece per generated token, then (possibly) a last one with what was held back;
        ``finish_reason`` is set at the end."""
        assert self.gen is not None
        m = self.state.metrics
        want_logprobs = self.req.sampling.logprobs
        async for ev in self.gen:
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()
                m.ttft.observe(self.first_token_at - self.started)
            m.generated.inc(endpoint=self.endpoint)
            # A token's text_offset counts the characters before it: a token's own text alone is
            # U+FFFD where it is part of a character, so summing those drifts past the text.
            at = self.text.decoded_length() if want_logprobs and self.req.kind != "chat" else None
            delta = self.text.push(ev.token)
            entries = []
            if want_logprobs and not ev.eos and ev.logprob is not None:
                entries.append(self._entry(ev.token, ev.logprob, ev.top, at))
            content, calls = self._content(delta)
            if self.text.finished and not delta:
                break  # the token completed a stop sequence (or is EOS): nothing of it is sent
            # One piece per token, possibly "" (a token that ends inside a multi-byte character or
            # a possible stop sequence), so streams show every decode step.
            yield Piece(content, entries, calls)
            if self.text.finished:
                break
        reason = self.text.finish_reason or self.gen.finish_reason or "stop"
        tail = self.text.flush(reason)
        content, calls = self._content(tail, final=True)
        if content or calls:
            yield Piece(content, [], calls)
        if self.tool_calls and reason == "stop":
            reason = "tool_calls"
        self.finish_reason = reason

    def usage(self) -> dict[str, Any]:
        cached = self.gen.cached_tokens if self.gen is not None else 0
        return oai.usage(len(self.prompt_ids), self.text.completion_tokens, cached)

    def access(self) -> dict[str, Any]:
        """What the access-log line says about the generation."""
        ttft = None if self.first_token_at is None else self.first_token_at - self.started
        return {"prompt": len(self.prompt_ids), "cached": self.gen.cached_tokens if self.gen else 0,
                "completion": self.text.completion_tokens, "ttft": ttft}


async def _recheck_bad_experts(health: HealthRegistry, every: float) -> None:
    """While experts are bad, look for their blobs replaced and verify them again (healing)."""
    while True:
        await anyio.sleep(every)
        if health.degraded:
            try:
                await health.recheck()
            except Exception:  # a recheck that fails is tried again; it must not stop the server
                log.exception("re-checking bad experts failed")


class _OneLineStartupFailure:
    """ASGI middleware: a startup that failed with an expected error (``state.startup_error``)
    reports no traceback to the server (whose caller says the error in one line)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def quiet_send(message: Any) -> None:
            if message["type"] == "lifespan.startup.failed" and self.state.startup_error is not None:
                message = {**message, "message": ""}
            await send(message)

        await self.app(scope, receive, quiet_send)


class _NotServing:
    """ASGI middleware: a request while no engine serves (its lifespan has not run, or has ended) is
    a 503 saying so. Without the lifespan (an app mounted in another, a test client outside its
    ``with``) each was an internal error: an assert's, or under ``python -O`` an AttributeError."""

    def __init__(self, app: ASGIApp, state: ServerState, on_refused: Callable[[str, int], None]) -> None:
        self.app = app
        self.state = state
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.state.batcher is not None or scope["path"] == "/metrics":
            await self.app(scope, receive, send)
            return
        error = oai.RequestError("the server is not running: the app's lifespan, which starts the engine, has not run "
                                 "or has ended (serve it with its lifespan on; a mounted app's lifespan does not run)",
                                 status=503, type="server_error", code="server_not_running")
        scope.setdefault("state", {})["asyncside_status"] = error.status
        self.on_refused(scope["path"], error.status)
        await _error(error)(scope, receive, send)


class AccessLog:
    """ASGI middleware: one ``asyncside.access`` log line per HTTP request (status, tokens, timing)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500

        async def send_status(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            if access_log.isEnabledFor(logging.INFO):
                st = scope.get("state", {})
                final = st.get("asyncside_status", status)
                extra = st.get("asyncside_access")
                client = scope.get("client")
                who = f"{client[0]}:{client[1]}" if client else "-"
                # The path as sent (percent-encoded): decoded, a client's %0a wrote log lines of its own.
                raw = scope.get("raw_path")
                path = raw.decode("ascii", "backslashreplace") if isinstance(raw, bytes) else \
                    scope["path"].encode("unicode_escape").decode("ascii")
                line = f'{who} "{scope["method"]} {path}" {final} {time.perf_counter() - t0:.3f}s'
                if extra:
                    ttft = extra["ttft"]
                    line += (f" prompt={extra['prompt']} cached={extra['cached']} completion={extra['completion']}"
                             f" ttft={'-' if ttft is None else f'{ttft:.3f}s'}")
                access_log.info(line)


def create_app(engine_factory: EngineFactory, settings: ServeSettings | None = None) -> Starlette:
    """The ASGI application. ``engine_factory`` is entered at startup, on the serving loop."""
    settings = settings or ServeSettings()
    state = ServerState(settings)
    handlers = _Handlers(state)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            try:
                engine = await stack.enter_async_context(engine_factory())
            except (AsyncsideError, OSError) as exc:  # a bad store, a missing file: said in one line
                state.startup_error = exc
                raise
            batcher = engine.batcher
            if batcher is None:
                batcher = Batcher(engine.model, engine.source, predictor=settings.predictor,
                                  max_batch=settings.max_batch, max_queue=settings.max_queue,
                                  prefill_chunk=settings.prefill_chunk, prompt_cache_size=settings.prompt_cache_size,
                                  prompt_cache_min_tokens=settings.prompt_cache_min_tokens,
                                  joint_prefill=settings.joint_prefill,
                                  prompt_cache_bytes=settings.prompt_cache_bytes, routing=engine.routing)
                # An unknown predictor fails startup, not requests.
                engine.model.forward.make_predictor(settings.predictor)
            cache_limit = settings.mlx_cache_bytes
            plan = getattr(engine.source, "plan", None)
            room = getattr(plan, "forward_room_bytes", None)
            if isinstance(room, int):
                # Under a memory budget MLX's freed buffers are held in the headroom beside the KV
                # caches: at most the part of it the KV allowance leaves.
                room = max(0, room)
                cache_limit = room if cache_limit is None else min(cache_limit, room)
            state.mlx_cache_limit = cache_limit
            if cache_limit is not None:
                import mlx.core as mx

                # MLX keeps freed buffers for reuse up to its whole memory limit by default: with
                # batches of ever new shapes the process's RSS would grow towards that.
                mx.set_cache_limit(cache_limit)
            health = engine.health if engine.health is not None else HealthRegistry()
            batcher.on_failure = health.record
            async with anyio.create_task_group() as tg:
                tg.start_soon(batcher.run, name="asyncside engine")
                tg.start_soon(_recheck_bad_experts, health, settings.health_recheck_s, name="asyncside health")
                state.engine, state.batcher, state.health = engine, batcher, health
                try:
                    yield
                finally:
                    state.engine = state.batcher = state.health = None
                    tg.cancel_scope.cancel()

    routes = [
        Route("/v1/completions", handlers.completions, methods=["POST"]),
        Route("/completions", handlers.completions, methods=["POST"]),
        Route("/v1/chat/completions", handlers.chat, methods=["POST"]),
        Route("/chat/completions", handlers.chat, methods=["POST"]),
        Route("/v1/models", handlers.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", handlers.model, methods=["GET"]),
        Route("/health", handlers.health, methods=["GET"]),
        Route("/metrics", handlers.metrics, methods=["GET"]),
    ]
    middleware = [Middleware(_OneLineStartupFailure, state=state)]
    if settings.access_log:
        middleware.append(Middleware(AccessLog))
    if settings.allow_origins:
        from starlette.middleware.cors import CORSMiddleware

        middleware.append(Middleware(CORSMiddleware, allow_origins=list(settings.allow_origins),
                                     allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"]))

    def refused(path: str, status: int) -> None:
        state.metrics.requests.inc(endpoint=_CANONICAL.get(path, path) if path in _KNOWN_PATHS else "unmatched",
                                   status=str(status))

    middleware.append(Middleware(Guard, api_key=settings.api_key, max_header_bytes=settings.max_header_bytes,
                                 on_refused=refused))
    middleware.append(Middleware(_NotServing, state=state, on_refused=refused))
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=middleware,
        exception_handlers={HTTPException: handlers.http_error, Exception: handlers.server_error},
    )
    app.state.asyncside = state
    return app


_CANONICAL = {"/completions": "/v1/completions", "/chat/completions": "/v1/chat/completions"}
_KNOWN_PATHS = frozenset({"/v1/completions", "/completions", "/v1/chat/completions", "/chat/completions",
                          "/v1/models", "/health", "/metrics"})


def _endpoint(request: Request) -> str:
    """The ``endpoint`` label of a request: its route's path, never the path the client sent (a
    path of ``/v1/models/{id}`` with every id another label value, and another series kept for
    good); without a route (an error before routing) a known path, else ``unmatched``."""
    path = getattr(request.scope.get("route"), "path", None)
    if not isinstance(path, str):
        path = request.url.path if request.url.path in _KNOWN_PATHS else "unmatched"
    return _CANONICAL.get(path, "/v1/models/{id}" if path.startswith("/v1/models/{") else path)


class _Handlers:
    """The route handlers of one application."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.settings = state.settings
        self.m = state.metrics

    def record(self, endpoint: str, status: int) -> None:
        self.m.requests.inc(endpoint=endpoint, status=str(status))

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, "/v1/completions", oai.parse_completion, self.settings.default_max_tokens)

    async def chat(self, request: Request) -> Response:
        return await self.generate(request, "/v1/chat/completions", oai.parse_chat,
                                   self.settings.default_chat_max_tokens)

    async def generate(self, request: Request, endpoint: str, parse: oai.Parser, default_max: int) -> Response:
        started = time.perf_counter()
        state, settings, m = self.state, self.settings, self.m
        assert state.batcher is not None
        if state.draining:
            self.record(endpoint, SHUTDOWN_STATUS)
            return _error(state.shutdown_error())
        try:
            body = await read_json(request, state.body_limit)
            oai.check_strings(body)
            req = parse(body, served_models=[state.model_id], default_max_tokens=default_max,
                        max_tokens_limit=settings.max_tokens_limit, default_temperature=settings.default_temperature,
                        vocab_size=state.batcher.vocab_size)
            run = Completion(state, req, endpoint, started)
            run.start()
        except ClientGone:
            self.record(endpoint, DISCONNECTED_STATUS)
            m.disconnects.inc(endpoint=endpoint)
            return Response(status_code=DISCONNECTED_STATUS)  # nobody is listening
        except oai.RequestError as exc:
            self.record(endpoint, exc.status)
            return _error(exc)
        except QueueFull as exc:
            self.record(endpoint, 429)
            m.rejected.inc(endpoint=endpoint)
            return _error(oai.RequestError(str(exc), status=429, type="rate_limit_error", code="server_busy",
                                           headers={"Retry-After": str(exc.retry_after)}))
        request.state.asyncside_access = run.access()
        m.active.inc()
        finished = False

        def finish(status: int) -> None:
            nonlocal finished
            if finished:
                return
            finished = True
            run.cancel()
            m.active.dec()
            self.record(endpoint, status)
            if status == DISCONNECTED_STATUS:
                m.disconnects.inc(endpoint=endpoint)
            elif status == TIMEOUT_STATUS:
                m.timeouts.inc(endpoint=endpoint)
            elif status >= 500:
                m.errors.inc(endpoint=endpoint)
            m.duration.observe(time.perf_counter() - started)
            request.state.asyncside_access = run.access()
            request.state.asyncside_status = status

        deadline = None if settings.request_timeout is None else started + settings.request_timeout
        if req.stream:
            return _StreamedAnswer(self, run, deadline, finish)  # type: ignore[return-value]
        try:
            return await self._whole_answer(request, run, deadline, finish)
        finally:
            finish(DISCONNECTED_STATUS)  # no-op unless the answer was abandoned (cancelled)

    async def _whole_answer(self, request: Request, run: Completion, deadline: float | None,
                            finish: Callable[[int], None]) -> Response:
        pieces: list[Piece] = []
        timed_out = ended = False
        failed: GenerationFailed | None = None

        async def work() -> None:
            nonlocal timed_out, failed, ended
            with self.state.generating() as shutdown, \
                    anyio.move_on_after(None if deadline is None else deadline - time.perf_counter()) as scope:
                try:
                    async for piece in run.pieces():
                        pieces.append(piece)
                except GenerationFailed as exc:
                    failed = exc
            timed_out = scope.cancelled_caught
            ended = shutdown.cancelled_caught

        gone = await run_unless_disconnected(request.receive, work)
        if failed is not None:
            finish(500)
            log.error("%s", failed)
            return _error(oai.RequestError(self.state.public(str(failed)), status=500, type="server_error"))
        if ended:
            finish(SHUTDOWN_STATUS)
            return _error(self.state.shutdown_error())
        if gone:
            finish(DISCONNECTED_STATUS)
            return Response(status_code=DISCONNECTED_STATUS)  # nobody is listening
        if timed_out:
            finish(TIMEOUT_STATUS)
            return _error(self._timeout_error())
        finish(200)
        req = run.req
        text = "".join(p.text for p in pieces)
        logprobs = None
        if req.sampling.logprobs:
            logprobs = oai.logprobs_body(req, [e for p in pieces for e in p.logprobs])
        content: str | None = text
        if req.kind == "chat" and run.tool_calls and not text.strip():
            content = None
        return JSONResponse(oai.full_response(req, run.rid, run.created, content, run.finish_reason or "stop",
                                              run.usage(), logprobs=logprobs, tool_calls=run.tool_calls or None))

    def _timeout_error(self) -> oai.RequestError:
        return oai.RequestError(f"the request ran past the server's timeout of {self.settings.request_timeout:g} s",
                                status=TIMEOUT_STATUS, type="timeout_error", code="timeout")

    async def models(self, request: Request) -> Response:
        self.record("/v1/models", 200)
        return JSONResponse({"object": "list", "data": [self._card()]})

    def _card(self) -> dict[str, Any]:
        return {"id": self.state.model_id, "object": "model", "created": int(self.state.started),
                "owned_by": "asyncside"}

    async def model(self, request: Request) -> Response:
        wanted = request.path_params["model_id"]
        if wanted != self.state.model_id:
            self.record("/v1/models/{id}", 404)
            return _error(oai.RequestError(f"model {wanted!r:.100} does not exist", status=404, param="model",
                                           code="model_not_found"))
        self.record("/v1/models/{id}", 200)
        return JSONResponse(self._card())

    async def health(self, request: Request) -> Response:
        state = self.state
        assert state.engine is not None and state.batcher is not None
        ok, problems = state.engine.audit() if state.engine.audit else (True, [])
        faults = state.health.bad.values() if state.health is not None else []
        status = 200 if ok and not faults and not state.stopping else 503
        self.record("/health", status)
        b = state.batcher
        description = dict(state.engine.description)
        if not request.scope.get("state", {}).get("asyncside_authenticated"):
            # Nothing absolute about the host for a client without the key.
            description = {k: state.public(v) if isinstance(v, str) else v for k, v in description.items()}
            problems = [state.public(p) for p in problems]
        # Draining: a load balancer's readiness check must stop sending what would get 503 (the
        # rest of the body still shows the requests left in flight).
        return JSONResponse(
            {
                "status": "draining" if state.stopping else "ok" if status == 200 else "degraded",
                "bad_experts": [b.as_json() for b in faults],
                "model": b.model_id,
                "active_requests": b.active,
                "waiting_requests": b.waiting,
                "decode_steps": b.steps,
                "batched_decode": b.batched_decode,
                "prompt_cache": {"entries": len(b.prefix_cache), "hits": b.prefix_cache.hits,
                                 "reused_tokens": b.prefix_cache.reused_tokens},
                "audit": {"ok": ok, "problems": problems},
                "engine": description,
            },
            status_code=status,
            headers=state.shutdown_error().headers if state.stopping else None,
        )

    async def metrics(self, request: Request) -> Response:
        self.record("/metrics", 200)
        return Response(self.m.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    async def http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        message = {404: f"no route {request.url.path}",
                   405: f"method {request.method} not allowed on {request.url.path}"}
        self.record("unmatched" if exc.status_code == 404 else _endpoint(request), exc.status_code)
        # A 405 says which methods the route takes (Starlette's Allow header; HTTP requires it).
        return _error(oai.RequestError(message.get(exc.status_code, str(exc.detail)), status=exc.status_code,
                                       headers=exc.headers))

    async def server_error(self, request: Request, exc: Exception) -> Response:
        # Starlette re-raises after this answer, so uvicorn logs the traceback once.
        self.record(_endpoint(request), 500)
        return _error(oai.RequestError(self.state.public(f"internal error: {type(exc).__name__}: {exc}"), status=500,
                                       type="server_error"))


class _StreamedAnswer:
    """The SSE answer of a streaming request (an ASGI app Starlette returns as the response)."""

    def __init__(self, handlers: _Handlers, run: Completion, deadline: float | None,
                 finish: Callable[[int], None]) -> None:
        self.handlers = handlers
        self.run = run
        self.deadline = deadline
        self.stream = EventStream(self._produce, finish, heartbeat=handlers.settings.sse_heartbeat_s)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.stream(scope, receive, send)

    async def _produce(self, frame: Frame) -> int:
        run, req = self.run, self.run.req
        if req.kind == "chat":
            await frame(oai.chunk(req, run.rid, run.created, text="", role=True))
        state = self.handlers.state
        try:
            with state.generating() as shutdown, \
                    anyio.fail_after(None if self.deadline is None else self.deadline - time.perf_counter()):
                async for piece in run.pieces():  # each entry carries its text_offset in the whole answer
                    lp = oai.logprobs_body(req, piece.logprobs) if req.sampling.logprobs else None
                    await frame(oai.chunk(req, run.rid, run.created, text=piece.text, logprobs=lp,
                                          tool_calls=piece.tool_calls or None))
            if shutdown.cancelled_caught:
                return await frame.error(SHUTDOWN_STATUS, state.shutdown_error().body())
        except TimeoutError:
            return await frame.error(TIMEOUT_STATUS, self.handlers._timeout_error().body())
        except GenerationFailed as exc:  # a failed fill or model error: tell the client in-band
            log.error("%s", exc)
            return await frame.error(500, oai.RequestError(state.public(str(exc)), status=500,
                                                          type="server_error").body())
        tail = "" if req.kind == "completion" else None
        await frame(oai.chunk(req, run.rid, run.created, text=tail, finish_reason=run.finish_reason))
        if req.include_usage:
            await frame(oai.chunk(req, run.rid, run.created, usage_=run.usage(), no_choices=True))
        await frame("[DONE]")
        return 200
