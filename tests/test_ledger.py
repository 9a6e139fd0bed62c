"""The ledger against the side-region design's rules, its fixes, and its input checks.

``SideRegionModel`` below is a line-for-line Python model of the side-region design's C++
``reserve`` and ``read_publish`` (docs/design.md describes it): ``e2r`` is a std::map (iterated in
key order), ``free_rows`` a vector used as a stack (``back()``/``pop_back()``), ``freq`` the LFU
scores. A fill that is reserved but not yet published is invisible to it -- which is the row leak.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncside import CapacityError, Fill, Ledger, LedgerError
from asyncside.ledger import validate_ids
from asyncside.policies import LFU, AgingLFU


class SideRegionModel:
    """Model of the side-region design's C++ cache of one layer (LFU or legacy one-shot)."""

    def __init__(self, resident: list[int], spec: int, base: int, lfu: bool = True) -> None:
        self.resident = set(resident)
        self.lfu = lfu
        self.e2r: dict[int, int] = {}
        self.free_rows = [base + r for r in range(spec)]
        self.freq: dict[int, int] = {}
        self.spec, self.base = spec, base

    def reserve(self, ids: list[int]) -> list[tuple[int, int]]:
        P: list[int] = []
        seen: set[int] = set()
        for e in ids:
            if e in self.resident or e in seen:
                continue
            seen.add(e)
            P.append(e)
        Pset = set(P)
        to_read: list[tuple[int, int]] = []
        if not self.lfu:
            for e in sorted(self.e2r):  # std::map order
                if e not in Pset:
                    self.free_rows.append(self.e2r.pop(e))
            for e in P:
                if e in self.e2r or not self.free_rows:
                    continue
                to_read.append((e, self.free_rows.pop()))
            return to_read
        for e in P:
            if e in self.e2r:
                self.freq[e] = self.freq.get(e, 0) + 1
        for e in P:
            if e in self.e2r:
                continue
            if self.free_rows:
                row = self.free_rows.pop()
            else:
                victim, best = -1, 0
                for v in sorted(self.e2r):
                    if v in Pset:
                        continue
                    f = self.freq.get(v, 0)
                    if victim < 0 or f < best or (f == best and v < victim):
                        victim, best = v, f
                if victim < 0:
                    continue
                row = self.e2r.pop(victim)
                self.freq.pop(victim, None)
            to_read.append((e, row))
        return to_read

    def read_publish(self, to_read: list[tuple[int, int]], failed: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        done = []
        for e, row in to_read:
            if e in failed:
                self.free_rows.append(row)  # read failed: row back to free
                continue
            done.append((e, row))
        for e, row in done:
            self.e2r[e] = row
            self.freq.setdefault(e, 1)

    def accounted_rows(self) -> set[int]:
        return set(self.free_rows) | set(self.e2r.values())


# ---- table-driven: hand-written sequences, expected (expert, row) decisions ---------------------
#
# resident = [0, 1] (rows 0, 1); side rows 2, 3, 4; the free stack starts [2, 3, 4] so the first
# reservation takes row 4. Ops: ("reserve", ids, expected fills) then publish the batch, or
# ("reserve_fail", ids, expected fills, failed experts) which fails those and publishes the rest.

RESIDENT = [0, 1]
SIDE = 3

TABLE: list[tuple[str, str, list[Any]]] = [
    (
        "lfu: free rows from the top of the stack, then lowest freq, ties smallest id",
        "lfu",
        [
            ("reserve", [5, 6, 0, 5, 1], [(5, 4), (6, 3)]),  # residents and duplicates skipped
            ("reserve", [7, 5], [(7, 2)]),  # 5 bumped to 2
            ("reserve", [8], [(8, 3)]),  # victims 6 (1), 7 (1): tie -> 6, its row 3
            ("reserve", [9, 8, 7], [(9, 4)]),  # 8->2, 7->2; only 5 (2) is not predicted
            ("reserve", [10, 9, 8, 7], []),  # every LIVE expert is predicted: 10 is skipped
            ("reserve", [10, 9], [(10, 2)]),  # 9->3; victims 7 (3), 8 (3): tie -> 7, row 2
        ],
    ),
    (
        "lfu: a failed fill pushes its row back on top of the free stack",
        "lfu",
        [
            ("reserve_fail", [5, 6], [(5, 4), (6, 3)], {6}),
            ("reserve", [7], [(7, 3)]),
            ("reserve", [8, 9], [(8, 2), (9, 4)]),  # 8 takes row 2; 9: victims 5 (1), 7 (1) -> 5, row 4
        ],
    ),
    (
        "lfu: the evicted expert's frequency is forgotten",
        "lfu",
        [
            ("reserve", [5, 6, 7], [(5, 4), (6, 3), (7, 2)]),
            ("reserve", [5, 6], []),  # 5->2, 6->2
            ("reserve", [5, 6], []),  # 5->3, 6->3
            ("reserve", [8], [(8, 2)]),  # evicts 7 (1)
            ("reserve", [9, 8], [(9, 4)]),  # 8->2; victims 5 (3), 6 (3) -> 5 (row 4)
            ("reserve", [5, 9, 8], [(5, 3)]),  # 5 is new again (freq 1 on publish); victim 6 (3)
        ],
    ),
    (
        "one-shot: drops every unpredicted expert (rows pushed in expert order), then fills from free",
        "oneshot",
        [
            ("reserve", [5, 6, 7], [(5, 4), (6, 3), (7, 2)]),
            ("reserve", [6, 8], [(8, 2)]),  # drop 5 (row 4), 7 (row 2): free [4, 2]; 8 takes 2
            ("reserve", [9, 10, 11, 12], [(9, 2), (10, 3), (11, 4)]),  # drop 6 (3), 8 (2); 12: no row
            ("reserve", [11, 0, 9], []),  # drops 10; 9 and 11 stay
        ],
    ),
    (
        "one-shot: a failed fill returns its row",
        "oneshot",
        [
            ("reserve_fail", [5, 6, 7], [(5, 4), (6, 3), (7, 2)], {5, 7}),
            ("reserve", [6, 8, 9], [(8, 2), (9, 4)]),
        ],
    ),
]


def _run_side_region(policy: str, ops: list[Any]) -> list[list[tuple[int, int]]]:
    orig = SideRegionModel(RESIDENT, SIDE, len(RESIDENT), lfu=(policy == "lfu"))
    out = []
    for op in ops:
        fills = orig.reserve(op[1])
        out.append(fills)
        orig.read_publish(fills, op[3] if op[0] == "reserve_fail" else set())
        assert len(orig.accounted_rows()) == SIDE
    return out


def _run_ours(policy: str, ops: list[Any]) -> list[list[tuple[int, int]]]:
    led = Ledger(16, RESIDENT, SIDE, policy)
    out = []
    for op in ops:
        fills = led.reserve(op[1])
        out.append([(f.expert, f.row) for f in fills])
        failed = op[3] if op[0] == "reserve_fail" else set()
        for f in fills:
            (led.fail if f.expert in failed else led.publish)(f)
        report = led.audit()
        assert report.ok, report.problems
    return out


@pytest.mark.parametrize("name, policy, ops", TABLE, ids=[t[0].split(":")[0] + str(i) for i, t in enumerate(TABLE)])
def test_decisions_match_the_side_region_rules(name: str, policy: str, ops: list[Any]) -> None:
    expected = [op[2] for op in ops]
    assert _run_side_region(policy, ops) == expected, "the side-region model disagrees with the table"
    assert _run_ours(policy, ops) == expected


@pytest.mark.parametrize("policy", ["lfu", "oneshot"])
def test_double_reserve_leaked_a_row_in_the_side_region_not_in_ours(policy: str) -> None:
    # The side region: expert 5 is reserved, and predicted again before its read publishes.
    orig = SideRegionModel(RESIDENT, SIDE, 2, lfu=(policy == "lfu"))
    first = orig.reserve([5])
    second = orig.reserve([5])  # 5 is not in e2r yet: a second row is reserved
    assert first == [(5, 4)] and second == [(5, 3)]
    orig.read_publish(first)
    orig.read_publish(second)  # e2r[5] = 3 overwrites e2r[5] = 4
    assert orig.e2r == {5: 3} and orig.free_rows == [2]
    assert orig.accounted_rows() == {2, 3}, "row 4 is neither free nor owned: leaked"
    # ... forever: however the side region is driven now, it never uses row 4 again.
    used = set()
    for batch in ([6, 7, 8], [9, 10], [11], [12, 13, 14], [5, 6]):
        fills = orig.reserve(batch)
        used |= {r for _, r in fills}
        orig.read_publish(fills)
    assert 4 not in used and orig.accounted_rows() == {2, 3}

    # Ours: the in-flight expert counts as present, so no second row, and nothing leaks.
    led = Ledger(16, RESIDENT, SIDE, policy)
    (f1,) = led.reserve([5])
    assert (f1.expert, f1.row) == (5, 4)
    assert led.reserve([5]) == [] and led.is_filling(5)
    assert led.stats["filling_hits"] == 1
    led.publish(f1)
    assert led.row_of(5) == 4 and led.free_rows() == [2, 3]
    used = set()
    for batch in ([6, 7, 8], [9, 10], [11], [12, 13, 14], [5, 6]):
        fills = led.reserve(batch)
        used |= {f.row for f in fills}
        for f in fills:
            led.publish(f)
        assert led.audit().ok
    assert used == {2, 3, 4}


@settings(max_examples=150, derandomize=True, database=None, deadline=None)
@given(
    policy=st.sampled_from(["lfu", "oneshot"]),
    side=st.integers(0, 5),
    steps=st.lists(
        st.tuples(st.lists(st.integers(0, 11), max_size=8), st.sets(st.integers(0, 11), max_size=3)),
        max_size=30,
    ),
)
def test_same_decisions_as_the_side_region_when_fills_finish_between_reserves(
    policy: str, side: int, steps: list[tuple[list[int], set[int]]]
) -> None:
    """Differential: when every batch completes before the next reserve (no FILLING overlap, no
    leases), ours and the side region make the very same (expert, row) decisions."""
    orig = SideRegionModel([0, 3], side, 2, lfu=(policy == "lfu"))
    led = Ledger(12, [0, 3], side, policy)
    for ids, failed in steps:
        want = orig.reserve(ids)
        got = led.reserve(np.array(ids, dtype=np.int64))
        assert [(f.expert, f.row) for f in got] == want
        orig.read_publish(want, failed)
        for f in got:
            (led.fail if f.expert in failed else led.publish)(f)
        assert led.live() == orig.e2r
        assert led.free_rows() == orig.free_rows
        if policy == "lfu":
            assert isinstance(led.policy, LFU) and led.policy.score == orig.freq


# ---- the fixes ----------------------------------------------------------------------------------


def test_filling_expert_is_not_evictable() -> None:
    led = Ledger(10, [], 2)
    a, b = led.reserve([4, 5])
    assert led.reserve([6]) == [] and led.stats["skipped"] == 1  # both rows FILLING: nothing to evict
    led.publish(a)
    (c,) = led.reserve([6])
    assert (c.expert, c.row) == (6, a.row)  # the LIVE one was evicted, the FILLING one kept
    assert led.is_filling(5) and led.audit().ok


def test_publish_and_fail_act_only_on_their_own_fill() -> None:
    led = Ledger(10, [], 3)
    f = led.reserve([4])[0]
    with pytest.raises(LedgerError, match="pending fill 0 is"):
        led.publish(Fill(f.fill_id, f.expert, f.row - 1))
    with pytest.raises(LedgerError, match="not a pending fill"):
        led.publish(Fill(99, 4, f.row))
    with pytest.raises(LedgerError, match="needs a Fill"):
        led.publish((0, 4, 2))  # type: ignore[arg-type]
    led.publish(f)
    with pytest.raises(LedgerError, match="already published or failed"):
        led.publish(f)
    with pytest.raises(LedgerError, match="already published or failed"):
        led.fail(f)
    assert led.row_of(4) == f.row and led.audit().ok


def test_failed_fill_returns_its_row_and_expert_can_be_reserved_again() -> None:
    led = Ledger(10, [1], 2)
    f = led.reserve([4])[0]
    led.fail(f)
    assert led.state_of(4) == "absent" and led.free_rows() == [1, 2]
    g = led.reserve([4])[0]
    assert g.row == f.row and g.fill_id > f.fill_id
    assert led.stats["failed"] == 1 and led.audit().ok


def test_leases_pin_against_lfu_victim_choice() -> None:
    led = Ledger(10, [0], 2, "lfu")
    a, b = led.reserve([3, 4])  # 3 -> row 2, 4 -> row 1
    led.publish(a), led.publish(b)
    led.reserve([4])  # freq 3:1, 4:2 -> the victim would be 3
    lease = led.lease([3])
    (f,) = led.reserve([5])
    assert (f.expert, f.row) == (5, b.row), "3 is leased, so 4 (the next lowest) gives up its row"
    led.publish(f)
    lease2 = led.lease(np.array([[3, 5]]))  # several leases may pin one row
    assert led.reserve([6]) == [] and led.stats["skipped"] == 1
    led.release(lease)
    assert led.reserve([6]) == [], "3 is still pinned by the second lease"
    led.release(lease2)
    (g,) = led.reserve([6])
    assert g.expert == 6 and led.audit().ok
    with pytest.raises(LedgerError, match="already released"):
        led.release(lease)


def test_one_shot_keeps_leased_experts() -> None:
    led = Ledger(10, [], 3, "oneshot")
    for f in led.reserve([4, 5, 6]):
        led.publish(f)
    lease = led.lease([5])
    fills = led.reserve([7])
    assert set(led.live()) == {5} and [f.expert for f in fills] == [7]
    led.release(lease)
    led.reserve([8])
    assert set(led.live()) == set() and led.audit().ok


def test_lease_refuses_absent_and_filling_experts() -> None:
    led = Ledger(10, [0], 2)
    f = led.reserve([4])[0]
    with pytest.raises(LedgerError, match="cannot lease expert 4: it is FILLING"):
        led.lease([0, 4])
    with pytest.raises(LedgerError, match="cannot lease expert 5: it is absent"):
        led.lease(5)
    assert led.pinned_rows() == {}, "a refused lease pins nothing"
    led.publish(f)
    lid = led.lease([0, 4, 4])
    assert led.pinned_rows() == {0: 1, f.row: 1}
    led.release(lid)
    assert led.pinned_rows() == {} and led.audit().ok


# ---- demand ---------------------------------------------------------------------------------------


def test_demand_blocks_instead_of_skipping_and_never_evicts_its_own_batch() -> None:
    led = Ledger(10, [0], 2, "lfu")
    a, b = led.reserve([3, 4])
    led.publish(a)
    lease = led.lease([3])
    fills = led.reserve([5, 3, 0], demand=True)
    # 3 is in the batch (and leased), 4 is FILLING: nothing can give 5 a row now.
    assert fills == [] and led.blocked == [5] and led.stats["blocked"] == 1
    led.publish(b)
    fills = led.reserve([5, 4], demand=True)  # 4 is in the batch, 3 is leased
    assert fills == [] and led.blocked == [5]
    led.release(lease)
    (f,) = led.reserve([5, 4], demand=True)
    assert (f.expert, f.row) == (5, a.row) and led.blocked == []
    assert led.audit().ok


def test_demand_raises_capacity_error_only_when_it_can_never_fit() -> None:
    led = Ledger(10, [0, 1], 2)
    with pytest.raises(CapacityError, match="3 distinct non-resident experts.*2 rows"):
        led.reserve([0, 1, 2, 3, 4], demand=True)
    assert led.pending() == [] and led.stats["reserves"] == 0, "a refused demand changes nothing"
    assert led.reserve([0, 1, 2, 3, 4]) != []  # prediction just skips
    assert Ledger(10, [0], 0).reserve([0, 0], demand=True) == []


# ---- policies -----------------------------------------------------------------------------------


def test_lru_evicts_least_recently_used() -> None:
    led = Ledger(10, [], 3, "lru")
    for f in led.reserve([1, 2, 3]):
        led.publish(f)  # publish order = use order: 1, 2, 3
    led.reserve([1])  # 1 used again
    lid = led.lease([2])  # a lease counts as a use too
    led.release(lid)
    (f,) = led.reserve([4])
    assert (f.expert, f.row) == (4, 0) and led.state_of(3) == "absent"  # 3 (row 0) is least recently used
    assert led.audit().ok


def test_aging_lfu_halves_frequencies_every_period() -> None:
    led = Ledger(10, [], 2, AgingLFU(period=4))
    a, b = led.reserve([1, 2])  # reserve 1
    led.publish(a), led.publish(b)
    for _ in range(2):
        led.reserve([1])  # reserves 2, 3: freq 1 -> 3
    assert led.policy.score == {1: 3, 2: 1}  # type: ignore[attr-defined]
    led.reserve([])  # reserve 4: halve -> 1: 1, 2: 0
    assert led.policy.score == {1: 1, 2: 0}  # type: ignore[attr-defined]
    with pytest.raises(LedgerError, match="period must be a positive int, got 0"):
        AgingLFU(period=0)


def test_set_policy_starts_from_live_experts() -> None:
    led = Ledger(10, [], 3, "oneshot")
    for f in led.reserve([5, 2, 7]):
        led.publish(f)
    led.set_policy("lfu")
    assert led.policy.score == {2: 1, 5: 1, 7: 1}  # type: ignore[attr-defined]
    led.reserve([5, 7])
    (f,) = led.reserve([9])
    assert led.state_of(2) == "absent" and f.expert == 9 and led.audit().ok
    with pytest.raises(LedgerError, match="unknown policy 'mru'"):
        led.set_policy("mru")


def test_policy_instance_belongs_to_one_ledger() -> None:
    p = LFU()
    Ledger(4, [], 1, p)
    with pytest.raises(LedgerError, match="already attached"):
        Ledger(4, [], 1, p)


# ---- lookup -----------------------------------------------------------------------------------


def test_lookup_is_a_read_only_snapshot_updated_on_change() -> None:
    led = Ledger(8, [6, 2], 2)
    t0 = led.lookup()
    assert t0.dtype == np.int32 and t0.tolist() == [-1, -1, 1, -1, -1, -1, 0, -1]
    assert led.lookup() is t0, "no change: the cached snapshot is returned"
    with pytest.raises(ValueError):
        t0[0] = 3
    f = led.reserve([4])[0]
    assert led.lookup() is t0, "a FILLING expert is not in the table"
    led.publish(f)
    t1 = led.lookup()
    assert t1[4] == f.row and t0[4] == -1, "earlier snapshots never change"
    (g,) = led.reserve([5])
    (h,) = led.reserve([1])
    led.publish(g), led.publish(h)
    assert led.lookup()[4] == -1 and led.lookup()[1] == h.row == f.row


# ---- input validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ids, match",
    [
        (-1, r"expert id -1 out of range \[0, 8\)"),
        (8, r"expert id 8 out of range \[0, 8\)"),
        ([1, 2, 99], r"expert id 99 out of range \[0, 8\)"),
        ((3, -4), r"expert id -4 out of range"),
        (np.array([[1, 2], [3, 8]]), r"expert id 8 out of range \[0, 8\)"),
        (np.array([-2, 1], dtype=np.int8), r"expert id -2 out of range"),
        (np.array([1.0, 2.0]), r"integer array, got dtype float64"),
        (np.array([True, False]), r"integer array, got dtype bool"),
        (1.0, r"got 1.0 \(float\)"),
        (True, r"got True \(bool\)"),
        ([1, True], r"got True \(bool\)"),
        ([1, 2.5], r"got 2.5 \(float\)"),
        ([np.float32(1)], r"got np.float32\(1.0\)"),
        ([np.bool_(True)], r"got np.True_"),
        ("12", r"got '12' \(str\)"),
        (None, r"got None \(NoneType\)"),
        ([[1, 2], [3, "x"]], r"got 'x' \(str\)"),
    ],
)
def test_reserve_rejects_bad_ids_naming_the_value(ids: Any, match: str) -> None:
    led = Ledger(8, [0], 2)
    with pytest.raises(LedgerError, match=match):
        led.reserve(ids)
    with pytest.raises(LedgerError, match=match):
        led.lease(ids)
    assert led.stats["reserves"] == 0 and led.audit().ok


