"""The boundary between two stages: framed messages, tensors over MLX's distributed engine.

A message is a small fixed header (sequence number, kind, request id, layer, flags, dtype and
shape) and an optional tensor payload (a hidden state, predicted expert ids, a token). Payloads
travel with ``mx.distributed.send``/``recv`` on streams of the boundary's own (one for sends,
one for receives, on the backend's device), each receive awaited through the completion bridge,
so the event loop never blocks and the model's stream is never held by a transfer.

The header travels on the control link to the next rank (:mod:`.control`); the receiver posts
its ``recv`` only once a header has told it a payload is coming and of what shape. Two reasons:
a pending MLX ``recv`` busy-polls a core for as long as it waits (a rank waiting for its next
message would burn the core its own compute needs), and two receives scheduled together can
complete swapped. So per direction exactly one receive is in flight: the receiver posts one
``recv`` at a time, in header order, and sequence numbers check the order. Sends need no such
wait: they are queued on the one send stream, which runs them one after the other, so their
bytes leave in posting order; the sender awaits their completion (through the bridge) only when
more than :data:`MAX_QUEUED_SENDS` are queued, and in :meth:`Boundary.flush`.

The path of one decode step is kept short (BENCHMARKS.md, "Pipeline stages over MLX's ring",
has the breakdown that motivated each point):

- :meth:`Boundary.post` sends a hidden state's header and queues its transfer right away, on the
  caller's turn, when nothing is queued before it (no hop through the sender task). The header
  goes first and the transfer right behind it (a few microseconds later, on the send stream), so
  the receiver wakes while this rank's transport threads write the bytes, instead of after;
  its ``recv`` then waits for an announced transfer already under way.
- The receiver takes every frame of one read at once (:meth:`Boundary._on_frames`) and posts the
  ``recv`` of the first hidden state among them before it routes the small messages in front of
  it (a prediction arrives just ahead of its hidden state), so the transfer runs while it does.
- The control link's reader lets the tasks a delivery woke run before it waits for the next
  read (:mod:`.control`).

The small payloads (a token, a few predicted expert ids, an error message: at most
:data:`INLINE_BYTES`) ride inside the header's frame: an MLX transfer of a few bytes costs a
round trip through two MLX threads and a completion signal on each side, and the frame is going
anyway. With NCCL this also keeps the transport one-way between two ranks (hidden states forward
only): NCCL point-to-point operations in both directions at once, from two streams of one
communicator, are not something NCCL promises to order. (Over NCCL a hidden state's transfer is
still queued by the sender task, before its header: its payload lives on the GPU.)
"""

from __future__ import annotations

import math
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import mlx.core as mx
import numpy as np
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .. import _native
from ..bridge import completed, schedule
from .control import ControlPlane
from .errors import ProtocolError
from .group import DistGroup

# Message kinds.
HIDDEN = 1    # hidden state into the next stage (flags: LOGITS)
PRED = 2      # predicted expert ids of the next stage's first MoE layer (layer = that layer)
TOKEN = 3     # the sampled token, last stage -> rank 0
END = 4       # a request is over: free its state
ERROR = 5     # a request failed on some stage (payload: the message, utf-8)
SHUTDOWN = 6  # no more requests: each rank passes it on after its earlier messages
PING = 7      # boundary benchmark: a hidden-state-sized payload round the ring
PONG = 8      # boundary benchmark: the last rank's token-sized answer to a PING
RAW = 9       # boundary benchmark: the next ``step`` exchanges are bare transfers (payload: their shape)
KIND_NAMES = {HIDDEN: "hidden", PRED: "pred", TOKEN: "token", END: "end", ERROR: "error", SHUTDOWN: "shutdown",
              PING: "ping", PONG: "pong", RAW: "raw"}

#: flag of a HIDDEN message: the last stage computes the logits and sends the token back
LOGITS = 1

