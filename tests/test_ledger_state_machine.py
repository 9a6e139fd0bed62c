"""A hypothesis state machine drives the ledger through reserve / publish / fail / lease / release /
policy switches, in lockstep with a naive oracle, auditing every invariant after every step.

The oracle (``NaiveLedger``) restates the rules in the most direct way (linear scans, no heaps, no
caches): the side-region design's LFU / one-shot rules plus the fixes (FILLING counts as present, leased rows
are never victims, demand blocks). Every reserve must return the very same (expert, row) list.

``test_state_machine_runs_100k_steps`` is the CI run: derandomized, no example database, and it
asserts at least 100,000 steps ran. ``test_state_machine_catches_*`` prove the machine finds bugs:
each monkeypatches a deliberately broken ledger in and expects a failure within a small budget.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from asyncside import CapacityError, Fill, Ledger, LedgerError
from asyncside.policies import LFU, LRU, AgingLFU, OneShot, Policy, _HeapPolicy


class NaiveLedger:
    """The rules, written as plainly as possible (the oracle)."""

    def __init__(self, n: int, resident: list[int], side: int, policy: str, period: int) -> None:
        self.n, self.side, self.cap = n, side, len(resident)
        self.resident = {e: i for i, e in enumerate(resident)}
        self.free = list(range(self.cap, self.cap + side))
        self.live: dict[int, int] = {}
        self.filling: dict[int, int] = {}  # expert -> row
        self.leases: dict[int, list[int]] = {}  # our lease id -> rows
        self.set_policy(policy, period)

    def set_policy(self, policy: str, period: int) -> None:
        self.policy, self.period = policy, period
        self.score: dict[int, int] = {}
        self.clock = 0
        self.reserves = 0
        for e in sorted(self.live):
            self._on_publish(e)

    def pinned(self, row: int) -> bool:
        return any(row in rows for rows in self.leases.values())

    def _touch(self, e: int) -> None:
        self.clock += 1
        self.score[e] = self.clock

    def _on_publish(self, e: int) -> None:
        if self.policy == "lru":
            self._touch(e)
        elif self.policy in ("lfu", "aging"):
            self.score.setdefault(e, 1)

    def reserve(self, ids: list[int], demand: bool, protect: tuple[int, ...] = ()) -> tuple[list[tuple[int, int]], list[int]]:
        batch: list[int] = []
        for e in ids:
            if e not in self.resident and e not in batch:
                batch.append(e)
        if demand and len(batch) > self.side:
            raise CapacityError("oracle")
        self.reserves += 1
        if self.policy == "aging" and self.reserves % self.period == 0:
            self.score = {e: f // 2 for e, f in self.score.items()}
        if self.policy == "oneshot":
            for e in sorted(self.live):
                if e not in batch and e not in protect and not self.pinned(self.live[e]):
                    self.free.append(self.live.pop(e))
        for e in batch:
            if e in self.live:
                if self.policy == "lru":
                    self._touch(e)
                elif self.policy in ("lfu", "aging"):
                    self.score[e] += 1
        fills, blocked = [], []
        for e in batch:
            if e in self.live or e in self.filling:
                continue
            if self.free:
                row = self.free.pop()
            else:
                cands = [v for v in self.live if v not in batch and v not in protect and not self.pinned(self.live[v])]
                if self.policy == "oneshot" or not cands:
                    if demand:
                        blocked.append(e)
                    continue
                victim = min(cands, key=lambda v: (self.score[v], v))
                row = self.live.pop(victim)
                del self.score[victim]
            self.filling[e] = row
            fills.append((e, row))
        return fills, blocked

    def publish(self, e: int) -> None:
        self.live[e] = self.filling.pop(e)
        self._on_publish(e)

    def fail(self, e: int) -> None:
        self.free.append(self.filling.pop(e))

    def holdable(self, e: int) -> bool:
        return e in self.resident or e in self.live

    def lease(self, lease_id: int, ids: list[int]) -> None:
        rows = list(dict.fromkeys(self.resident[e] if e in self.resident else self.live[e] for e in ids))
        self.leases[lease_id] = rows
        if self.policy == "lru":
            for e in dict.fromkeys(ids):
                if e in self.live:
                    self._touch(e)

    def table(self) -> list[int]:
        t = [-1] * self.n
        for e, r in {**self.resident, **self.live}.items():
            t[e] = r
        return t


def _policy(name: str, period: int) -> Policy:
    return {"lfu": LFU, "oneshot": OneShot, "lru": LRU}[name]() if name != "aging" else AgingLFU(period)


STEPS = {"count": 0}


class LedgerMachine(RuleBasedStateMachine):
    """Ledger and oracle side by side; audit after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.led: Ledger | None = None

    @initialize(
        n=st.integers(1, 12),
        resident_raw=st.binary(max_size=3),
        side=st.integers(0, 5),
        policy=st.sampled_from(["lfu", "oneshot", "lru", "aging"]),
        period=st.integers(1, 4),
    )
    def setup(self, n: int, resident_raw: bytes, side: int, policy: str, period: int) -> None:
        resident = list(dict.fromkeys(b % n for b in resident_raw))
        self.led = Ledger(n, resident, side, _policy(policy, period))
        self.oracle = NaiveLedger(n, resident, side, policy, period)
        self.fills: dict[int, Fill] = {}  # expert -> our pending fill
        self.done: list[Fill] = []  # published or failed fills (stale)
        self.snapshots: list[tuple[np.ndarray, list[int]]] = []

    # Draws are deliberately cheap (one bytes/int choice per argument, no preconditions): the
    # engine's per-draw cost dominates, and 100k steps must stay affordable on 2 cores.

    def _ids(self, raw: bytes) -> list[int]:
        return [b % self.led.n_experts for b in raw]

    def _reserve(self, raw: bytes, demand: bool, as_array: bool, prot: bytes) -> None:
        ids = self._ids(raw)
        protect = self._ids(prot)  # what concurrent demands wait for: never evicted or dropped
        arg: Any = np.array(ids, dtype=np.int64).reshape(-1, 1) if as_array else ids
        before = self.led.lookup()
        self.snapshots = [(before, before.tolist())]
        STEPS["count"] += 1
        try:
            want = self.oracle.reserve(ids, demand, protect)
        except CapacityError:
            with pytest.raises(CapacityError):
                self.led.reserve(arg, demand=demand, protect=protect)
            return
        got = self.led.reserve(arg, demand=demand, protect=protect)
        assert [(f.expert, f.row) for f in got] == want[0]
        assert self.led.blocked == want[1]
        for f in got:
            assert f.expert not in self.fills
            self.fills[f.expert] = f

    @rule(raw=st.binary(max_size=7), as_array=st.booleans())
    def reserve_predicted(self, raw: bytes, as_array: bool) -> None:
        self._reserve(raw, False, as_array, b"")

    @rule(raw=st.binary(max_size=7), as_array=st.booleans())
    def reserve_demand(self, raw: bytes, as_array: bool) -> None:
        self._reserve(raw, True, as_array, b"")

    @rule(raw=st.binary(max_size=7), prot=st.binary(min_size=1, max_size=3), demand=st.booleans())
    def reserve_protecting(self, raw: bytes, prot: bytes, demand: bool) -> None:
        """A reserve while older demands wait for ``prot`` (the runtime's fair demand)."""
        self._reserve(raw, demand, False, prot)

    @rule(pick=st.integers(0, 255), ok=st.booleans())
    def complete(self, pick: int, ok: bool) -> None:
        """Publish or fail a pending fill; with none pending, check a stale fill is refused."""
        if self.fills:
            e = sorted(self.fills)[pick % len(self.fills)]
            f = self.fills.pop(e)
            if ok:
                self.led.publish(f)
                self.oracle.publish(e)
                assert self.led.lookup()[e] == f.row
            else:
                self.led.fail(f)
                self.oracle.fail(e)
                assert self.led.free_rows()[-1:] == [f.row], "a failed fill's row goes back on top of the free stack"
            self.done.append(f)
            STEPS["count"] += 1
        elif self.done:
            f = self.done[pick % len(self.done)]
            with pytest.raises(LedgerError, match="not a pending fill"):
                (self.led.publish if ok else self.led.fail)(f)
            STEPS["count"] += 1

    @rule(raw=st.binary(min_size=1, max_size=4))
    def lease(self, raw: bytes) -> None:
        """Mostly a lease of holdable experts; sometimes one naming an absent/FILLING expert (refused)."""
        holdable = sorted(set(self.oracle.resident) | set(self.oracle.live))
        if raw[0] < 200 and holdable:
            ids = [holdable[b % len(holdable)] for b in raw]
            lid = self.led.lease(ids)
            self.oracle.lease(lid, ids)
            STEPS["count"] += 1
            return
        ids = self._ids(raw)
        if all(self.oracle.holdable(e) for e in ids):
            return
        before = self.led.pinned_rows()
        with pytest.raises(LedgerError, match="cannot lease expert"):
            self.led.lease(ids)
        assert self.led.pinned_rows() == before
        STEPS["count"] += 1

    @rule(pick=st.integers(0, 255))
    def release(self, pick: int) -> None:
        if not self.oracle.leases:
            return
        lid = sorted(self.oracle.leases)[pick % len(self.oracle.leases)]
        self.led.release(lid)
        del self.oracle.leases[lid]
        with pytest.raises(LedgerError):
            self.led.release(lid)
        STEPS["count"] += 1

    @rule(policy=st.sampled_from(["lfu", "oneshot", "lru", "aging"]), period=st.integers(1, 4))
    def switch_policy(self, policy: str, period: int) -> None:
        self.led.set_policy(_policy(policy, period))
        self.oracle.set_policy(policy, period)
        STEPS["count"] += 1

    @invariant()
    def audited_and_equal_to_the_oracle(self) -> None:
        if self.led is None:
            return
        report = self.led.audit()
        assert report.ok, report.problems
        o = self.oracle
        assert self.led.lookup().tolist() == o.table()
        assert self.led.free_rows() == o.free
        assert {f.expert: f.row for f in self.led.pending()} == o.filling
        pins: dict[int, int] = {}
        for rows in o.leases.values():
            for r in rows:
                pins[r] = pins.get(r, 0) + 1
        assert self.led.pinned_rows() == pins
        if isinstance(self.led.policy, _HeapPolicy):
            assert self.led.policy.score == o.score
        for snap, content in self.snapshots:  # an earlier lookup() never changes under the caller
            assert snap.tolist() == content


