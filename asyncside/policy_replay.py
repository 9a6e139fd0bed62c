"""Cache policies against Belady's MIN on routing traces (:mod:`asyncside.routing`), and per-layer
row budgets from miss curves.

Model of the cache: one cache per MoE layer, nothing resident, one token per step (decode); a
step's demand is the token's K distinct experts at that layer, every one of which must be in a row
when the step runs (the ledger's rule). A hit is a demanded expert already in a row; hit rates are
hits over all demanded experts of all layers.

- :func:`replay_steps` replays one layer through a real :class:`asyncside.ledger.Ledger` with a
  policy (the code the runtime runs); :func:`belady_bypass` is MIN with bypass (a missed expert need
  not take a row; :func:`asyncside.models.trace.belady`), :func:`belady_no_bypass` MIN under the ledger's rule,
  :func:`static_best` the best fixed set in hindsight (an upper bound for online policies on
  routing drawn independently per token; docs/policies.md).
- :func:`compare_policies` tabulates all of them per trace and cache size (``asyncside bench policy``).
- :func:`lru_miss_curve` gives a layer's LRU misses at every row count in one pass
  (:func:`trace_miss_curves`: every layer's; a stack LRU, ties within a step by id);
  :func:`lru_hits` and :func:`trace_lru_hits` the runtime's LRU hits (:func:`replay_steps`'s) at
  given row counts, :func:`trace_min_hits` MIN's hits of every layer at given row counts (all
  vectorised with numpy, for ``asyncside routing info``);
  :func:`split_rows` splits a total row budget across layers from such curves;
  :func:`holdout_pair` and :func:`compare_split` measure such a split planned on one sequence and
  replayed on another (a holdout).

Pure Python and numpy, no MLX, no I/O.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .ledger import Ledger
from .policies import Policy, make_policy
from .routing import RoutingTrace

#: The policies :func:`compare_policies` replays unless told otherwise.
DEFAULT_COMPARED = ("lru", "lfu", "aging-lfu", "lrfu")

PolicySpec = Policy | str | Callable[[], Policy]


def _steps(demands: Iterable[Iterable[int]], resident: Iterable[int]) -> tuple[list[set[int]], set[int]]:
    res = {int(r) for r in resident}
    return [{int(e) for e in d} for d in demands], res


def _next_uses(reqs: Sequence[set[int]]) -> list[dict[int, int]]:
    """next_use[t][e]: the first step after t that demands e (absent: never again)."""
    out: list[dict[int, int]] = [{} for _ in reqs]
    upcoming: dict[int, int] = {}
    for t in range(len(reqs) - 1, -1, -1):
        out[t] = dict(upcoming)
        for e in reqs[t]:
            upcoming[e] = t
    return out


class Counts:
    """Hits and accesses of one cache (or summed): ``hits / accesses`` is the hit rate."""

    __slots__ = ("accesses", "hits")

    def __init__(self, hits: int = 0, accesses: int = 0) -> None:
        self.hits = hits
        self.accesses = accesses

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else float("nan")

    def __add__(self, other: Counts) -> Counts:
        return Counts(self.hits + other.hits, self.accesses + other.accesses)

    def __repr__(self) -> str:
        return f"Counts(hits={self.hits}, accesses={self.accesses})"


def belady_no_bypass(demands: Iterable[Iterable[int]], resident: Iterable[int], rows: int,
                     initial: Iterable[int] = (), *, groups: bool = False) -> Counts:
    """Belady's MIN under the ledger's rule: every missed expert takes a row at its step, and the
    rows left keep the cached experts whose next use is soonest (ties: smallest id). ``resident``
    experts are pinned beside the ``rows`` (always hits, never evicted).

    ``initial``: what the ``rows`` hold before the first step (a runtime warms its rows at start:
    MIN from those same rows bounds it, MIN from empty rows does not); resident ones are ignored,
    more than ``rows`` others is a ValueError. A step demanding more non-resident experts than
    ``rows`` is a ValueError, unless ``groups``: then the step passes through the rows in groups
    (the runtime's parts of a step, :func:`asyncside.models.trace.replay_policy`'s halves), and MIN
    counts as hits what the rows held at its start and then keeps any ``rows`` of what they held or
    it demanded (the soonest used again): no grouping gets more, so it stays an upper bound."""
    reqs, res = _steps(demands, resident)
    nxt = _next_uses(reqs)
    never = len(reqs) + 1
    out = Counts()
    cache = {int(e) for e in initial} - res
    if len(cache) > rows:
        raise ValueError(f"initial: {len(cache)} non-resident experts ({sorted(cache)[:16]}) but the cache has "
                         f"{rows} rows")
    for t, d in enumerate(reqs):
        req = d - res
        if len(req) > rows and not groups:
            raise ValueError(f"step {t} demands {len(req)} non-resident experts but the cache has {rows} rows")
        out.accesses += len(d)
        out.hits += len(d) - len(req - cache)
        nu = nxt[t]
        if len(req) > rows:  # in groups: whatever any grouping could leave in the rows
            cache = set(sorted(cache | req, key=lambda e: (nu.get(e, never), e))[: max(rows, 0)])
            continue
        keep = sorted(cache - req, key=lambda e: (nu.get(e, never), e))[: rows - len(req)]
        cache = req | set(keep)
    return out


def belady_bypass(demands: Iterable[Iterable[int]], resident: Iterable[int], rows: int,
                  initial: Iterable[int] = ()) -> Counts:
    """Belady's MIN with bypass (:func:`asyncside.models.trace.belady`) as :class:`Counts`, the
    ``rows`` holding ``initial`` before the first step."""
    from .models.trace import belady

    r = belady(list(demands), resident, rows, initial)
    return Counts(r.resident_hits + r.side_hits, r.accesses)


def static_best(demands: Iterable[Iterable[int]], resident: Iterable[int], rows: int) -> Counts:
    """The ``rows`` most demanded experts in hindsight, held for the whole trace (never changed).

    When each token's routing is drawn independently from a fixed popularity, the hits an online
    policy can expect at a step are those of what it holds, at most the most popular ``rows``
    experts' share: so this (up to its own fit to the sample) bounds every online policy there."""
    reqs, res = _steps(demands, resident)
    counts: dict[int, int] = {}
    for d in reqs:
        for e in d - res:
            counts[e] = counts.get(e, 0) + 1
    keep = set(sorted(counts, key=lambda e: (-counts[e], e))[: max(rows, 0)]) | res
    out = Counts()
    for d in reqs:
        out.accesses += len(d)
        out.hits += len(d & keep)
    return out


