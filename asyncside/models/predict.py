"""Expert prediction for prefetch: which experts will the next MoE layer route to?

Predictors are per generation (temporal keeps the previous token's ids). The forward asks for
the prediction of the next MoE layer as soon as the current layer's MoE input is built and hands
it to ``source.prefetch`` before it awaits the current layer's routing, so reads overlap compute.

- ``lookahead``: apply layer l+1's router (its MoE block's own routing code) to layer l's
  post-attention-normed hidden state. An approximation: the true input of layer l+1's router is
  ``post_attention_layernorm_{l+1}(h_l + moe_l + attn_{l+1})``; residual streams change slowly from
  layer to layer, so this usually names most of the true experts. The first MoE layer is predicted
  from the token embeddings through that layer's own post-attention norm. Predictions are lazy
  mx.arrays (the runtime awaits their completion itself).
- ``temporal``: the experts the previous token (the last position of the previous forward)
  routed to at layer l+1.
- ``none``: no prefetch; every miss is a demand read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

PREDICTORS = ("lookahead", "temporal", "none")


class Predictor:
    """Base: predicts nothing. ``name`` is the selector string."""

    name = "none"

    def first(self, layer: int, embeddings: mx.array) -> Any | None:
        """Prediction for the first MoE layer of a forward, from the token embeddings."""
        return None

    def next(self, layer: int, normed_hidden: mx.array) -> Any | None:
        """Prediction for MoE layer ``layer`` from the previous layer's post-attention normed state."""
        return None

    def observe(self, layer: int, ids: np.ndarray) -> None:
        """The ids layer ``layer`` actually routed in this forward (host array, (..., k))."""


class LookaheadPredictor(Predictor):
    name = "lookahead"

    def __init__(self, route: Callable[[int, mx.array], mx.array], first_norm: Callable[[int, mx.array], mx.array]):
        self._route = route
        self._first_norm = first_norm

    def first(self, layer: int, embeddings: mx.array) -> Any | None:
        return self._route(layer, self._first_norm(layer, embeddings))

    def next(self, layer: int, normed_hidden: mx.array) -> Any | None:
        return self._route(layer, normed_hidden)


class TemporalPredictor(Predictor):
    name = "temporal"

    def __init__(self) -> None:
        self._last: dict[int, np.ndarray] = {}

    def first(self, layer: int, embeddings: mx.array) -> Any | None:
        return self._last.get(layer)

    def next(self, layer: int, normed_hidden: mx.array) -> Any | None:
        return self._last.get(layer)

    def observe(self, layer: int, ids: np.ndarray) -> None:
        self._last[layer] = np.unique(ids.reshape(-1, ids.shape[-1])[-1])


def check_predictor(name: str) -> str:
    """Validate a predictor selector (ValueError naming the choices)."""
    if name not in PREDICTORS:
        raise ValueError(f"unknown predictor {name!r}; choose one of {list(PREDICTORS)}")
    return name
