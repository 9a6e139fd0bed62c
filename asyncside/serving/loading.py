"""Loading what the server serves: a converted model and the Runtime it streams experts from.

:class:`Engine` is what the application enters at startup (the model, its expert source, views of
the runtime for ``/health`` and ``/metrics``, the store's health registry); :func:`open_engine`
builds one from a directory written by ``asyncside convert``. :class:`ServedModel` is what the
engine loop needs from a model.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..policies import DEFAULT_POLICY

if TYPE_CHECKING:
    from ..routing import RoutingTrace


class ServedModel(Protocol):
    """What the engine needs from a model (:class:`asyncside.models.StreamingModel` provides it).

    ``forward`` is an :class:`~asyncside.models.forward.AsyncForward` or alike, stepped as ``ctx =
    forward.context(cache, source, predictor)``, ``await forward.step(ctx, inputs, head=draw)``
    (``draw(logits)``, lazy, scheduled with the step) and ``await forward.finish(ctx, y)`` (await
    it: decode steps), prefill
    chunks as ``await forward.step(ctx, inputs (1, L), logits=False, finish=False)`` and later
    ``finish(ctx, hidden)``; with ``completed`` (await an array's computation) and
    ``make_predictor(name)``.
    """

    model_id: str
    tokenizer: Any
    config: dict[str, Any]

    @property
    def forward(self) -> Any: ...

    def make_cache(self) -> list[Any]: ...


def text_config_value(model: Any, key: str) -> Any:
    """``key`` of the model's config (``model.config``), read in its text model's section where
    the config nests one (llama4's ``text_config`` holds the vocabulary and the context); None
    where neither has it."""
    config = getattr(model, "config", None) or {}
    inner = config.get("text_config")
    for scope in (inner if isinstance(inner, Mapping) else {}, config):
        if scope.get(key) is not None:
            return scope[key]
    return None


@dataclass
class Engine:
    """What the server serves: a model, the expert source it streams from, and runtime views."""

    model: ServedModel
    source: Any
    stats: Callable[[], Mapping[str, Any]] | None = None
    audit: Callable[[], tuple[bool, list[str]]] | None = None
    description: dict[str, Any] = field(default_factory=dict)
    #: an engine loop of its own (a :class:`Batcher` subclass); None: the app builds a Batcher
    batcher: Any = None
    #: the store's bad experts (:class:`~.health.HealthRegistry`); None: the app keeps one without a store
    health: Any = None
    #: routing replay of every request (a :class:`~asyncside.models.forcing.RoutingReplay`; request n
    #: replays sequence n mod S of its trace, see :class:`~.engine.Batcher`); None: the router routes
    routing: Any = None


def embedded_store_dir(cache_dir: str | None = None) -> str:
    """The embedded default model's expert store directory, built on first use."""
    from ..models.embedded import ensure_embedded_default

    return str(ensure_embedded_default(cache_dir)[1])


def _routing_description(replay: Any, source: str) -> dict[str, Any]:
    """The engine's description of its routing replay: the trace's file name only (/health shows
    it to any client), its tokens and sequences, its shape, and, where it was mapped onto the
    model's (a trace of another model), the shape it came from and a note saying so."""
    described = replay.describe()
    out = {"file": os.path.basename(source), "tokens": replay.n_tokens,
           "sequences": replay.fitted.n_sequences, "source_shape": described["source_shape"],
           "mapped_from": described["mapped_from"],
           "note": replay.fit_note() if described["mapped_from"] is not None else None}
    return out


@contextlib.asynccontextmanager
async def open_engine(
    model: str | None = None,
    *,
    resident: float | str = 0.25,
    reader: str = "auto",
    policy: str = DEFAULT_POLICY,
    cache_dir: str | None = None,
    host_tier: int | str = "auto",
    memory: int | str | None = None,
    routing: str | os.PathLike[str] | RoutingTrace | None = None,
    routing_source: str | None = None,
) -> AsyncIterator[Engine]:
    """Load a converted model (the embedded default when ``model`` is None) and open its Runtime.

    ``model`` is a directory written by ``asyncside convert`` (expert store + non-expert weights
    + config + tokenizer). Runs on the serving loop: the Runtime's reap task and completion
    bridge belong to that loop. Loading is synchronous and happens before the server accepts
    connections, so it blocks nothing that is waiting. ``host_tier`` goes to the Runtime (MLX
    CUDA: pinned host memory for records faulted in, see :class:`~asyncside.runtime.Runtime`);
    ``memory``, the budget the Runtime plans against (``resident="auto"`` sizes the pools to it);
    ``routing``, a routing trace every request replays (docs/routing-traces.md): a file, or a
    :class:`~asyncside.routing.RoutingTrace` already read from one (a pipe reads once: `serve
    --routing <(...)` hands the engine what it read); ``routing_source``, the file a trace in
    memory was read from (its name is what messages and the description show).
    """
    from ..audit import audit_problems
    from ..errors import StoreError
    from ..models import load_streaming_model
    from ..runtime import Runtime
    from .health import HealthRegistry

    store_dir = model if model is not None else embedded_store_dir(cache_dir)
    streaming = load_streaming_model(store_dir)
    if streaming.tokenizer is None:
        # Before the runtime starts: every request would otherwise fail with an internal error.
        raise StoreError(store_dir, "holds no tokenizer files (tokenizer.json, tokenizer_config.json, "
                         "tokenizer.model or asyncside_tokenizer.json): the server encodes prompts and decodes "
                         "tokens with them; convert a model directory that has them")
    store = streaming.store
    replay = None
    source = os.fspath(routing) if isinstance(routing, (str, os.PathLike)) else routing_source or "<in memory>"
    if routing is not None:
        # Fitted to the model as a generation's replay is; the engine replays it row by row, so
        # the model itself keeps no batch-1 replay.
        replay = streaming.set_routing(routing, source=source)
        streaming.set_routing(None)

    def audit() -> tuple[bool, list[str]]:
        problems = audit_problems(runtime)
        return not problems, problems

    async with Runtime(store, resident=resident, reader=reader, policy=policy, host_tier=host_tier,
                       memory=memory) as runtime:
        health = HealthRegistry(store, reopen_reader=runtime.reopen_blob)
        yield Engine(
            model=streaming,
            source=runtime,
            stats=runtime.stats,
            audit=audit,
            description={
                "model": str(store_dir),
                "layers": len(store.layers),
                "resident": resident,
                "reader": runtime.reader,
                "policy": policy,
                "host_tier_bytes": runtime.memory.get("host_tier_bytes", 0),
                "staging_bytes": runtime.memory.get("staging_bytes", 0),
                "memory_budget": memory,
                "plan": runtime.plan.describe() if runtime.plan is not None else None,
                # The trace's file name only: /health shows the description to any client.
                "routing": None if replay is None else _routing_description(replay, source),
            },
            health=health,
            routing=replay,
        )

