"""Pooled switch layers: mlx-lm's SwitchGLU/SwitchMLP computed over pool arrays.

A :class:`PooledSwitch` replaces each MoE block's switch layer. It holds no expert weights; the
async forward drives it through two phases of the block's *own* ``__call__``:

1. **route** (:func:`route`): the block is called with the switch in capture mode; the switch raises
   :class:`_Captured` with the (input, expert ids) the block handed it, so the block's router code
   (softmax/sigmoid, top-k, group selection) produced the ids, nothing re-implemented.
2. **combine** (:func:`combine`): after the ids are on the host and their rows are resident, the
   expert outputs are computed by :func:`pooled_switch_apply` (a gather over the pools with physical
   rows) and the block is called again with the switch returning that output, so the block's own
   code applies scores, normalisation and shared experts.

When the expert outputs can be built before the ids are known (a gather from a row snapshot, in
the graph), :func:`route_and_apply` does both in one call of the block: its router is built and
computed once, and the second call is only needed if the host later replaces the output.

:func:`pooled_switch_apply` reproduces ``SwitchGLU.__call__`` op for op, except that ``rhs_indices``
are physical pool rows instead of expert ids. For many tokens (>= 64 routed pairs) mlx-lm sorts the
pairs by expert id and passes ``sorted_indices=True``; here the pairs are sorted by *row* (stable),
which makes the same groups (rows are a bijection of the experts in use) and keeps the indices
monotone as ``sorted_indices`` promises. Each (token, expert) product is computed independently of
its group's position, so outputs are bitwise equal to mlx-lm's (asserted by the tests).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .arch import UnsupportedModelError, register_switch_type, switch_meta
from .forcing import forced_block_call

#: mlx-lm's SwitchGLU sorts the routed pairs when there are at least this many.
SORT_THRESHOLD = 64


@dataclass(frozen=True)
class SwitchSpec:
    """How to compute one switch layer from pools: kind ("glu"/"mlp") and per-linear metadata."""

    kind: str
    linears: tuple[tuple[str, dict[str, Any]], ...]

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> SwitchSpec:
        kind = meta.get("kind")
        linears = meta.get("linears")
        if kind not in ("glu", "mlp") or not isinstance(linears, Mapping):
            raise UnsupportedModelError(f"bad switch metadata {meta!r:.200}")
        expected = ["gate_proj", "up_proj", "down_proj"] if kind == "glu" else ["fc1", "fc2"]
        if sorted(linears) != sorted(expected):
            raise UnsupportedModelError(f"switch kind {kind!r} needs linears {expected}, got {sorted(linears)}")
        return cls(kind, tuple((n, dict(linears[n])) for n in expected))

    def to_meta(self) -> dict[str, Any]:
        return {"kind": self.kind, "linears": {n: dict(m) for n, m in self.linears}}


class _Captured(Exception):
    """Raised by a PooledSwitch in capture mode to stop the block right after routing."""

    def __init__(self, x: mx.array, indices: mx.array) -> None:
        super().__init__("routing captured")
        self.x = x
        self.indices = indices


class _Apply:
    """Switch plan of :func:`route_and_apply`: computes the output from the routed ids, or declines."""

    def __init__(self, fn: Callable[[mx.array, mx.array], mx.array | None]) -> None:
        self.fn = fn
        self.seen: tuple[mx.array, mx.array, mx.array] | None = None

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        y = self.fn(x, indices)
        if y is None:
            raise _Captured(x, indices)
        self.seen = (x, indices, y)
        return y


@register_switch_type
class PooledSwitch(nn.Module):
    """Stand-in for a switch layer; computes nothing by itself (see the module docstring)."""

    _spec: SwitchSpec

    def __init__(self, spec: SwitchSpec, activation: nn.Module) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx's Module.__init__ is unannotated
        object.__setattr__(self, "_spec", spec)  # plain attribute, not a parameter container
        object.__setattr__(self, "_plan", None)
        self.activation = activation

    @property
    def spec(self) -> SwitchSpec:
        return self._spec

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        plan = self._plan
        if isinstance(plan, _Apply):
            return plan(x, indices)
        if isinstance(plan, mx.array):
            if tuple(plan.shape[:-1]) != tuple(indices.shape):
                raise RuntimeError(f"planned switch output {plan.shape} does not fit the routed ids {indices.shape}")
            return plan
        raise RuntimeError(
            "a PooledSwitch holds no expert weights: run the model through asyncside's async forward "
            "(StreamingModel.generate), not its synchronous __call__"
        )


def replace_switches(model: nn.Module, moe: Mapping[int, tuple[nn.Module, str]],
                     specs: Mapping[int, SwitchSpec] | None = None) -> dict[int, SwitchSpec]:
    """Swap every MoE block's switch layer for a :class:`PooledSwitch`; returns layer -> spec.

    ``specs`` (e.g. from a store's metadata) overrides the spec read off the module, which matters
    when the model was built unquantized from a config and the experts are quantized in the store.
    mlx-lm's own switch modules (and their lazily-initialised weights) are dropped unevaluated.
    """
    out: dict[int, SwitchSpec] = {}
    for layer, (block, attr) in moe.items():
        sw = getattr(block, attr)
        if isinstance(sw, PooledSwitch):
            out[layer] = sw.spec
            continue
        spec = specs[layer] if specs is not None else SwitchSpec.from_meta(switch_meta(sw))
        setattr(block, attr, PooledSwitch(spec, sw.activation))
        out[layer] = spec
    return out


def route(block: nn.Module, attr: str, x: mx.array) -> tuple[mx.array, mx.array]:
    """Run the block's own router on ``x``; returns (switch input, expert ids), both lazy."""
    _out, x_sw, indices, _y = route_and_apply(block, attr, x, _decline)
    return x_sw, indices


def _decline(x: mx.array, indices: mx.array) -> None:
    return None


def route_and_apply(block: nn.Module, attr: str, x: mx.array,
                    apply: Callable[[mx.array, mx.array], mx.array | None], forced: mx.array | None = None
                    ) -> tuple[mx.array | None, mx.array, mx.array, mx.array | None]:
    """Route and combine in one call of the block, its switch computing ``apply(x_sw, ids)``.

    Returns ``(block output, switch input, ids, switch output)``, all lazy. When ``apply`` returns
    None the block stops right after routing, like :func:`route`, and the result is
    ``(None, switch input, ids, None)``. One call instead of :func:`route` then :func:`combine`
    builds (and computes) the block's router once when the switch output can be built before the
    ids are known (the forward's speculative row gather). ``forced``: ids replacing the router's
    top-k (routing replay, :func:`asyncside.models.forcing.forced_block_call`).
    """
    sw = getattr(block, attr)
    plan = _Apply(apply)
    object.__setattr__(sw, "_plan", plan)
    try:
        out = block(x) if forced is None else forced_block_call(block, x, forced)
    except _Captured as cap:
        return None, cap.x, cap.indices, None
    finally:
        object.__setattr__(sw, "_plan", None)
    if plan.seen is None:
        raise UnsupportedModelError(f"{type(block).__name__}.__call__ returned without calling its switch layer")
    x_sw, indices, y = plan.seen
    return out, x_sw, indices, y


def combine(block: nn.Module, attr: str, x: mx.array, switch_out: mx.array,
            forced: mx.array | None = None) -> mx.array:
    """Run the block's own ``__call__`` with its switch layer returning ``switch_out`` (routed to
    ``forced`` when given, as :func:`route_and_apply`)."""
    sw = getattr(block, attr)
    object.__setattr__(sw, "_plan", switch_out)
    try:
        return block(x) if forced is None else forced_block_call(block, x, forced)
    finally:
        object.__setattr__(sw, "_plan", None)


def _linear(meta: Mapping[str, Any], name: str, pools: Mapping[str, mx.array], x: mx.array,
            idx: mx.array, sorted_indices: bool) -> mx.array:
    # Same calls as mlx-lm's QuantizedSwitchLinear / SwitchLinear, over pool arrays.
    if meta["quantized"]:
        x = mx.gather_qmm(
            x,
            pools[f"{name}.weight"],
            pools[f"{name}.scales"],
            pools.get(f"{name}.biases"),
            rhs_indices=idx,
            transpose=True,
            group_size=meta["group_size"],
            bits=meta["bits"],
            mode=meta["mode"],
            sorted_indices=sorted_indices,
        )
    else:
        x = mx.gather_mm(x, pools[f"{name}.weight"].swapaxes(-1, -2), rhs_indices=idx, sorted_indices=sorted_indices)
    if meta["bias"]:
        x = x + mx.expand_dims(pools[f"{name}.bias"][idx], -2)
    return x


def pooled_switch_apply(spec: SwitchSpec, activation: nn.Module, x: mx.array, rows: np.ndarray | mx.array,
                        pools: Mapping[str, mx.array], *, sort: bool | None = None) -> mx.array:
    """The switch layer's output for input ``x`` with each routed pair served from pool row ``rows``.

    ``rows`` has the shape of the routed expert ids: a host array, or an ``mx.array`` computed in
    the graph (sorted in the graph too when there are :data:`SORT_THRESHOLD` pairs or more, or
    as ``sort`` says: a part of a larger switch input sorts as the whole would). Mirrors
    ``SwitchGLU.__call__``.
    """
    lin = dict(spec.linears)
    x = mx.expand_dims(x, (-2, -3))
    do_sort = rows.size >= SORT_THRESHOLD if sort is None else sort
    inv_order = None
    if isinstance(rows, mx.array):
        idx = rows.astype(mx.uint32)
        if do_sort:
            # mlx-lm's own sort, by row instead of expert id: the same groups (rows are a
            # bijection of the experts in use), and each pair's product does not depend on where
            # its group lands, so the outputs are bitwise the same.
            m = rows.shape[-1]
            flat = idx.flatten()
            order = mx.argsort(flat)
            inv_order = mx.argsort(order)
            x = x.flatten(0, -3)[order // m]
            idx = flat[order]
    elif do_sort:
        m = rows.shape[-1]
        flat_np = rows.reshape(-1)
        order_np = np.argsort(flat_np, kind="stable")
        inv = np.empty_like(order_np)
        inv[order_np] = np.arange(order_np.size)
        x = x.flatten(0, -3)[mx.array(order_np // m)]
        idx = mx.array(flat_np[order_np].astype(np.uint32))
        inv_order = mx.array(inv)
    else:
        idx = mx.array(rows.astype(np.uint32))
    if spec.kind == "glu":
        x_up = _linear(lin["up_proj"], "up_proj", pools, x, idx, do_sort)
        x_gate = _linear(lin["gate_proj"], "gate_proj", pools, x, idx, do_sort)
        x = _linear(lin["down_proj"], "down_proj", pools, activation(x_up, x_gate), idx, do_sort)
    else:
        x = _linear(lin["fc1"], "fc1", pools, x, idx, do_sort)
        x = activation(x)
        x = _linear(lin["fc2"], "fc2", pools, x, idx, do_sort)
    if do_sort:
        x = mx.unflatten(x[inv_order], 0, rows.shape)
    return x.squeeze(-2)


def pooled_switch_unsorted_pairs(spec: SwitchSpec, activation: nn.Module, x: mx.array, tokens: np.ndarray,
                                 rows: np.ndarray, pools: Mapping[str, mx.array]) -> mx.array:
    """Outputs of a few routed pairs on the unsorted path (fewer than :data:`SORT_THRESHOLD`
    pairs in all): shape ``(len(rows), out)``, pair j being token ``tokens[j]`` (flat index into
    ``x``'s leading dims) times pool row ``rows[j]``. Each pair is the same vector-matrix product
    as in the full unsorted gather, so results are bitwise those of :func:`pooled_switch_apply`.
    """
    xt = x.reshape(-1, x.shape[-1])[mx.array(tokens)]
    return pooled_switch_apply(spec, activation, xt, np.asarray(rows).reshape(-1, 1), pools).squeeze(-2)


def pooled_switch_pairs(spec: SwitchSpec, activation: nn.Module, x: mx.array, tokens: np.ndarray,
                        rows: np.ndarray, pools: Mapping[str, mx.array]) -> mx.array:
    """Outputs of a subset of routed pairs on the sorted path: shape ``(len(rows), 1, out)``.

    ``tokens[j]`` is the flat token index of pair j and ``rows[j]`` its pool row; rows must be
    sorted (stable), as :func:`pooled_switch_apply` sorts them. Used when one layer's experts are
    served in groups: a group computes only its own pairs.
    """
    lin = dict(spec.linears)
    x = mx.expand_dims(x, (-2, -3)).flatten(0, -3)[mx.array(tokens)]
    idx = mx.array(rows.astype(np.uint32))
    if spec.kind == "glu":
        x_up = _linear(lin["up_proj"], "up_proj", pools, x, idx, True)
        x_gate = _linear(lin["gate_proj"], "gate_proj", pools, x, idx, True)
        return _linear(lin["down_proj"], "down_proj", pools, activation(x_up, x_gate), idx, True)
    x = _linear(lin["fc1"], "fc1", pools, x, idx, True)
    return _linear(lin["fc2"], "fc2", pools, activation(x), idx, True)
