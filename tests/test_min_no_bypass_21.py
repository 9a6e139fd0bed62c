"""Belady's MIN under the ledger's rule from a run's starting rows, the bound ``bench offload`` and
``bench generate`` report beside MIN with bypass.

A run's ledger gives every demanded expert a row (no bypass), keeps its pinned experts, and starts
with warm rows. MIN with bypass over every row (what "of MIN" was alone) can keep an expert a miss
would have evicted, which no run can: at the plan's least rows (the top-k) every step's demand
takes every row, so any policy hits exactly what no-bypass MIN hits, while MIN with bypass reads
far higher. Checked here: no-bypass MIN from warm rows, with pinned experts and steps passed in
groups, against brute force; replays of the real Ledger never above it; each relaxation above
the one before; and the benches' fields.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncside.ledger import Ledger
from asyncside.models.trace import CacheResult, replay_policy
from asyncside.policy_replay import belady_bypass, belady_no_bypass

Steps = list[set[int]]


def brute_force(steps: Steps, resident: set[int], rows: int, initial: set[int], *, bypass: bool) -> int:
    """The most hits any schedule gets (dynamic programming over every content of the rows):
    resident experts always hit; a step's hits are what the rows held at its start; afterwards the
    rows hold any ``rows`` of what they held or the step demanded, which without bypass must
    include the whole demand where it fits (a larger demand passes in groups: no constraint)."""
    best: dict[frozenset[int], int] = {frozenset(initial - resident): 0}
    for d in steps:
        req = d - resident
        nxt: dict[frozenset[int], int] = {}
        for cache, hits in best.items():
            h = hits + len(d & resident) + len(req & cache)
            pool = sorted(cache | req)
            for size in range(min(rows, len(pool)) + 1):
                for keep in itertools.combinations(pool, size):
                    s = frozenset(keep)
                    if not bypass and len(req) <= rows and not req <= s:
                        continue
                    if nxt.get(s, -1) < h:
                        nxt[s] = h
        best = nxt
    return max(best.values())


@st.composite
def small_runs(draw: Any, *, oversize: bool = False) -> tuple[Steps, set[int], int, set[int], int]:
    """(steps, resident, side rows, initial rows, experts): a layer of up to 7 experts, a few pinned,
    side rows from 1, warm rows from any experts, steps of 1-3 experts (with ``oversize``, a step
    may demand more than the side rows)."""
    n = draw(st.integers(3, 7))
    resident = set(draw(st.lists(st.integers(0, n - 1), max_size=2, unique=True)))
    free = n - len(resident)
    rows = draw(st.integers(1, max(1, min(free, 4))))
    k = draw(st.integers(1, min(3, free if oversize else rows + len(resident))))
    steps = draw(st.lists(st.sets(st.integers(0, n - 1), min_size=1, max_size=k), min_size=1, max_size=8))
    if not oversize:
        steps = [d for d in steps if len(d - resident) <= rows] or [set(sorted(resident)[:1]) or {0}]
    initial = set(draw(st.lists(st.integers(0, n - 1), max_size=rows, unique=True))) - resident
    return steps, resident, rows, initial, n


FEW = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])


@FEW
@given(small_runs())
def test_no_bypass_min_from_warm_rows_is_the_optimum_under_the_rule(run: Any) -> None:
    """Fails without ``initial`` (MIN from empty rows: below what warm rows allow) or with a
    warm start counted as empty."""
    steps, resident, rows, initial, _n = run
    got = belady_no_bypass(steps, resident, rows, initial)
    assert got.accesses == sum(len(d) for d in steps)
    assert got.hits == brute_force(steps, resident, rows, initial, bypass=False), run


@FEW
@given(small_runs(oversize=True))
def test_steps_passed_in_groups_are_bounded_as_any_grouping_is(run: Any) -> None:
    steps, resident, rows, initial, _n = run
    got = belady_no_bypass(steps, resident, rows, initial, groups=True)
    assert got.hits == brute_force(steps, resident, rows, initial, bypass=False), run
    assert got.hits <= belady_bypass(steps, resident, rows, initial).hits


def test_a_warm_start_is_counted_and_an_oversized_step_refused_without_groups() -> None:
    steps = [{1, 2}, {1, 2}, {3}, {1}]
    # From empty rows both 1 and 2 miss first; warm with {1, 2} both hit.
    assert belady_no_bypass(steps, [], 2).hits == 2 + 1
    assert belady_no_bypass(steps, [], 2, initial=[1, 2]).hits == 2 + 2 + 1
    with pytest.raises(ValueError, match="initial: 3 non-resident experts"):
        belady_no_bypass(steps, [], 2, initial=[1, 2, 3])
    with pytest.raises(ValueError, match="step 0 demands 2 non-resident experts but the cache has 1 rows"):
        belady_no_bypass(steps, [], 1)
    # In groups through one row: a step's hits are what the row held (1), then it keeps the
    # soonest used again (1); 3 must take the row, so the last 1 misses.
    assert belady_no_bypass(steps, [], 1, initial=[1], groups=True).hits == 1 + 1 + 0 + 0


def ledger_from_warm(n: int, resident: set[int], rows: int, initial: set[int], policy: str) -> Ledger:
    """A Ledger whose side rows hold ``initial`` before the first step, warmed as the runtime warms
    them (asyncside/runtime/_fills.py ``_warm_up``: a reserve that is no demand, then publish)."""
    led = Ledger(n, sorted(resident), rows, policy=policy)
    if initial:
        for f in led.reserve(np.asarray(sorted(initial), dtype=np.int64), demand=False):
            led.publish(f)
    return led


def replay_from(led: Ledger, steps: Steps, resident: set[int]) -> CacheResult:
    """The hits a ledger's replay gets from its current rows (as replay_policy counts them)."""
    return replay_policy(steps, led.n_experts, sorted(resident), led.side_rows, ledger_factory=lambda *a, **k: led)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(small_runs(oversize=True), st.sampled_from(["lru", "lfu", "lrfu", "aging-lfu", "adaptive-lrfu"]))
