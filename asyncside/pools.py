"""Pool arrays: per layer, one evaluated MLX array per segment key, shape ``(rows, *segment.shape)``.

Reads land in these arrays directly (native readers hold references to them and write through
raw row addresses; the aiofiles reader writes through :meth:`PoolSet.row_view`). So a pool is
created once, evaluated, and never written through MLX operations: an MLX op may give the result
a new buffer, and the readers would keep writing into the old one.

MLX CPU buffers are not 4096-aligned. Each pool is carved out of an over-allocated ``uint8``
buffer at a 4096-aligned offset (a slice and a dtype view alias the buffer, they do not copy), so
that with the usual power-of-two row sizes every row is block aligned and an ``O_DIRECT`` read can
land in the rows themselves instead of going through a staging buffer.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from .store import DTYPE_SIZES, LayerSpec

if TYPE_CHECKING:
    import mlx.core as mx

#: Pools start at a multiple of this (the O_DIRECT block size the native readers use).
POOL_ALIGNMENT = 4096

_MX_DTYPE_ATTR = {name: name for name in DTYPE_SIZES}
_MX_DTYPE_ATTR["bool"] = "bool_"


def buffer_address(arr: object) -> int:
    """Address of the first byte of an evaluated MLX array's data (through the buffer protocol)."""
    view = memoryview(arr).cast("B")  # type: ignore[arg-type]
    if view.nbytes == 0:
        return 0
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


#: the most elements one dimension of an MLX array may have (its shapes are 32-bit)
MLX_MAX_DIM = (1 << 31) - 1


