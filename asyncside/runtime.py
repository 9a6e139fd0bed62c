"""The runtime: one object that owns the pools, the ledgers, the read scheduler and the bridge.

``Runtime`` is the public face of asyncside. A model forward talks to it through five calls:

* ``prefetch(layer, ids)`` — predicted experts; reserves rows and starts reads, returns at once.
* ``await ensure(layer, ids)`` — the demand path; returns once every id has bytes in a row.
* ``lookup(layer)`` — the expert -> row table as an ``mx.array`` for the gather.
* ``lease(layer, experts)`` / ``release_after(x, leases)`` — rows a forward reads stay pinned
  until the computation that reads them has completed on its stream.
* ``await drain(layer)`` — wait for every fill submitted so far, and hear about the ones that failed.

All ledger transitions happen on the event loop thread: the scheduler runs fill callbacks there,
and the runtime never touches a ledger from anywhere else. That is what keeps the ledger a plain
synchronous state machine.
"""

from __future__ import annotations

import math
from collections import Counter
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Awaitable

import anyio
import mlx.core as mx
import numpy as np

from .errors import AsyncsideError, CapacityError, FillError, LedgerError, StoreError
from .ledger import AuditReport, Fill, Ledger
from .pools import PoolSet
from .scheduler import FillHandle, Scheduler
from .snapshot import RowSnapshot, make_snapshot
from .store import ExpertStore, LayerSpec

__all__ = ["Runtime", "PrefetchHandle", "choose_resident", "plan_layer"]

Completed = Callable[[mx.array], Awaitable[None]]


def choose_resident(store: ExpertStore, layer: int, count: int) -> list[int]:
    """Pick ``count`` resident experts for ``layer``.

    The hottest experts first: from the converter's hottest-first ranking
    (``metadata["asyncside_model"]["expert_rank"]``, written by ``asyncside convert``, ranked by a
    routing profile when it had one), else a top-level routing profile (``metadata["profile"]``:
    per-layer routed counts), else the experts named in ``metadata["resident"]`` in order, else
    experts ``0..count-1``.
    """
    spec = store.layer(layer)
    count = max(0, min(count, spec.n_experts))
    meta = store.metadata or {}
    model_meta = meta.get("asyncside_model")
    ranking = (model_meta.get("expert_rank") or {}).get(str(layer)) if isinstance(model_meta, Mapping) else None
    if ranking is not None:
        ranked = [int(e) for e in ranking if 0 <= int(e) < spec.n_experts]
        seen = set(ranked)
        ranked += [e for e in range(spec.n_experts) if e not in seen]
        return ranked[:count]
    profile = (meta.get("profile") or {}).get(str(layer))
    if profile is not None:
        counts = np.asarray(profile, dtype=np.float64)
        # Stable sort on -count: ties keep the smaller expert id first.
        order = np.argsort(-counts, kind="stable")
        return [int(e) for e in order[:count]]
    listed = (meta.get("resident") or {}).get(str(layer))
    if listed is not None:
        chosen = [int(e) for e in listed[:count]]
        rest = [e for e in range(spec.n_experts) if e not in set(chosen)]
        return chosen + rest[: count - len(chosen)]
    return list(range(count))


