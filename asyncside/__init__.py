"""asyncside: stream Mixture-of-Experts expert weights from an SSD expert store into MLX pools."""

from __future__ import annotations

# Keep these imports cheap: no MLX, no native extension (store.py imports MLX lazily).
from .errors import AsyncsideError, CapacityError, FillError, LedgerError, StoreError
from .ledger import AuditReport, Fill, Ledger
from .policies import LFU, LRU, AgingLFU, OneShot, Policy, make_policy
from .store import ExpertStore, LayerSpec, Segment

__version__ = "0.1.0"

__all__ = [
    "LFU",
    "LRU",
    "AgingLFU",
    "AsyncsideError",
    "AuditReport",
    "Fill",
    "Ledger",
    "OneShot",
    "Policy",
    "make_policy",
    "CapacityError",
    "ExpertStore",
    "FillError",
    "LayerSpec",
    "LedgerError",
    "Segment",
    "StoreError",
    "__version__",
]
