"""Predictions in routing traces, the ``trace`` predictor, and precision / recall counting.

A trace's optional ``predicted`` array (saved, loaded, mapped like the ids, generated with a set
precision); the recorder writes what the lookahead returned; under replay the ``trace`` predictor
names the file's predictions; :func:`count_prediction` counts distinct ids per (token, layer).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import anyio
import mlx.core as mx
import numpy as np
import pytest

from asyncside.bridge import completed
from asyncside.errors import TraceError
from asyncside.models import ForwardOptions
from asyncside.models.forcing import RoutingReplay, RoutingReplayError
from asyncside.models.forward import StepMode
from asyncside.models.loading import streaming_from_model
from asyncside.models.predict import (
    PREDICTION_COUNTERS,
    PredictionQuality,
    Predictor,
    TracePredictor,
    choose_predictor,
    count_prediction,
)
from asyncside.models.source import ResidentSource
from asyncside.models.trace import RoutingTrace as Recorder
from asyncside.routing import RoutingTrace, preset, synthetic

from _models_support import tiny_model

PROMPT = 20  # a prefill chunk (per layer, long enough to be scheduled block by block), then decode steps
NEW_TOKENS = 5


def _hit_fraction(predicted: np.ndarray, ids: np.ndarray) -> float:
    """Share of predicted slots whose id the same (token, layer) routed."""
    return float((predicted[..., :, None] == ids[..., None, :]).any(-1).mean())


# -- counting --------------------------------------------------------------------------------------

def test_count_prediction_per_token_by_hand() -> None:
    counters: dict[str, int] = {}
    # Two tokens, k = 3 routed, k' = 2 predicted: token 0 predicted {1, 5}, routed {1, 2, 3} -> 1 hit;
    # token 1 predicted {7, 7} (one distinct id), routed {7, 8, 9} -> 1 hit.
    count_prediction(counters, np.array([[[1, 5], [7, 7]]]), np.array([[[1, 2, 3], [7, 8, 9]]]))
    q = PredictionQuality.from_counters(counters)
    assert (q.token_layers, q.predicted, q.routed, q.hits) == (2, 3, 6, 2)
    assert q.precision == pytest.approx(2 / 3) and q.recall == pytest.approx(2 / 6)
    # A second layer adds; ``before`` takes one generation's share.
    before = dict(counters)
    count_prediction(counters, np.array([[4, 2]]), np.array([[2, 4]]))
    assert PredictionQuality.from_counters(counters, before).as_dict() == {
        "token_layers": 1, "predicted": 2, "routed": 2, "hits": 2, "precision": 1.0, "recall": 1.0}
    assert sorted(counters) == sorted(PREDICTION_COUNTERS)


def test_count_prediction_of_a_set_uses_the_steps_union() -> None:
    counters: dict[str, int] = {}
    # A temporal-style prediction, one set for a step of two tokens: {1, 2, 9} vs routed {1, 2, 3, 4}.
    count_prediction(counters, np.array([9, 1, 2]), np.array([[1, 2], [3, 4]]))
    q = PredictionQuality.from_counters(counters)
    assert (q.token_layers, q.predicted, q.routed, q.hits) == (2, 3, 4, 2)
    assert PredictionQuality().precision is None and PredictionQuality().recall is None
    assert PredictionQuality().describe() == "no prediction counted"


def test_a_predictor_that_predicted_nothing_is_described_not_crashed() -> None:
    # Pairs counted with no id predicted (a predictor returning an empty set): precision undefined.
    counters: dict[str, int] = {}
    count_prediction(counters, np.array([], dtype=np.int64), np.array([[1, 2], [3, 4]]))
    q = PredictionQuality.from_counters(counters)
    assert (q.token_layers, q.predicted, q.routed, q.hits) == (2, 0, 4, 0)
    assert q.describe() == "precision n/a, recall 0.0% over 2 token-layers (0 of 0 predicted ids routed, of 4 routed)"


# -- the file format -------------------------------------------------------------------------------

@pytest.mark.parametrize("precision", [0.0, 0.35, 0.8, 1.0])
def test_synthetic_prediction_precision_lands_within_tolerance(precision: float) -> None:
    kw: dict[str, Any] = dict(tokens=3000, n_layers=4, n_experts=64, top_k=6, skew=0.7, overlap=0.4,
                              layer_corr=0.3, seed=11)
    tr = synthetic(**kw, prediction_precision=precision)
    assert tr.predicted is not None and tr.predicted.shape == tr.ids.shape
    # 72,000 slots, each a hit with probability p: one standard deviation is under 0.002.
    assert _hit_fraction(tr.predicted, tr.ids) == pytest.approx(precision, abs=0.01)
    counters: dict[str, int] = {}
    count_prediction(counters, tr.predicted, tr.ids)
    q = PredictionQuality.from_counters(counters)
    assert q.precision == pytest.approx(precision, abs=0.01) and q.recall == pytest.approx(precision, abs=0.01)
    # The ids are those of the same seed without predictions; the parameter is recorded.
    np.testing.assert_array_equal(tr.ids, synthetic(**kw).ids)
    assert synthetic(**kw).predicted is None
    assert tr.meta["generator"]["prediction_precision"] == precision


def test_synthetic_predictions_with_few_other_experts_stay_distinct() -> None:
    # 5 experts, top-4: one other expert per token, so at most one slot can be wrong.
    tr = synthetic(tokens=200, n_layers=2, n_experts=5, top_k=4, skew=0, overlap=0, layer_corr=0,
                   prediction_precision=0.0)
    assert tr.predicted is not None
    assert _hit_fraction(tr.predicted, tr.ids) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="prediction_precision"):
        synthetic(tokens=4, n_layers=1, n_experts=4, top_k=2, skew=0, overlap=0, layer_corr=0,
                  prediction_precision=1.5)


def test_predictions_round_trip_and_old_files_load(tmp_path: pathlib.Path) -> None:
    tr = preset("middle", tokens=50, n_layers=3, n_experts=16, top_k=4, sequences=2, prediction_precision=0.6)
    tr.save(tmp_path / "p.npz")
    back = RoutingTrace.load(tmp_path / "p.npz")
    assert back.predicted is not None and tr.predicted is not None and back.predicted.dtype == np.int32
    np.testing.assert_array_equal(back.predicted, tr.predicted)
    np.testing.assert_array_equal(back.sequence_predicted(1), tr.predicted[25:])
    # A file without the array (every file written before it existed) loads with none.
    plain = RoutingTrace(tr.ids, tr.lengths, tr.n_experts, tr.meta)
    plain.save(tmp_path / "old.npz")
    with np.load(tmp_path / "old.npz") as z:
        assert "predicted" not in z.files
    old = RoutingTrace.load(tmp_path / "old.npz")
    assert old.predicted is None and old.sequence_predicted(0) is None


@pytest.mark.parametrize("bad, message", [
    (np.zeros((50, 2, 4), np.int32), "shape"),
    (np.full((50, 3, 2), 16, np.int32), "outside"),
    (np.zeros((50, 3, 2), np.int32), "predicts an expert twice"),
    (np.zeros((50, 3, 2), np.float32), "integer"),
])
def test_bad_predictions_are_refused_naming_the_field(tmp_path: pathlib.Path, bad: np.ndarray, message: str) -> None:
    tr = preset("low", tokens=50, n_layers=3, n_experts=16, top_k=4)
    with open(tmp_path / "bad.npz", "wb") as fh:
        meta = json.dumps({"format": "asyncside-routing-trace-npz", "version": 1, "source": "synthetic"})
        np.savez(fh, ids=tr.ids, lengths=tr.lengths, n_experts=np.int64(16), meta=np.array(meta), predicted=bad)
    with pytest.raises(TraceError, match=message) as info:
        RoutingTrace.load(tmp_path / "bad.npz")
    assert info.value.field == "predicted" and "bad.npz" in str(info.value)


@pytest.mark.parametrize("shape", [(5, 64, 4), (2, 8, 2)])
def test_map_to_maps_predictions_like_ids(shape: tuple[int, int, int]) -> None:
    tr = synthetic(tokens=300, n_layers=3, n_experts=16, top_k=4, skew=0.5, overlap=0.3, layer_corr=0.2,
                   prediction_precision=0.5, seed=4)
    assert tr.predicted is not None
    n_layers, n_experts, top_k = shape
    m = tr.map_to(n_layers, n_experts, top_k)
    assert m.predicted is not None
    assert m.predicted.shape == (300, n_layers, max(1, 4 - (4 - top_k)))
    if n_experts >= tr.n_experts:
        # Injective: a predicted id maps where the same id maps as a routed one, layer by layer.
        layers = np.arange(n_layers) % 3
        src_pred, src_ids = tr.predicted[:, layers, :top_k], tr.ids[:, layers, :]
        hit_src = (src_pred[..., :, None] == src_ids[..., None, :]).any(-1)
        hit_dst = (m.predicted[..., :, None] == tr.map_to(n_layers, n_experts, 4).ids[..., None, :]).any(-1)
        np.testing.assert_array_equal(hit_src, hit_dst)
    else:  # folded: still distinct and in range (construction validates both)
        assert int(m.predicted.max()) < n_experts


# -- predictors in a model -------------------------------------------------------------------------

class Spy(Predictor):
    """The lookahead, keeping what it returned for each layer, in order."""

    name = "lookahead"

    def __init__(self, inner: Predictor) -> None:
        self.inner = inner
        self.returned: dict[int, list[Any]] = {}

    def _keep(self, layer: int, p: Any) -> Any:
        self.returned.setdefault(layer, []).append(p)
        return p

    def first(self, layer: int, embeddings: mx.array) -> Any | None:
        return self._keep(layer, self.inner.first(layer, embeddings))

    def next(self, layer: int, normed_hidden: mx.array) -> Any | None:
        return self._keep(layer, self.inner.next(layer, normed_hidden))


def _model() -> tuple[Any, dict[int, dict[str, mx.array]], list[int]]:
    model, config = tiny_model("qwen3_moe")
    sm, pools = streaming_from_model(model, config, completed=completed,
                                     options=ForwardOptions(mode=StepMode.PER_LAYER))
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, config["vocab_size"], PROMPT)]
    return sm, pools, prompt


def _generate(sm: Any, pools: Any, prompt: list[int], predictor: str, trace: Recorder) -> list[int]:
    async def main() -> list[int]:
        src = ResidentSource(pools)
        return [t async for t in sm.generate(prompt, max_tokens=NEW_TOKENS, source=src, predictor=predictor,
                                             trace=trace, stop_at_eos=False)]

    return anyio.run(main)


def test_recorder_writes_what_the_lookahead_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    sm, pools, prompt = _model()
    fwd = sm.forward
    spy = Spy(fwd.make_predictor("lookahead"))
    monkeypatch.setattr(fwd, "make_predictor", lambda name: spy)
    rec = Recorder()
    before = dict(fwd.counters)
    tokens = _generate(sm, pools, prompt, "lookahead", rec)
    assert len(tokens) == NEW_TOKENS
    file = rec.to_file_trace(16, {"model": "tiny"})
    assert file.predicted is not None and file.meta["predictions"] == "per token, predictor lookahead"
    assert file.predicted.shape == (PROMPT + NEW_TOKENS - 1, 2, 4)
    for j, layer in enumerate(sm.moe_layers):
        returned = np.concatenate([np.array(p).reshape(-1, 4) for p in spy.returned[layer]])
        np.testing.assert_array_equal(file.predicted[:, j], returned)
    # The counters counted the same predictions against the same routing.
    expect: dict[str, int] = {}
    count_prediction(expect, file.predicted, file.ids)
    got = PredictionQuality.from_counters(fwd.counters, before)
    assert got == PredictionQuality.from_counters(expect)
    assert got.token_layers == file.n_tokens * 2 and got.precision is not None and 0 < got.precision < 1


def test_trace_predictor_names_the_files_predictions(tmp_path: pathlib.Path) -> None:
    sm, pools, prompt = _model()
    tr = synthetic(tokens=PROMPT + NEW_TOKENS + 7, n_layers=2, n_experts=16, top_k=4, skew=0.3, overlap=0.2,
                   layer_corr=0.1, prediction_precision=0.5, seed=8)
    assert tr.predicted is not None
    tr.save(tmp_path / "t.npz")
    replay = sm.set_routing(tmp_path / "t.npz")
    assert replay is not None and replay.fitted is replay.trace  # the model's own shape: replayed as is
    # Directly: positions 5..7 of each MoE layer.
    p = TracePredictor()
    p.begin(replay, 5)
    x = mx.zeros((1, 3, 8))
    for j, layer in enumerate(sm.moe_layers):
        np.testing.assert_array_equal(np.asarray(p.next(layer, x))[0], tr.predicted[5:8, j])
    # In a generation: what was predicted (recorded beside the routing) is the file's, and the
    # counted precision is the file's own over those positions.
    rec = Recorder()
    before = dict(sm.forward.counters)
    _generate(sm, pools, prompt, "trace", rec)
    file = rec.to_file_trace(16)
    n = file.n_tokens
    assert file.predicted is not None and file.meta["predictions"] == "per token, predictor trace"
    np.testing.assert_array_equal(file.ids, tr.ids[:n])
    np.testing.assert_array_equal(file.predicted, tr.predicted[:n])
    expect: dict[str, int] = {}
    count_prediction(expect, tr.predicted[:n], tr.ids[:n])
    assert PredictionQuality.from_counters(sm.forward.counters, before) == PredictionQuality.from_counters(expect)


def test_choose_predictor_under_replay(tmp_path: pathlib.Path) -> None:
    sm, _pools, _prompt = _model()
    assert choose_predictor(None, None) == ("lookahead", None)
    with pytest.raises(RoutingReplayError, match="routing trace"):
        choose_predictor("trace", None)
    with_pred = synthetic(tokens=30, n_layers=2, n_experts=16, top_k=4, skew=0.3, overlap=0.2, layer_corr=0.1,
                          prediction_precision=0.9)
    replay = RoutingReplay.for_model(with_pred, sm.model, sm._moe, 16)
    name, note = choose_predictor(None, replay)
    assert name == "trace" and note is not None
    name, note = choose_predictor("lookahead", replay)
    assert name == "lookahead" and note is not None and "not meaningful" in note
    plain = RoutingReplay.for_model(RoutingTrace(with_pred.ids, with_pred.lengths, 16, {}), sm.model, sm._moe, 16,
                                    source="plain.npz")
    name, note = choose_predictor(None, plain)
    assert name == "temporal" and note is not None and "not be meaningful" in note
    with pytest.raises(RoutingReplayError, match="plain.npz carries no predictions"):
        choose_predictor("trace", plain)


def test_demo_records_predictions_and_replays_them(tmp_path: pathlib.Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """`demo --record-routing` (mode auto) runs per layer and writes the lookahead's predictions; `demo
    --routing` of that file takes the trace predictor by default, and its precision is the recording's
    (the same routing, the same predictions) over the layers both counted."""
    from asyncside.bench import generate as bench
    from asyncside.cli import main
    from asyncside.models.embedded import ensure_embedded_default

    store = str(ensure_embedded_default(tmp_path / "embedded", spec=bench._quick_spec(), progress=False)[1])
    rec = tmp_path / "recorded.npz"
    base = ["demo", "--model", store, "--tokens", "6", "--json", "--resident", "0.25"]
    capsys.readouterr()
    assert main([*base, "--record-routing", str(rec)]) == 0
    recorded = json.loads(capsys.readouterr().out)
    assert recorded["predictor"] == "lookahead" and recorded["decode_steps"] == "per-layer"
    assert any("--record-routing" in n for n in recorded["predictor_notes"])
    trace = RoutingTrace.load(rec)
    assert trace.predicted is not None and trace.meta["predictions"] == "per token, predictor lookahead"
    q = recorded["prediction"]
    assert q["token_layers"] == trace.n_tokens * trace.n_layers
    expect: dict[str, int] = {}
    count_prediction(expect, trace.predicted, trace.ids)
    assert q == PredictionQuality.from_counters(expect).as_dict()  # the file holds what was counted

    assert main([*base, "--routing", str(rec), "--mode", "per-layer"]) == 0
    replayed = json.loads(capsys.readouterr().out)
    assert replayed["predictor"] == "trace" and replayed["tokens_identical"] is True
    assert replayed["text"] == recorded["text"]
    # Without recording, a prefill chunk stops before the last decoder layer: all but its tokens there.
    last = trace.n_layers - 1
    n_prefill = recorded["prompt_tokens"] - 1
    expect = {}
    count_prediction(expect, trace.predicted[:, :last], trace.ids[:, :last])
    count_prediction(expect, trace.predicted[n_prefill:, last], trace.ids[n_prefill:, last])
    assert replayed["prediction"] == PredictionQuality.from_counters(expect).as_dict()