def test_replays_stay_under_no_bypass_min_which_stays_under_each_relaxation(run: Any, policy: str) -> None:
    """replay <= MIN under the ledger's rule (pinned, side rows, same warm rows) <= MIN with bypass
    (same pinned and rows) <= MIN with bypass over every row, pinned ones evictable (what
    ``bench offload``'s "of MIN (bypass)" is held to). Each step is a relaxation of the one
    before, so each inequality holds on every trace; a failure here is a bug in one of them."""
    steps, resident, rows, initial, n = run
    led = ledger_from_warm(n, resident, rows, initial, policy)
    got = replay_from(led, steps, resident)
    rule = belady_no_bypass(steps, resident, rows, initial, groups=True)
    bypass = belady_bypass(steps, resident, rows, initial)
    every_row = belady_bypass(steps, [], rows + len(resident), initial | resident)
    hits = got.resident_hits + got.side_hits
    assert got.accesses == rule.accesses == bypass.accesses == every_row.accesses
    assert hits <= rule.hits <= bypass.hits <= every_row.hits, (run, policy, hits, rule, bypass, every_row)


def test_at_the_top_k_rows_every_policy_hits_what_no_bypass_min_hits() -> None:
    """Why the second column matters: with rows = top-k (the plan's least rows, what bench offload's
    runs hold on this machine) each demand takes every row, so the rule leaves no choice and no
    policy is below no-bypass MIN; MIN with bypass, keeping experts a step would have evicted,
    reads far higher (at low locality most of the 'of MIN' gap is that)."""
    rng = np.random.default_rng(0)
    n, k = 32, 4
    steps = [set(rng.choice(n, size=k, replace=False, p=rng.dirichlet(np.ones(n))).tolist()) for _ in range(200)]
    rule = belady_no_bypass(steps, [], k)
    bypass = belady_bypass(steps, [], k)
    for policy in ("lru", "lrfu", "lfu"):
        r = replay_policy(steps, n, [], k, policy)
        assert r.side_hits == rule.hits, policy
    assert bypass.hits > 1.5 * rule.hits


def _trace(path: Any, ids: np.ndarray, n_experts: int) -> str:
    from asyncside.routing import RoutingTrace

    RoutingTrace(ids.astype(np.int32), np.array([ids.shape[0]], dtype=np.int64), n_experts, {}).save(path)
    return str(path)


