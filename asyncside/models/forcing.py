"""Routing replay: every MoE layer's top-k replaced by a routing trace's expert ids.

With a :class:`RoutingReplay` set on a :class:`~asyncside.models.streaming.StreamingModel`
(``sm.set_routing(replay)``) every MoE block of every step routes token ``p`` of the sequence to
the trace's ids of position ``p`` (``p`` counted from the start of the generation, the first
prompt token 0; past the trace's end positions wrap around, ``p mod T``). The gate weights are
still the router's own: the block computes its router's scores as mlx-lm does and takes them at
the forced ids (:func:`forced_block_call`), so the expert outputs, their weighting, shared
experts and everything after them are computed exactly as the block would for those ids. The
all-resident reference (mlx-lm's model and ``generate_step``) is forced the same way by
:func:`force_reference`, so tokens still compare exactly.

A trace of the model's own shape (MoE layers, experts, top-k: a recording of it) is replayed as
is; any other is fitted with :meth:`asyncside.routing.RoutingTrace.map_to` (model MoE layer ``i``
replays trace layer ``i mod L``; expert ids spread or folded by a fixed seeded permutation; slots
beyond the model's top-k dropped): docs/routing-traces.md.

``sm.set_routing`` is for batch-1 generation (``generate``, ``demo``, ``bench generate``, the slot
cache), one position counter per step. A batched step (the serving engine's: rows at different
positions, prefill chunks beside decode rows) is forced by :class:`RowsReplay`: row ``b`` replays
its own sequence from its own position, so the step's forced ids are a ``(B, L, k)`` array built
row by row (:func:`sequence_replays` gives one replay per sequence of a trace). The lookahead
predictor still runs the model's router on the hidden state, which does not know
the forced ids (use ``--predictor none`` or ``temporal`` to compare policies without it).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import CacheList

from ..errors import AsyncsideError
from .arch import UnsupportedModelError, top_k_attribute


class RoutingReplayError(AsyncsideError, ValueError):
    """A routing trace cannot be replayed on this model or this step (the message says why)."""


def _count(n: int, noun: str) -> str:
    """``n noun``, the noun plural unless ``n`` is one."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