MAGIC = b"ASP2"
#: magic kind dtype ndim flags where seq req layer step shape[4]
HEADER = struct.Struct("!4sBBBBBQQiI4I")
MAX_NDIM = 4
MAX_PAYLOAD_BYTES = 1 << 31
#: payloads up to this size (host memory only, not hidden states) travel inside the header's frame
INLINE_BYTES = 4096
#: transfers queued on the send stream before the sender waits for the oldest to complete
MAX_QUEUED_SENDS = 4
#: MLX's CPU task groups in flight below which a transfer is queued on the caller's turn: MLX's
#: eval throttle makes ``async_eval`` wait above 10, and a header must not go out before its
#: transfer can be queued (the receiver would poll for it)
EVAL_ROOM = 8
#: kinds whose payload is a hidden state: always over the transport
HIDDEN_KINDS = frozenset({HIDDEN, PING})
DTYPES: tuple[mx.Dtype, ...] = (mx.bool_, mx.uint8, mx.uint16, mx.uint32, mx.uint64, mx.int8, mx.int16, mx.int32,
                                mx.int64, mx.float16, mx.bfloat16, mx.float32)
_CODE = {d: i for i, d in enumerate(DTYPES)}
#: numpy dtype holding each MLX dtype's bytes (bfloat16 has none: raw uint16, viewed back)
_NUMPY = ("bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64", "float16", "uint16",
          "float32")
NO_PAYLOAD = 255
# where the payload travels
NONE, TRANSPORT, INLINE = 0, 1, 2


@dataclass(eq=False)
class Message:
    """One boundary message. ``payload`` is an mx.array (computed once received) or None."""

    kind: int
    req: int = 0
    payload: mx.array | None = None
    flags: int = 0
    layer: int = -1
    step: int = 0
    seq: int = 0

    def describe(self) -> str:
        shape = None if self.payload is None else tuple(self.payload.shape)
        name = KIND_NAMES.get(self.kind, self.kind)
        return f"{name}(req={self.req}, step={self.step}, seq={self.seq}, shape={shape})"


def encode_header(msg: Message, where: int | None = None) -> bytes:
    """The header of ``msg`` (its seq already assigned); ``where`` the payload travels (default: the transport)."""
    p = msg.payload
    shape: tuple[int, ...]
    if p is None:
        code, shape, where = NO_PAYLOAD, (), NONE
    else:
        if p.dtype not in _CODE:
            raise ValueError(f"cannot send a payload of dtype {p.dtype}; supported: {list(DTYPES)}")
        if p.ndim > MAX_NDIM:
            raise ValueError(f"cannot send a payload of {p.ndim} dimensions (at most {MAX_NDIM})")
        code, shape = _CODE[p.dtype], tuple(p.shape)
        where = TRANSPORT if where is None else where
    dims = list(shape) + [0] * (MAX_NDIM - len(shape))
    return HEADER.pack(MAGIC, msg.kind, code, len(shape), msg.flags, where, msg.seq, msg.req, msg.layer, msg.step,
                       *dims)