def test_bench_offload_holds_a_run_to_both_mins(quick_store: Any, tmp_path: Any) -> None:
    """A run's figures as ``bench offload`` derives them from its child's JSON (rows per layer, the
    experts its rows held at the start, the pinned ones): "of MIN (bypass)" against MIN with bypass
    over every row, and "of MIN (no bypass)" against MIN under the ledger's rule with the pinned
    experts kept and the warm side rows. Before, only the first was reported, so a run at the
    top-k rows (where its ledger has no choice) read as a fraction of a bound no run can reach."""
    from asyncside.bench import offload
    from asyncside.store import ExpertStore

    store = ExpertStore.open(quick_store)
    layers = sorted(store.layers)
    n, k = store.layer(layers[0]).n_experts, offload._store_top_k(str(quick_store))
    rng = np.random.default_rng(21)
    p = rng.dirichlet(np.ones(n))
    ids = np.stack([np.stack([rng.choice(n, k, replace=False, p=p) for _ in layers]) for _ in range(40)])
    trace = _trace(tmp_path / "t.npz", ids, n)
    steps = 30
    warm = {str(layer): list(range(k)) for layer in layers}
    pinned = {str(layer): [k, k + 1] for layer in layers}  # two pinned experts beside k side rows
    demands = {layer: [set(ids[t, i].tolist()) for t in range(steps)] for i, layer in enumerate(layers)}
    # The run's own hits: an LRU ledger from those rows, the pinned beside (what the runtime would hit).
    hits = accesses = 0
    for layer in layers:
        led = ledger_from_warm(n, set(pinned[str(layer)]), k, set(warm[str(layer)]), "lru")
        r = replay_from(led, demands[layer], set(pinned[str(layer)]))
        hits, accesses = hits + r.resident_hits + r.side_hits, accesses + r.accesses
    run: dict[str, Any] = {"status": "ok", "tokens": [0] * steps, "rows_per_layer": {str(x): k + 2 for x in layers},
                           "warm_experts": {x: w + pinned[x] for x, w in warm.items()}, "pinned_experts": pinned,
                           "stats": {"hits": hits, "misses": accesses - hits}, "decode_tokens_per_s": 1.0}
    sh = {"store": str(quick_store), "record_bytes": store.layer(layers[0]).stride, "io": {"GBps": 1.0}}
    offload._figures(run, sh, trace, {"tokens": [0] * steps, "decode_tokens_per_s": 1.0})
    rule = sum((belady_no_bypass(demands[x], pinned[str(x)], k, warm[str(x)]) for x in layers[1:]),
               start=belady_no_bypass(demands[layers[0]], pinned[str(layers[0])], k, warm[str(layers[0])]))
    nb = run["belady"]["no_bypass"]
    assert (nb["accesses"], nb["misses"]) == (rule.accesses, rule.accesses - rule.hits)
    assert hits <= rule.hits and run["of_min_no_bypass"] == pytest.approx(hits / rule.hits)
    assert run["of_min"] is not None and run["of_min"] < 0.95 * run["of_min_no_bypass"] <= 1.0
    # Without the pinned experts named, MIN under the rule may evict them (every row dynamic): a
    # looser bound than the run's own; named, they stay (the figure above is the run's ceiling).
    unpinned = offload.belady_of_run(trace, str(quick_store), steps, run["rows_per_layer"], run["warm_experts"])
    assert unpinned["no_bypass"]["hit_rate"] > nb["hit_rate"]
    md = offload.render_markdown({"budget_bytes": 1 << 30, "cgroup": "v2", "shapes": [], "runs": [
        {**run, "shape": "s", "locality": "l", "system": "asyncside"}]})
    head, _, row = md.splitlines()[2:5]
    assert "| of MIN (bypass) | of MIN (no bypass) |" in head
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[5:7] == [f"{run['of_min']:.2f}x", f"{run['of_min_no_bypass']:.2f}x"]


