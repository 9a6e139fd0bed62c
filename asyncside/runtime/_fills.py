"""The host fill path: rows reserved by the ledger, read by the scheduler, published on completion.

``prefetch`` (a hint: predicted experts, possibly a lazy ``mx.array``), ``ensure`` (the demand
path) and ``drain`` (wait for what was submitted, hear about failures) all end in :meth:`HostFills.settle`,
the one place a fill's row leaves FILLING. Queued steps lend rows to the stream instead: while
they are active a prediction is skipped and a demand first takes the rows back (``quiesce``).
"""

from __future__ import annotations

import copy
import errno as _errno
import functools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import anyio
import mlx.core as mx
import numpy as np

from .. import memory as _memory
from ..errors import AsyncsideError, CapacityError, FillError, StoreError
from ..ledger import Fill, Ledger, validate_ids
from ..policies import Policy
from ..pools import PoolSet
from ..readers import ENV_DIRECT
from ..scheduler import FillHandle
from ._plan import MemoryPlan, plan_layer, warm_experts
from ._queued import QueuedSide
from ._state import LayerState, Pending, PrefetchHandle, Shared, host_ids, native_available

Ids = mx.array | Sequence[int] | np.ndarray


def layer_policy(policy: str | Policy) -> str | Policy:
    """One layer's policy: a name makes its own; an instance (``Runtime(policy=LRFU(...))``, a
    policy of chosen parameters) is copied for each layer, since a policy belongs to one ledger
    (the same instance for every layer was refused at entry as "already attached to another
    ledger"). The copy starts unattached, without the scores of any ledger it served."""
    if not isinstance(policy, Policy):
        return policy
    fresh = copy.deepcopy(policy, {id(policy._owner): None})  # never a copy of the ledger it serves
    fresh._owner = None
    fresh.reset()
    return fresh


def _direct_way_out(plan: MemoryPlan, exc: OSError) -> str:
    """Where the store's filesystem refuses O_DIRECT (EINVAL; an older tmpfs, some FUSE and network
    filesystems), why the reads were direct and how to read buffered instead: "read it buffered"
    alone named no way to, where the plan had chosen O_DIRECT from the budget."""
    if not plan.direct or exc.errno != _errno.EINVAL:
        return ""
    if plan.direct_reason == "asked for":
        return "; O_DIRECT was asked for: leave out direct=True (--direct) to read the store buffered"
    if plan.direct_reason == ENV_DIRECT:
        return f"; O_DIRECT was asked for by ${ENV_DIRECT}: set it to 0 to read the store buffered"
    return (f"; the plan chose O_DIRECT ({plan.direct_reason}): direct=False, or ${ENV_DIRECT}=0 on the "
            f"command line, reads the store buffered, through a page cache larger than the budget leaves it")


