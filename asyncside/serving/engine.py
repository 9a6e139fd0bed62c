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
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import anyio
import anyio.lowlevel
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..errors import AsyncsideError
from ..policies import DEFAULT_POLICY
from .health import describe_failure, fill_errors
from .prompt_cache import PrefixCache
from .protocol import SamplingParams

log = logging.getLogger("asyncside.serving")


class ServedModel(Protocol):
    """What the engine needs from a model (:class:`asyncside.models.StreamingModel` provides it).

    ``forward`` is an :class:`~asyncside.models.forward.AsyncForward` or alike, stepped as ``ctx =
    forward.context(cache, source, predictor)``, ``await forward.step(ctx, inputs, head=draw)``
    (``draw(logits)``, lazy, scheduled with the step) and ``await forward.finish(ctx, y)`` (await
    it: decode steps), prefill
    chunks as ``await forward.step(ctx, inputs (1, L), logits=False, finish=False)`` and later
    ``finish(ctx, hidden)``; with ``completed`` (await an array's computation) and
    ``make_predictor(name)``.
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
    #: the store's bad experts (:class:`~.health.HealthRegistry`); None: the app keeps one without a store
    health: Any = None


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
    host_tier: int | str = "auto",
) -> AsyncIterator[Engine]:
    """Load a converted model (the embedded default when ``model`` is None) and open its Runtime.

    ``model`` is a directory written by ``asyncside convert`` (expert store + non-expert weights
    + config + tokenizer). Runs on the serving loop: the Runtime's reap task and completion
    bridge belong to that loop. Loading is synchronous and happens before the server accepts
    connections, so it blocks nothing that is waiting. ``host_tier`` goes to the Runtime (MLX
    CUDA: pinned host memory for records faulted in, see :class:`~asyncside.runtime.Runtime`).
    """
    from ..audit import audit_problems
    from ..models import load_streaming_model
    from ..runtime import Runtime
    from .health import HealthRegistry

    store_dir = model if model is not None else embedded_store_dir(cache_dir)
    streaming = load_streaming_model(store_dir)
    store = streaming.store

    def audit() -> tuple[bool, list[str]]:
        problems = audit_problems(runtime)
        return not problems, problems

    async with Runtime(store, resident=resident, reader=reader, policy=policy, host_tier=host_tier) as runtime:
        health = HealthRegistry(store, reopen_reader=_reader_reopener(runtime))
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
                "host_tier_bytes": runtime.memory.get("host_tier_bytes", 0),
                "staging_bytes": runtime.memory.get("staging_bytes", 0),
            },
            health=health,
        )


def _reader_reopener(runtime: Any) -> Callable[[str], Any] | None:
    """The runtime's scheduler's ``reopen`` (a replaced blob's reads through the reader: io_uring's
    registered files are not reached by re-pointing descriptors), None if it has none."""
    shared = getattr(runtime, "_s", None)
    scheduler = getattr(shared, "scheduler", None) or getattr(runtime, "_scheduler", None)
    return getattr(scheduler, "reopen", None)


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


def _fresh_cache(slot: Any) -> bool:
    """Whether a request's cache is fresh mlx-lm ``KVCache`` layers (nothing fed: no cached
    prefix), the caches a joint prefill can take rows of."""
    from mlx_lm.models.cache import KVCache

    cache = slot.cache
    return bool(cache) and not slot.fed and all(type(c) is KVCache and c.keys is None for c in cache)


def _row_cache(c: Any, row: int, start: int, stop: int) -> Any:
    """Positions ``[start, stop)`` of row ``row`` of a batch layer cache (a joint prefill's
    ``KVCache`` of B rows, or a ``BatchKVCache``), copied into a ``KVCache`` of its own; an
    empty one if nothing was fed to that layer yet."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    one = KVCache()
    if c.keys is None:
        return one
    one.keys = mx.contiguous(c.keys[row:row + 1, :, start:stop])
    one.values = mx.contiguous(c.values[row:row + 1, :, start:stop])
    one.offset = stop - start
    return one


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
    that grows with the batch, on the order of a whole decode step on a GPU (BENCHMARKS.md,
    "Measurements behind code choices"). Kept merged, a step pays nothing for its caches: a
    request that joins is merged in once (:meth:`join`), one that leaves is dropped (:meth:`drop`), and its own cache is
    extracted (:meth:`extract`) only when something still needs it (the prefix cache).

    mlx-lm's ``BatchKVCache.filter`` and ``extract`` read the left padding back to the host
    (``tolist``), which waits for every step queued on the stream: with a step in flight that
    would block the event loop for the rest of that step. For ``BatchKVCache`` layers (every
    plain attention cache) the padding is therefore mirrored here on the host and ``drop`` /
    ``extract`` do the same work without reading the device (:attr:`tracked`); the results are
    mlx-lm's bit for bit (tests).
    """

    def __init__(self) -> None:
        self.layers: list[Any] | None = None  # one mlx-lm batch cache per layer
        self.size = 0
        # Per layer, each row's left padding as mlx-lm's cache holds it (BatchKVCache layers).
        self._pads: list[list[int]] = []

    @property
    def tracked(self) -> bool:
        """Whether rows can be dropped and extracted without reading the device (every layer is a
        ``BatchKVCache``, whose padding is mirrored here), so with a step still in flight."""
        from mlx_lm.models.cache import BatchKVCache

        return self.layers is None or all(type(c) is BatchKVCache for c in self.layers)

    def join(self, caches: Sequence[list[Any]]) -> None:
        """Merge requests' caches in as the last rows, in order."""
        if not caches:
            return
        new = [layer.merge([c[i] for c in caches]) for i, layer in enumerate(caches[0])]
        # A fresh merge's padding is a constant array: reading it costs nothing.
        new_pads = [self._host_pads(c) for c in new]
        if self.layers is None:
            self.layers, self._pads = new, new_pads
        else:
            pads = []
            for mine, theirs, p_mine, p_theirs in zip(self.layers, new, self._pads, new_pads):
                idx_mine, idx_theirs = getattr(mine, "_idx", 0), getattr(theirs, "_idx", 0)
                mine.extend(theirs)
                # BatchKVCache.extend right-justifies both at the longer one's index.
                top = max(idx_mine, idx_theirs)
                pads.append([p + top - idx_mine for p in p_mine] + [p + top - idx_theirs for p in p_theirs])
            self._pads = pads
        self.size += len(caches)

    @staticmethod
    def _host_pads(c: Any) -> list[int]:
        from mlx_lm.models.cache import BatchKVCache

        if type(c) is not BatchKVCache:
            return []
        return [int(x) for x in cast(list[int], c.left_padding.tolist())]

    def drop(self, rows: Sequence[int]) -> None:
        """Keep only the other rows (in their order)."""
        import mlx.core as mx
        from mlx_lm.models.cache import BatchKVCache

        gone = set(rows)
        keep = [i for i in range(self.size) if i not in gone]
        if not keep:
            self.layers, self.size, self._pads = None, 0, []
            return
        assert self.layers is not None
        index = mx.array(keep)
        for n, c in enumerate(self.layers):
            if type(c) is not BatchKVCache:
                c.filter(keep)
                continue
            # BatchKVCache.filter, with the padding taken from the host mirror.
            if c.keys is not None:
                c.keys, c.values = c.keys[index], c.values[index]
            c.offset = c.offset[index]
            pads = [self._pads[n][i] for i in keep]
            shift = min(pads)
            if shift > 0:
                if c.keys is not None:
                    c.keys, c.values = c.keys[..., shift:, :], c.values[..., shift:, :]
                c._idx -= shift
                pads = [p - shift for p in pads]
            c.left_padding = mx.array(pads)
            self._pads[n] = pads
        self.size = len(keep)

    def extract(self, row: int) -> list[Any]:
        """Row ``row``'s own cache (a copy; the batch keeps its row)."""
        from mlx_lm.models.cache import BatchKVCache

        assert self.layers is not None
        out = []
        for n, c in enumerate(self.layers):
            if type(c) is not BatchKVCache:
                out.append(c.extract(row))
                continue
            # BatchKVCache.extract, with the padding taken from the host mirror.
            out.append(_row_cache(c, row, self._pads[n][row], c._idx))
        return out

    async def launch(self, sm: ServedModel, tokens: Any, source: Any, sample: Callable[[Any], Any]
                     ) -> tuple[Any, Any]:
        """Queue one forward of the whole batch (``tokens``: (size, 1)); ``sample`` builds, from the
        last position's logits (size, vocab), what the caller reads. Returns the step's context
        and that (lazy, scheduled where the step was queued): pass both to ``forward.finish``.

        A queued step (the batch's switches resolving their experts in parts when they may not
        fit a layer's rows at once), else per layer with the union of the batch's experts served
        in groups.
        """
        assert self.layers is not None and tokens.shape[0] == self.size
        fwd = sm.forward
        ctx = fwd.context(self.layers, source)
        return ctx, await fwd.step(ctx, tokens, head=lambda logits: sample(logits[:, -1, :]))


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


