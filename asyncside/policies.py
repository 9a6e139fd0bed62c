"""Eviction policies for the side-region ledger.

A policy only *decides*: it keeps its own scores and answers "which LIVE expert should give up its
row?". It never touches row state; :class:`asyncside.ledger.Ledger` owns every transition and tells
the policy what happened through the ``on_*`` hooks. Pure Python, no I/O.

Policies:

- :class:`LFU` (``"lfu"``): the side-region design's rules. A published expert starts at frequency 1;
  each reserve that predicts an expert already LIVE bumps it by 1 (once per reserve, duplicates
  ignored); the victim is the LIVE expert with the lowest frequency (ties: smallest id) that the
  ledger allows (not predicted in this batch, not under lease); its frequency is forgotten.
- :class:`OneShot` (legacy, ``"oneshot"``): every reserve first drops every LIVE expert not predicted
  now (unless leased), then fills from free rows only; it never evicts.
- :class:`LRU` (``"lru"``): the victim is the least recently used LIVE expert, where "used"
  means published, routed or predicted while LIVE, or leased (ties: smallest id).
- :class:`LRFU` (default, ``"lrfu"``): recency and frequency together: each use counts 1 and
  halves every ``half_life`` reserves; the victim has the lowest sum. On the embedded model's
  decode trace it keeps more hits than LRU, LFU or ageing LFU at the same rows (BENCHMARKS.md).
  Its recency guard ranks by last use instead while a shadow LRU cache hits clearly more (the hot
  experts move faster than the decay forgets them).
- :class:`AgingLFU` (``"aging-lfu"``): LFU whose frequencies all halve (``f // 2``) every
  ``period`` reserves (default 64), so experts that were hot long ago stop squatting rows.
- :class:`AdaptiveLRFU` (``"adaptive-lrfu"``): LRFU that keeps each expert's history after
  eviction (a newcomer enters as the next victim) and picks its half-life online from a shadow
  cache; more hits than LRFU where requests interleave or topics switch, fewer on the embedded
  model's own decode, at a higher cost per access. It carries LRFU's
  recency guard, which keeps it with LRU where the hot experts move fast (docs/policies.md).

The heap-based policies answer ``choose_victim`` in O((skipped + 1) log n) with lazy deletion
instead of scanning every LIVE expert per eviction (docs/design.md).
"""

from __future__ import annotations

import heapq
import math
import numbers
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Sequence
from typing import Any

from .errors import LedgerError


def _positive(value: Any) -> bool:
    """Whether ``value`` is a number > 0 (a NumPy scalar too, as a parameter read off an array is;
    a bool is none)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and float(value) > 0


def _count(value: Any) -> bool:
    """Whether ``value`` is an integer >= 1 (a NumPy integer too; a bool is none)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 1


def _evict_lowest(keys: dict[int, float], heap: list[tuple[float, int]], cap: int,
                  keep: Container[int]) -> list[int]:
    """Drop the lowest-keyed experts of a shadow cache (``keys``: expert -> key, ``heap``: its
    lazily deleted heap) until at most ``cap`` remain, sparing those in ``keep`` (this batch's)
    unless the batch alone is larger than ``cap`` (a prefetch, a fault log's use); the experts
    dropped, lowest first."""
    dropped: list[int] = []
    kept: list[tuple[float, int]] = []
    while len(keys) > cap and heap:
        k, e = heapq.heappop(heap)
        if keys.get(e) != k:
            continue  # stale
        if e in keep:
            kept.append((k, e))
            continue
        del keys[e]
        dropped.append(e)
    while len(keys) > cap and kept:
        e = kept.pop(0)[1]
        del keys[e]
        dropped.append(e)
    for entry in kept:
        heapq.heappush(heap, entry)
    return dropped


def _evict_lowest_lazy(keys: dict[int, float], heap: list[tuple[float, int]], cap: int,
                       keep: Container[int]) -> list[int]:
    """:func:`_evict_lowest` for a heap that holds, for each expert of ``keys``, an entry at or
    below its key rather than at it (keys that only grow need no push per use): an entry below
    the key is pushed again at the key when it surfaces. The same experts dropped in the same
    order as with an entry at every key."""
    dropped: list[int] = []
    kept: list[tuple[float, int]] = []
    while len(keys) > cap and heap:
        k, e = heapq.heappop(heap)
        current = keys.get(e)
        if current is None:
            continue  # dropped since
        if k != current:
            if k < current:
                heapq.heappush(heap, (current, e))
            continue
        if e in keep:
            if not kept or all(x != e for _, x in kept):  # an entry pushed again may repeat one
                kept.append((k, e))
            continue
        del keys[e]
        dropped.append(e)
    while len(keys) > cap and kept:
        e = kept.pop(0)[1]
        del keys[e]
        dropped.append(e)
    for entry in kept:
        heapq.heappush(heap, entry)
    return dropped


