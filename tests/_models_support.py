"""Shared helpers of the model tests: tiny configs, random models, and ShuffledSource.

ShuffledSource is a streaming stand-in without the runtime: it keeps every layer's experts in a
random row permutation with *fewer rows than experts*, copies rows in on ensure (evicting by a
simple policy, never a leased row), honours prefetch hints at the next ensure, and releases leases
only after the leasing computation completed. Running the model over it exercises everything the
forward must get right with a real streaming source: arbitrary rows, misses, evictions between
steps, capacity splits, predictions.
"""

from __future__ import annotations

import itertools
from typing import Any, Awaitable, Callable, Mapping

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from asyncside.errors import CapacityError, LedgerError

BASE = {
    "qwen3_moe": dict(
        model_type="qwen3_moe", hidden_size=64, num_hidden_layers=3, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=16,
        num_experts_per_tok=4, decoder_sparse_step=1, mlp_only_layers=[1], moe_intermediate_size=64,
        rms_norm_eps=1e-6, vocab_size=128, rope_theta=10000.0, tie_word_embeddings=False,
        max_position_embeddings=512, norm_topk_prob=True,
    ),
    "mixtral": dict(
        model_type="mixtral", hidden_size=64, num_hidden_layers=2, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
        vocab_size=128, rope_theta=10000.0,
    ),
    "olmoe": dict(
        model_type="olmoe", hidden_size=64, num_hidden_layers=2, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-5, vocab_size=128,
        num_experts=16, num_experts_per_tok=4, norm_topk_prob=False,
    ),
    "deepseek_v3": dict(
        model_type="deepseek_v3", vocab_size=128, hidden_size=64, intermediate_size=128,
        moe_intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
        n_shared_experts=1, n_routed_experts=16, routed_scaling_factor=2.5, kv_lora_rank=64,
        q_lora_rank=64, qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32, n_group=2,
        topk_group=1, num_experts_per_tok=4, first_k_dense_replace=1, norm_topk_prob=True,
        max_position_embeddings=512,
    ),
    "gpt_oss": dict(
        model_type="gpt_oss", num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2,
        vocab_size=128, hidden_size=64, intermediate_size=64, head_dim=16, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=8, rope_theta=10000,
    ),
}


def tiny_model(model_type: str, *, seed: int = 0, quantize: dict[str, Any] | None = None,
               dtype: mx.Dtype = mx.float32) -> tuple[nn.Module, dict[str, Any]]:
    """A tiny randomly-initialised mlx-lm model of ``model_type`` (optionally quantized)."""
    from mlx_lm.utils import _get_classes, quantize_model

    config = dict(BASE[model_type])
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    # Replace every parameter: norm weights near 1, the rest small random (biases included, so
    # expert biases and e_score_correction_bias are exercised).
    rng = np.random.default_rng(seed)
    new = []
    for k, v in tree_flatten(model.parameters()):
        if "norm" in k and k.endswith("weight"):
            a = 1.0 + 0.1 * rng.standard_normal(v.shape)
        elif v.ndim >= 2:
            a = rng.standard_normal(v.shape) / np.sqrt(v.shape[-1])
        else:
            a = 0.1 * rng.standard_normal(v.shape)
        new.append((k, mx.array(a.astype(np.float32)).astype(dtype)))
    model.update(tree_unflatten(new))
    if quantize is not None:
        model, config = quantize_model(model, config, quantize.get("group_size"), quantize.get("bits"),
                                       mode=quantize.get("mode", "affine"))
    mx.eval(model.parameters())
    model.eval()
    return model, config


