"""The queued-step side: one owner for lending rows to the stream, the fault logs, the host tier
and its staging arrays.

A queued step is built once per token and scheduled whole: its switch layers fault absent
experts in on the stream (``native/expert_faults*``) into rows the ledger lent to each layer's
native fault table. The ledger learns what the stream did from the tables' fault logs
(:meth:`QueuedSide.reconcile`), applied on the loop thread: every few steps, before anything reads
the ledgers, and at once when a fault failed. :meth:`QueuedSide.quiesce` waits for the steps and
takes every lent row back, so the host fill path owns the rows again.
"""

from __future__ import annotations

import errno
import os
from collections import deque
from typing import Any

import anyio
import mlx.core as mx
import numpy as np

import asyncside._native as _native  # absolute: a relative import resolves through the lazy front door in mypy

from ..errors import AsyncsideError, FillError
from ..native_env import ENV_DIRECT_DECODE_TOKENS, env_direct_decode_tokens
from ._leases import Leases
from ._plan import MemoryPlan, tier_bytes
from ._state import LayerState, Shared, native_available

#: queued steps apply the stream's fault logs to the ledgers at least this often (steps)
RECONCILE_EVERY = 32
#: O_DIRECT's block: a layer whose records are whole blocks is read past the page cache directly
DIRECT_ALIGN = 4096
#: a layer streams its misses (when the plan reads past the page cache) only if its records are at
#: least this large: computing a switch slot by slot costs more graph nodes and waits per layer,
#: which a smaller record's read does not repay (BENCHMARKS.md, "Streamed switches")
STREAM_MIN_RECORD_BYTES = 1 << 20
#: under a plan that reads past the page cache, a decode step (one token per sequence) of at most
#: this many tokens may still be queued in slices (a prefill chunk's transient buffers grow with its
#: tokens; a decode batch's were expected to stay a few rows' worth). 0 by default, off: on the CPU
#: such batches, cut in sorted parts, ran slower than one-row steps, hit less and peaked past the
#: budget (BENCHMARKS.md, "Serving under a memory budget"). ``ASYNCSIDE_DIRECT_DECODE_TOKENS`` sets it.
DIRECT_DECODE_TOKENS = 0


def direct_decode_tokens() -> int:
    """:data:`DIRECT_DECODE_TOKENS`, or ``ASYNCSIDE_DIRECT_DECODE_TOKENS`` where set (a count >= 0)."""
    value = env_direct_decode_tokens(os.environ.get(ENV_DIRECT_DECODE_TOKENS, ""))
    return DIRECT_DECODE_TOKENS if value is None else value


