"""The streaming model: an mlx-lm MoE model whose experts come from an ExpertSource.

:class:`StreamingModel` is what users hold: ``await sm(tokens, cache)`` gives logits like an
mlx-lm model's ``model(tokens, cache)`` (awaited instead of lazy), ``sm.make_cache()`` makes its
KV cache, and ``sm.generate(...)`` streams greedy tokens exactly as mlx-lm's ``generate_step``.
"""

from __future__ import annotations

import asyncio
import numbers
import os
import sys
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import anyio
import anyio.lowlevel
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from ..bridge import Completed
from ..errors import AsyncsideError
from ..kv_layout import model_kv_layout
from ..memory import describe_bytes
from ..routing import RoutingTrace as TraceFile
from .arch import Arch
from .forcing import RoutingReplay, RoutingReplayError, load_replay
from .forward import AsyncForward, ForwardOptions, StepMode, default_completed
from .pooled import SwitchSpec
from .predict import check_predictor
from .source import ExpertSource
from .trace import RoutingTrace

#: mlx-lm's generate_step default; prefill is chunked identically so numerics match.
PREFILL_STEP_SIZE = 2048


#: Decode steps between two clears of MLX's buffer cache (mlx-lm's generate_step's period).
_CLEAR_CACHE_EVERY = 256


def greedy(logits: mx.array) -> mx.array:
    """The greedy token of the last position (lazy), as mlx-lm's generate_step computes it."""
    logits = logits[:, -1, :]
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    return mx.argmax(logprobs, axis=-1)


def _evaluate_buffers(model: nn.Module) -> None:
    """Evaluate the arrays a model's modules keep outside their parameters (deepseek_v2's and
    hunyuan's rotary frequencies, computed lazily at construction). MLX's streams belong to the
    thread that made them: left lazy, such an array fails the first forward run on another
    thread (asyncside.load's loop thread) with "There is no Stream(cpu, 0) in current thread"."""
    # A module keeps an array attribute as an item, a private one (``_freqs``) too, which its
    # parameters() leave out. Only those: evaluating the parameters would load what a lazily
    # loaded model leaves unloaded (a pipeline stage's other layers).
    held = [v for m in model.modules() for k, v in (*m.items(), *vars(m).items())
            if k.startswith("_") and isinstance(v, mx.array)]
    if held:
        mx.eval(held)


