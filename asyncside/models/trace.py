"""Routing traces and offline cache analysis (ledger policies vs Belady's MIN).

A :class:`RoutingTrace` records, per forward step and MoE layer, the routed expert ids of every
token and the ids the predictor proposed for that layer. From it:

- :func:`belady` computes the best possible hit rate of a side region of ``side_rows`` rows over
  the same demand sequence (Belady's MIN with bypass, generalised to set requests: after each step
  keep the ``side_rows`` non-resident experts whose next use is soonest);
- :func:`replay_policy` replays the demands (and optionally the recorded predictions, as
  prefetches that complete before the demand) through :class:`asyncside.ledger.Ledger` with a
  given eviction policy;
- :meth:`RoutingTrace.prediction_quality` measures the predictor (precision/recall per layer).

The unit of demand is one forward step of one layer: the set of distinct experts it routed (what
``ensure`` sees). Resident experts always hit and are excluded from the side-region counts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

TRACE_FORMAT = "asyncside-routing-trace"


@dataclass
class LayerStep:
    """One MoE layer in one forward step: routed ids (tokens, k), the prediction (unique ids), and
    the prediction per token ((tokens, k'), when the predictor named ids per token, as the lookahead
    and the trace predictor do; None otherwise)."""

    ids: np.ndarray
    predicted: np.ndarray | None
    predicted_tokens: np.ndarray | None = None

    @property
    def demand(self) -> np.ndarray:
        return np.unique(self.ids)


@dataclass
class TraceStep:
    predictor: str
    layers: dict[int, LayerStep] = field(default_factory=dict)

    def record(self, layer: int, ids: np.ndarray, predicted: np.ndarray | None) -> None:
        """Record ``layer``'s routed ids (..., k) and what the predictor named for it beforehand (host
        array; kept per token when it has one row of ids per routed token)."""
        ids = np.asarray(ids)
        k = ids.shape[-1] if ids.ndim else 1
        rows = ids.reshape(-1, k).astype(np.int64)
        pred = per_token = None
        if predicted is not None:
            p = np.asarray(predicted).astype(np.int64)
            pred = np.unique(p)
            if p.ndim >= 2 and p.size and p.size // p.shape[-1] == rows.shape[0]:
                per_token = p.reshape(rows.shape[0], -1)
        self.layers[layer] = LayerStep(rows, pred, per_token)


class RoutingTrace:
    """Routing of a run: a list of forward steps, each layer's ids and predictions."""

    def __init__(self) -> None:
        self.steps: list[TraceStep] = []

    def begin(self, predictor: str) -> TraceStep:
        step = TraceStep(predictor)
        self.steps.append(step)
        return step

    @property
    def layers(self) -> list[int]:
        out: set[int] = set()
        for s in self.steps:
            out.update(s.layers)
        return sorted(out)

    def demands(self, layer: int) -> list[np.ndarray]:
        """Distinct experts routed at ``layer``, one array per forward step."""
        return [s.layers[layer].demand for s in self.steps if layer in s.layers]

    def predictions(self, layer: int) -> list[np.ndarray | None]:
        return [s.layers[layer].predicted for s in self.steps if layer in s.layers]

    def token_ids(self, layer: int) -> np.ndarray:
        """All routed ids of ``layer`` in token order, shape (tokens, k)."""
        return np.concatenate([s.layers[layer].ids for s in self.steps if layer in s.layers])

    def counts(self, n_experts: int) -> dict[int, list[int]]:
        """Per layer, how many times each expert was routed (a routing profile)."""
        return {l: np.bincount(self.token_ids(l).reshape(-1), minlength=n_experts).tolist() for l in self.layers}

    def prediction_quality(self) -> dict[int, dict[str, float]]:
        """Per layer: precision (predicted that were used) and recall (used that were predicted)."""
        out: dict[int, dict[str, float]] = {}
        for l in self.layers:
            tp = n_pred = n_used = 0
            steps = 0
            for d, p in zip(self.demands(l), self.predictions(l)):
                if p is None:
                    continue
                steps += 1
                tp += len(np.intersect1d(d, p))
                n_pred += len(p)
                n_used += len(d)
            out[l] = {
                "steps": steps,
                "precision": tp / n_pred if n_pred else float("nan"),
                "recall": tp / n_used if n_used else float("nan"),
            }
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "format": TRACE_FORMAT,
            "version": 1,
            "steps": [
                {
                    "predictor": s.predictor,
                    "layers": {
                        str(l): {"ids": ls.ids.tolist(),
                                 "predicted": None if ls.predicted is None else ls.predicted.tolist()}
                        for l, ls in s.layers.items()
                    },
                }
                for s in self.steps
            ],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RoutingTrace:
        if data.get("format") != TRACE_FORMAT or data.get("version") != 1:
            raise ValueError(f"not a version-1 {TRACE_FORMAT} document (format={data.get('format')!r})")
        tr = cls()
        for s in data["steps"]:
            step = tr.begin(s["predictor"])
            for l, ls in s["layers"].items():
                pred = ls["predicted"]
                step.record(int(l), np.asarray(ls["ids"], dtype=np.int64), None if pred is None else np.asarray(pred))
        return tr

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_json(), fh)

    def to_file_trace(self, n_experts: int, meta: Mapping[str, Any] | None = None) -> Any:
        """This recording as an :class:`asyncside.routing.RoutingTrace` (one sequence, the ``.npz``
        format of docs/routing-traces.md): ids ``(tokens, MoE layers, k)`` in token order, and
        ``predicted`` ``(tokens, MoE layers, k')`` when every step recorded a per-token prediction
        of every layer (per-layer steps with the lookahead or the trace predictor);
        ``meta["predictions"]`` says which predictor, or why there are none.

        Every layer must have routed the same tokens (a recorded generation does: a recording
        step routes every layer). ``meta`` is stored beside ``"source": "recorded"``.
        """
        from ..routing import RoutingTrace as FileTrace

        layers = self.layers
        if not layers:
            raise ValueError("the recording has no routed step")
        per_layer = [self.token_ids(layer) for layer in layers]
        shapes = {a.shape for a in per_layer}
        if len(shapes) != 1:
            raise ValueError(f"layers routed different token counts: {dict(zip(layers, [a.shape for a in per_layer]))}")
        ids = np.stack(per_layer, axis=1).astype(np.int32)
        info = {**dict(meta or {}), "source": "recorded", "layers": layers}
        predicted, info["predictions"] = self._file_predictions(layers)
        return FileTrace(ids, np.array([ids.shape[0]], dtype=np.int64), int(n_experts), info, predicted)

    def _file_predictions(self, layers: list[int]) -> tuple[np.ndarray | None, str]:
        """The per-token predictions as a (tokens, layers, k') array, and what ``meta["predictions"]``
        says of them: the predictor's name, or why the file has none (a step without per-token
        predictions of every layer, e.g. a queued step, which does not run the predictor)."""
        names = sorted({s.predictor for s in self.steps if s.layers})
        cols = []
        for layer in layers:
            parts = [s.layers[layer].predicted_tokens for s in self.steps if layer in s.layers]
            if any(p is None for p in parts):
                missing = sum(1 for p in parts if p is None)
                return None, (f"none: {missing} of {len(parts)} steps of layer {layer} have no per-token "
                              f"prediction (predictor {'/'.join(names)})")
            cols.append(np.concatenate([p for p in parts if p is not None]))
        widths = {c.shape[1] for c in cols}
        if len(widths) != 1:
            return None, f"none: layers predicted different numbers of ids per token {sorted(widths)}"
        return np.stack(cols, axis=1).astype(np.int32), f"per token, predictor {'/'.join(names)}"


