"""HTTP plumbing of a generating request: reading the body, watching for the client leaving,
server-sent events.

Every generating request watches the ASGI receive channel for ``http.disconnect`` next to the
work and cancels the work the moment the client goes away (:func:`run_unless_disconnected`);
a streaming answer is an :class:`EventStream`, which does the same around its producer.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.types import Receive, Scope, Send

from ..errors import AsyncsideError
from .protocol import RequestError

DISCONNECTED_STATUS = 499  # nginx's "client closed request": the request ended because the client left


class ClientGone(AsyncsideError):
    """The client disconnected before the answer was complete."""


async def read_json(request: Request, limit: int) -> Any:
    """The request body decoded as JSON; RequestError (400/413) for a body that is not acceptable,
    ClientGone when the client leaves while sending it."""
    # The operator's knob is named: the client cannot raise the limit, but can tell who can.
    raising = "the server's --max-request-bytes sets it"
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise RequestError(f"request body is {length} bytes; the limit is {limit} ({raising})", status=413)
    chunks, size = [], 0
    try:
        async for piece in request.stream():
            size += len(piece)
            if size > limit:
                raise RequestError(f"request body exceeds the limit of {limit} bytes ({raising})", status=413)
            chunks.append(piece)
    except ClientDisconnect:
        raise ClientGone() from None
    raw = b"".join(chunks)
    if not raw:
        raise RequestError("request body is empty; expected a JSON object")
    try:
        return json.loads(raw)
    except RecursionError:
        raise RequestError("request body is not acceptable JSON: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        # JSONDecodeError, and integers past Python's digit limit (int_max_str_digits)
        raise RequestError(f"request body is not acceptable JSON: {exc}") from None


async def watch_disconnect(receive: Receive, on_disconnect: Callable[[], None]) -> None:
    """Return when the client disconnects (after calling ``on_disconnect``)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


async def run_unless_disconnected(receive: Receive, work: Callable[[], Awaitable[None]]) -> bool:
    """Run ``work()`` while watching for the client leaving; True if it left (``work`` was cancelled)."""
    gone = False
    async with anyio.create_task_group() as tg:

        def left() -> None:
            nonlocal gone
            gone = True
            tg.cancel_scope.cancel()

        tg.start_soon(watch_disconnect, receive, left)
        await work()
        tg.cancel_scope.cancel()  # stop watching
    return gone


def sse(payload: Mapping[str, Any] | str) -> bytes:
    """One server-sent event carrying a JSON payload (or a literal such as ``[DONE]``)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class Frame:
    """What a producer writes its server-sent events with: ``await frame(payload)`` sends one."""

    def __init__(self, write: Callable[[bytes], Awaitable[None]]) -> None:
        self._write = write
        #: the status the stream reports even if the client leaves from here on (None: not settled)
        self.settled: int | None = None

    async def __call__(self, payload: Mapping[str, Any] | str) -> None:
        await self._write(sse(payload))

    async def error(self, status: int, body: Mapping[str, Any]) -> int:
        """Send an error in-band and ``[DONE]``; returns ``status`` for the producer to return.

        The status is settled before the error is sent: a client that has the error may close
        the connection before ``[DONE]`` (the OpenAI client does), and that request still failed
        with ``status``, not because the client left.
        """
        self.settled = status
        await self(body)
        await self("[DONE]")
        return status


class EventStream:
    """An ASGI response streaming server-sent events from ``produce(frame)``; cancels the producer
    when the client leaves and then reports ``finish(DISCONNECTED_STATUS)``, unless the producer
    had already settled the status by sending an error (:meth:`Frame.error`).

    ``produce`` returns the status to report (200, or the status of an error it sent in-band);
    ``finish`` is called exactly once.
    """

    def __init__(self, produce: Callable[[Frame], Awaitable[int]], finish: Callable[[int], None], *,
                 heartbeat: float | None = None) -> None:
        self.produce = produce
        self.finish = finish
        #: seconds without an event after which an SSE comment is sent (None: never)
        self.heartbeat = heartbeat
        self._finished = False

    def _done(self, scope: Scope, status: int) -> None:
        if not self._finished:
            self._finished = True
            scope.setdefault("state", {})["asyncside_status"] = status
            self.finish(status)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream; charset=utf-8"),
                        (b"cache-control", b"no-cache"),
                        (b"x-accel-buffering", b"no"),
                    ],
                }
            )

            sending = anyio.Lock()
            last = anyio.current_time()

            async def write(body: bytes) -> None:
                nonlocal last
                async with sending:
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                    last = anyio.current_time()

            frame = Frame(write)

            async def beat(every: float) -> None:
                # A proxy's read timeout ends a stream that sends nothing for a while (a long queue,
                # a long prompt's prefill): a comment, which SSE clients skip, keeps it open.
                while True:
                    await anyio.sleep(max(0.0, last + every - anyio.current_time()))
                    if anyio.current_time() - last >= every:
                        await write(b": keep-alive\n\n")

            status = 200

            async def work() -> None:
                nonlocal status
                try:
                    async with anyio.create_task_group() as beats:
                        if self.heartbeat is not None:
                            beats.start_soon(beat, self.heartbeat)
                        status = await self.produce(frame)
                        beats.cancel_scope.cancel()
                except* OSError:  # the transport broke under a send
                    raise ClientGone() from None

            try:
                gone = await run_unless_disconnected(receive, work)
            except* ClientGone:
                gone = True
            if gone:
                self._done(scope, DISCONNECTED_STATUS if frame.settled is None else frame.settled)
                return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            self._done(scope, status)
        finally:
            self._done(scope, DISCONNECTED_STATUS)  # no-op unless the stream ended before finishing