class HostFills:
    """Reads records into pool rows on the host and publishes them."""

    def __init__(self, shared: Shared, queued: QueuedSide) -> None:
        self._s = shared
        self._queued = queued
        #: bytes of the pinned and warm rows' records whose pages were dropped from the page cache
        #: once they were in the pools, with what readahead read past them (buffered reads; see
        #: :meth:`_cached_before`)
        self.dropped_start_bytes = 0

    def _cached_before(self, layers: Iterable[int]) -> dict[str, bytes]:
        """Which pages of the blobs of ``layers`` are in the page cache now, per blob, before the
        rows read at start are read (:meth:`_drop_start_pages` drops what those reads add). Empty
        under O_DIRECT reads, which leave no pages.

        Why drop them once the rows hold the bytes: a pinned row's record is never read again, and a
        warm row's only once the policy evicts it, as any first miss is; meanwhile a memory cgroup
        charges their pages (and what readahead read past them) beside the pools' copies, outside
        what the plan counts (the non-expert weights' pages are dropped after loading for the same
        reason). Why only the pages these reads brought in: a page cached before (another process
        serving the same store, an earlier run) may be read there again. The reader copies fully
        cached records through its own mapping of the blob, whose pages the advice would skip: those
        are let go first (:func:`asyncside.memory.unmap_ranges`)."""
        s = self._s
        if s.scheduler.direct:
            return {}
        out: dict[str, bytes] = {}
        for index in layers:
            path = str(s.layers[index].spec.path)
            if path not in out:
                pages = _memory.cached_pages(path)
                if pages is not None:  # cannot tell what was there: drop nothing of it
                    out[path] = pages
        return out

    def _drop_start_pages(self, before: Mapping[str, bytes]) -> None:
        """Evict the pages of each blob of ``before`` cached now and not then; counts the bytes."""
        for path, pages in before.items():
            now = _memory.cached_pages(path)
            if now is not None:
                ranges = _memory.pages_brought_in(pages, now)
                # the reader's own mapping first: the page cache keeps what a mapping holds
                _memory.unmap_ranges(path, ranges)
                self.dropped_start_bytes += _memory.drop_ranges(path, ranges)

    # ---------------------------------------------------------------- setup

    async def setup(self, plan: MemoryPlan, *, policy: str | Policy, side_rows: int | None, min_side_rows: int | None,
                    pinned: Mapping[int, Sequence[int]] | None) -> None:
        """Allocate every layer's pools, open its blob, and load its pinned and warm rows."""
        s = self._s
        assert not isinstance(plan.resident, str) or pinned is not None
        fraction = 0.0 if isinstance(plan.resident, str) else float(plan.resident)
        pinned_sets: dict[int, list[int]] = {}
        for index in plan.rows:
            spec = s.store.layer(index)
            if plan.split is not None:  # rows split between layers by a profile: all dynamic
                chosen, side = list[int](), plan.rows[index]
            else:
                chosen, side = plan_layer(s.store, index, fraction, side_rows, min_side_rows, pinned)
            ledger = Ledger(spec.n_experts, chosen, side, policy=layer_policy(policy))
            pools = await PoolSet.allocate(spec, ledger.rows)
            try:
                # Opened now, in a worker thread: never on the loop, never at a first fill.
                await s.scheduler.prepare(spec, pools)
            except OSError as exc:
                raise StoreError(spec.path, f"layer {index}: cannot open the blob for reading: "
                                 f"{exc.strerror or exc}{_direct_way_out(plan, exc)}", errno=exc.errno) from None
            s.layers[index] = LayerState(spec=spec, ledger=ledger, pools=pools)
            pinned_sets[index] = chosen
        # Pinned rows are read once, through the same reader as everything else.
        before = await anyio.to_thread.run_sync(self._cached_before, list(pinned_sets))
        handles: list[FillHandle] = []
        for index, chosen in pinned_sets.items():
            st = s.layers[index]
            fills = [Fill(fill_id=-1 - row, expert=e, row=row) for row, e in enumerate(chosen)]
            if fills:
                handles.extend(s.scheduler.submit(st.spec, st.pools, fills))
        errors: list[FillError] = []
        for h in handles:
            try:
                await h.wait()
            except FillError as err:
                errors.append(err)
        for index, chosen in pinned_sets.items():
            st = s.layers[index]
            if st.pools.device and chosen and not errors:
                # Device pools: the mirror holds the bytes; copy them over on MLX's stream.
                await s.computed(st.pools.upload(range(len(chosen))))
        s.reads.resident_bytes = sum(len(r) * s.layers[i].spec.stride for i, r in pinned_sets.items())
        if errors:
            raise ExceptionGroup("loading resident experts failed", errors)
        await self._warm_up(pinned_sets)
        await anyio.to_thread.run_sync(self._drop_start_pages, before)

    async def _warm_up(self, pinned_sets: Mapping[int, list[int]]) -> None:
        """Fill the dynamic rows with the store's hottest experts (when it ranks them) before the
        first step, as ordinary LIVE rows the policy may evict; the hottest count as most recent."""
        s = self._s
        waits: list[Pending] = []
        warm_sets: dict[int, list[int]] = {}
        for index, chosen in pinned_sets.items():
            st = s.layers[index]
            warm = warm_experts(s.store, index, st.ledger.side_rows, exclude=chosen)
            if warm:
                warm_sets[index] = warm
                waits.extend(self._submit(st, self.reserve(st, np.asarray(warm, dtype=np.int64), demand=False)))
        for p in waits:
            await p.wait()
        for index, warm in warm_sets.items():
            for e in reversed(warm):
                s.layers[index].ledger.record_use([e])
        # Warm-up reads are setup, not misses of the generation.
        s.reads.fills = 0
        s.reads.warm_bytes, s.reads.bytes_read = s.reads.bytes_read, 0

    # ---------------------------------------------------------------- reads

    def _submit(self, st: LayerState, fills: Sequence[Fill], on_done: Callable[[Pending], None] | None = None,
                parent_op: int | None = None) -> list[Pending]:
        """Hand reserved fills to the scheduler; returns one Pending per fill.

        Each fill holds an op (``parent_op`` when a prefetch started it) until it settles.
        ``on_done`` runs after the ledger saw the outcome and before drain waiters are woken,
        so whoever is woken sees a consistent picture.
        """
        if not fills:
            return []
        s = self._s
        pendings = [Pending(fill) for fill in fills]
        for p in pendings:
            st.inflight[p.fill.expert] = p
        ops = [s.hold(st, parent_op) for _ in fills]
        started = time.perf_counter()
        s.reads.fills += len(fills)
        try:
            handles = s.scheduler.submit(st.spec, st.pools, fills)
        except Exception as exc:
            # No read started: fail every fill now (rows back to FREE, awaiters told), so no row
            # stays FILLING and no drain waits for a read that never was.
            code = getattr(exc, "errno", None)
            for p, op in zip(pendings, ops):
                err = FillError(st.spec.index, p.fill.expert, p.fill.row,
                                f"the read could not be started: {exc}", errno=code)
                self.settle(st, p, op, err, started, on_done)
            return pendings
        for p, op, handle in zip(pendings, ops, handles):
            handle.add_done_callback(functools.partial(self._on_read_done, st, p, op, started=started,
                                                       on_done=on_done))
        return pendings

    def _on_read_done(self, st: LayerState, p: Pending, op: int, handle: FillHandle, *, started: float,
                      on_done: Callable[[Pending], None] | None) -> None:
        # Runs on the loop thread. Host pools: the bytes are in the row now. Device pools: they
        # are in the host mirror; the row is published once the upload on the stream completed.
        err = handle.result_error()
        if err is None and st.pools.device:
            if not self._s.closed:
                # Batch: every read that completes before the flush task runs shares one upload.
                st.uploads.append((p, op, started, on_done))
                if len(st.uploads) == 1:
                    self._s.spawn(self._flush_uploads, st)
                return
            err = FillError(st.spec.index, p.fill.expert, p.fill.row, "the runtime closed before the upload")
        self.settle(st, p, op, err, started, on_done)

    async def _flush_uploads(self, st: LayerState) -> None:
        import anyio

        try:
            await anyio.lowlevel.checkpoint()  # let the rest of this wakeup's completions join
        except anyio.get_cancelled_exc_class():
            # The runtime is closing (it cancels its tasks): these reads landed, but no upload will
            # run. Settled here, or their rows stayed FILLING and their awaiters waited forever.
            batch, st.uploads = st.uploads, []
            for p, op, started, on_done in batch:
                closed = FillError(st.spec.index, p.fill.expert, p.fill.row, "the runtime closed before the upload")
                self.settle(st, p, op, closed, started, on_done)
            raise
        batch, st.uploads = st.uploads, []
        err_text: str | None = None
        try:
            with anyio.CancelScope(shield=True):
                # Shielded: once the copy is on the stream the rows must not be reused before it ran.
                await self._s.computed(st.pools.upload([p.fill.row for p, *_ in batch]))
        except Exception as exc:  # the upload failed on the device: these fills failed
            err_text = f"upload to the device pool failed: {exc}"
        for p, op, started, on_done in batch:
            err = None if err_text is None else FillError(st.spec.index, p.fill.expert, p.fill.row, err_text)
            self.settle(st, p, op, err, started, on_done)

    def settle(self, st: LayerState, p: Pending, op: int, err: FillError | None, started: float,
               on_done: Callable[[Pending], None] | None) -> None:
        """The one place a fill's row leaves FILLING: publish on success, fail (row freed) otherwise."""
        s = self._s
        fill = p.fill
        if st.inflight.get(fill.expert) is p:
            del st.inflight[fill.expert]
        if err is None:
            st.ledger.publish(fill)
            s.reads.bytes_read += st.spec.stride
        else:
            st.ledger.fail(fill)
            st.errors.append(err)
            s.reads.failed_fills += 1
        s.reads.read_time_s += time.perf_counter() - started
        st.changed()
        p.settle(err)
        if on_done is not None:
            on_done(p)
        s.finish(st, op)

    def reserve(self, st: LayerState, ids: np.ndarray, *, demand: bool, protect: Iterable[int] = ()) -> list[Fill]:
        before = st.ledger.stats.get("evictions", 0)
        fills = st.ledger.reserve(ids, demand=demand, protect=protect)
        evicted = st.ledger.stats.get("evictions", 0) - before
        self._s.cache.evictions += evicted
        if fills or evicted:
            # An eviction changes lookup(): the evicted expert no longer has a row. (The one-shot
            # policy drops experts even when a reserve starts no fill.)
            st.changed()
        return fills

    @staticmethod
    def _demanded(st: LayerState, upto: int | None = None) -> set[int]:
        """Experts wanted by the ensure() calls in progress on ``st`` (the first ``upto`` of them)."""
        out: set[int] = set()
        for wanted in st.demands[:upto]:
            out.update(wanted.tolist())
        return out

    # ---------------------------------------------------------------- prefetch

    def prefetch(self, layer: int, ids: Ids) -> PrefetchHandle:
        """Start reading the predicted experts ``ids`` of ``layer``; returns at once (see Runtime)."""
        import anyio

        s = self._s
        # Running first: before entering, no layer is set up, and "layer 0 is not streamed by this
        # runtime (layers: [])" sent the caller looking for a wrong layer.
        s.check_running()
        st = s.layer(layer)
        handle = PrefetchHandle(layer=layer, _done=anyio.Event())
        if self._queued.active:
            # Queued steps own the rows' placement until quiesce(): a prediction is only a hint.
            s.reads.skipped_prefetches += 1
            handle._done.set()
            return handle
        op = s.hold(st)
        if isinstance(ids, mx.array) and not native_available(ids, failed=False):
            s.spawn(self._prefetch_lazy, st, ids, handle, op)
            return handle
        try:
            self._prefetch_now(st, host_ids(ids), handle, op)
        except Exception as exc:
            if not isinstance(ids, mx.array):
                raise  # bad ids given directly: the caller's error
            # Computed already (a prediction that crossed a pipeline boundary): as in the lazy
            # path, its errors fail the handle.
            self._fail_prediction(handle, exc)
        finally:
            s.finish(st, op)
        return handle

    async def _prefetch_lazy(self, st: LayerState, ids: mx.array, handle: PrefetchHandle, op: int) -> None:
        try:
            await self._s.computed(ids)
            self._prefetch_now(st, host_ids(ids), handle, op)
        except Exception as exc:
            self._fail_prediction(handle, exc)
        finally:
            if not handle.fills and not handle._done.is_set():
                # Cancelled (the runtime is closing) before any read started: whoever awaits the
                # handle hears of it instead of waiting forever.
                handle.errors.append(AsyncsideError(
                    f"layer {st.spec.index}: the runtime closed before this prediction was computed"))
                handle._done.set()
            self._s.finish(st, op)

    def _fail_prediction(self, handle: PrefetchHandle, exc: Exception) -> None:
        """A prediction is a hint: bad ids or a failed computation fail its handle (and are
        counted), never the runtime's task group."""
        handle.errors.append(exc)
        handle._done.set()
        self._s.reads.failed_predictions += 1

    def _prefetch_now(self, st: LayerState, ids: np.ndarray, handle: PrefetchHandle, op: int) -> None:
        if ids.size == 0:  # nothing predicted: nothing to do
            handle._done.set()
            return
        fills = self.reserve(st, ids, demand=False, protect=self._demanded(st))
        handle.fills = fills
        self._s.reads.prefetched += len(fills)
        if not fills:
            handle._done.set()
            return
        remaining = [len(fills)]

        def one_done(p: Pending) -> None:
            if p.error is not None:
                handle.errors.append(p.error)
            remaining[0] -= 1
            if remaining[0] == 0:
                handle._done.set()

        self._submit(st, fills, one_done, parent_op=op)

    # ---------------------------------------------------------------- demand

    async def drain(self, layer: int | None = None) -> None:
        """Wait for every fill (and pending prefetch) submitted so far for ``layer`` (or all);
        an ExceptionGroup of the FillErrors of fills that failed since the last drain."""
        s = self._s
        layers = [s.layer(layer)] if layer is not None else list(s.layers.values())
        horizon = s.horizon
        while any(op < horizon for st in layers for op in st.outstanding):
            await s.wait_change()
        await self._queued.settle_idle(layers)
        errors: list[FillError] = []
        for st in layers:
            errors.extend(st.errors)
            st.errors.clear()
        if errors:
            where = f"layer {layer}" if layer is not None else "all layers"
            raise ExceptionGroup(f"{len(errors)} fill(s) failed ({where})", errors)

    async def ensure(self, layer: int, ids: Ids) -> None:
        """Return once every expert in ``ids`` has its bytes in a row of ``layer``'s pools (see Runtime)."""
        s = self._s
        s.check_running()  # before the layer's lookup, as prefetch does
        st = s.layer(layer)
        if isinstance(ids, mx.array):
            await s.computed(ids)
            s.check_running()
        if self._queued.active:
            # Reads outside the stream must not race queued steps that read rows in it. After
            # the last await before the ledger is read: a queued step begun meanwhile would hold
            # the rows again.
            await self._queued.quiesce()
        wanted = np.unique(np.asarray(validate_ids(host_ids(ids), st.spec.n_experts, layer=layer), dtype=np.int64))
        if wanted.size == 0:  # nothing wanted: nothing to wait for
            return
        s.reads.ensure_calls += 1
        present = st.ledger.lookup()[wanted] >= 0
        n_hits = int(present.sum())
        missing = wanted[~present]
        if missing.size == 0:
            # Tell the policy these experts were used (LFU counts, LRU recency), as a miss does.
            self.reserve(st, wanted, demand=True, protect=self._demanded(st))
            s.cache.hits += n_hits
            return
        t0 = time.perf_counter()
        counted = False
        st.demands.append(wanted)
        try:
            while True:
                s.check_running()
                if self._queued.active:
                    # A queued step began while this task awaited (between two of its fills):
                    # take the rows back first; the ledger is only changed with none lent.
                    await self._queued.quiesce()
                    continue
                # Re-check every wanted expert, not only the ones missing before: while this
                # task awaited, a prefetch may have evicted one that was present.
                missing = wanted[st.ledger.lookup()[wanted] < 0]
                if missing.size == 0:
                    return
                # The whole wanted set goes in: the ledger never evicts a member of the batch,
                # nor anything an older ensure on this layer still waits for.
                mine = next(i for i, w in enumerate(st.demands) if w is wanted)
                fills = self.reserve(st, wanted, demand=True, protect=self._demanded(st, mine))
                if not counted:
                    # Counted once the batch fits: a CapacityError is retried by the forward in
                    # smaller groups, whose ensures count their own hits and misses.
                    counted = True
                    s.cache.hits += n_hits
                    s.cache.misses += int(missing.size)
                    s.cache.late += sum(1 for e in missing.tolist() if e in st.inflight)
                ours = self._submit(st, fills)
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
                    await s.wait_change()
                else:
                    raise CapacityError(
                        f"layer {layer}: experts {missing.tolist()} could not be placed "
                        f"(side region of {st.ledger.side_rows} rows)"
                    )
        finally:
            st.demands[:] = [w for w in st.demands if w is not wanted]
            s.notify()  # what this ensure protected may now be evicted by a younger one
            s.reads.stall_time_s += time.perf_counter() - t0
