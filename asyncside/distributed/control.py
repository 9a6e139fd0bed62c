"""The control plane of one rank: its two control links, heartbeats, and the watchdog.

MLX's transfers cannot be interrupted: a pending ``recv`` from a rank that died never completes
(its socket thread keeps polling), and a lone rank waits forever. So every rank watches its ring
neighbours on the control links it opened when the group formed (:func:`.group.rendezvous`):

- a link that reaches end-of-file before its peer said goodbye means the peer process is gone
  (the kernel closes a dead process's sockets at once, even after SIGKILL);
- a link silent for ``peer_timeout_s`` (heartbeats go out every ``heartbeat_s``) means the peer
  hung or its host became unreachable; the silence is counted only once the peer's control
  plane has spoken, so a slow start is not a death (``start_timeout_s`` bounds the start).
  Heartbeats come from the event loop and, whenever the loop has sent nothing for a heartbeat
  period, from a small thread of the control plane's own: on a GPU, MLX compiles a kernel on first
  use on the thread that schedules it, which holds a rank's loop for seconds while the process is
  well. The thread needs the GIL, which MLX's scheduling releases, so
  a process stopped, or stuck in Python, still falls silent;
- an ABORT frame carries another rank's failure (and its origin) along the ring, so ranks that
  are not neighbours of the failed one learn of it too.

Any of these raises :class:`PeerLostError` naming the rank, which cancels the rank's pipeline.
The links also carry the boundary's message frames (to the next rank only, in order); the reader
of the link from the previous rank hands them to the boundary (:attr:`ControlPlane.on_headers`),
all the frames of one read at once, and then lets the tasks they woke run before it reads again
(a decode step's next move is theirs; re-arming the read can wait).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel

from .errors import PeerLostError, PeerTimeoutError, ProtocolError
from .group import ABORT, BYE, FRAME, HEADER, HEARTBEAT, MAX_FRAME, DistGroup


@dataclass(eq=False)
class _Link:
    """One control link: a non-blocking TCP socket. Frames go out whole and in order."""

    name: str
    peer: int
    sock: socket.socket
    last: float = 0.0          # when a frame last arrived
    heard: bool = False        # the peer's control plane has spoken at least once
    bye: bool = False          # the peer said goodbye: its end-of-file is expected
    closed: bool = False       # we closed it
    said_bye: anyio.Event = field(default_factory=anyio.Event)
    #: time.monotonic() of the last write to the socket (the heartbeat thread's clock)
    sent_at: float = field(default_factory=time.monotonic)
    _pending: bytearray = field(default_factory=bytearray)
    _drain: anyio.Lock = field(default_factory=anyio.Lock)
    #: held around every write and every change of _pending: the loop and the heartbeat thread
    #: both write, and a frame must never be cut by another
    _write: threading.Lock = field(default_factory=threading.Lock)

    def _send_now(self, frame: bytes | bytearray) -> int:
        """Write what the socket takes now (the caller holds ``_write``); bytes written."""
        n = self.sock.send(frame)
        if n:
            self.sent_at = time.monotonic()
        return n

    async def send(self, kind: int, body: bytes = b"") -> None:
        """Send one frame. Written at once when the socket takes it (the usual case: no await);
        otherwise queued behind what is pending and drained as the socket allows."""
        frame = FRAME.pack(len(body), kind) + body
        with self._write:
            if not self._pending:
                try:
                    n = self._send_now(frame)
                except BlockingIOError:
                    n = 0
                if n == len(frame):
                    return
                frame = frame[n:]
            self._pending += frame
        await self.drain()

    def try_send(self, frame: bytes) -> bool:
        """Send ``frame`` now if nothing is pending and the socket takes all of it; else leave it."""
        with self._write:
            if self._pending:
                return False
            try:
                n = self._send_now(frame)
            except (BlockingIOError, OSError):
                return False  # the async path sends it (and meets the error, if any)
            if n < len(frame):
                self._pending += frame[n:]  # the rest goes out with the next async send or drain
            return True

    def beat_from_thread(self, frame: bytes) -> bool:
        """The heartbeat thread's write: ``frame`` now, only between whole frames; True if sent.

        A part the socket does not take is left pending, for the loop's next send or drain."""
        with self._write:
            if self.closed or self._pending:
                return False
            try:
                n = self._send_now(frame)
            except OSError:
                return False  # (the loop meets the error on its next send)
            if n < len(frame):
                self._pending += frame[n:]
            return True

    async def drain(self) -> None:
        """Send whatever is pending."""
        async with self._drain:
            while self._pending:
                await anyio.wait_writable(self.sock)
                with self._write:
                    try:
                        n = self._send_now(self._pending)
                    except BlockingIOError:
                        continue
                    del self._pending[:n]

    async def receive(self) -> bytes:
        """What has arrived (b"" at end-of-file)."""
        while True:
            try:
                return self.sock.recv(65536)
            except BlockingIOError:
                await anyio.wait_readable(self.sock)

    def has_unread(self) -> bool:
        """Bytes from the peer wait in the socket, not read yet (never blocks, consumes nothing)."""
        try:
            return bool(self.sock.recv(1, socket.MSG_PEEK))  # (the socket is non-blocking)
        except OSError:  # nothing there (EAGAIN), or the link failed: the reader will say which
            return False

    def close(self) -> None:
        if not self.closed:
            with self._write:
                self.closed = True
            anyio.notify_closing(self.sock)
            self.sock.close()


