"""Unseen inputs, round 10: the figures `routing info` and `bench policy` print, on routing traces
written by hand with plain numpy (several sequences, top-1, top-12 of 16, one- and two-token
traces, one-expert layers, an expert never routed, 1024 experts top-16, few hits over many
accesses, two files of one name).

Invariants checked on every hand-written trace and cache size: Belady's MIN (with bypass) hits at
least as often as MIN under the ledger's rule, which hits at least as often as every online policy
replayed through the Ledger; at a cache of every expert, each of them hits all but the first uses;
`routing info`'s LRU is the Ledger's replay; its ratio to MIN is the ratio of the hits."""

from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

import numpy as np
import pytest

from asyncside.cli import main
from asyncside.policy_replay import belady_bypass, belady_no_bypass, replay_trace, total
from asyncside.routing import RoutingTrace
from asyncside.routing_cli import trace_info

#: the online policies the invariants cover (``oneshot``, legacy, drops every unpredicted expert
#: at each step by design: it is bounded by MIN but keeps nothing at a cache of every expert)
ONLINE = ("lru", "lfu", "aging-lfu", "lrfu", "adaptive-lrfu")


def _distinct(rng: np.random.Generator, tokens: int, layers: int, top_k: int, experts: int) -> np.ndarray:
    return np.stack([np.stack([rng.choice(experts, top_k, replace=False) for _ in range(layers)])
                     for _ in range(tokens)])


def _hand_written(tmp_path: pathlib.Path) -> dict[str, pathlib.Path]:
    """Traces as a person writes them: np.savez of ids, n_experts and (sometimes) lengths."""
    rng = np.random.default_rng(10)
    files: dict[str, dict[str, Any]] = {
        "top1-three-sequences": {"ids": _distinct(rng, 40, 3, 1, 8), "n_experts": 8, "lengths": np.array([10, 20, 10])},
        "top12-of-16": {"ids": _distinct(rng, 30, 2, 12, 16), "n_experts": 16},
        "one-token": {"ids": _distinct(rng, 1, 2, 2, 8), "n_experts": 8},
        "two-sequences-of-one": {"ids": _distinct(rng, 2, 2, 2, 8), "n_experts": 8, "lengths": np.array([1, 1])},
        "one-expert-layers": {"ids": np.zeros((20, 3, 1), dtype=np.int8), "n_experts": 1},
        "expert-7-never": {"ids": _distinct(rng, 50, 2, 2, 7), "n_experts": 8},
        "1024-top16": {"ids": _distinct(rng, 24, 1, 16, 1024), "n_experts": 1024, "lengths": np.array([12, 12])},
    }
    out = {}
    for name, arrays in files.items():
        np.savez(tmp_path / f"{name}.npz", **arrays)
        out[name] = tmp_path / f"{name}.npz"
    return out


