"""mlx-lm integration: pooled switch layers, async forward/generation, prediction, converter, embedded model.

Public API (see docs/models.md):

- :class:`StreamingModel` (``await sm(tokens, cache)`` -> logits, ``make_cache``, ``generate``: greedy
  async token stream over an :class:`ExpertSource`), :class:`ForwardOptions` / :class:`StepMode`
  (how decode steps run: queued, per-layer, whole),
  :func:`load_streaming_model` (from a converted store), :func:`streaming_from_model` (in memory);
- :class:`ExpertSource` (protocol), :class:`ResidentSource` (all-resident baseline);
  :class:`QueuedSource` (optional: misses served inside the stream, see queued.py);
  :class:`SpeculativeSource` / :class:`RowSnapshot` (optional: in-graph row gathers, see snapshot.py);
- :func:`convert_model`, :func:`profile_routing`, :func:`resident_sets` (converter);
- :func:`ensure_embedded_default` (the embedded default model, built on first use);
- :func:`reference_generate`, :func:`load_reference_model` (plain mlx-lm baseline);
- :class:`RoutingTrace`, :func:`belady`, :func:`replay_policy` (offline cache analysis).
"""

from __future__ import annotations

from ..snapshot import RowSnapshot, SpeculativeSource
from . import _mlx_lm  # noqa: F401  (before any module importing mlx-lm: see its docstring)
from .arch import ARCHS, UnsupportedModelError
from .convert import (
    DEFAULT_RESIDENT_FRACTION,
    convert_model,
    load_profile,
    profile_from_trace,
    profile_model_dir,
    profile_routing,
    resident_sets,
)
from .embedded import EmbeddedSpec, ensure_embedded_default
from .forward import STEP_MODES, AsyncForward, ForwardOptions, RowLookupError, StepMode, eval_completed
from .loading import load_reference_model, load_streaming_model, reference_generate, streaming_from_model
from .predict import PREDICTORS
from .queued import QueuedSource
from .source import ExpertSource, ResidentSource
from .streaming import StreamingModel, greedy
from .tokenizer import ByteTokenizer, load_tokenizer
from .trace import CacheResult, RoutingTrace, belady, replay_policy

SUPPORTED_MODEL_TYPES = tuple(sorted(ARCHS))

__all__ = [
    "DEFAULT_RESIDENT_FRACTION", "PREDICTORS", "STEP_MODES", "SUPPORTED_MODEL_TYPES", "AsyncForward", "ByteTokenizer",
    "CacheResult", "EmbeddedSpec", "ExpertSource", "ForwardOptions", "QueuedSource", "ResidentSource", "RoutingTrace",
    "RowLookupError", "RowSnapshot", "SpeculativeSource", "StepMode", "greedy",
    "StreamingModel", "UnsupportedModelError", "belady", "convert_model", "ensure_embedded_default",
    "eval_completed", "load_profile", "load_reference_model", "load_streaming_model", "load_tokenizer",
    "profile_from_trace", "profile_model_dir", "profile_routing", "reference_generate", "replay_policy",
    "resident_sets", "streaming_from_model",
]