def _policy(spec: PolicySpec) -> Policy:
    if isinstance(spec, (Policy, str)):
        return make_policy(spec)
    return spec()


def replay_steps(demands: Iterable[Iterable[int]], n_experts: int, rows: int, policy: PolicySpec = "lrfu") -> Counts:
    """Replay demand steps (one layer, nothing resident) through a :class:`Ledger` with ``rows``
    side rows and ``policy`` (a name, an instance, or a factory): each step reserves its demand
    and publishes every fill at once (reads complete instantly)."""
    led = Ledger(n_experts, [], rows, policy=_policy(policy))
    out = Counts()
    for d in demands:
        ids = np.unique(np.asarray(d, dtype=np.int64))
        fills = led.reserve(ids, demand=True)
        for f in fills:
            led.publish(f)
        out.accesses += len(ids)
        out.hits += len(ids) - len(fills)
    return out


def trace_rows(trace: RoutingTrace, fraction: float) -> int:
    """Rows of a per-layer cache holding ``fraction`` of ``trace``'s experts (at least top_k)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    return max(int(round(trace.n_experts * fraction)), trace.top_k)


METHODS = ("policy", "min", "min-no-bypass", "static")


def replay_trace(trace: RoutingTrace, rows: int | Sequence[int], policy: PolicySpec = "lrfu",
                 method: str = "policy") -> list[Counts]:
    """Per MoE layer of ``trace``, the :class:`Counts` of a cache of ``rows`` (one int, or one per
    layer) under ``method``: ``"policy"`` (:func:`replay_steps` with ``policy``; a factory makes a
    fresh policy per layer), ``"min"`` (MIN with bypass), ``"min-no-bypass"`` or ``"static"``."""
    per_layer = [rows] * trace.n_layers if isinstance(rows, int) else list(rows)
    if len(per_layer) != trace.n_layers:
        raise ValueError(f"rows: expected one per layer ({trace.n_layers}), got {len(per_layer)}")
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    if method == "policy" and isinstance(policy, Policy) and trace.n_layers > 1:
        raise ValueError("policy: a Policy instance belongs to one ledger; pass a name or a factory")
    if method in ("min", "min-no-bypass") and _MIN_VECTOR_ELEMENTS >= trace.n_experts:
        # The vectorised MIN of every layer at once: the hits belady_bypass / belady_no_bypass
        # count, without a Python loop over each step's cache (a long trace of many layers took
        # minutes).
        accesses = trace.n_tokens * trace.top_k  # ids are distinct within a (token, layer)
        return [Counts(h, accesses) for h in _min_hits_per_layer(trace, per_layer, bypass=method == "min")]
    out = []
    for layer in range(trace.n_layers):
        r = per_layer[layer]
        if method == "policy":
            # Each step sorted, as replay_steps' np.unique gives it (a trace's ids are distinct in
            # a step): the same reservations in the same order.
            out.append(replay_steps(np.sort(trace.ids[:, layer, :], axis=1), trace.n_experts, r, policy))
            continue
        steps = trace.ids[:, layer, :].tolist()
        if method == "min":
            out.append(belady_bypass(steps, [], r))
        elif method == "min-no-bypass":
            out.append(belady_no_bypass(steps, [], r))
        else:
            out.append(static_best(steps, [], r))
    return out


def total(counts: Iterable[Counts]) -> Counts:
    """The sum of per-layer :class:`Counts`."""
    return sum(counts, start=Counts())


#: Called with what a comparison has just replayed (a trace, a cache size, a policy or method)
#: and its hit rate: the bench's progress lines.
Progress = Callable[[str, float], None]


def compare_policies(traces: Mapping[str, RoutingTrace], fractions: Sequence[float] = (0.25, 0.5),
                     policies: Sequence[str] | Mapping[str, PolicySpec] = DEFAULT_COMPARED,
                     progress: Progress | None = None) -> list[dict[str, Any]]:
    """One row per (trace, fraction): the hit rate of each policy (replayed through a Ledger), of
    Belady's MIN with bypass (``min``) and without (``min-no-bypass``), of the best static set
    (``static``), and each policy's hit rate over MIN's (``<policy>/min``). ``progress``, when
    given, is called after each replay."""
    named: Mapping[str, PolicySpec] = policies if isinstance(policies, Mapping) else {p: p for p in policies}
    rows: list[dict[str, Any]] = []
    for name, tr in traces.items():
        for frac in fractions:
            n_rows = trace_rows(tr, frac)
            line: dict[str, Any] = {"trace": name, "experts": tr.n_experts, "top_k": tr.top_k,
                                    "layers": tr.n_layers, "tokens": tr.n_tokens, "fraction": frac, "rows": n_rows}
            for m in ("min", "min-no-bypass", "static"):
                line[m] = total(replay_trace(tr, n_rows, method=m)).hit_rate
                if progress is not None:
                    progress(f"{name} at {n_rows} rows: {m}", line[m])
            for label, spec in named.items():
                line[label] = total(replay_trace(tr, n_rows, spec)).hit_rate
                if progress is not None:
                    progress(f"{name} at {n_rows} rows: {label}", line[label])
                # MIN hits nothing when no expert is used twice (a one-token trace): no ratio.
                line[f"{label}/min"] = line[label] / line["min"] if line["min"] else math.nan
            rows.append(line)
    return rows


#: Elements (steps x experts) one block of the vectorised LRU pass compares at once: its memory
#: stays bounded whatever a trace's length or experts.
_BLOCK_ELEMENTS = 1 << 22
#: The most (cache sizes x layers) x experts :func:`trace_min_hits` steps through together (more
#: layers go in groups); a trace of more experts than one layer's sizes fit runs
#: :func:`belady_bypass` layer by layer (the same hits, slower).
_MIN_VECTOR_ELEMENTS = 1 << 16


def _last_uses(steps: np.ndarray, n_experts: int, dtype: type[np.signedinteger[Any]]
               ) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """One layer's ``steps`` ``(T, W)`` (-1 pads) a block at a time (:data:`_BLOCK_ELEMENTS`):
    ``(start, r, c, e, before)``, the block's first step, its accesses (row in the block, slot,
    expert) and ``before[i, x]``, expert ``x``'s last use before step ``start + i`` (-1: none)."""
    last = np.full(n_experts, -1, dtype=dtype)  # each expert's last use before the block
    block = max(1, _BLOCK_ELEMENTS // (n_experts * max(steps.shape[1], 1)))
    for start in range(0, steps.shape[0], block):
        chunk = steps[start:start + block]
        r, c = np.nonzero(chunk >= 0)
        e = chunk[r, c]
        used = np.full((len(chunk) + 1, n_experts), -1, dtype=dtype)
        used[0] = last
        used[r + 1, e] = start + r
        np.maximum.accumulate(used, axis=0, out=used)
        last = used[-1].copy()
        yield start, r, c, e, used[:-1]


def _lru_distances(steps: np.ndarray, n_experts: int) -> tuple[np.ndarray, int]:
    """(hist, accesses) of one layer's ``steps`` ``(T, K)`` (distinct ids in a row, -1 pads a row of
    fewer): ``hist[d]`` counts the accesses at LRU stack distance ``d`` (a first use counts in none).

    The stack orders experts by their last use (latest first) and, within one step, by id, as
    :func:`lru_miss_curve` updates it; an access's distance is then the experts used later than
    its expert's previous use, plus those of that same step with smaller ids: counted here for a
    block of steps at once from each expert's last use before every step."""
    hist = np.zeros(n_experts + 1, dtype=np.int64)
    cols = np.arange(n_experts)
    accesses = 0
    # int64: the keys below multiply a step by the experts
    for _start, r, _c, e, before in _last_uses(steps, n_experts, np.int64):
        accesses += len(e)
        # Keys in stack order (a later use, then a smaller id, is a larger key): an access's
        # distance is how many keys of its step's row exceed its expert's.
        key = before * n_experts + (n_experts - 1 - cols)[None, :]
        order = np.argsort(key, axis=1)
        rank = np.empty_like(order)
        np.put_along_axis(rank, order, np.broadcast_to(cols, order.shape), axis=1)
        warm = before[r, e] >= 0
        d = n_experts - 1 - rank[r[warm], e[warm]]
        hist += np.bincount(d, minlength=n_experts + 1)
    return hist, accesses


def _curve(hist: np.ndarray, accesses: int, n_experts: int) -> np.ndarray:
    # hits with r rows = accesses at distance < r
    hits = np.concatenate([[0], np.cumsum(hist)[:n_experts]])
    return np.asarray(accesses - hits, dtype=np.int64)


def lru_miss_curve(demands: Iterable[Iterable[int]], n_experts: int) -> np.ndarray:
    """Misses of an LRU cache of r rows over ``demands``, for every r in ``0..n_experts`` (one pass,
    Mattson's stack algorithm on set requests: a demanded expert hits with r rows iff fewer than r
    other experts were used since its last use). ``out[r]`` is non-increasing; ``out[0]`` counts
    every access; ``out[n_experts]`` the first uses. Vectorised with numpy (:func:`_lru_distances`).

    The stack orders a step's experts by id, so that every size shares one order; the ledger's
    LRU orders them by whether they hit at its own size, so ``out[r]`` can differ from its misses
    (by a few points on hand-made traces): a curve for :func:`split_rows` to compare layers by,
    not the runtime's figure (:func:`lru_hits` is)."""
    reqs = [sorted({int(e) for e in d}) for d in demands]
    width = max((len(q) for q in reqs), default=0)
    steps = np.full((len(reqs), width), -1, dtype=np.int64)  # -1: no demand in that slot
    for t, q in enumerate(reqs):
        for e in (q[0], q[-1]) if q else ():
            if not 0 <= e < n_experts:
                raise ValueError(f"expert id {e} outside [0, {n_experts})")
        steps[t, :len(q)] = q
    hist, accesses = _lru_distances(steps, n_experts)
    return _curve(hist, accesses, n_experts)


def trace_miss_curves(trace: RoutingTrace) -> list[np.ndarray]:
    """:func:`lru_miss_curve` of every MoE layer of ``trace`` (the input :func:`split_rows` takes)."""
    out = []
    for layer in range(trace.n_layers):
        hist, accesses = _lru_distances(trace.ids[:, layer, :].astype(np.int64), trace.n_experts)
        out.append(_curve(hist, accesses, trace.n_experts))
    return out


def _uses(steps: np.ndarray, n_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """(prev, nxt) of each slot ``t * W + k`` of ``steps`` ``(T, W)`` (-1 pads): the slot of the
    same expert's previous and next use (-1: none; a pad has none)."""
    flat = steps.ravel()
    small = n_experts < (1 << 16)  # a stable sort of 16-bit keys is a radix sort
    keys = np.where(flat >= 0, flat, n_experts)  # pads sort last, after every expert
    order = np.argsort(keys.astype(np.uint16 if small else np.int64), kind="stable")
    same = (keys[order][1:] == keys[order][:-1]) & (keys[order][1:] < n_experts)
    prev = np.full(len(flat), -1, dtype=np.int64)
    nxt = np.full(len(flat), -1, dtype=np.int64)
    prev[order[1:][same]] = order[:-1][same]
    nxt[order[:-1][same]] = order[1:][same]
    return prev, nxt


def _used_between(steps: np.ndarray, n_experts: int) -> np.ndarray:
    """``out[t * W + k]``: how many distinct experts the steps strictly between ``t`` and the
    previous use of ``steps[t, k]`` demand (-1 for a first use or a pad), counted from each
    expert's last use before every step, a block of steps at a time."""
    n_steps, width = steps.shape
    out = np.full(n_steps * width, -1, dtype=np.int64)
    for start, r, c, e, before in _last_uses(steps, n_experts, np.int32):
        s = before[r, e]
        later = np.count_nonzero(before[r] > s[:, None], axis=1)  # experts used since
        warm = s >= 0
        out[((start + r) * width + c)[warm]] = later[warm]
    return out


def _ledger_lru_hits(steps: np.ndarray, n_experts: int, rows: Sequence[int]) -> list[int]:
    """Hits of the ledger's LRU (:func:`replay_steps` with ``"lru"``) on one layer's ``steps``
    ``(T, W)`` (distinct ids in a row, -1 pads), one count per cache size in ``rows`` (each at
    least every step's demand).

    The ledger's cache holds the ``r`` experts highest in its recency order, in which a step's
    demand goes on top, its misses above its hits (hits are bumped in the reserve, misses when
    their fills publish), each group's higher ids above. An expert demanded at step t and last at
    step s hits iff fewer than ``r`` experts are above it at t: those used strictly between
    (``a``, the LRU stack distance, whatever the order within a step) plus those of step s that
    step s put above it and nobody used since (``b``, which depends on which of step s's demands
    hit at that size: no inclusion across sizes). Only accesses with ``a < r <= a + W - 1`` can
    go either way; their hits are solved as a fixed point, each pass over those not yet settled:
    a pass that changes nothing before step t leaves every step before t settled (each step's
    hits follow from earlier steps' alone), so each pass settles at least one more step."""
    n_steps, width = steps.shape
    prev, nxt = _uses(steps, n_experts)
    between = _used_between(steps, n_experts)
    ids = steps.ravel().astype(np.int64)
    out = []
    for r in rows:
        hit = (between >= 0) & (between + width - 1 < r)
        maybe = np.nonzero((between >= 0) & (between < r) & ~hit)[0]
        # In blocks of slots in step order (each slot's hit depends on earlier steps' alone, so a
        # block is solved once those before it are): memory stays bounded whatever the trace.
        block = max(1, _BLOCK_ELEMENTS // (4 * width))
        for start in range(0, len(maybe), block):
            _settle(hit, maybe[start:start + block], prev, nxt, ids, between, width, r)
        out.append(int(hit.sum()))
    return out


def _settle(hit: np.ndarray, maybe: np.ndarray, prev: np.ndarray, nxt: np.ndarray, ids: np.ndarray,
            between: np.ndarray, width: int, r: int) -> None:
    """Set ``hit`` at slots ``maybe`` (in step order, every earlier step's hits settled) to the
    ledger's LRU hits at ``r`` rows (:func:`_ledger_lru_hits`), passes until none changes."""
    p = prev[maybe]
    s, t = p // width, maybe // width
    mates = s[:, None] * width + np.arange(width)[None, :]  # step s's slots
    mate_next = nxt[mates]
    # a mate counts if it is another expert of step s not used again before t
    counted = ((mates != p[:, None]) & (ids[mates] >= 0)
               & ((mate_next < 0) | (mate_next // width >= t[:, None])))
    higher = ids[mates] > ids[maybe][:, None]
    a = between[maybe]
    while len(maybe):
        mine, theirs = hit[p][:, None], hit[mates]
        above = (mine & ~theirs) | ((mine == theirs) & higher)
        now = a + (counted & above).sum(axis=1) < r
        changed = np.nonzero(now != hit[maybe])[0]
        hit[maybe] = now
        if not len(changed):
            return
        keep = t >= t[changed[0]]  # steps before the first change are settled
        maybe, p, t, mates, counted, higher, a = (x[keep] for x in (maybe, p, t, mates, counted, higher, a))


def lru_hits(demands: Iterable[Iterable[int]], n_experts: int, rows: Sequence[int]) -> list[Counts]:
    """The :class:`Counts` :func:`replay_steps` gets with ``"lru"`` (the runtime's LRU: one layer,
    nothing resident) at each cache size in ``rows``, without replaying a :class:`Ledger` per size
    (:func:`_ledger_lru_hits`). Repeats within a step count once, as there. Raises ValueError for
    an id outside ``[0, n_experts)`` or a size below a step's distinct demand (the ledger's
    CapacityError)."""
    reqs = [sorted({int(e) for e in d}) for d in demands]
    sizes = [int(r) for r in rows]
    width = max((len(q) for q in reqs), default=0)
    steps = np.full((len(reqs), max(width, 1)), -1, dtype=np.int64)  # -1: no demand in that slot
    for t, q in enumerate(reqs):
        if q and not (0 <= q[0] and q[-1] < n_experts):
            raise ValueError(f"step {t}: expert id {q[0] if q[0] < 0 else q[-1]} outside [0, {n_experts})")
        steps[t, :len(q)] = q
    for r in sizes:
        if width > r:
            t = next(i for i, q in enumerate(reqs) if len(q) > r)
            raise ValueError(f"step {t} demands {len(reqs[t])} distinct experts but the cache has {r} rows")
    accesses = sum(len(q) for q in reqs)
    return [Counts(h, accesses) for h in _ledger_lru_hits(steps, n_experts, sizes)]


def trace_lru_hits(trace: RoutingTrace, rows: Sequence[int]) -> list[int]:
    """Hits of the runtime's LRU (:func:`replay_steps` with ``"lru"``, nothing resident) summed
    over ``trace``'s layers, one total per cache size in ``rows`` (each at least the top-k), as
    ``asyncside routing info`` shows them. Unlike :func:`trace_miss_curves` these are the ledger's
    own hits: its order within a step (misses above hits) depends on the cache size."""
    sizes = [int(r) for r in rows]
    if any(r < trace.top_k for r in sizes):
        raise ValueError(f"rows: each must be at least the trace's top-k ({trace.top_k}), got {sizes}")
    totals = [0] * len(sizes)
    for layer in range(trace.n_layers):
        hits = _ledger_lru_hits(trace.ids[:, layer, :].astype(np.int64), trace.n_experts, sizes)
        totals = [a + b for a, b in zip(totals, hits)]
    return totals


def _next_uses_of(ids: np.ndarray, never: int) -> np.ndarray:
    """``out[t, l, k]``: the first step after ``t`` whose layer ``l`` demands ``ids[t, l, k]``
    (``never``: none does)."""
    n_steps, n_layers, k = ids.shape
    out = np.empty(ids.shape, dtype=np.int64)
    small = int(ids.max()) < (1 << 16)  # a stable sort of 16-bit keys is a radix sort
    for layer in range(n_layers):
        e = ids[:, layer, :].ravel()  # step-major: a stable sort by id keeps each id's steps in order
        order = np.argsort(e.astype(np.uint16 if small else np.int64), kind="stable")
        se = e[order]
        nxt = np.full(len(order), never, dtype=np.int64)
        same = se[1:] == se[:-1]
        nxt[:-1][same] = order[1:][same] // k
        flat = np.empty(len(order), dtype=np.int64)
        flat[order] = nxt
        out[:, layer, :] = flat.reshape(n_steps, k)
    return out


def trace_min_hits(trace: RoutingTrace, rows: Sequence[int]) -> list[int]:
    """Hits of Belady's MIN with bypass (:func:`belady_bypass`: nothing resident, empty rows at
    the start) summed over ``trace``'s layers, one total per cache size in ``rows``.

    Layers and cache sizes step through the trace together, each step a few numpy operations over
    a (sizes x layers, experts) array, making the choice :func:`asyncside.models.trace.belady`
    makes: keep the ``r`` cached or demanded experts used again soonest (ties: the smaller id),
    none that is never used again. A trace of many experts falls back to :func:`belady_bypass`."""
    sizes = [int(r) for r in rows]
    n_layers, n = trace.n_layers, trace.n_experts
    group = _MIN_VECTOR_ELEMENTS // max(len(sizes) * n, 1)
    if group < 1:
        return [sum(belady_bypass(trace.layer_steps(layer), (), r).hits for layer in range(n_layers))
                for r in sizes]
    totals = [0] * len(sizes)
    for first in range(0, n_layers, group):
        part = _min_hits(np.ascontiguousarray(trace.ids[:, first:first + group, :]), n, sizes)
        totals = [a + b for a, b in zip(totals, part)]
    return totals


def _min_hits_per_layer(trace: RoutingTrace, rows: Sequence[int], *, bypass: bool) -> list[int]:
    """MIN's hits per layer of ``trace``, layer ``l`` with ``rows[l]`` rows: with bypass
    (:func:`belady_bypass`) or under the ledger's rule (:func:`belady_no_bypass`, every demanded
    expert takes a row), layers in groups of :data:`_MIN_VECTOR_ELEMENTS`."""
    n = trace.n_experts
    group = max(1, _MIN_VECTOR_ELEMENTS // max(n, 1))
    out: list[int] = []
    for first in range(0, trace.n_layers, group):
        part = np.ascontiguousarray(trace.ids[:, first:first + group, :])
        out += _min_hits(part, n, [int(r) for r in rows[first:first + group]], bypass=bypass, per_layer=True)
    return out


def _min_hits(ids: np.ndarray, n: int, sizes: list[int], *, bypass: bool = True, per_layer: bool = False
              ) -> list[int]:
    """:func:`trace_min_hits` of ``ids`` ``(T, L, K)`` (ids distinct in a row) at once. With
    ``per_layer``, ``sizes`` holds one cache size per layer and the answer one hit count per layer.
    Without ``bypass``, a step's demanded experts always take rows (the ledger's rule) and a cached
    expert never used again may stay (hits are the same whichever stays)."""
    n_steps, n_layers, k = ids.shape
    copies = 1 if per_layer else len(sizes)
    width = copies * n_layers
    never = n_steps + 1
    # One key per (row, expert): next use x n + id while cached, ``absent`` while not; row b is
    # cache size b // L at layer b % L (per_layer: layer b's own size). A step's demands take their
    # new keys (a hit is one cached before), then each row keeps its r smallest keys (with bypass,
    # none of them never used again; without, the step's demands first).
    wide = ids.astype(np.int64)
    demand_keys = _next_uses_of(ids, never) * n + wide
    base = (np.arange(width, dtype=np.int64) * n)[:, None]
    per_row = sizes if per_layer else [r for r in sizes for _ in range(n_layers)]
    keep = np.array([max(min(r, n), 0) for r in per_row], dtype=np.int64)
    at = np.maximum(keep - 1, 0) + np.arange(width) * n  # each row's r-th smallest key, in the flat sort
    absent = (never + 1) * n
    limit = np.where(keep > 0, never * n - 1 if bypass else absent, -1)
    state = np.full(width * n, absent, dtype=np.int64)
    hits = np.zeros(width, dtype=np.int64)
    block = max(1, _BLOCK_ELEMENTS // max(width * k, 1))
    for start in range(0, n_steps, block):
        stop = min(start + block, n_steps)
        flats = (base[None] + np.tile(wide[start:stop], (1, copies, 1))).reshape(stop - start, -1)
        new_keys = np.tile(demand_keys[start:stop], (1, copies, 1)).reshape(stop - start, -1)
        hit = np.empty(flats.shape, dtype=bool)
        for i in range(stop - start):
            flat = flats[i]
            hit[i] = state[flat] < absent
            # without bypass the demands sort first (each row has at least its step's K rows)
            state[flat] = new_keys[i] if bypass else -1
            table = state.reshape(width, n)
            bound = np.minimum(np.sort(table, axis=1).ravel()[at], limit)
            state = np.where(table <= bound[:, None], table, absent).ravel()
            if not bypass:
                state[flat] = new_keys[i]
        hits += hit.reshape(-1, width, k).sum(axis=(0, 2))
    if per_layer:
        return [int(h) for h in hits]
    return [int(h) for h in hits.reshape(len(sizes), n_layers).sum(axis=1)]


def split_rows(miss_curves: Sequence[Sequence[float] | np.ndarray], total_rows: int, *,
               min_rows: int | Sequence[int] = 0) -> list[int]:
    """Split ``total_rows`` cache rows across layers to minimise the sum of their misses.

    ``miss_curves[l][r]``: misses of layer l with r rows (r from 0 to len - 1; e.g. from
    :func:`lru_miss_curve` or a policy's replay), non-increasing. ``min_rows``: the least each
    layer gets (an int for all, or one per layer; e.g. its top-k, which a step needs at once).
    Greedy over each curve's lower convex hull (optimal for convex curves; a non-convex curve's
    cliff, such as a working set that fits only whole, is taken whole when it pays). Rows beyond
    what lowers any curve go to the layers in turn. Returns one row count per layer, summing to
    ``total_rows``; raises ValueError when the minimums exceed it or a curve is malformed."""
    curves = [np.asarray(c, dtype=np.float64) for c in miss_curves]
    n = len(curves)
    if n == 0:
        raise ValueError("miss_curves: expected at least one layer")
    mins = [int(min_rows)] * n if isinstance(min_rows, (int, np.integer)) else [int(m) for m in min_rows]
    if len(mins) != n:
        raise ValueError(f"min_rows: expected one per layer ({n}), got {len(mins)}")
    for i, (c, m) in enumerate(zip(curves, mins)):
        if c.ndim != 1 or len(c) < 1 or not np.isfinite(c).all():
            raise ValueError(f"miss_curves[{i}]: expected a non-empty 1-d list of finite miss counts")
        if (np.diff(c) > 1e-9 * max(1.0, float(np.abs(c).max()))).any():
            raise ValueError(f"miss_curves[{i}]: misses must not grow with rows (non-increasing)")
        if m < 0 or m > len(c) - 1:
            raise ValueError(f"min_rows[{i}]: {m} is outside the curve's 0..{len(c) - 1} rows")
    if isinstance(total_rows, bool) or not isinstance(total_rows, (int, np.integer)) or total_rows < sum(mins):
        raise ValueError(f"total_rows: {total_rows!r} is less than the layers' minimums ({sum(mins)})")
    alloc = list(mins)
    left = int(total_rows) - sum(mins)
    # Each layer's hull from its minimum: segments (gain per row, rows), taken in order per layer.
    segments: list[list[tuple[float, int]]] = []
    for c, m in zip(curves, mins):
        pts = [(r, float(c[r])) for r in range(m, len(c))]
        hull: list[tuple[int, float]] = []
        for p in pts:  # lower convex hull (monotone chain)
            while len(hull) >= 2:
                (x1, y1), (x2, y2) = hull[-2], hull[-1]
                if (y2 - y1) * (p[0] - x1) >= (p[1] - y1) * (x2 - x1):
                    hull.pop()
                else:
                    break
            hull.append(p)
        segs = [((y1 - y2) / (x2 - x1), x2 - x1) for (x1, y1), (x2, y2) in zip(hull, hull[1:])]
        segments.append([s for s in segs if s[0] > 0])
    heap = [(-segs[0][0], i, 0) for i, segs in enumerate(segments) if segs]
    heapq.heapify(heap)
    while heap and left > 0:
        _gain, i, j = heapq.heappop(heap)
        size = segments[i][j][1]
        take = min(size, left)
        alloc[i] += take
        left -= take
        if take == size and j + 1 < len(segments[i]):
            heapq.heappush(heap, (-segments[i][j + 1][0], i, j + 1))
    # What no curve wants: spread in turn, up to each curve's end, then anywhere.
    i = 0
    while left > 0:
        room = [k for k in range(n) if alloc[k] < len(curves[k]) - 1]
        k = room[i % len(room)] if room else i % n
        alloc[k] += 1
        left -= 1
        i += 1
    return alloc


def holdout_pair(trace: RoutingTrace) -> tuple[RoutingTrace, RoutingTrace]:
    """(profile, holdout) of ``trace``: its first and second sequence when it has several, else its
    first and second half. A split planned on the profile is measured on the holdout, never on the
    routing it was planned from."""
    if trace.n_sequences >= 2:
        a, b = trace.sequence(0), trace.sequence(1)
    else:
        if trace.n_tokens < 2:
            raise ValueError("holdout_pair: a trace of one sequence needs at least two tokens")
        half = trace.n_tokens // 2
        a, b = trace.ids[:half], trace.ids[half:]
    meta = dict(trace.meta)
    return (RoutingTrace(np.ascontiguousarray(a), np.array([len(a)]), trace.n_experts, {**meta, "part": "profile"}),
            RoutingTrace(np.ascontiguousarray(b), np.array([len(b)]), trace.n_experts, {**meta, "part": "holdout"}))


def compare_split(traces: Mapping[str, tuple[RoutingTrace, RoutingTrace]], fractions: Sequence[float] = (0.25, 0.5),
                  policy: PolicySpec = "lrfu", min_rows: int | None = None, *,
                  policies: Sequence[str] | None = None, progress: Progress | None = None) -> list[dict[str, Any]]:
    """One row per (trace, fraction): ``policy`` on the holdout with even rows per layer
    (``even``) and with the same total split by :func:`split_rows` over the profile's LRU miss
    curves (``split``), beside MIN with bypass at even rows (``min``), and the split's gain
    (``split/even``) and fraction of MIN (``split/min``, ``even/min``). ``min_rows``: each layer's
    floor in the split (default the trace's top-k). ``traces`` maps a label to (profile, holdout).
    ``policies``: policy names to replay instead of ``policy``, one row per (trace, fraction,
    policy), each row naming its ``policy`` (the split and MIN are the same for all of them).
    ``progress``, when given, is called after each replay."""
    named: list[tuple[str | None, PolicySpec]] = ([(p, p) for p in policies] if policies is not None else
                                                  [(policy if isinstance(policy, str) else None, policy)])
    out: list[dict[str, Any]] = []
    for name, (profile, holdout) in traces.items():
        if (profile.n_layers, profile.n_experts) != (holdout.n_layers, holdout.n_experts):
            raise ValueError(f"{name}: the profile's shape {(profile.n_layers, profile.n_experts)} differs from "
                             f"the holdout's {(holdout.n_layers, holdout.n_experts)}")
        curves = trace_miss_curves(profile)
        floor = holdout.top_k if min_rows is None else int(min_rows)
        for frac in fractions:
            n_rows = trace_rows(holdout, frac)
            split = split_rows(curves, n_rows * holdout.n_layers, min_rows=min(floor, n_rows))
            best = total(replay_trace(holdout, n_rows, method="min")).hit_rate
            if progress is not None:
                progress(f"{name} at {n_rows} rows: min", best)
            for label, spec in named:
                even = total(replay_trace(holdout, n_rows, spec)).hit_rate
                got = total(replay_trace(holdout, split, spec)).hit_rate
                if progress is not None:
                    progress(f"{name} at {n_rows} rows: {label or 'policy'} even {even:.3f}, split", got)
                row: dict[str, Any] = {} if label is None else {"policy": label}
                out.append({"trace": name, **row, "experts": holdout.n_experts, "top_k": holdout.top_k,
                            "layers": holdout.n_layers, "profile_tokens": profile.n_tokens,
                            "holdout_tokens": holdout.n_tokens, "fraction": frac, "rows": n_rows, "split": split,
                            "even": even, "split_hit_rate": got, "min": best,
                            "split/even": got / even if even else math.nan,
                            "even/min": even / best if best else math.nan,
                            "split/min": got / best if best else math.nan})  # no hits on a short holdout: no ratio
    return out
