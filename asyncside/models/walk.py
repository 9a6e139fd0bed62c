"""The decoder walk every step strategy shares, and the per-step context they pass around.

A step strategy (:mod:`.queued`, :mod:`.per_layer`, :mod:`.whole`) cannot call an mlx-lm model's
``__call__``: it has to reach inside every MoE block. So it walks the model's own modules in the
same order with the same ops, through :class:`DecoderWalk`: the embedding, per decoder layer
``h = x + self_attn(input_layernorm(x), mask, cache)`` then ``h + mlp(post_attention_layernorm(h))``,
and the final norm and head. What differs between architectures lives in :mod:`.arch`; what
differs between strategies is only how an MoE block gets its expert rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from .arch import Arch, NormedBlock, ScaledBlock, decoder_layers, top_k_attribute, unwrapped
from .pooled import SwitchSpec, route
from .predict import LookaheadPredictor, Predictor, TemporalPredictor, TracePredictor, check_predictor
from .source import ExpertSource
from .trace import RoutingTrace


def _experts_of(*holders: object) -> int | None:
    """The experts an MoE block routes among, as mlx-lm's blocks, gates and configurations name them
    (None: unnamed)."""
    for holder in holders:
        for name in ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"):
            value = getattr(holder, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


class DecoderWalk:
    """An mlx-lm MoE model seen as the sequence of operations a forward walks through."""

    def __init__(self, model: nn.Module, arch: Arch, moe: dict[int, tuple[nn.Module, str]],
                 specs: dict[int, SwitchSpec]) -> None:
        self.model = model
        self.arch = arch
        if arch.residual_scale is not None:
            # The layer scales the block's output before its residual add: the step strategies add
            # what the walk's blocks return, so the blocks return it scaled.
            # (A stage's walk is handed its whole model's blocks, wrapped already.)
            moe = {i: (block if isinstance(block, ScaledBlock) else
                       ScaledBlock(block, self._residual_scale(i, model, arch)), attr)
                   for i, (block, attr) in moe.items()}
        if arch.mlp_out_norm is not None:
            # The layer norms the block's output before its residual add: the blocks return it normed.
            moe = {i: (block if isinstance(block, NormedBlock) else
                       NormedBlock(block, getattr(decoder_layers(model)[i], arch.mlp_out_norm)), attr)
                   for i, (block, attr) in moe.items()}
        self.moe = dict(sorted(moe.items()))
        self.specs = specs
        self.layers = decoder_layers(model)
        order = list(self.moe)
        self.first_moe = order[0]
        #: decoder layer index -> the next MoE layer after it (None after the last)
        self.next_moe: dict[int, int | None] = {}
        for i in range(len(self.layers)):
            later = [m for m in order if m > i]
            self.next_moe[i] = later[0] if later else None
        #: the most experts any MoE block routes one token to (sizes a queued step's lent rows)
        self.top_k = max((self._top_k(block) for block, _ in self.moe.values()), default=1)

    @staticmethod
    def _residual_scale(i: int, model: nn.Module, arch: Arch) -> float:
        return float(getattr(decoder_layers(model)[i], cast(str, arch.residual_scale)))

    @staticmethod
    def _top_k(block: nn.Module) -> int:
        where = top_k_attribute(block)
        if where is None:  # unknown router: assume the worst, every expert of the block
            return 1 << 30
        obj, name = where
        return int(getattr(obj, name))

    def embed(self, inputs: mx.array) -> mx.array:
        h = self.arch.embedding(self.model)(inputs)
        if self.arch.embed_scale is not None:
            h = h * getattr(self.arch.inner(self.model), self.arch.embed_scale)
        if self.arch.embed_op is not None:
            h = self.arch.embed_op(self.arch.inner(self.model), h)
        return cast(mx.array, h)

    def masks(self, h: mx.array, cache: list[Any]) -> list[Any]:
        """One attention mask per decoder layer, built as the model's own ``__call__`` builds them."""
        return self.arch.masks(self.model, h, cache)

    def attend(self, i: int, h: mx.array, masks: list[Any], cache: list[Any]) -> tuple[mx.array, mx.array]:
        """Layer ``i``'s attention sub-layer over ``h``: (hidden state after it, the MLP block's input)."""
        layer = self.layers[i]
        r = self.arch.attention(layer, layer.input_layernorm(h), masks[i], cache[i])
        if self.arch.attn_out_norm is not None:
            r = getattr(layer, self.arch.attn_out_norm)(r)
        if self.arch.residual_scale is not None:
            r = r * getattr(layer, self.arch.residual_scale)
        h = h + r
        return h, getattr(layer, self.arch.mlp_norm)(h)

    def block(self, i: int) -> nn.Module:
        """Layer ``i``'s MLP or MoE block (its output scaled as the layer scales it)."""
        block = cast(nn.Module, getattr(self.layers[i], self.arch.block_attr))
        if self.arch.residual_scale is None and self.arch.mlp_out_norm is None:
            return block
        if i in self.moe:
            return self.moe[i][0]
        if self.arch.mlp_out_norm is not None:
            return NormedBlock(block, getattr(self.layers[i], self.arch.mlp_out_norm))
        return ScaledBlock(block, self._residual_scale(i, self.model, self.arch))

    def activation(self, i: int) -> nn.Module:
        """The switch layer's activation of MoE layer ``i``."""
        block, attr = self.moe[i]
        return cast(nn.Module, getattr(block, attr).activation)

    def logits(self, h: mx.array) -> mx.array:
        """The final norm and output head over the last hidden state (lazy)."""
        model, arch = self.model, self.arch
        h = arch.inner(model).norm(h)
        head = arch.head_module(model)
        out = head.lm_head(h) if "lm_head" in head else arch.embedding(model).as_linear(h)
        if arch.logits_divisor is not None:
            out = out / getattr(head, arch.logits_divisor)
        return cast(mx.array, out)

    # -- what the lookahead predictor needs -------------------------------------------------------

    def route_ids(self, layer: int, x: mx.array, extra: int = 0) -> mx.array:
        """Layer ``layer``'s routed ids for MoE input ``x`` (lazy), via the block's own router.

        ``extra`` > 0 asks the router for that many more experts than it routes to (a wider
        prediction), at most every expert of the layer; blocks without a known top-k attribute, or
        whose router cannot widen (``Arch.widens``), give their usual k.
        """
        block, attr = self.moe[layer]
        # A wrapper's own attribute would be set, not the router's: ask the block it wraps.
        where = top_k_attribute(unwrapped(block)) if extra > 0 and self.arch.widens else None
        if where is None:
            return route(block, attr, x)[1]
        obj, name = where
        k = getattr(obj, name)
        # Past the layer's experts the router's top-k partition fails ("invalid kth").
        # The block and its gate name the count, or only the model's configuration does (MiniMax,
        # Mistral 4, bailing_moe, ernie4_5_moe; Mistral 3's wrapper in its text model's).
        experts = _experts_of(obj, unwrapped(block), getattr(self.model, "args", None),
                              getattr(self.arch.head_module(self.model), "args", None))
        if experts is not None:
            extra = min(extra, experts - k)
        if extra <= 0:
            return route(block, attr, x)[1]
        setattr(obj, name, k + extra)  # read while the graph is built, restored right after
        try:
            return route(block, attr, x)[1]
        finally:
            setattr(obj, name, k)

    def first_norm(self, layer: int, embeddings: mx.array) -> mx.array:
        return cast(mx.array, getattr(self.layers[layer], self.arch.mlp_norm)(embeddings))

    def make_predictor(self, name: str, lookahead_extra: int = 0) -> Predictor:
        """The predictor called ``name`` (see :mod:`.predict`) for one generation."""
        check_predictor(name)
        if name == "lookahead":
            return LookaheadPredictor(lambda layer, x: self.route_ids(layer, x, lookahead_extra), self.first_norm)
        if name == "temporal":
            return TemporalPredictor()
        if name == "trace":
            return TracePredictor()
        return Predictor()


