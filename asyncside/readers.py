"""Reader backends behind one interface: native io_uring, native thread pool, pure-Python aiofiles.

A backend reads expert records into pool rows and reports each finished fill as ``(token,
result)`` with ``result`` 0 or ``-errno`` (``-ENODATA``: the blob ended before the record did).
It knows nothing of ledgers or handles; :class:`asyncside.scheduler.Scheduler` maps tokens to
fills. Choice: an explicit name wins; ``"auto"`` takes ``$ASYNCSIDE_READER`` when set, else
io_uring when the kernel allows rings, else the thread pool. Every backend is tuned by one
:class:`ReaderOptions` (the native struct itself, bound: its defaults are the only ones).

- ``io_uring``: native, Linux. Rings set up through the syscalls (no liburing); vectored reads
  straight into the rows; IOSQE_ASYNC on large reads so page-cache copies (and O_DIRECT page
  pinning) run in io-wq workers (capped at the CPU count), not on the loop; O_DIRECT into the rows
  themselves when every piece is block aligned, else through registered staging slots + a native
  GIL-free scatter; registered files.
- ``threads``: native, portable (the macOS path): N workers doing preadv, same completion list
  and eventfd (a pipe off Linux).
- ``aiofiles``: pure Python, no native code: ``os.preadv`` into the rows' memoryviews, run through
  ``aiofiles.os.wrap`` on asyncio (aiofiles is asyncio-only; on trio the same call goes through
  ``anyio.to_thread``). The fallback and a baseline.
"""

from __future__ import annotations

import asyncio
import copy
import errno as _errno
import logging
import mmap
import os
import stat
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.abc import TaskStatus

from ._native import ReaderOptions as ReaderOptions  # re-exported: the one options struct
from .errors import AsyncsideError, EnvVarError
from .native_env import ENV_DIRECT as ENV_DIRECT  # re-exported: defined with their environment checks
from .native_env import ENV_READER as ENV_READER
from .native_env import READERS as READERS
from .native_env import env_direct, env_reader
from .pools import PoolSet
from .store import LayerSpec

log = logging.getLogger(__name__)

#: Gaps between segments up to this are read into a sink (one vectored read); larger ones split it.
JUNK_BYTES = 64 * 1024
DIRECT_ALIGN = 4096

Deliver = Callable[[list[tuple[int, int]]], None]


class ReaderUnavailable(AsyncsideError, RuntimeError):
    """The requested reader cannot run here (e.g. io_uring disabled by the kernel)."""


def io_uring_status() -> tuple[bool, str]:
    """(True, "") when io_uring rings can be set up here, else (False, reason)."""
    from . import _native

    ok, why = _native.io_uring_available()
    if not ok and os.path.exists("/proc/sys/kernel/io_uring_disabled"):
        try:
            with open("/proc/sys/kernel/io_uring_disabled") as fh:
                why += f"; /proc/sys/kernel/io_uring_disabled={fh.read().strip()}"
        except OSError:
            pass
    return ok, why


def check_reader_name(requested: str) -> None:
    """ValueError where ``requested`` names no reader backend (nor "auto")."""
    if requested not in (*READERS, "auto"):
        raise ValueError(f"reader: expected one of {['auto', *READERS]}, got {requested!r}")


def choose_reader(requested: str = "auto") -> str:
    """The backend name to use: an explicit name wins over $ASYNCSIDE_READER, which wins over auto."""
    check_reader_name(requested)
    if requested == "auto":
        env = os.environ.get(ENV_READER, "")
        try:
            named = env_reader(env)
        except EnvVarError:
            raise ValueError(f"${ENV_READER}: expected one of {list(READERS)}, got {env.strip()!r}") from None
        if named is None:
            return "io_uring" if io_uring_status()[0] else "threads"
        requested = named
    if requested == "io_uring":
        ok, why = io_uring_status()
        if not ok:
            raise ReaderUnavailable(f"reader 'io_uring' is not available here: {why}")
    return requested


def _env_direct() -> bool:
    env = os.environ.get(ENV_DIRECT, "")
    try:
        return env_direct(env)
    except EnvVarError:
        raise ValueError(f"${ENV_DIRECT}: expected 0 or 1, got {env.strip().lower()!r}") from None


