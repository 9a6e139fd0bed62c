"""asyncside: stream Mixture-of-Experts expert weights from an SSD expert store into MLX pools.

The names below are imported on first use (PEP 562), so ``import asyncside`` (and the
``asyncside`` command's ``--help``) loads neither numpy nor MLX nor the native extension.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> the module that defines it
_EXPORTS = {
    "AsyncsideError": "errors",
    "CapacityError": "errors",
    "FillError": "errors",
    "LedgerError": "errors",
    "StoreError": "errors",
    "AuditReport": "ledger",
    "Fill": "ledger",
    "Ledger": "ledger",
    "LFU": "policies",
    "LRU": "policies",
    "LRFU": "policies",
    "AgingLFU": "policies",
    "OneShot": "policies",
    "Policy": "policies",
    "make_policy": "policies",
    "ExpertStore": "store",
    "LayerSpec": "store",
    "Segment": "store",
}

__all__ = [
    "LFU",
    "LRU",
    "LRFU",
    "AgingLFU",
    "AsyncsideError",
    "AuditReport",
    "CapacityError",
    "ExpertStore",
    "Fill",
    "FillError",
    "LayerSpec",
    "Ledger",
    "LedgerError",
    "OneShot",
    "Policy",
    "Segment",
    "StoreError",
    "__version__",
    "make_policy",
]

if TYPE_CHECKING:
    from .errors import AsyncsideError, CapacityError, FillError, LedgerError, StoreError
    from .ledger import AuditReport, Fill, Ledger
    from .policies import LFU, LRU, AgingLFU, OneShot, Policy, make_policy
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