class RoutingReplay:
    """One sequence of a routing trace fitted to a model: ids ``(T, MoE layers, top_k)``.

    ``moe_layers``: the model's MoE decoder layer indices in order (trace layer ``j`` of the fitted
    trace drives ``moe_layers[j]``); ``n_experts`` and ``top_k``: the model's. ``sequence``
    picks one sequence of a multi-sequence trace.
    """

    def __init__(self, trace: Any, *, moe_layers: Sequence[int], n_experts: int, top_k: int,
                 sequence: int = 0, source: str = "<in memory>") -> None:
        layers = [int(i) for i in moe_layers]
        if not layers:
            raise RoutingReplayError(f"{source}: the model has no MoE layer to replay routing on")
        if isinstance(sequence, bool) or not isinstance(sequence, (int, np.integer)):
            raise RoutingReplayError(f"{source}: sequence: expected an int, which of the trace's "
                                     f"{_count(trace.n_sequences, 'sequence')} to replay, got {sequence!r}")
        if not 0 <= sequence < trace.n_sequences:
            raise RoutingReplayError(f"{source}: sequence {sequence} out of range: the trace has "
                                     f"{trace.n_sequences}")
        try:
            if trace.n_layers == len(layers) and trace.n_experts == n_experts and trace.top_k == top_k:
                fitted = trace  # the model's own shape (a recording of it): replayed as is
            else:
                fitted = trace.map_to(len(layers), int(n_experts), int(top_k))
        except ValueError as exc:
            raise RoutingReplayError(f"{source}: cannot map the trace ({_count(trace.n_layers, 'layer')} x "
                                     f"{_count(trace.n_experts, 'expert')}, top-{trace.top_k}) onto the model "
                                     f"({_count(len(layers), 'MoE layer')} x {_count(int(n_experts), 'expert')}, "
                                     f"top-{top_k}): {exc}") from None
        ids = np.ascontiguousarray(fitted.sequence(sequence), dtype=np.uint32)
        if ids.shape[0] < 1:
            raise RoutingReplayError(f"{source}: sequence {sequence} of the trace has no tokens")
        self.source = source
        self.sequence = int(sequence)
        self.trace = trace
        self.fitted = fitted
        self.ids = ids
        self.moe_layers = layers
        self.n_experts = int(n_experts)
        self.top_k = int(top_k)
        self._ordinal = {layer: j for j, layer in enumerate(layers)}

    @classmethod
    def for_model(cls, trace: Any, model: nn.Module, moe: dict[int, tuple[nn.Module, str]], n_experts: int,
                  *, sequence: int = 0, source: str = "<in memory>") -> RoutingReplay:
        """The replay of ``trace`` on ``model`` (its MoE blocks ``moe``; top-k read off the blocks)."""
        ks = set()
        for i, (block, _attr) in moe.items():
            where = top_k_attribute(block)
            if where is None:
                raise UnsupportedModelError(f"MoE layer {i} ({type(block).__name__}) has no known top-k attribute")
            ks.add(int(getattr(*where)))
        if len(ks) != 1:
            raise RoutingReplayError(f"{source}: the model's MoE layers route different top-k {sorted(ks)}")
        return cls(trace, moe_layers=sorted(moe), n_experts=n_experts, top_k=ks.pop(), sequence=sequence,
                   source=source)

    def misfit(self, moe: dict[int, tuple[nn.Module, str]], n_experts: int) -> str | None:
        """Why this replay cannot drive a model of MoE blocks ``moe``, ``n_experts`` experts a layer
        (None: it was fitted to that shape): it routes the layers, experts and top-k it was fitted to."""
        ks = sorted({int(getattr(*where)) for block, _attr in moe.values()
                     if (where := top_k_attribute(block)) is not None})
        if sorted(moe) == self.moe_layers and int(n_experts) == self.n_experts and ks in ([], [self.top_k]):
            return None
        return (f"{self.source}: this replay was fitted to MoE layers {self.moe_layers} x "
                f"{_count(self.n_experts, 'expert')}, top-{self.top_k}, and this model has MoE layers "
                f"{sorted(moe)} x {_count(int(n_experts), 'expert')}, top-{'/'.join(map(str, ks)) or '?'}: pass "
                f"the trace itself (its file or RoutingTrace) to fit it to this model")

    @property
    def n_tokens(self) -> int:
        """T: positions of the replayed sequence (later positions wrap around)."""
        return int(self.ids.shape[0])

    def describe(self) -> dict[str, Any]:
        """How the trace is replayed, JSON-able: the sequence and the file's sequences, the tokens
        of the one replayed, the file's shape (``source_shape``) and ``mapped_from`` (None when
        replayed as is), and ``note``, one line saying so."""
        src = {"n_layers": int(self.trace.n_layers), "n_experts": int(self.trace.n_experts),
               "top_k": int(self.trace.top_k)}
        mapped = self.fitted is not self.trace
        note = (f"{self.source}: sequence {self.sequence} of {self.trace.n_sequences} replayed ({self.n_tokens} "
                f"token{'s' if self.n_tokens != 1 else ''}; later positions wrap around); {self.fit_note()}")
        return {"sequence": self.sequence, "sequences": int(self.trace.n_sequences), "sequence_tokens": self.n_tokens,
                "source_shape": src, "mapped_from": self.fitted.meta.get("mapped_from", src) if mapped else None,
                "note": note}

    def fit_note(self) -> str:
        """The trace's shape and whether it was mapped onto the model's, in words."""
        t = self.trace
        shape = (f"{t.n_layers} layer{'s' if t.n_layers != 1 else ''} x {t.n_experts} "
                 f"expert{'s' if t.n_experts != 1 else ''} top-{t.top_k}")
        if self.fitted is t:
            return f"its {shape}, the model's own"
        n = len(self.moe_layers)
        return (f"its {shape} mapped onto the model's {n} MoE layer{'s' if n != 1 else ''} x {self.n_experts} "
                f"experts top-{self.top_k}")

    def host_ids(self, layer: int, start: int, n: int) -> np.ndarray:
        """The forced ids of MoE decoder layer ``layer`` for positions ``start .. start+n-1``: (n, top_k)."""
        try:
            j = self._ordinal[layer]
        except KeyError:
            raise RoutingReplayError(f"layer {layer} is not an MoE layer of the replay ({self.moe_layers})") from None
        pos = (np.arange(start, start + n, dtype=np.int64)) % self.n_tokens
        return self.ids[pos, j, :]

    def with_sequence(self, sequence: int) -> RoutingReplay:
        """The replay of another sequence of the same trace, fitted the same way (no second fit)."""
        if sequence == self.sequence:
            return self
        return RoutingReplay(self.fitted, moe_layers=self.moe_layers, n_experts=self.n_experts, top_k=self.top_k,
                             sequence=sequence, source=self.source)

    def step_ids(self, layer: int, start: int, shape: Sequence[int]) -> mx.array:
        """Forced ids for a block input of leading shape ``shape`` (B, L[, ...]): ``(*shape, top_k)`` uint32.

        Only batch 1 (``B == 1``) has one position per token; a larger batch is refused (a batch
        of rows at their own positions: :class:`RowsReplay`).
        """
        shape = tuple(int(s) for s in shape)
        if len(shape) == 2 and shape[0] == 1:
            n = shape[1]
        elif len(shape) == 1:
            n = shape[0]
        else:
            raise RoutingReplayError(f"routing replay runs batch-1 steps; got a block input of leading shape {shape}")
        return mx.array(self.host_ids(layer, start, n).reshape(*shape, self.top_k))


