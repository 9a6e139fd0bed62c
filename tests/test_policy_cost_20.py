"""AdaptiveLRFU's reserve path made cheaper without one decision changed.

The default policy's reserves (``begin``, ``on_hits``, ``on_reserves`` over a fault log) run on the
event loop's thread on the queued decode path (BENCHMARKS.md, "Decode: queued steps"); their
cheaper form must keep every hit, victim, score and switch of the form it replaced, frozen below
as :class:`_Reference`, over routing families that exercise both of its switches.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import numpy as np
import pytest

from asyncside.ledger import Ledger
from asyncside.policies import (
    _DECAY_TABLE,
    AdaptiveLRFU,
    Policy,
    _evict_lowest,
    _evict_lowest_lazy,
    _lru_shadow_step,
)
from asyncside.routing import RoutingTrace, preset


class _Reference(AdaptiveLRFU):
    """AdaptiveLRFU's reserve path as it was: one shadow push per access, one call per hit, and the
    base class's reserve-at-a-time ``on_reserves``."""

    def begin(self, batch: Sequence[int]) -> None:
        self._clock += 1
        clock = self._clock
        hist, hls, log2, tables = self._hist, self.half_lives, math.log2, self._decay
        m = len(hls)
        for e in batch:
            h = hist.get(e)
            if h is None:
                hist[e] = [clock] + [1.0] * m
                continue
            gap = int(clock - h[0])
            h[0] = clock
            for i in range(m):
                table = tables[i]
                h[1 + i] = h[1 + i] * (table[gap] if gap < _DECAY_TABLE else 2.0 ** (-gap / hls[i])) + 1.0
        rows = self.rows
        if rows > 0:
            in_batch = set(batch)
            wins = self._wins
            cur, live, recency = self._cur, self.score, self.recency
            if not recency:
                for e in batch:
                    if e in live:
                        wins[cur] += 1
                if self.guard:
                    real_only, shadow_only = _lru_shadow_step(self._lru, batch, live, max(rows, len(batch)))
                    self._gwins[0] += real_only
                    self._gwins[1] += shadow_only
            for i in range(m):
                if i == cur and not recency:
                    continue
                shadow, heap = self._shadow[i], self._sheap[i]
                t_key = clock / hls[i]
                j = 1 + i
                if i == cur:
                    for e in batch:
                        if (e in shadow) != (e in live):
                            self._gwins[e in shadow] += 1
                for e in batch:
                    if e in shadow:
                        wins[i] += 1
                    k = log2(hist[e][j]) + t_key
                    shadow[e] = k
                    heapq.heappush(heap, (k, e))
                if len(shadow) > rows:
                    _evict_lowest(shadow, heap, rows, in_batch)
                if len(heap) > 4 * rows + 64:
                    heap[:] = [(k, e) for e, k in shadow.items()]
                    heapq.heapify(heap)
        if clock % self.period == 0:
            self._decide()

    def on_hits(self, experts: Sequence[int]) -> None:
        for e in experts:
            self._rank(e)

    def on_reserves(self, reserves: Sequence[tuple[Sequence[int], Sequence[int]]]) -> None:
        Policy.on_reserves(self, reserves)


# Trace families not in the repo (helper P's generators, small): a topic that changes every few
# hundred tokens, eight requests of their own topics interleaved token by token, and layers of
# very different skew.
def _zipf(rng: np.random.Generator, n: int, s: float) -> np.ndarray:
    p = 1.0 / np.arange(1, n + 1) ** s
    p = p[rng.permutation(n)]
    return p / p.sum()


def _draw(rng: np.random.Generator, p: np.ndarray, k: int) -> np.ndarray:
    return np.argpartition(-(np.log(p) + rng.gumbel(size=len(p))), k - 1)[:k]


def _topics(rng: np.random.Generator, n: int, k: int, layers: int, tokens: int) -> np.ndarray:
    ids = np.zeros((tokens, layers, k), np.int32)
    t = 0
    while t < tokens:
        span = int(rng.integers(200, 500))
        ps = [_zipf(rng, n, 1.1) for _ in range(layers)]
        for u in range(t, min(tokens, t + span)):
            for layer in range(layers):
                ids[u, layer] = _draw(rng, ps[layer], k)
        t += span
    return ids


