"""The runtime: the pools, the ledgers, the read scheduler and the bridge of one expert store.

``Runtime`` is a thin owner over one part per concern, each in its own module:

* :mod:`._plan` — the memory plan: pool rows per layer (one sizing rule), the budget, the host
  tier, O_DIRECT when the store does not fit the page cache the budget leaves;
* :mod:`._fills` — the host fill path: ``prefetch``, ``ensure``, ``drain``;
* :mod:`._queued` — the queued-step side (``rt.queued``): lending rows to the stream, the fault
  logs, the host tier's staging;
* :mod:`._leases` and :mod:`._audit` — leases released by GPU completion, and the audit;
* :mod:`._stats` — one counter dataclass per part, composed by :meth:`Runtime.stats`.

A model forward talks to it through five calls: ``prefetch(layer, ids)`` (predicted experts,
returns at once), ``await ensure(layer, ids)`` (the demand path), ``lookup(layer)`` (the expert ->
row table for the gather), ``lease`` / ``release_after`` (rows pinned until the computation that
reads them completed) and ``await drain(layer)``. Queued steps use the calls of
:class:`~asyncside.models.queued.QueuedSource`, which the runtime hands to ``rt.queued``.

All ledger transitions happen on the event loop thread: the scheduler runs fill callbacks there,
and no part touches a ledger from anywhere else. That keeps the ledger a plain state machine.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import pathlib
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import mlx.core as mx
import numpy as np

# numpy imports numpy.ma lazily, on the first np.unique, which would then happen on the event
# loop during the first prefill (see BENCHMARKS.md, "Loop lag"). Paid here, at import.
import numpy.ma

import asyncside._native as _native  # absolute: a relative import resolves through the lazy front door in mypy

from ..argtypes import parse_resident
from ..errors import AsyncsideError
from ..ledger import AuditReport, Ledger, validate_ids
from ..memory import check_memory, parse_host_tier, parse_size, return_large_frees
from ..policies import DEFAULT_POLICY, Policy, make_policy
from ..read_window import MAX_READ_WINDOW, choose_read_window
from ..readers import ReaderOptions
from ..scheduler import HostedTaskGroup, Scheduler
from ..snapshot import RowSnapshot, make_snapshot
from ..store import ExpertStore
from ._audit import audit as _audit
from ._fills import HostFills, Ids
from ._leases import Leases
from ._plan import (
    MemoryPlan,
    PlanArgumentError,
    RowsProfile,
    choose_resident,
    plan_layer,
    plan_memory,
    reader_staging_bytes,
    side_rows_problem,
    warm_experts,
)
from ._queued import RECONCILE_EVERY, QueuedSide
from ._state import PrefetchHandle, Shared, host_ids, running_loop
from ._stats import CacheStats, QueuedStats, ReadStats, RuntimeStats, snapshot

if TYPE_CHECKING:
    from ..bridge import Completed


def drop_store_pages(path: pathlib.Path) -> list[pathlib.Path]:
    """Evict the regular files of the store directory ``path`` from the page cache
    (``POSIX_FADV_DONTNEED``; the pages of files mapped by the process stay). Returns the files
    advised; a platform or file system without the call advises none."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return []
    done: list[pathlib.Path] = []
    for f in sorted(path.iterdir()):
        try:
            if not f.is_file():
                continue
            fd = os.open(f, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            done.append(f)
        except OSError:
            pass  # the hint is not kept there: nothing to drop
        finally:
            os.close(fd)
    return done

__all__ = ["RECONCILE_EVERY", "CacheStats", "MemoryPlan", "PrefetchHandle", "QueuedSide", "QueuedStats",
           "ReadStats", "Runtime", "RuntimeStats", "check_arguments", "choose_resident", "drop_store_pages",
           "plan_layer", "warm_experts"]


def _layer_index(value: object, what: str) -> int:
    """``value`` as a layer index (an int, a NumPy integer); a PlanArgumentError naming ``what``
    otherwise: a bool is no layer index, though it compares equal to one."""
    if not isinstance(value, bool) and isinstance(value, numbers.Integral):
        return int(value)
    raise PlanArgumentError(f"{what}: expected layer indices (integers), got {value!r}")


def _plain_int(value: Any) -> Any:
    """``value`` as an int where it is an integer of another type (a NumPy integer), else as it is
    (None, a string, a float, a bool: each argument's own check says what it takes)."""
    if not isinstance(value, (bool, np.bool_)) and isinstance(value, numbers.Integral):
        return int(value)
    return value


def _pinned_ids(store: ExpertStore, layer: int, ids: Any) -> list[int]:
    """The expert ids ``pinned`` names for ``layer`` (a list, a tuple, an integer array; a bare id
    or a string :func:`check_arguments` refused); a PlanArgumentError naming the layer and the
    value otherwise (a float, a bool, an id outside the layer's experts)."""
    try:
        out = validate_ids(ids, store.layer(layer).n_experts, "pinned expert")
    except AsyncsideError as exc:
        raise PlanArgumentError(f"pinned[{layer}]: {exc}") from None
    # Refused once entered, by the ledger, as "resident expert 1 is listed twice": no layer, and a
    # name the caller never used.
    twice = next((e for i, e in enumerate(out) if e in out[:i]), None)
    if twice is not None:
        raise PlanArgumentError(f"pinned[{layer}]: expert {twice} is listed twice")
    return out


def _check_selection(resident: Any, pinned: Any, side_rows: Any, layers: Any, rows_profile: Any) -> list[int] | None:
    """The part of :func:`check_arguments` that says which layers and experts: ``layers`` as a list
    of ints (None: every one), ``pinned``'s form, and what ``rows_profile`` and ``resident='auto'``
    take beside them."""
    # A bool was taken as layer 1 (True == 1) and a float reached the native fault table's
    # constructor, whose TypeError named none of the user's arguments.
    indices = None if layers is None else [_layer_index(i, "layers") for i in layers]
    if pinned is not None and not isinstance(pinned, Mapping):
        raise PlanArgumentError(f"pinned: expected a mapping of layer to expert ids ({{layer: [experts]}}), "
                                f"got {type(pinned).__name__}")
    for i, ids in (pinned or {}).items():
        _layer_index(i, "pinned")
        if isinstance(ids, (str, bytes, numbers.Number, np.generic)) or ids is None:
            raise PlanArgumentError(f"pinned[{i}]: expected a list of expert ids, got {ids!r}")
    # Each was refused only once entered (after load() had converted and loaded the model): they
    # need no store.
    if resident == "auto" and pinned is not None:
        raise PlanArgumentError("resident='auto' sizes the pools itself: it takes no pinned experts")
    if rows_profile is not None:
        from ..routing import RoutingTrace

        if not isinstance(rows_profile, (RoutingTrace, str, os.PathLike)):
            raise TypeError(f"rows_profile: expected a RoutingTrace or the path of one (.npz), got "
                            f"{type(rows_profile).__name__}")
        if pinned is not None or side_rows is not None:
            raise PlanArgumentError("rows_profile splits the dynamic rows between layers: it takes no pinned "
                                    "experts and no side_rows")
    return indices


def check_arguments(*, resident: Any = 0.25, pinned: Any = None, side_rows: Any = None, min_side_rows: Any = None,
                    policy: Any = DEFAULT_POLICY, direct: Any = None, memory: Any = None, layers: Any = None,
                    completed: Any = None, verify: Any = True, host_tier: Any = "auto",
                    read_window: Any = None, rows_profile: Any = None) -> dict[str, Any]:
    """The :class:`Runtime` arguments that need no store, checked as the Runtime checks them (an
    exception naming the argument for a bad one), as it takes them: NumPy integers as ints, sizes
    in bytes, ``layers`` a list. ``load()`` calls it before it converts or loads a model: the
    Runtime refused them only after both."""
    if direct is not None and not isinstance(direct, bool):
        raise TypeError(f"direct: expected None (the plan chooses), True or False, got {direct!r}")
    if not isinstance(verify, bool):
        raise TypeError(f"verify: expected True or False, got {verify!r}")
    if completed is not None and not callable(completed):
        raise TypeError(f"completed: expected None or an async function of an array, got {completed!r}")
    # A count computed with NumPy (np.int64(4)) was refused as "expected a number of rows >= 0,
    # got np.int64(4)", which it is; memory= took one already.
    side_rows, min_side_rows, read_window = (_plain_int(v) for v in (side_rows, min_side_rows, read_window))
    host_tier = _plain_int(host_tier)
    if memory is not None:
        # As --memory and load() refuse it: memory=1.5 was one byte, refused as a budget of 0.0 MiB.
        check_memory(parse_size(memory, what="memory"), memory)
    if layers is not None and (isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable)):
        raise TypeError(f"layers: expected the indices of the layers to stream (or None: every one), "
                        f"got {layers!r}")
    if isinstance(host_tier, str):  # a size as docs/api.md's "Sizes" says ("1G" was refused), or "auto"
        host_tier = parse_host_tier(host_tier)
    elif isinstance(host_tier, bool) or not isinstance(host_tier, int) or host_tier < 0:
        raise ValueError(f"host_tier: expected 'auto' or a number of bytes >= 0, got {host_tier!r}")
    if read_window is not None and (isinstance(read_window, bool) or not isinstance(read_window, int)
                                    or not 0 <= read_window <= MAX_READ_WINDOW):
        raise ValueError(f"read_window: expected None (the process's, else measured on the store's disk) or "
                         f"0 to {MAX_READ_WINDOW} pieces in flight, got {read_window!r}")
    if isinstance(resident, Mapping):
        raise TypeError("resident: expected a fraction of each layer's experts or 'auto' (the pools' "
                        "size); name pinned experts with pinned={layer: [experts]}")
    if isinstance(resident, str):
        # As the command line's --resident reads it ("25%", " Auto"): the same parser.
        try:
            resident = parse_resident(resident)
        except ValueError as e:
            raise PlanArgumentError(f"resident: {e}") from None
    if resident != "auto":
        # A bool is no fraction, None failed inside float() when entered; a negative zero loses its sign.
        if isinstance(resident, bool) or not isinstance(resident, numbers.Real) or not 0.0 <= float(resident) <= 1.0:
            raise PlanArgumentError(f"resident: expected a fraction in [0, 1] or 'auto', got {resident!r}")
        resident = float(resident) + 0.0
    make_policy(policy)  # an unknown name is refused here, not once entered
    if side_rows is not None and (isinstance(side_rows, bool) or not isinstance(side_rows, int) or side_rows < 0):
        raise PlanArgumentError(f"side_rows: expected a number of rows >= 0, got {side_rows!r}")
    # A negative or fractional least was taken without a word (the rows a layer gets are whole).
    if min_side_rows is not None and (isinstance(min_side_rows, bool) or not isinstance(min_side_rows, int)
                                      or min_side_rows < 0):
        raise PlanArgumentError(f"min_side_rows: expected a number of rows >= 0 (None: the model's top-k), "
                                f"got {min_side_rows!r}")
    layers = _check_selection(resident, pinned, side_rows, layers, rows_profile)
    return {"resident": resident, "side_rows": side_rows, "min_side_rows": min_side_rows, "host_tier": host_tier,
            "read_window": read_window, "layers": layers}


