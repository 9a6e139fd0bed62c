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

import errno
import functools
import itertools
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import mlx.core as mx
import numpy as np

# numpy imports numpy.ma lazily, on the first np.unique: 10-17 ms, which then happened on the
# event loop during the first prefill (the demo's largest loop-lag tick). Paid here, at import.
import numpy.ma  # noqa: F401

from . import _native
from .errors import AsyncsideError, CapacityError, FillError, LedgerError, StoreError
from .ledger import AuditReport, Fill, Ledger, validate_ids
from .policies import DEFAULT_POLICY
from .pools import PoolSet
from .readers import ReaderOptions
from .scheduler import FillHandle, Scheduler
from .snapshot import RowSnapshot, make_snapshot
from .store import ExpertStore, LayerSpec

if TYPE_CHECKING:
    from .bridge import Completed

__all__ = ["Runtime", "PrefetchHandle", "choose_resident", "plan_layer", "warm_experts"]


#: queued steps apply the stream's fault logs to the ledgers at least this often (steps)
RECONCILE_EVERY = 32


def _native_available(x: mx.array, *, failed: bool = True) -> bool:
    """True when x's computation finished; ``failed`` when it failed. A queued step's failed
    faults are learned from the fault log, not from MLX's error, so checking (and consuming) it
    there loses nothing; a prediction asks for False, so its lazy path meets the error."""
    try:
        return bool(_native.is_available(x))
    except Exception:
        return failed

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
    """(pinned resident experts, dynamic rows) of one layer, as ``Runtime(resident=..., side_rows=...)``
    sizes it. Exposed so other expert sources (benchmark baselines) can size their pools alike.

    A fraction is the pool budget: ``ceil(fraction * n_experts)`` rows in all, at least
    ``min_side_rows``. By default every row is dynamic (managed online by the policy; a store's
    routing ranking only warms them up, see :func:`warm_experts`). ``side_rows`` pins
    ``budget - side_rows`` of the hottest experts (:func:`choose_resident`) and leaves
    ``side_rows`` dynamic. A mapping names the pinned
    experts per layer; then ``side_rows`` (default ``min_side_rows``) rows are dynamic.
    """
    spec = store.layer(index)
    if isinstance(resident, Mapping):
        chosen = [int(e) for e in resident.get(index, ())]
        side = side_rows if side_rows is not None else min_side_rows
    else:
        if not 0.0 <= float(resident) <= 1.0:
            raise ValueError(f"resident fraction must be in [0, 1], got {resident!r}")
        budget = max(1, math.ceil(float(resident) * spec.n_experts))
        side = max(min_side_rows, budget) if side_rows is None else int(side_rows)
        side = min(side, spec.n_experts)
        chosen = choose_resident(store, index, max(0, budget - side))
    if side < 0:
        raise ValueError(f"side_rows must be >= 0, got {side}")
    side = min(side, spec.n_experts - len(chosen))
    return chosen, side


def warm_experts(store: ExpertStore, index: int, count: int, exclude: Sequence[int] = ()) -> list[int]:
    """The experts to load into ``count`` dynamic rows before the first step: the hottest by the
    store's routing ranking (``asyncside convert`` writes one from a profile), or none when the
    store has no ranking (no arbitrary set: the rows then fill as the model routes)."""
    meta = store.metadata or {}
    model_meta = meta.get("asyncside_model")
    has_rank = isinstance(model_meta, Mapping) and str(index) in (model_meta.get("expert_rank") or {})
    if not has_rank and str(index) not in (meta.get("profile") or {}):
        return []
    skip = set(int(e) for e in exclude)
    ranked = [e for e in choose_resident(store, index, store.layer(index).n_experts) if e not in skip]
    return ranked[: max(0, count)]


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
    # Queued steps: the native fault table of this layer (host pools only), and whether the
    # ledger's table changed by other means since the native one was last synced.
    faults: Any = None
    # Device tables with a host tier: the whole-layer arrays staged resolves fill (one per segment
    # key, a row per expert; shared by the layers of one shape), or None.
    staging: dict[str, mx.array] | None = None
    native_dirty: bool = True
    native_order: str = ""
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
    errors: list[Exception] = field(default_factory=list)

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