class StreamingModel:
    """An mlx-lm MoE model whose experts come from an ExpertSource; greedy async generation.

    ``model`` is the mlx-lm module with every switch layer replaced by a PooledSwitch (no expert
    weights). ``options`` sets how decode steps run (:class:`ForwardOptions`; by default queued
    steps where the source allows). Concurrent :meth:`generate` calls are safe: each step runs
    under one fair lock, so requests interleave token by token.
    """

    def __init__(self, model: nn.Module, *, arch: Arch, moe: dict[int, tuple[nn.Module, str]],
                 specs: dict[int, SwitchSpec], tokenizer: Any, config: dict[str, Any], model_id: str,
                 store: Any = None, completed: Completed | None = None,
                 prefill_step_size: int = PREFILL_STEP_SIZE, options: ForwardOptions | None = None) -> None:
        self.model = model
        _evaluate_buffers(model)
        self.arch = arch
        self.tokenizer = tokenizer
        self.config = config
        self.model_id = model_id
        self.store = store
        self.prefill_step_size = prefill_step_size
        self.options = options or ForwardOptions()
        #: the source ``await sm(tokens, cache)`` reads experts from when none is passed
        self.source: ExpertSource | None = None
        self._completed = completed
        self._forwards: dict[ForwardOptions, AsyncForward] = {}
        self._moe = moe
        self._specs = specs
        self._lock: tuple[object, anyio.Lock] | None = None
        #: routing replay of every step (see :meth:`set_routing`)
        self.routing: RoutingReplay | None = None
        self._kv = _KVReservations()

    @property
    def moe_layers(self) -> list[int]:
        """Decoder layer indices that route experts (the store's layer indices)."""
        return sorted(self._moe)

    def set_routing(self, routing: RoutingReplay | TraceFile | str | os.PathLike[str] | None, *,
                    sequence: int = 0, source: str | None = None) -> RoutingReplay | None:
        """Replay a routing trace in every later step (a :class:`RoutingReplay`, or a trace, in memory
        (:class:`asyncside.RoutingTrace`) or a file, fitted to this model); None: the router routes
        again. Returns the replay (:mod:`.forcing`). ``source``: how messages name a trace in memory
        (the file it was read from; default ``<in memory>``)."""
        if routing is not None:
            n_experts = int(self.store.layer(self.moe_layers[0]).n_experts) if self.store is not None \
                else _config_experts(self.config)
            if isinstance(routing, RoutingReplay):
                # Another model's replay routed this one to its ids and top-k without a word (or
                # failed deep in a step).
                problem = self.routing_misfit(routing)
                if problem is not None:
                    raise RoutingReplayError(problem)
            elif isinstance(routing, TraceFile):
                routing = RoutingReplay.for_model(routing, self.model, self._moe, n_experts, sequence=sequence,
                                                  source=source or "<in memory>")
            elif isinstance(routing, (str, os.PathLike)):
                routing = load_replay(routing, self.model, self._moe, n_experts, sequence=sequence)
            else:
                raise TypeError(f"set_routing: expected a RoutingReplay, an asyncside.RoutingTrace, a trace file's "
                                f"path or None, got {type(routing).__name__}")
        self.routing = routing
        for fwd in self._forwards.values():
            fwd.routing = routing
        return routing

    def routing_misfit(self, replay: RoutingReplay) -> str | None:
        """Why ``replay`` cannot drive this model (None: it was fitted to its MoE layers, experts and
        top-k), in the words a refusal gives."""
        n_experts = int(self.store.layer(self.moe_layers[0]).n_experts) if self.store is not None \
            else _config_experts(self.config)
        return replay.misfit(self._moe, n_experts)

    def forward_with(self, options: ForwardOptions | None = None) -> AsyncForward:
        """The forward for ``options`` (this model's own by default); one per distinct options."""
        options = options or self.options
        fwd = self._forwards.get(options)
        if fwd is None:
            completed = self._completed or default_completed()
            fwd = self._forwards[options] = AsyncForward(self.model, self.arch, self._moe, self._specs, completed,
                                                         options)
            fwd.routing = self.routing
        return fwd

    @property
    def forward(self) -> AsyncForward:
        """The forward with this model's own options."""
        return self.forward_with(self.options)

    def make_cache(self) -> list[Any]:
        """A fresh KV cache for one sequence, as mlx-lm's ``make_prompt_cache`` builds it."""
        return make_prompt_cache(self.model)

    def resident_source(self) -> Any:
        """All-resident baseline source: every expert of the store read into pools."""
        from .source import ResidentSource

        if self.store is None:
            raise AsyncsideError("this StreamingModel has no expert store to read the experts from")
        return ResidentSource.from_store(self.store)

    async def __call__(self, inputs: mx.array, cache: list[Any] | None = None, *,
                       source: ExpertSource | None = None) -> mx.array:
        """The logits (B, L, vocab) of ``inputs`` (B, L), computed, updating ``cache`` — what an
        mlx-lm model's ``model(inputs, cache)`` returns, awaited. Experts come from ``source``
        (default: :attr:`source`). Without a cache the step sees no earlier tokens."""
        src = source if source is not None else self.source
        if src is None:
            raise AsyncsideError("no expert source: pass source=... or set StreamingModel.source")
        if inputs.ndim != 2:
            raise ValueError(f"inputs: expected shape (batch, tokens), got {tuple(inputs.shape)}")
        if cache is not None and len(cache) < len(self.model.layers):
            # A prompt cache of another model (load_prompt_cache of its file) failed with an
            # IndexError deep in the walk; mlx-lm's own model silently skips the layers left over.
            raise ValueError(f"cache: {len(cache)} layer caches for a model of {len(self.model.layers)} decoder "
                             f"layers (a prompt cache made for another model?); make_prompt_cache(model) makes "
                             f"this model's")
        async with self._step_lock():
            return await self.forward(inputs, self.make_cache() if cache is None else cache, src)

    def _step_lock(self) -> anyio.Lock:
        """The fair per-step lock of the current event loop (a new loop gets a new lock).

        Taken without a checkpoint when free (``fast_acquire``): generation takes it three times a
        token, and each checkpoint is a trip around the event loop, on a GPU (where decode is bound
        by the host) a few percent of a token. Still fair: a release hands the lock to the oldest
        waiter, and a step always awaits the stream in between."""
        token = anyio.lowlevel.current_token()
        if self._lock is None or self._lock[0] != token:
            self._lock = (token, anyio.Lock(fast_acquire=True))
        return self._lock[1]

    async def generate(self, prompt_ids: Sequence[int], *, max_tokens: int, source: ExpertSource,
                       predictor: str = "lookahead", trace: RoutingTrace | None = None,
                       stop_at_eos: bool = True, options: ForwardOptions | None = None) -> AsyncIterator[int]:
        """Greedy generation; yields token ids (an EOS token ends the stream and is not yielded).

        Mirrors mlx-lm's ``generate_step`` (prefill ``prompt[:-1]`` in chunks of
        ``prefill_step_size``, then the last prompt token, then one token per step; argmax of
        log-probabilities), so tokens equal :func:`reference_generate` on the full model. Queued
        steps run one step ahead like mlx-lm does: the next step is queued on the previous step's
        lazy token before that token is awaited.

        Under a memory budget the KV cache of the prompt and ``max_tokens`` is counted against the
        plan's KV allowance (:attr:`asyncside.runtime.MemoryPlan.kv_allowance_bytes`): a generation
        whose cache alone would pass it is refused (AsyncsideError, before the first step), and one
        that does not fit beside generations already running waits for one to end.
        """
        ids = checked_prompt_ids(prompt_ids, _config_vocab(self.config))
        # A str or None failed on a comparison, 2.5 in range(), and True ran one token.
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, numbers.Integral) or max_tokens < 0:
            raise ValueError(f"max_tokens: expected a number of tokens >= 0 (an int), got {max_tokens!r}")
        # None, a path or a store failed deep in the first step, with an AttributeError.
        if not isinstance(source, ExpertSource):
            raise TypeError(f"source: expected an expert source (a running asyncside.Runtime: `async with "
                            f"Runtime(store) as rt`, then source=rt), got {type(source).__name__}")
        if options is not None and not isinstance(options, ForwardOptions):
            raise TypeError(f"options: expected an asyncside.ForwardOptions or None, got {type(options).__name__}")
        if trace is not None and not isinstance(trace, RoutingTrace):
            raise TypeError(f"trace: expected a RoutingTrace recorder (asyncside.models.trace) or None, got "
                            f"{type(trace).__name__}; replay a routing trace with sm.set_routing(...)")
        check_predictor(predictor)
        kv_need = self.kv_need(getattr(source, "plan", None), len(ids), max_tokens)
        fwd = self.forward_with(options)
        pred = fwd.make_predictor(predictor)
        lock = self._step_lock()
        eos = set(getattr(self.tokenizer, "eos_token_ids", ()) or ()) if stop_at_eos else set()
        if kv_need is not None:
            await self._kv.acquire(*kv_need)
        try:
            async for tok in self._generate(ids, max_tokens, source, fwd, pred, lock, eos, trace):
                yield tok
        finally:
            if kv_need is not None:
                self._kv.release(kv_need[0])

    async def _generate(self, ids: list[int], max_tokens: int, source: ExpertSource, fwd: AsyncForward, pred: Any,
                        lock: anyio.Lock, eos: set[int], trace: RoutingTrace | None) -> AsyncIterator[int]:
        cache = self.make_cache()
        prompt = mx.array(ids)
        while prompt.size > 1:
            n = prompt_chunk(source, min(self.prefill_step_size, prompt.size - 1), cached=len(ids) - prompt.size)
            async with lock:
                await fwd.step(fwd.context(cache, source, pred, trace), prompt[:n][None], logits=False)
            prompt = prompt[n:]
            mx.clear_cache()
        if max_tokens == 0:
            return
        inputs = prompt[None]
        async with lock:
            ctx = fwd.context(cache, source, pred, trace)
            y = await fwd.step(ctx, inputs, head=greedy)
        for n in range(max_tokens):
            ahead = None
            if n + 1 < max_tokens and ctx.routed:
                # A queued step: queue the next one on this step's lazy token before awaiting it,
                # so the stream goes on while the host hands this token out.
                async with lock:
                    nctx = fwd.context(cache, source, pred, trace)
                    if fwd.kind(nctx, y[None]) is StepMode.QUEUED:
                        ahead = (nctx, await fwd.step(nctx, y[None], head=greedy))
            async with lock:
                await fwd.finish(ctx, y)
            tok = int(y)
            if tok in eos:
                return
            yield tok
            if n + 1 == max_tokens:
                return
            if n % _CLEAR_CACHE_EVERY == 0:
                # As mlx-lm's generate_step does: the buffers of each size the KV cache outgrew
                # stay in MLX's cache, whose limit off the CPU is the device's memory, so a long
                # generation's cache grew without bound past the plan's headroom.
                mx.clear_cache()
            if ahead is None:
                async with lock:
                    ctx = fwd.context(cache, source, pred, trace)
                    y = await fwd.step(ctx, mx.array([[tok]]), head=greedy)
            else:
                ctx, y = ahead


    def kv_need(self, plan: Any, prompt_tokens: int, max_tokens: int) -> tuple[int, int] | None:
        """(a generation's KV cache at worst, the allowance) under the memory ``plan`` (a
        :class:`~asyncside.runtime.MemoryPlan`; None: no plan); None where the plan bounds no KV
        cache (no budget) or the config does not say the cache's size. AsyncsideError where the
        cache alone would pass the allowance: the budget would not hold the generation, so
        :meth:`generate` refuses it before its first step rather than run past the budget."""
        allowance = getattr(plan, "kv_allowance_bytes", None)
        if not isinstance(allowance, int):
            return None
        try:
            layout = model_kv_layout(self)
        except AsyncsideError:
            return None
        need = layout.bytes_for(prompt_tokens + max_tokens, self.prefill_step_size)
        if need > allowance:
            most = plan.kv_tokens(layout, self.prefill_step_size)
            fits = (f"at most {most - prompt_tokens} new tokens fit after this prompt" if most > prompt_tokens
                    else f"not even the prompt fits ({most} positions do)")
            raise AsyncsideError(
                f"max_tokens={max_tokens} after a prompt of {prompt_tokens} tokens may need {describe_bytes(need)} of "
                f"KV cache ({layout.bytes_per_token:,} bytes a position, allocated {layout.step} at a time), past "
                f"the KV allowance of {describe_bytes(allowance)} under the memory budget "
                f"({getattr(plan, 'source', 'memory=')}): {fits}; ask for fewer tokens or a larger memory budget")
        return need, allowance


