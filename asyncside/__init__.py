"""asyncside: stream Mixture-of-Experts expert weights from an SSD expert store into MLX pools."""

from __future__ import annotations

__version__ = "0.1.0"
