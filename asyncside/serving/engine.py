"""The serving engine: one loop that steps every admitted request of one model together.

:class:`Batcher` owns the model's forward: it is the only caller of it, from one task, so it alone
serializes steps (no lock on the model is needed beside it). Each engine step

1. admits waiting requests into free slots (up to ``max_batch``), each with its own KV cache,
   started from a copy of a cached prefix where one matches (:mod:`.prompt_cache`);
2. runs at most one prefill chunk's worth of prompt tokens (``prefill_chunk``): requests still
   prefilling take their next chunk, the least remaining first (every other step the oldest
   first, so a long prompt is never starved), while the budget lasts; a long prompt therefore
   delays the other streams by at most one chunk per step;
3. runs one decode step over every request that is decoding (:meth:`BatchCaches.step`), samples each
   request's token with its own sampler (:mod:`.sampling`) and hands it to the request's
   consumer;
4. lets requests leave: finished (EOS or ``max_tokens``), cancelled by their consumer (a client
   that left, a stop sequence) or failed.

Requests join and leave only between steps. A request's prefill chunks have fixed boundaries
(multiples of ``prefill_chunk`` from where its prefill starts) whatever else is running, so what
it computes never depends on its neighbours.

:meth:`BatchCaches.step`, :func:`rows_step` (a batch of one, or caches without a batched form)
and :func:`prefill_step` are the only places the model is called.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import anyio.lowlevel
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..errors import AsyncsideError
from ..policies import DEFAULT_POLICY
from .prompt_cache import PrefixCache
from .protocol import SamplingParams

log = logging.getLogger("asyncside.serving")


class ServedModel(Protocol):
    """What the engine needs from a model (:class:`asyncside.models.StreamingModel` provides it).

    ``forward`` is an :class:`~asyncside.models.forward.AsyncForward` or alike: awaited as ``await
    forward(inputs (1, L), cache, source, predictor, logits=...)`` (prefill chunks), stepped as
    ``ctx = forward.context(cache, source, predictor)``, ``await forward.step(ctx, inputs)`` (lazy
    logits) and ``await forward.finish(ctx, y)`` (await what was derived from them: decode steps),
    with ``completed`` (await an array's computation) and ``make_predictor(name)``.
    """

    model_id: str
    tokenizer: Any
    config: dict[str, Any]

    @property
    def forward(self) -> Any: ...

    def make_cache(self) -> list[Any]: ...


@dataclass
class Engine:
    """What the server serves: a model, the expert source it streams from, and runtime views."""

    model: ServedModel
    source: Any
    stats: Callable[[], Mapping[str, Any]] | None = None
    audit: Callable[[], tuple[bool, list[str]]] | None = None
    description: dict[str, Any] = field(default_factory=dict)
    #: an engine loop of its own (a :class:`Batcher` subclass); None: the app builds a Batcher
    batcher: Any = None


def embedded_store_dir(cache_dir: str | None = None) -> str:
    """The embedded default model's expert store directory, built on first use."""
    from ..models.embedded import ensure_embedded_default

    return str(ensure_embedded_default(cache_dir)[1])


@contextlib.asynccontextmanager
async def open_engine(
    model: str | None = None,
    *,
    resident: float = 0.25,
    reader: str = "auto",
    policy: str = DEFAULT_POLICY,
    cache_dir: str | None = None,
) -> AsyncIterator[Engine]:
    """Load a converted model (the embedded default when ``model`` is None) and open its Runtime.

    ``model`` is a directory written by ``asyncside convert`` (expert store + non-expert weights
    + config + tokenizer). Runs on the serving loop: the Runtime's reap task and completion
    bridge belong to that loop. Loading is synchronous and happens before the server accepts
    connections, so it blocks nothing that is waiting.
    """
    from ..audit import audit_problems
    from ..models import load_streaming_model
    from ..runtime import Runtime

    store_dir = model if model is not None else embedded_store_dir(cache_dir)
    streaming = load_streaming_model(store_dir)
    store = streaming.store

    def audit() -> tuple[bool, list[str]]:
        problems = audit_problems(runtime)
        return not problems, problems

    async with Runtime(store, resident=resident, reader=reader, policy=policy) as runtime:
        yield Engine(
            model=streaming,
            source=runtime,
            stats=runtime.stats,
            audit=audit,
            description={
                "model": str(store_dir),
                "layers": len(store.layers),
                "resident": resident,
                "reader": runtime.reader,
                "policy": policy,
            },
        )


# --- the model calls -------------------------------------------------------------------------


def default_prefill_chunk() -> int:
    """Prompt tokens per engine step when none is configured: 512 on a GPU, 16 on the CPU.

    On a GPU a chunk of many tokens costs little more than one token, so large chunks keep a long
    prefill fast. On the CPU a prefilled token costs about as much as a decode step (each routed
    pair is its own product), so a small chunk gives the same prefill speed while holding the
    other streams for less time per step.
    """
    import mlx.core as mx

    return 512 if mx.default_device() == mx.gpu else 16


def mergeable(cache: list[Any]) -> bool:
    """Whether a request's KV cache has mlx-lm's batched form (every layer's cache can ``merge``)."""
    return all(hasattr(c, "merge") for c in cache)


async def rows_step(sm: ServedModel, tokens: Any, caches: Sequence[list[Any]], source: Any,
                    predictors: Sequence[Any], sample: Callable[[Any], Any]) -> Any:
    """One decode step of ``B`` requests, each through its own KV cache ``caches[i]``, one after the
    other (a batch of one: the single-stream step itself; caches without a batched form).

    ``tokens`` (B, 1); ``sample`` builds, from the last position's logits (B, vocab), what the
    caller reads (lazy). Returns it, computed: one completion for the last row's forward and the
    sampling together.
    """
    import mlx.core as mx

    fwd = sm.forward
    rows = []
    n = tokens.shape[0]
    for i in range(n):
        ctx = fwd.context(caches[i], source, predictors[i])
        last = (await fwd.step(ctx, tokens[i:i + 1]))[:, -1, :]
        rows.append(last)
        if i < n - 1:
            await fwd.finish(ctx, last)
    y = sample(rows[0] if n == 1 else mx.concatenate(rows, axis=0))
    await fwd.finish(ctx, y)
    return y


class BatchCaches:
    """The KV caches of the requests decoding together, merged into mlx-lm's batch caches
    (left-padded, with the masks mlx-lm's own batched generation uses) and kept merged across
    steps, as mlx-lm's ``BatchGenerator`` keeps them.

    Merging every request's cache at every step and extracting them back after costs host time
    that grows with the batch (measured on the dev VM: 2.4 ms per step for 8 requests of 8
    layers, 9.2 ms for 32, before the device copies), on the order of a whole decode step on a
    GPU. Kept merged, a step pays nothing for its caches: a request that joins is merged in
    once (:meth:`join`), one that leaves is dropped (:meth:`drop`), and its own cache is
    extracted (:meth:`extract`) only when something still needs it (the prefix cache).
    """

    def __init__(self) -> None:
        self.layers: list[Any] | None = None  # one mlx-lm batch cache per layer
        self.size = 0

    def join(self, caches: Sequence[list[Any]]) -> None:
        """Merge requests' caches in as the last rows, in order."""
        if not caches:
            return
        new = [layer.merge([c[i] for c in caches]) for i, layer in enumerate(caches[0])]
        if self.layers is None:
            self.layers = new
        else:
            for mine, theirs in zip(self.layers, new):
                mine.extend(theirs)
        self.size += len(caches)

    def drop(self, rows: Sequence[int]) -> None:
        """Keep only the other rows (in their order)."""
        gone = set(rows)
        keep = [i for i in range(self.size) if i not in gone]
        if not keep:
            self.layers, self.size = None, 0
            return
        assert self.layers is not None
        for c in self.layers:
            c.filter(keep)
        self.size = len(keep)

    def extract(self, row: int) -> list[Any]:
        """Row ``row``'s own cache (a copy; the batch keeps its row)."""
        assert self.layers is not None
        return [c.extract(row) for c in self.layers]

    async def step(self, sm: ServedModel, tokens: Any, source: Any, sample: Callable[[Any], Any]) -> Any:
        """One forward of the whole batch (``tokens``: (size, 1)); ``sample`` builds, from the last
        position's logits (size, vocab), what the caller reads (lazy). Returns it, computed, with
        one completion for the step and the sampling together (not one for the logits first).

        A queued step (the batch's switches resolving their experts in parts when they may not
        fit a layer's rows at once), else per layer with the union of the batch's experts served
        in groups.
        """
        assert self.layers is not None and tokens.shape[0] == self.size
        fwd = sm.forward
        ctx = fwd.context(self.layers, source)
        y = sample((await fwd.step(ctx, tokens))[:, -1, :])
        await fwd.finish(ctx, y)
        return y


async def prefill_step(sm: ServedModel, tokens: Any, cache: list[Any], source: Any, predictor: Any) -> None:
    """Feed prompt tokens (1, n) through ``cache`` without computing logits (nobody reads them)."""
    await sm.forward(tokens, cache, source, predictor, logits=False)


# --- requests ----------------------------------------------------------------------------------


class QueueFull(AsyncsideError):
    """The engine's slots and its queue are full; ``retry_after`` is a hint in whole seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class GenerationFailed(AsyncsideError):
    """A request's generation failed inside the engine (the model or the expert source raised)."""


@dataclass(frozen=True)
class TokenEvent:
    """One generated token; ``logprob`` and ``top`` are set when the request asked for log-probabilities."""

    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()
    eos: bool = False


@dataclass(eq=False)
class _Slot:
    """One request inside the engine."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    send: MemoryObjectSendStream[Any]
    submitted: float
    cache: list[Any] | None = None
    sampler: Any = None
    predictor: Any = None
    todo: list[int] = field(default_factory=list)  # tokens to feed: the prompt's rest, then the last token
    fed: list[int] = field(default_factory=list)   # tokens whose keys and values are in the cache
    generated: int = 0
    cached_tokens: int = 0
    cancelled: bool = False
    done: bool = False
    finish_reason: str | None = None

    @property
    def prefilling(self) -> bool:
        return len(self.todo) > 1


class Generation:
    """A caller's handle on one request: iterate it for :class:`TokenEvent` (``async for``), then
    read ``finish_reason``; ``cancel()`` leaves the engine at the next step boundary.

    Iteration raises :class:`GenerationFailed` if the engine failed the request.
    """

    def __init__(self, batcher: Batcher, slot: _Slot, receive: MemoryObjectReceiveStream[Any]) -> None:
        self._batcher = batcher
        self._slot = slot
        self._receive = receive

    @property
    def prompt_tokens(self) -> int:
        return len(self._slot.prompt)

    @property
    def cached_tokens(self) -> int:
        return self._slot.cached_tokens

    @property
    def finish_reason(self) -> str | None:
        return self._slot.finish_reason

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[TokenEvent]:
        async for item in self._receive:
            if isinstance(item, BaseException):
                raise GenerationFailed(f"generation failed: {_describe(item)}") from item
            yield item

    def cancel(self) -> None:
        """Leave the engine (no-op once finished); safe to call more than once."""
        self._batcher._cancel(self._slot)
        self._receive.close()


def _describe(exc: BaseException) -> str:
    """``Type: message`` of an error, looking through task-group wrappers of a single error."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"


# --- the engine ------------------------------------------------------------------------------


class Batcher:
    """Continuous batching over one model and one expert source (see the module docstring).

    Start :meth:`run` in a task group on the serving loop; :meth:`submit` requests from any task of
    that loop.
    """

    def __init__(self, model: ServedModel, source: Any, *, predictor: str = "lookahead", max_batch: int = 32,
                 max_queue: int = 64, prefill_chunk: int | None = None, prompt_cache_size: int = 8,
                 prompt_cache_min_tokens: int = 16) -> None:
        if prefill_chunk is None:
            prefill_chunk = default_prefill_chunk()
        if max_batch < 1 or prefill_chunk < 1 or max_queue < 0:
            raise ValueError(f"max_batch and prefill_chunk must be >= 1 and max_queue >= 0, got "
                             f"{max_batch}, {prefill_chunk}, {max_queue}")
        self.model = model
        self.source = source
        self.predictor = predictor
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        self.prefix_cache = PrefixCache(prompt_cache_size, prompt_cache_min_tokens)
        config = getattr(model, "config", None) or {}
        vocab = config.get("vocab_size", getattr(model.tokenizer, "vocab_size", None))
        self.vocab_size: int | None = vocab if isinstance(vocab, int) else None
        if self.vocab_size is not None and self.vocab_size >= 1 << 24:
            raise ValueError(f"vocabulary of {self.vocab_size} ids: token ids above 2**24 are not supported")
        ctx = config.get("max_position_embeddings")
        self.context_length: int | None = ctx if isinstance(ctx, int) and ctx > 0 else None
        self.eos: set[int] = set(getattr(model.tokenizer, "eos_token_ids", ()) or ())
        self._waiting: deque[_Slot] = deque()
        self._active: list[_Slot] = []
        self._turn = anyio.Lock()
        self._wake = anyio.Event()
        self._prefill_turn = 0
        self._duration_ewma = 1.0
        # The decoding requests' caches, merged across steps (their slots' own `cache` is None
        # while they are in it), and those requests in the merged caches' row order.
        self._merged = BatchCaches()
        self._in_merged: list[_Slot] = []
        #: counters (read by /health and /metrics)
        self.steps = 0            # decode steps (one token for each request in the batch)
        self.tokens = 0           # tokens generated
        self.prefill_tokens = 0   # prompt tokens computed (cached ones excluded)
        self.cached_tokens = 0    # prompt tokens taken from the prefix cache
        self.last_batch = 0       # requests in the last decode step
        self.peak_batch = 0       # most requests in one decode step

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

        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise ValueError("prompt_ids is empty: generation needs at least one prompt token")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        free = self.max_batch - len(self._active)
        if len(self._waiting) >= self.max_queue + max(0, free):
            ahead = len(self._waiting) - max(0, free) + 1
            retry = max(1, math.ceil(self._duration_ewma * ahead / self.max_batch))
            raise QueueFull(f"the server is at capacity ({self.max_batch} requests generating, "
                            f"{len(self._waiting)} waiting); retry after {retry} s", retry)
        sampling = sampling or SamplingParams()
        send, receive = anyio.create_memory_object_stream[Any](math.inf)
        slot = _Slot(ids, max_tokens, sampling, send, time.monotonic())
        slot.sampler = RequestSampler(sampling, ids, self.vocab_size)
        self._waiting.append(slot)
        self._wake.set()
        return Generation(self, slot, receive)

    def _cancel(self, slot: _Slot) -> None:
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
        """The engine loop; runs until cancelled, then fails every request still in it."""
        try:
            while True:
                if not self._waiting and not self._active:
                    self._wake = anyio.Event()
                    await self._wake.wait()
                async with self._turn:
                    await self.step()
                # Let HTTP handlers and holders of paused() run between steps.
                await anyio.lowlevel.checkpoint()
        finally:
            self._fail_all(AsyncsideError("the server is shutting down"))

    def _fail_all(self, exc: BaseException) -> None:
        """Fail every admitted and waiting request with ``exc`` (the engine loop is ending)."""
        for slot in [*self._active, *self._waiting]:
            self._fail(slot, exc)
        self._active.clear()
        self._waiting.clear()
        self._forget_merged()

    async def step(self) -> None:
        """One engine step: admit, one prefill chunk's worth, one decode step, let requests leave."""
        self._leave()
        self._admit()
        used = 0
        for slot in self._prefill_order():
            if slot.cancelled or slot.done:  # left while an earlier chunk ran
                continue
            n = min(self.prefill_chunk, len(slot.todo) - 1)
            if used and used + n > self.prefill_chunk:
                continue  # a smaller one may still fit this step
            await self._prefill(slot, n)
            used += n
        batch = [s for s in self._active if not s.prefilling and not s.cancelled and not s.done and s.todo]
        if batch:
            await self._decode(batch)
        self._leave()

    def _prefill_order(self) -> list[_Slot]:
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
        while self._waiting and len(self._active) < self.max_batch:
            slot = self._waiting.popleft()
            cache, reused = self.prefix_cache.fetch(slot.prompt)
            slot.cache = cache if cache is not None else self.model.make_cache()
            slot.cached_tokens = reused
            self.cached_tokens += reused
            slot.fed = slot.prompt[:reused]
            slot.todo = slot.prompt[reused:]
            slot.predictor = self.model.forward.make_predictor(self.predictor)
            self._active.append(slot)

    async def _prefill(self, slot: _Slot, n: int) -> None:
        import mlx.core as mx

        chunk = slot.todo[:n]
        try:
            await prefill_step(self.model, mx.array(chunk)[None], slot.cache, self.source, slot.predictor)  # type: ignore[arg-type]
        except Exception as exc:
            log.exception("prefill failed")
            self._fail(slot, exc)
            return
        slot.fed.extend(chunk)
        del slot.todo[:n]
        self.prefill_tokens += n

    async def _decode(self, batch: list[_Slot]) -> None:
        import mlx.core as mx

        from .sampling import draw_step, unpack

        layout: list[tuple[int, int, int]] = []

        def sample(logits: Any) -> Any:
            values, lay = draw_step([s.sampler for s in batch], logits)
            layout.extend(lay)
            return values

        try:
            if len(batch) > 1 and self._can_merge(batch):
                batch = self._merge(batch)
                tokens = mx.array([[s.todo[0]] for s in batch])
                values = await self._merged.step(self.model, tokens, self.source, sample)
            else:
                self._unmerge()
                caches = [s.cache for s in batch]
                assert all(c is not None for c in caches), "a decoding slot has its cache when not merged"
                tokens = mx.array([[s.todo[0]] for s in batch])
                values = await rows_step(self.model, tokens, caches, self.source,  # type: ignore[arg-type]
                                         [s.predictor for s in batch], sample)
            results = unpack(values.tolist(), layout)
        except Exception as exc:
            log.exception("decode step failed")
            self._forget_merged()  # its rows may be half-updated
            for s in batch:
                self._fail(s, exc)
            return
        self.steps += 1
        self.last_batch = len(batch)
        self.peak_batch = max(self.peak_batch, len(batch))
        for s, (token, lp, alts) in zip(batch, results):
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

    def _can_merge(self, batch: list[_Slot]) -> bool:
        return all(s.cache is None or mergeable(s.cache) for s in batch)

    def _merge(self, batch: list[_Slot]) -> list[_Slot]:
        """Make the merged caches hold exactly ``batch``'s requests: drop those that left, merge
        in those that joined. Returns the batch in the merged caches' row order."""
        wanted = set(batch)
        gone = [i for i, s in enumerate(self._in_merged) if s not in wanted]
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

    def _finish(self, slot: _Slot, reason: str | None, *, keep_cache: bool = True) -> None:
        if slot.done:
            return
        slot.done = True
        slot.finish_reason = reason
        slot.todo = []
        duration = time.monotonic() - slot.submitted
        self._duration_ewma = 0.8 * self._duration_ewma + 0.2 * duration
        if keep_cache and slot.fed and self.prefix_cache.enabled:
            cache = slot.cache
            if cache is None and slot in self._in_merged:
                cache = self._merged.extract(self._in_merged.index(slot))
            if cache is not None:
                self.prefix_cache.insert(slot.fed, cache)
        slot.cache = None
        slot.send.close()

    def _fail(self, slot: _Slot, exc: BaseException) -> None:
        if slot.done:
            return
        slot.done = True
        slot.finish_reason = "error"
        slot.todo = []
        slot.cache = None
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            slot.send.send_nowait(exc)
        slot.send.close()
