"""The limits and defaults of one server (:class:`ServeSettings`); no heavy imports."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServeSettings:
    """Limits and defaults of one server.

    Admission: at most ``max_batch`` requests are in the engine at once (prefilling or decoding
    together); up to ``max_queue`` more wait for a slot; beyond that a request is answered 429
    with ``Retry-After``. ``request_timeout`` (seconds, None for none) bounds a request from
    arrival to its last token, queueing included. A prompt whose length plus ``max_tokens`` exceeds
    the model's context (``max_context``, else the model config's ``max_position_embeddings``)
    is answered 400 before it queues. A request body past ``max_body_bytes`` is answered 413
    (None: :func:`default_body_limit` of the served context, so that a prompt of the context's
    length as token ids fits).

    Prefill runs in chunks of ``prefill_chunk`` tokens (None: by device, see
    :func:`~asyncside.serving.engine.default_prefill_chunk`), one chunk's worth per engine step
    between decode steps, so a long prompt delays other streams by at most one chunk per token.
    ``prompt_cache_size`` KV caches of finished requests are kept for prefix reuse (0: off), at
    most ``prompt_cache_bytes`` of them; a prefix shorter than ``prompt_cache_min_tokens`` is
    recomputed rather than copied. ``mlx_cache_bytes`` bounds MLX's cache of freed buffers for
    the process (None: MLX's default, which is its whole memory limit: RSS then grows with every
    new shape a batch meets).
    ``joint_prefill``: fresh prompts arriving together share one prefill forward (see
    :class:`~asyncside.serving.engine.Batcher`; off by default: on a GPU it changes the low bits
    of their caches with who arrived together).

    ``api_key``: every endpoint but ``/health`` wants ``Authorization: Bearer <api_key>`` (401
    otherwise); ``/health`` stays open but names no file of the host unless the request carries
    the key. ``max_header_bytes`` bounds a request's headers (431 beyond). ``shutdown_grace``:
    on SIGTERM/SIGINT (or :meth:`~.background.BackgroundServer.stop`) new requests get 503 and
    requests in flight have this many seconds to finish before they are ended with an error.
    ``drain_delay``: seconds before that drain during which ``/health`` already answers 503
    "draining" but requests are still taken and served, so that a load balancer's health check sees
    the instance leave before its connections are refused (0: the drain starts at once).
    ``request_read_timeout``: seconds a connection has to send a whole request (head and body)
    once it is open or its previous answer ended; closed beyond (the handler of a body that stalls
    sees the client leave).
    ``keep_alive``: seconds an idle connection is kept open between requests (uvicorn's
    ``timeout_keep_alive``); longer than the idle timeouts of the proxies in front (their
    connections to the server are reused until then: one the server closed first fails a request
    with 502), see docs/serving.md.
    ``sse_heartbeat_s``: a stream that has sent nothing for this long (queued, or a long prompt's
    prefill) gets an SSE comment, so that a proxy's read timeout does not end it (None: never).
    ``health_recheck_s``: while experts are bad (a read failed), how often their blobs are looked
    at again (replaced on disk: re-opened) and their records verified (clean: healed).
    """

    default_max_tokens: int = 16          # /v1/completions default, as OpenAI's
    default_chat_max_tokens: int = 128
    max_tokens_limit: int = 512
    max_context: int | None = None
    max_body_bytes: int | None = None     # None: default_body_limit of the served context
    predictor: str = "lookahead"
    default_temperature: float = 0.0      # greedy unless a request asks otherwise (as mlx_lm.server)
    max_batch: int = 32
    max_queue: int = 64
    request_timeout: float | None = 600.0
    prefill_chunk: int | None = None
    prompt_cache_size: int = 8
    prompt_cache_min_tokens: int = 16
    prompt_cache_bytes: int = 256 << 20
    mlx_cache_bytes: int | None = 512 << 20
    joint_prefill: bool = False
    allow_origins: tuple[str, ...] = field(default_factory=tuple)
    access_log: bool = True
    api_key: str | None = field(default=None, repr=False)
    max_header_bytes: int = 16 * 1024
    shutdown_grace: float = 5.0
    drain_delay: float = 0.0
    health_recheck_s: float = 2.0
    request_read_timeout: float = 30.0
    keep_alive: float = 75.0             # beyond nginx's upstream keepalive_timeout and AWS ALB's idle timeout
    sse_heartbeat_s: float | None = 15.0

    def __post_init__(self) -> None:
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError(f"ServeSettings.prefill_chunk must be at least 1 or None, got {self.prefill_chunk}")
        for name in ("default_max_tokens", "default_chat_max_tokens", "max_tokens_limit", "max_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServeSettings.{name} must be at least 1, got {getattr(self, name)}")
        if self.max_body_bytes is not None and self.max_body_bytes < 1:
            raise ValueError(f"ServeSettings.max_body_bytes must be at least 1 or None, got {self.max_body_bytes}")
        for name in ("max_queue", "prompt_cache_size", "prompt_cache_min_tokens", "prompt_cache_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"ServeSettings.{name} must be at least 0, got {getattr(self, name)}")
        if self.mlx_cache_bytes is not None and self.mlx_cache_bytes < 0:
            raise ValueError(f"ServeSettings.mlx_cache_bytes must be >= 0 or None, got {self.mlx_cache_bytes}")
        if self.max_context is not None and self.max_context < 2:
            raise ValueError(f"ServeSettings.max_context must be at least 2, got {self.max_context}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"ServeSettings.request_timeout must be positive or None, got {self.request_timeout}")
        if self.api_key is not None and (not self.api_key or not self.api_key.isprintable()
                                         or any(c.isspace() for c in self.api_key)):
            raise ValueError("ServeSettings.api_key must be a non-empty string of printable characters without spaces")
        if self.max_header_bytes < 1024:
            raise ValueError(f"ServeSettings.max_header_bytes must be at least 1024, got {self.max_header_bytes}")
        if not 0 < self.request_read_timeout < float("inf"):
            raise ValueError(f"ServeSettings.request_read_timeout must be positive seconds, got "
                             f"{self.request_read_timeout}")
        if not 0 <= self.keep_alive < float("inf"):
            raise ValueError(f"ServeSettings.keep_alive must be >= 0 seconds, got {self.keep_alive}")
        if self.sse_heartbeat_s is not None and not 0 < self.sse_heartbeat_s < float("inf"):
            raise ValueError(f"ServeSettings.sse_heartbeat_s must be positive seconds or None, got "
                             f"{self.sse_heartbeat_s}")
        if not self.health_recheck_s > 0:
            raise ValueError(f"ServeSettings.health_recheck_s must be positive, got {self.health_recheck_s}")
        if not self.shutdown_grace >= 0:
            raise ValueError(f"ServeSettings.shutdown_grace must be >= 0 seconds, got {self.shutdown_grace}")
        if not 0 <= self.drain_delay < float("inf"):
            raise ValueError(f"ServeSettings.drain_delay must be >= 0 seconds, got {self.drain_delay}")
        if not 0.0 <= self.default_temperature <= 2.0:
            raise ValueError(f"ServeSettings.default_temperature must be in [0, 2], got {self.default_temperature}")


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    """The server settings an argument namespace asks for."""
    d = ServeSettings()
    return ServeSettings(
        max_tokens_limit=getattr(args, "max_tokens_limit", d.max_tokens_limit),
        predictor=args.predictor,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        prefill_chunk=args.prefill_chunk,
        prompt_cache_size=args.prompt_cache_size,
        prompt_cache_bytes=getattr(args, "prompt_cache_bytes", d.prompt_cache_bytes),
        mlx_cache_bytes=getattr(args, "mlx_cache_bytes", d.mlx_cache_bytes),
        joint_prefill=getattr(args, "joint_prefill", d.joint_prefill),
        request_timeout=getattr(args, "request_timeout", d.request_timeout),
        default_temperature=getattr(args, "temp", d.default_temperature),
        allow_origins=tuple(getattr(args, "allow_origin", ()) or ()),
        access_log=getattr(args, "access_log", d.access_log),
        api_key=api_key_from_env(getattr(args, "api_key", None)),
        shutdown_grace=getattr(args, "shutdown_grace", d.shutdown_grace),
        drain_delay=getattr(args, "drain_delay", d.drain_delay),
        keep_alive=getattr(args, "keep_alive", d.keep_alive),
        max_body_bytes=getattr(args, "max_request_bytes", d.max_body_bytes),
    )


#: the least request body limit the default allows, whatever the context
MIN_BODY_LIMIT = 1 << 20
#: the most the default allows, whatever the context: about a million token ids of up to six digits
MAX_BODY_LIMIT = 8 << 20
#: room in a request body beside its prompt (the other fields, a chat's roles and markup)
BODY_ROOM = 64 << 10


def default_body_limit(context: int | None, vocab_size: int | None) -> int:
    """The request body limit (bytes) when none is set: room for a prompt of ``context`` token ids
    as JSON (each id's digits, a comma and a space, as ``json.dumps`` writes them) beside the
    rest of the request, within [:data:`MIN_BODY_LIMIT`, :data:`MAX_BODY_LIMIT`]. A text prompt
    of as many tokens takes fewer bytes where its tokens average fewer bytes than an id's figure.

    The cap: each connection may make the server hold a body of the limit while it is read and
    parsed (and its ids as Python ints, several times its bytes, while the request lives), and a
    config may declare a context of millions of tokens that no prompt sent fills; an explicit
    limit (``--max-request-bytes``) is taken as given."""
    if context is None:
        return MIN_BODY_LIMIT
    digits = len(str(vocab_size - 1)) if vocab_size is not None and vocab_size > 1 else len(str(1 << 24))
    return min(MAX_BODY_LIMIT, max(MIN_BODY_LIMIT, context * (digits + 2) + BODY_ROOM))


API_KEY_ENV = "ASYNCSIDE_API_KEY"


def api_key_from_env(given: str | None) -> str | None:
    """The API key: ``given`` (``--api-key``) else $ASYNCSIDE_API_KEY, else None (no key)."""
    return given if given else (os.environ.get(API_KEY_ENV) or None)