class _KVReservations:
    """The KV caches of one model's generations running at once, against a plan's allowance: a
    generation whose cache would not fit beside the others' waits until one ends.

    A model may generate on several event loops at once (a thread each, with a Runtime of its
    own): the count is guarded by a lock, and a waiter is woken on its own loop's thread. An
    ``anyio.Event`` set from another loop's thread never woke its asyncio waiter (the loop slept
    on), and failed an assertion inside trio."""

    def __init__(self) -> None:
        self.held = 0
        self._lock = threading.Lock()
        self._waiters: list[tuple[anyio.Event, Callable[[Callable[[], object]], object]]] = []

    async def acquire(self, need: int, allowance: int) -> None:
        """Count ``need`` bytes in, waiting while they do not fit beside what is held."""
        while True:
            with self._lock:
                if not self.held or self.held + need <= allowance:
                    self.held += need
                    return
                waiter = (anyio.Event(), _soon_on_this_loop())
                self._waiters.append(waiter)
            try:
                await waiter[0].wait()
            finally:
                with self._lock:
                    if waiter in self._waiters:
                        self._waiters.remove(waiter)

    def release(self, need: int) -> None:
        """Count ``need`` bytes out and wake the waiters (each checks again). Synchronous: it runs
        where an abandoned generation is closed, which may not await."""
        with self._lock:
            self.held -= need
            waiters, self._waiters = self._waiters, []
        for event, soon in waiters:
            try:
                soon(event.set)
            except RuntimeError:  # its loop has closed: nobody waits there any more
                pass


