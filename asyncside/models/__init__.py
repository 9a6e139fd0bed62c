"""mlx-lm integration: pooled switch layers, async forward/generation, prediction, converter, embedded model."""

from __future__ import annotations

from .forward import AsyncForward, StreamingModel, eval_completed
from .loading import load_reference_model, load_streaming_model, reference_generate, streaming_from_model
from .source import ExpertSource, ResidentSource
from .trace import RoutingTrace, belady, replay_policy

__all__ = [
    "AsyncForward", "ExpertSource", "ResidentSource", "RoutingTrace", "StreamingModel", "belady",
    "eval_completed", "load_reference_model", "load_streaming_model", "reference_generate",
    "replay_policy", "streaming_from_model",
]