def plan_layer(store: ExpertStore, index: int, resident: float | Mapping[int, Sequence[int]] = 0.25,
               side_rows: int | None = None, min_side_rows: int = 8) -> tuple[list[int], int]:
    """(resident experts, side rows) of one layer, as ``Runtime(resident=..., side_rows=...)`` sizes it.

    A fraction is the pool budget: ``ceil(fraction * n_experts)`` rows in all, of which
    ``side_rows`` (default: half the budget, at least ``min_side_rows``) rotate and the rest hold
    the hottest experts (:func:`choose_resident`). Exposed so other expert sources (benchmark
    baselines) can size their pools exactly like the runtime.
    """
    spec = store.layer(index)
    if isinstance(resident, Mapping):
        chosen = [int(e) for e in resident.get(index, ())]
        side = side_rows if side_rows is not None else min_side_rows
    else:
        if not 0.0 <= float(resident) <= 1.0:
            raise ValueError(f"resident fraction must be in [0, 1], got {resident!r}")
        budget = max(1, math.ceil(float(resident) * spec.n_experts))
        side = int(side_rows) if side_rows is not None else max(min_side_rows, budget // 2)
        side = min(side, spec.n_experts)
        chosen = choose_resident(store, index, max(0, budget - side))
    if side < 0:
        raise ValueError(f"side_rows must be >= 0, got {side}")
    side = min(side, spec.n_experts - len(chosen))
    return chosen, side


def _checked_ids(layer: int, n_experts: int, ids: np.ndarray) -> np.ndarray:
    """Unique expert ids as int64, or LedgerError naming the first bad value (as given)."""
    if ids.size == 0:
        return np.zeros(0, dtype=np.int64)
    if ids.dtype.kind not in "iu":
        raise LedgerError(f"layer {layer}: expert ids must be integers, got dtype {ids.dtype}")
    # Range-checked before the cast: uint64 2**64-1 cast to int64 would read as -1.
    lo, hi = ids.min(), ids.max()
    if lo < 0 or hi >= n_experts:
        bad = int(lo if lo < 0 else hi)
        raise LedgerError(f"layer {layer}: expert id {bad} is out of range [0, {n_experts})")
    return np.unique(ids.astype(np.int64, copy=False))


@dataclass
class _Layer:
    """Everything the runtime keeps for one layer. Mutated on the loop thread only."""

    spec: LayerSpec
    ledger: Ledger
    pools: PoolSet
    inflight: dict[int, _Pending] = field(default_factory=dict)  # expert -> its fill in flight
    # op id -> holders. A prefetch's fills hold the prefetch's own op id, so a drain that began
    # before a lazy prefetch resolved still waits for the reads that prefetch starts later.
    outstanding: Counter[int] = field(default_factory=Counter)
    errors: list[FillError] = field(default_factory=list)  # failed fills since the last drain
    # Device pools: reads that landed in the mirror, waiting for one batched upload.
    uploads: list[tuple[_Pending, int, float, Any]] = field(default_factory=list)
    table: mx.array | None = None
    table_version: int = -1
    snap: RowSnapshot | None = None
    snap_version: int = -1
    version: int = 0  # bumped on every row-state change that alters lookup()
    # ensure() calls that must reserve, oldest first, each with its wanted experts. An ensure
    # never evicts what an older one wants, and a prefetch evicts nothing any of them wants: the
    # oldest always makes progress (fair FIFO demand, no livelock between concurrent ensures).
    demands: list[np.ndarray] = field(default_factory=list)


@dataclass
class PrefetchHandle:
    """What ``Runtime.prefetch`` returns: await it to wait for the prefetch's own fills."""

    layer: int
    _done: anyio.Event
    fills: list[Fill] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)

    def done(self) -> bool:
        return self._done.is_set()

    async def wait(self) -> None:
        """Wait for this prefetch's reads; raise an ExceptionGroup of its FillErrors, if any."""
        await self._done.wait()
        if self.errors:
            raise ExceptionGroup(f"prefetch of layer {self.layer} failed", list(self.errors))

    def __await__(self):  # type: ignore[no-untyped-def]
        return self.wait().__await__()


class _Pending:
    """One fill from reserve until its bytes are usable in the pool (read, and uploaded for device
    pools). Settled exactly once, on the loop thread, right after the ledger saw the outcome."""

    __slots__ = ("fill", "_event", "error")

    def __init__(self, fill: Fill) -> None:
        self.fill = fill
        self._event = anyio.Event()
        self.error: FillError | None = None

    def done(self) -> bool:
        return self._event.is_set()

    def settle(self, error: FillError | None) -> None:
        self.error = error
        self._event.set()

    async def wait(self) -> None:
        """Wait for the bytes; raise the fill's FillError if it failed."""
        await self._event.wait()
        if self.error is not None:
            raise self.error