class ControlPlane:
    """Watches a rank's neighbours and carries its message headers. Run :meth:`run` in a task group."""

    def __init__(self, group: DistGroup, *, heartbeat_s: float = 0.5, peer_timeout_s: float = 4.0,
                 start_timeout_s: float = 120.0) -> None:
        if not 0 < heartbeat_s < peer_timeout_s:
            raise ValueError(f"need 0 < heartbeat_s ({heartbeat_s}) < peer_timeout_s ({peer_timeout_s})")
        self.group = group
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s
        self.start_timeout_s = start_timeout_s
        self.me = group.describe(group.rank)
        #: called, in order, with the message frames from the previous rank, those of one read
        #: together (set by the boundary); it runs in the link's reader task, so the next frames
        #: are read once it returns
        self.on_headers: Callable[[list[bytes]], Awaitable[None]] | None = None
        self._out: _Link | None = None
        self._in: _Link | None = None
        self._closing = False
        self._failed: PeerLostError | None = None
        self._started = anyio.Event()
        self._done = anyio.Event()
        self.counters = {"headers_sent": 0, "headers_received": 0, "heartbeats_sent": 0, "heartbeats_received": 0,
                         "heartbeats_from_thread": 0}

    @property
    def failed(self) -> PeerLostError | None:
        return self._failed

    @property
    def links(self) -> list[_Link]:
        return [link for link in (self._out, self._in) if link is not None]

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Read both links, send heartbeats, watch for silence; returns after :meth:`goodbye`."""
        socks = self.group.links
        now = anyio.current_time()
        for sock in (socks.to_next, socks.from_prev):
            sock.setblocking(False)
        self._out = _Link("to-next", self.group.next, socks.to_next, last=now)
        self._in = _Link("from-prev", self.group.prev, socks.from_prev, last=now)
        self._started.set()
        stop = threading.Event()
        pacer = threading.Thread(target=self._beat_while_the_loop_is_held, args=(stop,),
                                 name="asyncside-heartbeat", daemon=True)
        pacer.start()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._read, self._out)
                tg.start_soon(self._read, self._in)
                tg.start_soon(self._beat)
                tg.start_soon(self._watch, now)
                task_status.started()
        finally:
            stop.set()
            self._done.set()

    # -- headers ---------------------------------------------------------------------------------

    async def send_header(self, body: bytes) -> None:
        """One message frame to the next rank (in order; only the boundary sends them)."""
        if self._out is None:
            await self._started.wait()  # (only before the links are up: a set Event still yields)
        assert self._out is not None
        try:
            await self._out.send(HEADER, body)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            await self._lost(self._gone(self._out))
        self.counters["headers_sent"] += 1

    def try_send_header(self, body: bytes) -> bool:
        """Send a message frame now, without waiting, if the link is idle and takes it (else False)."""
        if self._out is None or not self._out.try_send(FRAME.pack(len(body), HEADER) + body):
            return False
        self.counters["headers_sent"] += 1
        return True

    @property
    def send_pending(self) -> bool:
        """Part of a frame to the next rank waits for :meth:`drain`."""
        return self._out is not None and bool(self._out._pending)

    async def drain(self) -> None:
        """Send what :meth:`try_send_header` left pending."""
        if self._out is not None:
            try:
                await self._out.drain()
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                await self._lost(self._gone(self._out))

    # -- failure -----------------------------------------------------------------------------------

    def _gone(self, link: _Link) -> PeerLostError:
        return PeerLostError(f"{self.me}: {self.group.describe(link.peer)} closed its control link without a "
                             "goodbye: its process exited or was killed", origin=link.peer)

    async def _notify(self, origin: int, reason: str, *, skip: _Link | None = None) -> None:
        """Best effort: tell the other links' peers (they may be gone too)."""
        body = json.dumps({"origin": origin, "reason": reason, "by": self.group.rank}).encode()
        with anyio.move_on_after(1.0, shield=True):
            for link in self.links:
                if link is skip or link.closed:
                    continue
                try:
                    await link.send(ABORT, body)
                except Exception:  # a dead peer's link: nothing more to tell it
                    pass

    async def _lost(self, err: PeerLostError, *, skip: _Link | None = None) -> None:
        """Record the first failure, pass it along the ring, raise it."""
        if self._failed is None:
            self._failed = err
            await self._notify(err.origin if err.origin is not None else self.group.rank, str(err), skip=skip)
        raise self._failed

    async def abort(self, reason: str) -> None:
        """This rank failed: tell both neighbours (they stop with an error naming this rank)."""
        if self._failed is None:
            self._failed = PeerLostError(f"{self.me} failed: {reason}", origin=self.group.rank)
            await self._notify(self.group.rank, f"{self.me} failed: {reason}")

    # -- tasks -------------------------------------------------------------------------------------

    async def _read(self, link: _Link) -> None:
        buf = bytearray()
        while True:
            try:
                chunk = await link.receive()
            except anyio.ClosedResourceError:
                return  # we closed it (goodbye)
            except OSError:
                if link.closed:
                    return
                chunk = b""
            if not chunk:
                if link.bye or link.closed:
                    return
                await self._lost(self._gone(link), skip=link)
            link.last = anyio.current_time()
            link.heard = True
            buf += chunk
            headers: list[bytes] = []  # message frames, handed over together (in order with the others)
            while len(buf) >= FRAME.size:
                length, kind = FRAME.unpack_from(buf)
                if length > MAX_FRAME:
                    await self._lost(PeerLostError(f"{self.me}: {self.group.describe(link.peer)} sent a control "
                                                   f"frame of {length} bytes: the link is corrupt", origin=link.peer))
                if len(buf) < FRAME.size + length:
                    break
                body = bytes(buf[FRAME.size:FRAME.size + length])
                del buf[:FRAME.size + length]
                if kind == HEADER:
                    headers.append(body)
                    continue
                if headers:
                    await self._headers(link, headers)
                    headers = []
                await self._frame(link, kind, body)
            if headers:
                await self._headers(link, headers)
                # The tasks these messages woke (the stage's work, a request's driver) run first:
                # re-arming this read is not on a decode step's path.
                await anyio.lowlevel.checkpoint()

    async def _headers(self, link: _Link, bodies: list[bytes]) -> None:
        if link is not self._in:
            raise ProtocolError(f"{self.me}: a message header arrived on the link to the next rank")
        if self.on_headers is None:
            raise ProtocolError(f"{self.me}: a message arrived before the boundary was ready")
        self.counters["headers_received"] += len(bodies)
        await self.on_headers(bodies)

    async def _frame(self, link: _Link, kind: int, body: bytes) -> None:
        if kind == HEARTBEAT:
            self.counters["heartbeats_received"] += 1
        elif kind == BYE:
            link.bye = True
            link.said_bye.set()
        elif kind == ABORT:
            try:
                data: dict[str, Any] = json.loads(body.decode("utf-8"))
                origin, reason, by = int(data["origin"]), str(data["reason"]), int(data["by"])
            except (ValueError, KeyError, TypeError, UnicodeDecodeError):
                origin, reason, by = link.peer, body.decode("utf-8", "replace"), link.peer
            via = "" if by == origin else f" (relayed by {self.group.describe(by)})"
            await self._lost(PeerLostError(f"{self.me}: stopping because {reason}{via}", origin=origin), skip=link)
        else:
            raise ProtocolError(f"{self.me}: unknown control frame type {kind} from {self.group.describe(link.peer)}")

    async def _beat(self) -> None:
        while not self._closing:
            for link in self.links:
                if link.closed or self._closing:
                    continue
                try:
                    await link.send(HEARTBEAT)
                    self.counters["heartbeats_sent"] += 1
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    if not (link.bye or link.closed):
                        await self._lost(self._gone(link), skip=link)
            await anyio.sleep(self.heartbeat_s)

    def _beat_while_the_loop_is_held(self, stop: threading.Event) -> None:
        """Heartbeat thread: a heartbeat on each link the loop has not written to for 1.5 periods
        (the loop's own beat comes every period; the half period spare keeps the two from doubling).

        Never touches the event loop or anything but the links' sockets (under their write lock)."""
        frame = FRAME.pack(0, HEARTBEAT)
        while not stop.wait(self.heartbeat_s / 2):
            if self._closing:
                return
            now = time.monotonic()
            for link in self.links:
                if now - link.sent_at >= 1.5 * self.heartbeat_s and link.beat_from_thread(frame):
                    self.counters["heartbeats_from_thread"] += 1

    async def _watch(self, started: float) -> None:
        while not self._closing:
            await anyio.sleep(self.heartbeat_s / 2)
            now = anyio.current_time()
            for link in self.links:
                if link.bye or link.closed or self._closing:
                    continue
                if not link.heard:
                    if now - started > self.start_timeout_s:
                        err = PeerTimeoutError(f"{self.me}: {self.group.describe(link.peer)} did not start its "
                                               f"pipeline within {self.start_timeout_s:g} s", link.peer)
                        await self._notify(link.peer, str(err))
                        raise err
                elif self._silent(link, now):
                    await self._lost(PeerLostError(
                        f"{self.me}: no word from {self.group.describe(link.peer)} for {now - link.last:.1f} s "
                        "(heartbeats stopped): it hung or its host is unreachable", origin=link.peer))

    def _silent(self, link: _Link, now: float) -> bool:
        """Whether ``link``'s peer has said nothing for longer than the peer timeout, as of ``now``."""
        if now - link.last <= self.peer_timeout_s:
            return False
        if link.has_unread():
            # The peer spoke: this rank's own loop was held up (a first-use GPU kernel compiles on
            # the thread that schedules it, for seconds), and the watchdog woke before the reader
            # took the frames. The peer's silence is counted only while nothing waits unread.
            link.last = now
            return False
        return True

    # -- clean end ---------------------------------------------------------------------------------

    # A timeout argument, not a caller's cancel scope: it bounds only the wait for the neighbours' goodbyes,
    # never the sends or the closing after it.
    async def goodbye(self, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Say goodbye on both links, wait (up to ``timeout``) for the neighbours' own, then close them."""
        await self._started.wait()
        self._closing = True
        for link in self.links:
            try:
                await link.send(BYE)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                pass
        with anyio.move_on_after(self.peer_timeout_s if timeout is None else timeout):
            for link in self.links:
                await link.said_bye.wait()
        for link in self.links:
            link.close()
