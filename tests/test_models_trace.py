"""Routing traces, Belady's MIN and ledger-policy replay."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from asyncside.models.trace import CacheResult, RoutingTrace, belady, replay_policy


def brute_force_min_misses(demands: list[set[int]], side_rows: int) -> int:
    """Fewest misses over every keep-set choice (exhaustive; tiny inputs only)."""
    best = {frozenset(): 0}
    for req in demands:
        nxt: dict[frozenset, int] = {}
        for cache, misses in best.items():
            m = misses + len(req - cache)
            pool = sorted(cache | req)
            for k in range(min(side_rows, len(pool)) + 1):
                for keep in itertools.combinations(pool, k):
                    key = frozenset(keep)
                    if nxt.get(key, 1 << 30) > m:
                        nxt[key] = m
        best = nxt
    return min(best.values())


def test_belady_hand_example() -> None:
    # side region of 2 rows, nothing resident
    demands = [{1, 2}, {3}, {1}, {2}, {3}, {1}]
    r = belady(demands, [], 2)
    # t0: miss 1, 2 -> keep {1, 2}; t1: miss 3 -> keep 1 (next use t2) and 2 (t3), bypass 3 (t4);
    # t2: hit 1; t3: hit 2 -> keep {1} (2 is never used again); t4: miss 3; t5: hit 1.
    assert (r.accesses, r.side_hits, r.misses) == (7, 3, 4)
    assert r.misses == brute_force_min_misses(demands, 2)


def test_belady_resident_always_hits() -> None:
    r = belady([{0, 5}, {0, 6}, {0, 5}], resident=[0], side_rows=1)
    assert r.resident_hits == 3 and r.accesses == 6
    # 5 misses and is kept; 6 misses and is bypassed (never used again); 5 hits.
    assert (r.misses, r.side_hits) == (2, 1)
    assert r.hit_rate == pytest.approx(4 / 6)


@pytest.mark.parametrize("seed", range(6))
def test_belady_is_optimal_and_beats_every_policy(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, k, side = 8, 2, 3
    demands = [set(rng.choice(n, size=k, replace=False).tolist()) for _ in range(12)]
    best = belady(demands, [], side)
    assert best.misses == brute_force_min_misses(demands, side)
    for policy in ("lfu", "lru", "oneshot", "aging-lfu"):
        r = replay_policy(demands, n, [], side, policy)
        assert r.accesses == best.accesses
        assert r.misses >= best.misses, policy
        assert r.side_hits + r.misses == r.accesses - r.resident_hits


def test_replay_with_predictions_counts_prefetch_reads() -> None:
    demands = [[1, 2], [3, 4], [1, 2], [3, 4]]
    perfect = [None, [3, 4], [1, 2], [3, 4]]  # the previous step always predicts the next
    r = replay_policy(demands, 8, [], 2, "lfu", predictions=perfect)
    assert r.misses == 2  # only the first step misses
    assert r.prefetch_reads == 6
    assert r.side_hits == 6
    plain = replay_policy(demands, 8, [], 2, "lfu")
    assert plain.misses == 8 and plain.prefetch_reads == 0


def test_replay_splits_demands_larger_than_the_side_region() -> None:
    r = replay_policy([[0, 1, 2, 3, 4]], 8, [0], 2, "lru")
    assert r.resident_hits == 1 and r.misses == 4


def test_trace_roundtrip_and_quality() -> None:
    tr = RoutingTrace()
    s = tr.begin("temporal")
    s.record(0, np.array([[1, 2], [2, 3]]), None)
    s.record(3, np.array([[0, 1], [1, 2]]), None)
    s = tr.begin("temporal")
    s.record(0, np.array([[2, 5]]), np.array([2, 3]))
    s.record(3, np.array([[1, 2]]), np.array([1, 2]))
    assert tr.layers == [0, 3]
    assert [d.tolist() for d in tr.demands(0)] == [[1, 2, 3], [2, 5]]
    q = tr.prediction_quality()
    assert q[0] == {"steps": 1, "precision": 0.5, "recall": 0.5}
    assert q[3] == {"steps": 1, "precision": 1.0, "recall": 1.0}
    assert tr.counts(6)[0] == [0, 1, 3, 1, 0, 1]
    back = RoutingTrace.from_json(tr.to_json())
    assert back.to_json() == tr.to_json()
    with pytest.raises(ValueError, match="routing-trace"):
        RoutingTrace.from_json({"format": "nope"})


def test_cache_result_sums() -> None:
    a = CacheResult(4, 1, 2, 1, 0)
    b = CacheResult(2, 0, 0, 2, 3)
    c = a + b
    assert c.astuple() == (6, 1, 2, 3, 3)
    assert c.hit_rate == pytest.approx(0.5)
    assert c.side_hit_rate == pytest.approx(2 / 5)