def _tier_bytes(spec: LayerSpec) -> int:
    """Host memory of one layer's host tier: the mirror's layout, each segment a page-rounded
    block of one row per expert."""
    return sum(-(-spec.n_experts * seg.nbytes // 4096) * 4096 for seg in spec.segments)


class Runtime:
    """Stream expert rows of ``store`` into MLX pools; use as ``async with Runtime(store) as rt``.

    ``resident`` is the fraction of each layer's experts the pools hold in total (the memory
    budget), or an explicit mapping layer -> pinned resident expert ids. By default every row is
    dynamic, managed online by ``policy`` (warmed up from the store's routing ranking when it has
    one); ``side_rows`` pins the hottest ``budget - side_rows`` experts and leaves ``side_rows``
    rows dynamic (see :func:`plan_layer`). ``resident="auto"`` sizes the pools to the memory
    available (:mod:`asyncside.memory`); whatever the residency, the runtime refuses to start when
    its pools would not fit with room for the page cache. ``reader``, ``reader_options`` and
    ``direct`` go to the :class:`~asyncside.scheduler.Scheduler`. ``verify`` (default on) checks
    every record read or faulted in against its checksum in the store before its row is used; a
    mismatch fails that fill with a FillError
    (``errno`` EBADMSG, ``expected`` and ``got``).

    ``host_tier`` (device pools on MLX CUDA only) bounds the pinned host memory kept for a host
    tier of records: a layer in the tier keeps every record its queued steps faulted in, verified,
    in pinned host memory, so a later fault of that expert is a copy to the device alone (no read,
    no checksum on the host node the GPU waits for). Whole layers, in order, while their records
    fit the bound; ``"auto"``: a quarter of the memory available at start once the pools are
    counted (:data:`asyncside.memory.TIER_SHARE`); 0 turns it off.
    """

    def __init__(
        self,
        store: ExpertStore,
        *,
        resident: float | str | Mapping[int, Sequence[int]] = 0.25,
        side_rows: int | None = None,
        min_side_rows: int = 8,
        policy: str = DEFAULT_POLICY,
        reader: str = "auto",
        reader_options: ReaderOptions | None = None,
        direct: bool | None = None,
        layers: Iterable[int] | None = None,
        completed: Completed | None = None,
        verify: bool = True,
        host_tier: int | str = "auto",
    ) -> None:
        if not (host_tier == "auto" or (isinstance(host_tier, int) and not isinstance(host_tier, bool)
                                        and host_tier >= 0)):
            raise ValueError(f"host_tier: expected 'auto' or a number of bytes >= 0, got {host_tier!r}")
        self._host_tier_arg = host_tier
        self._tier_layers: set[int] = set()
        self.store = store
        self.policy = policy
        self._resident_arg = resident
        self._side_rows_arg = side_rows
        self._min_side_rows = min_side_rows
        self._layer_ids = list(layers) if layers is not None else list(store.layers)
        self._scheduler = Scheduler(reader, reader_options, direct=direct, verify=verify)
        self._completed = completed
        self._layers: dict[int, _Layer] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self._changed: anyio.Event | None = None
        self._next_op = 0
        self._closed = False
        self._memory: dict[str, Any] = {}
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
            "queued_steps": 0,
            "faults": 0,
            "fault_time_s": 0.0,
            "skipped_prefetches": 0,
            "warm_bytes": 0,
            "tier_faults": 0,  # faults whose bytes came from the host tier (no read)
            "host_tier_bytes": 0,
            "staged_copies": 0,  # experts a staged resolve copied from the host tier (misses, no row taken)
            "staging_bytes": 0,
        }
        #: the output of the latest staged switch: the next staged resolve depends on it through
        #: data, since every staged switch of this runtime's layers of one shape shares the arrays
        self._staged_tail: mx.array | None = None
        #: the latest queued steps' outputs not known to be computed (see begin_step / quiesce)
        self._queued_outs: list[mx.array] = []
        # Queued steps begun (begin_step) and not yet built (end_step / abandon_step): a long
        # step's graph is built with checkpoints between layers, and quiesce() must not take the
        # rows back from under a step whose fault nodes are being built.
        self._building = 0
        self._build_done: anyio.Event | None = None
        #: nanoseconds of the latest faults (bounded), for latency percentiles
        self._fault_ns: list[int] = []
        #: failed faults learned from the logs, raised by the next begin_step / after_step / quiesce
        self._fault_errors: list[FillError] = []
        #: queued steps: every dynamic row of every layer is lent (begin_step has nothing to do)
        self._lent_all = False
        self._ready_pairs = 0  # queued_ready() answered yes for this many pairs since _lent_all
        self._steps_since_reconcile = 0
        self._fault_errors_seen = 0
        #: release_after() calls whose computation is awaited by a task: key -> (x, leases)
        self._pending_releases: dict[int, tuple[mx.array, list[tuple[int, int]]]] = {}
        self._release_keys = itertools.count()

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
            self._plan_memory()  # refuses (before anything is opened) pools that cannot fit
        except BaseException:
            self._closed = self._exited = True
            raise
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
        if self._queued_outs or any(st.ledger.lent_rows() for st in self._layers.values()):
            # Queued steps may still fault rows in on the stream: let them finish, then take the
            # lent rows back, so the ledgers end consistent (and the pools outlive the reads).
            with anyio.CancelScope(shield=True):
                try:
                    await self.quiesce()
                except Exception:
                    pass  # failed faults were reported to (or are lost with) their steps
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

    def _plan_memory(self) -> None:
        """Resolve ``resident="auto"`` to the residency the memory available allows, state what the
        pools take, and refuse to start (AsyncsideError) when they cannot fit with room to spare."""
        from .memory import MIN_HEADROOM, auto_fraction, available_memory, pool_bytes

        budget = available_memory()
        if self._resident_arg == "auto":
            self._resident_arg = auto_fraction(self.store, budget, self._layer_ids, self._min_side_rows)
        need = (pool_bytes(self.store, float(self._resident_arg), self._layer_ids, self._min_side_rows)
                if not isinstance(self._resident_arg, Mapping) else 0)
        self._stats["pool_bytes_planned"] = need
        self._memory = {"pool_bytes": need, "available_bytes": budget.available, "source": budget.source,
                        "resident": self._resident_arg if not isinstance(self._resident_arg, Mapping) else "mapping"}
        self._tier_layers, tier_bytes = self._plan_tier(budget.available - need - MIN_HEADROOM)
        self._memory["host_tier_bytes"] = tier_bytes
        self._memory["host_tier_layers"] = len(self._tier_layers)
        # The tier's layers get staging arrays (see _setup_staging): a whole layer per shape.
        shapes = {(spec.n_experts, tuple((seg.key, tuple(seg.shape), seg.dtype) for seg in spec.segments)):
                  spec.n_experts * sum(seg.nbytes for seg in spec.segments)
                  for spec in (self.store.layer(i) for i in self._tier_layers)}
        staging = sum(shapes.values())
        self._memory["staging_bytes"] = staging
        need += staging
        if need + MIN_HEADROOM > budget.available:
            raise AsyncsideError(
                f"the pools need {need / 2**30:.2f} GiB (resident={self._resident_arg}"
                f"{f', staging {staging / 2**30:.2f} GiB of it' if staging else ''}) plus "
                f"{MIN_HEADROOM >> 20} MiB of room for the page cache and the model, but only "
                f"{budget.describe()}: use a smaller resident fraction, or resident='auto'")

    def _plan_tier(self, room: int) -> tuple[set[int], int]:
        """The layers whose queued-step faults keep their records in a host tier, and its bytes
        (whole layers in order, within ``host_tier``; ``"auto"``: a quarter of ``room``, the memory
        left once the pools and their headroom are counted); none unless pools live on a CUDA
        device."""
        from .memory import TIER_SHARE
        from .pools import device_pools_default

        cap = int(max(room, 0) * TIER_SHARE) if self._host_tier_arg == "auto" else int(self._host_tier_arg)
        if cap <= 0 or not device_pools_default():
            return set(), 0
        if not _native.device_faults_available():
            return set(), 0
        layers, total = set(), 0
        for index in self._layer_ids:
            nbytes = _tier_bytes(self.store.layer(index))
            if total + nbytes > cap:
                break
            layers.add(index)
            total += nbytes
        return layers, total

    @property
    def memory(self) -> dict[str, Any]:
        """What the pools take and what was available when the runtime started (see asyncside.memory)."""
        return dict(self._memory)

    async def _setup_layers(self) -> None:
        resident_sets: dict[int, list[int]] = {}
        planned = self._resident_arg
        assert not isinstance(planned, str), "resolved by _plan_memory"
        for index in self._layer_ids:
            spec = self.store.layer(index)
            resident, side = plan_layer(self.store, index, planned, self._side_rows_arg, self._min_side_rows)
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
        await self._warm_up(resident_sets)
        await self._setup_fault_tables()
        self._setup_staging()

    def _setup_staging(self) -> None:
        """Give each device fault table with a host tier its staging arrays: one whole layer per
        segment, shared by the layers of one shape, so that a switch whose experts exceed the lent
        rows (a prefill chunk, a large batch) copies its experts there instead of cycling them
        through the pool rows (see :meth:`staged_rows`)."""
        shared: dict[tuple[Any, ...], list[mx.array]] = {}
        for index, st in self._layers.items():
            if st.faults is None or not st.pools.device or index not in self._tier_layers:
                continue
            spec = st.spec
            key = (spec.n_experts, tuple((seg.key, tuple(seg.shape), seg.dtype) for seg in spec.segments))
            arrays = shared.get(key)
            if arrays is None:
                arrays = [mx.zeros((spec.n_experts, *st.pools.arrays[seg.key].shape[1:]),
                                   dtype=st.pools.arrays[seg.key].dtype) for seg in spec.segments]
                mx.eval(*arrays)
                shared[key] = arrays
                self._stats["staging_bytes"] += sum(a.nbytes for a in arrays)
            st.faults.set_staging(arrays)
            st.staging = {seg.key: a for seg, a in zip(spec.segments, arrays)}

    async def _warm_up(self, resident_sets: Mapping[int, list[int]]) -> None:
        """Fill the dynamic rows with the store's hottest experts (when it ranks them) before the
        first step, as ordinary LIVE rows the policy may evict; the hottest count as most recent."""
        waits: list[_Pending] = []
        for index, resident in resident_sets.items():
            st = self._layers[index]
            warm = warm_experts(self.store, index, st.ledger.side_rows, exclude=resident)
            if not warm:
                continue
            fills = self._reserve(index, st, np.asarray(warm, dtype=np.int64), demand=False)
            waits.extend(self._submit(index, st, fills))
        for p in waits:
            await p.wait()
        self._stats["fills"] = 0  # warm-up reads are setup, not misses of the generation
        for index, resident in resident_sets.items():
            st = self._layers[index]
            warm = warm_experts(self.store, index, st.ledger.side_rows, exclude=resident)
            for e in reversed(warm):
                st.ledger.record_use([e])
        self._stats["warm_bytes"] = self._stats["bytes_read"]
        self._stats["bytes_read"] = 0

    async def _setup_fault_tables(self) -> None:
        """One native fault table per layer (queued steps fault experts in there): for host pools,
        and for device pools where the CUDA fault path is compiled in.

        The blobs are opened in a worker thread: an open() can block (a FIFO, a stale mount).
        """
        device_ok = _native.device_faults_available()
        host = [(i, st) for i, st in self._layers.items() if not st.pools.device or device_ok]
        if not host:
            return

        def open_all() -> list[int]:
            fds: list[int] = []
            try:
                for _, st in host:
                    fds.append(os.open(st.spec.path, os.O_RDONLY | os.O_CLOEXEC))
            except OSError as exc:
                for fd in fds:
                    os.close(fd)
                raise AsyncsideError(
                    f"{exc.filename}: cannot open the layer blob for queued steps: {exc.strerror}") from exc
            return fds

        # The host tier's memory first (pinned, zeroed: a worker thread's job), before any blob
        # is opened, so that a failure or a cancellation here leaves nothing to close.
        tiers: dict[int, Any] = {}
        for index, st in host:
            if index in self._tier_layers and st.pools.device:
                tiers[index] = await anyio.to_thread.run_sync(
                    _native.HostMirror, st.spec.n_experts, [seg.nbytes for seg in st.spec.segments])
                self._stats["host_tier_bytes"] += _tier_bytes(st.spec)
        fds = await anyio.to_thread.run_sync(open_all)
        for k, (index, st) in enumerate(host):
            spec = st.spec
            pools = [st.pools.arrays[seg.key] for seg in spec.segments]
            offsets = [seg.offset for seg in spec.segments]
            nbytes = [seg.nbytes for seg in spec.segments]
            try:
                if st.pools.device:
                    # Device pools (MLX CUDA): faults read into pinned host memory and the stream
                    # copies them to the pools; a layer in the host tier reads each record once.
                    tier = tiers.get(index)
                    st.faults = _native.FaultTable.for_device(index, spec.n_experts, pools, st.pools.mirror,
                                                              offsets, nbytes, fds[k], str(spec.path), spec.stride,
                                                              tier=tier)
                else:
                    st.faults = _native.FaultTable(index, spec.n_experts, pools, offsets, nbytes, fds[k],
                                                   str(spec.path), spec.stride)
                if self._scheduler.verify and spec.checksum is not None and spec.checksums is not None:
                    # A faulted record is used only after its bytes verified, as a read one is.
                    st.faults.set_checksums(spec.checksum, list(spec.checksums))
            except BaseException:
                for fd in fds[k + 1:]:  # fds[k] is the table's (closed by the constructor on failure)
                    os.close(fd)
                raise

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
            handle.add_done_callback(functools.partial(self._on_read_done, st, p, op, started=started, on_done=on_done))
        self._stats["fills"] += len(fills)
        return pendings

    def _on_read_done(
        self,
        st: _Layer,
        p: _Pending,
        op: int,
        handle: FillHandle,
        *,
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
        st.native_dirty = True
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
            st.native_dirty = True
        return fills

    @staticmethod
    def _demanded(st: _Layer, upto: int | None = None) -> set[int]:
        """Experts wanted by the ensure() calls in progress on ``st`` (the first ``upto`` of them)."""
        out: set[int] = set()
        for wanted in st.demands[:upto]:
            out.update(wanted.tolist())
        return out

    def _spawn(self, fn: Callable[..., Coroutine[Any, Any, None]], *args: Any) -> None:
        if self._tg is None or self._closed:
            raise AsyncsideError("the runtime is not running (use `async with Runtime(...)`)")
        self._tg.start_soon(fn, *args)

    @staticmethod
    def _host_ids(ids: Any) -> np.ndarray:
        if isinstance(ids, mx.array):
            return np.array(ids, copy=True).reshape(-1)
        return np.asarray(ids).reshape(-1)


    # ---------------------------------------------------------------- queued steps

    def queued_ready(self, pairs: int) -> bool:
        """Whether a queued step routing up to ``pairs`` (token, expert) pairs per MoE layer can run:
        every layer has a fault table and enough rows to lend for that many distinct experts."""
        if self._lent_all and pairs <= self._ready_pairs:
            return True  # every dynamic row is lent already: nothing can have pinned one since
        if any(st.inflight for st in self._layers.values()):
            # A host fill (an ensure's, a prefetch's) still to settle changes its layer's ledger
            # when it does, which must not happen while rows are lent to the stream: this step
            # goes per layer (whose ensure waits for the fill) instead.
            return False
        self.release_computed()
        # A row being filled (a prefetch in flight) or pinned by a lease cannot be lent: the
        # stream would run out of rows for the step's misses.
        for st in self._layers.values():
            if st.faults is None or st.ledger.lendable_rows() < min(pairs, st.spec.n_experts):
                return False
        self._ready_pairs = max(self._ready_pairs, pairs) if self._lent_all else 0
        return True

    def queued_capacity(self) -> int:
        """How many distinct experts every layer can take for one resolve of a queued step: the
        fewest rows any layer could lend now (0 without fault tables). A batch routing more
        resolves its experts in parts of at most this many (see ``models.queued``)."""
        self.release_computed()
        return min((st.ledger.lendable_rows() if st.faults is not None else 0 for st in self._layers.values()),
                   default=0)

    def begin_step(self, pairs: int) -> None:
        """Before queuing a step (never blocks): make sure every layer's dynamic rows are lent to
        its fault table (they stay lent across steps), and raise the FillError of a fault that
        failed in an earlier step. The step is being built from here until :meth:`end_step` (or
        :meth:`abandon_step`): :meth:`quiesce` waits for that.

        Once every row is lent this costs the host next to nothing: what the stream did is applied
        to the ledgers every :data:`RECONCILE_EVERY` steps (and before anything reads them:
        quiesce, audit, stats), failures at once.
        """
        self._lend_for_step()
        self._building += 1

    def _lend_for_step(self) -> None:
        self._check_running()
        if len(self._queued_outs) > 4:
            self._queued_outs = [o for o in self._queued_outs if not _native_available(o)]
        self._stats["queued_steps"] += 1
        if self._lent_all:
            self.after_step()
            return
        self._queued_outs = [o for o in self._queued_outs if not _native_available(o)]
        in_flight = len(self._queued_outs)
        self._reconcile_all()
        self._raise_fault_errors()
        for st in self._layers.values():
            faults = st.faults
            if faults is None:
                raise AsyncsideError(f"layer {st.spec.index}: queued steps need a fault table")
            if st.native_dirty:
                if st.ledger.lent_rows() or in_flight:
                    raise AsyncsideError(f"layer {st.spec.index}: the ledger changed while rows were lent")
                faults.sync(np.ascontiguousarray(st.ledger.lookup(), dtype=np.int32))
                st.native_dirty = False
            policy = st.ledger.policy
            if policy.native_order != st.native_order:
                faults.set_order(policy.native_order, policy.half_life)
                st.native_order = policy.native_order
            # Every dynamic row is lent (lent rows stay lent after a fault): the stream, which sees
            # each use first, picks victims among all of them in the policy's native order.
            short = st.ledger.side_rows - len(st.ledger.lent_rows())
            if short > 0:
                rows = st.ledger.lend(short)
                if rows:
                    faults.lend(rows)
        self._lent_all = all(len(st.ledger.lent_rows()) == st.ledger.side_rows for st in self._layers.values())

    def expert_rows(self, layer: int, ids: mx.array) -> mx.array:
        """Lazy uint32 pool rows of the routed ``ids`` of ``layer`` for a queued step: the stream
        maps each expert to its row when it gets there, reading absent ones into lent rows."""
        st = self._layer(layer)
        if st.faults is None:
            raise AsyncsideError(f"layer {layer}: queued steps need host pools with a fault table")
        rows: mx.array = _native.expert_rows(ids, st.faults)
        return rows

    def staging(self, layer: int) -> dict[str, mx.array] | None:
        """The staging arrays of ``layer`` (one per segment key, a row per expert), or None when
        it has none (host pools, no host tier)."""
        return self._layer(layer).staging

    def staged_rows(self, layer: int, ids: mx.array) -> mx.array:
        """Lazy uint32 rows of the routed ``ids`` of ``layer`` in its :meth:`staging` arrays (the ids
        themselves) for a queued step: when the stream gets there, every routed expert is copied
        into the staging arrays, from its pool row, or from the host tier (read and verified into
        it first when absent). No pool row changes, so a prefill chunk's experts neither evict a
        batch's working set nor need slices of lent rows. Call :meth:`staged_done` with the
        switch's output: the next staged resolve waits for it, through data."""
        st = self._layer(layer)
        if st.faults is None or st.staging is None:
            raise AsyncsideError(f"layer {layer}: no staging arrays (they need device pools and a host tier)")
        tail = self._staged_tail
        if tail is not None:
            # A data dependency (MLX CUDA orders its graph's nodes by the buffers they read and
            # write, and the staging arrays are written behind its back): `ids` whatever `first`.
            first = tail.reshape(-1)[:1]
            ids = mx.where(first == first, ids, ids)
        rows: mx.array = _native.expert_rows(ids, st.faults, staged=True)
        return rows

    def staged_done(self, out: mx.array) -> None:
        """``out`` is the output of the switch that read the latest :meth:`staged_rows`."""
        self._staged_tail = out

    def end_step(self, out: mx.array) -> None:
        """A queued step whose last output is ``out`` is built and about to be scheduled: from now
        on :meth:`quiesce` waits for it (see :meth:`quiesce`)."""
        self._queued_outs.append(out)
        self._step_built()

    def abandon_step(self) -> None:
        """A queued step begun with :meth:`begin_step` will not be scheduled (its build failed or
        was cancelled): :meth:`quiesce` stops waiting for it."""
        self._step_built()

    def _step_built(self) -> None:
        self._building -= 1
        if self._building == 0 and self._build_done is not None:
            self._build_done.set()
            self._build_done = None

    async def quiesce(self) -> None:
        """Wait for every queued step, learn what it did, and take every lent row back, so that
        the per-layer paths (ensure, prefetch, leases) own the rows again."""
        assert self._completed is not None
        while self._building or self._queued_outs:
            if self._building:
                # A step is being built (a long one yields between its layers): its fault nodes
                # will need the lent rows. Wait until it is registered (end_step) or abandoned.
                if self._build_done is None:
                    self._build_done = anyio.Event()
                await self._build_done.wait()
                continue
            out = self._queued_outs[-1]
            failed = None
            try:
                await self._completed(out)
            except Exception:
                # The step's own awaiter hears of its failure; the fault log says what happened. A
                # step MLX refused to schedule (its encoder raised: on a GPU, inside async_eval)
                # never becomes available: it is done with too, or this loop would never end.
                failed = out
            self._queued_outs = [o for o in self._queued_outs if o is not failed and not _native_available(o)]
        self._reconcile_all()
        for st in self._layers.values():
            if st.faults is not None:
                st.ledger.reclaim(st.faults.reclaim())
        self._lent_all = False
        self._ready_pairs = 0
        self._raise_fault_errors()

    def after_step(self) -> None:
        """A queued step's output was awaited: raise the FillError of a failed fault (FillErrors in
        an ExceptionGroup when several failed), and every :data:`RECONCILE_EVERY` steps apply the
        stream's fault logs to the ledgers (the policy sees the uses)."""
        self._steps_since_reconcile += 1
        errors = _native.fault_errors_total()
        if errors != self._fault_errors_seen or self._steps_since_reconcile >= RECONCILE_EVERY:
            self._fault_errors_seen = errors
            self._reconcile_all()
        self._raise_fault_errors()

    def _reconcile_all(self) -> None:
        self._steps_since_reconcile = 0
        for st in self._layers.values():
            self._reconcile(st)

    def _raise_fault_errors(self) -> None:
        errors, self._fault_errors = self._fault_errors, []
        if errors:
            raise errors[0] if len(errors) == 1 else ExceptionGroup(f"{len(errors)} faults failed", errors)

    @property
    def queued_active(self) -> bool:
        """True while queued steps may be running or rows are lent."""
        return bool(self._queued_outs) or self._building > 0 or any(st.ledger.lent_rows()
                                                                     for st in self._layers.values())

    def _reconcile(self, st: _Layer) -> None:
        """Apply a layer's fault log to its ledger; failed faults are kept for the next raise."""
        faults = st.faults
        if faults is None:
            return
        raw_events, raw_used, raw_sizes = faults.drain()
        errors = self._fault_errors
        if raw_events:
            events = np.frombuffer(raw_events, dtype=np.int64).reshape(-1, 6)
            for row, victim, expert, ns, err, source in events.tolist():
                if row >= 0:
                    st.ledger.settle_fault(row, victim, expert, err == 0)
                    st.version += 1
                elif err == 0:
                    # A staged resolve's copy from the host tier (read into it first when source
                    # is 0): a miss that took no row.
                    self._stats["misses"] += 1
                    self._stats["staged_copies"] += 1
                    if source == 0:
                        self._stats["bytes_read"] += st.spec.stride
                    continue
                if err == 0:
                    self._stats["faults"] += 1
                    self._stats["misses"] += 1
                    self._stats["fills"] += 1
                    if source == 0:
                        self._stats["bytes_read"] += st.spec.stride
                    else:  # from the host tier: a device copy, nothing read
                        self._stats["tier_faults"] += 1
                    self._stats["fault_time_s"] += ns * 1e-9
                    if victim >= 0:
                        self._stats["evictions"] += 1
                    self._fault_ns.append(ns)
                else:
                    self._stats["failed_fills"] += 1
                    if err == -2:
                        why = "no lent row was left for it (the step needed more rows than were lent)"
                    elif err == -1:
                        why = "its bytes did not match the store's checksum"
                    else:
                        why = f"the read failed: {os.strerror(err)} (errno {err})" if err != errno.ENODATA else \
                            "the blob ended before the record did"
                    errors.append(FillError(st.spec.index, expert, row, f"fault in a queued step: {why}",
                                            errno=err if err > 0 else None))
            if len(self._fault_ns) > 4096:
                del self._fault_ns[:-2048]
        if raw_used:
            used = np.frombuffer(raw_used, dtype=np.int32)
            st.ledger.record_uses(used, np.frombuffer(raw_sizes, dtype=np.int32).tolist())
            self._stats["hits"] += int(used.size) - int(events.shape[0] if raw_events else 0)

    def fault_latency(self) -> dict[str, float]:
        """Median and p99 of the latest faults' time on the stream (seconds; 0 when none)."""
        self._reconcile_all()
        if not self._fault_ns:
            return {"p50_s": 0.0, "p99_s": 0.0, "count": 0}
        a = np.asarray(self._fault_ns, dtype=np.float64) * 1e-9
        return {"p50_s": float(np.percentile(a, 50)), "p99_s": float(np.percentile(a, 99)), "count": int(a.size)}

    # ---------------------------------------------------------------- public API

    def prefetch(self, layer: int, ids: mx.array | Sequence[int] | np.ndarray) -> PrefetchHandle:
        """Start reading the predicted experts ``ids`` of ``layer``; returns at once.

        ``ids`` may be a lazy ``mx.array``: the runtime awaits its computation through the
        completion bridge, then reserves rows and submits the reads.
        """
        st = self._layer(layer)
        self._check_running()
        handle = PrefetchHandle(layer=layer, _done=anyio.Event())
        if self.queued_active:
            # Queued steps own the rows' placement until quiesce(): a prediction is only a hint.
            self._stats["skipped_prefetches"] += 1
            handle._done.set()
            return handle
        op = self._op(st)
        if isinstance(ids, mx.array) and not _native_available(ids, failed=False):
            self._spawn(self._prefetch_lazy, layer, st, ids, handle, op)
        elif isinstance(ids, mx.array):
            # Computed already (a prediction that crossed a pipeline boundary): no task to spawn
            # and nothing to await; as in the lazy path, its errors fail the handle.
            try:
                self._prefetch_now(layer, st, self._host_ids(ids), handle, op)
            except Exception as exc:
                self._fail_prediction(handle, exc)
            finally:
                self._finish_op(st, op)
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
            self._fail_prediction(handle, exc)
        finally:
            if not handle.fills and not handle._done.is_set():
                # Cancelled (the runtime is closing) before any read started: whoever awaits the
                # handle hears of it instead of waiting forever.
                handle.errors.append(AsyncsideError(
                    f"layer {layer}: the runtime closed before this prediction was computed"))
                handle._done.set()
            self._finish_op(st, op)

    def _fail_prediction(self, handle: PrefetchHandle, exc: Exception) -> None:
        """A prediction is a hint: bad ids or a failed computation fail its handle (and are
        counted), never the runtime's task group."""
        handle.errors.append(exc)
        handle._done.set()
        self._stats["failed_predictions"] += 1

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
        if self.queued_active:
            # Reads outside the stream must not race queued steps that read rows in it. After
            # the last await before the ledger is read: a queued step begun meanwhile would hold
            # the rows again.
            await self.quiesce()
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
                if self.queued_active:
                    # A queued step began while this task awaited (between two of its fills):
                    # take the rows back first; the ledger is only changed with none lent.
                    await self.quiesce()
                    continue
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

    def n_experts(self, layer: int) -> int:
        """How many experts ``layer`` has."""
        return int(self._layer(layer).spec.n_experts)

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
        ids = np.asarray(validate_ids(self._host_ids(experts), st.spec.n_experts, layer=layer), dtype=np.int64)
        return st.ledger.unchanged_since(snap.table, snap.generations, ids)

    def pools(self, layer: int) -> dict[str, mx.array]:
        """The pool arrays of ``layer``, one per segment key, shape ``(rows, *row_shape)``."""
        return self._layer(layer).pools.arrays

    def ledger(self, layer: int) -> Ledger:
        """The ledger of ``layer`` (read it; only the runtime changes it), caught up with what
        queued steps did so far."""
        st = self._layer(layer)
        self._reconcile(st)
        return st.ledger

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
        if self._closed or _native_available(x):
            # Closed: no fill will write a row again. Computed (e.g. a prefill chunk's awaited
            # output): nothing reads the rows. Either way, release now.
            for layer, lease_id in leases:
                self._layer(layer).ledger.release(lease_id)
            self._notify()
            return
        key = next(self._release_keys)
        self._pending_releases[key] = (x, leases)
        self._spawn(self._release_after, key)

    async def _release_after(self, key: int) -> None:
        x, _leases = self._pending_releases[key]
        try:
            assert self._completed is not None
            await self._completed(x)
        finally:
            # Even when cancelled (runtime closing) the leases go: nothing reads them after.
            # (release_computed() may have released them already.)
            held = self._pending_releases.pop(key, None)
            if held is not None:
                for layer, lease_id in held[1]:
                    self._layers[layer].ledger.release(lease_id)
                self._notify()

    def release_computed(self) -> None:
        """Release now the leases whose computation already finished but whose release task has
        not run yet (a step about to be queued needs those rows lendable)."""
        done = [k for k, (x, _) in self._pending_releases.items() if _native_available(x)]
        for key in done:
            _x, leases = self._pending_releases.pop(key)
            for layer, lease_id in leases:
                self._layers[layer].ledger.release(lease_id)
        if done:
            self._notify()

    def audit(self) -> dict[int, Any]:
        """Audit every ledger; returns layer -> AuditReport.

        Queued steps' faults are applied first; with no queued step in flight, each layer's native
        fault table must equal its ledger's lookup table. Once the runtime has closed, a lease still
        open (nobody released it: rows a forward pinned and forgot) or a fill still pending is
        reported as a problem too.
        """
        reports: dict[int, Any] = {}
        idle = not [o for o in self._queued_outs if not _native_available(o)]
        for i, st in self._layers.items():
            self._reconcile(st)
            report = st.ledger.audit()
            extra: list[str] = []
            if st.faults is not None and idle and not st.native_dirty:
                native = np.asarray(st.faults.table(), dtype=np.int32)
                if not np.array_equal(native, st.ledger.lookup()):
                    bad = np.flatnonzero(native != st.ledger.lookup())[:8].tolist()
                    extra.append(f"native fault table differs from the ledger for experts {bad}")
                lent_native = sorted(st.faults.lent())
                if lent_native != sorted(st.ledger.lent_rows()):
                    extra.append(f"rows lent natively {lent_native} != lent by the ledger "
                                 f"{sorted(st.ledger.lent_rows())}")
            if self._exited:
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
        self._reconcile_all()  # queued steps' faults and uses, up to now
        out = dict(self._stats)
        total = out["hits"] + out["misses"]
        out["hit_rate"] = out["hits"] / total if total else 1.0
        out["reader"] = self.reader  # type: ignore[assignment]
        return out
