"""The side-region ledger: which expert owns which pool row of one layer. Sans-I/O.

This module is the ONLY code that mutates row state. It does no I/O, imports no anyio, no MLX and
no native code (numpy only), so a hypothesis state machine can drive it alone.

Rows ``[0, cap)`` hold the resident experts (``resident[i]`` in row ``i``); rows
``[cap, cap + side_rows)`` form the side region, where each row is in exactly one state:

    FREE --reserve--> FILLING(expert, fill) --publish(fill)--> LIVE(expert) --evict/drop--> FREE
                            \\--fail(fill)--> FREE

Rows can also be *lent* to a native fault handler (queued decode steps, see
:mod:`asyncside.runtime`): a lent row is either LIVE(expert) (its expert stays readable until the
handler reuses the row) or LENT (it was free). The ledger never evicts, refills or leases a lent
row; the handler may fill it with a faulted expert, which the ledger learns afterwards
(:meth:`Ledger.settle_fault`), or the row comes back unused (:meth:`Ledger.reclaim`):

    FREE --lend--> LENT --settle_fault(ok)--> LIVE(new), lent ; --settle_fault(failed)--> LENT ; --reclaim--> FREE
    LIVE(e) --lend--> LIVE(e), lent --settle_fault(ok)--> LIVE(new), lent (e evicted) ; --reclaim--> LIVE(e)

What it fixes in the side-region design this project grows from (docs/design.md):

- an expert whose fill is in flight counts as present: it is never reserved a second time (a
  second reservation would take a second row, and the later publish would leak one of them) and
  it is not evictable while FILLING;
- ``publish``/``fail`` act only on the exact pending :class:`Fill` they are given;
- a failed fill returns its row to the free stack;
- rows under a lease (a forward may still read them) are never evicted or dropped.

The free rows form a stack, as in the side-region design (so the two make the same decisions on
the same inputs, which tests/test_ledger.py checks): initialised ``cap, cap+1, ...`` so the first
reservation takes the last side row; failed fills and one-shot drops push rows back.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import CapacityError, LedgerError
from .policies import DEFAULT_POLICY, Policy, make_policy

FREE, FILLING, LIVE, LENT = 0, 1, 2, 3
_STATE_NAMES = {FREE: "FREE", FILLING: "FILLING", LIVE: "LIVE", LENT: "LENT"}
_INT32_MAX = 2**31 - 1


def _frozen_copy(a: np.ndarray) -> np.ndarray:
    """A read-only copy (the snapshots handed out must not change under their holders)."""
    out = a.copy()
    out.flags.writeable = False
    return out


@dataclass(frozen=True)
class Fill:
    """One read the ledger asks for: the record of ``expert`` into pool row ``row``."""

    fill_id: int
    expert: int
    row: int


@dataclass
class AuditReport:
    """Result of :meth:`Ledger.audit`: ``ok`` is True iff ``problems`` is empty."""

    ok: bool
    problems: list[str]
    counts: dict[str, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.ok


def _int_or_raise(v: Any, n_experts: int, what: str) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise LedgerError(f"{what}s must be integers in [0, {n_experts}), got {v!r} ({type(v).__name__})")
    if not 0 <= v < n_experts:
        raise LedgerError(f"{what} {int(v)} out of range [0, {n_experts})")
    return int(v)


def validate_ids(ids: Any, n_experts: int, what: str = "expert id", *, layer: int | None = None) -> list[int]:
    """Flatten ``ids`` into a list of Python ints in ``[0, n_experts)``: the one check of expert ids
    (the ledger, the runtime and the model's expert sources all use it).

    Accepts an int, a (nested) list/tuple/range/iterable of ints, or an integer numpy array of
    any shape (anything with ``__array__``, e.g. an evaluated mx.array, goes through numpy; an
    empty array of any dtype is no ids). Rejects floats and bools (also as array dtypes) and
    out-of-range values with a LedgerError naming the value, the valid range and, when given,
    the layer.
    """
    try:
        return _validate_ids(ids, n_experts, what)
    except LedgerError as exc:
        if layer is None:
            raise
        raise LedgerError(f"layer {layer}: {exc}") from None


def _validate_ids(ids: Any, n_experts: int, what: str) -> list[int]:
    if isinstance(ids, (int, np.integer)) and not isinstance(ids, (bool, np.bool_)):
        return [_int_or_raise(ids, n_experts, what)]
    if not isinstance(ids, np.ndarray) and hasattr(ids, "__array__") and not isinstance(ids, (list, tuple)):
        ids = np.asarray(ids)
    if isinstance(ids, np.ndarray):
        flat = ids.ravel()
        if not flat.size:
            return []
        if ids.dtype.kind not in "iu":
            raise LedgerError(f"{what}s must be an integer array, got dtype {ids.dtype} (values {flat[:8]!r})")
        lo, hi = flat.min(), flat.max()
        if lo < 0 or hi >= n_experts:
            bad = lo if lo < 0 else hi
            raise LedgerError(f"{what} {int(bad)} out of range [0, {n_experts})")
        return flat.tolist()
    if isinstance(ids, (str, bytes, float, bool, np.bool_, np.floating)):
        raise LedgerError(f"{what}s must be integers in [0, {n_experts}), got {ids!r} ({type(ids).__name__})")
    try:
        items = iter(ids)
    except TypeError:
        raise LedgerError(f"{what}s must be integers in [0, {n_experts}), got {ids!r} ({type(ids).__name__})") from None
    out: list[int] = []
    for v in items:
        if isinstance(v, (list, tuple, np.ndarray)):
            out.extend(_validate_ids(v, n_experts, what))
        else:
            out.append(_int_or_raise(v, n_experts, what))
    return out


class Ledger:
    """Row ownership of one layer's pools (see module docstring)."""

    def __init__(
        self, n_experts: int, resident: Sequence[int], side_rows: int, policy: Policy | str = DEFAULT_POLICY
    ) -> None:
        if not isinstance(n_experts, int) or isinstance(n_experts, bool) or not 1 <= n_experts <= _INT32_MAX:
            raise LedgerError(f"n_experts must be an int in [1, {_INT32_MAX}], got {n_experts!r}")
        if not isinstance(side_rows, int) or isinstance(side_rows, bool) or side_rows < 0:
            raise LedgerError(f"side_rows must be a non-negative int, got {side_rows!r}")
        res = validate_ids(resident, n_experts, "resident expert")
        if len(set(res)) != len(res):
            dup = next(e for i, e in enumerate(res) if e in res[:i])
            raise LedgerError(f"resident expert {dup} is listed twice")
        self.n_experts = n_experts
        self.resident: tuple[int, ...] = tuple(res)
        self.cap = len(res)
        self.side_rows = side_rows
        self.rows = self.cap + side_rows
        if self.rows > _INT32_MAX:
            raise LedgerError(f"cap + side_rows = {self.rows} does not fit int32 row indices")

        self._resident_row = {e: i for i, e in enumerate(res)}
        self._free: list[int] = list(range(self.cap, self.rows))  # a stack: pop() takes the last
        self._row_state = [FREE] * side_rows  # indexed by row - cap
        self._row_owner = [-1] * side_rows
        self._live: dict[int, int] = {}  # expert -> row
        self._filling: dict[int, Fill] = {}  # expert -> its pending fill
        self._pending: dict[int, Fill] = {}  # fill_id -> fill
        self._pins: dict[int, int] = {}  # row -> number of leases pinning it
        self._leases: dict[int, tuple[int, ...]] = {}  # lease id -> rows
        self._lent: dict[int, None] = {}  # rows lent to a fault handler, in lend order
        self._fill_ids = itertools.count()
        self._lease_ids = itertools.count(1)
        self._table = np.full(n_experts, -1, dtype=np.int32)
        for e, r in self._resident_row.items():
            self._table[e] = r
        self._snapshot: np.ndarray | None = None
        # Per row: how many fills it has been handed. A row whose count is unchanged since some
        # moment has not been written since then (writes happen only to FILLING rows), which is
        # what lets a forward that gathered rows speculatively prove its rows were stable.
        self._gen = np.zeros(self.rows, dtype=np.int64)
        self.blocked: list[int] = []
        self.stats: dict[str, int] = dict.fromkeys(
            (
                "reserves",
                "hits",
                "resident_hits",
                "filling_hits",
                "misses",
                "reserved",
                "published",
                "failed",
                "evictions",
                "skipped",
                "blocked",
                "leases",
                "releases",
                "lent",
                "faulted",
                "fault_failures",
                "reclaimed",
            ),
            0,
        )
        self.policy = make_policy(policy)
        self.policy.attach(self, ())

    def __repr__(self) -> str:
        return (
            f"Ledger(n_experts={self.n_experts}, cap={self.cap}, side_rows={self.side_rows}, "
            f"policy={self.policy.name!r}, live={len(self._live)}, filling={len(self._filling)}, "
            f"free={len(self._free)})"
        )

    # ---- policy ---------------------------------------------------------------------------

    def set_policy(self, policy: Policy | str) -> None:
        """Switch policy; the new one starts from the LIVE experts (ascending id) as just published."""
        new = make_policy(policy)
        new.attach(self, sorted(self._live))
        self.policy = new

    # ---- transitions ----------------------------------------------------------------------

    def _unique_side_ids(self, ids: Any) -> tuple[list[int], int]:
        """(distinct non-resident ids in first-seen order, number of resident ids)."""
        seen: dict[int, None] = {}
        resident = self._resident_row
        n_resident = 0
        for e in validate_ids(ids, self.n_experts):
            if e in resident:
                n_resident += 1
            elif e not in seen:
                seen[e] = None
        return list(seen), n_resident

    def _evict(self, victim: int) -> int:
        """LIVE(victim) -> FREE; returns its row (the caller reuses it or pushes it on the free stack)."""
        row = self._live.pop(victim)
        i = row - self.cap
        assert self._row_state[i] == LIVE and self._row_owner[i] == victim and not self._pins.get(row)
        self._row_state[i] = FREE
        self._row_owner[i] = -1
        self._table[victim] = -1
        self._snapshot = None
        self.policy.on_remove(victim)
        self.stats["evictions"] += 1
        return row

    def reserve(self, ids: Any, *, demand: bool = False, protect: Iterable[int] = ()) -> list[Fill]:
        """Reserve rows for the predicted (or, with ``demand``, needed) experts; returns the reads to do.

        Skips resident and duplicate ids and experts already LIVE or FILLING (LIVE ones count as a
        hit for the policy). Each missing expert takes the top free row, else the policy's victim
        (never an expert of this batch, never a leased row). With ``demand=False`` an expert that
        gets no row is skipped (counted in ``stats["skipped"]``); with ``demand=True`` it is listed
        in ``self.blocked`` for the caller to retry after leases are released or fills finish, and
        CapacityError is raised up front if the batch can never fit (more distinct non-resident
        experts than side rows). ``self.blocked`` is reset by every call.

        ``protect``: LIVE experts that are neither evicted nor dropped by this call (the runtime
        passes what older concurrent demands wait for, so the oldest always makes progress).
        """
        batch, n_resident = self._unique_side_ids(ids)
        if demand and len(batch) > self.side_rows:
            raise CapacityError(
                f"demand needs {len(batch)} distinct non-resident experts at once but the side region "
                f"has {self.side_rows} rows (experts {batch[:16]}{'...' if len(batch) > 16 else ''})"
            )
        self.blocked = []
        self.stats["reserves"] += 1
        self.stats["resident_hits"] += n_resident
        policy = self.policy
        policy.begin(batch)
        live = self._live
        in_batch = set(batch)
        protected = in_batch.union(protect)

        if policy.drops_unpredicted:
            # Legacy one-shot: drop every unpredicted LIVE expert, rows pushed in ascending expert
            # order (the side-region design's map iterates in key order) -- except rows a forward
            # still holds.
            for e in sorted(live):
                if e not in protected and not self._pins.get(live[e]) and live[e] not in self._lent:
                    self._free.append(self._evict(e))

        hits = [e for e in batch if e in live]  # every predicted present expert is bumped before any row is filled
        policy.on_hits(hits)
        self.stats["hits"] += len(hits)

        pins = self._pins

        lent = self._lent

        def evictable(v: int) -> bool:
            return v not in protected and not pins.get(live[v], 0) and live[v] not in lent

        fills: list[Fill] = []
        for e in batch:
            if e in live:
                continue
            if e in self._filling:
                self.stats["filling_hits"] += 1
                continue
            self.stats["misses"] += 1
            if self._free:
                row = self._free.pop()
            else:
                victim = policy.choose_victim(evictable)
                if victim is None:
                    if demand:
                        self.blocked.append(e)
                        self.stats["blocked"] += 1
                    else:
                        self.stats["skipped"] += 1
                    continue
                if victim not in live or not evictable(victim):
                    raise LedgerError(f"policy {policy.name!r} chose expert {victim}, which is not evictable")
                row = self._evict(victim)
            fill = Fill(next(self._fill_ids), e, row)
            self._gen[row] += 1
            i = row - self.cap
            self._row_state[i] = FILLING
            self._row_owner[i] = e
            self._filling[e] = fill
            self._pending[fill.fill_id] = fill
            fills.append(fill)
        self.stats["reserved"] += len(fills)
        return fills

    def _take_pending(self, fill: Fill, verb: str) -> Fill:
        if not isinstance(fill, Fill):
            raise LedgerError(f"{verb} needs a Fill, got {fill!r}")
        mine = self._pending.get(fill.fill_id)
        if mine is None:
            raise LedgerError(
                f"cannot {verb} {fill}: it is not a pending fill of this ledger (already published or failed?)"
            )
        if mine != fill:
            raise LedgerError(f"cannot {verb} {fill}: pending fill {fill.fill_id} is {mine}")
        del self._pending[fill.fill_id]
        del self._filling[fill.expert]
        return mine

    def publish(self, fill: Fill) -> None:
        """FILLING -> LIVE for exactly this pending fill (its bytes have all landed)."""
        f = self._take_pending(fill, "publish")
        i = f.row - self.cap
        self._row_state[i] = LIVE
        self._live[f.expert] = f.row
        self._table[f.expert] = f.row
        self._snapshot = None
        self.policy.on_publish(f.expert)
        self.stats["published"] += 1

    def fail(self, fill: Fill) -> None:
        """FILLING -> FREE for exactly this pending fill (its read failed or was abandoned)."""
        f = self._take_pending(fill, "fail")
        i = f.row - self.cap
        self._row_state[i] = FREE
        self._row_owner[i] = -1
        self._free.append(f.row)
        self.stats["failed"] += 1

    def lease(self, experts: Any) -> int:
        """Pin the rows of ``experts`` (each resident or LIVE) until :meth:`release`; returns the lease id.

        A pinned row is never evicted or dropped. Several leases may pin the same row.
        """
        ids = validate_ids(experts, self.n_experts)
        rows: dict[int, None] = {}
        for e in ids:
            row = self._resident_row.get(e)
            if row is None:
                row = self._live.get(e)
            if row is None:
                state = "FILLING (its read is in flight)" if e in self._filling else "absent"
                raise LedgerError(f"cannot lease expert {e}: it is {state}, not resident or LIVE")
            if row in self._lent:
                raise LedgerError(f"cannot lease expert {e}: its row {row} is lent to a fault handler "
                                  "(reclaim it first)")
            rows[row] = None
        # The policy hears of it before anything is pinned: a hook that raises (an interrupt, a
        # MemoryError) then leaves no pin behind that no lease id could ever release.
        for e in dict.fromkeys(ids):
            self.policy.on_lease(e)
        for row in rows:
            self._pins[row] = self._pins.get(row, 0) + 1
        lease_id = next(self._lease_ids)
        self._leases[lease_id] = tuple(rows)
        self.stats["leases"] += 1
        return lease_id

    def release(self, lease_id: int) -> None:
        """Unpin the rows of a lease (LedgerError if the id is unknown or already released)."""
        rows = self._leases.pop(lease_id, None) if isinstance(lease_id, int) else None
        if rows is None:
            raise LedgerError(f"unknown or already released lease {lease_id!r}")
        for row in rows:
            n = self._pins[row] - 1
            if n:
                self._pins[row] = n
            else:
                del self._pins[row]
        self.stats["releases"] += 1


    # ---- rows lent to a fault handler -------------------------------------------------------

    def lend(self, count: int) -> list[int]:
        """Lend up to ``count`` more rows to a fault handler; returns the rows, best victims first.

        Free rows go first (FREE -> LENT), then LIVE rows in the policy's eviction order (a lent
        LIVE row keeps its expert readable until the handler reuses it). Pinned, FILLING and
        already lent rows are never lent. May return fewer rows than asked for.
        """
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise LedgerError(f"count must be a non-negative int, got {count!r}")
        out: list[int] = []
        while len(out) < count and self._free:
            row = self._free.pop()
            self._row_state[row - self.cap] = LENT
            out.append(row)
        if len(out) < count:
            live, pins, lent = self._live, self._pins, self._lent
            chosen: set[int] = set()

            def evictable(v: int) -> bool:
                return v not in chosen and not pins.get(live[v], 0) and live[v] not in lent

            if not self.policy.drops_unpredicted:
                while len(out) < count:
                    victim = self.policy.choose_victim(evictable)
                    if victim is None:
                        break
                    chosen.add(victim)
                    out.append(live[victim])
            else:
                # One-shot keeps no scores: lend the LIVE rows in ascending expert order.
                for v in sorted(live):
                    if len(out) >= count:
                        break
                    if evictable(v):
                        chosen.add(v)
                        out.append(live[v])
        for row in out:
            self._lent[row] = None
        self.stats["lent"] += len(out)
        return out

    def lendable_rows(self) -> int:
        """How many rows a fault handler can hold: those lent now plus every row :meth:`lend` could
        still give (a side row that is neither pinned nor FILLING)."""
        pins, lent = self._pins, self._lent
        held = sum(1 for i, state in enumerate(self._row_state)
                   if (state == FILLING or pins.get(i + self.cap, 0)) and (i + self.cap) not in lent)
        return self.side_rows - held

    def lent_rows(self) -> list[int]:
        """Rows lent to a fault handler and not settled or reclaimed, in lend order."""
        return list(self._lent)

    def settle_fault(self, row: int, victim: int, expert: int, ok: bool) -> None:
        """The fault handler reused lent ``row``: ``victim`` (-1: none) is gone, and ``expert`` is
        LIVE there (``ok``), or the read failed and the row is empty. The row stays lent (the
        handler may reuse it) until :meth:`reclaim`."""
        if row not in self._lent:
            raise LedgerError(f"settle_fault: row {row} is not lent")
        i = row - self.cap
        state, owner = self._row_state[i], self._row_owner[i]
        expected = owner if state == LIVE else -1
        if victim != expected:
            raise LedgerError(f"settle_fault: row {row} holds {_STATE_NAMES[state]}({owner}), "
                              f"the handler evicted {victim}")
        e = _int_or_raise(expert, self.n_experts, "expert id")
        if ok and (e in self._live or e in self._resident_row or e in self._filling):
            raise LedgerError(f"settle_fault: expert {e} filled into row {row} but it is already {self.state_of(e)}")
        if state == LIVE:
            self._evict(victim)
        self._gen[row] += 1
        del self._lent[row]
        self._lent[row] = None  # to the back: the handler filled it last
        if ok:
            self._row_state[i] = LIVE
            self._row_owner[i] = e
            self._live[e] = row
            self._table[e] = row
            self._snapshot = None
            self.policy.on_publish(e)
            self.stats["faulted"] += 1
        else:
            self._row_state[i] = LENT
            self._row_owner[i] = -1
            self.stats["fault_failures"] += 1

    def reclaim(self, rows: Sequence[int] | None = None) -> None:
        """Lent rows come back (all of them when ``rows`` is None): LENT ones are FREE again,
        LIVE ones stay LIVE, and the ledger may evict, refill and lease them again."""
        for row in list(self._lent) if rows is None else rows:
            if row not in self._lent:
                raise LedgerError(f"reclaim: row {row} is not lent")
            del self._lent[row]
            i = row - self.cap
            if self._row_state[i] == LENT:
                self._row_state[i] = FREE
                self._free.append(row)
            self.stats["reclaimed"] += 1

    def record_use(self, ids: Any) -> None:
        """A forward routed ``ids`` (one reserve's worth): LIVE ones count as hits for the policy."""
        flat = validate_ids(ids, self.n_experts)
        self._record(flat, [len(flat)])

    def record_uses(self, ids: np.ndarray, sizes: Sequence[int]) -> None:
        """:meth:`record_use` for each of many reserves at once: ``ids`` concatenates them,
        ``sizes[i]`` ids each, in order (a fault table's log of distinct experts per resolve).

        The same effect as one call per reserve, with one range check for all of them: the
        queued steps' reconcile hands ~30 reserves a step (one per MoE layer and resolve), and
        the per-call checks cost more than the policy's own work did.
        """
        flat = validate_ids(ids, self.n_experts)
        if sum(sizes) != len(flat):
            raise LedgerError(f"record_uses: sizes add up to {sum(sizes)} ids, got {len(flat)}")
        self._record(flat, sizes)

    def _record(self, flat: list[int], sizes: Sequence[int]) -> None:
        resident, live = self._resident_row, self._live
        reserves: list[tuple[list[int], list[int]]] = []
        n_resident = n_hits = start = 0
        for n in sizes:
            seen: dict[int, None] = {}
            for e in flat[start:start + n]:
                if e in resident:
                    n_resident += 1
                elif e not in seen:
                    seen[e] = None
            start += n
            batch = list(seen)
            hits = [e for e in batch if e in live]
            n_hits += len(hits)
            reserves.append((batch, hits))
        self.policy.on_reserves(reserves)
        self.stats["resident_hits"] += n_resident
        self.stats["hits"] += n_hits

    # ---- queries --------------------------------------------------------------------------

    def lookup(self) -> np.ndarray:
        """int32 (n_experts,): the row of each resident or LIVE expert, -1 otherwise.

        Read-only; a snapshot that later transitions never change (rebuilt only after a change).
        """
        if self._snapshot is None:
            self._snapshot = _frozen_copy(self._table)
        return self._snapshot

    def generations(self) -> np.ndarray:
        """int64 (rows,): how many fills each row has been handed so far, as a read-only copy.

        If a row's count and :meth:`lookup` entry are both unchanged between two moments, the row
        held the same expert throughout and nothing wrote to it in between.
        """
        return _frozen_copy(self._gen)  # callers cache it (Runtime.snapshot, per row-state version)

    def unchanged_since(self, table: np.ndarray, generations: np.ndarray, experts: np.ndarray) -> np.ndarray:
        """For each of ``experts``: True iff it had a row in ``table`` (an earlier :meth:`lookup`,
        with ``generations`` taken at the same moment) and still has that row, never refilled since."""
        experts = np.asarray(experts, dtype=np.int64)
        then = table[experts]
        rows = np.maximum(then, 0)
        out: np.ndarray = (then >= 0) & (self._table[experts] == then) & (self._gen[rows] == generations[rows])
        return out

    def row_of(self, expert: int) -> int | None:
        """The row of a resident or LIVE expert, else None."""
        e = _int_or_raise(expert, self.n_experts, "expert id")
        row = self._resident_row.get(e)
        return row if row is not None else self._live.get(e)

    def is_filling(self, expert: int) -> bool:
        """True while ``expert`` has a fill in flight."""
        return _int_or_raise(expert, self.n_experts, "expert id") in self._filling

    def fill_of(self, expert: int) -> Fill | None:
        """The pending fill of ``expert``, if one is in flight."""
        return self._filling.get(_int_or_raise(expert, self.n_experts, "expert id"))

    def state_of(self, expert: int) -> str:
        """``"resident"``, ``"live"``, ``"filling"`` or ``"absent"``."""
        e = _int_or_raise(expert, self.n_experts, "expert id")
        if e in self._resident_row:
            return "resident"
        if e in self._live:
            return "live"
        return "filling" if e in self._filling else "absent"

    def pending(self) -> list[Fill]:
        """Fills in flight, oldest first."""
        return sorted(self._pending.values(), key=lambda f: f.fill_id)

    def live(self) -> dict[int, int]:
        """LIVE side-region experts: expert -> row (a copy)."""
        return dict(self._live)

    def free_rows(self) -> list[int]:
        """The free stack, bottom first (the next reservation takes the last)."""
        return list(self._free)

    def pinned_rows(self) -> dict[int, int]:
        """row -> number of leases pinning it (a copy)."""
        return dict(self._pins)

    # ---- invariants -----------------------------------------------------------------------

    def audit(self) -> AuditReport:
        """Check every invariant; never raises. O(rows + n_experts).

        One helper per invariant; each appends what it finds to ``problems`` in a fixed order.
        """
        problems: list[str] = []
        try:
            free_set = self._audit_free_stack(problems)
            owner_of_row = self._audit_owners(problems)
            self._audit_owned_rows(problems, owner_of_row, free_set)
            self._audit_row_states(problems, free_set)
            self._audit_lent(problems)
            n_free, n_fill, n_live = len(self._free), len(self._filling), len(self._live)
            self._audit_counts_balance(problems)
            self._audit_lookup_table(problems)
            self._audit_pins(problems)
            self._audit_fill_stats(problems)
            problems.extend(self.policy.audit(set(self._live)))
            counts = {"free": n_free, "filling": n_fill, "live": n_live, "lent": len(self._lent),
                      "pinned_rows": len(self._pins), "leases": len(self._leases)}
        except Exception as exc:  # audit must report, never raise
            problems.append(f"audit crashed: {type(exc).__name__}: {exc}")
            counts = {}
        return AuditReport(not problems, problems, counts)

    def _audit_free_stack(self, problems: list[str]) -> set[int]:
        """The free stack holds distinct side-region rows, each in state FREE; returns it as a set."""
        cap, p = self.cap, problems.append
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            p(f"free stack holds duplicate rows: {sorted(self._free)}")
        for r in self._free:
            if not cap <= r < self.rows:
                p(f"free row {r} is outside the side region [{cap}, {self.rows})")
            elif self._row_state[r - cap] != FREE:
                state = _STATE_NAMES[self._row_state[r - cap]]
                p(f"row {r} is on the free stack but {state}({self._row_owner[r - cap]})")
        return free_set

    def _audit_owners(self, problems: list[str]) -> dict[int, int]:
        """LIVE and FILLING experts own distinct rows and agree with the pending fills; returns row -> owner."""
        p = problems.append
        owner_of_row: dict[int, int] = {}
        for e, r in self._live.items():
            if r in owner_of_row:
                p(f"row {r} owned twice: experts {owner_of_row[r]} and {e}")
            owner_of_row[r] = e
            if e in self._resident_row:
                p(f"expert {e} is both resident and LIVE (row {r})")
            if e in self._filling:
                p(f"expert {e} is both LIVE (row {r}) and FILLING ({self._filling[e]})")
        for e, f in self._filling.items():
            if f.expert != e:
                p(f"filling[{e}] holds {f}")
            if f.row in owner_of_row:
                p(f"row {f.row} owned twice: experts {owner_of_row[f.row]} and {e} (filling)")
            owner_of_row[f.row] = e
            if self._pending.get(f.fill_id) != f:
                p(f"FILLING expert {e} row {f.row} has no matching pending fill ({f})")
        for fid, f in self._pending.items():
            if fid != f.fill_id or self._filling.get(f.expert) != f:
                p(f"pending fill {fid} = {f} is not the fill of a FILLING row")
        return owner_of_row

    def _audit_owned_rows(self, problems: list[str], owner_of_row: dict[int, int], free_set: set[int]) -> None:
        """An owned row is not free and lies in the side region."""
        for r, e in owner_of_row.items():
            if r in free_set:
                problems.append(f"row {r} is both free and owned by expert {e}")
            if not self.cap <= r < self.rows:
                problems.append(f"expert {e} owns row {r} outside the side region")

    def _audit_row_states(self, problems: list[str], free_set: set[int]) -> None:
        """Each side row's state and owner agree with the free stack, the LIVE map, the fills and the lent set."""
        p = problems.append
        for i in range(self.side_rows):
            r, st, own = self.cap + i, self._row_state[i], self._row_owner[i]
            if st == FREE and (own != -1 or r not in free_set):
                p(f"row {r} is FREE but owner={own}, on free stack={r in free_set}")
            elif st == LIVE and self._live.get(own) != r:
                p(f"row {r} is LIVE({own}) but live[{own}]={self._live.get(own)}")
            elif st == FILLING and (own not in self._filling or self._filling[own].row != r):
                p(f"row {r} is FILLING({own}) without exactly one pending fill for it")
            elif st == LENT and (own != -1 or r not in self._lent or r in free_set):
                p(f"row {r} is LENT but owner={own}, lent={r in self._lent}, on free stack={r in free_set}")

    def _audit_lent(self, problems: list[str]) -> None:
        """A lent row lies in the side region, is LIVE or LENT, and no lease pins it."""
        cap, p = self.cap, problems.append
        for r in self._lent:
            if not cap <= r < self.rows:
                p(f"lent row {r} is outside the side region")
            elif self._row_state[r - cap] not in (LIVE, LENT):
                p(f"lent row {r} is {_STATE_NAMES[self._row_state[r - cap]]}")
            if self._pins.get(r):
                p(f"lent row {r} is pinned by a lease")

    def _audit_counts_balance(self, problems: list[str]) -> None:
        """Free, filling, LIVE and lent-free rows add up to the side region."""
        n_free, n_fill, n_live = len(self._free), len(self._filling), len(self._live)
        n_lent_free = sum(1 for st in self._row_state if st == LENT)
        if n_free + n_fill + n_live + n_lent_free != self.side_rows:
            problems.append(f"counts do not balance: free {n_free} + filling {n_fill} + live {n_live} + lent free "
                            f"{n_lent_free} != side_rows {self.side_rows}")

    def _audit_lookup_table(self, problems: list[str]) -> None:
        """The expert -> row table (and its cached snapshot) matches the resident and LIVE maps."""
        expected = np.full(self.n_experts, -1, dtype=np.int32)
        for e, r in self._resident_row.items():
            expected[e] = r
        for e, r in self._live.items():
            expected[e] = r
        if not np.array_equal(expected, self._table):
            bad = np.flatnonzero(expected != self._table)[:8].tolist()
            problems.append(f"lookup table wrong for experts {bad}: has {self._table[bad].tolist()}, "
                            f"expected {expected[bad].tolist()}")
        if self._snapshot is not None and not np.array_equal(self._snapshot, self._table):
            problems.append("cached lookup snapshot is stale")

    def _audit_pins(self, problems: list[str]) -> None:
        """Pin counts match the open leases, and only resident or LIVE rows are pinned."""
        pins: dict[int, int] = {}
        for rows in self._leases.values():
            for r in rows:
                pins[r] = pins.get(r, 0) + 1
        if pins != self._pins:
            problems.append(f"pin counts {self._pins} do not match the open leases {pins}")
        held_rows = set(self._resident_row.values()) | set(self._live.values())
        for r in self._pins:
            if r not in held_rows:
                problems.append(f"pinned row {r} is not resident or LIVE")

    def _audit_fill_stats(self, problems: list[str]) -> None:
        """Every reserved fill is published, failed or still pending."""
        s = self.stats
        if s["reserved"] != s["published"] + s["failed"] + len(self._pending):
            problems.append(f"reserved {s['reserved']} != published {s['published']} + failed {s['failed']} "
                            f"+ pending {len(self._pending)}")
