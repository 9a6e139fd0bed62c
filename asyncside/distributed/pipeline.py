"""One rank of a pipeline: its stage's layers, streaming their experts, between two boundaries.

Rank 0 embeds the prompt and runs the first layers; each later rank runs its layers on the hidden
state it receives; the last rank computes the logits, picks the token and sends it back to rank 0
(its ring neighbour), which feeds it into the next step. Every rank streams its own experts with
its own Runtime (``source``).

Requests are pipelined: each request is its own chain of steps, and a rank works on whichever
step reaches it next, so with several requests in flight different requests occupy different
stages at once (rank 0 computes request B's step while rank 1 computes request A's). On every
rank the steps of different requests take turns on the model one at a time, in arrival order.

Prediction crosses the boundary ahead of the hidden state: a stage's last MoE layer predicts the
next stage's first MoE layer (the lookahead router of that layer), and the ids are sent before
the hidden state, so the next rank prefetches them while it is still busy (or idle).

Failure: a peer that dies or hangs stops every rank with :class:`PeerLostError` (see
:mod:`.control`); a request that fails on one stage fails alone (:class:`StageError` at rank 0,
naming the rank). Shutdown: rank 0 ends its requests, sends SHUTDOWN after them through every
stage and back, so every step in flight is drained; then all ranks meet in a barrier.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import mlx.core as mx
import numpy as np
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..bridge import completed
from ..models.predict import Predictor, check_predictor
from ..models.streaming import StreamingModel
from .boundary import END, ERROR, HIDDEN, LOGITS, PING, PONG, PRED, RAW, SHUTDOWN, TOKEN, Boundary, Message
from .control import ControlPlane
from .errors import DistributedError, ProtocolError, StageError
from .group import DistGroup
from .plan import StagePlan
from .stage_forward import embed, greedy, head, run_layers


class StageSource:
    """A stage's view of its expert source: its own layers go to ``inner``; a prefetch of the next
    stage's first MoE layer goes to ``on_forward`` (to be sent ahead); other layers are ignored."""

    def __init__(self, inner: Any | None, local: Sequence[int], forward_layer: int | None,
                 on_forward: Callable[[int, Any], None] | None) -> None:
        self.inner = inner
        self.local = frozenset(int(layer) for layer in local)
        self.forward_layer = forward_layer
        self.on_forward = on_forward
        # Row snapshots (speculative gathers) only when the inner source offers them: the
        # forward takes a None attribute as "not offered".
        speculative = inner is not None and callable(getattr(inner, "snapshot", None)) \
            and callable(getattr(inner, "unchanged", None))
        self.snapshot: Callable[[int], Any] | None = self._snapshot if speculative else None
        self.unchanged: Callable[[int, Any, Any], Any] | None = self._unchanged if speculative else None

    def _own(self, layer: int) -> Any:
        if layer not in self.local or self.inner is None:
            raise DistributedError(f"layer {layer} is not one of this stage's MoE layers {sorted(self.local)}")
        return self.inner

    def pools(self, layer: int) -> dict[str, mx.array]:
        return self._own(layer).pools(layer)

    def lookup(self, layer: int) -> mx.array:
        return self._own(layer).lookup(layer)

    async def ensure(self, layer: int, ids: Any) -> None:
        await self._own(layer).ensure(layer, ids)

    def lease(self, layer: int, experts: Any) -> int:
        return self._own(layer).lease(layer, experts)

    def release_after(self, x: mx.array, leases: list[tuple[int, int]]) -> None:
        if leases:
            self._own(leases[0][0]).release_after(x, leases)

    def _snapshot(self, layer: int) -> Any:
        return self._own(layer).snapshot(layer)

    def _unchanged(self, layer: int, snap: Any, experts: Any) -> Any:
        return self._own(layer).unchanged(layer, snap, experts)

    def prefetch(self, layer: int, ids: Any) -> object:
        if layer in self.local and self.inner is not None:
            return self.inner.prefetch(layer, ids)
        if layer == self.forward_layer and self.on_forward is not None:
            self.on_forward(layer, ids)
        return None


