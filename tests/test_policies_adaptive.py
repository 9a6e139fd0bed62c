"""AdaptiveLRFU: history kept after eviction, the half-life picked online, bookkeeping sound."""

from __future__ import annotations

import numpy as np
import pytest

from asyncside.errors import LedgerError
from asyncside.ledger import Ledger
from asyncside.policies import LRFU, AdaptiveLRFU, make_policy
from asyncside.policy_replay import replay_steps, replay_trace, total, trace_rows
from asyncside.routing import preset, synthetic


def run(led: Ledger, steps: list[list[int]]) -> None:
    for d in steps:
        for f in led.reserve(d, demand=True):
            led.publish(f)


def test_known_by_name_and_validated() -> None:
    p = make_policy("adaptive-lrfu")
    assert isinstance(p, AdaptiveLRFU) and p.native_order == "decayed"
    assert isinstance(make_policy("alrfu"), AdaptiveLRFU)
    for bad in ({"half_lives": ()}, {"half_lives": (8.0, 0.0)}, {"period": 0}, {"rows": 0}):
        with pytest.raises(LedgerError, match="adaptive-lrfu"):
            AdaptiveLRFU(**bad)  # type: ignore[arg-type]


def test_shadow_rows_follow_the_ledger() -> None:
    led = Ledger(16, [0], 5, policy="adaptive-lrfu")
    assert isinstance(led.policy, AdaptiveLRFU) and led.policy.rows == 5
    assert AdaptiveLRFU(rows=3).rows == 3


def test_an_evicted_frequent_expert_returns_with_its_standing() -> None:
    # Expert 1 is used 12 times, then a step that needs every row pushes it out; back, it
    # outranks the experts used 3 times since, where LRFU (which forgets) evicts it first.
    steps = [[1]] * 12 + [[2, 3, 4]] * 3
    for policy, kept in ((AdaptiveLRFU(half_lives=(64.0,)), True), (LRFU(64.0), False)):
        led = Ledger(20, [], 3, policy=policy)
        run(led, steps)
        assert led.row_of(1) is None
        run(led, [[1], [6]])
        assert (led.row_of(1) is not None) == kept, policy.name


def test_a_newcomer_enters_as_the_next_victim() -> None:
    led = Ledger(20, [], 3, policy=AdaptiveLRFU(half_lives=(64.0,)))
    run(led, [[1, 2, 3]] * 5 + [[7]])  # 7 evicts one of the three, then is the first to go
    assert led.row_of(7) is not None
    run(led, [[8]])
    assert led.row_of(7) is None and led.row_of(8) is not None


def test_moves_to_frequency_on_a_stationary_trace_and_stays_on_recency_on_phases() -> None:
    skewed = synthetic(tokens=1500, n_layers=1, n_experts=64, top_k=6, skew=0.7, overlap=0.4, layer_corr=0, seed=4)
    led = Ledger(64, [], 16, policy="adaptive-lrfu")
    run(led, skewed.ids[:, 0, :].tolist())
    pol = led.policy
    assert isinstance(pol, AdaptiveLRFU) and pol.half_life == 256.0 and pol.switches >= 1
    # Phases: a new working set of 12 experts every 40 steps, each used in turn. Long memory
    # keeps the old phases' experts; recency wins.
    rng = np.random.default_rng(0)
    steps = []
    for _phase in range(30):
        ws = rng.choice(64, size=12, replace=False)
        steps += [sorted(rng.choice(ws, size=4, replace=False).tolist()) for _ in range(40)]
    led = Ledger(64, [], 16, policy="adaptive-lrfu")
    run(led, steps)
    assert led.policy.half_life == 8.0
    assert led.audit().ok


def test_audit_stays_clean_and_shadows_stay_within_rows() -> None:
    tr = synthetic(tokens=400, n_layers=1, n_experts=32, top_k=4, skew=0.8, overlap=0.3, layer_corr=0, seed=2)
    led = Ledger(32, [0, 1], 8, policy=AdaptiveLRFU(half_lives=(2.0, 32.0, 256.0), period=4))
    for d in tr.ids[:, 0, :].tolist():
        for f in led.reserve(d, demand=True):
            led.publish(f)
        assert led.audit().ok, led.audit().problems
    pol = led.policy
    assert isinstance(pol, AdaptiveLRFU)
    assert all(len(s) <= 8 for s in pol._shadow)
    assert pol.snapshot()["rows"] == 8


def test_hits_at_least_lrfus_on_the_presets() -> None:
    """The claim docs/policies.md makes, on shortened presets (the full table: BENCHMARKS.md)."""
    for name in ("middle", "high"):
        tr = preset(name, tokens=600, n_layers=2)
        rows = trace_rows(tr, 0.25)
        ad = total(replay_trace(tr, rows, "adaptive-lrfu")).hit_rate
        lrfu = total(replay_trace(tr, rows, "lrfu")).hit_rate
        assert ad >= lrfu, (name, ad, lrfu)
    assert replay_steps([[0, 1], [0, 1]], 4, 2, "adaptive-lrfu").hits == 2