class Runtime:
    """Stream expert rows of ``store`` into MLX pools; use as ``async with Runtime(store) as rt``.

    ``resident`` is the fraction of each layer's experts the pools hold in total (the memory
    budget), or an explicit mapping layer -> resident expert ids. ``side_rows`` is how many of
    those rows rotate (the side region); the rest hold a fixed resident set. By default half the
    budget rotates, at least ``min_side_rows``. ``verify`` (default on) checks every record read
    against its checksum in the store before its row is published; a mismatch fails that fill
    with a FillError (``errno`` EBADMSG, ``expected`` and ``got``).
    """

    def __init__(
        self,
        store: ExpertStore,
        *,
        resident: float | Mapping[int, Sequence[int]] = 0.25,
        side_rows: int | None = None,
        min_side_rows: int = 8,
        policy: str = "lfu",
        reader: str = "auto",
        queue_depth: int = 64,
        direct: bool | None = None,
        layers: Iterable[int] | None = None,
        completed: Completed | None = None,
        verify: bool = True,
    ) -> None:
        self.store = store
        self.policy = policy
        self._resident_arg = resident
        self._side_rows_arg = side_rows
        self._min_side_rows = min_side_rows
        self._layer_ids = list(layers) if layers is not None else list(store.layers)
        # verify: every record read is checked against its checksum before its row is published
        # (a mismatch is a FillError); False skips the check.
        self._scheduler = Scheduler(reader, queue_depth=queue_depth, direct=direct, verify=verify)
        self._completed = completed
        self._layers: dict[int, _Layer] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self._changed: anyio.Event | None = None
        self._next_op = 0
        self._closed = False
        self._exited = False  # _close() finished: every read landed, every task is gone
        self._stats: dict[str, float] = {
            "hits": 0,
            "misses": 0,
            "late": 0,  # demanded while its prefetch was still in flight
            "fills": 0,
            "failed_fills": 0,
            "bytes_read": 0,
            "evictions": 0,
            "prefetched": 0,
            "read_time_s": 0.0,
            "stall_time_s": 0.0,
            "ensure_calls": 0,
            "resident_bytes": 0,
            "failed_predictions": 0,
        }

    # ---------------------------------------------------------------- lifecycle

    @property
    def reader(self) -> str:
        """The reader backend actually in use."""
        return self._scheduler.name

    async def __aenter__(self) -> Runtime:
        if self._completed is None:
            from .bridge import completed

            self._completed = completed
        self._changed = anyio.Event()
        try:
            # Cancellable at every await; on any failure (cancellation included) the scheduler
            # has already closed itself.
            await self._scheduler.__aenter__()
        except BaseException:
            self._closed = self._exited = True
            raise
        try:
            self._tg = anyio.create_task_group()
            await self._tg.__aenter__()
            await self._setup_layers()
        except BaseException:
            # Not handed to the task group (it would wrap it in an ExceptionGroup): the setup
            # error itself is what the caller sees.
            await self._close(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        return await self._close(*exc_info)

    async def _close(self, *exc_info: Any) -> bool | None:
        self._closed = True
        # Pending prefetch tasks and lease releases are ours: cancel them. Reads already
        # submitted are not cancelled: the scheduler waits for them so no row stays FILLING.
        try:
            if self._tg is not None:
                self._tg.cancel_scope.cancel()
                await self._tg.__aexit__(*exc_info)
        finally:
            try:
                await self._scheduler.__aexit__(*exc_info)
            finally:
                self._exited = True
                if self._changed is not None:
                    self._notify()  # an ensure waiting for a change hears that the runtime closed
        return None

    async def _setup_layers(self) -> None:
        resident_sets: dict[int, list[int]] = {}
        for index in self._layer_ids:
            spec = self.store.layer(index)
            resident, side = plan_layer(self.store, index, self._resident_arg, self._side_rows_arg,
                                        self._min_side_rows)
            ledger = Ledger(spec.n_experts, resident, side, policy=self.policy)
            pools = await PoolSet.allocate(spec, ledger.rows)
            try:
                # Opened now, in a worker thread: never on the loop, never at a first fill.
                await self._scheduler.prepare(spec, pools)
            except OSError as exc:
                raise StoreError(spec.path, f"layer {index}: cannot open the blob for reading: "
                                 f"{exc.strerror or exc}", errno=exc.errno) from None
            self._layers[index] = _Layer(spec=spec, ledger=ledger, pools=pools)
            resident_sets[index] = resident
        # Resident rows are read once, through the same reader as everything else.
        handles: list[FillHandle] = []
        for index, resident in resident_sets.items():
            st = self._layers[index]
            fills = [Fill(fill_id=-1 - row, expert=e, row=row) for row, e in enumerate(resident)]
            if fills:
                handles.extend(self._scheduler.submit(st.spec, st.pools, fills))
        errors: list[FillError] = []
        for h in handles:
            try:
                await h.wait()
            except FillError as err:
                errors.append(err)
        for index, resident in resident_sets.items():
            st = self._layers[index]
            if st.pools.device and resident and not errors:
                # Device pools: the mirror holds the bytes; copy them over on MLX's stream.
                assert self._completed is not None
                await self._completed(st.pools.upload(range(len(resident))))
        self._stats["resident_bytes"] = sum(
            len(r) * self._layers[i].spec.stride for i, r in resident_sets.items()
        )
        if errors:
            raise ExceptionGroup("loading resident experts failed", errors)

    # ---------------------------------------------------------------- helpers

    def _layer(self, layer: int) -> _Layer:
        try:
            return self._layers[layer]
        except KeyError:
            raise AsyncsideError(
                f"layer {layer} is not streamed by this runtime (layers: {sorted(self._layers)})"
            ) from None

    def _check_running(self) -> None:
        """AsyncsideError unless the runtime is entered and not closing (before any ledger change)."""
        if self._closed:
            raise AsyncsideError("the runtime is closed: no more prefetch/ensure (it was used after "
                                 "`async with Runtime(...)` ended, or its entry failed)")
        if self._tg is None:
            raise AsyncsideError("the runtime is not running (use `async with Runtime(...) as rt`)")

    def _notify(self) -> None:
        assert self._changed is not None
        self._changed.set()
        self._changed = anyio.Event()

    async def _wait_change(self) -> None:
        assert self._changed is not None
        await self._changed.wait()

    def _op(self, st: _Layer, op: int | None = None) -> int:
        """Hold ``op`` (a new one when None) outstanding until ``_finish_op``."""
        if op is None:
            op = self._next_op
            self._next_op += 1
        st.outstanding[op] += 1
        return op

    def _finish_op(self, st: _Layer, op: int) -> None:
        st.outstanding[op] -= 1
        if st.outstanding[op] <= 0:
            del st.outstanding[op]
        self._notify()

    def _submit(
        self,
        layer: int,
        st: _Layer,
        fills: Sequence[Fill],
        on_done: Callable[[_Pending], None] | None = None,
        parent_op: int | None = None,
    ) -> list[_Pending]:
        """Hand reserved fills to the scheduler; returns one _Pending per fill.

        Each fill holds an op (``parent_op`` when a prefetch started it) until it settles.
        ``on_done`` runs after the ledger saw the outcome and before drain waiters are woken,
        so whoever is woken sees a consistent picture.
        """
        if not fills:
            return []
        pendings = [_Pending(fill) for fill in fills]
        for p in pendings:
            st.inflight[p.fill.expert] = p
        ops = [self._op(st, parent_op) for _ in fills]
        started = time.perf_counter()
        try:
            handles = self._scheduler.submit(st.spec, st.pools, fills)
        except Exception as exc:
            # No read started: fail every fill now (rows back to FREE, awaiters told), so no row
            # stays FILLING and no drain waits for a read that never was.
            self._stats["fills"] += len(fills)
            code = getattr(exc, "errno", None)
            for p, op in zip(pendings, ops):
                err = FillError(st.spec.index, p.fill.expert, p.fill.row,
                                f"the read could not be started: {exc}", errno=code)
                self._settle(st, p, op, err, started, on_done)
            return pendings
        for p, op, handle in zip(pendings, ops, handles):
            handle.add_done_callback(
                lambda h, p=p, op=op: self._on_read_done(st, p, op, h, started, on_done)
            )
        self._stats["fills"] += len(fills)
        return pendings

    def _on_read_done(
        self,
        st: _Layer,
        p: _Pending,
        op: int,
        handle: FillHandle,
        started: float,
        on_done: Callable[[_Pending], None] | None,
    ) -> None:
        # Runs on the loop thread. Host pools: the bytes are in the row now. Device pools: they
        # are in the host mirror; the row is published once the upload on the stream completed.
        err = handle.result_error()
        if err is None and st.pools.device:
            if not self._closed:
                # Batch: every read that completes before the flush task runs shares one upload.
                st.uploads.append((p, op, started, on_done))
                if len(st.uploads) == 1:
                    self._spawn(self._flush_uploads, st)
                return
            err = FillError(st.spec.index, p.fill.expert, p.fill.row, "the runtime closed before the upload")
        self._settle(st, p, op, err, started, on_done)

    async def _flush_uploads(self, st: _Layer) -> None:
        await anyio.lowlevel.checkpoint()  # let the rest of this wakeup's completions join
        batch, st.uploads = st.uploads, []
        err_text: str | None = None
        try:
            assert self._completed is not None
            with anyio.CancelScope(shield=True):
                # Shielded: once the copy is on the stream the rows must not be reused before it ran.
                await self._completed(st.pools.upload([p.fill.row for p, *_ in batch]))
        except Exception as exc:  # the upload failed on the device: these fills failed
            err_text = f"upload to the device pool failed: {exc}"
        for p, op, started, on_done in batch:
            err = None if err_text is None else FillError(st.spec.index, p.fill.expert, p.fill.row, err_text)
            self._settle(st, p, op, err, started, on_done)

    def _settle(
        self,
        st: _Layer,
        p: _Pending,
        op: int,
        err: FillError | None,
        started: float,
        on_done: Callable[[_Pending], None] | None,
    ) -> None:
        """The one place a fill's row leaves FILLING: publish on success, fail (row freed) otherwise."""
        fill = p.fill
        if st.inflight.get(fill.expert) is p:
            del st.inflight[fill.expert]
        if err is None:
            st.ledger.publish(fill)
            self._stats["bytes_read"] += st.spec.stride
        else:
            st.ledger.fail(fill)
            st.errors.append(err)
            self._stats["failed_fills"] += 1
        self._stats["read_time_s"] += time.perf_counter() - started
        st.version += 1
        p.settle(err)
        if on_done is not None:
            on_done(p)
        self._finish_op(st, op)

    def _reserve(self, layer: int, st: _Layer, ids: np.ndarray, *, demand: bool,
                 protect: Iterable[int] = ()) -> list[Fill]:
        before = st.ledger.stats.get("evictions", 0)
        fills = st.ledger.reserve(ids, demand=demand, protect=protect)
        evicted = st.ledger.stats.get("evictions", 0) - before
        self._stats["evictions"] += evicted
        if fills or evicted:
            # An eviction changes lookup(): the evicted expert no longer has a row. (The one-shot
            # policy drops experts even when a reserve starts no fill.)
            st.version += 1
        return fills

    @staticmethod
    def _demanded(st: _Layer, upto: int | None = None) -> set[int]:
        """Experts wanted by the ensure() calls in progress on ``st`` (the first ``upto`` of them)."""
        out: set[int] = set()
        for wanted in st.demands[:upto]:
            out.update(wanted.tolist())
        return out

    def _spawn(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        if self._tg is None or self._closed:
            raise AsyncsideError("the runtime is not running (use `async with Runtime(...)`)")
        self._tg.start_soon(fn, *args)

    @staticmethod
    def _host_ids(ids: Any) -> np.ndarray:
        if isinstance(ids, mx.array):
            return np.array(ids, copy=True).reshape(-1)
        return np.asarray(ids).reshape(-1)

    # ---------------------------------------------------------------- public API

    def prefetch(self, layer: int, ids: mx.array | Sequence[int] | np.ndarray) -> PrefetchHandle:
        """Start reading the predicted experts ``ids`` of ``layer``; returns at once.

        ``ids`` may be a lazy ``mx.array``: the runtime awaits its computation through the
        completion bridge, then reserves rows and submits the reads.
        """
        st = self._layer(layer)
        self._check_running()
        handle = PrefetchHandle(layer=layer, _done=anyio.Event())
        op = self._op(st)
        if isinstance(ids, mx.array):
            self._spawn(self._prefetch_lazy, layer, st, ids, handle, op)
        else:
            try:
                self._prefetch_now(layer, st, self._host_ids(ids), handle, op)
            finally:
                self._finish_op(st, op)
        return handle

    async def _prefetch_lazy(
        self, layer: int, st: _Layer, ids: mx.array, handle: PrefetchHandle, op: int
    ) -> None:
        try:
            assert self._completed is not None
            await self._completed(ids)
            self._prefetch_now(layer, st, self._host_ids(ids), handle, op)
        except Exception as exc:
            # A prediction is a hint: bad ids or a failed computation fail its handle (and are
            # counted), never the runtime's task group.
            handle.errors.append(exc)
            handle._done.set()
            self._stats["failed_predictions"] += 1
        finally:
            if not handle.fills and not handle._done.is_set():
                # Cancelled (the runtime is closing) before any read started: whoever awaits the
                # handle hears of it instead of waiting forever.
                handle.errors.append(AsyncsideError(
                    f"layer {layer}: the runtime closed before this prediction was computed"))
                handle._done.set()
            self._finish_op(st, op)

    def _prefetch_now(
        self, layer: int, st: _Layer, ids: np.ndarray, handle: PrefetchHandle, op: int
    ) -> None:
        if ids.size == 0:  # nothing predicted: nothing to do
            handle._done.set()
            return
        fills = self._reserve(layer, st, ids, demand=False, protect=self._demanded(st))
        handle.fills = fills
        self._stats["prefetched"] += len(fills)
        if not fills:
            handle._done.set()
            return
        remaining = [len(fills)]

        def one_done(p: _Pending) -> None:
            if p.error is not None:
                handle.errors.append(p.error)
            remaining[0] -= 1
            if remaining[0] == 0:
                handle._done.set()

        self._submit(layer, st, fills, one_done, parent_op=op)

    async def drain(self, layer: int | None = None) -> None:
        """Wait for every fill (and pending prefetch) submitted so far for ``layer`` (or all).

        Raises an ExceptionGroup of the FillErrors of fills that failed since the last drain.
        """
        layers = [self._layer(layer)] if layer is not None else list(self._layers.values())
        horizon = self._next_op
        while any(op < horizon for st in layers for op in st.outstanding):
            await self._wait_change()
        errors: list[FillError] = []
        for st in layers:
            errors.extend(st.errors)
            st.errors.clear()
        if errors:
            where = f"layer {layer}" if layer is not None else "all layers"
            raise ExceptionGroup(f"{len(errors)} fill(s) failed ({where})", errors)

    async def ensure(self, layer: int, ids: mx.array | Sequence[int] | np.ndarray) -> None:
        """Return once every expert in ``ids`` has its bytes in a row of ``layer``'s pools.

        Experts already present are hits; absent ones are reserved on demand (a demand is never
        skipped like a prediction is) and read; ones whose prefetch is in flight are waited for.
        A fill that fails raises its FillError here.
        """
        st = self._layer(layer)
        self._check_running()
        if isinstance(ids, mx.array):
            assert self._completed is not None
            await self._completed(ids)
            self._check_running()
        wanted = _checked_ids(layer, st.spec.n_experts, self._host_ids(ids))
        if wanted.size == 0:  # nothing wanted: nothing to wait for
            return
        self._stats["ensure_calls"] += 1
        lookup = st.ledger.lookup()
        present = lookup[wanted] >= 0
        n_hits = int(present.sum())
        missing = wanted[~present]
        if missing.size == 0:
            # Tell the policy these experts were used (LFU counts, LRU recency), as a miss does.
            self._reserve(layer, st, wanted, demand=True, protect=self._demanded(st))
            self._stats["hits"] += n_hits
            return
        t0 = time.perf_counter()
        counted = False
        st.demands.append(wanted)
        try:
            while True:
                self._check_running()
                # Re-check every wanted expert, not only the ones missing before: while this
                # task awaited, a prefetch may have evicted one that was present.
                missing = wanted[st.ledger.lookup()[wanted] < 0]
                if missing.size == 0:
                    return
                # The whole wanted set goes in: the ledger never evicts a member of the batch,
                # nor anything an older ensure on this layer still waits for.
                mine = next(i for i, w in enumerate(st.demands) if w is wanted)
                fills = self._reserve(layer, st, wanted, demand=True, protect=self._demanded(st, mine))
                if not counted:
                    # Counted once the batch fits: a CapacityError is retried by the forward in
                    # smaller groups, whose ensures count their own hits and misses.
                    counted = True
                    self._stats["hits"] += n_hits
                    self._stats["misses"] += int(missing.size)
                    self._stats["late"] += sum(1 for e in missing.tolist() if e in st.inflight)
                ours = self._submit(layer, st, fills)
                # Fills that settled inside submit are awaited too, so a failure among them
                # reaches this awaiter.
                waiting = [p for p in ours if p.done()]
                waiting += [st.inflight[e] for e in missing.tolist() if e in st.inflight]
                if waiting:
                    for h in waiting:
                        await h.wait()  # raises FillError: the awaiter hears of it
                elif st.ledger.blocked:
                    # Every usable row is pinned by a lease, filling, or wanted by an older
                    # ensure: wait for a change.
                    await self._wait_change()
                else:
                    raise CapacityError(
                        f"layer {layer}: experts {missing.tolist()} could not be placed "
                        f"(side region of {st.ledger.side_rows} rows)"
                    )
        finally:
            st.demands[:] = [w for w in st.demands if w is not wanted]
            self._notify()  # what this ensure protected may now be evicted by a younger one
            self._stats["stall_time_s"] += time.perf_counter() - t0

    def lookup(self, layer: int) -> mx.array:
        """The expert -> row table of ``layer`` (int32, -1 for absent) as an ``mx.array``."""
        st = self._layer(layer)
        if st.table is None or st.table_version != st.version:
            st.table = mx.array(st.ledger.lookup())
            st.table_version = st.version
        return st.table

    def snapshot(self, layer: int) -> RowSnapshot:
        """Where ``layer``'s experts are now, for an in-graph gather (see :mod:`asyncside.snapshot`)."""
        st = self._layer(layer)
        if st.snap is None or st.snap_version != st.version:
            # Every reserve that hands out a row bumps st.version, so generations cannot change
            # under a cached snapshot either.
            st.snap = make_snapshot(st.ledger.lookup(), st.ledger.generations())
            st.snap_version = st.version
        return st.snap

    def unchanged(self, layer: int, snap: RowSnapshot, experts: np.ndarray) -> np.ndarray:
        """Bool per expert: present in ``snap`` and in the same row since, never refilled."""
        st = self._layer(layer)
        ids = self._host_ids(experts)
        _checked_ids(layer, st.spec.n_experts, ids)  # validates; the answer keeps the caller's order
        return st.ledger.unchanged_since(snap.table, snap.generations, ids)

    def pools(self, layer: int) -> dict[str, mx.array]:
        """The pool arrays of ``layer``, one per segment key, shape ``(rows, *row_shape)``."""
        return self._layer(layer).pools.arrays

    def ledger(self, layer: int) -> Ledger:
        """The ledger of ``layer`` (read it; only the runtime changes it)."""
        return self._layer(layer).ledger

    def lease(self, layer: int, experts: Iterable[int] | np.ndarray) -> int:
        """Pin the rows of ``experts`` so no fill overwrites them; returns a lease id."""
        return self._layer(layer).ledger.lease(experts)

    def release(self, layer: int, lease_id: int) -> None:
        """Release a lease now (the caller knows the rows are no longer read)."""
        self._layer(layer).ledger.release(lease_id)
        self._notify()

    def release_after(self, x: mx.array, leases: Iterable[tuple[int, int]]) -> None:
        """Release ``leases`` ((layer, lease id) pairs) once ``x`` has been computed."""
        leases = list(leases)
        if not leases:
            return
        if self._closed:
            # No fill will ever write a row again: nothing to protect, release now.
            for layer, lease_id in leases:
                self._layer(layer).ledger.release(lease_id)
            return
        self._spawn(self._release_after, x, leases)

    async def _release_after(self, x: mx.array, leases: list[tuple[int, int]]) -> None:
        try:
            assert self._completed is not None
            await self._completed(x)
        finally:
            # Even when cancelled (runtime closing) the leases go: nothing reads them after.
            for layer, lease_id in leases:
                self._layers[layer].ledger.release(lease_id)
            self._notify()

    def audit(self) -> dict[int, Any]:
        """Audit every ledger; returns layer -> AuditReport.

        Once the runtime has closed, a lease still open (nobody released it: rows a forward
        pinned and forgot) or a fill still pending is reported as a problem too.
        """
        reports: dict[int, Any] = {}
        for i, st in self._layers.items():
            report = st.ledger.audit()
            if self._exited:
                extra: list[str] = []
                pinned = st.ledger.pinned_rows()
                n_leases = report.counts.get("leases", 0)
                if n_leases or pinned:
                    extra.append(f"{n_leases} lease(s) still open after the runtime closed "
                                 f"(pinned rows {sorted(pinned)}): a lease was never released")
                pending = st.ledger.pending()
                if pending:
                    extra.append(f"{len(pending)} fill(s) still pending after the runtime closed: {pending[:4]}")
                if extra:
                    report = AuditReport(False, [*report.problems, *extra], report.counts)
            reports[i] = report
        return reports

    def stats(self) -> dict[str, float]:
        """Counters since start: hits, misses, bytes read, fills, evictions, read/stall time."""
        out = dict(self._stats)
        total = out["hits"] + out["misses"]
        out["hit_rate"] = out["hits"] / total if total else 1.0
        out["reader"] = self.reader  # type: ignore[assignment]
        return out