@dataclass(eq=False)
class _Request:
    rid: int
    cache: list[Any]
    predictor: Predictor
    source: StageSource
    step: int = 0
    # rank 0: TOKEN / ERROR messages of this request, in order
    inbox_send: MemoryObjectSendStream[Message] | None = None
    inbox: MemoryObjectReceiveStream[Message] | None = None
    logits: list[np.ndarray] = field(default_factory=list)


def _text_payload(text: str) -> mx.array:
    return mx.array(np.frombuffer(text.encode("utf-8")[:4096] or b"?", dtype=np.uint8))


def _payload_text(x: mx.array | None) -> str:
    return "" if x is None else bytes(np.array(x, dtype=np.uint8)).decode("utf-8", "replace")


class Pipeline:
    """This rank's part of a pipeline. Enter :meth:`running`; rank 0 then calls :meth:`generate`,
    the other ranks :meth:`serve` (which returns when rank 0 shuts the pipeline down).

    ``source`` is the rank's expert source over its stage's MoE layers (a Runtime; None for a
    stage without MoE layers). ``keep_logits`` keeps every logits array the last rank computes
    (per request id: tests compare them with one process).
    """

    def __init__(self, group: DistGroup, plan: StagePlan, sm: StreamingModel, source: Any | None, *,
                 predictor: str = "lookahead", keep_logits: bool = False, heartbeat_s: float = 0.5,
                 peer_timeout_s: float = 4.0, start_timeout_s: float = 120.0) -> None:
        if plan.size != group.size:
            raise DistributedError(f"the plan has {plan.size} stages for a group of {group.size} ranks")
        self.group = group
        self.plan = plan
        self.stage = plan.stage(group.rank)
        if self.stage.moe_layers and source is None:
            raise DistributedError(f"rank {group.rank} has MoE layers {list(self.stage.moe_layers)} but no "
                                   "expert source")
        self.sm = sm
        self.source = source
        self.predictor = check_predictor(predictor)
        self.keep_logits = keep_logits
        self.rank = group.rank
        self.last = plan.is_last(group.rank)
        self.me = group.describe(group.rank)
        self.control = ControlPlane(group, heartbeat_s=heartbeat_s, peer_timeout_s=peer_timeout_s,
                                    start_timeout_s=start_timeout_s)
        self.boundary = Boundary(group, self.control, self._deliver)
        self._next_moe = plan.next_moe(group.rank)
        self._requests: dict[int, _Request] = {}
        self._failed: set[int] = set()
        self._rids = itertools.count(1)
        self._tg: anyio.abc.TaskGroup | None = None
        # Steps of this rank's requests take turns on the model; taken without a trip around the
        # event loop when free (a decode step's boundary is a few loop iterations in all).
        self._turn = anyio.Lock(fast_acquire=True)
        self._inbox_send: MemoryObjectSendStream[Message]
        self._inbox: MemoryObjectReceiveStream[Message]
        self._inbox_send, self._inbox = anyio.create_memory_object_stream(math.inf)
        self._pings_send: MemoryObjectSendStream[Message]
        self._pings: MemoryObjectReceiveStream[Message]
        self._pings_send, self._pings = anyio.create_memory_object_stream(math.inf)
        self._drivers: set[anyio.CancelScope] = set()
        self._no_drivers: anyio.Event | None = None
        self._drained = anyio.Event()
        #: why the group cannot go on (a lost or silent peer), once its control plane has said so
        self.failure: DistributedError | None = None
        self.kept_logits: dict[int, list[np.ndarray]] = {}
        self.counters = {"steps": 0, "requests": 0, "request_errors": 0, "predictions_sent": 0,
                         "predictions_received": 0}

    # -- lifetime --------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Pipeline]:
        """Run the rank's control plane, boundary and stage; on a clean exit shut the pipeline down."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            await tg.start(self._control)
            tg.start_soon(self.boundary.run_sender)
            if self.rank != 0:
                tg.start_soon(self._work)
            try:
                yield self
            except BaseException as exc:
                if not isinstance(exc, (anyio.get_cancelled_exc_class(), DistributedError)):
                    # This rank is failing: its neighbours must not wait for it.
                    await self.control.abort(f"{type(exc).__name__}: {exc}")
                raise
            await self._shutdown()
            tg.cancel_scope.cancel()

    async def _control(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The control plane, whose failure is kept in :attr:`failure` before it cancels the rank's
        work: the requests it ends are failed with it, not with a shutdown that nobody asked for."""
        from .errors import PeerLostError, PeerTimeoutError

        try:
            await self.control.run(task_status=task_status)
        except BaseException as exc:
            found: list[BaseException] = [exc]  # its own task group's errors come grouped
            while found and self.failure is None:
                first = found.pop()
                if isinstance(first, (PeerLostError, PeerTimeoutError)):
                    self.failure = first
                elif isinstance(first, BaseExceptionGroup):
                    found.extend(first.exceptions)
            raise

    async def _shutdown(self) -> None:
        """Drain every step in flight (SHUTDOWN goes round after them), barrier, goodbye."""
        if self.rank == 0:
            for scope in list(self._drivers):
                scope.cancel()
            if self._drivers:
                self._no_drivers = anyio.Event()
                await self._no_drivers.wait()
            self.boundary.post(Message(SHUTDOWN))
        await self._drained.wait()
        await self.boundary.flush()
        # Every rank has passed SHUTDOWN on: nothing is in flight. Meet once more before the
        # goodbye, so no rank closes its transport while a neighbour still reads from it.
        done = mx.distributed.all_sum(mx.array(1.0), group=self.group.group, stream=self.boundary.send_stream)
        await completed(done)
        await self.control.goodbye()

    async def serve(self) -> None:
        """Ranks after 0: run until rank 0 shuts the pipeline down."""
        if self.rank == 0:
            raise DistributedError("rank 0 drives the pipeline (generate); serve() is for the other ranks")
        await self._drained.wait()

    # -- rank 0: requests ------------------------------------------------------------------------

    def _new_request(self, rid: int) -> _Request:
        def send_prediction(layer: int, ids: Any) -> None:
            arr = ids if isinstance(ids, mx.array) else mx.array(np.asarray(ids))
            self.boundary.post(Message(PRED, rid, arr.astype(mx.int32), layer=layer))
            self.counters["predictions_sent"] += 1

        src = StageSource(self.source, self.stage.moe_layers, self._next_moe, send_prediction)
        return _Request(rid, self.sm.make_cache(), self.sm.forward.make_predictor(self.predictor), src)

    async def generate(self, prompt_ids: Sequence[int], max_tokens: int, *,
                       stop_at_eos: bool = True) -> AsyncIterator[int]:
        """Greedy tokens of one request (rank 0 only), exactly one process's.

        The request runs in the pipeline's own task group, ahead of the consumer (tokens queue up
        if it reads slowly), so a consumer that waits its turn elsewhere never holds the pipeline
        back. Closing the iterator cancels the request. An EOS token ends the stream, unyielded.
        A failure on another stage raises StageError naming the rank.
        """
        if self.rank != 0:
            raise DistributedError(f"generate() runs on rank 0; this is rank {self.rank}")
        if self._tg is None:
            raise DistributedError("the pipeline is not running: use `async with pipeline.running():`")
        if self.control.failed is not None:
            raise self.control.failed
        from ..models.streaming import checked_prompt_ids  # an id past the vocabulary killed rank 0 (SIGSEGV)
        from ..serving.loading import text_config_value

        vocab = text_config_value(self.sm, "vocab_size")
        ids = checked_prompt_ids(prompt_ids, vocab if isinstance(vocab, int) else None)
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        out_send, out = anyio.create_memory_object_stream[Any](math.inf)
        scope = anyio.CancelScope()
        self._drivers.add(scope)
        self._tg.start_soon(self._drive, ids, max_tokens, stop_at_eos, out_send, scope)
        try:
            async with out:
                async for item in out:
                    if isinstance(item, BaseException):
                        raise item
                    yield item
        finally:
            scope.cancel()

    async def _drive(self, ids: list[int], max_tokens: int, stop_at_eos: bool,
                     out: MemoryObjectSendStream[Any], scope: anyio.CancelScope) -> None:
        rid = next(self._rids)
        req = self._new_request(rid)
        req.inbox_send, req.inbox = anyio.create_memory_object_stream[Message](math.inf)
        self._requests[rid] = req
        self.counters["requests"] += 1
        eos = set(getattr(self.sm.tokenizer, "eos_token_ids", ()) or ()) if stop_at_eos else set()
        try:
            with scope:
                try:
                    prompt = mx.array(ids)
                    while prompt.size > 1:
                        n = min(self.sm.prefill_step_size, prompt.size - 1)
                        await self._first_stage(req, prompt[:n], 0)
                        prompt = prompt[n:]
                    inputs = prompt
                    for _ in range(max_tokens):
                        await self._first_stage(req, inputs, LOGITS)
                        tok = await self._token(req)
                        if tok in eos:
                            break
                        out.send_nowait(tok)
                        inputs = mx.array([tok])
                except Exception as exc:  # the request fails alone; its consumer gets the error
                    self.counters["request_errors"] += 1
                    out.send_nowait(exc)
        finally:
            self._requests.pop(rid, None)
            self.boundary.post(Message(END, rid))
            if self.control.failed is not None:
                out.send_nowait(self.control.failed)  # a consumer outside the pipeline's tasks learns why
            out.close()
            self._drivers.discard(scope)
            if not self._drivers and self._no_drivers is not None:
                self._no_drivers.set()

    async def _first_stage(self, req: _Request, tokens: mx.array, flags: int) -> None:
        async with self._turn:
            h = embed(self.sm, tokens[None])
            h = await run_layers(self.sm, h, req.cache, req.source, req.predictor,
                                 start=self.stage.start, stop=self.stage.stop)
        req.step += 1
        self.counters["steps"] += 1
        self.boundary.post(Message(HIDDEN, req.rid, h, flags=flags, step=req.step))

    async def _token(self, req: _Request) -> int:
        assert req.inbox is not None
        msg = await req.inbox.receive()
        if msg.kind == ERROR:
            raise StageError(_payload_text(msg.payload))
        tok = None if msg.payload is None or msg.payload.size != 1 else msg.payload.item()
        if not isinstance(tok, int):
            raise ProtocolError(f"{self.me}: a token message without one integer token: {msg.describe()}")
        return tok

    async def ping(self, payload: mx.array, *, predicted: mx.array | None = None) -> float:
        """Boundary benchmark (rank 0): send ``payload`` round the ring and back; returns seconds.

        With ``predicted``, a PRED message goes first, as before a real step's hidden state. The
        last rank answers with a token-sized payload, so the round trip carries one decode step's
        messages without its compute.
        """
        if self.rank != 0:
            raise DistributedError("ping() runs on rank 0")
        t0 = time.perf_counter()  # (uvloop's clock counts whole milliseconds)
        if predicted is not None:
            self.boundary.post(Message(PRED, 0, predicted, layer=-1))
        self.boundary.post(Message(PING, 0, payload))
        await self._pings.receive()
        return time.perf_counter() - t0

    async def ping_raw(self, payload: mx.array, n: int) -> list[float]:
        """The transport's floor (rank 0 of 2): ``n`` bare exchanges of ``payload`` and a token.

        ``mx.distributed`` send and recv awaited through the bridge, nothing else: no header, and
        rank 1 posts each recv as soon as the previous exchange is done (so its transport thread
        is already polling when the bytes arrive, which the boundary never does). Seconds each.
        """
        if self.rank != 0 or self.group.size != 2 or self.group.env.backend == "nccl":
            raise DistributedError("ping_raw() runs on rank 0 of a pipeline of 2, not over NCCL (it sends both "
                                   "ways at once)")
        await self.boundary.flush()
        self.boundary.post(Message(RAW, 0, mx.zeros(payload.shape, dtype=payload.dtype), step=n))
        await self.boundary.flush()
        g, b = self.group.group, self.boundary
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            await completed(mx.distributed.send(payload, 1, group=g, stream=b.send_stream))
            await completed(mx.distributed.recv((1,), mx.uint32, 1, group=g, stream=b.recv_stream))
            times.append(time.perf_counter() - t0)
        return times

    async def _answer_raw(self, template: mx.array, n: int) -> None:
        g, b = self.group.group, self.boundary
        token = mx.array([0], dtype=mx.uint32)
        mx.eval(token)
        for _ in range(n):
            await completed(mx.distributed.recv(template.shape, template.dtype, 0, group=g, stream=b.recv_stream))
            await completed(mx.distributed.send(token, 0, group=g, stream=b.send_stream))

    # -- every rank: the receiving side ------------------------------------------------------------

    async def _deliver(self, msg: Message) -> None:
        """Route one message from the previous rank (called in order, by the boundary)."""
        if self.rank == 0:
            if msg.kind in (TOKEN, ERROR):
                req = self._requests.get(msg.req)
                if req is not None and req.inbox_send is not None:
                    req.inbox_send.send_nowait(msg)  # a finished request's late token is dropped
            elif msg.kind == SHUTDOWN:
                self._drained.set()
            elif msg.kind == PONG:
                self._pings_send.send_nowait(msg)
            elif msg.kind == PRED:
                pass  # a PING's companion come back round
            else:
                raise ProtocolError(f"{self.me}: unexpected {msg.describe()} from the last rank")
        elif (msg.kind == RAW and msg.payload is not None and self.group.size == 2
              and self.group.env.backend != "nccl"):
            await self._answer_raw(msg.payload, msg.step)
        elif msg.kind == PRED:
            # Prefetch at once, even while this rank is busy with another step.
            self.counters["predictions_received"] += 1
            if msg.layer in self.stage.moe_layers and self.source is not None and msg.payload is not None:
                self.source.prefetch(msg.layer, msg.payload)
            elif msg.layer == -1 and not self.last:
                self.boundary.post(msg)  # a PING's companion: pass it on
        else:
            self._inbox_send.send_nowait(msg)

    async def _work(self) -> None:
        """Ranks after 0: process HIDDEN/END/ERROR/SHUTDOWN messages in arrival order."""
        async for msg in self._inbox:
            if msg.kind == HIDDEN:
                await self._stage_step(msg)
            elif msg.kind == END:
                self._requests.pop(msg.req, None)
                self._failed.discard(msg.req)
                if not self.last:
                    self.boundary.post(msg)
            elif msg.kind == ERROR:
                self._requests.pop(msg.req, None)
                self._failed.add(msg.req)
                self.boundary.post(msg)  # on to rank 0 (the last rank's next)
            elif msg.kind == PING:
                if self.last:
                    self.boundary.post(Message(PONG, msg.req, mx.array([0], dtype=mx.uint32)))
                else:
                    self.boundary.post(msg)
            elif msg.kind == SHUTDOWN:
                self.boundary.post(msg)
                await self.boundary.flush()
                self._drained.set()
                return
            else:
                raise ProtocolError(f"{self.me}: unexpected {msg.describe()} from the previous rank")

    async def _stage_step(self, msg: Message) -> None:
        rid = msg.req
        if rid in self._failed:
            return  # the request already failed here; rank 0 will end it
        req = self._requests.get(rid)
        if req is None:
            req = self._requests[rid] = self._new_request(rid)
        assert msg.payload is not None
        try:
            async with self._turn:
                h = await run_layers(self.sm, msg.payload, req.cache, req.source, req.predictor,
                                     start=self.stage.start, stop=self.stage.stop,
                                     prefill_end=self.last and not msg.flags & LOGITS)
                self.counters["steps"] += 1
                if not self.last:
                    self.boundary.post(Message(HIDDEN, rid, h, flags=msg.flags, step=msg.step))
                elif msg.flags & LOGITS:
                    logits = head(self.sm, h)
                    tok = greedy(logits)
                    await completed(tok)
                    if self.keep_logits:
                        await completed(logits)
                        self.kept_logits.setdefault(rid, []).append(np.array(logits))
                    self.boundary.post(Message(TOKEN, rid, tok, step=msg.step))
        except (DistributedError, anyio.get_cancelled_exc_class()):
            raise
        except Exception as exc:  # this request fails here; the others go on
            self.counters["request_errors"] += 1
            self._requests.pop(rid, None)
            self._failed.add(rid)
            text = f"{self.me} failed request {rid} at step {msg.step}: {type(exc).__name__}: {exc}"
            self.boundary.post(Message(ERROR, rid, _text_payload(text), step=msg.step))

    # -- reporting -------------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "rank": self.rank,
            "stage": self.stage.to_json(),
            **self.counters,
            "boundary": dict(self.boundary.counters),
            "control": dict(self.control.counters),
        }
        if self.source is not None and hasattr(self.source, "stats"):
            out["runtime"] = self.source.stats()
        return out