@dataclass
class CacheResult:
    """Hit/miss counts of one layer (or summed over layers) under one policy."""

    accesses: int = 0       # distinct experts demanded, summed over steps
    resident_hits: int = 0  # of those, resident
    side_hits: int = 0      # present in the side region when demanded
    misses: int = 0         # demand reads
    prefetch_reads: int = 0  # reads issued by predictions (replay only)

    @property
    def hit_rate(self) -> float:
        return (self.resident_hits + self.side_hits) / self.accesses if self.accesses else float("nan")

    @property
    def side_hit_rate(self) -> float:
        side = self.accesses - self.resident_hits
        return self.side_hits / side if side else float("nan")

    def __add__(self, other: CacheResult) -> CacheResult:
        return CacheResult(*(a + b for a, b in zip(self.astuple(), other.astuple())))

    def astuple(self) -> tuple[int, ...]:
        return (self.accesses, self.resident_hits, self.side_hits, self.misses, self.prefetch_reads)

    def as_dict(self) -> dict[str, Any]:
        return {
            "accesses": self.accesses, "resident_hits": self.resident_hits, "side_hits": self.side_hits,
            "misses": self.misses, "prefetch_reads": self.prefetch_reads,
            "hit_rate": self.hit_rate, "side_hit_rate": self.side_hit_rate,
        }


