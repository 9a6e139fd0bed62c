"""What the server knows about the health of its expert store: experts whose reads failed.

The engine hands every failure of a request to :meth:`HealthRegistry.record`; the
:class:`~asyncside.errors.FillError` s inside it (possibly wrapped in exception groups) that blame
the store -- a checksum mismatch, a short read, an I/O error -- mark their (layer, expert) bad,
under the blob's file name. ``/health`` answers 503 "degraded" while any is bad, naming file,
layer, expert and cause; ``/metrics`` counts them.

A bad expert heals without a restart: :meth:`HealthRegistry.recheck` (run every few seconds by
the server while anything is bad) first looks for blobs replaced on disk (another inode, size or
modification time than when they were opened), re-opens those (:func:`reopen_blob`), and then
reads each bad expert's record again with its checksum verified; one that verifies is cleared.
"""

from __future__ import annotations

import errno as _errno
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import FillError

log = logging.getLogger("asyncside.serving")

#: at most this many experts are named in one client message (the rest are counted)
NAMED_IN_MESSAGE = 3


def fill_errors(exc: BaseException) -> list[FillError]:
    """The FillErrors in ``exc``: itself, or inside (nested) exception groups, or its causes."""
    out: list[FillError] = []
    stack: list[BaseException] = [exc]
    seen: set[int] = set()
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, FillError):
            out.append(e)
        elif isinstance(e, BaseExceptionGroup):
            stack.extend(reversed(e.exceptions))
        elif e.__cause__ is not None:
            stack.append(e.__cause__)
    return out


def fill_cause(err: FillError) -> tuple[str, bool]:
    """What went wrong with a fill, in a few words, and whether the store's bytes are to blame
    (a row that could not be lent is the runtime's limit, not the store's fault)."""
    text = str(err)
    if err.errno == _errno.EBADMSG or (err.errno is None and "checksum" in text):
        if err.expected is not None and err.got is not None:
            return f"checksum mismatch (expected {err.expected:#010x}, got {err.got:#010x})", True
        return "checksum mismatch", True
    if err.errno == _errno.ENODATA or "ended before" in text or "end of file" in text:
        return "short read: the blob ends before the record (truncated?)", True
    if err.errno is not None and err.errno > 0:
        return f"read error: {os.strerror(err.errno)} (errno {err.errno})", True
    return text.split(": ", 1)[-1], False


def describe_failure(exc: BaseException) -> str:
    """A client-facing line for a failed generation: the layers, experts and causes of its failed
    fills when there are any, else ``Type: message`` of the error."""
    fills = fill_errors(exc)
    if not fills:
        while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
            exc = exc.exceptions[0]
        return f"{type(exc).__name__}: {exc}"
    named: dict[tuple[int, int], str] = {}
    for e in fills:
        named.setdefault((e.layer, e.expert), fill_cause(e)[0])
    shown = list(named.items())[:NAMED_IN_MESSAGE]
    parts = [f"layer {layer} expert {expert}: {cause}" for (layer, expert), cause in shown]
    more = len(named) - NAMED_IN_MESSAGE
    return "expert read failed: " + "; ".join(parts) + (f" (and {more} more experts)" if more > 0 else "")


@dataclass
class BadExpert:
    """One expert whose record could not be read back intact."""

    layer: int
    expert: int
    file: str      # the blob, relative to the store
    cause: str
    failures: int = 1
    since: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return {"file": self.file, "layer": self.layer, "expert": self.expert, "cause": self.cause,
                "failures": self.failures}

    def line(self) -> str:
        return f"{self.file}: layer {self.layer} expert {self.expert}: {self.cause}"


Identity = tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns


def identity(path: str | os.PathLike[str]) -> Identity | None:
    """What tells a file replaced on disk from the one opened: device, inode, size, mtime."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _descriptors_of(dev: int, ino: int) -> Iterator[int]:
    """This process's open descriptors on the file (dev, ino) (Linux: /proc/self/fd)."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in names:
        fd = int(name)
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (dev, ino):
            yield fd


def reopen_blob(path: str, old: Identity) -> int:
    """Point every descriptor this process holds on ``path``'s old file (``old``: its identity
    when opened) at the file now at ``path``; returns how many were re-pointed. Blocking: call it
    in a worker thread.

    Each is replaced in place (``dup2``, atomic: a read in progress finishes on the old file, the
    next reads the new one), with the same status flags (``O_DIRECT`` stays), so the readers and
    fault tables that hold them need not know. Their owner (the runtime) keeps them open while it
    runs, which is while the server can call this.
    """
    import fcntl

    moved = 0
    for fd in list(_descriptors_of(old[0], old[1])):
        try:
            flags = fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0)
            fresh = os.open(path, os.O_RDONLY | os.O_CLOEXEC | flags)
        except OSError as exc:
            log.warning("cannot re-open %s: %s", path, exc)
            continue
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) == (old[0], old[1]):  # still the old file's (not closed and reused)
                os.dup2(fresh, fd, inheritable=False)
                moved += 1
        finally:
            os.close(fresh)
    return moved