def decode_header(data: bytes) -> tuple[Message, mx.Dtype | None, tuple[int, ...], int]:
    """(message without payload, payload dtype or None, payload shape, where it travels).

    ``data`` is a whole frame: the header, then an inline payload's bytes. ProtocolError if malformed.
    """
    if len(data) < HEADER.size:
        raise ProtocolError(f"a message frame of {len(data)} bytes (a header is {HEADER.size})")
    magic, kind, code, ndim, flags, where, seq, req, layer, step, *dims = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ProtocolError(f"a message header with magic {magic!r} (expected {MAGIC!r})")
    if kind not in KIND_NAMES:
        raise ProtocolError(f"a message of unknown kind {kind}")
    msg = Message(kind, req, None, flags, layer, step, seq)
    extra = len(data) - HEADER.size
    if code == NO_PAYLOAD:
        if where != NONE or extra:
            raise ProtocolError(f"a message without payload that carries {extra} bytes (where={where})")
        if kind == HIDDEN:
            # The next stage runs its layers on it: an assert there (gone under python -O) was all
            # that stood between a hidden message without one and the layers run on None.
            raise ProtocolError(f"a hidden message without its payload (req={req}, step={step}, seq={seq}): "
                                "it carries the hidden state to the next stage")
        return msg, None, (), NONE
    if code >= len(DTYPES) or ndim > MAX_NDIM or where not in (TRANSPORT, INLINE):
        raise ProtocolError(f"a message header with dtype code {code}, {ndim} dimensions, where={where}")
    dtype = DTYPES[code]
    shape = tuple(dims[:ndim])
    nbytes = math.prod(shape) * dtype.size
    if nbytes > MAX_PAYLOAD_BYTES:
        raise ProtocolError(f"a payload of shape {shape} {dtype} exceeds {MAX_PAYLOAD_BYTES} bytes")
    if (where == INLINE and extra != nbytes) or (where == TRANSPORT and extra):
        kind_of = "an inline" if where == INLINE else "a transport"
        raise ProtocolError(f"a frame with {extra} payload bytes for {kind_of} "
                            f"payload of shape {shape} {dtype} ({nbytes} bytes)")
    return msg, dtype, shape, where


def _host_view(x: mx.array) -> memoryview:
    """The bytes of an array in host memory, as they lie (no copy)."""
    return memoryview(x)  # type: ignore[arg-type]  # mx.array has the buffer protocol; its stubs lack __buffer__


def _inline_array(data: bytes, dtype: mx.Dtype, shape: tuple[int, ...]) -> mx.array:
    arr = mx.array(np.frombuffer(data, dtype=_NUMPY[_CODE[dtype]]).reshape(shape))
    return arr.view(mx.bfloat16) if dtype == mx.bfloat16 else arr


class _Flush:
    """Sender marker: set once every message posted before it has been sent."""

    def __init__(self) -> None:
        self.done = anyio.Event()


class _Drain:
    """Sender marker: a frame sent without waiting left a part behind; send it."""


@dataclass(eq=False)
class _Schedule:
    """Sender marker: a transfer whose header went out could not be queued at once; queue it."""

    sent: mx.array


Deliver = Callable[[Message], Awaitable[None]]


