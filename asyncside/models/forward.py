"""The async forward: one object that runs a step of an MoE model over an ExpertSource.

It picks, per step, one of three strategies (each in its own module), by the mode it was built
with:

- ``queued`` (:mod:`.queued`): the whole step queued at once, misses served inside the stream by
  the source's fault tables. The default for decode steps whenever the source can (``Runtime``
  with host pools, ``ResidentSource``).
- ``per-layer`` (:mod:`.per_layer`): each MoE layer's routed ids come to the host, which serves
  its experts (prefetch, ensure, leases), optionally gathering speculatively from row snapshots.
  Used for sources without queued steps and for steps too large to queue.
- ``whole`` (:mod:`.whole`): the step queued whole from row snapshots and checked after, redone
  from the first unsound layer.

``auto`` takes ``queued`` when the source can run the step, else ``whole`` on a GPU (where a
layer computes faster than a host round trip), else ``per-layer``. An explicit mode falls back
to ``per-layer`` for a step it cannot run (counted in ``counters["fallbacks"]``).

Whatever the strategy, results equal the plain mlx-lm model's bit for bit (tests), whatever rows
the source chose.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from ..bridge import Completed
from ..errors import AsyncsideError
from .arch import Arch
from .forcing import cache_position
from .per_layer import PerLayerSteps, RowLookupError
from .pooled import SwitchSpec
from .predict import Predictor
from .queued import QueuedSource, QueuedSteps
from .source import ExpertSource
from .trace import RoutingTrace
from .walk import DecoderWalk, StepContext
from .whole import WholeSteps

__all__ = ["AsyncForward", "Completed", "ForwardOptions", "RowLookupError", "StepMode", "default_completed",
           "eval_completed"]


class StepMode(enum.StrEnum):
    """How a forward runs a step (see the module docstring)."""

    AUTO = "auto"
    QUEUED = "queued"
    PER_LAYER = "per-layer"
    WHOLE = "whole"


STEP_MODES = tuple(m.value for m in StepMode)


@dataclass(frozen=True)
class ForwardOptions:
    """The forward's settings, fixed at construction.

    ``speculate``: per-layer steps gather from row snapshots where the source offers them.
    ``lookahead_extra``: the lookahead predictor names this many experts beyond the router's k.
    ``expert_slices``: a queued step's sorted switch (a prefill chunk, a large batch) whose experts
    may not fit a layer's lendable rows at once resolves them in slices of that many distinct
    experts, each slice computing every pair (``ceil(distinct / rows)`` resolves per layer);
    off: in slices of that many pairs (``ceil(pairs / rows)`` resolves, no product computed twice).
    None (the default): on a GPU, where computing a slice's other pairs costs little and fewer
    resolves matter; off on the CPU, where the products are the step's cost (BENCHMARKS.md, "Time
    to first token").
    ``staged_switches``: such a switch, where the source has staging arrays for the layer (device
    pools with a host tier: MLX CUDA), copies its experts into them instead (one resolve, no pool
    row changes, the gather over a whole layer as mlx-lm's); off: slices as above.
    ``streamed_switch``: a queued step's small switch (fewer pairs than a sorted one) starts its
    misses' reads at once and computes its experts slot by slot, each slot waiting only for its
    own experts, so the layer's reads overlap its expert compute (exact: each product is the one
    the whole gather computes). None (the default): where the source asks for it (a runtime whose
    memory plan reads past the page cache); True: wherever the source can; False: never.

    Prefill chunks run as queued steps where the source can and the mode allows (``auto``,
    ``queued``), else per layer.
    """

    mode: StepMode = StepMode.AUTO
    speculate: bool = True
    lookahead_extra: int = 0
    expert_slices: bool | None = None
    staged_switches: bool = True
    streamed_switch: bool | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "mode", StepMode(self.mode))
        except ValueError:
            raise ValueError(f"mode: expected one of {list(STEP_MODES)}, got {self.mode!r}") from None
        if not isinstance(self.lookahead_extra, int) or self.lookahead_extra < 0:
            raise ValueError(f"lookahead_extra: expected an int >= 0, got {self.lookahead_extra!r}")
        if self.expert_slices not in (None, True, False):
            raise ValueError(f"expert_slices: expected True, False or None, got {self.expert_slices!r}")
        if self.staged_switches not in (True, False):
            raise ValueError(f"staged_switches: expected True or False, got {self.staged_switches!r}")
        if self.streamed_switch not in (None, True, False):
            raise ValueError(f"streamed_switch: expected True, False or None, got {self.streamed_switch!r}")


async def eval_completed(x: mx.array) -> None:
    """Blocking stand-in for ``asyncside.bridge.completed``: evaluates ``x`` on the calling thread.

    Only for tests and synchronous tools; it blocks the event loop for the whole computation.
    """
    mx.eval(x)


async def _async_eval(*arrays: mx.array) -> None:
    """``mx.async_eval`` for injected completions that are not the bridge's."""
    mx.async_eval(*arrays)