CI_SETTINGS = settings(
    max_examples=700,
    stateful_step_count=200,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)


def test_state_machine_runs_100k_steps() -> None:
    STEPS["count"] = 0
    run_state_machine_as_test(LedgerMachine, settings=CI_SETTINGS)
    print(f"ledger state machine: {STEPS['count']} audited transitions")
    assert STEPS["count"] >= 100_000, STEPS["count"]


# ---- the machine finds bugs: deliberately broken ledgers ---------------------------------------

# No shrinking: the point is that the bug is found, and shrinking a long trace costs minutes.
QUICK = settings(
    max_examples=300, stateful_step_count=40, derandomize=True, database=None, deadline=None,
    suppress_health_check=list(HealthCheck), phases=[Phase.generate],
)


def _leaky_fail(self: Ledger, fill: Fill) -> None:
    """Forgets to push the row back (the row leaks)."""
    f = self._take_pending(fill, "fail")
    self._row_state[f.row - self.cap] = 0
    self._row_owner[f.row - self.cap] = -1
    self.stats["failed"] += 1


def _make_side_region_double_reserve(real: Any) -> Any:
    def reserve(self: Ledger, ids: Any, *, demand: bool = False, protect: Any = ()) -> list[Fill]:
        hidden, self._filling = self._filling, {}  # like the side-region design: in-flight experts are absent
        try:
            return real(self, ids, demand=demand, protect=protect)
        finally:
            self._filling = {**hidden, **self._filling}

    return reserve