def _soon_on_this_loop() -> Callable[[Callable[[], object]], object]:
    """How another thread runs a callback on the running event loop's thread (asyncio's
    ``call_soon_threadsafe``, trio's ``run_sync_soon``); safe from the loop's own thread too."""
    loop = asyncio._get_running_loop()
    if loop is not None:
        return loop.call_soon_threadsafe
    trio = sys.modules["trio"]  # not asyncio: anyio runs on trio
    soon: Callable[[Callable[[], object]], object] = trio.lowlevel.current_trio_token().run_sync_soon
    return soon


def outside_vocabulary(ids: Any, vocab: int | None) -> int | None:
    """The first of the token ids ``ids`` (a sequence or an integer array) outside ``[0, vocab)``
    (``vocab`` None: only a negative id is), else None. The embedding does not check its ids: one
    past its table reads memory that is not its own (garbage tokens, or the process dies of SIGSEGV)."""
    a = np.asarray(ids).reshape(-1)
    out = (a < 0) if vocab is None else ((a < 0) | (a >= vocab))
    hit = np.flatnonzero(out)
    return int(a[hit[0]]) if hit.size else None


def checked_prompt_ids(prompt_ids: Any, vocab: int | None) -> list[int]:
    """``prompt_ids`` as a list of ints, refused (ValueError or TypeError naming the argument) where
    it is no flat sequence of integer ids, is empty, or holds an id outside the model's vocabulary
    (``vocab``; None: unknown). Every entry that generates from token ids checks them here."""
    ids = _prompt_list(prompt_ids)
    if not ids:
        raise ValueError("prompt_ids is empty: generation needs at least one prompt token")
    bad = outside_vocabulary(ids, vocab)
    if bad is not None:
        raise ValueError(f"prompt_ids holds token id {bad}, outside the model's vocabulary "
                         f"[0, {vocab if vocab is not None else '...'})")
    return ids


