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
- ``trace``: under routing replay, the predictions the replayed trace carries (its ``predicted``
  array: what a predictor named for layer l at position t before the routing was known), so a
  replayed trace's prefetch figures are those of the predictor that recorded it (or of a
  synthetic precision). The lookahead is not meaningful under replay: the router it runs on the
  hidden state knows nothing of the replayed ids (:func:`choose_predictor` says so).
- ``none``: no prefetch; every miss is a demand read.

Precision and recall: :func:`count_prediction` counts one MoE layer's prediction against the ids
that layer then routed into a counters dict (the forward's ``counters``), and
:class:`PredictionQuality` reads the figures back: precision = predicted ids the layer then routed
/ predicted ids, recall = routed ids that were predicted / routed ids, each counted as distinct
ids per (token, layer), over the MoE layers and tokens that had a prediction.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
import numpy as np

from .forcing import RoutingReplayError

PREDICTORS = ("lookahead", "temporal", "trace", "none")

#: the forward counters :func:`count_prediction` adds to (see :class:`PredictionQuality`)
PREDICTION_COUNTERS = ("prediction_token_layers", "prediction_ids", "prediction_routed", "prediction_hits")


def _distinct_rows(a: np.ndarray) -> np.ndarray:
    """``a`` (rows, k) sorted per row, each repeated id replaced by -1."""
    s = np.sort(a.astype(np.int64), axis=1)
    dup = np.zeros(s.shape, dtype=np.bool_)
    dup[:, 1:] = s[:, 1:] == s[:, :-1]
    return np.where(dup, -1, s)


def count_prediction(counters: MutableMapping[str, int], predicted: Any, routed: Any) -> None:
    """Count one MoE layer's prediction against the ids the layer then routed (host arrays).

    ``routed``: (..., k), one row of k ids per token. ``predicted``: (..., k') with one row per
    token as well (the lookahead, the trace predictor), compared token by token; or any other
    shape (a set for the whole step, as the temporal predictor names), compared with the union of
    the step's routed ids, once. Adds to ``counters``' :data:`PREDICTION_COUNTERS`: the tokens
    counted (``prediction_token_layers``), the distinct predicted ids, the distinct routed ids, and
    the predicted ids that were routed, each per (token, layer).
    """
    r = np.asarray(routed)
    r = r.reshape(-1, r.shape[-1] if r.ndim else 1)
    p = np.asarray(predicted)
    if p.ndim >= 2 and p.size and p.size // p.shape[-1] == r.shape[0]:
        pr = _distinct_rows(p.reshape(r.shape[0], -1))
        rr = _distinct_rows(r)
        hits = int(((pr[:, :, None] == rr[:, None, :]) & (pr[:, :, None] >= 0)).sum())
        n_pred, n_routed = int((pr >= 0).sum()), int((rr >= 0).sum())
    else:
        ps, rs = np.unique(p.astype(np.int64)), np.unique(r.astype(np.int64))
        hits = int(np.intersect1d(ps, rs).size)
        n_pred, n_routed = int(ps.size), int(rs.size)
    for key, n in zip(PREDICTION_COUNTERS, (r.shape[0], n_pred, n_routed, hits)):
        counters[key] = counters.get(key, 0) + n


@dataclass(frozen=True)
class PredictionQuality:
    """A predictor's precision and recall over the (token, MoE layer) pairs it predicted.

    ``token_layers``: the pairs counted; ``predicted`` / ``routed``: their distinct predicted /
    routed ids; ``hits``: predicted ids the layer then routed. Precision and recall are None when
    nothing was counted (a predictor that never ran, e.g. ``none``, or steps that do not predict).
    """

    token_layers: int = 0
    predicted: int = 0
    routed: int = 0
    hits: int = 0

    @property
    def precision(self) -> float | None:
        """Predicted ids the layer then routed / predicted ids."""
        return self.hits / self.predicted if self.predicted else None

    @property
    def recall(self) -> float | None:
        """Routed ids that were predicted / routed ids."""
        return self.hits / self.routed if self.routed else None

    @classmethod
    def from_counters(cls, counters: Mapping[str, Any], before: Mapping[str, Any] | None = None) -> PredictionQuality:
        """The figures in a forward's ``counters`` (minus those of ``before``: one generation's)."""
        b = before or {}
        token_layers, predicted, routed, hits = (int(counters.get(k, 0)) - int(b.get(k, 0))
                                                 for k in PREDICTION_COUNTERS)
        return cls(token_layers, predicted, routed, hits)

    def as_dict(self) -> dict[str, Any]:
        """Every figure (JSON-able)."""
        return {"token_layers": self.token_layers, "predicted": self.predicted, "routed": self.routed,
                "hits": self.hits, "precision": self.precision, "recall": self.recall}

    def describe(self) -> str:
        """One line: precision, recall and what they were counted over."""
        if not self.token_layers:
            return "no prediction counted"
        # A predictor may predict nothing for the pairs it was asked about (precision undefined).
        def pct(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.1%}"

        return (f"precision {pct(self.precision)}, recall {pct(self.recall)} over {self.token_layers} token-layers "
                f"({self.hits} of {self.predicted} predicted ids routed, of {self.routed} routed)")


class Predictor:
    """Base: predicts nothing. ``name`` is the selector string."""

    name = "none"

    def begin(self, routing: Any, position: int) -> None:
        """A step starts: its routing replay (None: the router routes) and its first token's position."""

    def first(self, layer: int, embeddings: mx.array) -> Any | None:
        """Prediction for the first MoE layer of a forward, from the token embeddings."""
        return None

    def next(self, layer: int, normed_hidden: mx.array) -> Any | None:
        """Prediction for MoE layer ``layer`` from the previous layer's post-attention normed state."""
        return None

    def observe(self, layer: int, ids: np.ndarray) -> None:
        """The ids layer ``layer`` actually routed in this forward (host array, (..., k))."""


def replay_predictions(routing: Any) -> np.ndarray | None:
    """The predictions a routing replay's fitted trace carries for its sequence, (T, MoE layers, k')
    (None: the trace has none, or no replay)."""
    if routing is None:
        return None
    rows = getattr(routing, "rows", None)  # a batched replay: its rows' replays alike
    if rows:
        routing = rows[0][0]
    fitted = getattr(routing, "fitted", None)
    if fitted is None or getattr(fitted, "predicted", None) is None:
        return None
    return cast(np.ndarray, fitted.sequence_predicted(getattr(routing, "sequence", 0)))


class TracePredictor(Predictor):
    """Under routing replay, the replayed trace's own predictions: layer l at position t is the
    fitted trace's ``predicted[t, l]`` (positions wrap past the end as the replayed ids do)."""

    name = "trace"

    def __init__(self) -> None:
        self._rows: list[tuple[np.ndarray, list[int], int]] = []

    def begin(self, routing: Any, position: int) -> None:
        if routing is None:
            raise RoutingReplayError("predictor 'trace' predicts from a replayed routing trace: set one "
                                     "(--routing FILE, StreamingModel.set_routing) or choose another predictor")
        # A batched replay (RowsReplay) has a replay and a position per row; a plain one is one row.
        rows = getattr(routing, "rows", None) or [(routing, 0)]
        self._rows = []
        for replay, start in rows:
            pred = replay_predictions(replay)
            if pred is None:
                raise RoutingReplayError(f"predictor 'trace': the routing trace {getattr(replay, 'source', '')} "
                                         "carries no predictions (no 'predicted' array); choose another predictor")
            self._rows.append((pred, list(replay.moe_layers), int(start) + position))

    def _at(self, layer: int, x: mx.array) -> np.ndarray:
        if not self._rows:
            raise RoutingReplayError("predictor 'trace' asked before a step began (no routing replay)")
        n = int(x.shape[-2]) if x.ndim >= 2 else 1
        out = []
        for pred, layers, start in self._rows:
            pos = np.arange(start, start + n, dtype=np.int64) % pred.shape[0]
            out.append(pred[pos, layers.index(layer), :])
        return np.stack(out).astype(np.int64)

    def first(self, layer: int, embeddings: mx.array) -> Any | None:
        return self._at(layer, embeddings)

    def next(self, layer: int, normed_hidden: mx.array) -> Any | None:
        return self._at(layer, normed_hidden)


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


def choose_predictor(asked: str | None, routing: Any) -> tuple[str, str | None]:
    """The predictor a generation uses, and a note to print about it (None: nothing to say).

    ``asked``: the selector given (None: the default); ``routing``: the routing replay in force
    (:class:`asyncside.models.forcing.RoutingReplay`, None without). Without replay the default is
    ``lookahead``. Under replay it is ``trace`` when the trace carries predictions, else
    ``temporal`` (which learns from the replayed ids): the lookahead runs the model's router on the
    hidden state, which knows nothing of the replayed ids, so its figures would not be meaningful
    (asking for it anyway gets it, with that note). ``trace`` without predictions to replay is a
    :class:`~asyncside.models.forcing.RoutingReplayError`.
    """
    if asked is not None:
        check_predictor(asked)
    has = replay_predictions(routing) is not None
    if asked == "trace" and not has:
        TracePredictor().begin(routing, 0)  # raises, saying what is missing
    if routing is None:
        return asked or "lookahead", None
    if asked is None:
        if has:
            return "trace", "routing replay: predictor 'trace' (the predictions the trace carries)"
        return "temporal", ("routing replay: the trace carries no predictions, and the lookahead (the model's "
                            "router on the hidden state) knows nothing of the replayed ids, so its prefetch figures "
                            "would not be meaningful; predictor: temporal (the previous token's experts)")
    if asked == "lookahead":
        return asked, ("routing replay: the lookahead runs the model's router on the hidden state, which knows "
                       "nothing of the replayed ids: its prefetch, precision and recall are not meaningful"
                       + ("; the trace carries predictions (--predictor trace)" if has else ""))
    return asked, None