def reader_options(options: ReaderOptions | None = None, *, direct: bool | None = None) -> ReaderOptions:
    """The options a reader runs with: a copy of ``options`` (defaults when None) whose ``direct``
    is ``direct`` when given; else ``options.direct`` when options were given; else
    $ASYNCSIDE_DIRECT (1/0) when set; else buffered reads (the page cache helps)."""
    out = ReaderOptions() if options is None else copy.copy(options)
    if direct is not None:
        out.direct = bool(direct)
    elif options is None:
        out.direct = _env_direct()
    return out


class ReaderBackend(ABC):
    """What the scheduler needs from a reader."""

    name: str
    direct: bool

    @abstractmethod
    def add_layout(self, spec: LayerSpec, pools: PoolSet) -> int:
        """Open the layer blob for reads into ``pools``; returns a layout id for :meth:`submit`.

        Called in a worker thread (an open can block: a stale mount). Raises OSError with errno
        and filename when the blob cannot be opened or is not a regular file."""

    @abstractmethod
    def submit(self, layout: int, tokens: Sequence[int], experts: Sequence[int], rows: Sequence[int]) -> None:
        """Start reading ``experts[i]`` into ``rows[i]``; never blocks on I/O."""

    @abstractmethod
    async def serve(self, deliver: Deliver, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Deliver completions (on the loop thread) until cancelled; ``task_status.started()`` once
        submit() may be called. The scheduler runs this shielded."""

    def kick(self, deliver: Deliver) -> None:  # noqa: B027 - optional hook, nothing to do by default
        """Deliver whatever completed already (io_uring reads may finish inside submit)."""

    def take_mismatch(self, token: int) -> tuple[int, int] | None:
        """(expected, got) checksums of a fill that completed with -EBADMSG (once), else None."""
        return None

    @abstractmethod
    def set_faults(self, path: str = "", lo: int = 0, hi: int = 0, err: int = 0, max_read_bytes: int = 0,
                   transient_every: int = 0, transient_err: int = 0) -> None:
        """Test hooks (off by default): fail reads of ``path`` touching [lo, hi) with ``err``; cap
        every read op at ``max_read_bytes``; every ``transient_every``-th op fails once with
        ``transient_err`` (EAGAIN/EINTR) and is retried."""

    @abstractmethod
    def counters(self) -> dict[str, int]:
        """Monotonic counters; balanced (submitted == completed, staging returned) when idle."""

    @abstractmethod
    async def aclose(self) -> None:
        """Release threads, rings, staging and files. Only called with nothing in flight."""


# --------------------------------------------------------------------------------------------
# Native (io_uring, threads)


class NativeReader(ReaderBackend):
    """asyncside._native.Reader: completions on one native list, announced through one eventfd."""

    def __init__(self, name: str, options: ReaderOptions) -> None:
        from . import _native

        self.name = name
        try:
            self._r = _native.Reader(name, options)
        except (RuntimeError, OSError) as exc:
            # The ring or the threads could not be set up (too few open files allowed, the locked
            # memory limit an older kernel charges rings to, io_uring refused by a seccomp
            # profile): a RuntimeError traceback from inside the scheduler's entry.
            raise AsyncsideError(reader_start_failure(name, exc)) from None
        self.options: ReaderOptions = self._r.options  # machine-dependent defaults resolved
        self.direct = bool(self.options.direct)

    def add_layout(self, spec: LayerSpec, pools: PoolSet) -> int:
        segs = spec.segments
        if pools.mirror is not None:  # device pools: reads land in the pinned host mirror
            lid = self._r.add_layout_mirror(
                str(spec.path), spec.stride, spec.n_experts, [s.offset for s in segs], [s.nbytes for s in segs],
                pools.mirror,
            )
            self._set_checksums(lid, spec)
            return int(lid)
        lid = self._r.add_layout(
            str(spec.path), spec.stride, spec.n_experts, [s.offset for s in segs], [s.nbytes for s in segs],
            [pools.arrays[s.key] for s in segs],
        )
        self._set_checksums(lid, spec)
        return int(lid)

    def _set_checksums(self, lid: int, spec: LayerSpec) -> None:
        if self.options.verify and spec.checksum is not None and spec.checksums is not None:
            self._r.set_checksums(lid, spec.checksum, list(spec.checksums))

    def take_mismatch(self, token: int) -> tuple[int, int] | None:
        got = self._r.take_mismatch(token)
        return None if got is None else (int(got[0]), int(got[1]))

    def submit(self, layout: int, tokens: Sequence[int], experts: Sequence[int], rows: Sequence[int]) -> None:
        self._r.submit(layout, list(tokens), list(experts), list(rows))

    async def serve(self, deliver: Deliver, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        fd = self._r.event_fd
        task_status.started()
        while True:
            await anyio.wait_readable(fd)
            done = self._r.reap()
            if done:
                deliver(done)

    def kick(self, deliver: Deliver) -> None:
        done = self._r.reap()
        if done:
            deliver(done)

    def set_faults(self, path: str = "", lo: int = 0, hi: int = 0, err: int = 0, max_read_bytes: int = 0,
                   transient_every: int = 0, transient_err: int = 0) -> None:
        self._r.set_faults(path=path, lo=lo, hi=hi, err=err, max_read_bytes=max_read_bytes,
                           transient_every=transient_every, transient_err=transient_err)

    def counters(self) -> dict[str, int]:
        return dict(self._r.counters())

    async def aclose(self) -> None:
        # Nothing is in flight, but joining threads and unmapping rings is still blocking work.
        await anyio.to_thread.run_sync(self._r.close)


# --------------------------------------------------------------------------------------------
# aiofiles (pure Python)


@dataclass
class _PyLayout:
    spec: LayerSpec
    pools: PoolSet
    fd: int
    fd_direct: int


class _EndOfFile(Exception):
    pass


class _Mismatch(Exception):
    def __init__(self, expected: int, got: int) -> None:
        self.expected, self.got = expected, got


class AiofilesReader(ReaderBackend):
    """Pure Python: each fill is one hop to aiofiles' executor (asyncio) or anyio's thread pool
    (trio), where ``os.preadv`` reads into the rows' writable memoryviews (zero-copy; short reads
    continue, EINTR/EAGAIN retry). O_DIRECT reads go into a page-aligned mmap staging buffer and are
    scattered with memoryview copies in that same worker thread: the loop thread never copies."""

    name = "aiofiles"

    def __init__(self, options: ReaderOptions) -> None:
        self.direct = options.direct
        self.options = options
        self._layouts: list[_PyLayout] = []
        self._tg: Any = None
        self._deliver: Deliver | None = None
        self._faults: dict[str, Any] = {}
        self._op_seq = 0
        self._junk = bytearray(JUNK_BYTES)
        self._lock = threading.Lock()  # counters and the fault sequence are touched from worker threads
        self._c = {k: 0 for k in ("fills_submitted", "fills_completed", "fills_failed", "ops_submitted",
                                  "ops_completed", "short_reads", "retries", "faults_injected", "bytes_read",
                                  "staging_acquired", "staging_released")}
        self._offload: Callable[..., Any] | None = None
        self._closed = False
        self._mismatches: dict[int, tuple[int, int]] = {}

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._c[key] += n

    def add_layout(self, spec: LayerSpec, pools: PoolSet) -> int:
        fd = _open_blob(str(spec.path), 0, "")
        fd_direct = -1
        if self.direct:
            try:
                fd_direct = _open_blob(str(spec.path), getattr(os, "O_DIRECT", 0), " with O_DIRECT")
            except OSError:
                os.close(fd)
                raise
        with self._lock:
            if self._closed:  # closed while this open ran in its worker thread
                os.close(fd)
                if fd_direct >= 0:
                    os.close(fd_direct)
                raise OSError(_errno.EBADF, "the reader is closed", str(spec.path))
            self._layouts.append(_PyLayout(spec, pools, fd, fd_direct))
            return len(self._layouts) - 1

    def submit(self, layout: int, tokens: Sequence[int], experts: Sequence[int], rows: Sequence[int]) -> None:
        if self._tg is None:
            raise RuntimeError("aiofiles reader: submit before serve() started (use the Scheduler as a context)")
        L = self._layouts[layout]
        for tok, e, r in zip(tokens, experts, rows):
            self._count("fills_submitted")
            self._tg.start_soon(self._fill, tok, L, int(e), int(r))

    async def serve(self, deliver: Deliver, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self._deliver = deliver
        # sniffio's own test for asyncio: sniffio no longer comes with anyio, and without it this
        # reader took anyio's thread pool on asyncio too, not aiofiles.
        try:
            on_asyncio = asyncio.current_task() is not None
        except RuntimeError:  # no asyncio loop in this thread (trio)
            on_asyncio = False
        if on_asyncio:
            import aiofiles.os

            self._offload = aiofiles.os.wrap(_call)
        else:
            # aiofiles supports asyncio only; the same work runs through anyio's thread pool.
            async def offload(fn: Callable[..., Any], *args: Any) -> Any:
                return await anyio.to_thread.run_sync(fn, *args)

            self._offload = offload
        async with anyio.create_task_group() as tg:
            self._tg = tg
            task_status.started()
            try:
                await anyio.sleep_forever()
            finally:
                self._tg = None

    async def _fill(self, token: int, L: _PyLayout, expert: int, row: int) -> None:
        # Shielded: a read that started must land (or fail) before anyone reuses its row.
        with anyio.CancelScope(shield=True):
            try:
                assert self._offload is not None
                await self._offload(self._read_staged if self.direct else self._read_rows, L, expert, row)
                res = 0
            except _EndOfFile:
                res = -_errno.ENODATA
            except _Mismatch as exc:
                self._mismatches[token] = (exc.expected, exc.got)
                res = -_errno.EBADMSG
            except OSError as exc:
                res = -(exc.errno or _errno.EIO)
            except Exception:  # a bug here must still settle the fill, or its row leaks
                log.exception("aiofiles reader: fill of %s expert %d failed", L.spec.path, expert)
                res = -_errno.EIO
        self._count("fills_completed")
        if res:
            self._count("fills_failed")
        assert self._deliver is not None
        self._deliver([(token, res)])

    # ---- worker-thread side -------------------------------------------------------------

    def _fault(self, path: str, off: int, length: int) -> int:
        f = self._faults
        if not f:
            return 0
        with self._lock:
            if f.get("transient_every") and f.get("transient_err"):
                self._op_seq += 1
                if self._op_seq % f["transient_every"] == 0:
                    self._c["faults_injected"] += 1
                    return int(f["transient_err"])
            if f.get("err") and f.get("path") == path and off < f["hi"] and off + length > f["lo"]:
                self._c["faults_injected"] += 1
                return int(f["err"])
        return 0

    def _read_range(self, fd: int, path: str, off: int, bufs: list[memoryview], need: int, direct: bool) -> None:
        """Read ``sum(len(bufs))`` bytes at ``off`` into ``bufs``; short reads continue, EINTR/EAGAIN retry."""
        total = sum(b.nbytes for b in bufs)
        done = 0
        cap = self._faults.get("max_read_bytes", 0)
        if cap and direct:
            cap = max(cap - cap % DIRECT_ALIGN, DIRECT_ALIGN)
        while done < need:
            # The op asks for the rest (want); the max_read_bytes hook trims what is handed to
            # preadv (give), which then returns fewer bytes than asked: a short read.
            want = total - done
            give = min(want, cap) if cap else want
            window: list[memoryview] = []
            skip, left = done, give
            for b in bufs:
                if left == 0:
                    break
                if skip >= b.nbytes:
                    skip -= b.nbytes
                    continue
                take = min(b.nbytes - skip, left)
                window.append(b[skip : skip + take])
                left -= take
                skip = 0
            self._count("ops_submitted")
            err = self._fault(path, off + done, give)
            try:
                if err:
                    raise OSError(err, os.strerror(err))
                n = os.preadv(fd, window, off + done)
            except OSError as exc:
                self._count("ops_completed")
                if exc.errno in (_errno.EAGAIN, _errno.EINTR):
                    self._count("retries")
                    continue
                raise
            self._count("ops_completed")
            if n == 0:
                raise _EndOfFile()
            self._count("bytes_read", n)
            done += n
            if done < need and n < want:
                self._count("short_reads")
                if direct and done % DIRECT_ALIGN:
                    raise _EndOfFile()

    def _read_rows(self, L: _PyLayout, expert: int, row: int) -> None:
        spec, rec = L.spec, expert * L.spec.stride
        groups: list[tuple[int, list[memoryview]]] = []
        end = -1
        for seg in sorted(spec.segments, key=lambda s: s.offset):
            off = rec + seg.offset
            gap = off - end
            if groups and 0 < gap <= JUNK_BYTES:
                groups[-1][1].append(memoryview(self._junk)[:gap])
            elif not groups or gap > 0:
                groups.append((off, []))
            groups[-1][1].append(L.pools.row_view(seg.key, row))
            end = off + seg.nbytes
        for off, bufs in groups:
            self._read_range(L.fd, str(spec.path), off, bufs, sum(b.nbytes for b in bufs), False)
        self._verify(L, expert, row)

    def _verify(self, L: _PyLayout, expert: int, row: int) -> None:
        """Worker thread: the row's segments, in table order, must match the record's checksum."""
        spec = L.spec
        if not self.options.verify or spec.checksum is None or spec.checksums is None:
            return
        from . import _native

        got = 0
        for seg in spec.segments:
            got = _native.checksum(spec.checksum, L.pools.row_view(seg.key, row), got)
        if got != spec.checksums[expert]:
            raise _Mismatch(spec.checksums[expert], got)

    def take_mismatch(self, token: int) -> tuple[int, int] | None:
        return self._mismatches.pop(token, None)

    def _read_staged(self, L: _PyLayout, expert: int, row: int) -> None:
        spec, rec = L.spec, expert * L.spec.stride
        first = min(s.offset for s in spec.segments)
        last = max(s.end for s in spec.segments)
        a = (rec + first) // DIRECT_ALIGN * DIRECT_ALIGN
        need_end = rec + last
        b = -(-need_end // DIRECT_ALIGN) * DIRECT_ALIGN
        # Page aligned, as O_DIRECT wants. Not closed explicitly: an exception's traceback may still
        # hold slices of it; dropping the last reference unmaps it.
        staging = mmap.mmap(-1, b - a)
        self._count("staging_acquired")
        try:
            view = memoryview(staging)
            self._read_range(L.fd_direct, str(spec.path), a, [view], need_end - a, True)
            for seg in spec.segments:
                s = rec + seg.offset - a
                L.pools.row_view(seg.key, row)[:] = view[s : s + seg.nbytes]
        finally:
            self._count("staging_released")
        self._verify(L, expert, row)

    def set_faults(self, path: str = "", lo: int = 0, hi: int = 0, err: int = 0, max_read_bytes: int = 0,
                   transient_every: int = 0, transient_err: int = 0) -> None:
        if transient_every == 1:
            raise ValueError("transient_every: 1 would fail every retry too; expected 0 or >= 2")
        if transient_every and transient_err not in (_errno.EAGAIN, _errno.EINTR):
            raise ValueError(f"transient_err: expected EAGAIN or EINTR, got {transient_err}")
        on = bool(err or max_read_bytes or transient_every)
        self._faults = dict(path=path, lo=lo, hi=hi, err=err, max_read_bytes=max_read_bytes,
                            transient_every=transient_every, transient_err=transient_err) if on else {}

    def counters(self) -> dict[str, int]:
        with self._lock:
            c = dict(self._c)
        c["in_flight"] = c["fills_submitted"] - c["fills_completed"]
        return c

    async def aclose(self) -> None:
        with self._lock:
            self._closed = True
            layouts, self._layouts = self._layouts, []
        for L in layouts:
            os.close(L.fd)
            if L.fd_direct >= 0:
                os.close(L.fd_direct)


def reader_start_failure(name: str, exc: BaseException) -> str:
    """What to say where the ``name`` reader cannot start: the native reason and the way on."""
    text = " ".join(str(exc).split())
    why = f"the {name} reader cannot start: {text}"
    if "Too many open files" in text:
        import resource

        why += f" (this process may open {resource.getrlimit(resource.RLIMIT_NOFILE)[0]} files: raise ulimit -n)"
    elif "Cannot allocate memory" in text and name == "io_uring":
        import resource

        locked = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
        shown = "unlimited" if locked == resource.RLIM_INFINITY else f"{locked >> 10} KiB"
        why += f" (the locked memory limit, ulimit -l, is {shown}: older kernels charge io_uring rings to it)"
    if name == "io_uring":
        why += "; the threads reader (--reader threads, reader='threads') reads without io_uring"
    return why


def _open_blob(path: str, flags: int, how: str) -> int:
    """Open a blob for reading without blocking on what the path is (see native open_blob):
    O_NONBLOCK so a FIFO does not wait for a writer, anything but a regular file refused, then
    O_NONBLOCK cleared. Raises OSError with errno and filename set. Blocking if the filesystem
    blocks (a stale mount): call it from a worker thread."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | os.O_NONBLOCK | flags)
    except OSError as exc:
        why = f"cannot open{how}: {exc.strerror} (errno {exc.errno})"
        if exc.errno == _errno.EINVAL and flags:
            why += " (the filesystem refuses direct I/O; read it buffered)"
        raise OSError(exc.errno, why, path) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(_errno.EINVAL, "not a regular file (a FIFO, device or directory cannot be a blob)", path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def make_reader(name: str, options: ReaderOptions) -> ReaderBackend:
    """Build the backend ``name`` (already chosen by :func:`choose_reader`)."""
    if name in ("io_uring", "threads"):
        return NativeReader(name, options)
    if name == "aiofiles":
        return AiofilesReader(options)
    raise ValueError(f"reader: expected one of {list(READERS)}, got {name!r}")