def test_a_runtime_child_records_its_pinned_experts(quick_store: Any, tmp_path: Any) -> None:
    """The asyncside child says which of its rows' experts are pinned (none: every row dynamic, the
    runtime's default), so its MIN under the rule keeps exactly those; its hits stay at or under it."""
    from asyncside.bench import offload
    from asyncside.store import ExpertStore

    store = ExpertStore.open(quick_store)
    layers = sorted(store.layers)
    n, k = store.layer(layers[0]).n_experts, offload._store_top_k(str(quick_store))
    rng = np.random.default_rng(3)
    ids = np.stack([np.stack([rng.choice(n, k, replace=False) for _ in layers]) for _ in range(12)])
    trace = _trace(tmp_path / "c.npz", ids, n)
    spec = {"store": str(quick_store), "prompt": offload.prompt_for(str(quick_store)), "seconds": 60.0, "tokens": 6,
            "policy": "lru", "predictor": "none", "budget": 1 << 30, "system": "asyncside", "routing": trace}
    run: dict[str, Any] = {**offload.child_main(spec), "status": "ok"}
    assert run["pinned_experts"] == {str(layer): [] for layer in layers}
    sh = {"store": str(quick_store), "record_bytes": store.layer(layers[0]).stride, "io": {"GBps": 1.0}}
    offload._figures(run, sh, trace, {"tokens": run["tokens"], "decode_tokens_per_s": 1.0})
    assert run["of_min_no_bypass"] is not None and run["of_min_no_bypass"] <= 1.0
    assert run["belady"]["no_bypass"]["hit_rate"] <= run["belady"]["hit_rate"]


def test_bench_generate_reports_min_under_the_ledgers_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench generate``'s policies against MIN: beside MIN with bypass, MIN under the ledger's rule
    from the same start (the resident set pinned, side rows empty), which bounds every demand-only
    replay, and each policy's fraction of both, in the JSON and both tables. A prefill step larger
    than the side rows passes in groups, as the replay's halves do (it was a ValueError)."""
    import types

    import asyncside.runtime
    from asyncside.bench import generate
    from asyncside.models.trace import RoutingTrace as Recorded

    recorded = Recorded()
    rng = np.random.default_rng(5)
    step = recorded.begin("trace")  # a prefill of 3 tokens: up to 6 experts through 2 side rows
    step.record(0, rng.choice(8, (3, 2), replace=True), None)
    for _ in range(24):
        step = recorded.begin("trace")
        step.record(0, rng.choice(8, 2, replace=False), rng.choice(8, 2, replace=False))
    monkeypatch.setattr(asyncside.runtime, "plan_layer", lambda store, layer, frac: ([7], 2))
    store = types.SimpleNamespace(layer=lambda layer: types.SimpleNamespace(n_experts=8))
    (row,) = generate.policy_hit_rates(recorded, store, [0.5], policies=("lru", "lfu"), predictor="trace")
    demands = recorded.demands(0)
    want = belady_no_bypass(demands, [7], 2, groups=True).hit_rate
    assert row["belady_no_bypass"] == pytest.approx(want) and want < row["belady"]
    for name in ("lru", "lfu"):
        v = row["policies"][name]
        assert v["hit_rate"] <= row["belady_no_bypass"] + 1e-12
        assert v["vs_belady_no_bypass"] == pytest.approx(v["hit_rate"] / want)
    dyn = row["all_rows_dynamic"]
    assert dyn["lru"] <= dyn["belady_no_bypass"] + 1e-12 <= dyn["belady"] + 2e-12
    from test_unseen_inputs_10 import _generate_result

    result = {**_generate_result(8, {0.5: (1, 2)}), "policies_vs_belady": [row]}
    md = generate.render_markdown(result)
    assert "| Belady (MIN) | MIN, no bypass | lru | lru+trace | lfu | lfu+trace |" in md
    lru = row["policies"]["lru"]
    assert (f"| {row['belady']:.3f} | {want:.3f} | {lru['hit_rate']:.3f} ({lru['vs_belady']:.2f} / "
            f"{lru['vs_belady_no_bypass']:.2f}) |") in md
    assert f"| {dyn['belady']:.3f} / {dyn['belady_no_bypass']:.3f} / {dyn['lru']:.3f} |" in md