def test_accepted_id_forms() -> None:
    assert validate_ids(3, 8) == [3]
    assert validate_ids(np.uint8(3), 8) == [3]
    assert validate_ids([1, (2, 3), np.array([4])], 8) == [1, 2, 3, 4]
    assert validate_ids(range(3), 8) == [0, 1, 2]
    assert validate_ids(np.arange(6, dtype=np.uint32).reshape(2, 3), 8) == [0, 1, 2, 3, 4, 5]
    assert validate_ids(np.array([], dtype=np.int32), 8) == []
    assert validate_ids(np.asarray([]), 8) == []  # no ids, whatever numpy's default dtype
    with pytest.raises(LedgerError, match=r"^layer 5: expert id 9 out of range \[0, 8\)$"):
        validate_ids(np.array([1, 9]), 8, layer=5)
    with pytest.raises(LedgerError, match=r"^layer 2: expert ids must be an integer array, got dtype float64"):
        validate_ids(np.array([1.5]), 8, layer=2)
    mx = pytest.importorskip("mlx.core")
    assert validate_ids(mx.array([[7, 1]], dtype=mx.uint32), 8) == [7, 1]
    with pytest.raises(LedgerError, match="float32"):
        validate_ids(mx.array([1.0]), 8)


@pytest.mark.parametrize(
    "args, match",
    [
        ((0, [], 1), r"n_experts must be an int in \[1, .*got 0"),
        ((8.0, [], 1), r"got 8.0"),
        ((8, [], -1), r"side_rows must be a non-negative int, got -1"),
        ((8, [], True), r"got True"),
        ((8, [1, 9], 1), r"resident expert 9 out of range \[0, 8\)"),
        ((8, [1, 3, 1], 1), r"resident expert 1 is listed twice"),
        ((8, [1.5], 1), r"got 1.5"),
    ],
)
def test_constructor_rejects_bad_arguments(args: tuple, match: str) -> None:
    with pytest.raises(LedgerError, match=match):
        Ledger(*args)