@dataclass(eq=False)
class StepContext:
    """What one forward step carries between the layers it walks.

    ``leases`` are the rows this step pinned, released together once its output is computed;
    ``predicted`` the predictions handed to the source, by MoE layer; ``record`` the routing
    trace's entry of this step (None when not tracing); ``routed`` a queued step's routed ids by
    MoE layer (lazy: read them only once the step computed); ``part`` a queued step's routed pairs
    per expert resolve when the step's experts may not all fit a layer's lent rows at once (None:
    all of them in one); ``armed`` a queued step's output with its completion signal; ``step`` the
    id the source gave the queued step (its failed reads carry it: ``FillError.step``), or None.
    """

    cache: list[Any]
    source: ExpertSource
    predictor: Predictor
    trace: RoutingTrace | None = None
    leases: list[tuple[int, int]] = field(default_factory=list)
    predicted: dict[int, Any] = field(default_factory=dict)
    record: Any = None
    routed: list[tuple[int, mx.array]] = field(default_factory=list)
    part: int | None = None
    #: a queued step's output and its completion, armed as the step was scheduled (see
    #: ``asyncside.bridge.arm``); ``finish`` awaits it
    armed: tuple[mx.array, Any] | None = None
    step: int | None = None
    #: routing replay (:class:`asyncside.models.forcing.RoutingReplay`, or for a batched step
    #: :class:`~asyncside.models.forcing.RowsReplay`: each row from its own position, with
    #: ``position`` 0) and the position of the step's first token in the sequence; None: the
    #: router routes
    routing: Any = None
    position: int = 0
    _forced: dict[int, mx.array] = field(default_factory=dict)

    def forced(self, layer: int, x: mx.array) -> mx.array | None:
        """The ids replacing MoE layer ``layer``'s top-k for block input ``x`` (None: no replay).
        The same array for every call of one step (a block built twice routes the same)."""
        if self.routing is None:
            return None
        ids = self._forced.get(layer)
        if ids is None:
            ids = self._forced[layer] = self.routing.step_ids(layer, self.position, x.shape[:-1])
        return ids

    def __post_init__(self) -> None:
        if self.trace is not None:
            self.record = self.trace.begin(self.predictor.name)