def default_completed() -> Completed:
    """``asyncside.bridge.completed`` (the native completion bridge), or a clear error if absent."""
    try:
        from ..bridge import completed
    except ImportError as exc:  # pragma: no cover - depends on the bridge module being present
        raise AsyncsideError(
            "asyncside.bridge is not available; pass completed=... (eval_completed blocks the loop)"
        ) from exc
    return completed


class AsyncForward:
    """Steps of an mlx-lm MoE model whose switch layers are PooledSwitch modules."""

    def __init__(self, model: nn.Module, arch: Arch, moe: dict[int, tuple[nn.Module, str]],
                 specs: dict[int, SwitchSpec], completed: Completed,
                 options: ForwardOptions | None = None) -> None:
        self.options = options or ForwardOptions()
        self.walk = DecoderWalk(model, arch, moe, specs)
        self.completed = completed
        self.counters = {"forwards": 0, "capacity_splits": 0, "groups": 0, "subset_groups": 0,
                         "speculated": 0, "speculation_misses": 0, "optimistic": 0, "optimistic_redone": 0,
                         "queued": 0, "queued_prefill": 0, "sorted_parts": 0, "expert_slices": 0, "token_parts": 0,
                         "staged_switches": 0, "streamed_switches": 0,
                         "per_layer": 0,
                         "prefill": 0, "fallbacks": 0}
        # A completion that takes `then` is the bridge's (or wraps it): queue work through the
        # bridge too, which never lets MLX's async_eval throttle block the loop.
        try:
            then_ok = "then" in inspect.signature(completed).parameters
        except (TypeError, ValueError):  # a callable without a signature
            then_ok = False
        schedule: Callable[..., Awaitable[None]] = _async_eval
        arm = None
        if then_ok:
            from .. import bridge
            from ..bridge import schedule

            if completed is bridge.completed:
                arm = bridge.arm

        self.per_layer = PerLayerSteps(self.walk, completed, schedule, self.counters,
                                       speculate=self.options.speculate, then_ok=then_ok)
        self.whole = WholeSteps(self.per_layer)
        on_gpu = mx.default_device() == mx.gpu
        es = self.options.expert_slices
        self.queued = QueuedSteps(self.walk, completed, self.counters, bridged=then_ok,
                                  expert_slices=es if es is not None else on_gpu,
                                  staged_switches=self.options.staged_switches,
                                  streamed_switch=self.options.streamed_switch, arm=arm)
        #: routing replay of every step (:class:`asyncside.models.forcing.RoutingReplay`); None: the
        #: router routes. Set through ``StreamingModel.set_routing``.
        self.routing: Any = None

    @property
    def mode(self) -> StepMode:
        return self.options.mode

    def make_predictor(self, name: str) -> Predictor:
        """The predictor called ``name`` for one generation (see :mod:`.predict`)."""
        return self.walk.make_predictor(name, self.options.lookahead_extra)

    def context(self, cache: list[Any], source: ExpertSource, predictor: Predictor | None = None,
                trace: RoutingTrace | None = None) -> StepContext:
        """A new step's context (one per step); under routing replay its first token's position is
        the tokens ``cache`` has seen."""
        if self.routing is None:
            return StepContext(cache, source, predictor or Predictor(), trace)
        return StepContext(cache, source, predictor or Predictor(), trace, routing=self.routing,
                           position=cache_position(cache))

    def kind(self, ctx: StepContext, inputs: mx.array) -> StepMode:
        """The strategy this decode step will run with."""
        mode = self.options.mode
        if mode in (StepMode.AUTO, StepMode.QUEUED) and self.queued.can_run(ctx, inputs):
            return StepMode.QUEUED
        whole_ok = self.options.speculate and WholeSteps.can_run(ctx, inputs)
        if mode is StepMode.AUTO and whole_ok and mx.default_device() == mx.gpu:
            return StepMode.WHOLE
        if mode is StepMode.WHOLE and whole_ok:
            return StepMode.WHOLE
        return StepMode.PER_LAYER

    async def step(self, ctx: StepContext, inputs: mx.array, *, logits: bool = True,
                   finish: bool = True, head: Callable[[mx.array], mx.array] | None = None) -> mx.array:
        """Run ``inputs`` (B, L) through the model, updating ``ctx.cache``.

        ``head`` (decode steps): a function of the logits (a draw) whose result the step returns
        instead of them; a queued step builds it into its graph and schedules it with the step, so
        the stream computes the draw right after the logits, not behind whatever is queued between
        the step and the await of its result (a prefill chunk, the next step).

        Returns the logits (B, L, vocab), or with ``logits=False`` a hidden state, computed (prefill
        chunks, whose logits nobody reads: queued where the source can and the mode allows, else per
        layer; a queued chunk stops after the last layer's attention, where its
        caches are complete, as mlx-lm's prefill does, unless a trace records it). A queued step's
        logits are scheduled but not
        awaited: pass what you derive from them to :meth:`finish`. With ``logits=False,
        finish=False`` a queued prefill chunk is not awaited either (later steps may be queued
        behind it, on its cache): pass the hidden state to :meth:`finish` (harmless for a chunk
        that ran per layer, which is computed when this returns).
        """
        if not logits:
            self.counters["prefill"] += 1
            if self.options.mode in (StepMode.AUTO, StepMode.QUEUED) \
                    and self.queued.can_run(ctx, inputs):
                h = await self._queued(ctx, inputs, logits=False)
                if finish:
                    await self.finish(ctx, h)
                return h
            return await self.per_layer.forward(ctx, inputs, logits=False)
        kind = self.kind(ctx, inputs)
        if self.options.mode is not StepMode.AUTO and kind is not self.options.mode:
            self.counters["fallbacks"] += 1
        if kind is StepMode.QUEUED:
            return await self._queued(ctx, inputs, logits=True, head=head)
        if kind is StepMode.WHOLE:
            out = await self.whole.forward(ctx, inputs)
        else:
            self.counters["per_layer"] += 1
            out = await self.per_layer.forward(ctx, inputs, logits=True)
        return out if head is None else head(out)

    async def _queued(self, ctx: StepContext, inputs: mx.array, *, logits: bool,
                      head: Callable[[mx.array], mx.array] | None = None) -> mx.array:
        try:
            return await self.queued.forward(ctx, inputs, logits=logits, head=head)
        except RuntimeError:
            # MLX raises a stream's failure at the next call that schedules on it. When a fault
            # failed meanwhile (logged, never thrown there: native/expert_faults.h), its FillError
            # is the error to raise; anything else stays as it is.
            ctx.source.after_step(ctx.step)  # type: ignore[attr-defined]
            raise

    async def finish(self, ctx: StepContext, y: mx.array) -> None:
        """Await ``y`` (computed from a step's logits), then let the source learn what a queued
        step did (its faults, a failed read raised here as FillError) and record its routing."""
        armed, ctx.armed = ctx.armed, None
        queued = ctx.routed and self.queued.is_queued_source(ctx.source)
        try:
            if armed is not None and armed[0] is y:
                await armed[1].wait()
            else:
                if armed is not None:
                    armed[1].disarm()
                await self.completed(y)
        except Exception:
            if queued:  # a failed read of the step is the error to raise (what failed came of it)
                cast(QueuedSource, ctx.source).after_step(ctx.step)
            raise
        # A cancellation or an interrupt leaves the step unawaited, its failures kept: raised to a
        # later step's await or by quiesce. Raised here, one would replace the cancellation (on
        # trio it then escaped the caller's cancel scope), and the awaiter had walked away.
        if queued:
            cast(QueuedSource, ctx.source).after_step(ctx.step)
            self.queued.bound_cache()
        if ctx.routed:
            self.queued.count_predictions(ctx)
            QueuedSteps.record_routes(ctx)

    async def __call__(self, inputs: mx.array, cache: list[Any], source: ExpertSource,
                       predictor: Predictor | None = None, *, trace: RoutingTrace | None = None,
                       logits: bool = True) -> mx.array:
        """One step over ``inputs`` (B, L); the logits, computed (or with ``logits=False`` a hidden
        state: a prefill chunk, see :meth:`step`)."""
        ctx = self.context(cache, source, predictor, trace)
        out = await self.step(ctx, inputs, logits=logits)
        if logits:
            await self.finish(ctx, out)
        return out