def test_queries_validate_their_expert() -> None:
    led = Ledger(4, [1], 1)
    for fn in (led.row_of, led.is_filling, led.fill_of, led.state_of):
        with pytest.raises(LedgerError, match="expert id 4 out of range"):
            fn(4)
    assert led.row_of(1) == 0 and led.state_of(1) == "resident" and led.row_of(2) is None
    with pytest.raises(LedgerError, match="unknown or already released lease 7"):
        led.release(7)


def test_audit_reports_corruption_without_raising() -> None:
    led = Ledger(8, [0], 3)
    for f in led.reserve([4, 5]):
        led.publish(f)
    led._free.append(led._live[4])  # corrupt: a LIVE row also on the free stack
    report = led.audit()
    assert not report.ok and any("both free and owned by expert 4" in p for p in report.problems)
    led._pending = None  # type: ignore[assignment]
    report = led.audit()
    assert not report.ok and any("audit crashed" in p for p in report.problems)


def test_ledger_imports_no_io_runtime_mlx_or_native_code() -> None:
    """The ledger stays sans-I/O: importing it (and the package) pulls in no MLX, anyio or native code."""
    import subprocess
    import sys

    code = (
        "import sys, asyncside, asyncside.ledger, asyncside.policies\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'anyio', 'trio', 'aiofiles')"
        " or m == 'asyncside._native')\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