class Policy:
    """Base class of eviction policies. Subclasses override the hooks they need.

    A policy instance belongs to one ledger (``attach`` refuses a second owner).
    """

    name: str = "policy"
    #: True for the legacy one-shot policy: each reserve drops every unpredicted LIVE expert first.
    drops_unpredicted: bool = False
    #: How a native fault handler ranks the rows lent to it under this policy (queued steps, where
    #: every dynamic row is lent and the stream sees each use before the ledger does): "recency"
    #: (LRU), "decayed" (LRFU, with :attr:`half_life`), or "lend": the order the ledger lent them
    #: in (this policy's ranking then), each refilled row going to the back (FIFO after that).
    native_order: str = "lend"
    half_life: float = 8.0

    def __init__(self) -> None:
        self._owner: object | None = None

    def attach(self, owner: object, live: Iterable[int]) -> None:
        """Bind to ``owner`` and start from the experts already LIVE (each as if just published)."""
        if self._owner is not None and self._owner is not owner:
            raise LedgerError(f"policy {self.name!r} instance is already attached to another ledger")
        self._owner = owner
        self.reset()
        for e in live:
            self.on_publish(e)

    def reset(self) -> None:
        """Forget every score."""

    def begin(self, batch: Sequence[int]) -> None:
        """A reserve starts for ``batch`` (unique, non-resident ids in order)."""

    def on_hit(self, expert: int) -> None:
        """``expert`` is LIVE and was predicted again (called once per reserve)."""

    def on_hits(self, experts: Sequence[int]) -> None:
        """:meth:`on_hit` for each of ``experts`` in order (distinct, LIVE). The ledger calls this
        once per reserve; a policy may override it with a faster loop of the same effect (the
        queued steps' reconcile reports every layer's hits of every step: ~180 a step here)."""
        for e in experts:
            self.on_hit(e)

    def on_reserves(self, reserves: Sequence[tuple[Sequence[int], Sequence[int]]]) -> None:
        """Many reserves in a row, each ``(batch, hits)``: :meth:`begin` with the batch, then
        :meth:`on_hits` with its hits. Nothing reads the policy between them (the queued steps'
        reconcile hands a fault table's whole log at once), so a policy may override this with a
        loop of the same final state."""
        for batch, hits in reserves:
            self.begin(batch)
            self.on_hits(hits)

    def on_publish(self, expert: int) -> None:
        """``expert`` became LIVE."""

    def on_remove(self, expert: int) -> None:
        """``expert`` stopped being LIVE (evicted or dropped)."""

    def on_lease(self, expert: int) -> None:
        """A lease pinned ``expert`` (it is about to be read by a forward)."""

    def choose_victim(self, evictable: Callable[[int], bool]) -> int | None:
        """The LIVE expert to evict among those for which ``evictable`` is true, or None."""
        return None

    def audit(self, live: set[int]) -> list[str]:
        """Problems in the policy's own bookkeeping, given the set of LIVE experts."""
        return []

    def snapshot(self) -> dict[str, Any]:
        """A JSON-friendly view of the policy's state (for stats and debugging)."""
        return {"name": self.name}


class _HeapPolicy(Policy):
    """Victim = LIVE expert with the smallest (score, expert id); a lazy-deletion min-heap."""

    def reset(self) -> None:
        self.score: dict[int, float] = {}
        self._heap: list[tuple[float, int]] = []

    def _set(self, expert: int, value: float) -> None:
        self.score[expert] = value
        heapq.heappush(self._heap, (value, expert))
        if len(self._heap) > 2 * len(self.score) + 64:  # too many stale entries: rebuild
            self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [(v, e) for e, v in self.score.items()]
        heapq.heapify(self._heap)

    def on_remove(self, expert: int) -> None:
        self.score.pop(expert, None)  # its heap entries become stale

    def choose_victim(self, evictable: Callable[[int], bool]) -> int | None:
        heap, score = self._heap, self.score
        kept: list[tuple[float, int]] = []
        victim = None
        while heap:
            value, e = heap[0]
            if score.get(e) != value:  # stale: the expert was removed or rescored
                heapq.heappop(heap)
                continue
            if evictable(e):
                victim = e
                break
            kept.append(heapq.heappop(heap))  # valid but protected now: put back afterwards
        for entry in kept:
            heapq.heappush(heap, entry)
        return victim

    def audit(self, live: set[int]) -> list[str]:
        problems = []
        if set(self.score) != live:
            problems.append(
                f"{self.name}: scored experts {sorted(set(self.score) ^ live)} differ from LIVE experts"
            )
        current = {(v, e) for e, v in self.score.items()}
        missing = current - set(self._heap)
        if missing:
            problems.append(f"{self.name}: heap lacks current entries {sorted(missing)}")
        return problems

    def snapshot(self) -> dict[str, Any]:
        return {"name": self.name, "score": dict(sorted(self.score.items()))}


