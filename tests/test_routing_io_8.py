"""Reading routing traces: `serve --routing` reads a pipe once, `routing info` on long traces, and
a zip bomb in a trace file refused before it is inflated."""

from __future__ import annotations

import argparse
import os
import pathlib
from typing import Any

import numpy as np
import pytest

from asyncside.routing import RoutingTrace, preset


@pytest.fixture(scope="module")
def quick_store(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from asyncside.bench import generate as bench
    from asyncside.models.embedded import ensure_embedded_default

    cache = tmp_path_factory.mktemp("embedded")
    return ensure_embedded_default(cache, spec=bench._quick_spec(), progress=False)[1]


def test_serve_replays_a_trace_from_a_pipe(quick_store: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve --routing <(cat t.npz)` read the pipe to check it, then the engine opened it again and
    found it empty ("a pipe such as <(...) reads once"): the command now reads the trace once and
    hands the engine what it read. Through the CLI's own argument handling and the real engine;
    only the HTTP server is left out."""
    from asyncside.cli import build_parser
    from asyncside.serving import cli as serve_cli

    trace = preset("high", tokens=20, n_layers=2, n_experts=32, top_k=4, sequences=2)
    seen: dict[str, Any] = {}

    async def no_server(args: argparse.Namespace) -> None:
        async with serve_cli.engine_factory_from_args(args)() as engine:
            seen.update(engine.description["routing"])
            seen["replay"] = engine.routing

    monkeypatch.setattr(serve_cli, "run_serve", no_server)
    monkeypatch.setattr(serve_cli, "bound_malloc", lambda: False)
    r, w = os.pipe()
    try:
        data = _saved(trace)
        assert len(data) < 16 << 10  # fits the pipe's buffer: written whole before it is read
        os.write(w, data)
        os.close(w)
        w = -1
        args = build_parser().parse_args(["serve", "--model", str(quick_store), "--resident", "0.5",
                                          "--routing", f"/dev/fd/{r}"])
        assert serve_cli.serve_main(args) == 0
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    assert seen["file"] == str(r) and seen["tokens"] == 10 and seen["sequences"] == 2
    assert np.array_equal(seen["replay"].fitted.ids, trace.ids) and seen["replay"].source == f"/dev/fd/{r}"


def _saved(trace: RoutingTrace) -> bytes:
    """The bytes of ``trace`` saved as a file."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = pathlib.Path(d) / "t.npz"
        trace.save(path)
        return path.read_bytes()


# -- routing info: LRU and MIN hit rates vectorised, the same figures as the walks they replaced --


def _reference_lru_miss_curve(demands: list[list[int]], n_experts: int) -> np.ndarray:
    """The stack walk ``policy_replay.lru_miss_curve`` was before it was vectorised (one list
    operation per access: about a minute for `routing info` on 100k tokens x 8 layers)."""
    stack: list[int] = []
    hist = np.zeros(n_experts + 1, dtype=np.int64)
    accesses = 0
    for d in demands:
        req = sorted({int(e) for e in d})
        for e in req:
            accesses += 1
            if e in stack:
                hist[stack.index(e)] += 1
        stack = req + [e for e in stack if e not in req]
    hits = np.concatenate([[0], np.cumsum(hist)[:n_experts]])
    return np.asarray(accesses - hits, dtype=np.int64)


def _reference_min_hits(trace: RoutingTrace, rows: int) -> int:
    """MIN with bypass layer by layer, as `routing info` computed it before."""
    from asyncside.models.trace import belady

    return sum(belady(trace.layer_steps(layer), (), rows).side_hits for layer in range(trace.n_layers))


_SMALL = [
    dict(name="low", tokens=300, n_layers=3, n_experts=16, top_k=4, sequences=2, seed=1),
    dict(name="middle", tokens=257, n_layers=2, n_experts=32, top_k=6, sequences=1, seed=2),
    dict(name="high", tokens=200, n_layers=4, n_experts=8, top_k=2, sequences=3, seed=3),
    dict(name="high", tokens=50, n_layers=1, n_experts=5, top_k=5, sequences=1, seed=4),
    dict(name="low", tokens=1, n_layers=2, n_experts=4, top_k=1, sequences=1, seed=5),
]


@pytest.mark.parametrize("spec", _SMALL, ids=lambda s: f"{s['name']}-{s['n_experts']}x{s['top_k']}")
def test_vectorised_hit_rates_equal_the_reference(spec: dict[str, Any]) -> None:
    from asyncside.policy_replay import lru_miss_curve, trace_min_hits, trace_miss_curves

    spec = dict(spec)
    trace = preset(spec.pop("name"), **spec)
    curves = trace_miss_curves(trace)
    for layer in range(trace.n_layers):
        ref = _reference_lru_miss_curve(trace.ids[:, layer, :].tolist(), trace.n_experts)
        assert np.array_equal(curves[layer], ref)
        assert np.array_equal(lru_miss_curve(trace.layer_steps(layer), trace.n_experts), ref)
    sizes = [0, 1, trace.top_k, trace.n_experts // 2, trace.n_experts, trace.n_experts + 3]
    assert trace_min_hits(trace, sizes) == [_reference_min_hits(trace, r) for r in sizes]


def test_lru_miss_curve_takes_ragged_demands_with_repeats() -> None:
    """Demands of any length, an id repeated within a step, an empty step: as the walk counts them."""
    from asyncside.policy_replay import lru_miss_curve

    rng = np.random.default_rng(7)
    demands = [rng.integers(0, 10, size=int(rng.integers(0, 6))).tolist() for _ in range(400)]
    assert np.array_equal(lru_miss_curve(demands, 10), _reference_lru_miss_curve(demands, 10))
    assert np.array_equal(lru_miss_curve([], 4), np.zeros(5, dtype=np.int64))
    for bad in ([[0, 4]], [[-1]]):
        with pytest.raises(ValueError, match="outside"):
            lru_miss_curve(bad, 4)


def test_min_hits_in_layer_groups_and_past_the_vector_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers too many for one pass go in groups; experts too many for one layer's pass fall back
    to the walk: the same hits either way."""
    from asyncside import policy_replay

    trace = preset("middle", tokens=120, n_layers=5, n_experts=16, top_k=3, seed=9)
    want = [_reference_min_hits(trace, r) for r in (4, 8)]
    for limit in (2 * 16 * 2, 1):  # two layers a group; none fits: the walk
        monkeypatch.setattr(policy_replay, "_MIN_VECTOR_ELEMENTS", limit)
        assert policy_replay.trace_min_hits(trace, [4, 8]) == want


def test_routing_info_does_not_walk_the_trace_per_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """`routing info` stepped Belady's MIN with Python sets and sorts per layer and step, and LRU
    with a list walk per access: about a minute on 100k tokens x 8 layers x 64 experts. It now
    runs the vectorised passes (tests above: the same figures), never the per-layer walks."""
    from asyncside import policy_replay
    from asyncside.routing_cli import trace_info

    trace = preset("low", tokens=200, n_layers=3, n_experts=16, top_k=4)
    want = {r: _reference_min_hits(trace, r) for r in (4, 8)}

    def walked(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("walked the trace per layer")

    monkeypatch.setattr(policy_replay, "belady_bypass", walked)
    monkeypatch.setattr(policy_replay, "lru_miss_curve", walked)
    info = trace_info(trace)
    accesses = 200 * 3 * 4
    assert [c["rows"] for c in info["caches"]] == [4, 8]
    assert [c["min"] for c in info["caches"]] == [round(want[r] / accesses, 4) for r in (4, 8)]
    curves = [_reference_lru_miss_curve(trace.ids[:, layer, :].tolist(), 16) for layer in range(3)]
    assert [c["lru"] for c in info["caches"]] == [round(1 - sum(int(c[r]) for c in curves) / accesses, 4)
                                                  for r in (4, 8)]