class RowsReplay:
    """Routing replay of a batched step: row ``b`` of the block input routes to ``rows[b]``'s
    replay from position ``rows[b][1]`` on (token ``t`` of the row: position ``rows[b][1] + t``).

    Every row of the step gets ids, right padding included (a pad's position is the next one of
    its row's sequence, wrapped as any position): a padded token routes to valid experts like any
    token. Passed as a step context's ``routing`` with ``position`` 0 (:class:`StepContext`).
    """

    def __init__(self, rows: Sequence[tuple[RoutingReplay, int]]) -> None:
        self.rows = [(replay, int(start)) for replay, start in rows]
        if not self.rows:
            raise RoutingReplayError("a batched replay needs at least one row")
        for b, (replay, start) in enumerate(self.rows):
            if not isinstance(replay, RoutingReplay):
                raise RoutingReplayError(f"row {b}: expected a RoutingReplay, got {type(replay).__name__}")
            if start < 0:
                raise RoutingReplayError(f"row {b}: position must be >= 0, got {start}")
        if len({r.top_k for r, _ in self.rows}) != 1:
            raise RoutingReplayError("the rows' replays route different top-k")
        self.top_k = self.rows[0][0].top_k

    def host_ids(self, layer: int, start: int, n: int) -> np.ndarray:
        """The forced ids of MoE layer ``layer`` for each row's tokens ``start .. start+n-1`` (counted
        from the row's own position): (B, n, top_k)."""
        return np.stack([replay.host_ids(layer, pos + start, n) for replay, pos in self.rows])

    def step_ids(self, layer: int, start: int, shape: Sequence[int]) -> mx.array:
        """Forced ids for a block input of leading shape ``(B, L)`` (B: the rows): ``(B, L, top_k)`` uint32."""
        shape = tuple(int(s) for s in shape)
        if len(shape) != 2 or shape[0] != len(self.rows):
            raise RoutingReplayError(f"a batched replay of {len(self.rows)} row(s) needs a block input of leading "
                                     f"shape ({len(self.rows)}, L); got {shape}")
        return mx.array(self.host_ids(layer, start, shape[1]))


def sequence_replays(replay: RoutingReplay) -> list[RoutingReplay]:
    """One replay per sequence of ``replay``'s trace, in order, fitted once."""
    return [replay.with_sequence(s) for s in range(replay.fitted.n_sequences)]


def batch_replays(routing: Any, model: Any = None) -> list[RoutingReplay]:
    """A serving batch's ``routing`` (None, a RoutingReplay, or a non-empty sequence of them) as a
    list of replays, one per trace sequence; RoutingReplayError where they were fitted to another
    model than ``model`` (its ``routing_misfit``; a pipeline's stages check their own layers)."""
    if routing is None:
        return []
    if isinstance(routing, RoutingReplay):
        replays = sequence_replays(routing)
    else:
        replays = list(routing)
        if not replays or not all(isinstance(r, RoutingReplay) for r in replays):
            raise TypeError("routing: expected a RoutingReplay or a non-empty sequence of them")
    misfit = getattr(model, "routing_misfit", None)
    if callable(misfit) and (problem := misfit(replays[0])) is not None:
        raise RoutingReplayError(problem)  # another model's replay: its ids and top-k, without a word
    return replays