def belady(demands: Sequence[Iterable[int]], resident: Iterable[int], side_rows: int,
           initial: Iterable[int] = ()) -> CacheResult:
    """Belady's MIN (with bypass) over set requests: the fewest demand reads any policy can do.

    ``initial``: what the ``side_rows`` hold before the first request (a runtime that warms its
    rows at start is bounded by MIN from the same contents, not from empty rows)."""
    res = set(int(r) for r in resident)
    reqs = [set(int(e) for e in d) - res for d in demands]
    # next_use[t][e]: the first step after t that demands e (absent: never again)
    never = len(reqs) + 1
    next_use: list[dict[int, int]] = [{} for _ in reqs]
    upcoming: dict[int, int] = {}
    for t in range(len(reqs) - 1, -1, -1):
        next_use[t] = dict(upcoming)
        for e in reqs[t]:
            upcoming[e] = t
    out = CacheResult()
    cache: set[int] = set(int(e) for e in initial) - res
    for t, (d, req) in enumerate(zip(demands, reqs)):
        n = len(set(int(e) for e in d))
        out.accesses += n
        out.resident_hits += n - len(req)
        out.side_hits += len(req & cache)
        out.misses += len(req - cache)
        nu = next_use[t]
        keep = sorted(cache | req, key=lambda e: (nu.get(e, never), e))[: max(side_rows, 0)]
        cache = {e for e in keep if e in nu}  # an expert never used again is worth nothing
    return out


def replay_policy(demands: Sequence[Iterable[int]], n_experts: int, resident: Sequence[int], side_rows: int,
                  policy: str = "lfu", predictions: Sequence[Iterable[int] | None] | None = None,
                  ledger_factory: Callable[..., Any] | None = None) -> CacheResult:
    """Replay demand steps through a Ledger (reads complete instantly), counting hits and reads.

    With ``predictions`` (one per step, None for none), each step first reserves the prediction
    (``demand=False``, as a prefetch that finished before the demand), then the demand.
    """
    from ..errors import CapacityError

    if ledger_factory is None:
        from ..ledger import Ledger

        ledger_factory = Ledger

    led = ledger_factory(n_experts, list(resident), side_rows, policy=policy)
    res = set(int(r) for r in resident)
    out = CacheResult()
    for t, d in enumerate(demands):
        ids = np.unique(np.asarray(list(d) if not isinstance(d, np.ndarray) else d, dtype=np.int64))
        predicted = predictions[t] if predictions is not None else None
        if predicted is not None:
            pred = np.unique(np.asarray(list(predicted), dtype=np.int64))
            for f in led.reserve(pred, demand=False):
                led.publish(f)
                out.prefetch_reads += 1
        table = led.lookup()
        present = table[ids] >= 0
        n_res = sum(1 for e in ids.tolist() if e in res)
        out.accesses += len(ids)
        out.resident_hits += n_res
        out.side_hits += int(present.sum()) - n_res
        groups = [ids]
        while groups:
            g = groups.pop(0)
            try:
                fills = led.reserve(g, demand=True)
            except CapacityError:
                half = len(g) // 2
                groups[:0] = [g[:half], g[half:]]
                continue
            for f in fills:
                led.publish(f)
                out.misses += 1
    return out
