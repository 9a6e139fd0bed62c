"""asyncside: stream Mixture-of-Experts expert weights from an SSD expert store into MLX pools."""

from __future__ import annotations

# Keep these imports cheap: no MLX, no native extension (store.py imports MLX lazily).
from .errors import AsyncsideError, CapacityError, FillError, LedgerError, StoreError
from .store import ExpertStore, LayerSpec, Segment

__version__ = "0.1.0"

__all__ = [
    "AsyncsideError",
    "CapacityError",
    "ExpertStore",
    "FillError",
    "LayerSpec",
    "LedgerError",
    "Segment",
    "StoreError",
    "__version__",
]