def load_replay(path: str | os.PathLike[str], model: nn.Module, moe: dict[int, tuple[nn.Module, str]],
                n_experts: int, *, sequence: int = 0) -> RoutingReplay:
    """Load a routing trace file (:meth:`asyncside.routing.RoutingTrace.load`) and fit it to a model."""
    from ..routing import RoutingTrace

    return RoutingReplay.for_model(RoutingTrace.load(path), model, moe, n_experts, sequence=sequence,
                                   source=os.fspath(path))


def cache_position(cache: Sequence[Any]) -> int:
    """Tokens a KV cache has seen: the position of the next step's first token."""
    if not cache:
        return 0
    first = cache[0]
    if isinstance(first, CacheList):  # deepseek_v32: its latent keys' cache, then its indexer's
        first = first[0]
    offset = getattr(first, "offset", None)
    if isinstance(offset, (int, np.integer)):
        return int(offset)
    raise RoutingReplayError(f"routing replay needs a batch-1 cache with an int offset, got "
                             f"{type(cache[0]).__name__} (offset {offset!r})")


# -- the blocks, routed to given ids ----------------------------------------------------------------

def _qwen3_moe(block: nn.Module, x: mx.array, inds: mx.array) -> mx.array:
    gates = mx.softmax(block.gate(x), axis=-1, precise=True)
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if block.norm_topk_prob:
        scores /= mx.sum(scores, axis=-1, keepdims=True)
    y: mx.array = block.switch_mlp(x, inds)
    return (y * scores[..., None]).sum(axis=-2).astype(y.dtype)


def _mixtral(block: nn.Module, x: mx.array, inds: mx.array) -> mx.array:
    gates = block.gate(x)
    scores = mx.softmax(mx.take_along_axis(gates, inds, axis=-1), axis=-1, precise=True)
    y: mx.array = block.switch_mlp(x, inds)
    return (y * scores[..., None]).sum(axis=-2)


def _olmoe(block: nn.Module, x: mx.array, inds: mx.array) -> mx.array:
    B, L, D = x.shape
    x_flat = x.reshape(-1, D)
    inds = inds.reshape(B * L, -1)
    weights = mx.softmax(block.gate(x_flat), axis=1, precise=True)
    scores = mx.take_along_axis(weights, inds, axis=-1)
    if block.norm_topk_prob:
        scores = scores / scores.sum(axis=-1, keepdims=True)
    y: mx.array = block.switch_mlp(x_flat, inds)
    return (y * scores[..., None]).sum(axis=-2).reshape(B, L, D)


def _deepseek_v3(block: nn.Module, x: mx.array, inds: mx.array) -> mx.array:
    gate = block.gate
    # group_expert_select's scores without its group and top-k selection: sigmoid of the logits,
    # taken at the forced ids, normalised and scaled as it does.
    orig = mx.sigmoid((x @ gate.weight.T).astype(mx.float32))
    scores = mx.take_along_axis(orig, inds, axis=-1)
    if gate.top_k > 1 and gate.norm_topk_prob:
        scores = scores / scores.sum(axis=-1, keepdims=True)
    scores = scores * gate.routed_scaling_factor
    y: mx.array = block.switch_mlp(x, inds)
    y = (y * scores[..., None]).sum(axis=-2).astype(y.dtype)
    if block.config.n_shared_experts is not None:
        y = y + block.shared_experts(x)
    return y


def _gpt_oss(block: nn.Module, x: mx.array, inds: mx.array) -> mx.array:
    g = block.router(x)
    weights = mx.softmax(mx.take_along_axis(g, inds, axis=-1), axis=-1, precise=True)
    y: mx.array = block.experts(x, inds)
    return (y * mx.expand_dims(weights, axis=-1)).sum(axis=-2)


def _qwen2_moe(block: nn.Module, x: mx.array, inds: mx.array) -> mx.array:
    gates = mx.softmax(block.gate(x), axis=-1, precise=True)
    scores = mx.take_along_axis(gates, inds, axis=-1)
    y: mx.array = block.switch_mlp(x, inds)
    y = (y * scores[..., None]).sum(axis=-2)
    shared: mx.array = mx.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    return y + shared


