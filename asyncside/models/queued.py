"""Queued steps: one step queued per token, expert misses served inside the stream.

The step is built like mlx-lm's own forward, op for op, except that each MoE block gathers from
the pools through the source's ``expert_rows(layer, ids)`` node: when the stream reaches it, the
routed experts are mapped to pool rows, and an expert without a row is read into a row the ledger
lent for it right there, before the gather that depends on it runs (see
``native/expert_faults.h``). The host queues the whole step once and awaits only its token: no
host round trip between layers, no recomputation, no speculation to check.

The host's work per step besides building the graph: ``source.begin_step`` (learn what earlier
steps did, top up the lent rows) before the step is built, ``source.end_step`` after it is
scheduled, and ``source.after_step`` once its token was awaited.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast, runtime_checkable

import anyio.lowlevel
import mlx.core as mx
import numpy as np

import asyncside._native as _native  # absolute: a relative import resolves through the lazy front door in mypy

from ..bridge import Armed, Completed, current_queue
from .pooled import SORT_THRESHOLD, pooled_switch_apply, route_and_apply
from .predict import PREDICTION_COUNTERS, Predictor, count_prediction
from .walk import DecoderWalk, StepContext

#: a queued step routes at most this many tokens (B x L) at once; longer steps go per layer
MAX_QUEUED_TOKENS = 512

#: a queued step of at least this many tokens per sequence (a prefill chunk) is built layer by
#: layer with a checkpoint between layers
LONG_STEP_TOKENS = 16

#: a queued step's switch resolves its experts in at most this many parts per layer (each part a
#: fault node on the stream); a step that would need more goes per layer
MAX_RESOLVES_PER_LAYER = 64

#: a decode step's switch is staged (where the source stages and its experts exceed the lent
#: rows) only when it routes at least this many pairs per expert of the layer: then it routes
#: nearly every expert (128 pairs over 64 experts: ~86% of them), and faulting them into rows
#: would only cycle the batch's working set out. A smaller batch faults its misses into rows as
#: usual, so that its working set stays in the pools (staged, a step's misses would be copied
#: from the host tier again every step). A prefill chunk is always staged.
STAGE_DECODE_PAIRS_PER_EXPERT = 2

#: a streamed switch prefetches the next MoE layer's predicted experts only while at least this
#: share of the records its prefetches read were then routed (decayed over steps): a read nobody
#: routes costs the disk time this layer's own reads wait for, and evicts a row that might have
#: hit; one routed saves only the wait for its read. Below it, prefetching lost on this machine's
#: CPU and above it gained (BENCHMARKS.md, "Prefetch inside queued steps").
PREFETCH_MIN_USE = 0.65
#: prefetch reads counted before that share is trusted (until then the prefetch runs)
PREFETCH_PROBATION_READS = 64
#: per step, the counts keep this much of their weight, prefetching or not: a predictor that
#: turned poor is followed within tens of steps, and one switched off is tried again once its
#: counts decayed below the probation (about every hundred steps)
PREFETCH_DECAY = 0.98

#: on the CPU, a decode step's graph is built with a checkpoint every this many layers (0: none).
#: A whole step's build is more Python on the loop thread than a loop should stay blocked; of none,
#: every 4, every 2 and every layer, one a layer gave the demo the lowest loop lag, decode speed
#: unchanged (BENCHMARKS.md, "Loop lag"). On a GPU the build is the step's critical path and runs whole.
DECODE_CHECKPOINT_LAYERS = 1

#: on the CPU, the most host time (ns) one hand-over of a step's graph to MLX may take before the
#: loop runs again (0: none). MLX's encoding of a chunk under its throttle (up to 50 nodes), and the
#: last layer's build, the graph walk and the first chunk together, were with the graph's release
#: (native/graph_release.h) the longest spans behind the demo's loop lag; both cut them
#: (BENCHMARKS.md, "Loop lag").
SCHEDULE_SLICE_NS = 500_000

#: on the CPU, a decode step's layer of at most this many graph nodes is handed to MLX in one call
#: (see QueuedSteps._schedule); a decode layer of the models here is well under it, and its
#: encoding about one :data:`SCHEDULE_SLICE_NS`
WHOLE_LAYER_NODES = 256


#: off the CPU, MLX's cache of freed buffers is emptied after a queued step once it holds more than
#: this many times what it held CACHE_FLOOR_STEP queued steps after it was last emptied (see
#: QueuedSteps.bound_cache)
CACHE_GROWTH_BOUND = 2
#: the queued step after a clear whose cache the bound is a multiple of: the first steps after a
#: clear find the cache empty, the third finds in it what every step takes again
CACHE_FLOOR_STEP = 3


@runtime_checkable
class QueuedSource(Protocol):
    """What an expert source offers for queued steps (``Runtime`` and ``ResidentSource`` do).

    - ``queued_ready(pairs)``: whether a step routing up to ``pairs`` pairs per layer can be queued.
    - ``queued_capacity(decode_tokens)``: how many distinct experts every layer can hold for one
      expert resolve (a step whose batch routes more is split into resolves of that many at most);
      ``decode_tokens`` is the step's tokens when it is a decode step (one per sequence), else None.
    - ``begin_step(pairs)``: called before the step is built (never blocks); returns the step's id
      (kept in the step context's ``step``) or None.
    - ``expert_rows(layer, ids)``: lazy uint32 pool rows of the routed ids, resolved on the stream.
    - ``end_step(out)``: the step whose last output is ``out`` is built (called before it is scheduled).
    - ``abandon_step()``: the step begun will not be scheduled (its build raised or was cancelled).
    - ``after_step(step)``: the output of the step ``begin_step`` named ``step`` was awaited
      (None: a step not named); raises the FillError of a fault that step read.
    - ``quiesce()``: await every queued step and give the rows back to the per-layer paths.

    Optional (``Runtime`` has them): ``streams_misses(layer)`` / ``can_stream(layer)``, whether a
    small switch of the layer should / can stream its misses; ``begin_rows(layer, ids)`` /
    ``finish_rows(layer, ids, rows)``, the streamed form of ``expert_rows``;
    ``prefetch_rows(layer, ids, after)``, a prediction's reads started on the stream (see
    :func:`_streamed_switch`), and ``prefetch_counts()``, the records prefetched and of them
    routed; ``staging(layer)``, the layer's whole-layer staging arrays or None;
    ``staged_rows(layer, ids)``, lazy rows of the ids in them, every routed expert copied there on
    the stream; ``staged_done(out)``, the output of the switch that read them.
    """

    def queued_ready(self, pairs: int) -> bool: ...
    def queued_capacity(self, decode_tokens: int | None = None) -> int: ...
    def begin_step(self, pairs: int) -> int | None: ...
    def expert_rows(self, layer: int, ids: mx.array) -> mx.array: ...
    def end_step(self, out: mx.array) -> None: ...
    def abandon_step(self) -> None: ...
    def after_step(self, step: int | None = None) -> None: ...
    async def quiesce(self) -> None: ...


#: a routed id naming no expert (the native fault node maps it to row 0, without a fault or a use)
NO_EXPERT = 0xFFFFFFFF


class QueuedSteps:
    """Decode steps queued whole, misses served by the source inside the stream."""

    def __init__(self, walk: DecoderWalk, completed: Completed, counters: dict[str, int], *, bridged: bool,
                 expert_slices: bool = True, staged_switches: bool = True, streamed_switch: bool | None = None,
                 arm: Callable[[mx.array], Armed] | None = None) -> None:
        self.walk = walk
        self.completed = completed
        #: the bridge's ``arm`` when ``completed`` is the bridge's own (else None: the injected
        #: completion is awaited as it is)
        self.arm = arm
        self.counters = counters
        self._bridged = bridged
        self._expert_slices = expert_slices
        self._staged_switches = staged_switches
        self._streamed_switch = streamed_switch
        self._is_queued: dict[type, bool] = {}
        self._on_cpu = mx.default_device() == mx.cpu
        #: on the CPU, steps go to MLX past its eval throttle (see _schedule)
        self._lend = self._on_cpu
        #: host time spent on queued steps, in ns, by phase (``asyncside bench step`` reads it):
        #: ``begin`` (source.begin_step), ``build`` (the graph, checkpoints included), ``end``
        #: (source.end_step), ``plan`` (walking the graph), ``schedule`` (handing it to MLX:
        #: ``async_eval``, on a GPU the encoding of every kernel), and ``steps``
        self.host_ns = {"begin": 0, "build": 0, "end": 0, "plan": 0, "schedule": 0, "steps": 0}
        for key in PREDICTION_COUNTERS:  # precision and recall of the predictions prefetched from
            counters.setdefault(key, 0)
        #: the prefetches' recent use (decayed counts: records read, of them routed), which decides
        #: whether streamed switches prefetch (see :meth:`prefetching`); the source's totals at the
        #: last count
        self._recent = [0.0, 0.0]
        self._totals = (0, 0)
        #: queued steps since MLX's cache was last emptied here, and what it held
        #: :data:`CACHE_FLOOR_STEP` steps after that (see bound_cache)
        self._since_clear = 0
        self._cache_floor = 0

    def pairs(self, inputs: mx.array) -> int:
        """(token, expert) pairs one MoE layer routes for ``inputs`` at most."""
        return int(inputs.size) * self.walk.top_k

    def is_queued_source(self, source: Any) -> bool:
        """``isinstance(source, QueuedSource)``, cached per source type: a Protocol isinstance
        walks every method of the protocol (tens of microseconds, twice a token otherwise)."""
        kind = type(source)
        queued = self._is_queued.get(kind)
        if queued is None:
            queued = self._is_queued[kind] = isinstance(source, QueuedSource)
        return queued

    def can_run(self, ctx: StepContext, inputs: mx.array) -> bool:
        source = ctx.source
        if not self.is_queued_source(source) or inputs.size > MAX_QUEUED_TOKENS:
            return False
        qsource = cast(QueuedSource, source)  # `queued` is the cached isinstance, True here
        pairs = self.pairs(inputs)
        if qsource.queued_ready(pairs):
            ctx.part = None
            return True
        # A step whose experts may not fit a layer's rows at once: its switches resolve them in
        # parts of at most `part` pairs, each part computed before the next may evict its rows
        # (see forward). A sorted switch (prefill chunks, large batches) cuts its pairs sorted by
        # expert, so a part holds <= part distinct experts and each expert is read about once per
        # layer; an unsorted one cuts by whole tokens (part = tokens x top_k). Rows for fewer than
        # one token's experts (side rows below the top-k) leave no whole token to cut: the step
        # sorts its pairs then, however few, rather than go per layer.
        decode = inputs.shape[-1] == 1
        capacity = qsource.queued_capacity(int(inputs.size) if decode else None)
        sort = pairs >= SORT_THRESHOLD or self._sorts_cuts(source, decode) or capacity < self.walk.top_k
        part = capacity if sort else capacity // self.walk.top_k * self.walk.top_k
        if part < 1 or (-(-pairs // part) > MAX_RESOLVES_PER_LAYER and not self._stages_every_layer(source)):
            return False
        if not qsource.queued_ready(part):
            return False
        ctx.part = part
        return True

    def _sorts_cuts(self, source: Any, decode: bool) -> bool:
        """Whether a decode step cut into parts sorts its pairs by expert however few they are:
        under a plan that reads past the page cache, where a token-cut batch reads an expert two
        parts route twice from the disk (BENCHMARKS.md, "Serving under a memory budget"). Sorted,
        the step takes sorted parts or, where fewer resolves do (``expert_slices``, a GPU's
        default), expert slices: either reads each expert it routes once."""
        return decode and bool(getattr(getattr(source, "plan", None), "direct", False))

    def _streams(self, source: Any, layer: int) -> bool:
        """Whether a small switch of ``layer`` streams its misses (see ForwardOptions.streamed_switch)."""
        if self._streamed_switch is False:
            return False
        ask = getattr(source, "can_stream" if self._streamed_switch else "streams_misses", None)
        return ask is not None and bool(ask(layer))

    def _prefetches_after_resolve(self, source: Any, layer: int, nxt: int) -> bool:
        """Whether ``layer``'s plain switch (no streamed misses: its records are too small to
        repay one) starts reading ``nxt``'s predicted experts once its own resolve is done, so
        they read while this layer's experts, the next attention and its router compute: under a
        plan that reads past the page cache (most routed experts miss), on the CPU, where both
        layers have a host fault table (``nxt``'s next resolve settles the prefetch first). Without
        it a predictor on such a store read nothing ahead in queued steps (BENCHMARKS.md,
        "Prefetch inside queued steps")."""
        can = getattr(source, "can_stream", None)
        return (self._on_cpu and can is not None and bool(getattr(getattr(source, "plan", None), "direct", False))
                and bool(can(layer)) and bool(can(nxt)))

    def _stages_every_layer(self, source: Any) -> bool:
        """Whether every MoE layer's switch can stage its experts (one resolve however many)."""
        staging = getattr(source, "staging", None)
        return (self._staged_switches and staging is not None
                and all(staging(i) is not None for i in self.walk.moe))

    async def forward(self, ctx: StepContext, inputs: mx.array, *, logits: bool = True,
                      head: Callable[[mx.array], mx.array] | None = None) -> mx.array:
        """Queue one step over ``inputs`` (B, L); returns its logits (with ``logits=False``, a prefill
        chunk, the hidden state after the last layer's attention, the last point the KV caches
        need; the whole model's when a routing trace records the step), scheduled, not awaited.
        With ``head``, ``head(logits)`` instead, built into the step's graph and scheduled with it.

        The routing of every MoE layer is kept in ``ctx.routed``: read it only after the output
        was awaited.
        """
        source = cast(QueuedSource, ctx.source)
        assert self.is_queued_source(source)
        host = self.host_ns
        t0 = time.perf_counter_ns()
        ctx.step = source.begin_step(self.pairs(inputs))
        t1 = time.perf_counter_ns()
        try:
            # The residual stream after each layer: a long step's, handed to MLX a layer at a time
            # once the one before computed; a CPU decode step's, each layer handed over whole
            # (see _schedule).
            long = inputs.shape[-1] >= LONG_STEP_TOKENS
            layers: list[mx.array] | None = [] if long or (self._lend and self._bridged) else None
            out = await self._build(ctx, source, inputs, logits, layers)
            if head is not None:
                out = head(out)
        except BaseException:
            source.abandon_step()
            raise
        t2 = time.perf_counter_ns()
        # Registered before scheduling: _schedule awaits between pieces of the graph, and a
        # quiesce() meanwhile (another task's ensure, the runtime closing, a cancel) must wait
        # for this step too before it takes the lent rows back; the stream may be faulting rows
        # in for its first layers already. quiesce() schedules what this task did not get to.
        source.end_step(out)
        host["begin"] += t1 - t0
        host["build"] += t2 - t1
        host["end"] += time.perf_counter_ns() - t2
        host["steps"] += 1
        if self._on_cpu and self._bridged:
            await between_layers()  # the last layer's build and the graph walk are spans of their own
        if long and layers:
            await self._schedule_layers(layers)
            await self._schedule(out)
        elif layers:
            await self._schedule(out, layers)
        else:
            await self._schedule(out)
        if self.arm is not None:
            # The step's completion signal goes on the stream now, right behind the step: the
            # caller may queue the next step before it awaits this one (generation runs one step
            # ahead), and a signal issued at the await would sit behind that next step, so the
            # host would hear of this token only once the next step is computed too, and build
            # the one after while the stream stands idle.
            try:
                ctx.armed = (out, self.arm(out))
            except RuntimeError:  # queuing the signal met a failure MLX kept: see _schedule
                if self._on_cpu:
                    await _run_out(mx.default_stream(mx.cpu))
                raise
        self.counters["queued" if logits else "queued_prefill"] += 1
        self.counters["forwards"] += 1
        return out

    async def _build(self, ctx: StepContext, source: Any, inputs: mx.array, logits: bool,
                     layers: list[mx.array] | None = None) -> mx.array:
        """The step's graph (lazy). A long step (a prefill chunk) lets the loop run between its
        layers: its whole graph is thousands of nodes, built in Python on the loop thread (the
        source's quiesce() waits for a step being built, so nothing takes its rows meanwhile).
        On the CPU a decode step lets it run every :data:`DECODE_CHECKPOINT_LAYERS` layers.
        ``layers``: where the residual stream after each layer is appended."""
        walk = self.walk
        h = walk.embed(inputs)
        masks = walk.masks(h, ctx.cache)
        routed, part, counters = ctx.routed, ctx.part, self.counters
        every = 1 if inputs.shape[-1] >= LONG_STEP_TOKENS else DECODE_CHECKPOINT_LAYERS if self._on_cpu else 0
        # (an unsorted cut is whole tokens, at least top-k pairs: a smaller part was sorted by can_run)
        sort_cuts = part is not None and (self._sorts_cuts(source, inputs.shape[-1] == 1) or part < walk.top_k)
        last = len(walk.layers) - 1
        predicting = False  # the predictor began this step (at its first streamed switch)
        for i in range(len(walk.layers)):
            if every and i and i % every == 0:
                await between_layers()
            h_attn, xn = walk.attend(i, h, masks, ctx.cache)
            if not logits and i == last and ctx.record is None:
                # A prefill chunk: its caches are complete after the last layer's attention and
                # nobody reads its output, so the last block (an MoE layer: a resolve and its
                # faults) is not built at all, as mlx-lm's prefill never computes it either.
                # (Unless a routing trace is recording: it gets every layer's routing.)
                return h_attn
            if i not in walk.moe:
                h = h_attn + walk.block(i)(xn)
                if layers is not None:
                    layers.append(h)
                continue
            block, attr = walk.moe[i]
            spec, activation, pools = walk.specs[i], walk.activation(i), source.pools(i)
            staging = getattr(source, "staging", None)
            staged = staging(i) if staging is not None and part is not None and self._staged_switches else None
            if staged is not None and logits and inputs.size * walk.top_k < STAGE_DECODE_PAIRS_PER_EXPERT * \
                    cast(Any, source).n_experts(i):
                staged = None  # a decode batch that keeps its working set in the rows
            streamed = part is None and self._on_cpu and self._streams(source, i)
            # The next MoE layer's prediction, prefetched by this layer's streamed switch once its
            # own reads landed (see _streamed_switch): only into a layer that streams too (a host
            # table whose next resolve settles the prefetch first). A layer whose records are too
            # small to stream prefetches once its resolve is done (see _prefetches_after_resolve).
            ahead = None
            nxt = walk.next_moe[i]
            if nxt is not None and (streamed and self._streams(source, nxt) or not streamed and part is None
                                    and self._prefetches_after_resolve(source, i, nxt)) \
                    and self.prefetching(ctx):
                if not predicting:
                    ctx.predictor.begin(ctx.routing, ctx.position)
                    predicting = True
                predicted = ctx.predictor.next(nxt, xn)
                if predicted is not None:
                    ctx.predicted[nxt] = predicted
                    ahead = (nxt, predicted if isinstance(predicted, mx.array) else mx.array(predicted))

            def apply(x_sw: mx.array, inds: mx.array, i: int = i, spec: Any = spec, activation: Any = activation,
                      pools: Any = pools, staged: Any = staged, streamed: bool = streamed,
                      ahead: Any = ahead) -> mx.array:
                if streamed and inds.size < SORT_THRESHOLD:
                    counters["streamed_switches"] += 1
                    return _streamed_switch(source, i, spec, activation, x_sw, inds, pools, ahead)
                if part is None or inds.size <= part:
                    rows = source.expert_rows(i, inds)
                    if ahead is not None and part is None and inds.size < SORT_THRESHOLD:
                        # (as a streamed switch: a decode step's few pairs, not a prompt's chunk)
                        rows = source.prefetch_rows(ahead[0], ahead[1], rows)
                    return pooled_switch_apply(spec, activation, x_sw, rows, pools)
                if staged is not None:
                    # Experts beyond the lent rows, on a device with a host tier: copied into the
                    # layer's staging arrays by expert id (no pool row changes, no slices); the
                    # gather is then mlx-lm's own, over a whole layer.
                    counters["staged_switches"] += 1
                    y = pooled_switch_apply(spec, activation, x_sw, source.staged_rows(i, inds), staged)
                    source.staged_done(y)
                    return y
                if inds.size >= SORT_THRESHOLD or sort_cuts:
                    n_experts = getattr(source, "n_experts", None)
                    slices = -(-min(inds.size, n_experts(i)) // part) if n_experts is not None else 0
                    if self._expert_slices and 0 < slices < -(-inds.size // part):
                        counters["expert_slices"] += slices
                        return _expert_slices_switch(source, i, spec, activation, x_sw, inds, pools, part, slices)
                    counters["sorted_parts"] += -(-inds.size // part)
                    return _sorted_parts_switch(source, i, spec, activation, x_sw, inds, pools, part)
                tokens, split = inds.size // inds.shape[-1], part // inds.shape[-1]
                counters["token_parts"] += -(-tokens // split)
                return _split_switch(source, i, spec, activation, x_sw, inds, pools, split)

            out, _x_sw, inds, _y = route_and_apply(block, attr, xn, apply, ctx.forced(i, xn))
            assert out is not None
            routed.append((i, inds))
            h = h_attn + out
            if layers is not None:
                layers.append(h)
        return walk.logits(h) if logits else h

    async def _schedule(self, out: mx.array, layers: Sequence[mx.array] = ()) -> None:
        """Hand the step to MLX without blocking the loop (native StepPlan: one walk of the graph
        per step).

        On the CPU, MLX's eval throttle lets a caller run only about 50 nodes ahead of the
        stream; mlx-lm's caller simply blocks in it. The loop cannot, so the step goes past the
        throttle (``lend``): whole, in slices of :data:`SCHEDULE_SLICE_NS` with a checkpoint
        between. Handed over in chunks under the throttle instead, each awaited, a decode step woke the
        loop many times more and decoded slower (BENCHMARKS.md, "Decode: queued steps").

        With ``layers`` (a CPU decode step's residual stream after each layer), the step goes a
        layer at a time, each layer in one call with a checkpoint after it (a layer's graph is
        about one slice of MLX's encoding): a sliced hand-over calls into MLX every few nodes,
        and each call costs the loop thread more than those nodes' encoding. A layer of more than
        :data:`WHOLE_LAYER_NODES` nodes (a batch cut in parts) is still sliced."""
        host = self.host_ns
        if not self._bridged:
            t = time.perf_counter_ns()
            mx.async_eval(out)  # an injected completion (tests): MLX may block the caller
            host["schedule"] += time.perf_counter_ns() - t
            return
        queued = False  # some of the step is scheduled
        plan: Any = None
        try:
            for k, root in enumerate((*layers, out)):
                if k:
                    await between_layers()
                t = time.perf_counter_ns()
                plan = _native.StepPlan([root])
                t1 = time.perf_counter_ns()
                host["plan"] += t1 - t
                whole = bool(layers) and plan.size <= WHOLE_LAYER_NODES
                slice_ns = SCHEDULE_SLICE_NS if self._on_cpu and not whole else 0
                while True:
                    done, wait_on = plan.advance(slice_ns=slice_ns, lend=self._lend)
                    t2 = time.perf_counter_ns()
                    host["schedule"] += t2 - t1
                    if done:
                        break
                    if wait_on is None:  # the slice ran out with room under the throttle: let the loop run
                        await between_layers()
                    else:
                        await self.completed(wait_on)
                    t1 = time.perf_counter_ns()
                queued = True
        except RuntimeError:
            # MLX raises a failure thrown on the stream at the next call that queues work there.
            # Our fault nodes never throw there (a failed fault goes to the fault log, raised as
            # FillError once the step is awaited), but other work on the stream may. Part of the
            # step may be queued by then, and queued work runs whatever failed before it: let it
            # all run, so that every fault this step makes is logged before its awaiter hears of
            # the failure, not left for a later step or quiesce().
            if (queued or (plan is not None and plan.scheduled)) and self._on_cpu:
                await _run_out(mx.default_stream(mx.cpu))
            raise

    def bound_cache(self) -> None:
        """After a queued step computed: empty MLX's cache of freed buffers once it holds more than
        :data:`CACHE_GROWTH_BOUND` times what it held :data:`CACHE_FLOOR_STEP` steps after it was
        last emptied.

        A queued step goes to MLX whole, past its throttle (:meth:`_schedule`; on a GPU in one
        eval), and MLX allocates a node's output as the node is handed over, its kernel running
        later: every buffer of the step is allocated before any of them is freed, so none is
        reused by a later layer or donated to the op that consumes it, as they are under
        mlx-lm's own eval. The buffers sized by the context (each layer's attention scores and
        weights) grow by a position every step and never fit a later request: MLX's cache kept
        all of them every token (mlx-lm's about one) until the next clear, and off the CPU its
        limit is the device's memory. What the cache holds a few steps after a clear is what
        every step takes again; past a multiple of that it holds buffers no step will take. The
        same rule on the CPU: emptied every step there, the buffers went back to malloc each
        token, and a server's RSS crept up between them (tests/test_serve_soak.py)."""
        held = mx.get_cache_memory()
        self._since_clear += 1
        if self._since_clear == CACHE_FLOOR_STEP:
            self._cache_floor = held
        elif self._since_clear > CACHE_FLOOR_STEP and held > CACHE_GROWTH_BOUND * self._cache_floor:
            mx.clear_cache()
            self._since_clear = 0

    async def _schedule_layers(self, layers: Sequence[mx.array]) -> None:
        """Hand a long step's ``layers`` (its residual stream after each layer) to MLX
        (:meth:`_schedule`) one at a time, each once the one before has computed; the rest of the
        step goes after them.

        MLX allocates a node's output as the node is handed over (its kernel runs later), and a
        step handed over whole (on the CPU past MLX's throttle) had every buffer of every layer
        allocated at once: a prefill chunk's attention scores of every layer side by side, where
        mlx-lm's eval frees each layer's before the next allocates its own. On the embedded
        model a chunk of a few hundred tokens took several times mlx-lm's memory, past the
        plan's estimate of a
        forward (one layer's buffers, :mod:`asyncside.runtime._forward_cost`), which bounds prompt
        chunks under a budget. A layer at a time, one layer's buffers are held; the stream idles
        while the next is handed over, which on the CPU is little beside a layer's compute and on
        a GPU costs some time to first token (BENCHMARKS.md, "A prefill chunk's layers handed
        over one at a time on a GPU"). Decode steps go whole: their layers' buffers are small,
        and the host's time per step is what decode waits for."""
        if self._bridged:
            for h in layers:
                await self._schedule(h)
                await self.completed(h)

    def prefetching(self, ctx: StepContext) -> bool:
        """Whether this step's streamed switches prefetch the next layer's predicted experts: a
        predictor that predicts, on a source that counts its prefetches, whose recent prefetch
        reads are not known to be routed less than :data:`PREFETCH_MIN_USE` of the time."""
        if type(ctx.predictor).next is Predictor.next:  # "none", or a predictor that never predicts
            return False
        if not hasattr(ctx.source, "prefetch_counts"):
            return False
        read, used = self._recent
        return read < PREFETCH_PROBATION_READS or used >= PREFETCH_MIN_USE * read

    def count_predictions(self, ctx: StepContext) -> None:
        """After a computed queued step: count its predictions against what its layers routed (the
        forward's precision and recall counters), and the source's prefetch reads and the routed
        ones among them into the recent counts :meth:`prefetching` reads. Only a step that predicted
        reads the source's counts (every layer's table): the others only decay them, and a
        prefetch published late is counted at the next step that predicts (the counts are totals)."""
        recent = self._recent
        recent[0] *= PREFETCH_DECAY
        recent[1] *= PREFETCH_DECAY
        if not ctx.predicted:
            return
        for layer, inds in ctx.routed:
            pred = ctx.predicted.get(layer)
            if pred is not None:
                count_prediction(self.counters, np.array(pred, copy=False), np.array(inds, copy=False))
        counts = getattr(ctx.source, "prefetch_counts", None)
        if counts is not None:
            totals = counts()
            for j in range(2):
                recent[j] += max(totals[j] - self._totals[j], 0)
            self._totals = totals

    @staticmethod
    def record_routes(ctx: StepContext) -> None:
        """Trace the routing of a queued step whose logits were awaited (only when tracing), with
        the predictions its prefetches used."""
        if ctx.record is None:
            return
        for layer, inds in ctx.routed:
            pred = ctx.predicted.get(layer)
            ctx.record.record(layer, np.array(inds, copy=True), None if pred is None else np.array(pred, copy=True))


async def _run_out(stream: mx.Stream) -> None:
    """Return once the CPU ``stream`` has run everything queued on it, and MLX holds no failure
    of that work for the next call to raise (each raise clears the one MLX stored)."""
    ran = False
    while True:
        try:
            await current_queue().wait_stream(stream)  # queuing the barrier raises a stored failure
        except RuntimeError:
            continue
        if ran:  # a second barrier queued cleanly after the first ran: nothing failed in between
            return
        ran = True


async def between_layers() -> None:
    """Where a long queued step's build lets other tasks run (a checkpoint; tests replace it)."""
    await anyio.lowlevel.checkpoint()


def _after(prev: mx.array | None, ids: mx.array) -> mx.array:
    """``ids``, made to depend through data on ``prev`` (a part's output) when there is one.

    A data dependency, not ``mx.depends``: MLX CUDA orders the nodes of its command graphs by the
    buffers they read and write, and a ``depends`` moves no data, so there a later part's fault
    node ran beside the previous part's products (and shared the layer's staging buffers): wrong
    logits on MLX CUDA. ``where(c, ids, ids)`` is ``ids`` whatever ``c``.
    """
    if prev is None:
        return ids
    first = prev.reshape(-1)[:1]
    return mx.where(first == first, ids, ids)


def _sorted_pairs(x_sw: mx.array, inds: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """A switch's (token, expert) pairs sorted by expert id in the graph, as mlx-lm's sorted switch
    sorts them: each pair's input row, its expert id, and the permutation that puts the pairs'
    outputs back in order."""
    k = inds.shape[-1]
    flat = inds.reshape(-1)
    order = mx.argsort(flat)
    return x_sw.reshape(-1, x_sw.shape[-1])[order // k], flat[order], mx.argsort(order)


def _sorted_parts_switch(source: QueuedSource, layer: int, spec: Any, activation: Any, x_sw: mx.array,
                         inds: mx.array, pools: Any, part: int) -> mx.array:
    """A sorted switch layer's output with its experts resolved ``part`` pairs at a time.

    The pairs are sorted by expert id in the graph (as mlx-lm's own sorted switch does) and cut
    into fixed slices of ``part`` pairs: a slice holds at most ``part`` distinct experts, and
    consecutive slices share at most one, so each routed expert is read about once per layer
    however many tokens route to it (cutting by tokens instead reads a popular expert once per
    part). Each slice resolves its experts (faulting absent ones into lent rows, possibly
    evicting rows an earlier slice used) only after the previous slice's output was computed
    (:func:`_after`). Each pair's product does not depend on which other pairs share its gather
    (MLX computes a gather's rows independently), so the output is bitwise the unsplit one.
    """
    x, ids, inv = _sorted_pairs(x_sw, inds)
    outs: list[mx.array] = []
    for start in range(0, ids.shape[0], part):
        rows = source.expert_rows(layer, _after(outs[-1] if outs else None, ids[start:start + part]))
        outs.append(pooled_switch_apply(spec, activation, x[start:start + part], rows[:, None], pools, sort=True))
    y = mx.concatenate(outs, axis=0)[inv]
    return y.reshape(*inds.shape, y.shape[-1])


def _expert_slices_switch(source: QueuedSource, layer: int, spec: Any, activation: Any, x_sw: mx.array,
                          inds: mx.array, pools: Any, capacity: int, slices: int) -> mx.array:
    """A sorted switch layer's output with its experts resolved ``capacity`` experts at a time.

    The pairs are sorted by expert id in the graph and each is ranked by its expert among the
    distinct experts routed (0 for the lowest id, ...). Slice ``j`` resolves the experts ranked
    ``[j * capacity, (j + 1) * capacity)`` (every other pair's id becomes :data:`NO_EXPERT`, which
    faults nothing) and computes every pair, keeping the products of its own pairs. So a layer
    takes ``ceil(distinct / capacity)`` resolves however many pairs route to them, each expert
    is read at most once, and all of a slice's misses are read side by side; the price is each
    slice's products for the other slices' pairs, computed and dropped. Each slice's ids depend
    through data on the previous slice's output (:func:`_after`), so its faults cannot evict
    rows before the gathers that read them ran. A pair's product does not depend on the other
    pairs of its gather, so the output is bitwise the unsplit one.
    """
    x, ids, inv = _sorted_pairs(x_sw, inds)
    ids = ids.astype(mx.uint32)
    starts = mx.concatenate([mx.ones((1,), mx.int32), (ids[1:] != ids[:-1]).astype(mx.int32)])
    rank = mx.cumsum(starts) - 1
    none = mx.array(NO_EXPERT, dtype=mx.uint32)
    y: mx.array | None = None
    for j in range(slices):
        mine = (rank >= j * capacity) & (rank < (j + 1) * capacity)
        rows = source.expert_rows(layer, _after(y, mx.where(mine, ids, none)))
        out = pooled_switch_apply(spec, activation, x, rows[:, None], pools, sort=True)
        y = out if y is None else mx.where(mine[:, None, None], out, y)
    assert y is not None
    y = y[inv]
    return y.reshape(*inds.shape, y.shape[-1])


def slot_groups(k: int) -> list[int]:
    """How a streamed switch of ``k`` slots groups them, in its compute order: sizes 1, 1, 2, 3,
    4, ..., the last cut to what is left (10 slots: 1, 1, 2, 3, 3), each group one ``finish_rows``
    node and one gather.

    Why: a group costs a dozen graph nodes built on the loop thread and run on the stream, whatever
    its size, which a small record's read does not repay: one group a slot, a switch of many small
    records (a fine-grained MoE's) took more loop and stream CPU a token than grouped, and no less
    time (BENCHMARKS.md, "Fine-grained records"). The first two positions stay single: the compute
    order puts the experts that are in first, so at low locality the second is the first miss,
    which waits one record's read as it did alone. After it the records land back to back while
    the groups before compute; groups growing from the first position on waited for their reads
    more than these (the same section)."""
    sizes: list[int] = []
    left = k
    while left > 0:
        sizes.append(min(max(1, len(sizes)), left))
        left -= sizes[-1]
    return sizes


def _streamed_switch(source: Any, layer: int, spec: Any, activation: Any, x_sw: mx.array, inds: mx.array,
                     pools: Any, ahead: tuple[int, mx.array] | None = None) -> mx.array:
    """A small switch layer's output with its misses streamed: one ``begin_rows`` node maps every
    routed expert to its row, starts the absent ones' reads in the background, and says per token
    in which order to compute its ``k`` slots (those whose expert is in first, then the others as
    their reads were issued). Then group after group of slots (:func:`slot_groups`), in that order,
    waits for its own experts alone (``finish_rows``) and computes their products. So the experts
    that are in compute while the others are still read, and the layer's reads overlap its expert
    compute instead of preceding it.

    With ``ahead`` (the next MoE layer and its predicted ids), the first slot's rows pass through a
    ``prefetch_rows`` node before its gather: once that slot's experts are in, the next layer's
    predicted experts start reading, while this layer's slots, the next attention and its router
    compute. They share the disk with this layer's later records, which its later slots wait for;
    started after the last slot's record instead, they had less time to land, and the next
    layer's first slot waited for them more than that cost (BENCHMARKS.md, "Prefetch inside
    queued steps").

    Each pair's product does not depend on which other pairs share its gather, and the products
    are put back in slot order, so the output is bitwise the whole gather's.
    """
    k = inds.shape[-1]
    both = source.begin_rows(layer, inds)
    rows, order = both[..., :k], both[..., k:]
    outs = []
    start = 0
    for g, size in enumerate(slot_groups(k)):
        slots = order[..., start:start + size]
        ids_g = mx.take_along_axis(inds, slots, axis=-1)
        mine = source.finish_rows(layer, ids_g, mx.take_along_axis(rows, slots, axis=-1))
        if ahead is not None and g == 0:
            mine = source.prefetch_rows(ahead[0], ahead[1], mine)
        outs.append(pooled_switch_apply(spec, activation, x_sw, mine, pools, sort=False))
        start += size
    y = mx.concatenate(outs, axis=-2)  # (..., k, out), in compute order
    back = mx.argsort(order, axis=-1)
    return mx.take_along_axis(y, mx.expand_dims(back, -1), axis=-2)


def _split_switch(source: QueuedSource, layer: int, spec: Any, activation: Any, x_sw: mx.array, inds: mx.array,
                  pools: Any, split: int) -> mx.array:
    """A switch layer's output computed ``split`` tokens at a time, for a batch whose routed
    experts may not all fit the layer's lent rows at once (an unsorted switch: few pairs).

    Each part resolves its own experts (faulting absent ones into lent rows, possibly evicting
    rows an earlier part used), so each part's ids depend on the previous part's output through
    data (:func:`_after`): the graph cannot resolve them before the rows they may evict were
    read. Every part sorts as the whole switch input would, and each pair's product does not
    depend on which part it is in, so the output is bitwise the unsplit one.
    """
    k = inds.shape[-1]
    ids = inds.reshape(-1, k)
    x = x_sw.reshape(-1, x_sw.shape[-1])
    outs: list[mx.array] = []
    for start in range(0, ids.shape[0], split):
        rows = source.expert_rows(layer, _after(outs[-1] if outs else None, ids[start:start + split]))
        outs.append(pooled_switch_apply(spec, activation, x[start:start + split], rows, pools, sort=False))
    y = mx.concatenate(outs, axis=0)
    return y.reshape(*inds.shape, y.shape[-1])