def _prompt_list(prompt_ids: Any) -> list[int]:
    """``prompt_ids`` as a list of ints: a flat sequence (or array) of integer token ids, else a
    ValueError or TypeError naming the argument. Text ended in int()'s "invalid literal", a float id
    was truncated to another token without a word, a nested list failed in int()."""
    if isinstance(prompt_ids, (str, bytes)):
        raise TypeError(f"prompt_ids: expected token ids (ints), got {type(prompt_ids).__name__}; "
                        "encode text first: sm.tokenizer.encode(text)")
    try:
        ids = np.asarray(prompt_ids)
    except Exception as exc:  # an object numpy cannot make an array of says why itself
        raise TypeError(f"prompt_ids: expected a sequence of token ids (ints), got {type(prompt_ids).__name__} "
                        f"({exc})") from None
    if ids.ndim != 1 or not (ids.size == 0 or ids.dtype.kind in "iu"):
        what = f"{ids.ndim}-d" if ids.ndim != 1 else f"of {ids.dtype}"
        raise TypeError(f"prompt_ids: expected a flat sequence of token ids (ints), got {type(prompt_ids).__name__} "
                        f"{what}")
    return [int(t) for t in ids.tolist()]


def prompt_chunk(source: ExpertSource, want: int, cached: int) -> int:
    """How many of ``want`` prompt tokens one forward after ``cached`` positions takes: what the
    source's memory plan allows (:meth:`asyncside.runtime.MemoryPlan.prompt_chunk`), else ``want``."""
    plan = getattr(source, "plan", None)
    bound = getattr(plan, "prompt_chunk", None)
    return int(bound(want, cached)) if callable(bound) else want


def _config_vocab(config: dict[str, Any]) -> int | None:
    """The vocabulary size of an mlx-lm config (its text section where it nests one); None if unsaid."""
    for scope in (config, config.get("text_config")):
        if isinstance(scope, dict) and isinstance(scope.get("vocab_size"), int):
            return int(scope["vocab_size"])
    return None


def _config_experts(config: dict[str, Any]) -> int:
    """Experts per MoE layer from an mlx-lm config (the keys the supported architectures use)."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"):
        if isinstance(config.get(key), int):
            return int(config[key])
    raise RoutingReplayError(f"config.json names no expert count (num_experts / num_local_experts / "
                             f"n_routed_experts / moe_num_experts): keys {sorted(config)}")