def _deepseek_v2(block: nn.Module, x: mx.array, inds: mx.array) -> mx.array:
    gate = block.gate
    # The router's softmax taken at the forced ids: group-limited greedy routing only zeroes the
    # scores of the groups it drops, part of the selection the forced ids replace.
    scores = mx.softmax(x @ gate.weight.T, axis=-1, precise=True)
    scores = mx.take_along_axis(scores, inds, axis=-1) * gate.routed_scaling_factor
    y: mx.array = block.switch_mlp(x, inds)
    y = (y * scores[..., None]).sum(axis=-2)
    if block.config.n_shared_experts is not None:
        y = y + block.shared_experts(x)
    return y


def _sigmoid_group_scores(gate: nn.Module, x: mx.array, inds: mx.array, eps: float = 0.0) -> mx.array:
    # group_expert_select's scores (glm4_moe, dots1) at the forced ids, as _deepseek_v3 takes them;
    # ``eps``: the small term some models' selection adds to the normalising sum.
    orig = mx.sigmoid((x @ gate.weight.T).astype(mx.float32))
    scores = mx.take_along_axis(orig, inds, axis=-1)
    if gate.top_k > 1 and gate.norm_topk_prob:
        total = scores.sum(axis=-1, keepdims=True)
        scores = scores / (total + eps if eps else total)
    scaled: mx.array = scores * gate.routed_scaling_factor
    return scaled


def _dots1(block: nn.Module, x: mx.array, inds: mx.array) -> mx.array:
    scores = _sigmoid_group_scores(block.gate, x, inds)
    y: mx.array = block.experts(x, inds)
    y = (y * scores[..., None]).sum(axis=-2).astype(y.dtype)
    if block.n_shared_experts is not None:
        y = y + block.shared_experts(x)
    return y


def _phimoe(block: nn.Module, x: mx.array, inds: mx.array) -> mx.array:
    # mlx-lm's sparsemixer with each round's argmax replaced by the forced id of that slot: the
    # round's "top" is the (still unmasked) logit of that id, the jitter band and softmax as before.
    gates = block.gate(x)
    masked = gates
    scores = []
    for j in range(inds.shape[-1]):
        ind = inds[..., j:j + 1]
        top = mx.take_along_axis(masked, ind, axis=-1)
        factor = mx.maximum(mx.abs(gates), top)
        band = mx.where((top - gates) / factor > 2 * block.jitter_eps, -mx.inf, masked)
        band = mx.softmax(band, axis=-1, precise=True)
        scores.append(mx.take_along_axis(band, ind, axis=-1))
        masked = mx.put_along_axis(masked, ind, mx.array(-mx.inf, masked.dtype), axis=-1)
    weights = mx.concatenate(scores, axis=-1)
    y: mx.array = block.switch_mlp(x, inds)
    return (y * weights[..., None]).sum(axis=-2)


def _ernie4_5_moe(block: nn.Module, x: mx.array, inds: mx.array) -> mx.array:
    gates = block.gate_act(block.gate(x).astype(mx.float32))
    scores = mx.take_along_axis(gates, inds, axis=-1)
    scores = scores / mx.maximum(scores.sum(axis=-1, keepdims=True), 1e-12)
    y: mx.array = block.switch_mlp(x, inds)
    y = (y * scores[..., None]).sum(axis=-2).astype(y.dtype)
    if block.shared_experts is not None:
        y = y + block.shared_experts(x)
    return y


def _hunyuan(block: nn.Module, x: mx.array, inds: mx.array) -> mx.array:
    gates = mx.softmax(block.gate(x), axis=-1, precise=True)
    scores = mx.take_along_axis(gates, inds, axis=-1)
    y: mx.array = block.switch_mlp(x, inds)
    y = (y * scores[..., None].astype(mx.float32)).sum(axis=-2).astype(y.dtype)
    if block.use_shared_mlp:
        y = y + block.shared_mlp(x)
    return y