class HealthRegistry:
    """Bad experts of one store (see the module docstring).

    ``store``: the :class:`~asyncside.store.ExpertStore` (None: nothing to verify or re-open,
    failures are still recorded). ``reopen_reader(path)``: an async hook re-opening the reader's
    own handles on a replaced blob (:meth:`Runtime.reopen_blob <asyncside.Runtime.reopen_blob>`: io_uring's
    registered files are not reached by re-pointing descriptors), beside :func:`reopen_blob`.
    """

    def __init__(self, store: Any = None, reopen_reader: Callable[[str], Any] | None = None) -> None:
        self.store = store
        self.reopen_reader = reopen_reader
        self.bad: dict[tuple[int, int], BadExpert] = {}
        self.read_failures: dict[str, int] = {}  # by cause kind: checksum, short_read, io_error
        self.healed = 0
        self.reopened = 0
        self._seen: weakref.WeakSet[BaseException] = weakref.WeakSet()
        self._root = str(getattr(store, "path", "")) if store is not None else ""
        self._identities: dict[str, Identity | None] = {}
        if store is not None:
            for index in store.layers:
                path = str(store.layer(index).path)
                self._identities[path] = identity(path)

    @property
    def degraded(self) -> bool:
        return bool(self.bad)

    def _file(self, layer: int) -> str:
        if self.store is None:
            return f"layer {layer}"
        try:
            path = str(self.store.layer(layer).path)
        except Exception:
            return f"layer {layer}"
        return os.path.relpath(path, self._root) if self._root else os.path.basename(path)

    def record(self, exc: BaseException) -> list[BadExpert]:
        """Note the store faults in a request's failure (each fault once however many requests it
        failed); returns the experts it marked bad."""
        marked = []
        for err in fill_errors(exc):
            if err in self._seen:
                continue
            self._seen.add(err)
            cause, blames_store = fill_cause(err)
            if not blames_store:
                continue
            kind = "checksum" if cause.startswith("checksum") else "short_read" if cause.startswith("short") \
                else "io_error"
            self.read_failures[kind] = self.read_failures.get(kind, 0) + 1
            key = (err.layer, err.expert)
            bad = self.bad.get(key)
            if bad is None:
                bad = self.bad[key] = BadExpert(err.layer, err.expert, self._file(err.layer), cause,
                                                since=time.time())
                log.error("expert marked bad: %s", bad.line())
            else:
                bad.failures += 1
                bad.cause = cause
            marked.append(bad)
        return marked

    def problems(self) -> list[str]:
        return [b.line() for b in self.bad.values()]

    async def recheck(self) -> int:
        """Re-open replaced blobs, then verify each bad expert's record again; returns how many
        healed. Never raises for a record still bad (it stays bad, its cause updated)."""
        import anyio

        if self.store is None or not self.bad:
            return 0
        paths = {str(self.store.layer(layer).path) for layer, _ in self.bad}
        for path in sorted(paths):
            now = await anyio.to_thread.run_sync(identity, path)
            was = self._identities.get(path)
            if now is None or now == was:
                continue
            if was is not None and now[:2] != was[:2]:  # another file: re-open what reads the old one
                moved = await anyio.to_thread.run_sync(reopen_blob, path, was)
                if self.reopen_reader is not None:
                    await self.reopen_reader(path)
                self.reopened += 1
                log.warning("%s was replaced on disk: re-opened (%d descriptors)", path, moved)
            self._identities[path] = now
        verified = []
        for key, bad in list(self.bad.items()):
            try:
                await anyio.to_thread.run_sync(self._verify, bad.layer, bad.expert)
            except Exception as exc:
                bad.cause = f"still bad: {str(exc).split(': ', 1)[-1]}" if "still bad" not in bad.cause else bad.cause
                continue
            verified.append((key, bad))
        # The records were read at the path, the runtime reads the file its descriptors hold: a
        # blob replaced after the look above verified from the new file while the runtime still
        # reads the old one. Its experts heal at the next recheck, once it is re-opened.
        changed = {p for p in paths if await anyio.to_thread.run_sync(identity, p) != self._identities.get(p)}
        healed = 0
        for key, bad in verified:
            if str(self.store.layer(bad.layer).path) in changed:
                continue
            del self.bad[key]
            healed += 1
            self.healed += 1
            log.warning("expert healed: layer %d expert %d (%s verifies again)", bad.layer, bad.expert, bad.file)
        return healed

    def _verify(self, layer: int, expert: int) -> None:
        self.store.read_record(layer, expert, verify=True)
