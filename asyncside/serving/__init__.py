"""`asyncside serve`: an OpenAI-compatible HTTP server over one streaming model and one runtime.

Modules, in the order a request meets them:

- :mod:`.cli` -- the command's arguments and entry point (imports nothing heavy);
- :mod:`.settings` -- :class:`ServeSettings`, the limits and defaults of one server;
- :mod:`.app` -- the Starlette application: routes, the life of one request, access log;
- :mod:`.streaming` -- reading bodies, watching for clients that leave, server-sent events;
- :mod:`.protocol` -- OpenAI request parsing and response shapes (pure functions);
- :mod:`.security` -- the API key, the header bound, host paths kept out of client answers;
- :mod:`.loading` -- :func:`open_engine` (a converted model and its Runtime), :class:`Engine`;
- :mod:`.engine` -- the engine loop: continuous batching over the model (:class:`Batcher`), with
  a pluggable step strategy (a pipeline of ranks plugs its own);
- :mod:`.requests` -- one request inside the engine, and the caller's :class:`Generation`;
- :mod:`.batch_caches` -- the decoding requests' KV caches kept merged across steps;
- :mod:`.health` -- bad experts of the store: recorded, reported, re-opened, healed;
- :mod:`.sampling` -- per-request sampling as mlx-lm samples, seeded per request;
- :mod:`.prompt_cache` -- KV-cache reuse for prompts that share a prefix;
- :mod:`.text` -- token ids to text deltas, stop sequences, tool calls;
- :mod:`.metrics` -- the Prometheus registry and the server's metrics;
- :mod:`.background` -- ``serve()`` on the running loop and :class:`BackgroundServer`.

The names below are importable from ``asyncside.serving``; each is loaded with its module on
first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "create_app": ".app",
    "ServerState": ".app",
    "ServeSettings": ".settings",
    "Engine": ".loading",
    "Batcher": ".engine",
    "StepStrategy": ".engine",
    "BatchedSteps": ".engine",
    "Generation": ".requests",
    "GenerationFailed": ".requests",
    "QueueFull": ".requests",
    "BatchCaches": ".batch_caches",
    "rows_step": ".batch_caches",
    "default_prefill_chunk": ".engine",
    "open_engine": ".loading",
    "embedded_store_dir": ".loading",
    "HealthRegistry": ".health",
    "BackgroundServer": ".background",
    "ServeError": ".background",
    "bind_socket": ".background",
    "serve": ".background",
    "add_model_arguments": ".cli",
    "add_engine_arguments": ".cli",
    "add_serve_arguments": ".cli",
    "app_from_args": ".cli",
    "engine_factory_from_args": ".cli",
    "serve_main": ".cli",
    "settings_from_args": ".cli",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncside.serving' has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