def _make_pin_blind(real: Any) -> Any:
    def reserve(self: Ledger, ids: Any, *, demand: bool = False, protect: Any = ()) -> list[Fill]:
        hidden, self._pins = self._pins, {}  # ignores leases when choosing victims
        try:
            return real(self, ids, demand=demand, protect=protect)
        finally:
            self._pins = hidden

    return reserve


def _make_protect_blind(real: Any) -> Any:
    def reserve(self: Ledger, ids: Any, *, demand: bool = False, protect: Any = ()) -> list[Fill]:
        return real(self, ids, demand=demand)  # evicts what older demands wait for

    return reserve


def _wrong_tie_break(self: Any, evictable: Any) -> int | None:
    cands = [e for e in self.score if evictable(e)]
    return max(cands, key=lambda e: (-self.score[e], e)) if cands else None  # ties: LARGEST id


def _stale_publish(self: Ledger, fill: Fill) -> None:
    """Publishes without invalidating the cached lookup snapshot."""
    f = self._take_pending(fill, "publish")
    self._row_state[f.row - self.cap] = 2
    self._live[f.expert] = f.row
    self._table[f.expert] = f.row
    self.policy.on_publish(f.expert)
    self.stats["published"] += 1


@pytest.mark.parametrize(
    "target, attr, make",
    [
        (Ledger, "fail", lambda real: _leaky_fail),
        (Ledger, "reserve", _make_side_region_double_reserve),
        (Ledger, "reserve", _make_pin_blind),
        (Ledger, "reserve", _make_protect_blind),
        (_HeapPolicy, "choose_victim", lambda real: _wrong_tie_break),
        (Ledger, "publish", lambda real: _stale_publish),
    ],
    ids=["leaky-fail", "side-region-double-reserve", "evicts-leased-rows", "evicts-protected", "lfu-tie-break",
         "stale-lookup"],
)
def test_state_machine_catches_a_broken_ledger(
    monkeypatch: pytest.MonkeyPatch, target: Any, attr: str, make: Any
) -> None:
    monkeypatch.setattr(target, attr, make(getattr(target, attr)))
    # A budget far past what any mutant needs, so that the self-check never depends on luck: the
    # examples drawn are not the same in every run (inside a full-suite run the protect-blind
    # ledger once went uncaught after 300 examples, though derandomized alone it is caught at
    # once; over random seeds it needs up to a few hundred), and a wrong tie-break needs two equal-frequency evictable experts at the
    # moment of eviction, rarer still (test_ledger.py's tables pin the rule exactly). A caught
    # mutant stops at its first failing example, so the budget costs nothing when the check works.
    budget = settings(QUICK, max_examples=3000)
    with pytest.raises(Exception) as info:
        run_state_machine_as_test(LedgerMachine, settings=budget)
    # Caught by an audit/oracle assertion, not by some unrelated crash.
    assert isinstance(info.value, AssertionError), repr(info.value)
