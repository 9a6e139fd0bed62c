"""asyncside: stream Mixture-of-Experts expert weights from an SSD expert store into MLX pools.

The names below are imported on first use (PEP 562), so ``import asyncside`` (and the
``asyncside`` command's ``--help``) loads neither numpy nor MLX nor the native extension.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# The public API, name -> the module that defines it. docs/api.md lists the same names (a test
# checks both ways); everything else in the package is implementation.
_EXPORTS = {
    # the runtime and its accounts
    "Runtime": "runtime",
    "MemoryPlan": "runtime",
    "RuntimeStats": "runtime",
    "PrefetchHandle": "runtime",
    # the store
    "ExpertStore": "store",
    "LayerSpec": "store",
    "Segment": "store",
    # models
    "StreamingModel": "models",
    "ForwardOptions": "models",
    "load_streaming_model": "models",
    "convert_model": "models",
    "load": "facade",
    # routing traces and cache policies
    "RoutingTrace": "routing",
    "Policy": "policies",
    "make_policy": "policies",
    "LRU": "policies",
    "LFU": "policies",
    "LRFU": "policies",
    "AgingLFU": "policies",
    "OneShot": "policies",
    # the sans-I/O ledger
    "Ledger": "ledger",
    "Fill": "ledger",
    "AuditReport": "ledger",
    # errors
    "AsyncsideError": "errors",
    "StoreError": "errors",
    "LedgerError": "errors",
    "CapacityError": "errors",
    "FillError": "errors",
}

__all__ = [
    "AgingLFU",
    "AsyncsideError",
    "AuditReport",
    "CapacityError",
    "ExpertStore",
    "Fill",
    "FillError",
    "ForwardOptions",
    "LFU",
    "LRFU",
    "LRU",
    "LayerSpec",
    "Ledger",
    "LedgerError",
    "MemoryPlan",
    "OneShot",
    "Policy",
    "PrefetchHandle",
    "RoutingTrace",
    "Runtime",
    "RuntimeStats",
    "Segment",
    "StoreError",
    "StreamingModel",
    "__version__",
    "convert_model",
    "load",
    "load_streaming_model",
    "make_policy",
]

if TYPE_CHECKING:
    from .errors import AsyncsideError, CapacityError, FillError, LedgerError, StoreError
    from .facade import load
    from .ledger import AuditReport, Fill, Ledger
    from .models import ForwardOptions, StreamingModel, convert_model, load_streaming_model
    from .policies import LFU, LRFU, LRU, AgingLFU, OneShot, Policy, make_policy
    from .routing import RoutingTrace
    from .runtime import MemoryPlan, PrefetchHandle, Runtime, RuntimeStats
    from .store import ExpertStore, LayerSpec, Segment


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f".{module}", __name__), name)
    elif not name.startswith("__"):
        try:  # a submodule, as `import asyncside; asyncside.runtime` found it when it was eager
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'asyncside' has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module 'asyncside' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