class LFU(_HeapPolicy):
    """Least frequently predicted (the default; see module docstring)."""

    name = "lfu"

    def on_hit(self, expert: int) -> None:
        self._set(expert, self.score.get(expert, 0) + 1)

    def on_publish(self, expert: int) -> None:
        if expert not in self.score:  # freq starts at 1 unless already known (a re-publish keeps it)
            self._set(expert, 1)


class AgingLFU(LFU):
    """LFU whose frequencies halve every ``period`` reserves."""

    name = "aging-lfu"

    def __init__(self, period: int = 64) -> None:
        if not _count(period):
            raise LedgerError(f"aging-lfu period must be a positive int, got {period!r}")
        super().__init__()
        self.period = int(period)
        self._reserves = 0

    def reset(self) -> None:
        super().reset()
        self._reserves = 0

    def begin(self, batch: Sequence[int]) -> None:
        self._reserves += 1
        if self._reserves % self.period == 0:
            self.score = {e: v // 2 for e, v in self.score.items()}
            self._rebuild()  # halving can create new ties, so order needs a fresh heap

    def snapshot(self) -> dict[str, Any]:
        return {**super().snapshot(), "period": self.period, "reserves": self._reserves}


class LRU(_HeapPolicy):
    """Least recently used: publish, predicted-while-LIVE and lease all count as a use."""

    name = "lru"
    native_order = "recency"

    def reset(self) -> None:
        super().reset()
        self._clock = 0

    def _touch(self, expert: int) -> None:
        self._clock += 1
        self._set(expert, self._clock)

    def on_hit(self, expert: int) -> None:
        self._touch(expert)

    def on_publish(self, expert: int) -> None:
        self._touch(expert)

    def on_lease(self, expert: int) -> None:
        if expert in self.score:  # resident experts are leased too, but never scored
            self._touch(expert)


#: How far (in standard deviations of a fair coin over the accesses only one of the two caches
#: hit) the recency shadow must lead LRFU's decayed ranking to take over, and the decayed shadow
#: lead recency to take back: a switch on noise costs rows, and the decayed counts are the ranking
#: the benchmarks favour (docs/policies.md, "Recency guard").
GUARD_TO_RECENCY = 2.0
GUARD_TO_DECAYED = 0.5


def _lru_shadow_step(lru: OrderedDict[int, None], batch: Sequence[int], live: Container[int],
                     cap: int) -> tuple[int, int]:
    """One reserve of the recency guard's shadow LRU (expert ids in order of last use) beside a real
    cache holding ``live``: the batch moves to the back, the front is dropped past ``cap``; returns
    (accesses only the real cache hit, accesses only the shadow hit)."""
    real_only = shadow_only = 0
    for e in batch:
        if e in lru:
            shadow_only += e not in live
            lru.move_to_end(e)
        else:
            real_only += e in live
            lru[e] = None
    while len(lru) > cap:
        lru.popitem(last=False)
    return real_only, shadow_only


def _guard_leads(wins: list[float], recency: bool) -> bool:
    """The recency guard's decision at a period's end: halve the window (``wins``: accesses only
    the real cache hit, only the shadow hit) and say whether the shadow's lead passes the sign test
    (:data:`GUARD_TO_RECENCY` while ranking by decayed counts, :data:`GUARD_TO_DECAYED` while
    ranking by recency). On a switch the caller swaps the two counts (the shadow becomes real)."""
    real, shadow = wins
    wins[0], wins[1] = real * 0.5, shadow * 0.5
    # A sign test over the accesses only one of the two hit: switching on noise costs rows.
    return shadow - real > (GUARD_TO_DECAYED if recency else GUARD_TO_RECENCY) * math.sqrt(real + shadow)


class LRFU(_HeapPolicy):
    """Least recently/frequently used: each use of an expert counts 1, halving every ``half_life``
    reserves, and the victim has the lowest sum (ties: smallest id). Frequency keeps experts that
    come back often; the decay forgets the ones that stopped.

    Kept in a heap without rescoring: at any moment the decayed score of e is
    ``s_e * 2**(-(now - t_e) / h)``, which orders experts exactly like the time-free key
    ``log2(s_e) + t_e / h`` (s_e and t_e: score and time of its last use).

    Recency guard (``adapt``, on by default): where the hot experts move faster than the decay
    forgets them (the hot set changes every few dozen tokens, requests interleaved token by token),
    the counts of experts that stopped keep rows the new ones need, and plain LRU hits more. A
    shadow cache of the ledger's side rows (expert ids only) replays the same reserves under the
    other ranking (LRU while this one ranks by decayed counts, decayed counts while it ranks by
    recency); every ``period`` reserves the policy takes the shadow's ranking where the shadow
    hit more over a window that halves each period, by more than chance explains
    (:data:`GUARD_TO_RECENCY`, :data:`GUARD_TO_DECAYED`). docs/policies.md, "Recency guard".
    Without side rows to size the shadow (a policy attached to no ledger), or with
    ``adapt=False``, it ranks by decayed counts only.
    """

    name = "lrfu"
    native_order = "decayed"

    def __init__(self, half_life: float = 8.0, *, adapt: bool = True, period: int = 32) -> None:
        if not _positive(half_life):
            raise LedgerError(f"lrfu half_life must be a positive number, got {half_life!r}")
        if not isinstance(adapt, bool):
            raise LedgerError(f"lrfu adapt must be a bool, got {adapt!r}")
        if not _count(period):
            raise LedgerError(f"lrfu period must be a positive int, got {period!r}")
        super().__init__()
        self.half_life = float(half_life)
        self.adapt = bool(adapt)
        self.period = int(period)
        self.rows = 0

    def attach(self, owner: object, live: Iterable[int]) -> None:
        rows = getattr(owner, "side_rows", 0) if self.adapt else 0
        self.rows = int(rows) if _count(rows) else 0
        super().attach(owner, live)

    def reset(self) -> None:
        super().reset()
        self._clock = 0
        self._s: dict[int, tuple[float, int]] = {}  # expert -> (score at last use, time of last use)
        self.recency = False  # ranking by last use (the guard's LRU) instead of decayed counts
        self.native_order = "decayed"  # what the queued steps' fault tables rank by: follows the guard
        self.switches = 0
        self._wins = [0.0, 0.0]  # over the window, accesses only the real cache hit, only the shadow hit
        self._lru: OrderedDict[int, None] = OrderedDict()  # the shadow while ranking by counts
        self._fs: dict[int, tuple[float, int]] = {}  # the shadow while ranking by recency: (score, time)
        self._fkey: dict[int, float] = {}
        self._fheap: list[tuple[float, int]] = []

    def _key(self, s: float, t: int) -> float:
        return float(t) if self.recency else math.log2(s) + t / self.half_life

    def begin(self, batch: Sequence[int]) -> None:
        if self.rows:
            self._tick(batch, self.score)
        else:
            self._clock += 1

    def _tick(self, batch: Sequence[int], live: Container[int]) -> None:
        """One reserve of the guard: a decision at each period's end, the clock, the shadow's step;
        ``live``: the batch's experts the real cache holds (its hits)."""
        if self._clock and self._clock % self.period == 0:
            self._decide()
        self._clock += 1
        clock, cap = self._clock, max(self.rows, len(batch))
        real_only = shadow_only = 0
        if not self.recency:
            real_only, shadow_only = _lru_shadow_step(self._lru, batch, live, cap)
        else:
            fs, fkey, heap, h = self._fs, self._fkey, self._fheap, self.half_life
            for e in batch:
                st = fs.get(e)
                if st is not None:
                    shadow_only += e not in live
                    s = st[0] * 2.0 ** (-(clock - st[1]) / h) + 1.0
                else:
                    real_only += e in live
                    s = 1.0
                fs[e] = (s, clock)
                k = fkey[e] = math.log2(s) + clock / h
                heapq.heappush(heap, (k, e))
            if len(fs) > cap:
                for e in _evict_lowest(fkey, heap, cap, set(batch)):
                    del fs[e]
            if len(heap) > 4 * cap + 64:
                heap[:] = [(k, e) for e, k in fkey.items()]
                heapq.heapify(heap)
        self._wins[0] += real_only
        self._wins[1] += shadow_only

    def _decide(self) -> None:
        if not _guard_leads(self._wins, self.recency):
            return
        # The shadow's ranking becomes the real one; the real cache's content seeds the new shadow.
        self.recency = not self.recency
        self.native_order = "recency" if self.recency else "decayed"
        self.switches += 1
        self._wins.reverse()
        held = sorted(self.score, key=lambda e: (self._s[e][1], e))
        if self.recency:
            self._lru.clear()
            self._fs = {e: self._s[e] for e in held}
            h = self.half_life
            self._fkey = {e: math.log2(s) + t / h for e, (s, t) in self._fs.items()}
            self._fheap = [(k, e) for e, k in self._fkey.items()]
            heapq.heapify(self._fheap)
        else:
            self._fs, self._fkey, self._fheap = {}, {}, []
            self._lru = OrderedDict.fromkeys(held)
        for e in held:
            self.score[e] = self._key(*self._s[e])
        self._rebuild()

    def _use(self, expert: int) -> None:
        s, t = self._s.get(expert, (0.0, self._clock))
        s = s * 2.0 ** (-(self._clock - t) / self.half_life) + 1.0
        self._s[expert] = (s, self._clock)
        self._set(expert, self._key(s, self._clock))

    def on_hit(self, expert: int) -> None:
        self._use(expert)

    def on_hits(self, experts: Sequence[int]) -> None:
        # _use inlined (the same arithmetic, so the same scores bit for bit): the per-call
        # overhead of _use and _set was most of the reconcile's host time.
        clock, half_life = self._clock, self.half_life
        key_time = clock / half_life
        recency = self.recency
        uses, score, heap, push, log2 = self._s, self.score, self._heap, heapq.heappush, math.log2
        for e in experts:
            s, t = uses.get(e, (0.0, clock))
            s = s * 2.0 ** (-(clock - t) / half_life) + 1.0
            uses[e] = (s, clock)
            value = float(clock) if recency else log2(s) + key_time
            score[e] = value
            push(heap, (value, e))
        if len(heap) > 2 * len(score) + 64:
            self._rebuild()

    def on_reserves(self, reserves: Sequence[tuple[Sequence[int], Sequence[int]]]) -> None:
        # Each use updates (score, time) with on_hits' arithmetic, so every expert ends with the
        # same score bit for bit; but its eviction key (a log2 and a heap entry) is computed once,
        # for its last use: the keys of earlier uses would only be stale heap entries, and the
        # decay factor of a gap (a few distinct gaps repeat) is computed once per reconcile.
        half_life = self.half_life
        uses = self._s
        decay: dict[int, float] = {}
        last: dict[int, None] = {}
        guard = self.rows > 0
        for batch, hits in reserves:
            if guard:
                self._tick(batch, set(hits))  # may switch the ranking: keys so far rebuilt from uses
            else:
                self._clock += 1
            clock = self._clock
            for e in hits:
                s, t = uses.get(e, (0.0, clock))
                gap = clock - t
                f = decay.get(gap)
                if f is None:
                    f = decay[gap] = 2.0 ** (-gap / half_life)
                uses[e] = (s * f + 1.0, clock)
                last[e] = None
        score, heap, push = self.score, self._heap, heapq.heappush
        for e in last:
            value = self._key(*uses[e])
            score[e] = value
            push(heap, (value, e))
        if len(heap) > 2 * len(score) + 64:
            self._rebuild()

    def on_publish(self, expert: int) -> None:
        self._use(expert)

    def on_lease(self, expert: int) -> None:
        if expert in self.score:
            self._use(expert)

    def on_remove(self, expert: int) -> None:
        super().on_remove(expert)
        self._s.pop(expert, None)

    def snapshot(self) -> dict[str, Any]:
        return {**super().snapshot(), "half_life": self.half_life, "clock": self._clock,
                "ranking": "recency" if self.recency else "decayed", "switches": self.switches}


#: Gaps (in reserves) whose decay factors AdaptiveLRFU keeps in a table; longer ones are computed.
_DECAY_TABLE = 1024


class _Ageing:
    """AdaptiveLRFU's history update for one reserve's batch: each expert's decayed count under
    every candidate half-life (decay factors from the tables up to :data:`_DECAY_TABLE` reserves of
    gap), one more use, and its time; a newcomer starts at one use."""

    def __init__(self, tables: list[list[float]], half_lives: tuple[float, ...]) -> None:
        self.tables, self.half_lives = tables, half_lives
        self.ones = [1.0] * len(half_lives)

    def __call__(self, hist: dict[int, list[float]], batch: Sequence[int], clock: int) -> None:
        tables, hls, ones = self.tables, self.half_lives, self.ones
        pair = len(hls) == 2  # the default candidates: the loop over them unrolled
        for e in batch:
            h = hist.get(e)
            if h is None:
                hist[e] = [clock, *ones]
                continue
            gap = int(clock - h[0])
            h[0] = clock
            if pair and gap < _DECAY_TABLE:
                h[1] = h[1] * tables[0][gap] + 1.0
                h[2] = h[2] * tables[1][gap] + 1.0
                continue
            for i in range(len(hls)):
                table = tables[i]
                h[1 + i] = h[1 + i] * (table[gap] if gap < _DECAY_TABLE else 2.0 ** (-gap / hls[i])) + 1.0


def _shadow_step(shadow: dict[int, float], heap: list[tuple[float, int]], hist: dict[int, list[float]], j: int,
                 t_key: float, batch: Sequence[int], rows: int, wins: float) -> float:
    """One reserve of an AdaptiveLRFU candidate's shadow cache (``shadow``: expert -> key under the
    candidate at ``hist[e][j]``, ``t_key``: the clock over its half-life): each of ``batch`` keyed
    anew, the lowest dropped past ``rows``; returns ``wins`` plus the batch's hits in the shadow.
    ``heap`` holds an entry at or below each key (:func:`_evict_lowest_lazy`): a key grows with
    each use, so a use of an expert the shadow holds pushes nothing."""
    log2, push = math.log2, heapq.heappush
    for e in batch:
        k = log2(hist[e][j]) + t_key
        old = shadow.get(e)
        if old is None:
            push(heap, (k, e))
        else:
            wins += 1
            if k < old:  # a float's rounding could make a key smaller: it needs its entry
                push(heap, (k, e))
        shadow[e] = k
    if len(shadow) > rows:
        _evict_lowest_lazy(shadow, heap, rows, batch if len(batch) <= 16 else set(batch))
    if len(heap) > 4 * rows + 64:
        heap[:] = [(k, e) for e, k in shadow.items()]
        heapq.heapify(heap)
    return wins


def _real_and_guard_step(lru: OrderedDict[int, None], batch: Sequence[int], live: Container[int], cap: int,
                         wins: float) -> tuple[float, int, int]:
    """AdaptiveLRFU's real cache and the guard's shadow LRU over one reserve, in one pass:
    ``wins`` plus the batch's hits in ``live`` (one at a time, as the window always counted), then
    :func:`_lru_shadow_step`'s two counts."""
    real_only = shadow_only = 0
    for e in batch:
        hit = e in live
        if hit:
            wins += 1
        if e in lru:
            shadow_only += not hit
            lru.move_to_end(e)
        else:
            real_only += hit
            lru[e] = None
    while len(lru) > cap:
        lru.popitem(last=False)
    return wins, real_only, shadow_only


class AdaptiveLRFU(_HeapPolicy):
    """LRFU that remembers evicted experts and picks its half-life online (``"adaptive-lrfu"``).

    - History: each expert's decayed use count survives its eviction, so an expert that comes back
      often returns with its standing, and a newcomer with little history enters as the next
      victim (admission without bypass: it takes a row for its step, then goes first).
    - Adaptive half-life: the real cache ranks by the current candidate of ``half_lives``; for
      each other candidate a shadow cache of the ledger's side rows (ids only) replays the same
      demands under LRFU with that half-life. Every ``period`` reserves the policy adopts the
      candidate that hit most (the real cache counting for the current one) over a window that
      halves each period; ties keep the current one. It starts at the first candidate (LRFU's
      default half-life). Short half-lives are recency, long ones frequency.

    - Recency guard (``guard``, on by default; :class:`LRFU`'s): where the hot experts move faster
      than any candidate's counts forget them, the history keeps the experts that just stopped and
      the new hot ones enter as the next victims. A shadow LRU of the side rows is replayed beside
      the real cache; at each period's end the real cache ranks by last use while that shadow's
      lead passes the guard's sign test, and the current candidate's shadow then plays the decayed
      side of the test. ``snapshot()`` says the ranking; :attr:`native_order` follows it.

    Every access is counted once, in :meth:`begin` (the reserve's batch: hits and misses);
    publish, hit and lease only rank. Cost: one history update per access and one shadow step
    per access and other candidate, plus the guard's (BENCHMARKS.md, "Policies against Belady's MIN").
    """

    name = "adaptive-lrfu"
    native_order = "decayed"

    def __init__(self, half_lives: Sequence[float] = (8.0, 256.0), period: int = 32,
                 rows: int | None = None, *, guard: bool = True) -> None:
        # A bare number ended in "'int' object is not iterable".
        hl = tuple(half_lives) if isinstance(half_lives, Iterable) and not isinstance(half_lives, (str, bytes)) else ()
        if not hl or not all(_positive(h) for h in hl):
            raise LedgerError(f"adaptive-lrfu half_lives must be a sequence of positive numbers, got {half_lives!r}")
        if not _count(period):
            raise LedgerError(f"adaptive-lrfu period must be a positive int, got {period!r}")
        if rows is not None and not _count(rows):
            raise LedgerError(f"adaptive-lrfu rows must be a positive int or None, got {rows!r}")
        if not isinstance(guard, bool):
            raise LedgerError(f"adaptive-lrfu guard must be a bool, got {guard!r}")
        super().__init__()
        self.guard = guard
        self.half_lives = tuple(float(h) for h in hl)
        self.period = int(period)
        self._rows_given = None if rows is None else int(rows)
        self.rows = self._rows_given or 0
        self._start = 0  # the first candidate (LRFU's half-life) until the shadows have a say

    def attach(self, owner: object, live: Iterable[int]) -> None:
        if self._rows_given is None:
            self.rows = int(getattr(owner, "side_rows", 0))
        super().attach(owner, live)

    def reset(self) -> None:
        super().reset()
        self._clock = 0
        self._cur = self._start
        self.half_life = self.half_lives[self._cur]
        m = len(self.half_lives)
        # expert -> [time of last use, decayed count under each candidate half-life]
        self._hist: dict[int, list[float]] = {}
        self._shadow: list[dict[int, float]] = [{} for _ in range(m)]  # candidate -> {expert: key}
        self._sheap: list[list[tuple[float, int]]] = [[] for _ in range(m)]
        self._wins = [0.0] * m
        self._decay = [[2.0 ** (-g / h) for g in range(_DECAY_TABLE)] for h in self.half_lives]
        self._ageing = _Ageing(self._decay, self.half_lives)
        self.switches = 0
        # The recency guard (LRFU's): ranking by last use while a shadow LRU hits clearly more.
        self.recency = False
        self.native_order = "decayed"
        self.guard_switches = 0
        self._gwins = [0.0, 0.0]  # over the window, accesses only the real cache hit, only the shadow hit
        self._lru: OrderedDict[int, None] = OrderedDict()  # the guard's shadow while ranking by counts
        self._ctx: tuple[Any, ...] | None = None  # _advance's view of the above (_context)

    def _key(self, expert: int, i: int) -> float:
        h = self._hist[expert]
        return math.log2(h[1 + i]) + h[0] / self.half_lives[i]

    def _real_key(self, expert: int) -> float:
        """The real cache's key: the time of last use under the guard's recency, else the current
        candidate's decayed count."""
        return float(self._hist[expert][0]) if self.recency else self._key(expert, self._cur)

    def begin(self, batch: Sequence[int]) -> None:
        self._advance(((batch, ()),))

    def on_reserves(self, reserves: Sequence[tuple[Sequence[int], Sequence[int]]]) -> None:
        # The same steps and rankings as begin + on_hits per reserve, with the attribute look-ups
        # done once per log; each hit's key is set at once (later reserves read the score's
        # membership) but pushed on the heap once, at the end (nothing chooses a victim between).
        self._advance(reserves)

    def _advance(self, reserves: Iterable[tuple[Sequence[int], Sequence[int]]]) -> None:
        """:meth:`begin` with each batch, then :meth:`on_hits` with its hits, for each reserve."""
        hist, hls, score, period = self._hist, self.half_lives, self.score, self.period
        log2, push = math.log2, heapq.heappush
        clock = self._clock
        ranked: dict[int, None] = {}  # hits whose heap entries are pushed at the end
        heap = self._heap
        cur, recency, others = self._ctx or self._context()  # read again after a decision
        j_cur, hl_cur = 1 + cur, hls[cur]
        for batch, hits in reserves:
            clock += 1
            self._clock = clock
            self._step(batch, clock, others)
            if clock % period == 0:
                for e in ranked:
                    push(heap, (score[e], e))
                ranked.clear()
                self._decide()
                heap = self._heap
                cur, recency, others = self._ctx or self._context()
                j_cur, hl_cur = 1 + cur, hls[cur]
            for e in hits:
                h = hist.get(e)
                if h is None:  # not seen by a reserve: _rank's use now
                    self._rank(e)
                    heap = self._heap
                    continue
                score[e] = float(h[0]) if recency else log2(h[j_cur]) + h[0] / hl_cur
                ranked[e] = None
        for e in ranked:
            push(heap, (score[e], e))
        if len(heap) > 2 * len(score) + 64:
            self._rebuild()

    def _context(self) -> tuple[int, bool, list[tuple[int, dict[int, float], list[tuple[float, int]], float]]]:
        """What a decision may change, for :meth:`_advance`'s locals, kept until a decision or a
        reset (a reserve at a time rebuilt it per reserve): the current candidate, the ranking, and
        each shadow replayed (index, keys, heap, half-life)."""
        hls = self.half_lives
        others = [(i, self._shadow[i], self._sheap[i], hls[i]) for i in range(len(hls))
                  if i != self._cur or self.recency]
        self._ctx = (self._cur, self.recency, others)
        return self._ctx

    def _step(self, batch: Sequence[int], clock: int,
              others: list[tuple[int, dict[int, float], list[tuple[float, int]], float]]) -> None:
        """One reserve's history update, windows and shadow steps, for any candidates and ranking
        (``others``: the shadows replayed, from :meth:`_state`)."""
        hist, score, rows, cur, wins, gwins = self._hist, self.score, self.rows, self._cur, self._wins, self._gwins
        self._ageing(hist, batch, clock)
        if rows <= 0:
            return
        if not self.recency and self.guard:
            wins[cur], real_only, shadow_only = _real_and_guard_step(self._lru, batch, score, max(rows, len(batch)),
                                                                     wins[cur])
            gwins[0] += real_only
            gwins[1] += shadow_only
        elif not self.recency:
            w = wins[cur]
            for e in batch:  # the current candidate's cache is the real one
                if e in score:
                    w += 1
            wins[cur] = w
        for i, shadow, sheap, hl in others:
            if i == cur:  # ranking by recency: the current candidate's shadow is the guard's
                for e in batch:
                    if (e in shadow) != (e in score):
                        gwins[e in shadow] += 1
            wins[i] = _shadow_step(shadow, sheap, hist, 1 + i, clock / hl, batch, rows, wins[i])

    def on_hits(self, experts: Sequence[int]) -> None:
        # _rank inlined (the same keys): the per-call overhead was most of the cost.
        hist, score, heap, push, log2 = self._hist, self.score, self._heap, heapq.heappush, math.log2
        recency, j, hl = self.recency, 1 + self._cur, self.half_lives[self._cur]
        for e in experts:
            h = hist.get(e)
            if h is None:
                self._rank(e)
                heap = self._heap
                continue
            value = float(h[0]) if recency else log2(h[j]) + h[0] / hl
            score[e] = value
            push(heap, (value, e))
        if len(heap) > 2 * len(score) + 64:
            self._rebuild()

    def _decide(self) -> None:
        self._ctx = None  # what it changes is read again
        if self.guard and self.rows > 0 and _guard_leads(self._gwins, self.recency):
            self._switch_ranking()
        wins = self._wins
        best = self._cur
        for i in range(len(wins)):
            if wins[i] > wins[best]:
                best = i
        self._wins = [w * 0.5 for w in wins]
        if best != self._cur and self.recency:
            # Every candidate has a shadow while the real cache ranks by recency: the guard's
            # shadow becomes the new candidate's.
            self._cur = best
            self.half_life = self.half_lives[best]
            self.switches += 1
        elif best != self._cur:
            # The old candidate's shadow starts from the real cache; the new one's is the real cache.
            old = self._cur
            self._shadow[old] = {e: self._key(e, old) for e in self.score}
            self._sheap[old] = [(k, e) for e, k in self._shadow[old].items()]
            heapq.heapify(self._sheap[old])
            self._shadow[best], self._sheap[best] = {}, []
            self._cur = best
            self.half_life = self.half_lives[best]
            self.switches += 1
            for e in self.score:
                self.score[e] = self._key(e, best)
            self._rebuild()

    def _switch_ranking(self) -> None:
        """The guard's shadow ranking becomes the real one (LRFU's recency guard); the real cache's
        content seeds the new shadow, and the rows held are re-ranked (none moves)."""
        self.recency = not self.recency
        self.native_order = "recency" if self.recency else "decayed"
        self.guard_switches += 1
        self._gwins.reverse()
        cur = self._cur
        if self.recency:  # the current candidate's shadow starts from the real cache
            self._lru.clear()
            self._shadow[cur] = {e: self._key(e, cur) for e in self.score}
            self._sheap[cur] = [(k, e) for e, k in self._shadow[cur].items()]
            heapq.heapify(self._sheap[cur])
        else:
            self._shadow[cur], self._sheap[cur] = {}, []
            self._lru = OrderedDict.fromkeys(sorted(self.score, key=lambda e: (self._hist[e][0], e)))
        for e in self.score:
            self.score[e] = self._real_key(e)
        self._rebuild()

    def _rank(self, expert: int) -> None:
        if expert not in self._hist:  # not seen by a reserve (attach, a settled fault): a use now
            self._hist[expert] = [self._clock] + [1.0] * len(self.half_lives)
        self._set(expert, self._real_key(expert))

    def on_hit(self, expert: int) -> None:
        self._rank(expert)

    def on_publish(self, expert: int) -> None:
        self._rank(expert)

    def audit(self, live: set[int]) -> list[str]:
        problems = super().audit(live)
        for i, shadow in enumerate(self._shadow):
            if self.rows and len(shadow) > self.rows:
                problems.append(f"{self.name}: shadow {i} holds {len(shadow)} experts, more than {self.rows} rows")
        return problems

    def snapshot(self) -> dict[str, Any]:
        return {**super().snapshot(), "half_life": self.half_life, "half_lives": list(self.half_lives),
                "clock": self._clock, "rows": self.rows, "switches": self.switches,
                "ranking": "recency" if self.recency else "decayed", "guard_switches": self.guard_switches}


class OneShot(Policy):
    """Legacy: drop every unpredicted LIVE expert at each reserve, fill from free rows, never evict."""

    name = "oneshot"
    drops_unpredicted = True


#: The policy a Runtime uses unless told otherwise.
DEFAULT_POLICY = "lrfu"

POLICIES: dict[str, Callable[[], Policy]] = {
    "lfu": LFU,
    "oneshot": OneShot,
    "one-shot": OneShot,
    "lru": LRU,
    "aging-lfu": AgingLFU,
    "lfu-aging": AgingLFU,
    "lrfu": LRFU,
    "adaptive-lrfu": AdaptiveLRFU,
    "alrfu": AdaptiveLRFU,
}

#: One name per policy (:data:`POLICIES` also holds aliases), for help texts and choices.
POLICY_NAMES: tuple[str, ...] = tuple(sorted({factory().name for factory in POLICIES.values()}))


def make_policy(policy: Policy | str) -> Policy:
    """A policy instance from a name of :data:`POLICIES` (:data:`POLICY_NAMES` or an alias) or an instance."""
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str) and policy.lower() in POLICIES:
        return POLICIES[policy.lower()]()
    raise LedgerError(f"unknown policy {policy!r}; known: {sorted(POLICIES)} or a Policy instance")