def _bailing_moe(block: nn.Module, x: mx.array, inds: mx.array) -> mx.array:
    gate = block.gate
    logits = gate.gate_proj(x)
    if gate.score_function == "sigmoid":
        orig = mx.sigmoid(logits.astype(mx.float32))
    else:
        orig = mx.softmax(logits.astype(mx.float32), axis=-1)
    scores = mx.take_along_axis(orig, inds, axis=-1)
    if gate.top_k > 1 and gate.norm_topk_prob:
        scores = scores / (scores.sum(axis=-1, keepdims=True) + 1e-20)
    scores = (scores * gate.routed_scaling_factor).astype(logits.dtype)
    y: mx.array = block.switch_mlp(x, inds)
    # The block's module's own compiled aggregation, as its __call__ uses it.
    y = importlib.import_module(type(block).__module__).aggregate_expert_outputs(y, scores)
    if block.shared_experts is not None:
        y = y + block.shared_experts(x)
    return y


def _llama4(block: nn.Module, x: mx.array, inds: mx.array) -> mx.array:
    logits = block.router(x)
    scores = mx.take_along_axis(logits, inds, axis=-1)
    scores = mx.sigmoid(scores.astype(mx.float32)).astype(x.dtype)
    out: mx.array = block.experts(x * scores, inds).squeeze(2)
    shared: mx.array = block.shared_expert(x)
    return out + shared


def _granitemoe(block: nn.Module, x: mx.array, inds: mx.array) -> mx.array:
    logits = block.router.layer(x)
    gates = mx.softmax(mx.take_along_axis(logits, inds, axis=-1).astype(mx.float32), axis=-1)
    y: mx.array = block.switch_mlp(x, inds)
    return (y * gates[..., None]).sum(axis=-2).astype(y.dtype)


def _minimax(block: nn.Module, x: mx.array, inds: mx.array) -> mx.array:
    # The sigmoid of the float32 logits taken at the forced ids (the correction bias only picks
    # them), normalised and cast as mlx-lm's block does.
    scores = mx.take_along_axis(mx.sigmoid(block.gate(x.astype(mx.float32))), inds, axis=-1)
    scores = scores / (mx.sum(scores, axis=-1, keepdims=True) + 1e-20)
    scores = scores.astype(x.dtype)
    y: mx.array = block.switch_mlp(x, inds)
    return (y * scores[..., None]).sum(axis=-2)


def _deepseek(block: nn.Module, x: mx.array, inds: mx.array) -> mx.array:
    scores = mx.softmax(x @ block.gate.weight.T, axis=-1, precise=True)
    scores = mx.take_along_axis(scores, inds, axis=-1)
    y: mx.array = block.switch_mlp(x, inds)
    y = (y * scores[..., None]).sum(axis=-2)
    if block.config.n_shared_experts is not None:
        y = y + block.shared_experts(x)
    return y


def _sigmoid_group_eps(block: nn.Module, x: mx.array, inds: mx.array) -> mx.array:
    # glm4_moe_lite, exaone_moe, mimo_v2_flash: deepseek_v3's scores, but their group_expert_select
    # adds a small term to the denominator; shared experts where the block has them.
    scores = _sigmoid_group_scores(block.gate, x, inds, eps=1e-20)
    y: mx.array = block.switch_mlp(x, inds)
    y = (y * scores[..., None]).sum(axis=-2).astype(y.dtype)
    if getattr(block, "shared_experts", None) is not None:
        y = y + block.shared_experts(x)
    return y


def _mistral4(block: nn.Module, x: mx.array, inds: mx.array) -> mx.array:
    # mistral4_expert_select's softmax taken at the forced ids (its group limit only zeroes the
    # scores it does not pick), normalised and scaled as it does.
    args = block.args
    scores = mx.take_along_axis(mx.softmax(block.gate(x).astype(mx.float32), axis=-1), inds, axis=-1)
    if args.norm_topk_prob:
        scores = scores / (scores.sum(axis=-1, keepdims=True) + 1e-20)
    scores = scores * args.routed_scaling_factor
    y: mx.array = block.switch_mlp(x, inds)
    y = (y * scores[..., None]).sum(axis=-2).astype(y.dtype)
    if args.n_shared_experts is not None:
        y = y + block.shared_experts(x)
    return y


def _klear(block: nn.Module, x: mx.array, inds: mx.array) -> mx.array:
    # The sigmoid of the logits at the forced ids (the expert bias only picks them); the routed and
    # shared outputs mixed by the block's coefficients as mlx-lm's block mixes them.
    scores = mx.take_along_axis(mx.sigmoid(block.gate(x).astype(mx.float32)), inds, axis=-1)
    if block.norm_topk_prob:
        scores = scores / mx.sum(scores, axis=-1, keepdims=True)
    scores = scores.astype(x.dtype)
    y: mx.array = (block.experts(x, inds) * scores[..., None]).sum(axis=-2)
    coef = mx.softmax(block.coefficient(x), axis=-1, precise=True)
    out: mx.array = y * coef[..., :1] + block.shared_experts(x) * coef[..., 1:]
    return out


