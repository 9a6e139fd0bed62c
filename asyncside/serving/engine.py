"""The serving engine: one loop that steps every admitted request of one model together.

:class:`Batcher` owns the model's forward: it is the only caller of it, from one task, so it alone
serializes steps (no lock on the model is needed beside it). Each engine step

1. admits waiting requests into free slots (up to ``max_batch``), each with its own KV cache,
   started from a copy of a cached prefix where one matches (:mod:`.prompt_cache`);
2. runs at most one prefill chunk's worth of prompt tokens (``prefill_chunk``): requests still
   prefilling take their next chunk, the least remaining first (every other step the oldest
   first, so a long prompt is never starved), while the budget lasts; a long prompt therefore
   delays the other streams by at most one chunk per step. A queued chunk is awaited only after
   the decode step behind it is queued (the host builds the step while the stream computes the
   chunk). With ``joint_prefill`` the first chunks of fresh prompts share one forward
   (right-padded; each request's caches are those of its prompt alone, on the CPU bit for bit);
3. runs one decode step over every request that is decoding (:meth:`BatchCaches.launch`), samples
   each request's token with its own sampler (:mod:`.sampling`) and hands it to the request's
   consumer. Decode steps run one ahead, as mlx-lm's batched generation does: the next step is
   queued on the lazy tokens of the step in flight before the host awaits them, so the host's
   work per step (handing tokens out, building the next graph) overlaps the stream's;
4. lets requests leave: finished (EOS or ``max_tokens``), cancelled by their consumer (a client
   that left, a stop sequence) or failed.

Under routing replay (``routing``: a :class:`~asyncside.models.forcing.RoutingReplay`, or one per
trace sequence, :func:`~asyncside.models.forcing.sequence_replays`) request ``n`` (the ``n``-th
submitted, from 0) replays sequence ``n mod S`` of the trace from its own position (its first prompt
token is position 0, as a generation alone replays it): every forward the engine runs carries a
:class:`~asyncside.models.forcing.RowsReplay` of its rows' (sequence, position), so each row of a
batched step routes to its own request's ids. The prefix cache is off then (a cached prefix holds
the keys and values of another request's routing).

Under a memory budget, requests are admitted while their KV caches fit the plan's KV allowance
(:class:`.kv_budget.KVAdmission`: first come, first admitted; one that can never fit is refused).
Requests join and leave only between steps. A request's prefill chunks have fixed boundaries
(multiples of ``prefill_chunk`` from where its prefill starts) whatever else is running, so what
it computes never depends on its neighbours.

``Batcher._launch`` (through :meth:`BatchCaches.launch`, or :func:`rows_step` for caches without a
batched form) and :meth:`Batcher._prefill` are the only places the model is called.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol, cast

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup

from ..errors import AsyncsideError
from ..models.forcing import batch_replays
from ..models.streaming import checked_prompt_ids
from .batch_caches import BatchCaches, announce_unbatched, mergeable, row_cache, rows_step
from .forward_inputs import decode_inputs, prefill_groups
from .kv_budget import plan_admission
from .loading import Engine, ServedModel, embedded_store_dir, open_engine, text_config_value
from .prompt_cache import PrefixCache, cache_nbytes
from .protocol import SamplingParams
from .read_failures import ReadFailures
from .read_failures import log_failure as _log_failure
from .requests import Chunk, Generation, GenerationFailed, QueueFull, Slot, Step, TokenEvent
from .step_shapes import StepShapes, bounded_prefill_chunk, default_prefill_chunk

__all__ = ["BatchCaches", "BatchedSteps", "Batcher", "Engine", "Generation", "GenerationFailed", "QueueFull",
           "ServedModel", "StepStrategy", "TokenEvent", "default_prefill_chunk", "embedded_store_dir", "mergeable",
           "open_engine", "rows_step"]

log = logging.getLogger("asyncside.serving")


# --- the engine ------------------------------------------------------------------------------


class StepStrategy(Protocol):
    """How the one engine loop (:meth:`Batcher.run`) advances its requests, one turn at a time.

    The default, :class:`BatchedSteps`, is the batched step over a local model; a pipeline of
    ranks plugs in its own (:class:`asyncside.distributed.serve.PipelineSteps`). A strategy works
    through the Batcher's public hooks: :meth:`Batcher.take_waiting`, :meth:`Batcher.emit`,
    :meth:`Batcher.finish`, :meth:`Batcher.fail`; its ``failure``, if set, fails the requests a stopped loop left.
    """

    def check(self, sampling: SamplingParams) -> None:
        """Refuse a request this strategy cannot serve as asked (raise a ``RequestError``)."""

    def idle(self, batcher: Batcher) -> bool:
        """Whether the loop has nothing to do until a request arrives."""

    async def step(self, batcher: Batcher, tasks: TaskGroup) -> None:
        """One turn of the loop (``tasks``: the loop's task group, for work that outlives a turn)."""


class BatchedSteps:
    """The batched step over the model (:meth:`Batcher.step`): every admitted request advances
    together, one decode step (and at most one prefill chunk's worth) per turn."""

    def check(self, sampling: SamplingParams) -> None:
        return None

    def idle(self, batcher: Batcher) -> bool:
        return not batcher.waiting and not batcher._active

    async def step(self, batcher: Batcher, tasks: TaskGroup) -> None:
        await batcher.step()


class Batcher:
    """Continuous batching over one model and one expert source (see the module docstring).

    Start :meth:`run` in a task group on the serving loop; :meth:`submit` requests from any task of
    that loop.
    """

    def __init__(self, model: ServedModel, source: Any, *, predictor: str = "lookahead", max_batch: int = 32,
                 max_queue: int = 64, prefill_chunk: int | None = None, prompt_cache_size: int = 8,
                 prompt_cache_min_tokens: int = 16, run_ahead: bool = True, overlap_prefill: bool = True,
                 joint_prefill: bool = False, strategy: StepStrategy | None = None,
                 prompt_cache_bytes: int = 256 << 20, routing: Any = None) -> None:
        prefill_chunk = bounded_prefill_chunk(prefill_chunk, source)
        if max_batch < 1 or prefill_chunk < 1 or max_queue < 0:
            raise ValueError(f"max_batch and prefill_chunk must be >= 1 and max_queue >= 0, got "
                             f"{max_batch}, {prefill_chunk}, {max_queue}")
        self.model = model
        self.source = source
        #: how the loop steps its requests (:class:`StepStrategy`); the batched step by default
        self.strategy: StepStrategy = strategy if strategy is not None else BatchedSteps()
        self.predictor = predictor
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        #: routing replay: one replay per trace sequence, request n replaying sequence n mod S (see
        #: the module docstring); empty: the router routes
        self.replays: list[Any] = batch_replays(routing, model)
        if self.replays and getattr(model.forward, "routing", None) is not None:
            raise ValueError("the model replays a batch-1 routing (set_routing): pass the replay to the "
                             "Batcher's routing= instead, which replays each request's rows on their own")
        self._submitted = 0  # requests submitted: the next one's number (its replayed sequence)
        self.shapes = StepShapes(model, source)  # the forwards' shapes under a memory plan
        self.batched_decode = not announce_unbatched(model)  # False: decode rows one after the other
        if self.replays:
            prompt_cache_size = 0  # a cached prefix holds another request's routing
        self.prefix_cache = PrefixCache(prompt_cache_size, prompt_cache_min_tokens, prompt_cache_bytes)
        #: admission against the memory plan's KV allowance (None: no budget, no limit)
        self.kv_admission = plan_admission(model, source, prefill_chunk, self.prefix_cache)
        vocab = text_config_value(model, "vocab_size")
        vocab = vocab if vocab is not None else getattr(model.tokenizer, "vocab_size", None)
        self.vocab_size: int | None = vocab if isinstance(vocab, int) else None
        if self.vocab_size is not None and self.vocab_size >= 1 << 24:
            raise ValueError(f"vocabulary of {self.vocab_size} ids: token ids above 2**24 are not supported")
        ctx = text_config_value(model, "max_position_embeddings")
        self.context_length: int | None = ctx if isinstance(ctx, int) and ctx > 0 else None
        self.eos: set[int] = set(getattr(model.tokenizer, "eos_token_ids", ()) or ())
        self._waiting: deque[Slot] = deque()
        self._active: list[Slot] = []
        self._turn = anyio.Lock()
        self._wake = anyio.Event()
        self._prefill_turn = 0
        self._duration_ewma = 1.0
        # The decoding requests' caches, merged across steps (their slots' own `cache` is None
        # while they are in it), and those requests in the merged caches' row order.
        self._merged = BatchCaches()
        self._in_merged: list[Slot] = []
        #: decode steps run one ahead (see :meth:`step`); off: each step is awaited before the next is built
        self.run_ahead = run_ahead
        #: queued prefill chunks awaited after the decode step is queued behind them (see
        #: :meth:`_prefill`); off: each chunk is awaited as soon as it is queued
        self.overlap_prefill = overlap_prefill
        #: the first chunks of fresh prompts that fit one step run as one forward, right-padded
        #: (see :meth:`_prefill_joint`). Off by default: on the CPU a request's caches are then
        #: bitwise its own prompt's, but on a GPU the larger products round differently in the low
        #: bits (measured on MLX CUDA), so a seeded request's draws could depend on who arrived
        #: with it; there it saves forwards when many clients start at once
        self.joint_prefill = joint_prefill
        self._inflight: Step | None = None  # the decode step queued last and not completed yet
        #: called with every error a request fails with (the server's health registry)
        self.on_failure: Callable[[BaseException], None] | None = None
        self._reads = ReadFailures()  # the failed reads met during this engine step, by forward
        #: counters (read by /health and /metrics)
        self.steps = 0            # decode steps (one token for each request in the batch)
        self.tokens = 0           # tokens generated
        self.prefill_tokens = 0   # prompt tokens computed (cached ones excluded)
        self.cached_tokens = 0    # prompt tokens taken from the prefix cache
        self.last_batch = 0       # requests in the last decode step
        self.peak_batch = 0       # most requests in one decode step
        self.steps_ahead = 0      # decode steps queued on the previous step's lazy tokens
        self.launch_seconds = 0.0  # wall time building and queuing decode steps (CPU: with the chunks awaited)
        self.prefill_chunks = 0   # prefill forwards run (one request's chunk each)
        self.prefill_seconds = 0.0  # wall time in prefill forwards, awaited
        self.wait_seconds = 0.0   # wall time awaiting decode steps' tokens (what the host did not overlap)
        self.chunks_overlapped = 0  # queued prefill chunks awaited after a decode step was queued behind them
        self.prefill_joined = 0   # requests whose chunk ran in a joint prefill forward with others

    # -- views --------------------------------------------------------------------------------

    @property
    def model_id(self) -> str:
        return self.model.model_id

    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    @property
    def active(self) -> int:
        """Requests in the engine (prefilling or decoding); a cancelled one leaves at the next step."""
        return sum(1 for s in self._active if not (s.cancelled or s.done))

    @property
    def waiting(self) -> int:
        """Requests queued for a slot."""
        return len(self._waiting)

    # -- requests -----------------------------------------------------------------------------

    def submit(self, prompt_ids: Sequence[int], max_tokens: int, sampling: SamplingParams | None = None) -> Generation:
        """Queue one request; QueueFull when every slot is taken and the queue is full."""
        from .sampling import RequestSampler

        ids = checked_prompt_ids(prompt_ids, self.vocab_size)
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        free = self.max_batch - self.active  # a request that finished or left frees its slot now
        if len(self._waiting) >= self.max_queue + max(0, free):
            ahead = len(self._waiting) - max(0, free) + 1
            at_once = min(self.max_batch, (self.kv_admission.limit if self.kv_admission else None) or self.max_batch)
            retry = max(1, math.ceil(self._duration_ewma * ahead / at_once))  # the rows' limit: fewer at once
            raise QueueFull(f"the server is at capacity ({self.active} requests generating, "
                            f"{len(self._waiting)} waiting); retry after {retry} s", retry)
        sampling = sampling or SamplingParams()
        self.strategy.check(sampling)
        need = self.kv_admission.check(len(ids), max_tokens) if self.kv_admission is not None else 0
        send, receive = anyio.create_memory_object_stream[Any](math.inf)
        slot = Slot(ids, max_tokens, sampling, send, time.monotonic(), kv_need=need)
        slot.sampler = RequestSampler(sampling, ids, self.vocab_size)
        if self.replays:
            slot.replay = self.replays[self._submitted % len(self.replays)]
        self._submitted += 1
        self._waiting.append(slot)
        self._wake.set()
        return Generation(self._cancel, slot, receive)

    def _cancel(self, slot: Slot) -> None:
        if slot.done or slot.cancelled:
            return
        slot.cancelled = True
        if slot in self._waiting:
            self._waiting.remove(slot)
            self._finish(slot, None, keep_cache=False)

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """Hold the engine between two steps until the block exits (maintenance, tests).

        Requests keep arriving and queue up; the engine resumes in order behind the holder.
        """
        async with self._turn:
            yield

    # -- the loop -----------------------------------------------------------------------------

    async def run(self) -> None:
        """The engine loop; runs until cancelled, then fails every request still in it.

        Each turn is one step of the strategy (:attr:`strategy`; the batched step over the
        model, :meth:`step`, by default), between steps the loop lets HTTP handlers and holders
        of :meth:`paused` run; with nothing to do it sleeps until a request arrives."""
        strategy = self.strategy
        try:
            async with anyio.create_task_group() as tasks:
                while True:
                    if strategy.idle(self):
                        self._wake = anyio.Event()
                        await self._wake.wait()
                    async with self._turn:
                        await strategy.step(self, tasks)
                    if self.kv_admission is not None:  # the rows' limit is tuned on what the turns make
                        self.kv_admission.observe(time.monotonic(), self.tokens, bool(self._waiting))
                    await anyio.lowlevel.checkpoint()
        finally:
            self._fail_all(getattr(strategy, "failure", None) or AsyncsideError("the server is shutting down"))

    # -- what a step strategy uses ------------------------------------------------------------

    def take_waiting(self) -> list[Slot]:
        """Move waiting requests into the engine while slots are free (and their KV caches fit); returns them."""
        taken = []
        while self._waiting and len(self._active) < self.max_batch:
            if self.kv_admission and not self.kv_admission.admits(self._active, self._waiting[0], self.prefix_cache):
                break
            slot = self._waiting.popleft()
            self._active.append(slot)
            taken.append(slot)
        self.peak_batch = max(self.peak_batch, len(self._active))
        return taken

    def kv_reserved(self) -> int:
        """Bytes the admitted requests' KV caches may take at worst (0 without a KV allowance)."""
        return self.kv_admission.reserved([s.kv_need for s in self._active]) if self.kv_admission else 0

    def emit(self, slot: Slot, event: TokenEvent) -> None:
        """Hand a request its next token (dropped if its consumer left)."""
        slot.generated += 1
        self.tokens += 1
        if not slot.cancelled:
            with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
                slot.send.send_nowait(event)

    def finish(self, slot: Slot, reason: str | None, *, keep_cache: bool = True) -> None:
        """End a request (``reason``: "stop", "length", or None when cancelled) and let it leave."""
        self._finish(slot, reason, keep_cache=keep_cache)
        self._release(slot)

    def fail(self, slot: Slot, exc: BaseException) -> None:
        """End a request with ``exc`` (its consumer raises :class:`GenerationFailed`) and let it leave."""
        self._fail(slot, exc)
        self._release(slot)

    def _release(self, slot: Slot) -> None:
        if slot in self._active:
            self._active.remove(slot)

    def _fail_all(self, exc: BaseException) -> None:
        """Fail every admitted and waiting request with ``exc`` (the engine loop is ending)."""
        for slot in [*self._active, *self._waiting]:
            self._fail(slot, exc)
        self._active.clear()
        self._waiting.clear()
        self._forget_merged()
        self._inflight = None  # the Runtime's quiesce waits for a step still on the stream

    async def step(self) -> None:
        """One engine step: admit, one prefill chunk's worth, one decode step, let requests leave.

        Decode steps run one ahead, as mlx-lm's own generation does: the step over the batch is
        queued on the previous step's lazy tokens before those are awaited, so the stream
        computes while the host hands the previous tokens out and builds the next step (see
        :meth:`_launch_ahead`). A step launched here is completed by the next engine step.
        """
        self._leave()
        self._admit()
        self._reads.start([self._inflight.ctx] if self._inflight is not None else [])
        clean: set[Slot] = set()  # requests whose forward was awaited before a failed read no forward was named for
        used = 0
        picked: list[tuple[Slot, int]] = []
        most = self.shapes.queued_chunk(self.prefill_chunk)
        for slot in self._prefill_order():
            n = min(most, len(slot.todo) - 1)
            if used and used + n > self.prefill_chunk:
                continue  # a smaller one may still fit this step
            picked.append((slot, n))
            used += n
        chunks: list[Chunk] = []
        for group in prefill_groups(picked, self.joint_prefill, self.prefill_chunk):
            group = [(slot, n) for slot, n in group if not (slot.cancelled or slot.done)]  # left meanwhile
            if not group:
                continue
            chunk = await (self._prefill(*group[0]) if len(group) == 1 else self._prefill_joint(group))
            if chunk is not None:
                chunks.append(chunk)
                self._reads.add(chunk.ctx)
        prev, self._inflight = self._inflight, None
        behind: tuple[Step, BaseException, tuple[BatchCaches, list[Slot]]] | None = None
        if prev is not None:
            self._inflight = await self._launch_ahead(prev)
            self._reads.add(self._inflight.ctx if self._inflight is not None else None)
            merged = self._merged, list(self._in_merged)  # what the step launched ahead runs on
            failure = await self._complete(prev)
            clean.update(prev.batch if self._reads.unplaced is None else ())
            if failure is not None and self._inflight is not None:
                # The step behind it was queued on its tokens: it goes with it (after the chunks).
                behind, self._inflight = (self._inflight, failure, merged), None
        # The stream runs prev, then the chunks, then the step launched ahead (which may hold the
        # requests whose prompts they completed, on their lazy caches): awaited in that order.
        for chunk in chunks:
            await self._finish_chunk(chunk)
            clean.update(chunk.slots if self._reads.unplaced is None else ())
        if behind is not None:
            await self._abandon(*behind)
        await self._fail_misread(chunks, prev, clean)
        if self._inflight is None:
            batch = self._decoding()
            if batch:
                self._inflight = await self._launch(batch, None)
        self._leave()

    async def _fail_misread(self, chunks: list[Chunk], prev: Step | None, clean: set[Slot]) -> None:
        """Fail the requests whose own failed read was raised elsewhere (:meth:`ReadFailures.failed`)."""
        forwards = [(c.slots, c.ctx) for c in chunks] + ([(prev.batch, prev.ctx)] if prev else [])
        for s, exc in self._reads.failed(forwards, clean):
            self._fail(s, exc)
        nxt = self._inflight
        failure = self._reads.unplaced or (self._reads.of(nxt.ctx) if nxt is not None else None)
        if nxt is not None and failure is not None:
            self._inflight = None
            await self._abandon(nxt, failure)

    def _decoding(self) -> list[Slot]:
        """The requests that take part in the next decode step, in admission order."""
        return [s for s in self._active if not s.prefilling and not s.cancelled and not s.done and s.todo]

    def _prefill_order(self) -> list[Slot]:
        """Who prefills this step: the least remaining prompt first (short prompts reach their
        first token soon), except that on every other step the oldest prefilling request goes
        first, so a long prompt advances at least one chunk per two steps however many short ones
        keep arriving."""
        waiting = [s for s in self._active if s.prefilling and not s.cancelled and not s.done]
        order = sorted(waiting, key=lambda s: len(s.todo))
        self._prefill_turn += 1
        if waiting and self._prefill_turn % 2 == 0:
            oldest = waiting[0]  # _active keeps admission order
            order.remove(oldest)
            order.insert(0, oldest)
        return order

    def _admit(self) -> None:
        for slot in self.take_waiting():
            cache, reused = self.prefix_cache.fetch(slot.prompt)
            if cache is not None and cache_nbytes(cache) > slot.kv_need > 0:  # allocated past its worst case
                cache, reused = None, 0
            slot.cache = cache if cache is not None else self.model.make_cache()
            slot.cached_tokens = reused
            self.cached_tokens += reused
            slot.fed = slot.prompt[:reused]
            slot.todo = slot.prompt[reused:]
            slot.predictor = self.model.forward.make_predictor(self.predictor)

    async def _prefill(self, slot: Slot, n: int) -> Chunk | None:
        """Queue ``slot``'s next ``n`` prompt tokens; returns the chunk to pass to
        :meth:`_finish_chunk` (None if it failed, and the request with it).

        A queued chunk is not awaited here: the decode step is built (and launched ahead) while
        the stream computes it, the requests it completes joining that step on their lazy caches.
        A chunk that runs per layer (a source without queued steps) is computed when this returns.
        """
        import mlx.core as mx

        tokens = slot.todo[:n]
        started = time.perf_counter()
        fwd, ctx = self.model.forward, None
        try:
            ctx = self._context(slot.cache, [(slot, len(slot.fed))], slot.predictor)
            h = await fwd.step(ctx, mx.array(tokens)[None], logits=False, finish=False)
        except Exception as exc:
            _log_failure("prefill failed", exc)
            self._reads.place(ctx, exc)
            self._fail(slot, exc)
            return None
        finally:
            self.prefill_chunks += 1
            self.prefill_seconds += time.perf_counter() - started
        slot.fed.extend(tokens)
        del slot.todo[:n]
        self.prefill_tokens += n
        chunk = Chunk([slot], ctx, h)
        if not self.overlap_prefill:
            await self._finish_chunk(chunk)
            return None
        return chunk

    async def _prefill_joint(self, group: list[tuple[Slot, int]]) -> Chunk | None:
        """Queue the first chunks of several fresh prompts as one forward; returns it as one
        :class:`Chunk` (None if it failed, and its requests with it).

        The chunks are right-padded to the longest, as mlx-lm's batched prompt processing pads
        them: a real token never attends to a pad after it (the mask is causal) and keeps its own
        position, so each request's keys and values are those of its chunk alone (bit for bit
        on the CPU; on MLX CUDA the products of B rows round differently in the last bits). Each request
        then takes its own cache: its row of the batch cache up to its length (lazy). The pads
        (token 0) route to experts like any token: their faults and products are the price of
        one forward instead of several.
        """
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache

        longest = max(n for _, n in group)
        rows = [slot.todo[:n] + [0] * (longest - n) for slot, n in group]
        started = time.perf_counter()
        fwd, ctx = self.model.forward, None
        try:
            layers = len(cast(list[Any], group[0][0].cache))
            # Plain caches of B rows: every row starts at position 0 and the mask is the plain
            # causal one, exactly as a single prompt's prefill has them.
            batch = [KVCache() for _ in range(layers)]
            ctx = self._context(batch, [(slot, len(slot.fed)) for slot, _ in group])
            h = await fwd.step(ctx, mx.array(rows), logits=False, finish=False)
        except Exception as exc:
            _log_failure("prefill failed", exc)
            self._reads.place(ctx, exc)
            for slot, _ in group:
                self._fail(slot, exc)
            return None
        finally:
            self.prefill_chunks += 1
            self.prefill_joined += len(group)
            self.prefill_seconds += time.perf_counter() - started
        for i, (slot, n) in enumerate(group):
            slot.cache = [row_cache(c, i, 0, n) for c in batch]
            slot.fed.extend(slot.todo[:n])
            del slot.todo[:n]
            self.prefill_tokens += n
        chunk = Chunk([slot for slot, _ in group], ctx, h)
        if not self.overlap_prefill:
            await self._finish_chunk(chunk)
            return None
        return chunk

    async def _finish_chunk(self, chunk: Chunk) -> None:
        """Await a prefill forward queued by :meth:`_prefill` or :meth:`_prefill_joint`; its requests
        fail if it did (a decode step queued on their caches hands them nothing: they are done)."""
        if self._inflight is not None:
            self.chunks_overlapped += 1
        started = time.perf_counter()
        try:
            await self.model.forward.finish(chunk.ctx, chunk.hidden)
        except Exception as exc:
            if self._reads.place(chunk.ctx, exc):
                return  # another forward's failed read, raised here: this chunk's own were clean
            _log_failure("prefill failed", exc)
            for slot in chunk.slots:
                self._fail(slot, exc)
        finally:
            self.prefill_seconds += time.perf_counter() - started

    # -- decode steps -----------------------------------------------------------------------

    async def _launch_ahead(self, prev: Step) -> Step | None:
        """Queue the next decode step on ``prev``'s lazy tokens, before ``prev`` is awaited; None
        when it cannot be (then the step is launched after ``prev`` completes).

        The batch: ``prev``'s requests that do not end by length with ``prev`` (one that ends with
        an EOS token gets a step computed for nothing, as in mlx-lm), then requests that finished
        their prefill. It runs ahead only when every decision it needs is on the host already:
        the step is queued (a per-layer step would wait for ``prev`` at its first layer), no
        continuing request's sampler needs its last token (penalties look at past tokens), and
        the caches' rows can change without reading the device (:attr:`BatchCaches.tracked`).
        """
        if not self.run_ahead or prev.ctx is None:
            return None
        kind = getattr(self.model.forward, "kind", None)
        if kind is None:  # a forward without queued steps
            return None
        in_prev = set(prev.batch)
        going = [s for s in prev.batch if not (s.done or s.cancelled) and s.generated + 1 < s.max_tokens]
        batch = going + [s for s in self._decoding() if s not in in_prev]
        if not batch or any(s.sampler.processors for s in going):
            return None
        if not self._merged.tracked:
            return None
        if len(batch) > 1 and not self._can_merge(batch):
            return None
        import mlx.core as mx

        from ..models.forward import StepMode

        if kind(self.model.forward.context([], self.source), mx.zeros((len(batch), 1), mx.int32)) \
                is not StepMode.QUEUED:
            return None
        step = await self._launch(batch, prev)
        if step is not None:
            self.steps_ahead += 1
        return step

    async def _launch(self, batch: list[Slot], prev: Step | None) -> Step | None:
        """Build and queue one decode step over ``batch`` (each request's input: its last token on
        the host, or for a request in ``prev``, ``prev``'s lazy token); returns it, not awaited.
        None if it failed (its requests failed with it)."""
        from .sampling import draw_step

        layout: list[tuple[int, int, int]] = []

        def sample(logits: Any) -> Any:
            values, lay = draw_step([s.sampler for s in batch], logits)
            layout.extend(lay)
            return values

        in_prev = set(prev.batch) if prev is not None else set()

        def rows(slots: list[Slot]) -> list[tuple[Slot, int]]:
            # A request in prev feeds the token prev is computing: one past the tokens it fed.
            return [(s, len(s.fed) + (1 if s in in_prev else 0)) for s in slots]

        started, ctx = time.perf_counter(), None
        try:
            if len(batch) > 1 and self._can_merge(batch) and not self.shapes.rows_apart(len(batch)):
                batch = self._merge(batch)
                ctx, values = await self._merged.launch(self.model, decode_inputs(batch, prev), self.source, sample,
                                                        routing=self._rows_replay(rows(batch)))
            else:
                self._unmerge()
                tokens = decode_inputs(batch, prev)
                if len(batch) == 1:
                    (s,) = batch
                    fwd = self.model.forward
                    ctx = self._context(s.cache, rows(batch), s.predictor)
                    values = await fwd.step(ctx, tokens, head=lambda logits: sample(logits[:, -1, :]))
                else:  # caches without a batched form: one after the other, awaited here
                    caches = [s.cache for s in batch]
                    assert all(c is not None for c in caches), "a decoding slot has its cache when not merged"
                    routings = [self._rows_replay([r]) for r in rows(batch)] if self.replays else None
                    ctx, values = None, await rows_step(self.model, tokens, caches, self.source,  # type: ignore[arg-type]
                                                        [s.predictor for s in batch], sample, routings=routings)
        except Exception as exc:
            _log_failure("decode step failed", exc)
            self._reads.place(ctx, exc)
            self._forget_merged()  # its rows may be half-updated
            for s in batch:
                self._fail(s, exc)
            return None
        finally:
            self.launch_seconds += time.perf_counter() - started
        return Step(batch, ctx, values, layout)

    def _rows_replay(self, rows: list[tuple[Slot, int]]) -> Any:
        """The replay of a forward over ``rows`` (each request and the position of its first token
        in the forward); None without routing replay."""
        if not self.replays:
            return None
        from ..models.forcing import RowsReplay

        return RowsReplay([(s.replay, pos) for s, pos in rows])

    def _context(self, cache: list[Any] | None, rows: list[tuple[Slot, int]], predictor: Any = None) -> Any:
        """A step context over ``cache`` whose forward runs ``rows`` (see :meth:`_rows_replay`)."""
        ctx = self.model.forward.context(cache, self.source, predictor)
        routing = self._rows_replay(rows)
        if routing is not None:
            ctx.routing, ctx.position = routing, 0
        return ctx

    async def _complete(self, step: Step) -> BaseException | None:
        """Await ``step``, hand each request its token, let finished requests go; returns the
        error the step failed with (its requests failed with it), or None."""
        from .sampling import unpack

        started = time.perf_counter()
        try:
            try:
                if step.ctx is not None:
                    await self.model.forward.finish(step.ctx, step.values)
            except Exception as exc:
                if not self._reads.place(step.ctx, exc):
                    raise  # else another forward's failed read, raised here: this step's tokens are good
            results = unpack(step.values.tolist(), step.layout)
        except Exception as exc:
            self._reads.place(step.ctx, exc)
            _log_failure("decode step failed", exc)
            self._forget_merged()  # its rows may be half-updated
            for s in step.batch:
                self._fail(s, exc)
            return exc
        finally:
            self.wait_seconds += time.perf_counter() - started
        batch = step.batch
        self.steps += 1
        self.last_batch = len(batch)
        self.peak_batch = max(self.peak_batch, len(batch))
        self._hand(batch, results)
        return None

    def _hand(self, batch: list[Slot], results: list[Any]) -> None:
        """Hand each request of ``batch`` still in the engine its token of ``results``; let finished ones go."""
        for s, (token, lp, alts) in zip(batch, results):
            if s.done:  # failed meanwhile
                continue
            s.fed.append(s.todo[0])
            s.todo = [token]
            s.generated += 1
            s.sampler.accept(token)
            self.tokens += 1
            eos = token in self.eos
            if not s.cancelled:
                with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
                    s.send.send_nowait(TokenEvent(token, lp, tuple(alts), eos))
            if eos:
                self._finish(s, "stop")
            elif s.generated >= s.max_tokens:
                self._finish(s, "length")

    async def _abandon(self, step: Step, failure: BaseException,
                       merged: tuple[BatchCaches, list[Slot]] | None = None) -> None:
        """``step`` was queued on the tokens of a step that failed: wait until the stream is done
        with it (so the expert source has learned what it did), then fail its requests; with
        ``merged`` (the caches it ran on, their requests by row), a request still in the engine
        (it joined with its own token) keeps its token and cache where no forward's read failed."""
        clean = step.ctx is not None
        if step.ctx is not None:
            try:
                await self.model.forward.finish(step.ctx, step.values)
            except Exception as exc:
                clean = False
                # Its own failure (a second failed read) is recorded, its requests failing with the first.
                if exc is not failure and not self._reads.place(step.ctx, exc):
                    _log_failure("decode step failed", exc)
                    self._record(exc)
        ok = clean and merged and not self._reads.misread and self._reads.unplaced is None
        kept = [s for s in step.batch if not s.done] if ok else []
        if kept and merged:
            from .sampling import unpack

            for s in kept:  # its own cache back: its row of the merged caches, which it ran on
                s.cache = merged[0].extract(merged[1].index(s)) if s in merged[1] else s.cache
            self._hand(step.batch, unpack(step.values.tolist(), step.layout))
        self._forget_merged()
        for s in step.batch:
            if s not in kept:
                self._fail(s, failure)

    def _can_merge(self, batch: list[Slot]) -> bool:
        return all(s.cache is None or mergeable(s.cache) for s in batch)

    def _merge(self, batch: list[Slot]) -> list[Slot]:
        """Make the merged caches hold exactly ``batch``'s requests: drop those that left, merge
        in those that joined. Returns the batch in the merged caches' row order."""
        wanted = set(batch)
        gone = [i for i, s in enumerate(self._in_merged) if s not in wanted]
        if gone and self.prefix_cache.enabled:
            # A request leaving before its last token was handed out (run ahead: it ends by length
            # with the step in flight) takes its own cache along, for the prefix cache.
            for i in gone:
                s = self._in_merged[i]
                if not s.done:
                    s.cache = self._merged.extract(i)
        if gone:
            self._merged.drop(gone)
            self._in_merged = [s for s in self._in_merged if s in wanted]
        present = set(self._in_merged)
        joining = [s for s in batch if s not in present]
        if joining:
            self._merged.join([s.cache for s in joining])  # type: ignore[misc]  # joining slots hold their cache
            for s in joining:
                s.cache = None
            self._in_merged.extend(joining)
        return list(self._in_merged)

    def _unmerge(self) -> None:
        """Give every request still in the merged caches its own cache back (a batch of one runs
        as the single stream does)."""
        for i, s in enumerate(self._in_merged):
            if not s.done:
                s.cache = self._merged.extract(i)
        self._forget_merged()

    def _forget_merged(self) -> None:
        self._merged, self._in_merged = BatchCaches(), []

    def _leave(self) -> None:
        still = []
        for s in self._active:
            if s.done:
                continue
            if s.cancelled:
                self._finish(s, None)
                continue
            still.append(s)
        self._active = still

    def _finish(self, slot: Slot, reason: str | None, *, keep_cache: bool = True) -> None:
        if slot.done:
            return
        slot.done = True
        slot.finish_reason = reason
        # A request in the step in flight has its last token's keys and values in the cache too.
        held = slot.fed + slot.todo[:1] if self._inflight is not None and slot in self._inflight.batch else slot.fed
        slot.todo = []
        duration = time.monotonic() - slot.submitted
        self._duration_ewma = 0.8 * self._duration_ewma + 0.2 * duration
        if keep_cache and held and self.prefix_cache.enabled:
            cache = slot.cache
            if cache is None and slot in self._in_merged:
                cache = self._merged.extract(self._in_merged.index(slot))
            if cache is not None:
                self.prefix_cache.insert(held, cache)
        slot.cache = None
        slot.send.close()

    def _record(self, exc: BaseException) -> None:
        """Tell the health registry (:attr:`on_failure`) of a failure."""
        if self.on_failure is not None:
            try:
                self.on_failure(exc)
            except Exception:  # the health registry must not take a request's failure path down
                log.exception("recording a failure failed")

    def _fail(self, slot: Slot, exc: BaseException) -> None:
        if slot.done:
            return
        self._record(exc)
        slot.done = True
        slot.finish_reason = "error"
        slot.todo = []
        slot.cache = None
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            slot.send.send_nowait(exc)
        slot.send.close()
