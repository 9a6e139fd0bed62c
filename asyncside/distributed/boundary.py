"""The boundary between two stages: framed messages, tensors over MLX's distributed engine.

A message is a small fixed header (sequence number, kind, request id, layer, flags, dtype and
shape) and an optional tensor payload (a hidden state, predicted expert ids, a token). The
payload travels with ``mx.distributed.send``/``recv`` on streams of the boundary's own (one for
sends, one for receives, on the backend's device), each transfer awaited through the completion
bridge, so the event loop never blocks and the model's stream is never held by a transfer.

The header goes first, on the control link to the next rank (:mod:`.control`); the receiver
posts its ``recv`` only once the header has told it a payload is coming and of what shape. Two
reasons: a pending MLX ``recv`` busy-polls a core for as long as it waits (a rank waiting for
its next message would burn the core its own compute needs), and two receives scheduled
together can complete swapped. So per direction exactly one message is in flight: the sender
sends the next header only after the previous payload's send has completed, and the receiver
posts one ``recv`` at a time, in header order; sequence numbers check the order.
"""

from __future__ import annotations

import math
import struct
import time
from dataclasses import dataclass
from typing import Any

import anyio
import mlx.core as mx
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..bridge import completed
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
PING = 7      # boundary benchmark: echo it
KIND_NAMES = {HIDDEN: "hidden", PRED: "pred", TOKEN: "token", END: "end", ERROR: "error", SHUTDOWN: "shutdown",
              PING: "ping"}

#: flag of a HIDDEN message: the last stage computes the logits and sends the token back
LOGITS = 1

MAGIC = b"ASP1"
HEADER = struct.Struct("!4sBBBBQQiI4I")  # magic kind dtype ndim flags seq req layer step shape[4]
MAX_NDIM = 4
MAX_PAYLOAD_BYTES = 1 << 31
DTYPES: tuple[mx.Dtype, ...] = (mx.bool_, mx.uint8, mx.uint16, mx.uint32, mx.uint64, mx.int8, mx.int16, mx.int32,
                                mx.int64, mx.float16, mx.bfloat16, mx.float32)
_CODE = {d: i for i, d in enumerate(DTYPES)}
NO_PAYLOAD = 255


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
        return f"{KIND_NAMES.get(self.kind, self.kind)}(req={self.req}, step={self.step}, seq={self.seq}, shape={shape})"


def encode_header(msg: Message) -> bytes:
    """The 48-byte header of ``msg`` (its seq already assigned)."""
    p = msg.payload
    if p is None:
        code, shape = NO_PAYLOAD, ()
    else:
        if p.dtype not in _CODE:
            raise ValueError(f"cannot send a payload of dtype {p.dtype}; supported: {list(DTYPES)}")
        if p.ndim > MAX_NDIM:
            raise ValueError(f"cannot send a payload of {p.ndim} dimensions (at most {MAX_NDIM})")
        code, shape = _CODE[p.dtype], tuple(p.shape)
    dims = list(shape) + [0] * (MAX_NDIM - len(shape))
    return HEADER.pack(MAGIC, msg.kind, code, len(shape), msg.flags, msg.seq, msg.req, msg.layer, msg.step, *dims)


def decode_header(data: bytes) -> tuple[Message, mx.Dtype | None, tuple[int, ...]]:
    """(message without payload, payload dtype or None, payload shape); ProtocolError if malformed."""
    if len(data) != HEADER.size:
        raise ProtocolError(f"a message header of {len(data)} bytes (expected {HEADER.size})")
    magic, kind, code, ndim, flags, seq, req, layer, step, *dims = HEADER.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"a message header with magic {magic!r} (expected {MAGIC!r})")
    if kind not in KIND_NAMES:
        raise ProtocolError(f"a message of unknown kind {kind}")
    msg = Message(kind, req, None, flags, layer, step, seq)
    if code == NO_PAYLOAD:
        return msg, None, ()
    if code >= len(DTYPES) or ndim > MAX_NDIM:
        raise ProtocolError(f"a message header with dtype code {code} and {ndim} dimensions")
    dtype = DTYPES[code]
    shape = tuple(dims[:ndim])
    if math.prod(shape) * dtype.size > MAX_PAYLOAD_BYTES:
        raise ProtocolError(f"a payload of shape {shape} {dtype} exceeds {MAX_PAYLOAD_BYTES} bytes")
    return msg, dtype, shape


class _Flush:
    """Sender marker: set once every message posted before it has been sent."""

    def __init__(self) -> None:
        self.done = anyio.Event()


class Boundary:
    """This rank's side of both boundaries: sends go to the next rank, receives come from the previous."""

    def __init__(self, group: DistGroup, control: ControlPlane) -> None:
        self.group = group
        self.control = control
        device = group.device
        self.send_stream = mx.new_stream(device)
        self.recv_stream = mx.new_stream(device)
        self._out: MemoryObjectSendStream[Any]
        self._queue: MemoryObjectReceiveStream[Any]
        self._out, self._queue = anyio.create_memory_object_stream(math.inf)
        self._seq_out = 0
        self._seq_in = 0
        self.counters: dict[str, float] = {"sent": 0, "received": 0, "bytes_sent": 0, "bytes_received": 0,
                                           "send_s": 0.0, "recv_s": 0.0}

    def post(self, msg: Message) -> None:
        """Queue ``msg`` for the next rank; never blocks. Messages leave in posting order."""
        self._out.send_nowait(msg)

    async def flush(self) -> None:
        """Return once every message posted so far has been sent (its payload handed to the transport)."""
        marker = _Flush()
        self._out.send_nowait(marker)
        await marker.done.wait()

    async def run_sender(self) -> None:
        """Send posted messages one at a time, forever (run it in the pipeline's task group)."""
        async for msg in self._queue:
            if isinstance(msg, _Flush):
                msg.done.set()
                continue
            payload = msg.payload
            if payload is not None:
                # The transport sends the bytes as they lie: make them contiguous (a routed-ids
                # slice is a strided view), on this stream so it never queues behind the model.
                payload = mx.contiguous(payload, stream=self.send_stream)
                await completed(payload)
                msg.payload = payload
            self._seq_out += 1
            msg.seq = self._seq_out
            t0 = time.perf_counter()
            await self.control.send_header(encode_header(msg))
            if payload is not None:
                sent = mx.distributed.send(payload, self.group.next, group=self.group.group, stream=self.send_stream)
                await completed(sent)
                self.counters["bytes_sent"] += payload.nbytes
            self.counters["send_s"] += time.perf_counter() - t0
            self.counters["sent"] += 1

    async def receive(self) -> Message:
        """The next message from the previous rank, its payload computed. One caller at a time."""
        msg, dtype, shape = decode_header(await self.control.recv_header())
        self._seq_in += 1
        if msg.seq != self._seq_in:
            raise ProtocolError(f"{self.group.describe(self.group.rank)}: message {msg.describe()} arrived out of "
                                f"order (expected sequence number {self._seq_in})")
        t0 = time.perf_counter()
        if dtype is not None:
            x = mx.distributed.recv(shape, dtype, self.group.prev, group=self.group.group, stream=self.recv_stream)
            await completed(x)
            msg.payload = x
            self.counters["bytes_received"] += x.nbytes
        self.counters["recv_s"] += time.perf_counter() - t0
        self.counters["received"] += 1
        return msg
