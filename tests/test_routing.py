"""asyncside.routing: the trace format, its refusals, map_to, and the synthetic presets' locality."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from asyncside.errors import StoreError, TraceError
from asyncside.models.trace import belady, replay_policy
from asyncside.routing import LOCALITIES, RoutingTrace, preset, synthetic


def small(seed: int = 0, tokens: int = 40, sequences: int = 3) -> RoutingTrace:
    return synthetic(tokens=tokens, n_layers=3, n_experts=16, top_k=4, skew=0.8, overlap=0.5, layer_corr=0.3,
                     sequences=sequences, seed=seed)


def write_npz(path: Path, **fields: object) -> Path:
    with open(path, "wb") as fh:
        np.savez(fh, **fields)  # type: ignore[arg-type]
    return path


def good_fields() -> dict[str, object]:
    tr = small()
    return {"ids": tr.ids, "lengths": tr.lengths, "n_experts": np.int64(16),
            "meta": np.array(json.dumps({"format": "asyncside-routing-trace-npz", "version": 1,
                                         "source": "synthetic"}))}


def test_round_trip(tmp_path: Path) -> None:
    tr = small()
    tr.save(tmp_path / "t.npz")
    back = RoutingTrace.load(tmp_path / "t.npz")
    assert back.ids.dtype == np.int32 and back.lengths.dtype == np.int64
    np.testing.assert_array_equal(back.ids, tr.ids)
    np.testing.assert_array_equal(back.lengths, tr.lengths)
    assert back.n_experts == 16 and back.meta == tr.meta
    assert back.meta["source"] == "synthetic" and back.meta["generator"]["overlap"] == 0.5
    assert (back.n_tokens, back.n_layers, back.top_k, back.n_sequences) == (40, 3, 4, 3)


def test_fields_are_read_only() -> None:
    tr = small()
    with pytest.raises(ValueError):
        tr.ids[0, 0, 0] = 1
    with pytest.raises(AttributeError):
        tr.n_experts = 3  # type: ignore[misc]


def test_sequences() -> None:
    tr = small(tokens=10, sequences=3)
    assert tr.lengths.tolist() == [4, 3, 3]
    np.testing.assert_array_equal(tr.sequence(1), tr.ids[4:7])
    assert tr.sequence(2).shape == (3, 3, 4)
    with pytest.raises(IndexError, match="sequence 3"):
        tr.sequence(3)


@pytest.mark.parametrize(
    "change, field, message",
    [
        ({"ids": "drop"}, "ids", "missing"),
        ({"n_experts": "drop"}, "n_experts", "missing"),
        ({"n_experts": np.int64(3)}, "ids", "top_k 4 exceeds n_experts 3"),
        ({"n_experts": np.float64(16)}, "n_experts", "integer scalar"),
        ({"lengths": np.array([40, 1])}, "lengths", "sum to 41"),
        ({"lengths": np.array([41, -1])}, "lengths", "at least one token"),
        ({"meta": np.array("{not json")}, "meta", "not JSON"),
        ({"meta": np.array(json.dumps({"format": "other", "version": 1}))}, "meta.format", "expected"),
        ({"meta": np.array(json.dumps({"format": "asyncside-routing-trace-npz", "version": 9}))},
         "meta.version", "version 1"),
    ],
)
def test_load_refuses(tmp_path: Path, change: dict[str, object], field: str, message: str) -> None:
    fields = good_fields()
    for k, v in change.items():
        if isinstance(v, str) and v == "drop":
            del fields[k]
        else:
            fields[k] = v
    path = write_npz(tmp_path / "bad.npz", **fields)
    with pytest.raises(TraceError, match=message) as info:
        RoutingTrace.load(path)
    assert info.value.field == field and info.value.path == str(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, StoreError)


def test_load_refuses_out_of_range_and_duplicate_ids(tmp_path: Path) -> None:
    fields = good_fields()
    ids = np.array(fields["ids"])
    ids[5, 1, 2] = 16
    path = write_npz(tmp_path / "range.npz", **{**fields, "ids": ids})
    with pytest.raises(TraceError, match=r"expert id 16 at token 5, layer 1, slot 2 is outside \[0, 16\)") as info:
        RoutingTrace.load(path)
    assert info.value.field == "ids"
    ids = np.array(fields["ids"])
    ids[7, 2, 0] = -1
    with pytest.raises(TraceError, match="expert id -1 at token 7"):
        RoutingTrace.load(write_npz(tmp_path / "neg.npz", **{**fields, "ids": ids}))
    ids = np.array(fields["ids"])
    ids[9, 0, 3] = ids[9, 0, 1]
    with pytest.raises(TraceError, match="token 9, layer 0 lists an expert twice") as info:
        RoutingTrace.load(write_npz(tmp_path / "dup.npz", **{**fields, "ids": ids}))
    assert info.value.field == "ids"
    with pytest.raises(TraceError, match="dtype float"):
        RoutingTrace.load(write_npz(tmp_path / "f.npz", **{**fields, "ids": ids.astype(np.float32)}))
    with pytest.raises(TraceError, match=r"shape \(40, 12\)"):
        RoutingTrace.load(write_npz(tmp_path / "2d.npz", **{**fields, "ids": ids.reshape(40, 12)}))


def test_load_refuses_missing_and_garbage_files(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such file"):
        RoutingTrace.load(tmp_path / "absent.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip at all")
    with pytest.raises(TraceError, match="expected an .npz archive") as info:
        RoutingTrace.load(tmp_path / "junk.npz")
    assert info.value.path.endswith("junk.npz")


def test_constructor_validates() -> None:
    tr = small()
    with pytest.raises(TraceError, match="n_experts"):
        RoutingTrace(tr.ids, tr.lengths, 0, {})
    with pytest.raises(TraceError, match="lists an expert twice"):
        RoutingTrace(np.array([[[1, 1]]]), np.array([1]), 4, {})
    with pytest.raises(TraceError, match="JSON-able"):
        RoutingTrace(tr.ids, tr.lengths, 16, {"x": object()})


def test_map_to_layers_cyclic_and_top_k_truncated() -> None:
    tr = small()
    m = tr.map_to(7, 16, 2)
    assert (m.n_layers, m.n_experts, m.top_k) == (7, 16, 2)
    perm = np.random.default_rng(0).permutation(16)
    for i in range(7):
        np.testing.assert_array_equal(m.ids[:, i, :], perm[tr.ids[:, i % 3, :2]])
    assert m.meta["mapped_from"] == {"n_layers": 3, "n_experts": 16, "top_k": 4}
    with pytest.raises(ValueError, match="top_k 5 exceeds the trace's top_k 4"):
        tr.map_to(3, 16, 5)
    with pytest.raises(ValueError, match="n_layers must be a positive int"):
        tr.map_to(0, 16, 4)


def test_map_to_more_experts_is_injective() -> None:
    tr = small()
    m = tr.map_to(3, 100, 4)
    assert m.ids.max() < 100
    pairs = set(zip(tr.ids.reshape(-1).tolist(), m.ids.reshape(-1).tolist()))
    assert len({a for a, _ in pairs}) == len(pairs) == len({b for _, b in pairs})  # a bijection on used ids


def test_map_to_fewer_experts_keeps_ids_distinct() -> None:
    tr = small()
    m = tr.map_to(3, 5, 4)  # 16 experts folded onto 5: many collisions within a token
    assert m.ids.min() >= 0 and m.ids.max() < 5
    s = np.sort(m.ids, axis=2)
    assert not (s[:, :, 1:] == s[:, :, :-1]).any()
    assert np.array_equal(m.ids, tr.map_to(3, 5, 4).ids)  # deterministic


def test_synthetic_is_seeded_and_validated() -> None:
    a, b, c = small(seed=1), small(seed=1), small(seed=2)
    assert np.array_equal(a.ids, b.ids) and not np.array_equal(a.ids, c.ids)
    with pytest.raises(ValueError, match="overlap must be in"):
        synthetic(tokens=4, n_layers=1, n_experts=4, top_k=2, skew=0, overlap=1.5, layer_corr=0)
    with pytest.raises(ValueError, match="top_k 5 exceeds n_experts 4"):
        synthetic(tokens=4, n_layers=1, n_experts=4, top_k=5, skew=0, overlap=0, layer_corr=0)
    with pytest.raises(ValueError, match="unknown locality preset"):
        preset("extreme")


def test_synthetic_overlap_and_layer_correlation_do_what_they_say() -> None:
    kw: dict[str, Any] = {"tokens": 300, "n_layers": 2, "n_experts": 32, "top_k": 4, "skew": 0.0}
    full = synthetic(**kw, overlap=1.0, layer_corr=0.0)
    # overlap 1: every token reuses the previous token's experts (within a sequence)
    assert all(set(full.ids[t, 0]) == set(full.ids[t - 1, 0]) for t in range(1, 300))
    none = synthetic(**kw, overlap=0.0, layer_corr=0.0)
    same = np.mean([len(set(none.ids[t, 0]) & set(none.ids[t - 1, 0])) for t in range(1, 300)])
    assert same < 1.0  # uniform draws share about k*k/n = 0.5 experts
    corr = synthetic(**kw, overlap=0.0, layer_corr=1.0)
    # layer_corr 1: layer 1's slots are a fixed permutation of layer 0's
    mapping: dict[int, int] = {}
    for a, b in zip(corr.ids[:, 0].reshape(-1).tolist(), corr.ids[:, 1].reshape(-1).tolist()):
        assert mapping.setdefault(a, b) == b


def lru_and_min(tr: RoutingTrace, fraction: float) -> tuple[float, float]:
    rows = int(tr.n_experts * fraction)
    lru = [replay_policy(tr.layer_steps(l), tr.n_experts, [], rows, policy="lru") for l in range(tr.n_layers)]
    opt = [belady(tr.layer_steps(l), [], rows) for l in range(tr.n_layers)]
    return (sum(r.side_hits for r in lru) / sum(r.accesses for r in lru),
            sum(r.side_hits for r in opt) / sum(r.accesses for r in opt))


def test_presets_span_the_locality_range() -> None:
    """Calibrated as docs/routing-traces.md says: low like recorded text, high > 90% LRU hits at 25%."""
    assert set(LOCALITIES) == {"low", "middle", "high"}
    low_lru, low_min = lru_and_min(preset("low"), 0.25)
    assert 0.24 <= low_lru <= 0.31 and 0.50 <= low_min <= 0.59, (low_lru, low_min)
    mid_lru, mid_min = lru_and_min(preset("middle", tokens=1024), 0.25)
    assert 0.45 <= mid_lru <= 0.80 and mid_min > mid_lru, (mid_lru, mid_min)
    high_lru, high_min = lru_and_min(preset("high", tokens=1024), 0.25)
    assert high_lru > 0.90 and high_min >= high_lru, (high_lru, high_min)


@pytest.mark.parametrize(("name", "digest"), [
    ("low", "4b99798cb2d0a0a2"), ("middle", "2bac51b4f6abdfeb"), ("high", "87afd3d48b814bfd")])
def test_a_presets_ids_for_a_seed_stay_what_they_were(name: str, digest: str) -> None:
    """The benchmarks name their traces by preset and seed: a change to the generator's code (its
    draws made faster) must not change the ids or predictions a seed gives."""
    import hashlib

    t = preset(name, tokens=400, n_layers=3, n_experts=32, top_k=4, seed=5, prediction_precision=0.6)
    assert t.predicted is not None
    assert hashlib.sha256(t.ids.tobytes() + t.predicted.tobytes()).hexdigest()[:16] == digest
    # a top-k near the experts: many redraws of taken experts
    tight = preset("low", tokens=200, n_layers=2, n_experts=8, top_k=7, seed=1)
    assert hashlib.sha256(tight.ids.tobytes()).hexdigest()[:16] == "4958238914eebe63"