def _mellum(block: nn.Module, x: mx.array, inds: mx.array) -> mx.array:
    gates = mx.softmax(block.gate(x), axis=-1, precise=True)
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if block.norm_topk_prob:
        scores /= mx.sum(scores, axis=-1, keepdims=True)
    y: mx.array = block.switch_mlp(x, inds)
    return (y * scores[..., None]).sum(axis=-2)


def _laguna(block: nn.Module, x: mx.array, inds: mx.array) -> mx.array:
    # its gate's scores (soft-capped logits, its score function) at the forced ids, normalised; the
    # correction bias only picks them.
    gate = block.gate
    logits = gate.proj(x).astype(mx.float32)
    if gate.softcap > 0.0:
        logits = mx.tanh(logits / gate.softcap) * gate.softcap
    weights = mx.take_along_axis(gate._routing_scores(logits), inds, axis=-1)
    weights = weights / weights.sum(axis=-1, keepdims=True)
    shared: mx.array = block.shared_expert(x)
    y: mx.array = block.switch_mlp(x, inds)
    y = (y * weights[..., None]).sum(axis=-2).astype(x.dtype)
    out: mx.array = y * block.routed_scaling_factor + shared
    return out


def _afmoe(block: nn.Module, x: mx.array, inds: mx.array) -> mx.array:
    # AfmoeMoE's scores (sigmoid or softmax of the router's logits) at the forced ids, normalised
    # and scaled as it does; its expert bias and groups only pick the ids the forced ones replace.
    gates = block.router(x).astype(mx.float32)
    scores = mx.sigmoid(gates) if block.score_func == "sigmoid" else mx.softmax(gates, axis=-1)
    selected = mx.take_along_axis(scores, inds, axis=-1)
    if block.route_norm and block.num_experts_per_tok > 1:
        selected = selected / selected.sum(axis=-1, keepdims=True)
    selected = selected * block.route_scale
    y: mx.array = block.experts(x, inds)
    y = (y * selected[..., None]).sum(axis=-2).astype(y.dtype)
    if block.args.num_shared_experts > 0:
        y = y + block.shared_experts(x)
    return y


def _step3p5(block: nn.Module, x: mx.array, inds: mx.array) -> mx.array:
    # moe_gate_select's sigmoid scores at the forced ids (its router bias only picks them),
    # normalised with its small term and scaled; the shared expert added as the block adds it.
    gate = block.gate
    weights = mx.take_along_axis(mx.sigmoid(gate.gate(x).astype(mx.float32)), inds, axis=-1)
    if gate.norm_topk_prob:
        weights = weights / (mx.sum(weights, axis=-1, keepdims=True) + 1e-20)
    weights = weights * gate.routed_scaling_factor
    y: mx.array = block.switch_mlp(x, inds)
    y = (y * weights[..., None]).sum(axis=-2).astype(y.dtype)
    out: mx.array = y + block.share_expert(x)
    return out


def _normed(block: nn.Module, x: mx.array, inds: mx.array) -> mx.array:
    # the walk's NormedBlock: the wrapped block forced, then the layer's norm of its output
    out: mx.array = block.norm(forced_block_call(block.block, x, inds))
    return out


def _scaled(block: nn.Module, x: mx.array, inds: mx.array) -> mx.array:
    # the walk's ScaledBlock: the wrapped block forced, times the layer's residual factor
    out: mx.array = forced_block_call(block.block, x, inds) * block.scale
    return out