class ShuffledSource:
    """Test source: shuffled rows, fewer rows than experts, demand copies, policy eviction."""

    def __init__(self, pools: Mapping[int, Mapping[str, mx.array]], *, resident_fraction: float,
                 side_rows: int, completed: Callable[[mx.array], Awaitable[None]], policy: str = "lru",
                 seed: int = 0) -> None:
        if policy not in ("lru", "random", "fifo"):
            raise ValueError(policy)
        self.completed = completed
        self.policy = policy
        self.rng = np.random.default_rng(seed)
        self.full = {l: dict(p) for l, p in pools.items()}
        self.layers: dict[int, dict[str, Any]] = {}
        self._lease_ids = itertools.count(1)
        self._pending_release: list[tuple[mx.array, list[tuple[int, int]]]] = []
        self._predicted: dict[int, list[Any]] = {}
        self.stats = {"hits": 0, "misses": 0, "prefetch_fills": 0, "evictions": 0, "capacity_errors": 0}
        self._tick = itertools.count()
        for l, arrays in self.full.items():
            n = next(iter(arrays.values())).shape[0]
            cap = int(round(resident_fraction * n))
            rows = cap + side_rows
            if rows >= n:
                raise ValueError(f"layer {l}: {rows} rows would hold every one of {n} experts")
            resident = self.rng.choice(n, size=cap, replace=False)
            row_perm = self.rng.permutation(rows)  # resident experts land on random rows
            pool = {k: mx.zeros((rows, *a.shape[1:]), dtype=a.dtype) for k, a in arrays.items()}
            mx.eval(list(pool.values()))
            st = {
                "n": n, "rows": rows, "pool": pool, "row_of": np.full(n, -1, np.int64),
                "expert_at": np.full(rows, -1, np.int64), "pinned": np.zeros(rows, bool),
                "leases": np.zeros(rows, np.int64), "used": np.zeros(rows, np.int64), "open": {},
            }
            self.layers[l] = st
            for i, e in enumerate(resident):
                self._copy(l, int(e), int(row_perm[i]))
                st["pinned"][row_perm[i]] = True

    # -- row management --------------------------------------------------------------------------

    def _copy(self, l: int, e: int, r: int) -> None:
        st = self.layers[l]
        assert st["leases"][r] == 0, "overwriting a leased row"
        old = st["expert_at"][r]
        if old >= 0:
            st["row_of"][old] = -1
            self.stats["evictions"] += 1
        for k, pool in st["pool"].items():
            src = memoryview(self.full[l][k][e]).cast("B")
            dst = memoryview(pool).cast("B")
            n = src.nbytes
            dst[r * n:(r + 1) * n] = src
        st["expert_at"][r] = e
        st["row_of"][e] = r
        st["used"][r] = next(self._tick)

    def _victim(self, l: int, keep: set[int]) -> int | None:
        st = self.layers[l]
        free = [r for r in range(st["rows"]) if not st["pinned"][r] and st["expert_at"][r] < 0]
        if free:
            return free[0]
        cand = [r for r in range(st["rows"]) if not st["pinned"][r] and st["leases"][r] == 0
                and st["expert_at"][r] not in keep]
        if not cand:
            return None
        if self.policy == "random":
            return int(self.rng.choice(cand))
        return min(cand, key=lambda r: st["used"][r])  # lru (used is bumped on hits) / fifo (not bumped)

    async def _drain_releases(self) -> None:
        pending, self._pending_release = self._pending_release, []
        for x, leases in pending:
            await self.completed(x)
            for l, lid in leases:
                for r in self.layers[l]["open"].pop(lid):
                    self.layers[l]["leases"][r] -= 1

    # -- ExpertSource ----------------------------------------------------------------------------

    def pools(self, layer: int) -> dict[str, mx.array]:
        return self.layers[layer]["pool"]

    def lookup(self, layer: int) -> mx.array:
        return mx.array(self.layers[layer]["row_of"].astype(np.int32))

    def prefetch(self, layer: int, ids: Any) -> None:
        self._predicted.setdefault(layer, []).append(ids)

    async def ensure(self, layer: int, ids: Any) -> None:
        st = self.layers[layer]
        want = [int(e) for e in np.unique(np.asarray(ids))]
        if any(e < 0 or e >= st["n"] for e in want):
            raise LedgerError(f"layer {layer}: id out of range in {want}")
        side = st["rows"] - int(st["pinned"].sum())
        if sum(1 for e in want if not self._is_resident(layer, e)) > side:
            self.stats["capacity_errors"] += 1
            raise CapacityError(f"layer {layer}: {len(want)} experts cannot fit {side} side rows")
        for p in self._predicted.pop(layer, []):
            if isinstance(p, mx.array):
                await self.completed(p)
            for e in np.unique(np.asarray(p)).tolist():
                if st["row_of"][e] < 0:
                    r = self._victim(layer, set(want))
                    if r is not None:
                        self._copy(layer, int(e), r)
                        self.stats["prefetch_fills"] += 1
        keep = set(want)
        for e in want:
            r = st["row_of"][e]
            if r >= 0:
                self.stats["hits"] += 1
                if self.policy == "lru":
                    st["used"][r] = next(self._tick)
                continue
            self.stats["misses"] += 1
            r = self._victim(layer, keep)
            while r is None:
                if not self._pending_release:
                    raise AssertionError(f"layer {layer}: no row for expert {e} and nothing to release")
                await self._drain_releases()
                r = self._victim(layer, keep)
            self._copy(layer, e, r)

    def _is_resident(self, layer: int, e: int) -> bool:
        r = self.layers[layer]["row_of"][e]
        return bool(r >= 0 and self.layers[layer]["pinned"][r])

    def lease(self, layer: int, experts: Any) -> int:
        st = self.layers[layer]
        rows = [int(st["row_of"][e]) for e in np.unique(np.asarray(experts))]
        assert all(r >= 0 for r in rows), "lease of an absent expert"
        lid = next(self._lease_ids)
        for r in rows:
            st["leases"][r] += 1
        st["open"][lid] = rows
        return lid

    def release_after(self, x: mx.array, leases: list[tuple[int, int]]) -> None:
        self._pending_release.append((x, list(leases)))

    async def close(self) -> None:
        await self._drain_releases()

    def open_leases(self) -> int:
        return sum(len(st["open"]) for st in self.layers.values())
