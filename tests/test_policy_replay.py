"""asyncside.policy_replay: Belady against brute force, the replay, miss curves and split_rows."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from asyncside.policy_replay import (
    belady_bypass,
    belady_no_bypass,
    compare_policies,
    lru_miss_curve,
    replay_steps,
    replay_trace,
    split_rows,
    static_best,
    total,
    trace_miss_curves,
    trace_rows,
)
from asyncside.routing import RoutingTrace, synthetic


def brute_force_hits(steps: list[set[int]], rows: int, bypass: bool) -> int:
    """The most hits any schedule gets: dynamic programming over every cache content."""
    best: dict[frozenset[int], int] = {frozenset(): 0}
    for req in steps:
        nxt: dict[frozenset[int], int] = {}
        for cache, hits in best.items():
            h = hits + len(req & cache)
            pool = sorted(cache | req)
            for size in range(rows + 1):
                for keep in itertools.combinations(pool, size):
                    s = frozenset(keep)
                    if not bypass and not req <= s:
                        continue
                    if nxt.get(s, -1) < h:
                        nxt[s] = h
        best = nxt
    return max(best.values())


def tiny_traces(count: int, seed: int) -> list[tuple[list[set[int]], int]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        n = int(rng.integers(3, 7))
        k = int(rng.integers(1, 3))
        rows = int(rng.integers(k, min(n, 4) + 1))
        t = int(rng.integers(1, 9))
        p = rng.dirichlet(np.ones(n) * 0.5)
        out.append(([set(rng.choice(n, size=k, replace=False, p=p).tolist()) for _ in range(t)], rows))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_belady_with_bypass_is_optimal(seed: int) -> None:
    for steps, rows in tiny_traces(40, seed):
        got = belady_bypass(steps, [], rows)
        assert got.accesses == sum(len(s) for s in steps)
        assert got.hits == brute_force_hits(steps, rows, bypass=True), (steps, rows)


@pytest.mark.parametrize("seed", range(4))
def test_belady_without_bypass_is_optimal(seed: int) -> None:
    for steps, rows in tiny_traces(40, seed + 100):
        assert belady_no_bypass(steps, [], rows).hits == brute_force_hits(steps, rows, bypass=False), (steps, rows)


def test_bypass_helps_where_it_should() -> None:
    # 1 row: A A B A A. Without bypass B must evict A (3 hits of 5 -> 2); with bypass A stays.
    steps = [{0}, {0}, {1}, {0}, {0}]
    assert belady_no_bypass(steps, [], 1).hits == 2
    assert belady_bypass(steps, [], 1).hits == 3
    with pytest.raises(ValueError, match="step 0 demands 2 non-resident experts but the cache has 1 rows"):
        belady_no_bypass([{0, 1}], [], 1)


def test_resident_experts_always_hit() -> None:
    steps = [{0, 5}, {1, 5}, {0, 5}]
    assert belady_bypass(steps, [5], 1).hits == 4  # 5 three times, 0 once
    assert belady_no_bypass(steps, [5], 1).hits == 3 + 0  # 1 evicts 0
    assert static_best(steps, [5], 1).hits == 3 + 2


def test_static_best_holds_the_most_demanded() -> None:
    steps = [{0, 1}, {0, 2}, {0, 1}, {3, 1}]
    got = static_best(steps, [], 2)  # keeps {0, 1}: 3 + 3 hits of 8
    assert (got.hits, got.accesses) == (6, 8)


def lru_reference(steps: list[list[int]], rows: int) -> int:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for d in steps:
        req = sorted(set(d))
        hits += sum(1 for e in req if e in cache)
        for e in reversed(req):  # the smallest id ends most recent, as lru_miss_curve orders a step
            cache[e] = None
            cache.move_to_end(e)
        while len(cache) > rows:
            cache.popitem(last=False)
    return hits


def test_lru_miss_curve_matches_lru_at_every_size() -> None:
    tr = synthetic(tokens=300, n_layers=1, n_experts=12, top_k=3, skew=0.8, overlap=0.3, layer_corr=0, seed=3)
    steps = tr.ids[:, 0, :].tolist()
    curve = lru_miss_curve(steps, 12)
    assert len(curve) == 13 and curve[0] == 900 and (np.diff(curve) <= 0).all()
    assert curve[12] == len({e for d in steps for e in d})
    for r in range(3, 13):
        assert curve[r] == 900 - lru_reference(steps, r), r
        ledger = replay_steps(steps, 12, r, "lru")  # the ledger's LRU orders a step's ties otherwise
        assert abs(ledger.accesses - ledger.hits - curve[r]) <= 0.03 * 900, r


def test_replay_steps_counts_ledger_hits() -> None:
    steps = [[0, 1], [1, 2], [0, 1], [3, 4], [0, 1]]
    got = replay_steps(steps, 5, 2, "lru")
    # rows 2: {0,1} miss 2; {1,2}: 1 hit, 2 evicts 0; {0,1}: 1 hit, 0 evicts 2; {3,4}: 2 misses; {0,1}: 2 misses
    assert (got.hits, got.accesses) == (2, 10)
    assert replay_steps(steps, 5, 5, "lru").hits == 5  # every repeat hits when all fit


def test_replay_trace_and_compare_policies() -> None:
    tr = synthetic(tokens=200, n_layers=2, n_experts=16, top_k=2, skew=1.0, overlap=0.5, layer_corr=0.2, seed=1)
    assert trace_rows(tr, 0.25) == 4
    rows = compare_policies({"t": tr}, (0.25,), ("lru", "lfu"))
    assert len(rows) == 1
    r = rows[0]
    assert r["rows"] == 4 and r["experts"] == 16 and r["tokens"] == 200
    for p in ("lru", "lfu"):
        assert 0 < r[p] <= r["min"] and r[f"{p}/min"] == pytest.approx(r[p] / r["min"])
    assert r["min-no-bypass"] <= r["min"]
    assert r["lru"] == total(replay_trace(tr, [4, 4], "lru")).hit_rate
    with pytest.raises(ValueError, match="one per layer"):
        replay_trace(tr, [4], "lru")
    with pytest.raises(ValueError, match="method"):
        replay_trace(tr, 4, method="oracle")


def test_split_rows_follows_the_curves() -> None:
    flat = [100.0] * 9  # no row helps this layer
    steep = [100.0 - 12 * r for r in range(9)]
    assert split_rows([flat, steep], 8) == [0, 8]
    assert split_rows([flat, steep], 8, min_rows=2) == [2, 6]
    assert split_rows([flat, steep], 8, min_rows=[3, 0]) == [3, 5]
    # concave diminishing returns on both: equal marginal gains
    a = [100 / (1 + r) for r in range(17)]
    assert split_rows([a, a], 10) == [5, 5]
    # a cliff: 6 rows hold the working set, fewer hold nothing; taken whole when the budget allows
    cliff = [60.0] * 6 + [0.0] * 3
    gentle = [60.0 - 5 * r for r in range(9)]
    assert split_rows([cliff, gentle], 6) == [6, 0]
    # rows nobody wants are spread, and the total is always spent
    got = split_rows([[5.0, 0.0, 0.0], [5.0, 0.0, 0.0]], 6)
    assert sum(got) == 6 and got == [3, 3]


def test_split_rows_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="less than the layers' minimums"):
        split_rows([[3, 2, 1]], 1, min_rows=2)
    with pytest.raises(ValueError, match=r"miss_curves\[1\]: misses must not grow"):
        split_rows([[3, 2], [1, 2]], 2)
    with pytest.raises(ValueError, match="expected at least one layer"):
        split_rows([], 2)
    with pytest.raises(ValueError, match=r"min_rows\[0\]: 5 is outside"):
        split_rows([[3, 2, 1]], 6, min_rows=5)


def test_split_rows_on_mixed_layers_beats_an_even_split() -> None:
    low = synthetic(tokens=400, n_layers=1, n_experts=32, top_k=4, skew=0.1, overlap=0.0, layer_corr=0, seed=1)
    high = synthetic(tokens=400, n_layers=1, n_experts=32, top_k=4, skew=1.2, overlap=0.9, layer_corr=0, seed=2)
    tr = RoutingTrace(np.concatenate([low.ids, high.ids], axis=1), np.array([400]), 32, {"source": "synthetic"})
    curves = trace_miss_curves(tr)
    assert [c.tolist() for c in curves] == [lru_miss_curve(tr.ids[:, i, :].tolist(), 32).tolist() for i in range(2)]
    alloc = split_rows(curves, 16, min_rows=4)
    even = total(replay_trace(tr, [8, 8], "lru")).hit_rate
    split = total(replay_trace(tr, alloc, "lru")).hit_rate
    assert alloc != [8, 8] and split > even


def test_bench_policy_prints_a_table_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse
    import json

    from asyncside.bench import add_bench_arguments, run_bench

    tr = synthetic(tokens=60, n_layers=2, n_experts=16, top_k=2, skew=1.0, overlap=0.5, layer_corr=0.0)
    tr.save(tmp_path / "t.npz")
    parser = argparse.ArgumentParser()
    add_bench_arguments("policy", parser)
    args = parser.parse_args(["--tokens", "50", "--layers", "2", "--shapes", "16x2", "--presets", "high",
                              "--policies", "lru,adaptive-lrfu", "--trace", str(tmp_path / "t.npz"),
                              "--out", str(tmp_path / "out.json")])
    assert run_bench("policy", args) == 0
    table = capsys.readouterr().out
    assert "| high 16x2 s0 | 25% (4/16) |" in table and "| t 16x2 | 50% (8/16) |" in table
    data = json.loads((tmp_path / "out.json").read_text())
    assert [r["trace"] for r in data["rows"]] == ["high 16x2 s0"] * 2 + ["t 16x2"] * 2
    assert all(0 < r["adaptive-lrfu"] <= r["min"] for r in data["rows"])
    quick = parser.parse_args(["--quick", "--json", "--policies", "lru"])
    assert run_bench("policy", quick) == 0
    data = json.loads(capsys.readouterr().out)
    assert {(r["trace"], r["tokens"], r["layers"]) for r in data["rows"]} == {
        (f"{p} 64x6 s0", 256, 2) for p in ("low", "middle", "high")}
    with pytest.raises(SystemExit) as info:  # a usage error, named as argparse names it
        parser.parse_args(["--shapes", "16by2"])
    assert info.value.code == 2 and "argument --shapes: expected EXPERTSxTOP_K" in capsys.readouterr().err


def test_a_cache_raised_to_the_top_k_is_labelled_with_what_it_holds() -> None:
    """``--fractions 0.01`` of 16 experts at top-2 replays 2 rows: the table said "1% (2)"."""
    from asyncside.bench.policy import format_table

    row = {"trace": "t", "experts": 16, "fraction": 0.01, "rows": 2, "min": 0.5, "min-no-bypass": 0.4,
           "static": 0.3, "lru": 0.2, "lru/min": 0.4}
    assert "| t | 12% (2/16), 1% asked, raised to top-k |" in format_table([row], ["lru"])
    assert "| t | 25% (4/16) |" in format_table([{**row, "fraction": 0.25, "rows": 4}], ["lru"])