#: MoE block class name -> its ``__call__`` with the router's top-k replaced by given ids (the same
#: ops as mlx-lm's block otherwise)
_FORCED = {
    "Qwen3MoeSparseMoeBlock": _qwen3_moe,
    "MixtralSparseMoeBlock": _mixtral,
    "OlmoeSparseMoeBlock": _olmoe,
    "DeepseekV3MoE": _deepseek_v3,
    "MLPBlock": _gpt_oss,
    "Qwen2MoeSparseMoeBlock": _qwen2_moe,
    "DeepseekV2MoE": _deepseek_v2,
    "PhiMoESparseMoeBlock": _phimoe,
    "Ernie4_5_MoeMLP": _ernie4_5_moe,
    "Dots1MoE": _dots1,
    "BailingMoeSparseMoeBlock": _bailing_moe,
    # Class names several mlx-lm modules use: keyed by module too.
    "mlx_lm.models.glm4_moe.MoE": _deepseek_v3,
    "mlx_lm.models.hunyuan.MoeBlock": _hunyuan,
    "mlx_lm.models.llama4.MoE": _llama4,
    "GraniteMoeMoE": _granitemoe,
    "MiniMaxSparseMoeBlock": _minimax,
    "mlx_lm.models.deepseek.DeepseekMoE": _deepseek,
    "Glm4MoeLiteMoE": _sigmoid_group_eps,
    "Mistral4MoE": _mistral4,
    "KlearSparseMoeBlock": _klear,
    "mlx_lm.models.exaone_moe.MoE": _sigmoid_group_eps,
    "MellumSparseMoeBlock": _mellum,
    "mlx_lm.models.laguna.MoE": _laguna,
    "mlx_lm.models.mimo_v2_flash.MoE": _sigmoid_group_eps,
    "asyncside.models.arch.ScaledBlock": _scaled,
    "DeepseekV32MoE": _deepseek_v3,
    "AfmoeMoE": _afmoe,
    "Step3p5MoE": _step3p5,
    "asyncside.models.arch.NormedBlock": _normed,
}


def forced_block_call(block: nn.Module, x: mx.array, inds: mx.array) -> mx.array:
    """The MoE block's output for ``x`` with every token routed to ``inds`` (``x.shape[:-1] + (k,)``).

    The gate weights are the router's scores at ``inds``, computed with mlx-lm's ops for the
    block's architecture; the switch layer is the block's own (a PooledSwitch in asyncside).
    """
    cls = type(block)
    fn = _FORCED.get(f"{cls.__module__}.{cls.__name__}") or _FORCED.get(cls.__name__)
    if fn is None:
        raise UnsupportedModelError(f"routing replay does not know the router of {type(block).__name__}; "
                                    f"known: {sorted(_FORCED)}")
    if getattr(block, "sharding_group", None) is not None:
        raise UnsupportedModelError("routing replay does not support tensor-sharded MoE blocks")
    return fn(block, x, inds)


# -- the all-resident reference -------------------------------------------------------------------

class ForcedBlock(nn.Module):
    """An mlx-lm MoE block whose routing replays a trace; installed by :func:`force_reference`.

    mlx-lm's model calls each block once per step, in order, so the block counts the positions
    it has seen (:meth:`rewind` restarts a generation at position 0).
    """

    def __init__(self, block: nn.Module, layer: int, replay: RoutingReplay) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx's Module.__init__ is unannotated
        self.block = block
        object.__setattr__(self, "_layer", layer)
        object.__setattr__(self, "_replay", replay)
        object.__setattr__(self, "_position", 0)

    def rewind(self) -> None:
        object.__setattr__(self, "_position", 0)

    def __call__(self, x: mx.array) -> mx.array:
        n = int(np.prod(x.shape[:-1]))
        inds = self._replay.step_ids(self._layer, self._position, x.shape[:-1])
        object.__setattr__(self, "_position", self._position + n)
        return forced_block_call(self.block, x, inds)


def force_reference(model: nn.Module, block_attr: str, replay: RoutingReplay) -> list[ForcedBlock]:
    """Wrap every MoE block of an mlx-lm ``model`` (its decoder layers' ``block_attr``) so its
    routing replays ``replay``; returns the wrappers. Call :func:`rewind_reference` before each
    generation."""
    out = []
    for i in replay.moe_layers:
        layer = model.layers[i]
        block = getattr(layer, block_attr)
        if isinstance(block, ForcedBlock):
            block = block.block
        wrapped = ForcedBlock(block, i, replay)
        setattr(layer, block_attr, wrapped)
        out.append(wrapped)
    return out


def rewind_reference(model: nn.Module) -> None:
    """Restart every :class:`ForcedBlock` of ``model`` at position 0 (no-op for an unforced model)."""
    for layer in getattr(model, "layers", []):
        for child in layer.children().values():
            if isinstance(child, ForcedBlock):
                child.rewind()