@dataclass(eq=False)
class _Chunk:
    """A prefill forward queued and not awaited: its requests (several for a joint chunk), its
    step context and its final hidden state (lazy; computed already for a chunk that ran per
    layer)."""

    slots: list[_Slot]
    ctx: Any
    hidden: Any


@dataclass(eq=False)
class _Step:
    """A decode step queued and not completed: its requests in row order, its context (None: it
    was awaited already), what its sampling built (lazy) and how to unpack it."""

    batch: list[_Slot]
    ctx: Any
    values: Any
    layout: list[tuple[int, int, int]]


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
                raise GenerationFailed(f"generation failed: {describe_failure(item)}") from item
            yield item

    def cancel(self) -> None:
        """Leave the engine (no-op once finished); safe to call more than once."""
        self._batcher._cancel(self._slot)
        self._receive.close()


def _log_failure(what: str, exc: BaseException) -> None:
    """Log a failed forward: one line for the store's faults (expected: a damaged blob, named by
    layer, expert and cause), the traceback for anything else (a bug)."""
    if fill_errors(exc):
        log.error("%s: %s", what, describe_failure(exc))
    else:
        log.error("%s", what, exc_info=exc)


# --- the engine ------------------------------------------------------------------------------


class Batcher:
    """Continuous batching over one model and one expert source (see the module docstring).

    Start :meth:`run` in a task group on the serving loop; :meth:`submit` requests from any task of
    that loop.
    """

    def __init__(self, model: ServedModel, source: Any, *, predictor: str = "lookahead", max_batch: int = 32,
                 max_queue: int = 64, prefill_chunk: int | None = None, prompt_cache_size: int = 8,
                 prompt_cache_min_tokens: int = 16, run_ahead: bool = True, overlap_prefill: bool = True,
                 joint_prefill: bool = False) -> None:
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
        self._inflight: _Step | None = None  # the decode step queued last and not completed yet
        #: called with every error a request fails with (the server's health registry)
        self.on_failure: Callable[[BaseException], None] | None = None
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
        used = 0
        picked: list[tuple[_Slot, int]] = []
        for slot in self._prefill_order():
            n = min(self.prefill_chunk, len(slot.todo) - 1)
            if used and used + n > self.prefill_chunk:
                continue  # a smaller one may still fit this step
            picked.append((slot, n))
            used += n
        chunks: list[_Chunk] = []
        for group in self._prefill_groups(picked):
            group = [(slot, n) for slot, n in group if not (slot.cancelled or slot.done)]  # left meanwhile
            if not group:
                continue
            chunk = await (self._prefill(*group[0]) if len(group) == 1 else self._prefill_joint(group))
            if chunk is not None:
                chunks.append(chunk)
        prev, self._inflight = self._inflight, None
        if prev is not None:
            self._inflight = await self._launch_ahead(prev)
            failure = await self._complete(prev)
            if failure is not None and self._inflight is not None:
                # The step behind it was queued on its tokens: it goes with it.
                nxt, self._inflight = self._inflight, None
                await self._abandon(nxt, failure)
        # The stream runs prev, then the chunks, then the step launched ahead (which may hold the
        # requests whose prompts they completed, on their lazy caches): awaited in that order.
        for chunk in chunks:
            await self._finish_chunk(chunk)
        if self._inflight is None:
            batch = self._decoding()
            if batch:
                self._inflight = await self._launch(batch, None)
        self._leave()

    def _decoding(self) -> list[_Slot]:
        """The requests that take part in the next decode step, in admission order."""
        return [s for s in self._active if not s.prefilling and not s.cancelled and not s.done and s.todo]

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

    async def _prefill(self, slot: _Slot, n: int) -> _Chunk | None:
        """Queue ``slot``'s next ``n`` prompt tokens; returns the chunk to pass to
        :meth:`_finish_chunk` (None if it failed, and the request with it).

        A queued chunk is not awaited here: the decode step is built (and launched ahead) while
        the stream computes it, the requests it completes joining that step on their lazy caches.
        A chunk that runs per layer (a source without queued steps) is computed when this returns.
        """
        import mlx.core as mx

        tokens = slot.todo[:n]
        started = time.perf_counter()
        fwd = self.model.forward
        try:
            ctx = fwd.context(slot.cache, self.source, slot.predictor)
            h = await fwd.step(ctx, mx.array(tokens)[None], logits=False, finish=False)
        except Exception as exc:
            _log_failure("prefill failed", exc)
            self._fail(slot, exc)
            return None
        finally:
            self.prefill_chunks += 1
            self.prefill_seconds += time.perf_counter() - started
        slot.fed.extend(tokens)
        del slot.todo[:n]
        self.prefill_tokens += n
        chunk = _Chunk([slot], ctx, h)
        if not self.overlap_prefill:
            await self._finish_chunk(chunk)
            return None
        return chunk

    def _prefill_groups(self, picked: list[tuple[_Slot, int]]) -> list[list[tuple[_Slot, int]]]:
        """This step's chunks as forwards, in order: requests whose chunk is the first of a fresh
        prompt (an empty cache of mlx-lm's plain ``KVCache``) share one joint forward while its
        padded size (requests x the longest chunk) stays within ``prefill_chunk``; every other
        chunk is a forward of its own."""
        if not self.joint_prefill:
            return [[p] for p in picked]
        fresh = sorted((p for p in picked if _fresh_cache(p[0])), key=lambda p: p[1])
        joint: list[tuple[_Slot, int]] = []
        for p in fresh:  # shortest first: the most requests per padded token
            if (len(joint) + 1) * p[1] > self.prefill_chunk:
                break
            joint.append(p)
        if len(joint) < 2:
            return [[p] for p in picked]
        inside = {id(p[0]) for p in joint}
        return [joint] + [[p] for p in picked if id(p[0]) not in inside]

    async def _prefill_joint(self, group: list[tuple[_Slot, int]]) -> _Chunk | None:
        """Queue the first chunks of several fresh prompts as one forward; returns it as one
        :class:`_Chunk` (None if it failed, and its requests with it).

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
        fwd = self.model.forward
        try:
            layers = len(cast(list[Any], group[0][0].cache))
            # Plain caches of B rows: every row starts at position 0 and the mask is the plain
            # causal one, exactly as a single prompt's prefill has them.
            batch = [KVCache() for _ in range(layers)]
            ctx = fwd.context(batch, self.source)
            h = await fwd.step(ctx, mx.array(rows), logits=False, finish=False)
        except Exception as exc:
            _log_failure("prefill failed", exc)
            for slot, _ in group:
                self._fail(slot, exc)
            return None
        finally:
            self.prefill_chunks += 1
            self.prefill_joined += len(group)
            self.prefill_seconds += time.perf_counter() - started
        for i, (slot, n) in enumerate(group):
            slot.cache = [_row_cache(c, i, 0, n) for c in batch]
            slot.fed.extend(slot.todo[:n])
            del slot.todo[:n]
            self.prefill_tokens += n
        chunk = _Chunk([slot for slot, _ in group], ctx, h)
        if not self.overlap_prefill:
            await self._finish_chunk(chunk)
            return None
        return chunk

    async def _finish_chunk(self, chunk: _Chunk) -> None:
        """Await a prefill forward queued by :meth:`_prefill` or :meth:`_prefill_joint`; its
        requests fail if it did (a decode step queued on their caches hands them nothing: they
        are done)."""
        if self._inflight is not None:
            self.chunks_overlapped += 1
        started = time.perf_counter()
        try:
            await self.model.forward.finish(chunk.ctx, chunk.hidden)
        except Exception as exc:
            _log_failure("prefill failed", exc)
            for slot in chunk.slots:
                self._fail(slot, exc)
        finally:
            self.prefill_seconds += time.perf_counter() - started

    # -- decode steps -----------------------------------------------------------------------

    async def _launch_ahead(self, prev: _Step) -> _Step | None:
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

    async def _launch(self, batch: list[_Slot], prev: _Step | None) -> _Step | None:
        """Build and queue one decode step over ``batch`` (each request's input: its last token on
        the host, or for a request in ``prev``, ``prev``'s lazy token); returns it, not awaited.
        None if it failed (its requests failed with it)."""
        from .sampling import draw_step

        layout: list[tuple[int, int, int]] = []

        def sample(logits: Any) -> Any:
            values, lay = draw_step([s.sampler for s in batch], logits)
            layout.extend(lay)
            return values

        started = time.perf_counter()
        try:
            if len(batch) > 1 and self._can_merge(batch):
                batch = self._merge(batch)
                ctx, values = await self._merged.launch(self.model, self._inputs(batch, prev), self.source, sample)
            else:
                self._unmerge()
                tokens = self._inputs(batch, prev)
                if len(batch) == 1:
                    (s,) = batch
                    fwd = self.model.forward
                    ctx = fwd.context(s.cache, self.source, s.predictor)
                    values = await fwd.step(ctx, tokens, head=lambda logits: sample(logits[:, -1, :]))
                else:  # caches without a batched form: one after the other, awaited here
                    caches = [s.cache for s in batch]
                    assert all(c is not None for c in caches), "a decoding slot has its cache when not merged"
                    ctx, values = None, await rows_step(self.model, tokens, caches, self.source,  # type: ignore[arg-type]
                                                        [s.predictor for s in batch], sample)
        except Exception as exc:
            _log_failure("decode step failed", exc)
            self._forget_merged()  # its rows may be half-updated
            for s in batch:
                self._fail(s, exc)
            return None
        finally:
            self.launch_seconds += time.perf_counter() - started
        return _Step(batch, ctx, values, layout)

    def _inputs(self, batch: list[_Slot], prev: _Step | None) -> Any:
        """The step's input tokens (B, 1): each request's last token, lazy from ``prev`` for the
        requests in it (their token as ``prev`` sampled it, exactly: ids below 2**24 are exact in
        the packed float32 draws), from the host for the others."""
        import mlx.core as mx

        if prev is None:
            return mx.array([[s.todo[0]] for s in batch])
        at = {s: lay[0] for s, lay in zip(prev.batch, prev.layout)}
        host = [s.todo[0] for s in batch if s not in at]
        index, extra = [], prev.values.shape[0]
        for s in batch:
            if s in at:
                index.append(at[s])
            else:
                index.append(extra)
                extra += 1
        values = prev.values if not host else mx.concatenate([prev.values, mx.array(host, dtype=mx.float32)])
        return values[mx.array(index)].astype(mx.int32).reshape(-1, 1)

    async def _complete(self, step: _Step) -> BaseException | None:
        """Await ``step``, hand each request its token, let finished requests go; returns the
        error the step failed with (its requests failed with it), or None."""
        from .sampling import unpack

        started = time.perf_counter()
        try:
            if step.ctx is not None:
                await self.model.forward.finish(step.ctx, step.values)
            results = unpack(step.values.tolist(), step.layout)
        except Exception as exc:
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
        return None

    async def _abandon(self, step: _Step, failure: BaseException) -> None:
        """``step`` was queued on the tokens of a step that failed: wait until the stream is done
        with it (so the expert source has learned what it did), then fail its requests."""
        if step.ctx is not None:
            with contextlib.suppress(Exception):
                await self.model.forward.finish(step.ctx, step.values)
        self._forget_merged()
        for s in step.batch:
            self._fail(s, failure)

    def _can_merge(self, batch: list[_Slot]) -> bool:
        return all(s.cache is None or mergeable(s.cache) for s in batch)

    def _merge(self, batch: list[_Slot]) -> list[_Slot]:
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

    def _finish(self, slot: _Slot, reason: str | None, *, keep_cache: bool = True) -> None:
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

    def _fail(self, slot: _Slot, exc: BaseException) -> None:
        if slot.done:
            return
        if self.on_failure is not None:
            try:
                self.on_failure(exc)
            except Exception:  # the health registry must not take a request's failure path down
                log.exception("recording a failure failed")
        slot.done = True
        slot.finish_reason = "error"
        slot.todo = []
        slot.cache = None
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            slot.send.send_nowait(exc)
        slot.send.close()