class Runtime:
    """Stream expert rows of ``store`` into MLX pools; use as ``async with Runtime(store) as rt``.

    ``resident`` is the pools' size: the fraction of each layer's experts they hold, or ``"auto"``
    (sized to the memory budget); a string is read as ``--resident`` reads it (``"25%"``).
    Every row is dynamic, managed online by ``policy`` (warmed up from the store's routing ranking
    when it has one; a policy's name, or an instance each layer gets a copy of), unless
    ``side_rows`` leaves only that many dynamic and pins the hottest others, or ``pinned`` names
    the pinned experts per layer.
    ``min_side_rows`` is the least rows a layer gets (None: the model's top-k where the store says
    it, else 8, at most a layer's experts; :func:`~asyncside.runtime._plan.min_rows`); one given
    above what a layer has to stream (its experts, less those ``pinned`` names) is refused as
    ``side_rows`` is.
    ``memory`` is the budget the runtime plans against (bytes or a size such as ``"1.5G"``; None:
    what the memory cgroup and MemAvailable allow): it refuses to start when the pools and their
    headroom do not fit, and reads past the page cache (O_DIRECT) when the records outside the
    pools do not fit what the budget leaves for it (``direct`` None; True or False forces it).
    ``reader`` and ``reader_options`` go to the :class:`~asyncside.scheduler.Scheduler`. ``verify``
    (default on) checks every record read or faulted in against the store's checksum before its
    row is used; a mismatch fails that fill with a FillError (``errno`` EBADMSG).

    ``host_tier`` (device pools on MLX CUDA only) bounds the pinned host memory of the host tier:
    a layer in the tier keeps every record its queued steps faulted in, verified, so a later fault
    of that expert is a copy to the device alone. Whole layers in order while they fit; ``"auto"``
    a quarter of what the budget leaves beside the pools; 0 none. The plan is :attr:`plan`.

    ``read_window`` is how many pieces a streamed resolve's reads past the page cache keep in
    flight (0 to 32; 0: a background read per record, side by side). None (the default): the
    process's where it was chosen (``ASYNCSIDE_FAULT_READ_WINDOW``), else the least window at which
    the store's disk reaches its rate, measured once per disk in the process when the plan reads
    O_DIRECT (:mod:`asyncside.read_window`; the plan says which and why).

    ``rows_profile`` (a :class:`~asyncside.routing.RoutingTrace` or the path of one, of the
    runtime's layers and experts; every row dynamic) splits the pools' rows between the layers by
    their miss curves on that trace instead of evenly, the same total (``profile_rows`` in
    :mod:`asyncside.runtime._plan`).
    Plan from one sequence and run another: a profile of the very routing replayed flatters it.
    """

    def __init__(
        self,
        store: ExpertStore,
        *,
        resident: float | str = 0.25,
        pinned: Mapping[int, Sequence[int]] | None = None,
        side_rows: int | None = None,
        min_side_rows: int | None = None,
        policy: str | Policy = DEFAULT_POLICY,
        reader: str = "auto",
        reader_options: ReaderOptions | None = None,
        direct: bool | None = None,
        memory: int | str | None = None,
        layers: Iterable[int] | None = None,
        completed: Completed | None = None,
        verify: bool = True,
        host_tier: int | str = "auto",
        rows_profile: RowsProfile | None = None,
        read_window: int | None = None,
    ) -> None:
        # Each was taken without a word (direct="yes", verify="no", completed=3) or failed far from
        # its cause (a path for the store, an int for layers: an AttributeError, a TypeError).
        if not isinstance(store, ExpertStore):
            raise TypeError(f"store: expected an ExpertStore (ExpertStore.open(path)), got {type(store).__name__} "
                            f"{store!r}")
        args = check_arguments(resident=resident, pinned=pinned, side_rows=side_rows, min_side_rows=min_side_rows,
                               policy=policy, direct=direct, memory=memory, layers=layers, completed=completed,
                               verify=verify, host_tier=host_tier, read_window=read_window,
                               rows_profile=rows_profile)
        resident, side_rows, min_side_rows = args["resident"], args["side_rows"], args["min_side_rows"]
        host_tier, read_window, layers = args["host_tier"], args["read_window"], args["layers"]
        self.store = store
        self.policy = policy
        self._resident, self._pinned, self._memory = resident, pinned, memory
        self._side_rows, self._min_side_rows, self._host_tier = side_rows, min_side_rows, host_tier
        self._rows_profile = rows_profile
        self._read_window = read_window
        # reader_options that say direct=... are an explicit choice too
        self._direct = direct if direct is not None or reader_options is None else reader_options.direct
        self._reader_args = (reader, reader_options, verify)
        self._layer_ids = list(layers) if layers is not None else list(store.layers)
        # A layer the store lacks (a typo, another model's map) pinned nothing, without a word.
        stray = [i for i in (pinned or {}) if int(i) not in store.layers]
        if stray:
            raise PlanArgumentError(f"pinned: the store has no layer {stray[0]!r} (its layers: {list(store.layers)}); "
                                    f"its experts would be pinned nowhere")
        if pinned is not None:
            # The plan read each id through int(): 1.7 pinned expert 1, the string "12" experts 1 and 2,
            # True expert 1; a bare id ended in "'int' object is not iterable".
            pinned = {int(i): _pinned_ids(store, int(i), ids) for i, ids in pinned.items()}
            self._pinned = pinned
        # Refused here, not when entered: more dynamic rows than a layer has experts to stream
        # would otherwise be cut down to what fits without a word.
        problem = side_rows_problem(store, self._layer_ids, side_rows, pinned)
        if problem is not None:
            raise PlanArgumentError(problem)
        # A least above what a layer has to stream was cut down to every expert, and the plan said the
        # rows were raised to "the least rows a layer": refused as side_rows is. The default (the
        # model's top-k, else DEFAULT_MIN_ROWS) is still capped at a small layer's experts.
        problem = side_rows_problem(store, self._layer_ids, min_side_rows, pinned, name="min_side_rows=")
        if problem is not None:
            raise PlanArgumentError(problem)
        self._plan: MemoryPlan | None = None
        self._s = Shared(store, Scheduler(reader, reader_options, direct=direct, verify=verify))
        self._s.completed = completed
        self._leases = Leases(self._s)
        #: the queued-step side: lending, fault logs, staging, the host tier
        self.queued = QueuedSide(self._s, self._leases)
        self._fills = HostFills(self._s, self.queued)

    # ---------------------------------------------------------------- lifecycle

    @property
    def reader(self) -> str:
        """The reader backend actually in use."""
        return self._s.scheduler.name

    @property
    def plan(self) -> MemoryPlan | None:
        """The memory plan (None until the runtime is entered)."""
        return self._plan

    @property
    def memory(self) -> dict[str, Any]:
        """The memory plan's figures (see :class:`MemoryPlan`; empty until entered)."""
        return self._plan.as_dict() if self._plan is not None else {}

    def plan_now(self, grows_by: int = 0) -> MemoryPlan:
        """The memory plan entering would make now, with nothing opened or allocated: an
        AsyncsideError where nothing sensible fits. Entering plans again, against what the process
        holds then (a process that grew meanwhile gets a tighter plan, never a roomier one);
        ``grows_by`` is what the caller will still take before it enters, planned as held already."""
        from .. import pools as _pools

        return plan_memory(
            self.store, self._layer_ids, resident=self._resident, pinned=self._pinned,
            side_rows=self._side_rows, min_side_rows=self._min_side_rows, memory=self._memory,
            direct=self._direct, host_tier=self._host_tier, rows_profile=self._rows_profile,
            tier_possible=_pools.device_pools_default() and _native.device_faults_available(), grows_by=grows_by,
            staging_bytes=reader_staging_bytes(self._reader_args[1]))

    async def __aenter__(self) -> Runtime:
        from ..native_env import check_env

        # The extension reads some itself and falls back quietly on a bad value; the others are read
        # where they are used, once a model has loaded: refused here first.
        s = self._s
        # Entered already (and running, or closed): a second entry failed deep in the scheduler
        # ("a Scheduler can be entered once") after it had replaced the running runtime's change
        # event and marked it closed, so the outer `async with` went on with a runtime that refused
        # every call and waiters that were never woken.
        if s.tg is not None or s.closed:
            state = "is running" if not s.closed else "was entered before and is closed"
            raise AsyncsideError(f"this Runtime {state}: a Runtime is entered once, by one `async with "
                                 "Runtime(...)`; make a new Runtime(store, ...) to run again")
        check_env()
        s.loop_thread = threading.get_ident()
        s.loop = running_loop()
        if s.completed is None:
            from ..bridge import completed

            s.completed = completed
        s.start(s.completed)
        try:
            self._plan = self.plan_now()  # before anything is opened: refuses pools that cannot fit
            if self._plan.direct != s.scheduler.direct:
                reader, options, verify = self._reader_args
                s.scheduler = Scheduler(reader, options, direct=self._plan.direct, verify=verify)
            if self._plan.direct:
                # Loading the model read its non-expert weights through the page cache; under a plan
                # that reads past it, a memory cgroup would go on charging those pages while the pools
                # are allocated (see BENCHMARKS.md, "At 4x the budget on the GPU").
                await anyio.to_thread.run_sync(drop_store_pages, self.store.path)
                return_large_frees()  # what MLX frees leaves the resident size (see memory.py)
                # How many pieces its ordered reads keep in flight: the disk's own answer, measured
                # once per disk in this process (asyncside/read_window.py).
                specs = [self.store.layers[i] for i in self._layer_ids]
                chosen = await anyio.to_thread.run_sync(choose_read_window, specs, self._read_window)
                self._plan = dataclasses.replace(self._plan, read_window=chosen)
            # Cancellable at every await; on any failure the scheduler has already closed itself.
            await s.scheduler.__aenter__()
        except BaseException:
            s.closed = s.exited = True
            raise
        try:
            # Hosted: the runtime may be exited by another task than the one that entered it (a
            # pytest-asyncio fixture's teardown).
            s.tg = HostedTaskGroup()
            await s.tg.__aenter__()
            await self._fills.setup(self._plan, policy=self.policy, side_rows=self._side_rows,
                                    min_side_rows=self._min_side_rows, pinned=self._pinned)
            await self.queued.setup(self._plan)
        except BaseException:
            # Not handed to the task group (it would wrap it in an ExceptionGroup): the setup
            # error itself is what the caller sees.
            await self._close(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        return await self._close(*exc_info)

    async def _close(self, *exc_info: Any) -> bool | None:
        s = self._s
        try:
            if self.queued.active:
                # Queued steps may still fault rows in on the stream: let them finish, then take the
                # lent rows back, so the ledgers end consistent (and the pools outlive the reads).
                with anyio.CancelScope(shield=True):
                    try:
                        await self.queued.quiesce()
                    except Exception:
                        pass  # failed faults were reported to (or are lost with) their steps
        finally:
            # Closed whatever interrupted that wait (a KeyboardInterrupt): a task group and a
            # scheduler never exited left their tasks, threads and cancel scope behind (trio then
            # failed the whole run with an internal error).
            s.closed = True
            # Pending prefetch tasks and lease releases are ours: cancel them. Reads already
            # submitted are not cancelled: the scheduler waits for them so no row stays FILLING.
            try:
                if s.tg is not None:
                    s.tg.cancel_scope.cancel()
                    # Not the body's exception: the task group would wrap it in an ExceptionGroup,
                    # and the caller's own error (a refusal, a KeyError) must reach it as raised.
                    # The group's tasks were cancelled just above; an error of theirs still raises.
                    await s.tg.__aexit__(None, None, None)
            finally:
                try:
                    await s.scheduler.__aexit__(*exc_info)
                finally:
                    self.queued.release_blobs()
                    s.exited = True
                    s.notify()  # an ensure waiting for a change hears that the runtime closed
        return None

    @property
    def scheduler(self) -> Scheduler:
        """The read scheduler in use (entering may replace it: read it at each use). Tests drive its
        reader's fault hooks through :class:`asyncside.testing.FaultyReader`."""
        return self._s.scheduler

    async def reopen_blob(self, path: str | os.PathLike[str]) -> bool:
        """Re-open the reader's handles on the blob at ``path`` (replaced on disk by another file):
        fills submitted from now on read the new file, fills in flight finish on the old one; a
        handle that cannot be re-opened keeps the old file. False when no layer reads ``path``;
        AsyncsideError when the runtime is not running. The queued steps' fault tables keep their
        own descriptors, opened on entry: they read the new file in a new Runtime, or once their
        descriptors are re-pointed (:func:`asyncside.serving.health.reopen_blob`)."""
        s = self._s
        if s.closed or s.tg is None:
            raise AsyncsideError(f"reopen_blob({os.fspath(path)!r}): the runtime is not running "
                                 "(use it inside `async with Runtime(...) as rt`)")
        want = pathlib.PurePath(path)  # as the store names it: nothing on disk is looked at
        blobs = {str(st.spec.path) for st in s.layers.values() if pathlib.PurePath(st.spec.path) == want}
        for blob in blobs:
            await s.scheduler.reopen(blob)
        return bool(blobs)

    # ---------------------------------------------------------------- the forward's calls

    def prefetch(self, layer: int, ids: Ids) -> PrefetchHandle:
        """Start reading the predicted experts ``ids`` of ``layer``; returns at once. ``ids`` may be
        a lazy ``mx.array``: the runtime awaits its computation, then reserves rows and reads."""
        return self._fills.prefetch(layer, ids)

    async def ensure(self, layer: int, ids: Ids) -> None:
        """Return once every expert in ``ids`` has its bytes in a row of ``layer``'s pools.

        Present experts are hits; absent ones are reserved on demand (a demand is never skipped
        like a prediction is) and read; ones whose prefetch is in flight are waited for. A fill
        that fails raises its FillError here.
        """
        await self._fills.ensure(layer, ids)

    async def drain(self, layer: int | None = None) -> None:
        """Wait for every fill (and pending prefetch) submitted so far for ``layer`` (or all).
        Raises an ExceptionGroup of the FillErrors of fills that failed since the last drain."""
        await self._fills.drain(layer)

    def lookup(self, layer: int) -> mx.array:
        """The expert -> row table of ``layer`` (int32, -1 for absent) as an ``mx.array``."""
        st = self._s.layer(layer)
        if st.table is None or st.table_version != st.version:
            st.table = mx.array(st.ledger.lookup())
            st.table_version = st.version
        return st.table

    def lease(self, layer: int, experts: Iterable[int] | np.ndarray) -> int:
        """Pin the rows of ``experts`` so no fill overwrites them; returns a lease id. AsyncsideError
        once the runtime is closed (a lease then taken was never released)."""
        self._s.check_running()
        return self._leases.lease(layer, experts)

    def release(self, layer: int, lease_id: int) -> None:
        """Release a lease now (the caller knows the rows are no longer read)."""
        self._leases.release(layer, lease_id)

    def release_after(self, x: mx.array, leases: Iterable[tuple[int, int]]) -> None:
        """Release ``leases`` ((layer, lease id) pairs) once ``x`` has been computed."""
        self._leases.release_after(x, leases)

    def release_computed(self) -> None:
        """Release now the leases whose computation already finished (see :class:`Leases`)."""
        self._leases.release_computed()

    # ---------------------------------------------------------------- what the forward reads

    def n_experts(self, layer: int) -> int:
        """How many experts ``layer`` has."""
        return int(self._s.layer(layer).spec.n_experts)

    def pools(self, layer: int) -> dict[str, mx.array]:
        """The pool arrays of ``layer``, one per segment key, shape ``(rows, *row_shape)``."""
        return self._s.layer(layer).pools.arrays

    def snapshot(self, layer: int) -> RowSnapshot:
        """Where ``layer``'s experts are now, for an in-graph gather (see :mod:`asyncside.snapshot`)."""
        st = self._s.layer(layer)
        if st.snap is None or st.snap_version != st.version:
            # Every reserve that hands out a row bumps st.version, so generations cannot change
            # under a cached snapshot either.
            st.snap = make_snapshot(st.ledger.lookup(), st.ledger.generations())
            st.snap_version = st.version
        return st.snap

    def unchanged(self, layer: int, snap: RowSnapshot, experts: np.ndarray) -> np.ndarray:
        """Bool per expert: present in ``snap`` and in the same row since, never refilled."""
        st = self._s.layer(layer)
        ids = np.asarray(validate_ids(host_ids(experts), st.spec.n_experts, layer=layer), dtype=np.int64)
        return st.ledger.unchanged_since(snap.table, snap.generations, ids)

    def ledger(self, layer: int) -> Ledger:
        """The ledger of ``layer`` (read it; only the runtime changes it), caught up with what
        queued steps did so far."""
        st = self._s.layer(layer)
        self.queued.reconcile(st)
        return st.ledger

    # ---------------------------------------------------------------- queued steps (QueuedSource)

    def queued_ready(self, pairs: int) -> bool:
        """Whether a queued step routing up to ``pairs`` pairs per layer can run now."""
        return self.queued.ready(pairs)

    def queued_capacity(self, decode_tokens: int | None = None) -> int:
        """Distinct experts one resolve of a queued step can take in every layer (``decode_tokens``:
        the step's tokens when it is a decode step, one token per sequence)."""
        return self.queued.capacity(decode_tokens)

    def begin_step(self, pairs: int) -> int:
        """Before queuing a step: every dynamic row lent; an earlier failed fault raised (unless it
        waits for its own step's :meth:`after_step`). Returns the step's id."""
        self._s.check_thread()
        return self.queued.begin()

    def expert_rows(self, layer: int, ids: mx.array) -> mx.array:
        """Lazy uint32 pool rows of the routed ``ids``; absent experts fault in on the stream."""
        return self.queued.expert_rows(layer, ids)

    def streams_misses(self, layer: int) -> bool:
        """Whether a small switch of ``layer`` streams its misses (:meth:`begin_rows`)."""
        return self.queued.streams_misses(layer)

    def can_stream(self, layer: int) -> bool:
        """Whether ``layer`` can take streamed resolves at all (a host fault table)."""
        return self.queued.can_stream(layer)

    def begin_rows(self, layer: int, ids: mx.array) -> mx.array:
        """Lazy rows of the routed ``ids``, absent experts' reads started in the background."""
        return self.queued.begin_rows(layer, ids)

    def prefetch_rows(self, layer: int, ids: mx.array, after: mx.array) -> mx.array:
        """``after`` passed through once the stream started reading the predicted experts ``ids``
        of ``layer`` that are absent (a prefetch inside a queued step; see ``QueuedSource``)."""
        return self.queued.prefetch_rows(layer, ids, after)

    def prefetch_counts(self) -> tuple[int, int]:
        """Records queued steps' prefetches read so far, and how many of them were routed."""
        return self.queued.prefetch_counts()

    def finish_rows(self, layer: int, ids: mx.array, rows: mx.array) -> mx.array:
        """``rows`` of ``ids`` (from :meth:`begin_rows`) once those experts' reads landed."""
        return self.queued.finish_rows(layer, ids, rows)

    def staging(self, layer: int) -> dict[str, mx.array] | None:
        """The whole-layer staging arrays of ``layer`` (device pools with a host tier), or None."""
        return self.queued.staging(layer)

    def staged_rows(self, layer: int, ids: mx.array) -> mx.array:
        """Lazy rows of the routed ``ids`` in the staging arrays, copied there on the stream."""
        return self.queued.staged_rows(layer, ids)

    def staged_done(self, out: mx.array) -> None:
        """``out`` is the output of the switch that read the latest :meth:`staged_rows`."""
        self.queued.staged_done(out)

    def end_step(self, out: mx.array) -> None:
        """A queued step whose last output is ``out`` is built and about to be scheduled."""
        self.queued.end(out)

    def abandon_step(self) -> None:
        """A queued step begun will not be scheduled."""
        self.queued.abandon()

    def after_step(self, step: int | None = None) -> None:
        """The output of the queued step ``step`` (what :meth:`begin_step` returned; None: a step
        not named) was awaited: raise the FillError of a fault it read (``FillError.step``)."""
        self.queued.after_step(step)

    async def quiesce(self) -> None:
        """Wait for every queued step, apply its faults, and take every lent row back."""
        await self.queued.quiesce()

    @property
    def queued_active(self) -> bool:
        """True while queued steps may be running or rows are lent."""
        return self.queued.active

    def fault_latency(self) -> dict[str, float]:
        """Median and p99 of the latest faults' time on the stream (seconds; 0 when none)."""
        return self.queued.fault_latency()

    # ---------------------------------------------------------------- accounts

    def audit(self) -> dict[int, AuditReport]:
        """Audit every ledger, native fault tables and (once closed) leases left open; returns
        layer -> AuditReport."""
        return _audit(self._s, self.queued)

    def stats(self) -> RuntimeStats:
        """Every counter since start (hits, misses, bytes read, faults, stall time, ...): typed
        parts, and a mapping of flat names (``stats()["hits"]``)."""
        self.queued.reconcile_all()  # queued steps' faults and uses, up to now
        self._s.queued.read_wait_s = self.queued.read_wait_s()
        self._s.queued.prefetch_hits = self.queued.prefetch_counts()[1]
        plan = self._plan
        return snapshot(self._s.cache, self._s.reads, self._s.queued, reader=self.reader,
                        direct=self._s.scheduler.direct, pool_bytes_planned=plan.pool_bytes if plan else 0,
                        memory_budget=plan.budget if plan else 0)
