"""Rows lent to a fault handler: the ledger's lend / settle_fault / reclaim transitions.

Unit tests of each transition and its errors, the LRFU policy's ranking, and a hypothesis state
machine that mixes lending and faults with reserve / publish / fail / lease / release, auditing
every invariant after every step (a lent row is never pinned, refilled by a reserve or evicted by
one; the lookup table always names exactly the LIVE and resident experts).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from asyncside import Ledger, LedgerError
from asyncside.policies import LRFU, make_policy


def test_lendable_rows_leaves_out_filling_and_pinned_rows() -> None:
    """What lend() can give plus what is lent: a queued step is only started when its misses fit
    (a row still FILLING or pinned by a lease cannot be lent)."""
    led = Ledger(8, [0], 4, policy="lru")
    assert led.lendable_rows() == 4
    (filling,) = led.reserve([1])  # in flight
    (f2,) = led.reserve([2])
    led.publish(f2)
    led.lease([2])  # pinned
    assert led.lendable_rows() == 2
    rows = led.lend(4)
    assert len(rows) == 2 and led.lendable_rows() == 2  # lent rows count, nothing else was lendable
    led.publish(filling)
    assert led.lendable_rows() == 3  # the fill landed: its row can be lent now
    assert led.audit().ok


def test_lend_free_rows_first_then_victims_in_policy_order() -> None:
    led = Ledger(8, [0], 4, policy="lru")
    for e in (1, 2):
        (f,) = led.reserve([e])
        led.publish(f)
    led.record_use([1])  # 2 is now the least recently used
    free = set(led.free_rows())
    rows = led.lend(3)
    assert set(rows[:2]) == free and led.free_rows() == []  # free rows come first
    assert rows[2] == led.row_of(2)  # then the LRU victim
    assert led.lent_rows() == rows
    assert led.audit().ok
    # A lent row is never leased, evicted by a reserve, or lent twice.
    with pytest.raises(LedgerError, match="lent to a fault handler"):
        led.lease([2])
    assert led.lend(5) == [led.row_of(1)]
    assert led.reserve([3], demand=False) == []  # nothing left to take: every row is lent
    assert led.audit().ok


def test_settle_fault_and_reclaim() -> None:
    led = Ledger(8, [], 2, policy="lru")
    (f,) = led.reserve([4])
    led.publish(f)
    rows = led.lend(2)
    free_row = next(r for r in rows if r != led.row_of(4))
    led.settle_fault(free_row, -1, 6, ok=True)
    assert led.row_of(6) == free_row and led.lent_rows()[-1] == free_row  # still lent, at the back
    row4 = led.row_of(4)
    assert row4 is not None
    led.settle_fault(row4, 4, 7, ok=False)  # 4 evicted, the read of 7 failed: the row is empty
    assert led.state_of(4) == "absent" and led.state_of(7) == "absent"
    assert led.lookup().tolist() == [-1] * 6 + [free_row, -1]
    assert led.audit().ok
    with pytest.raises(LedgerError, match="the handler evicted 3"):
        led.settle_fault(free_row, 3, 5, ok=True)
    with pytest.raises(LedgerError, match="already live"):
        led.settle_fault(row4, -1, 6, ok=True)
    led.reclaim()
    assert led.lent_rows() == [] and led.state_of(6) == "live" and len(led.free_rows()) == 1
    with pytest.raises(LedgerError, match="not lent"):
        led.settle_fault(free_row, 6, 5, ok=True)
    with pytest.raises(LedgerError, match="not lent"):
        led.reclaim([free_row])
    assert led.stats["faulted"] == 1 and led.stats["fault_failures"] == 1
    assert led.audit().ok


def test_pinned_rows_are_not_lent() -> None:
    led = Ledger(8, [], 2, policy="lrfu")
    for e in (1, 2):
        (f,) = led.reserve([e])
        led.publish(f)
    lease = led.lease([1])
    assert led.lend(2) == [led.row_of(2)]
    led.release(lease)
    assert led.lend(2) == [led.row_of(1)]


def test_lrfu_ranks_by_decayed_frequency() -> None:
    """Four early uses outweigh one later use (half-life 8 reserves); with a half-life of one
    reserve, recency wins instead."""
    for half_life, victim in ((8.0, 2), (0.5, 1)):
        led = Ledger(8, [], 3, policy=LRFU(half_life))
        for ids in ([1], [1], [1], [1], [2], [0]):
            for f in led.reserve(ids):
                led.publish(f)
        assert led.lend(1) == [led.row_of(victim)], half_life
    with pytest.raises(LedgerError, match="half_life"):
        LRFU(0)
    assert make_policy("lrfu").native_order == "decayed" and make_policy("lru").native_order == "recency"


@settings(max_examples=200, deadline=None)
@given(uses=st.lists(st.lists(st.integers(0, 15), max_size=12), max_size=40),
       half_life=st.sampled_from([0.5, 3.0, 8.0]))
def test_lrfu_batched_hits_score_exactly_as_one_by_one(uses: list[list[int]], half_life: float) -> None:
    """on_hits (the ledger's one call per reserve) leaves the same scores, bit for bit, and the
    same victims as on_hit per expert, including across the heap's rebuilds."""
    one, batched, at_once = LRFU(half_life), LRFU(half_life), LRFU(half_life)
    for p in (one, batched, at_once):
        p.attach(object(), range(16))
    reserves = []
    for ids in uses:
        distinct = list(dict.fromkeys(ids))
        for p in (one, batched):
            p.begin(distinct)
        for e in distinct:
            one.on_hit(e)
        batched.on_hits(distinct)
        reserves.append((distinct, distinct))
        assert batched.score == one.score and batched._s == one._s
    at_once.on_reserves(reserves)  # the whole log in one call: the same final state
    assert at_once.score == one.score and at_once._s == one._s and at_once._clock == one._clock
    for p in (one, batched, at_once):
        assert p.audit(set(range(16))) == []
    taken: set[int] = set()
    for _ in range(16):  # the whole eviction order agrees
        v = one.choose_victim(lambda e: e not in taken)
        assert batched.choose_victim(lambda e: e not in taken) == v
        assert at_once.choose_victim(lambda e: e not in taken) == v
        assert v is not None
        taken.add(v)


@settings(max_examples=200, deadline=None)
@given(uses=st.lists(st.lists(st.integers(0, 15), max_size=12), max_size=40),
       policy=st.sampled_from(["lru", "lfu", "lrfu", "aging-lfu", "oneshot", "adaptive-lrfu"]),
       live=st.lists(st.integers(3, 15), max_size=8, unique=True))
def test_record_uses_at_once_leaves_the_state_of_one_reserve_at_a_time(uses: list[list[int]], policy: str,
                                                                      live: list[int]) -> None:
    """Ledger.record_uses (a fault table's whole log of reserves, as the queued steps' reconcile
    hands it) leaves the policy's scores bit for bit, the stats and the eviction order of
    record_use called once per reserve (experts 0-2 resident, some LIVE, ids repeated)."""
    ledgers = [Ledger(16, [0, 1, 2], 8, policy=policy) for _ in range(2)]
    for led in ledgers:
        for f in led.reserve(live):
            led.publish(f)
    one, at_once = ledgers
    for ids in uses:
        one.record_use(ids)
    flat = np.array([e for ids in uses for e in ids], dtype=np.int32)
    at_once.record_uses(flat, [len(ids) for ids in uses])
    assert at_once.stats == one.stats
    assert at_once.policy.snapshot() == one.policy.snapshot()
    assert getattr(at_once.policy, "_s", None) == getattr(one.policy, "_s", None)
    assert at_once.audit().ok and one.audit().ok
    taken: set[int] = set()
    for _ in range(len(live)):
        v = one.policy.choose_victim(lambda e: e not in taken)
        assert at_once.policy.choose_victim(lambda e: e not in taken) == v
        if v is not None:  # one-shot never picks a victim
            taken.add(v)
    with pytest.raises(LedgerError, match="sizes add up"):
        at_once.record_uses(flat, [len(flat) + 1])


class LendMachine(RuleBasedStateMachine):
    """Random lends, faults, reclaims mixed with the ledger's other transitions."""

    @initialize(n=st.integers(2, 10), side=st.integers(1, 6), n_res=st.integers(0, 3),
                policy=st.sampled_from(["lru", "lfu", "lrfu", "aging-lfu", "oneshot", "adaptive-lrfu"]))
    def setup(self, n: int, side: int, n_res: int, policy: str) -> None:
        self.led = Ledger(n, list(range(min(n_res, n - 1))), side, policy=policy)
        self.pending: list = []
        self.leases: list[int] = []

    @rule(ids=st.lists(st.integers(0, 9), max_size=4), demand=st.booleans())
    def reserve(self, ids: list[int], demand: bool) -> None:
        ids = [e % self.led.n_experts for e in ids]
        try:
            fills = self.led.reserve(ids, demand=demand)
        except Exception:  # CapacityError on an impossible demand
            return
        for f in fills:
            assert f.row not in self.led.lent_rows()
        self.pending.extend(fills)

    @precondition(lambda self: self.pending)
    @rule(ok=st.booleans(), i=st.integers(0, 100))
    def finish_fill(self, ok: bool, i: int) -> None:
        f = self.pending.pop(i % len(self.pending))
        (self.led.publish if ok else self.led.fail)(f)

    @rule(count=st.integers(0, 4))
    def lend(self, count: int) -> None:
        before = set(self.led.lent_rows())
        rows = self.led.lend(count)
        assert len(rows) <= count and not set(rows) & before
        for r in rows:
            assert r not in self.led.pinned_rows()

    @precondition(lambda self: self.led.lent_rows())
    @rule(i=st.integers(0, 100), e=st.integers(0, 9), ok=st.booleans())
    def fault(self, i: int, e: int, ok: bool) -> None:
        led = self.led
        rows = led.lent_rows()
        row = rows[i % len(rows)]
        e %= led.n_experts
        if led.state_of(e) != "absent":
            return
        owner = next((x for x, r in led.live().items() if r == row), -1)
        led.settle_fault(row, owner, e, ok)
        assert (led.row_of(e) == row) == ok and row in led.lent_rows()

    @rule()
    def reclaim(self) -> None:
        self.led.reclaim()
        assert self.led.lent_rows() == []

    @rule(ids=st.lists(st.integers(0, 9), min_size=1, max_size=3))
    def lease(self, ids: list[int]) -> None:
        ids = [e % self.led.n_experts for e in ids]
        try:
            self.leases.append(self.led.lease(ids))
        except LedgerError:
            return

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 100))
    def release(self, i: int) -> None:
        self.led.release(self.leases.pop(i % len(self.leases)))

    @rule(ids=st.lists(st.integers(0, 9), max_size=4))
    def use(self, ids: list[int]) -> None:
        self.led.record_use([e % self.led.n_experts for e in ids])

    @invariant()
    def audit_clean(self) -> None:
        report = self.led.audit()
        assert report.ok, report.problems


def test_lend_state_machine() -> None:
    run_state_machine_as_test(
        LendMachine,
        settings=settings(max_examples=150, stateful_step_count=60, deadline=None, derandomize=True,
                          database=None, suppress_health_check=list(HealthCheck)),
    )