class Boundary:
    """This rank's side of both boundaries: sends go to the next rank, receives come from the previous.

    Received messages are handed, in order, to ``deliver`` (awaited before the next is read: it
    must only route the message, never compute).
    """

    def __init__(self, group: DistGroup, control: ControlPlane, deliver: Deliver) -> None:
        self.group = group
        self.control = control
        self.deliver = deliver
        control.on_headers = self._on_frames
        device = group.device
        self._host = device == mx.Device(mx.cpu)  # payloads live in host memory (not NCCL's GPU)
        self.send_stream = mx.new_stream(device)
        self.recv_stream = mx.new_stream(device)
        self._out: MemoryObjectSendStream[Any]
        self._queue: MemoryObjectReceiveStream[Any]
        self._out, self._queue = anyio.create_memory_object_stream(math.inf)
        self._queued = 0      # messages posted and not yet taken by the sender
        self._sending = False  # the sender is in the middle of a message
        self._seq_out = 0
        self._seq_in = 0
        #: transfers queued on the send stream and not yet seen complete, oldest first
        self._unsent: list[mx.array] = []
        self.counters: dict[str, float] = {"sent": 0, "received": 0, "bytes_sent": 0, "bytes_received": 0,
                                           "inline_sent": 0, "inline_received": 0, "sent_at_once": 0,
                                           "send_s": 0.0, "recv_s": 0.0}

    # -- sending ---------------------------------------------------------------------------------------

    def _inline_bytes(self, msg: Message) -> bytes | None:
        """The payload bytes when ``msg`` can travel in its frame (b"" without payload), else None."""
        p = msg.payload
        if p is None:
            return b""
        if p.nbytes > INLINE_BYTES or msg.kind in HIDDEN_KINDS or not _native.is_available(p):
            return None
        if self._host:
            return _host_view(p).tobytes()  # C order, whatever the strides
        if p.dtype != mx.bfloat16:
            return np.array(p).tobytes()  # a GPU payload: a few bytes copied to the host
        return None

    def _frame(self, msg: Message, where: int | None, inline: bytes) -> bytes:
        self._seq_out += 1
        msg.seq = self._seq_out
        return encode_header(msg, where) + inline

    def post(self, msg: Message) -> None:
        """Send ``msg`` to the next rank; never blocks. Messages leave in posting order.

        When nothing is queued before it, a message goes out at once: a small one inside its
        frame, a hidden state as its header followed by its transfer (:meth:`_post_transfer`).
        Anything else is queued for the sender task.
        """
        if not self._queued and not self._sending:
            inline = self._inline_bytes(msg)
            if inline is not None:
                where = None if msg.payload is None else INLINE
                seq = self._seq_out
                if self.control.try_send_header(self._frame(msg, where, inline)):
                    self.counters["sent"] += 1
                    self.counters["sent_at_once"] += 1
                    self.counters["inline_sent"] += msg.payload is not None
                    self._drain_later()
                    return
                self._seq_out = seq  # not sent: the sender numbers it
            elif self._post_transfer(msg):
                return
        self._queue_for_sender(msg)

    def _queue_for_sender(self, item: Any) -> None:
        self._queued += 1
        self._out.send_nowait(item)

    def _drain_later(self) -> None:
        """A frame sent without waiting may have left a part behind: the sender sends it."""
        if self.control.send_pending:
            self._queue_for_sender(_Drain())

    def _post_transfer(self, msg: Message) -> bool:
        """Send ``msg``'s header, then queue its payload's transfer, now; False to leave it to the sender.

        Only for a payload in host memory that is computed and contiguous (what the sender task
        would otherwise wait for or copy), and while the send stream and MLX's eval throttle have
        room, so the transfer is queued right behind its header, never left for later.
        """
        payload = msg.payload
        if (payload is None or not self._host or not _native.is_available(payload)
                or not _host_view(payload).c_contiguous):
            return False
        self._forget_sent()
        if len(self._unsent) >= MAX_QUEUED_SENDS or _native.mlx_active_tasks() >= EVAL_ROOM:
            return False
        seq = self._seq_out
        if not self.control.try_send_header(self._frame(msg, TRANSPORT, b"")):
            self._seq_out = seq  # not sent: the sender numbers it
            return False
        sent = mx.distributed.send(payload, self.group.next, group=self.group.group, stream=self.send_stream)
        done, _ = _native.schedule_step([sent])
        if not done:  # the throttle engaged after all: the sender finishes queueing it, before anything else
            self._queue_for_sender(_Schedule(sent))
        self._unsent.append(sent)
        self.counters["sent"] += 1
        self.counters["sent_at_once"] += 1
        self.counters["bytes_sent"] += payload.nbytes
        self._drain_later()
        return True

    def _forget_sent(self) -> None:
        """Drop the transfers that have completed from the front of :attr:`_unsent`."""
        while self._unsent and _native.is_available(self._unsent[0]):
            self._unsent.pop(0)

    async def flush(self) -> None:
        """Return once every message posted so far has been sent (its payload handed to the transport)."""
        marker = _Flush()
        self._queued += 1
        self._out.send_nowait(marker)
        await marker.done.wait()

    async def run_sender(self) -> None:
        """Send queued messages one at a time, forever (run it in the pipeline's task group)."""
        async for msg in self._queue:
            self._queued -= 1
            self._sending = True
            try:
                await self._send(msg)
            finally:
                self._sending = False

    async def _send(self, msg: Any) -> None:
        if isinstance(msg, _Drain):
            await self.control.drain()
            return
        if isinstance(msg, _Schedule):
            await schedule(msg.sent)
            return
        if isinstance(msg, _Flush):
            await self.control.drain()
            for transfer in self._unsent:
                await completed(transfer)
            self._unsent.clear()
            msg.done.set()
            return
        t0 = time.perf_counter()
        payload = msg.payload
        if payload is not None and not _native.is_available(payload):
            await completed(payload)  # the header goes out once the payload exists
        inline = self._inline_bytes(msg)
        sent: mx.array | None = None
        if inline is None:
            assert payload is not None
            if not self._host or not _host_view(payload).c_contiguous:
                # The transport sends the bytes as they lie: a strided view (a routed-ids slice)
                # is copied first, on this stream, so it never queues behind the model.
                payload = mx.contiguous(payload, stream=self.send_stream)
            # The transfer is queued before the header leaves, so its bytes are usually there by
            # the time the receiver posts its recv (which then waits, and polls, the least). Sends
            # on one stream go out in order; the receiver reads them in header order.
            sent = mx.distributed.send(payload, self.group.next, group=self.group.group, stream=self.send_stream)
            await schedule(sent)
            frame = self._frame(msg, TRANSPORT, b"")
        else:
            frame = self._frame(msg, None if payload is None else INLINE, inline)
        await self.control.send_header(frame)
        if sent is None:
            self.counters["inline_sent"] += payload is not None
        else:
            assert payload is not None
            self._unsent.append(sent)
            self.counters["bytes_sent"] += payload.nbytes
            if len(self._unsent) > MAX_QUEUED_SENDS:
                await completed(self._unsent[0])
        self._forget_sent()
        self.counters["send_s"] += time.perf_counter() - t0
        self.counters["sent"] += 1

    # -- receiving ----------------------------------------------------------------------------------

    async def _on_frames(self, frames: list[bytes]) -> None:
        """The message frames of one read from the previous rank, in order: payloads received, then delivered.

        The ``recv`` of the first transported payload among them is posted before anything is
        delivered (no receive is in flight between two calls: each returns once its last payload
        is in), so the transfer runs while the messages in front of it are routed.
        """
        decoded = []
        for frame in frames:
            msg, dtype, shape, where = decode_header(frame)
            self._seq_in += 1
            if msg.seq != self._seq_in:
                raise ProtocolError(f"{self.group.describe(self.group.rank)}: message {msg.describe()} arrived out "
                                    f"of order (expected sequence number {self._seq_in})")
            decoded.append((msg, dtype, shape, where))
        early: mx.array | None = None
        for _msg, dtype, shape, where in decoded:
            if dtype is not None and where == TRANSPORT:
                early = self._post_recv(shape, dtype)
                break
        for frame, (msg, dtype, shape, where) in zip(frames, decoded):
            if dtype is not None and where == INLINE:
                msg.payload = _inline_array(frame[HEADER.size:], dtype, shape)
                self.counters["inline_received"] += 1
            elif dtype is not None:
                t0 = time.perf_counter()
                if early is not None:
                    x, early = early, None
                else:
                    x = self._post_recv(shape, dtype)
                if not _native.is_available(x):  # usually it is: the recv ran as it was posted
                    await completed(x)
                msg.payload = x
                self.counters["bytes_received"] += x.nbytes
                self.counters["recv_s"] += time.perf_counter() - t0
            self.counters["received"] += 1
            await self.deliver(msg)

    def _post_recv(self, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
        """Post the ``recv`` of an announced payload on the receive stream (queued now if MLX's throttle has room)."""
        x = mx.distributed.recv(shape, dtype, self.group.prev, group=self.group.group, stream=self.recv_stream)
        _native.schedule_step([x])  # what does not fit now, completed() schedules
        return x