def test_min_bounds_every_policy_and_a_full_cache_misses_only_first_uses(tmp_path: pathlib.Path) -> None:
    for name, path in _hand_written(tmp_path).items():
        trace = RoutingTrace.load(path)
        uses = trace.n_tokens * trace.n_layers * trace.top_k
        first_uses = sum(len(np.unique(trace.ids[:, layer, :])) for layer in range(trace.n_layers))
        info = trace_info(trace)
        assert info["accesses"] == uses, name
        for cache in info["caches"]:  # routing info's LRU is the Ledger's, its MIN belady's
            rows = cache["rows"]
            assert cache["lru_hits"] == total(replay_trace(trace, rows, "lru")).hits, (name, rows)
            assert cache["min_hits"] == total(replay_trace(trace, rows, method="min")).hits, (name, rows)
            assert 0 <= cache["lru_hits"] <= cache["min_hits"] <= uses - first_uses, (name, rows)
        for rows in sorted({trace.top_k, (trace.top_k + trace.n_experts) // 2, trace.n_experts}):
            best = sum(belady_bypass(trace.layer_steps(layer), (), rows).hits for layer in range(trace.n_layers))
            ruled = sum(belady_no_bypass(trace.layer_steps(layer), (), rows).hits for layer in range(trace.n_layers))
            online = {p: total(replay_trace(trace, rows, p)) for p in ONLINE}
            for policy, counts in online.items():
                assert counts.accesses == uses, (name, rows, policy)
                assert counts.hits <= ruled <= best, (name, rows, policy, counts.hits, ruled, best)
                if rows >= trace.n_experts:
                    assert counts.hits == uses - first_uses, (name, rows, policy)
            if rows >= trace.n_experts:
                assert best == ruled == uses - first_uses, (name, rows)


def test_routing_info_ratio_to_min_is_that_of_the_hits(tmp_path: pathlib.Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Few hits over many accesses: LRU hits 1 of 13,000 at 4,000 rows, MIN 3 (two experts reused
    past LRU's reach, kept by MIN, and one reused at once). The ratio was taken from the rates
    rounded to four places (0.0001 over 0.0002: "LRU 0.50 of MIN"); it is 1 / 3."""
    ids = np.arange(3250 * 4, dtype=np.int64).reshape(3250, 1, 4)
    ids[2000, 0, 0], ids[2001, 0, 0] = 0, 1
    ids[2, 0, 1] = 4
    np.savez(tmp_path / "few.npz", ids=ids, n_experts=16000)
    assert main(["routing", "info", str(tmp_path / "few.npz")]) == 0
    text = capsys.readouterr().out
    assert "(LRU 0.33 of MIN)" in text and "(LRU 0.67 of MIN)" in text
    assert main(["routing", "info", str(tmp_path / "few.npz"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    quarter, half = info["caches"]
    assert info["accesses"] == 13000 and quarter["rows"] == 4000 and half["rows"] == 8000
    assert (quarter["lru_hits"], quarter["min_hits"], quarter["lru_of_min"]) == (1, 3, 0.3333)
    assert (half["lru_hits"], half["min_hits"], half["lru_of_min"]) == (2, 3, 0.6667)


def test_routing_info_without_hits_states_no_ratio(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    np.savez(tmp_path / "once.npz", ids=np.array([[[0, 1]], [[2, 3]]]), n_experts=8)
    assert main(["routing", "info", str(tmp_path / "once.npz"), "--json"]) == 0
    caches = json.loads(capsys.readouterr().out)["caches"]
    assert all(c["lru_hits"] == c["min_hits"] == 0 and c["lru_of_min"] is None for c in caches)
    assert main(["routing", "info", str(tmp_path / "once.npz")]) == 0
    assert "of MIN" not in capsys.readouterr().out


def test_bench_policy_keeps_two_files_of_one_name_apart(tmp_path: pathlib.Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """`--trace a/t.npz --trace b/t.npz` of one shape: both were labelled "t 8x1" and the second
    replaced the first, whose rows were gone without a word. Now the second is "t-2 8x1", each row
    has its own file's figures, and the JSON names each label's file."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    rng = np.random.default_rng(3)
    np.savez(tmp_path / "a" / "t.npz", ids=_distinct(rng, 40, 2, 1, 8), n_experts=8)
    np.savez(tmp_path / "b" / "t.npz", ids=np.zeros((40, 2, 1), dtype=np.int32), n_experts=8)
    shutil.copy(tmp_path / "a" / "t.npz", tmp_path / "t.npz")
    out = tmp_path / "out.json"
    argv = ["bench", "policy", "--json", "--presets", "", "--fractions", "0.5", "--policies", "lru", "--out", str(out),
            "--trace", str(tmp_path / "a" / "t.npz"), "--trace", str(tmp_path / "b" / "t.npz"),
            "--trace", str(tmp_path / "t.npz")]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    rows = {r["trace"]: r for r in result["rows"]}
    assert list(rows) == ["t 8x1", "t-2 8x1", "t-3 8x1"]
    assert {name: t["file"] for name, t in result["traces"].items()} == {
        "t 8x1": str(tmp_path / "a" / "t.npz"), "t-2 8x1": str(tmp_path / "b" / "t.npz"), "t-3 8x1": str(tmp_path / "t.npz")}
    # b/t.npz routes expert 0 only: every use after the first of each layer hits
    assert rows["t-2 8x1"]["lru"] == rows["t-2 8x1"]["min"] == (80 - 2) / 80
    assert rows["t 8x1"]["min"] == rows["t-3 8x1"]["min"] < rows["t-2 8x1"]["min"]
    assert main([a for a in argv if a != "--json"]) == 0
    table = capsys.readouterr().out
    assert "| t 8x1 |" in table and "| t-2 8x1 |" in table and "| t-3 8x1 |" in table


def _generate_result(experts: int, plan: dict[float, tuple[int, int]]) -> dict[str, Any]:
    """A `bench generate` result as its renderers read it: one asyncside row and one policies row a
    residency, the pools' plan as the bench writes it."""
    row = {"decode_tokens_per_s": 10.0, "vs_all_resident": 0.5, "vs_slot_cache": 1.0, "hit_rate": 0.5,
           "bytes_read_per_token": 1e6, "miss_bytes_per_token": 1e6, "loop_cpu_ms_per_token": 1.0,
           "loop_cpu_vs_mlx_lm": 1.0, "tokens_identical": True, "cache": "warm", "label": "asyncside (default)"}
    policy = {"hit_rate": 0.4, "vs_belady": 0.8}
    return {
        "model": "m", "moe_layers": 2, "experts_per_layer": experts, "record_bytes": 4096, "device": "cpu",
        "settings": {"tokens": 16, "repeats": 1, "cold_repeats": 0, "load": 0}, "model_info": {},
        "pool_plan": {str(f): {"resident_per_layer": r, "side_rows": s} for f, (r, s) in plan.items()},
        "rows": [{**row, "residency": f} for f in plan],
        "all_resident": {"mlx_lm": {"decode_tokens_per_s": 20.0}, "async_resident": {"decode_tokens_per_s": 19.0},
                         "async_overhead_ratio": 0.95},
        "policies_vs_belady": [{"residency": f, "resident_per_layer": r, "side_rows": s, "belady": 0.5,
                                "policies": {"lru": policy}, "all_rows_dynamic": {"belady": 0.5, "lru": 0.4}}
                               for f, (r, s) in plan.items()],
        "notes": [],
    }


def test_bench_generate_tables_say_what_raised_pools_hold() -> None:
    """`bench generate --residency 0` on 16 experts top-4: the pools hold the top-4 rows a layer,
    and the tables said "0%" of experts in pools. They now say 25% (4/16 rows; 0% asked); a share
    the plan kept is shown as before."""
    from asyncside.bench import generate

    md = generate.render_markdown(_generate_result(16, {0.0: (0, 4), 0.5: (0, 8)}))
    assert "| warm | 25% (4/16 rows; 0% asked) | asyncside (default) |" in md
    assert "| warm | 50% | asyncside (default) |" in md
    assert "| 25%, 0% asked (0 + 4) | 0.500 |" in md and "| 50% (0 + 8) | 0.500 |" in md
    assert "| 0%" not in md


def test_bench_generate_names_the_predictor_whose_prefetches_it_replays(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `bench generate --routing FILE` the trace is recorded with the trace's own predictions
    (or temporal), and the policies' columns with those prefetches were still "lru+lookahead"."""
    import types

    import asyncside.runtime
    from asyncside.bench import generate
    from asyncside.models.trace import RoutingTrace as Recorded

    recorded = Recorded()
    rng = np.random.default_rng(4)
    for _ in range(12):
        step = recorded.begin("trace")
        step.record(0, rng.choice(8, 2, replace=False), rng.choice(8, 2, replace=False))
    monkeypatch.setattr(asyncside.runtime, "plan_layer", lambda store, layer, frac: ([], 4))
    store = types.SimpleNamespace(layer=lambda layer: types.SimpleNamespace(n_experts=8))
    (row,) = generate.policy_hit_rates(recorded, store, [0.5], policies=("lru",), predictor="trace")
    assert list(row["policies"]) == ["lru", "lru+trace"]
    assert row["policies"]["lru"]["hit_rate"] <= row["belady"]