def _interleaved8(rng: np.random.Generator, n: int, k: int, layers: int, tokens: int) -> np.ndarray:
    parts = [_topics(rng, n, k, layers, tokens // 8 + 1) for _ in range(8)]
    ids = np.zeros((tokens // 8 * 8, layers, k), np.int32)
    for r in range(8):
        ids[r::8] = parts[r][: tokens // 8]
    return ids


def _layer_skewed(rng: np.random.Generator, n: int, k: int, layers: int, tokens: int) -> np.ndarray:
    ids = np.zeros((tokens, layers, k), np.int32)
    for layer in range(layers):
        p = _zipf(rng, n, [0.05, 1.5, 0.3, 2.0][layer % 4])
        for u in range(tokens):
            ids[u, layer] = _draw(rng, p, k)
    return ids


def _family(name: str, n: int, k: int, tokens: int = 600, layers: int = 2) -> RoutingTrace:
    make = {"topics": _topics, "interleaved8": _interleaved8, "layer_skewed": _layer_skewed}[name]
    ids = make(np.random.default_rng(0), n, k, layers, tokens)
    return RoutingTrace(ids, np.array([len(ids)]), n, {"family": name})


def _embedded() -> RoutingTrace:
    tr = RoutingTrace.load("benchmarks/policy-embedded-trace.npz")
    return RoutingTrace(tr.ids[:, :2], tr.lengths, tr.n_experts, tr.meta)


TRACES = {
    "low": lambda: preset("low", tokens=600, n_layers=2),
    "middle": lambda: preset("middle", tokens=600, n_layers=2),
    "high": lambda: preset("high", tokens=600, n_layers=2),
    "embedded": _embedded,
    "topics-32x4": lambda: _family("topics", 32, 4),
    "topics-128x8": lambda: _family("topics", 128, 8, tokens=400),
    "interleaved8-32x4": lambda: _family("interleaved8", 32, 4),
    "interleaved8-64x6": lambda: _family("interleaved8", 64, 6),
    "layer_skewed-64x6": lambda: _family("layer_skewed", 64, 6, layers=4, tokens=400),
}
SWITCHES: dict[str, tuple[int, int]] = {}  # trace -> (half-life switches, guard switches) seen


def _state(p: AdaptiveLRFU) -> dict[str, object]:
    """Everything that decides a later victim or switch: the snapshot (scores bit for bit), the
    histories, each shadow's keys and its eviction order, both windows, the guard's LRU."""
    order = []
    for keys in p._shadow:
        heap = [(k, e) for e, k in keys.items()]
        heapq.heapify(heap)
        order.append([heapq.heappop(heap)[1] for _ in range(len(heap))])
    return {"snapshot": p.snapshot(), "hist": p._hist, "shadows": p._shadow, "order": order,
            "wins": p._wins, "gwins": p._gwins, "lru": list(p._lru), "cur": p._cur}


def _replay(steps: list[list[int]], n: int, rows: int, policy: AdaptiveLRFU) -> tuple[list[object], dict[str, object]]:
    """Each step reserved and its fills published; per step the hits and the rows' experts."""
    led = Ledger(n, [], rows, policy=policy)
    seen: list[object] = []
    for d in steps:
        fills = led.reserve(d, demand=True)
        for f in fills:
            led.publish(f)
        seen.append((len(d) - len(fills), sorted(led._live)))
    return seen, _state(policy)


@pytest.mark.parametrize("name", list(TRACES))
def test_every_hit_victim_and_switch_is_the_reference_s(name: str) -> None:
    trace = TRACES[name]()
    halving = guard = 0
    for fraction in (0.125, 0.25, 0.5):
        rows = max(round(trace.n_experts * fraction), trace.top_k)
        for layer in range(trace.n_layers):
            steps = np.sort(trace.ids[:, layer, :], axis=1).tolist()
            for kw in ({}, {"guard": False}, {"half_lives": (4.0, 32.0, 512.0), "period": 16}):
                ref = _Reference(**kw)  # type: ignore[arg-type]
                new = AdaptiveLRFU(**kw)  # type: ignore[arg-type]
                got, want = _replay(steps, trace.n_experts, rows, new), _replay(steps, trace.n_experts, rows, ref)
                assert got[0] == want[0], (name, fraction, layer, kw)
                assert got[1] == want[1], (name, fraction, layer, kw)
                assert not new.audit(set(new.score))
                halving += ref.switches
                guard += ref.guard_switches
    SWITCHES[name] = (halving, guard)


def test_the_families_switch_both_ways() -> None:
    """The comparison above means something only if the replays switched half-life and ranking."""
    if len(SWITCHES) < len(TRACES):
        pytest.skip("needs the comparisons above in the same run")
    assert sum(h for h, _ in SWITCHES.values()) > 0
    assert sum(g for _, g in SWITCHES.values()) > 0


def _mixed(led: Ledger, steps: list[list[int]], log: int, *, batched: bool) -> list[object]:
    """Queued steps' pattern: a demand reserve, then a fault log of ``log`` reserves of uses
    (:meth:`Ledger.record_uses` at once, or one :meth:`Ledger.record_use` each)."""
    seen: list[object] = []
    i = 0
    while i < len(steps):
        for f in led.reserve(steps[i], demand=True):
            led.publish(f)
        part = steps[i + 1:i + 1 + log]
        if part and batched:
            led.record_uses(np.concatenate([np.asarray(s, np.int64) for s in part]), [len(s) for s in part])
        else:
            for s in part:
                led.record_use(s)
        seen.append(sorted(led._live))
        i += 1 + log
    return seen


@pytest.mark.parametrize("name", ["middle", "embedded", "interleaved8-32x4", "topics-128x8"])
def test_a_fault_log_at_once_leaves_the_state_of_one_reserve_at_a_time(name: str) -> None:
    trace = TRACES[name]()
    steps = trace.ids[:, 0, :].tolist()
    rows = max(trace.n_experts // 4, trace.top_k)
    for log in (1, 7, 64):
        runs = {}
        for label, cls, batched in (("batched", AdaptiveLRFU, True), ("one by one", AdaptiveLRFU, False),
                                    ("reference", _Reference, False)):
            pol = cls()
            led = Ledger(trace.n_experts, [], rows, policy=pol)
            runs[label] = (_mixed(led, steps, log, batched=batched), _state(pol), dict(led.stats))
        assert runs["batched"] == runs["one by one"] == runs["reference"], (name, log)


def test_the_lazy_shadow_heap_drops_what_a_heap_of_every_key_drops() -> None:
    """A shadow pushes only for an expert it lacks or whose key fell; its eviction must drop the
    same experts in the same order as with an entry at every key, a key that fell included (no
    use makes one fall, but rounding is not ruled out) and a batch bigger than the cap."""
    rng = np.random.default_rng(3)
    for _ in range(300):
        cap = int(rng.integers(1, 5))
        full: dict[int, float] = {}
        lazy: dict[int, float] = {}
        fheap: list[tuple[float, int]] = []
        lheap: list[tuple[float, int]] = []
        for _step in range(40):
            batch = rng.choice(10, int(rng.integers(1, cap + 4)), replace=False).tolist()
            for e in batch:
                old = lazy.get(e)
                # no key repeats (a use changes it), as in the shadows
                k = float(rng.uniform(0, 6)) if old is None else old + float(rng.uniform(-2, 2))
                full[e] = lazy[e] = k
                heapq.heappush(fheap, (k, e))
                if old is None or k < old:
                    heapq.heappush(lheap, (k, e))
            want = _evict_lowest(full, fheap, cap, set(batch))
            assert _evict_lowest_lazy(lazy, lheap, cap, batch) == want
            assert lazy == full


@pytest.mark.parametrize("kw", [{}, {"rows": 6}, {"half_lives": (16.0,), "rows": 6}, {"guard": False, "rows": 6}])
def test_a_policy_without_a_ledger_keeps_the_reference_s_state(kw: dict[str, object]) -> None:
    """Driven by hand (no side rows to size the shadows, rows given, one candidate): the same
    state after every reserve, a hit outside the batch and a publish included."""
    steps = np.sort(preset("middle", tokens=300, n_layers=1).ids[:, 0, :], axis=1).tolist()
    ref, new = _Reference(**kw), AdaptiveLRFU(**kw)  # type: ignore[arg-type]
    for p in (ref, new):
        p.reset()
    held: list[int] = []
    for d in steps:
        hits = [e for e in d if e in held] + ([held[0]] if held and held[0] not in d else [])
        for p in (ref, new):
            p.begin(d)
            p.on_hits(hits)
            for e in d:
                if e not in held:
                    p.on_publish(e)
        held = (held + [e for e in d if e not in held])[-6:]
        assert _state(new) == _state(ref)
