"""`asyncside routing` (info, preset, widen) and RoutingTrace.widen: a trace recorded with fewer
choices per token than a model routes becomes replayable, keeping its locality."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from asyncside.cli import main
from asyncside.policy_replay import lru_miss_curve
from asyncside.routing import RoutingTrace, preset


def _lru(trace: RoutingTrace, rows: int) -> float:
    misses = sum(int(lru_miss_curve(trace.layer_steps(layer), trace.n_experts)[rows])
                 for layer in range(trace.n_layers))
    return 1.0 - misses / (trace.n_tokens * trace.top_k * trace.n_layers)


def test_widen_keeps_the_recorded_slots_and_the_locality() -> None:
    """Cut a top-8 trace to top-6 and widen it back: the six recorded slots stay, the added ones
    are distinct valid ids, the same per seed; and LRU's hit rate stays near the top-8 original's
    at every locality (a uniform fill would drop the high preset's by far more)."""
    for name in ("low", "middle", "high"):
        full = preset(name, tokens=600, n_layers=4, n_experts=64, top_k=8, sequences=2)
        six = RoutingTrace(full.ids[:, :, :6].copy(), full.lengths, 64, {"source": "recorded"})
        wide = six.widen(8)
        assert wide.top_k == 8 and np.array_equal(wide.ids[:, :, :6], six.ids)
        assert all(len(set(row)) == 8 for row in wide.ids.reshape(-1, 8).tolist())
        assert wide.ids.min() >= 0 and wide.ids.max() < 64
        assert np.array_equal(wide.ids, six.widen(8).ids) and not np.array_equal(wide.ids, six.widen(8, seed=1).ids)
        assert wide.meta["widened"]["from_top_k"] == 6 and wide.meta["source"] == "recorded"
        assert abs(_lru(wide, 16) - _lru(full, 16)) < 0.06, (name, _lru(wide, 16), _lru(full, 16))
    uniform = full.ids.copy()  # the high preset: its extra slots drawn uniformly instead
    uniform[:, :, 6:] = -1
    for t, l in np.ndindex(uniform.shape[:2]):
        free = [e for e in np.random.default_rng(t * 7 + l).permutation(64) if e not in uniform[t, l, :6]]
        uniform[t, l, 6:] = free[:2]
    assert _lru(full, 16) - _lru(RoutingTrace(uniform, full.lengths, 64, {}), 16) > 0.1  # the check can tell


def test_widen_refuses_what_it_cannot_do() -> None:
    trace = preset("low", tokens=20, n_layers=2, n_experts=8, top_k=2)
    for bad in (2, 1, 9, True, 3.0):
        with pytest.raises(ValueError, match=r"widen: top_k must be an int in \(2, 8\]"):
            trace.widen(bad)  # type: ignore[arg-type]
    # A layer that routes fewer experts than the widened top-k still gets distinct ids.
    narrow = RoutingTrace(np.tile(np.array([[[0, 1]]], dtype=np.int32), (10, 2, 1)), np.array([10]), 8, {})
    wide = narrow.widen(6)
    assert all(len(set(row)) == 6 for row in wide.ids.reshape(-1, 6).tolist())


def test_a_narrow_trace_is_refused_by_name_then_replays_widened(tmp_path: pathlib.Path) -> None:
    """Fitting a top-2 trace onto a top-4 model is refused with the command that widens it; the
    widened file then fits (ids as the widened trace's, layer by layer)."""
    from asyncside.models.forcing import RoutingReplay, RoutingReplayError

    narrow = preset("middle", tokens=30, n_layers=2, n_experts=16, top_k=2)
    with pytest.raises(RoutingReplayError, match=r"asyncside routing widen FILE OUT --top-k 4"):
        RoutingReplay(narrow, moe_layers=[0, 1], n_experts=16, top_k=4)
    replay = RoutingReplay(narrow.widen(4), moe_layers=[0, 1], n_experts=16, top_k=4)
    assert replay.ids.shape == (30, 2, 4) and np.array_equal(replay.ids[:, :, :2], narrow.ids)


def test_the_routing_command(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    made, wide = tmp_path / "m.npz", tmp_path / "w.npz"
    assert main(["routing", "preset", "middle", str(made), "--tokens", "200", "--layers", "2", "--experts", "32",
                 "--top-k", "4", "--sequences", "2"]) == 0
    trace = RoutingTrace.load(made)
    assert (trace.n_tokens, trace.n_layers, trace.n_experts, trace.top_k, trace.n_sequences) == (200, 2, 32, 4, 2)
    capsys.readouterr()
    assert main(["routing", "info", str(made), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["top_k"] == 4 and [c["rows"] for c in info["caches"]] == [8, 16]
    assert all(0 < c["lru"] <= c["min"] <= 1 for c in info["caches"])
    assert main(["routing", "widen", str(made), str(wide), "--top-k", "6"]) == 0
    assert RoutingTrace.load(wide).top_k == 6
    assert main(["routing", "info", str(wide)]) == 0
    assert "widened from top-4" in capsys.readouterr().out
    assert main(["routing", "widen", str(made), str(wide), "--top-k", "3"]) == 2
    assert "--top-k" in capsys.readouterr().err
    assert main(["routing", "info", str(tmp_path / "missing.npz")]) == 2
    assert "missing.npz" in capsys.readouterr().err
    assert main(["routing", "preset", "low", str(made), "--top-k", "40", "--experts", "32"]) == 2