class QueuedSide:
    """Lending, fault logs, staging and the host tier of one runtime's queued steps."""

    def __init__(self, shared: Shared, leases: Leases) -> None:
        self._s = shared
        self._leases = leases
        #: the output of the latest staged switch: the next staged resolve depends on it through
        #: data, since every staged switch of this runtime's layers of one shape shares the arrays
        self._staged_tail: mx.array | None = None
        #: the latest queued steps' outputs not known to be computed (see begin_step / quiesce)
        self._outs: list[mx.array] = []
        # Steps begun (begin_step) and not yet built (end_step / abandon_step): a long step's
        # graph is built with checkpoints between layers, and quiesce() must not take the rows
        # back from under a step whose fault nodes are being built.
        self._building = 0
        self._build_done: anyio.Event | None = None
        #: nanoseconds of the latest faults (bounded), for latency percentiles
        self._fault_ns: list[int] = []
        #: failed faults learned from the logs, each keyed to the step that read it where known
        #: (FillError.step): raised where that step is awaited (after_step), or, where its step is
        #: unknown or no longer awaited, by the next begin_step / after_step; quiesce raises them all
        self._errors: list[FillError] = []
        self._step_seq = 0  # the latest step's id (begin returns it)
        self._building_step: int | None = None  # the step being built, when one build is under way
        #: steps built (end) whose after_step has not come yet: their errors wait for it
        self._awaiting: set[int] = set()
        #: every dynamic row of every layer is lent (begin_step has nothing to do)
        self._lent_all = False
        self._ready_pairs = 0  # ready() answered yes for this many pairs since _lent_all
        self._since_reconcile = 0
        # Counting a step's uses once per layer (reconcile): a layer's resolves of one step (a
        # switch split in parts) are consecutive in its fault log, and the log does not say where
        # a step ends, so the steps built say it: per layer, each built step's id and the resolves
        # it queued, in build (= stream) order, and the step the last drain left partway through
        # (resolves still to come, the experts it counted so far, its id). The same bookkeeping
        # keys a failed fault to its step (the log places each event among the resolves). Off
        # (each resolve counted as a step of its own, failures of no known step) from when builds
        # overlap or a fault node failed as a whole (either can leave the log and the counts out of
        # step) until everything queued was learned (quiesce, or no step in flight).
        self._resolves: dict[int, int] = {}  # the step being built: layer -> resolves queued
        self._step_resolves: dict[int, deque[tuple[int | None, int]]] = {}
        self._partial: dict[int, tuple[int, dict[int, None], int | None]] = {}
        self._last_step: dict[int, int | None] = {}  # layer -> the step of its last resolve drained
        self._grouping = True
        self._errors_seen = 0
        #: whether a step whose experts exceed the lent rows may be queued in slices (see capacity)
        self._slices = True
        #: whether small switches stream their misses (see streams_misses): the plan's choice
        self._stream_misses = False

    # ---------------------------------------------------------------- setup

    async def setup(self, plan: MemoryPlan) -> None:
        """One native fault table per layer (queued steps fault experts in there): for host pools,
        and for device pools where the CUDA fault path is compiled in; then the staging arrays of
        the host tier's layers.

        The blobs are opened in a worker thread: an open() can block (a FIFO, a stale mount).
        """
        s = self._s
        # Under a budget the store does not fit, the page cache is gone and so is the room for a
        # sliced step's transient buffers, which grow with its tokens (a prefill chunk; see
        # BENCHMARKS.md, "Memory we use"): such steps go layer by layer, whose buffers are one layer's.
        self._slices = not plan.direct
        # Past the page cache most routed experts miss: a small switch then starts its misses'
        # reads at once and computes its slots as they land (streamed resolves, see
        # native/expert_faults.h), so a layer's reads overlap its expert compute.
        self._stream_misses = plan.direct
        device_ok = _native.device_faults_available()
        host = [(i, st) for i, st in s.layers.items() if not st.pools.device or device_ok]
        if not host:
            return
        o_direct = getattr(os, "O_DIRECT", 0)
        direct: set[int] = set()  # layers whose descriptor bypasses the page cache

        def open_one(index: int, st: LayerState) -> int:
            flags = os.O_RDONLY | os.O_CLOEXEC
            if plan.direct and o_direct and st.spec.stride % DIRECT_ALIGN == 0:
                try:
                    fd = os.open(st.spec.path, flags | o_direct)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:  # EINVAL: a file system without O_DIRECT
                        raise
                else:
                    direct.add(index)
                    return fd
            return os.open(st.spec.path, flags)

        def open_all() -> list[int]:
            fds: list[int] = []
            try:
                for index, st in host:
                    fds.append(open_one(index, st))
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
            if index in plan.host_tier_layers and st.pools.device:
                tiers[index] = await anyio.to_thread.run_sync(
                    _native.HostMirror, st.spec.n_experts, [seg.nbytes for seg in st.spec.segments])
                s.queued.host_tier_bytes += tier_bytes(st.spec)
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
                    st.faults = _native.FaultTable.for_device(index, spec.n_experts, pools, st.pools.mirror,
                                                              offsets, nbytes, fds[k], str(spec.path), spec.stride,
                                                              tier=tiers.get(index))
                else:
                    st.faults = _native.FaultTable(index, spec.n_experts, pools, offsets, nbytes, fds[k],
                                                   str(spec.path), spec.stride)
                st.fault_fd = fds[k]
                self._configure(st, plan, o_direct=index in direct)
            except BaseException:
                for fd in fds[k + 1:]:  # fds[k] is the table's (closed by the constructor on failure)
                    os.close(fd)
                raise
        self._setup_staging(plan)

    def release_blobs(self) -> None:
        """Let go of the layer blobs the fault tables read (the runtime exited): each table's
        descriptor is pointed at /dev/null in place. A runtime still referenced after its exit
        would otherwise hold every blob open until it is collected (a store deleted or replaced
        meanwhile keeps its disk space). Closed instead, the number could be reused by another
        open while the table, which closes it when it is freed, still holds it."""
        fds = [st.fault_fd for st in self._s.layers.values() if st.faults is not None and st.fault_fd >= 0]
        if not fds:
            return
        null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        try:
            for fd in fds:
                os.dup2(null, fd, inheritable=False)
        finally:
            os.close(null)
        for st in self._s.layers.values():
            st.fault_fd = -1

    def _configure(self, st: LayerState, plan: MemoryPlan, *, o_direct: bool) -> None:
        """How a layer's new fault table reads: past the page cache or not, the read window, checksums."""
        if o_direct:
            # The plan reads past the page cache: O_DIRECT, through an aligned buffer.
            st.faults.set_direct(True)
            if plan.read_window is not None:
                st.faults.set_read_window(plan.read_window.table_window)
        elif plan.direct:
            # O_DIRECT could not be had here: a faulted record's pages are dropped once
            # read instead, so cached records never evict each other (see MemoryPlan).
            st.faults.set_drop_cache(True)
        spec = st.spec
        if self._s.scheduler.verify and spec.checksum is not None and spec.checksums is not None:
            # A faulted record is used only after its bytes verified, as a read one is.
            st.faults.set_checksums(spec.checksum, list(spec.checksums))

    def _setup_staging(self, plan: MemoryPlan) -> None:
        """Give each device fault table with a host tier its staging arrays: one whole layer per
        segment, shared by the layers of one shape, so that a switch whose experts exceed the lent
        rows (a prefill chunk, a large batch) copies its experts there instead of cycling them
        through the pool rows (see :meth:`staged_rows`)."""
        shared: dict[tuple[Any, ...], list[mx.array]] = {}
        for index, st in self._s.layers.items():
            if st.faults is None or not st.pools.device or index not in plan.host_tier_layers:
                continue
            spec = st.spec
            key = (spec.n_experts, tuple((seg.key, tuple(seg.shape), seg.dtype) for seg in spec.segments))
            arrays = shared.get(key)
            if arrays is None:
                arrays = [mx.zeros((spec.n_experts, *st.pools.arrays[seg.key].shape[1:]),
                                   dtype=st.pools.arrays[seg.key].dtype) for seg in spec.segments]
                mx.eval(*arrays)
                shared[key] = arrays
                self._s.queued.staging_bytes += sum(a.nbytes for a in arrays)
            st.faults.set_staging(arrays)
            st.staging = {seg.key: a for seg, a in zip(spec.segments, arrays)}

    # ---------------------------------------------------------------- stepping

    @property
    def active(self) -> bool:
        """True while queued steps may be running or rows are lent."""
        return bool(self._outs) or self._building > 0 or any(st.ledger.lent_rows()
                                                              for st in self._s.layers.values())

    def ready(self, pairs: int) -> bool:
        """Whether a queued step routing up to ``pairs`` (token, expert) pairs per MoE layer can run:
        every layer has a fault table and enough rows to lend for that many distinct experts."""
        if self._lent_all and pairs <= self._ready_pairs:
            return True  # every dynamic row is lent already: nothing can have pinned one since
        layers = self._s.layers.values()
        if any(st.inflight for st in layers):
            # A host fill (an ensure's, a prefetch's) still to settle changes its layer's ledger
            # when it does, which must not happen while rows are lent to the stream: this step
            # goes per layer (whose ensure waits for the fill) instead.
            return False
        self._leases.release_computed()
        # A row being filled (a prefetch in flight) or pinned by a lease cannot be lent: the
        # stream would run out of rows for the step's misses.
        for st in layers:
            if st.faults is None or st.ledger.lendable_rows() < min(pairs, st.spec.n_experts):
                return False
        self._ready_pairs = max(self._ready_pairs, pairs) if self._lent_all else 0
        return True

    def capacity(self, decode_tokens: int | None = None) -> int:
        """How many distinct experts every layer can take for one resolve of a queued step: the
        fewest rows any layer could lend now (0 without fault tables). When the memory plan reads
        past the page cache it is 0 too (a step too large for the rows then goes layer by layer),
        except for a decode step of ``decode_tokens`` tokens (one per sequence; None: not a decode
        step) up to :func:`direct_decode_tokens`, whose transient buffers stay small, and for a
        one-token decode step: its experts exceed the rows only where a layer has fewer dynamic
        rows than the model's top-k (``side_rows`` below it), and layer by layer every such token
        went, slower and reading more than in parts of one token's pairs."""
        if not self._slices and (decode_tokens is None or decode_tokens > max(direct_decode_tokens(), 1)):
            return 0
        self._leases.release_computed()
        return min((st.ledger.lendable_rows() if st.faults is not None else 0 for st in self._s.layers.values()),
                   default=0)

    def begin(self) -> int:
        """Before queuing a step (never blocks): every layer's dynamic rows lent to its fault table
        (they stay lent across steps); the FillError of a fault that failed earlier raised, unless
        it waits for its own step's :meth:`after_step`. Once every row is lent this costs the host
        next to nothing: the fault logs are applied every :data:`RECONCILE_EVERY` steps (and
        before anything reads the ledgers), failures at once. Returns the step's id (what
        :meth:`after_step` takes, and a failed fault's ``FillError.step``)."""
        self._regroup_when_idle()
        self._lend()
        self._step_seq += 1
        if self._building:
            self._grouping = False  # two builds at once: their resolves' order in the logs is unknown
            self._building_step = None
        else:
            self._building_step = self._step_seq
        self._building += 1
        return self._step_seq

    def _lend(self) -> None:
        s = self._s
        s.check_running()
        if len(self._outs) > 4:
            self._outs = [o for o in self._outs if not native_available(o)]
        s.queued.queued_steps += 1
        if self._lent_all:
            self._learn()
            self._raise_errors()
            return
        self._outs = [o for o in self._outs if not native_available(o)]
        in_flight = len(self._outs)
        self.reconcile_all()
        self._raise_errors()
        for st in s.layers.values():
            faults = st.faults
            if faults is None:
                raise AsyncsideError(f"layer {st.spec.index}: queued steps need a fault table")
            if st.native_dirty:
                if st.ledger.lent_rows() or in_flight:
                    raise AsyncsideError(f"layer {st.spec.index}: the ledger changed while rows were lent")
                faults.sync(np.ascontiguousarray(st.ledger.lookup(), dtype=np.int32))
                st.native_dirty = False
            self._follow_order(st)
            # Every dynamic row is lent (lent rows stay lent after a fault): the stream, which sees
            # each use first, picks victims among all of them in the policy's native order.
            short = st.ledger.side_rows - len(st.ledger.lent_rows())
            if short > 0:
                rows = st.ledger.lend(short)
                if rows:
                    faults.lend(rows)
        self._lent_all = all(len(st.ledger.lent_rows()) == st.ledger.side_rows for st in s.layers.values())

    def expert_rows(self, layer: int, ids: mx.array) -> mx.array:
        """Lazy uint32 pool rows of the routed ``ids`` of ``layer``: the stream maps each expert to
        its row when it gets there, reading absent ones into lent rows."""
        st = self._s.layer(layer)
        if st.faults is None:
            raise AsyncsideError(f"layer {layer}: queued steps need host pools with a fault table")
        rows: mx.array = _native.expert_rows(ids, st.faults)
        self._queued_resolve(layer)
        return rows

    def streams_misses(self, layer: int) -> bool:
        """Whether a small switch of ``layer`` should stream its misses (:meth:`begin_rows` and
        :meth:`finish_rows`): the plan reads past the page cache (most routed experts miss), the
        layer's records are large enough to repay it (:data:`STREAM_MIN_RECORD_BYTES`), and its fault
        table is a host one (:meth:`can_stream`)."""
        return (self._stream_misses and self._s.layer(layer).spec.stride >= STREAM_MIN_RECORD_BYTES
                and self.can_stream(layer))

    def can_stream(self, layer: int) -> bool:
        """Whether ``layer`` can take streamed resolves: a host fault table (CPU stream)."""
        st = self._s.layer(layer)
        return st.faults is not None and not st.pools.device

    def begin_rows(self, layer: int, ids: mx.array) -> mx.array:
        """Lazy uint32 pool rows of the routed ``ids`` of ``layer``, the streamed form of
        :meth:`expert_rows`: when the stream gets there every expert gets its row and the absent
        ones' reads start in the background. A gather may read a row only through
        :meth:`finish_rows`."""
        st = self._s.layer(layer)
        if st.faults is None or st.pools.device:
            raise AsyncsideError(f"layer {layer}: streamed resolves need host pools with a fault table")
        rows: mx.array = _native.begin_rows(ids, st.faults)
        self._queued_resolve(layer)
        return rows

    def prefetch_rows(self, layer: int, ids: mx.array, after: mx.array) -> mx.array:
        """``after`` (integer rows of another layer's switch), passed on by the stream once it
        started reading the predicted experts ``ids`` of ``layer`` that are absent into lent rows
        (a hint: nothing is routed, nothing fails the step; ``layer``'s next resolve settles them
        first, so the ones predicted right are hits there)."""
        st = self._s.layer(layer)
        if st.faults is None or st.pools.device:
            raise AsyncsideError(f"layer {layer}: prefetches on the stream need host pools with a fault table")
        out: mx.array = _native.prefetch_rows(after, ids, st.faults)
        return out

    def finish_rows(self, layer: int, ids: mx.array, rows: mx.array) -> mx.array:
        """``rows`` (part of a :meth:`begin_rows` output, for the experts ``ids``), passed on by
        the stream once those experts' reads landed and verified."""
        st = self._s.layer(layer)
        if st.faults is None:
            raise AsyncsideError(f"layer {layer}: streamed resolves need host pools with a fault table")
        out: mx.array = _native.finish_rows(ids, rows, st.faults)
        return out

    def staging(self, layer: int) -> dict[str, mx.array] | None:
        """The staging arrays of ``layer`` (one per segment key, a row per expert), or None."""
        return self._s.layer(layer).staging

    def staged_rows(self, layer: int, ids: mx.array) -> mx.array:
        """Lazy uint32 rows of the routed ``ids`` in the :meth:`staging` arrays (the ids themselves):
        when the stream gets there, every routed expert is copied into the staging arrays, from its
        pool row, or from the host tier (read and verified into it first when absent). No pool row
        changes, so a prefill chunk's experts neither evict a batch's working set nor need slices
        of lent rows. :meth:`staged_done` takes the switch's output: the next staged resolve waits
        for it, through data."""
        st = self._s.layer(layer)
        if st.faults is None or st.staging is None:
            raise AsyncsideError(f"layer {layer}: no staging arrays (they need device pools and a host tier)")
        tail = self._staged_tail
        if tail is not None:
            # A data dependency (MLX CUDA orders its graph's nodes by the buffers they read and
            # write, and the staging arrays are written behind its back): `ids` whatever `first`.
            first = tail.reshape(-1)[:1]
            ids = mx.where(first == first, ids, ids)
        rows: mx.array = _native.expert_rows(ids, st.faults, staged=True)
        self._queued_resolve(layer)
        return rows

    def _queued_resolve(self, layer: int) -> None:
        """A resolve node of ``layer`` was built into the step being built (one use entry in the log)."""
        if self._building:
            self._resolves[layer] = self._resolves.get(layer, 0) + 1

    def staged_done(self, out: mx.array) -> None:
        self._staged_tail = out

    def end(self, out: mx.array) -> None:
        """A step whose last output is ``out`` is built and about to be scheduled. The build ends
        here even when this raises: a build left begun would make every quiesce (the runtime's
        exit too, shielded) wait for it for ever."""
        try:
            self._outs.append(out)
            step = self._building_step
            if step is not None:
                self._awaiting.add(step)
            if self._grouping:
                for layer, n in self._resolves.items():
                    self._step_resolves.setdefault(layer, deque()).append((step, n))
        except BaseException:
            self._grouping = False  # this step's resolves went partly unrecorded: counting by steps is off
            raise
        finally:
            self._built()

    def abandon(self) -> None:
        """A step begun will not be scheduled (its build failed or was cancelled)."""
        self._built()

    def _built(self) -> None:
        self._resolves = {}
        self._building_step = None
        self._building -= 1
        if self._building == 0 and self._build_done is not None:
            self._build_done.set()
            self._build_done = None

    async def quiesce(self) -> None:
        """Wait for every queued step, learn what it did, and take every lent row back."""
        s = self._s
        while self._building or self._outs:
            if self._building:
                # A step is being built (a long one yields between its layers): its fault nodes
                # will need the lent rows. Wait until it is registered (end) or abandoned.
                if self._build_done is None:
                    self._build_done = anyio.Event()
                await self._build_done.wait()
                continue
            out = self._outs[-1]
            failed = None
            try:
                await s.computed(out)
            except Exception:
                # The step's own awaiter hears of its failure; the fault log says what happened. A
                # step MLX refused to schedule (its encoder raised: on a GPU, inside async_eval)
                # never becomes available: it is done with too, or this loop would never end.
                failed = out
            self._outs = [o for o in self._outs if o is not failed and not native_available(o)]
        # A step that failed before its streamed slots finished leaves their reads begun and
        # unpublished: wait for them (in a worker thread: it is I/O), so the logs say what they did.
        for st in s.layers.values():
            if st.faults is not None and st.faults.pending:
                await anyio.to_thread.run_sync(st.faults.settle)
        self.reconcile_all()
        # Everything queued is learned: what the steps built still expect never ran (a failed
        # schedule), and counting by steps starts afresh.
        self._regroup()
        self._awaiting.clear()
        for st in s.layers.values():
            if st.faults is not None:
                st.ledger.reclaim(st.faults.reclaim())
        self._lent_all = False
        self._ready_pairs = 0
        self._raise_errors()

    async def settle_idle(self, layers: list[LayerState]) -> None:
        """Publish the reads ``layers``' fault tables still hold unpublished (a last step's
        prefetches nobody routed, which the next step's begin would publish) and apply the fault
        logs, once no queued step is built or computing: a drained runtime's ledgers, native
        tables and counters then say the same."""
        if self._building or not self.idle():
            return  # a step in flight publishes them itself (begin, quiesce)
        for st in layers:
            if st.faults is not None and st.faults.pending:
                await anyio.to_thread.run_sync(st.faults.settle)  # I/O: in a worker thread
                self.reconcile(st)
        self._regroup_when_idle()

    def _regroup_when_idle(self) -> None:
        """Count by steps again where it went off and no step is built or computing now."""
        if not self._grouping and not self._building and self.idle():
            self._regroup()

    def _regroup(self) -> None:
        """Count by steps afresh (and key failures to steps again), once no step is built or
        computing and every log was learned; a no-op while a streamed read is unpublished (its
        event is the finished step's, learned later)."""
        if any(st.faults is not None and st.faults.pending for st in self._s.layers.values()):
            return
        self.reconcile_all()
        self._step_resolves.clear()
        self._partial.clear()
        self._last_step.clear()
        self._grouping = True

    def idle(self) -> bool:
        """No queued step is still computing (their outputs all available)."""
        return not [o for o in self._outs if not native_available(o)]

    def after_step(self, step: int | None = None) -> None:
        """The output of ``step`` (an id :meth:`begin` returned; None: a step not named) was
        awaited: raise the FillError of a fault that step read (an ExceptionGroup of them when
        several failed), with those of earlier steps and of no known step; a later step's wait for
        its own await. Unnamed, every failure learned so far is raised. Every
        :data:`RECONCILE_EVERY` steps the fault logs are applied."""
        self._learn()
        if step is None:
            self._awaiting.clear()
            self._raise_errors()
            return
        self._awaiting = {s for s in self._awaiting if s > step}
        self._regroup_when_idle()
        self._raise_errors()

    def _learn(self) -> None:
        """Apply the fault logs when a fault failed since the last time, or every
        :data:`RECONCILE_EVERY` calls."""
        self._since_reconcile += 1
        errors = _native.fault_errors_total()
        if errors != self._errors_seen or self._since_reconcile >= RECONCILE_EVERY:
            self._errors_seen = errors
            self.reconcile_all()

    def _raise_errors(self) -> None:
        """Raise the failures learned, except those of a step awaited later (built and not past
        its :meth:`after_step`) or being built, which wait for their own step's await."""
        keep = self._awaiting | ({self._building_step} if self._building_step is not None else set())
        errors = [e for e in self._errors if e.step is None or e.step not in keep]
        if not errors:
            return
        self._errors = [e for e in self._errors if e.step is not None and e.step in keep]
        # The group's own line is all a traceback's last line shows: it names the first failure.
        raise errors[0] if len(errors) == 1 else ExceptionGroup(f"{len(errors)} faults failed; the first: {errors[0]}",
                                                                errors)

    # ---------------------------------------------------------------- fault logs

    def reconcile_all(self) -> None:
        self._since_reconcile = 0
        for st in self._s.layers.values():
            self.reconcile(st)
            if st.native_order:  # lent to already: the uses just learned may have switched the policy
                self._follow_order(st)

    @staticmethod
    def _follow_order(st: LayerState) -> None:
        """The layer's fault table ranks victims as its policy does now: LRFU's recency guard
        switches between last use and decayed counts as the requests go, and adaptive-lrfu also
        adopts another half-life."""
        policy = st.ledger.policy
        if st.faults is not None and (policy.native_order, policy.half_life) != (st.native_order, st.native_half_life):
            # Counts under every half-life the policy may adopt (adaptive-lrfu's candidates): one
            # adopted ranks by the counts its shadow was judged on, not by another's re-read.
            st.faults.set_order(policy.native_order, policy.half_life, list(getattr(policy, "half_lives", ())))
            st.native_order, st.native_half_life = policy.native_order, policy.half_life

    def reconcile(self, st: LayerState) -> None:
        """Apply a layer's fault log to its ledger; failed faults are kept for the next raise."""
        faults = st.faults
        if faults is None:
            return
        raw_events, raw_used, raw_sizes, raw_missed, raw_at = faults.drain(positions=True)
        cache, reads, queued = self._s.cache, self._s.reads, self._s.queued
        events = np.frombuffer(raw_events, dtype=np.int64).reshape(-1, 6)
        if (events[:, 4] == _NODE_FAILED).any():
            self._grouping = False  # the node logged no uses: the steps' resolves are off
        layer = st.spec.index
        before = self._last_step.get(layer)  # the step of the last resolve drained before this log
        # The step of each resolve of this log (None: not known), counting their uses on the way
        groups = self._count_uses(st, np.frombuffer(raw_used, dtype=np.int32),
                                  np.frombuffer(raw_sizes, dtype=np.int32),
                                  np.frombuffer(raw_missed, dtype=np.uint8)) if raw_sizes else []
        if groups:
            self._last_step[layer] = groups[-1]
        at = np.frombuffer(raw_at, dtype=np.int32).tolist()
        if len(at) != len(events) or not self._grouping:
            at = [-1] * len(events)  # no event placed (a node failure's log, or its own entry lost)
        if raw_events:
            for i, (row, victim, expert, ns, err, source) in enumerate(events.tolist()):
                if row >= 0:
                    st.ledger.settle_fault(row, victim, expert, err == 0)
                    st.version += 1
                if source == _PREFETCHED:
                    # A prediction read in the background: not a miss (nothing routed it yet), and
                    # a failed one only frees its row (the expert is read again if routed).
                    if err == 0:
                        queued.prefetch_reads += 1
                        reads.prefetched += 1
                        reads.fills += 1
                        reads.bytes_read += st.spec.stride
                        queued.background_read_s += ns * 1e-9
                        if victim >= 0:
                            cache.evictions += 1
                    else:
                        queued.prefetch_failures += 1
                    continue
                if row < 0 and err == 0:
                    # A staged resolve's copy from the host tier (read into it first when source
                    # is 0): a miss that took no row.
                    cache.misses += 1
                    queued.staged_copies += 1
                    if source == 0:
                        reads.bytes_read += st.spec.stride
                    continue
                if err == 0:
                    queued.faults += 1
                    cache.misses += 1
                    reads.fills += 1
                    if source == 1:  # from the host tier: a device copy, nothing read
                        queued.tier_faults += 1
                    else:
                        reads.bytes_read += st.spec.stride
                    if source == 2:  # a streamed resolve's read: the stream computed meanwhile
                        queued.streamed_faults += 1
                        queued.background_read_s += ns * 1e-9
                    else:
                        queued.fault_time_s += ns * 1e-9
                    if victim >= 0:
                        cache.evictions += 1
                    self._fault_ns.append(ns)
                else:
                    reads.failed_fills += 1
                    cause = faults.failure if err == _NODE_FAILED else _fault_cause(err, st.spec.n_experts)
                    if err > 0 or err == -1:  # the record's read or its bytes: name the file, as fills do
                        lo = st.spec.record_offset(expert)
                        cause = f"read of {st.spec.path} record {expert} (bytes [{lo}, {lo + st.spec.stride})): {cause}"
                    # Its resolve: the at[i]-th of this log (none: the last one drained before)
                    k = at[i] - 1
                    step = (before if k == -1 else groups[k] if 0 <= k < len(groups) else None) \
                        if at[i] >= 0 else None
                    self._errors.append(FillError(st.spec.index, expert, row, f"fault in a queued step: {cause}",
                                                  errno=err if err > 0 else None, step=step))
            if len(self._fault_ns) > 4096:
                del self._fault_ns[:-2048]

    def _count_uses(self, st: LayerState, used: np.ndarray, sizes: np.ndarray,
                    missed: np.ndarray) -> list[int | None]:
        """A fault log's uses into the ledger's policy and the hits: each distinct expert a step's
        layer routed counted once, as the per-layer path counts it, a hit when the step's first
        resolve of it found it in place, however many resolves the step split the layer's switch
        into; the policy hears of it once per step too. (The misses are the faults and staged
        copies, counted from the events: a token part's resolve may fault an expert an earlier
        part of the step used and a later one evicted, a read of its own.) Returns the step of each
        resolve of the log (None where not known)."""
        cache, layer = self._s.cache, st.spec.index
        steps = self._step_resolves.get(layer)
        partial = self._partial.pop(layer, None)
        if not self._grouping:
            steps, partial = None, None
            self._step_resolves.clear()
            self._partial.clear()
        n_groups = int(sizes.size)
        groups: list[int | None] = []
        if partial is None and (not steps or all(steps[i][1] == 1 for i in range(min(n_groups, len(steps))))):
            # Each resolve a step of its own (an unsplit step per layer): the log's entries as they are.
            for _ in range(min(n_groups, len(steps) if steps else 0)):
                groups.append(steps.popleft()[0])  # type: ignore[union-attr]
            groups += [None] * (n_groups - len(groups))
            cache.hits += int(used.size) - int(missed.sum())
            st.ledger.record_uses(used, sizes.tolist())
            return groups
        ids, miss = used.tolist(), missed.tolist()
        flat: list[int] = []
        reserves: list[int] = []
        hits = pos = 0
        left, seen, step = partial if partial is not None else (0, {}, None)
        for k, n in enumerate(sizes.tolist()):
            starts = left == 0
            if starts:
                step, left = steps.popleft() if steps else (None, 1)
                seen = {}
            groups.append(step)
            if starts or k == 0:
                reserves.append(0)  # a step's uses (or their rest, after an earlier drain): one reserve
            for e, m in zip(ids[pos:pos + n], miss[pos:pos + n]):
                if e not in seen:
                    seen[e] = None
                    flat.append(e)
                    reserves[-1] += 1
                    hits += 1 - m
            pos += n
            left -= 1
        if left > 0:
            self._partial[layer] = (left, seen, step)
        cache.hits += hits
        st.ledger.record_uses(np.asarray(flat, dtype=np.int32), reserves)
        return groups

    def prefetch_counts(self) -> tuple[int, int]:
        """Records queued steps' prefetches read (failed reads too: they cost the disk and brought
        nothing), and the routed experts found in a row a prefetch filled, over every layer."""
        reads = hits = 0
        for st in self._s.layers.values():
            if st.faults is not None:
                c = st.faults.counters()
                reads += int(c["prefetch_reads"]) + int(c["prefetch_errors"])
                hits += int(c["prefetch_hits"])
        return reads, hits

    def set_fault(self, path: str, lo: int, hi: int, err: int) -> None:
        """Tests (:class:`asyncside.testing.FaultyReader`): every queued read of a record of the blob
        at ``path`` touching bytes [lo, hi) fails with errno ``err`` (0: none, on every table);
        the reader's own hooks never see these reads (the fault tables read natively)."""
        for st in self._s.layers.values():
            if st.faults is not None:
                here = err != 0 and str(st.spec.path) == path
                st.faults.set_fault(lo if here else 0, hi if here else 0, err if here else 0)

    def faults_injected(self) -> int:
        """Reads of queued steps that :meth:`set_fault` failed, over every layer."""
        return sum(int(st.faults.counters()["faults_injected"]) for st in self._s.layers.values()
                   if st.faults is not None)

    def read_wait_s(self) -> float:
        """Seconds the stream waited for streamed resolves' background reads, over every layer."""
        return float(sum(st.faults.counters()["read_wait_ns"] for st in self._s.layers.values()
                         if st.faults is not None)) * 1e-9

    def fault_latency(self) -> dict[str, float]:
        """Median and p99 of the latest faults' time on the stream (seconds; 0 when none)."""
        self.reconcile_all()
        if not self._fault_ns:
            return {"p50_s": 0.0, "p99_s": 0.0, "count": 0}
        a = np.asarray(self._fault_ns, dtype=np.float64) * 1e-9
        return {"p50_s": float(np.percentile(a, 50)), "p99_s": float(np.percentile(a, 99)), "count": int(a.size)}


_NODE_FAILED = -4  # a fault node failed as a whole: its message is the table's `failure`
_PREFETCHED = 3  # FaultEvent::source of a prefetch's read (native/expert_faults.h)


def _fault_cause(err: int, n_experts: int) -> str:
    """What a fault log's error code means, for a FillError's message (the codes below zero are
    native/expert_faults.h's)."""
    if err == -3:
        return f"the router named an expert outside the layer's [0, {n_experts})"
    if err == -2:
        return "no lent row was left for it (the step needed more rows than were lent)"
    if err == -1:
        return "its bytes did not match the store's checksum"
    if err == errno.ENODATA:
        return "the blob ended before the record did"
    if err == errno.ECANCELED:
        return "not read: an earlier record of the same streamed read failed first"
    return f"the read failed: {os.strerror(err)} (errno {err})"