def _aligned_pool(nbytes: int, dtype_name: str, shape: tuple[int, ...], align: int) -> mx.array:
    import mlx.core as mx

    dtype = getattr(mx, _MX_DTYPE_ATTR[dtype_name])
    # The buffer is a flat array of the widest unsigned unit that divides a row's innermost bytes:
    # as bytes, a pool of more than 2 GiB (a wide model's experts, most of them resident) had more
    # elements than an MLX dimension holds, and the runtime failed to start in an OverflowError.
    inner = (shape[-1] if len(shape) > 1 else 1) * DTYPE_SIZES[dtype_name]
    unit = next(u for u in (8, 4, 2, 1) if inner % u == 0 and nbytes % u == 0)
    if (nbytes + align) // unit > MLX_MAX_DIM:
        raise ValueError(f"a pool of {nbytes} bytes ({shape} of {dtype_name}) is larger than one MLX array holds: "
                         f"fewer rows a layer (a smaller resident fraction)")
    units = {8: mx.uint64, 4: mx.uint32, 2: mx.uint16, 1: mx.uint8}
    raw = mx.zeros(((nbytes + align) // unit,), dtype=units[unit])
    mx.eval(raw)
    base = buffer_address(raw)
    skip = (-base) % align
    if skip % unit:  # MLX buffers start at a multiple of the unit; one that did not is left unaligned (reads stage)
        skip = 0
    pool = raw[skip // unit : (skip + nbytes) // unit]
    if len(shape) > 1:
        pool = pool.reshape(*shape[:-1], inner // unit)
    if dtype != units[unit]:
        pool = pool.view(dtype)
    pool = pool.reshape(shape)
    mx.eval(pool)
    if buffer_address(pool) != base + skip:
        # MLX copied instead of aliasing: fall back to an unaligned pool (reads then stage).
        pool = mx.zeros(shape, dtype=dtype)
        mx.eval(pool)
    return pool


_BUILDER_LOCK = threading.Lock()
_BUILDER: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] | None = None


def _serve_builds(jobs: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]) -> None:
    while True:
        fn, future = jobs.get()
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the awaiting caller, whatever it is
                future.set_exception(exc)
        # Not kept while waiting for the next build: the finished future holds the pools it built,
        # which outlived their runtime (a closed runtime's last layer stayed allocated in the process).
        del fn, future


def _forget_builder() -> None:
    # A forked child has no copy of the thread: its first build starts its own.
    global _BUILDER
    _BUILDER = None


os.register_at_fork(after_in_child=_forget_builder)


def _build_in_pool_thread(fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
    """Run ``fn`` on the process's one pool-building thread (a daemon started on first use that
    never ends); its future.

    Why one thread for the process's life: MLX gives every thread that runs an op its own default
    stream, with a scheduler thread of its own that outlives the thread. Built in anyio's worker
    threads, which end with the task that ran the runtime (every ``asyncio.run``, every ``load()``'s
    model), each runtime left one more such thread behind for good. Like the facade's runtime
    thread, it never ends: a thread holding MLX state must not end while the interpreter finalizes.
    """
    global _BUILDER
    with _BUILDER_LOCK:
        if _BUILDER is None:
            jobs: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = queue.SimpleQueue()
            threading.Thread(target=_serve_builds, args=(jobs,), name="asyncside-pools", daemon=True).start()
            _BUILDER = jobs
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        _BUILDER.put((fn, future))
    return future


def device_pools_default() -> bool:
    """True when pools must live in device memory: MLX's default device is a CUDA GPU.

    On Metal, memory is unified and a host pointer to a pool is cheap, so the host path is used.
    """
    import mlx.core as mx

    try:
        return mx.default_device() == mx.gpu and bool(mx.cuda.is_available())
    except AttributeError:  # an MLX without the cuda module
        return False


class PoolSet:
    """For one layer: one evaluated MLX array per segment key, ``(rows, *segment.shape)``.

    ``arrays`` is ordered as ``spec.segments``. Rows are ``[0, rows)``; which row holds which
    expert is the ledger's business, not this class's.
    """

    def __init__(self, spec: LayerSpec, rows: int, *, align: int = POOL_ALIGNMENT,
                 device: bool | None = None) -> None:
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"layer {spec.index}: rows must be an int >= 1, got {rows!r}")
        if align < 1 or align & (align - 1):
            raise ValueError(f"align must be a power of two, got {align!r}")
        self.spec = spec
        self.rows = rows
        self.arrays: dict[str, mx.array] = {}
        #: Device pools (MLX CUDA): reads land in ``mirror`` (pinned host memory laid out like the
        #: pools) and :meth:`upload` copies rows over on MLX's stream. None for host pools.
        self.device = device_pools_default() if device is None else bool(device)
        self.mirror: Any = None  # asyncside._native.HostMirror
        if self.device:
            import mlx.core as mx

            from . import _native

            for seg in spec.segments:
                dtype = getattr(mx, _MX_DTYPE_ATTR[seg.dtype])
                self.arrays[seg.key] = mx.zeros((rows, *seg.shape), dtype=dtype)
            mx.eval(*self.arrays.values())
            self.mirror = _native.HostMirror(rows, [seg.nbytes for seg in spec.segments])
            return
        for seg in spec.segments:
            self.arrays[seg.key] = _aligned_pool(rows * seg.nbytes, seg.dtype, (rows, *seg.shape), align)

    @classmethod
    async def allocate(cls, spec: LayerSpec, rows: int, *, align: int = POOL_ALIGNMENT,
                       device: bool | None = None) -> PoolSet:
        """Build the pools without stalling the event loop: allocating and zeroing large host
        pools takes tens to hundreds of ms, so host pools are built off the loop, on the process's
        pool-building thread (see :func:`_build_in_pool_thread`). Device pools (MLX CUDA) are built
        on the calling thread: MLX streams are thread-local and the GPU stream that later reads the
        pools is this thread's. Evaluated when this returns."""
        import anyio

        if device_pools_default() if device is None else device:
            return cls(spec, rows, align=align, device=True)
        future = _build_in_pool_thread(lambda: cls(spec, rows, align=align, device=False))
        # The worker only waits (it runs no MLX op); the build goes on to its end if cancelled.
        pools: PoolSet = await anyio.to_thread.run_sync(future.result)
        return pools

    def __repr__(self) -> str:
        return f"PoolSet(layer={self.spec.index}, rows={self.rows}, keys={list(self.arrays)})"

    @property
    def nbytes(self) -> int:
        """Total bytes of all pools of the layer."""
        return self.rows * sum(seg.nbytes for seg in self.spec.segments)

    def _check(self, key: str, row: int) -> int:
        if key not in self.arrays:
            raise KeyError(f"layer {self.spec.index} has no pool {key!r}; keys: {list(self.arrays)}")
        if isinstance(row, bool) or not isinstance(row, (int, np.integer)) or not 0 <= int(row) < self.rows:
            raise IndexError(f"layer {self.spec.index} pool {key!r}: row {row!r} out of range [0, {self.rows})")
        return self.spec.segment(key).nbytes

    def upload(self, rows: Iterable[int]) -> mx.array:
        """Device pools: a lazy array whose evaluation copies ``rows`` from the mirror to the pools.

        Await ``asyncside.completed`` on it before publishing the rows.
        """
        import mlx.core as mx

        from . import _native

        if not self.device:
            raise ValueError(f"layer {self.spec.index}: host pools need no upload")
        arrays = [self.arrays[seg.key] for seg in self.spec.segments]
        out: mx.array = _native.upload_rows(self.mirror, arrays, [int(r) for r in rows], mx.default_stream(mx.gpu))
        return out

    def row_view(self, key: str, row: int) -> memoryview:
        """Writable bytes of one row of pool ``key`` (zero-copy: writes land in the MLX array).

        For device pools this is the row of the host mirror, which is where reads land.
        """
        nb = self._check(key, row)
        if self.device:
            index = [seg.key for seg in self.spec.segments].index(key)
            return memoryview(self.mirror.row_view(index, int(row)))
        flat = memoryview(self.arrays[key]).cast("B")  # type: ignore[arg-type]  # mx.array has the buffer protocol
        return flat[int(row) * nb : (int(row) + 1) * nb]

    def row_address(self, key: str, row: int) -> int:
        """Address of the first byte of one row (what native readers write to)."""
        nb = self._check(key, row)
        return buffer_address(self.arrays[key]) + int(row) * nb

    def row_bytes(self, key: str, row: int) -> bytes:
        """A copy of one row's bytes as the pool holds them (for device pools: copied back)."""
        if self.device:
            self._check(key, row)
            return np.array(self.arrays[key][int(row)]).tobytes()
        return bytes(self.row_view(key, row))

    @property
    def aligned(self) -> bool:
        """True when every pool starts on a POOL_ALIGNMENT boundary."""
        return all(buffer_address(a) % POOL_ALIGNMENT == 0 for a in self.arrays.values())
