"""Shared helpers of the model tests: tiny configs, random models, and ShuffledSource.

ShuffledSource is a streaming stand-in without the runtime: per layer a real asyncside Ledger
(resident set + side rows, the chosen eviction policy) decides rows, behind a random physical row
permutation, with *fewer rows than experts*; ensure() copies records into rows synchronously,
prefetch hints are reserved (demand=False) at the next ensure, and leases are released only
after the leasing computation completed. Running the model over it exercises everything the
forward must get right with a real streaming source: arbitrary rows, misses, evictions between
steps, capacity splits, predictions.
"""

from __future__ import annotations

import pathlib
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from asyncside.errors import CapacityError
from asyncside.models.embedded import EmbeddedSpec


def embedded_spec(**config: Any) -> EmbeddedSpec:
    """The embedded model's spec with ``config``'s fields changed, profiled over two tokens (the
    converter's routing profile: a small model builds in seconds)."""
    return EmbeddedSpec(config={**EmbeddedSpec().config, **config}, profile_tokens=2)


#: a small embedded model: two layers of thirty-two experts
SMALL_EMBEDDED = embedded_spec(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=64, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=128)

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
    # Architectures added in session 16 (tests/test_archs_16.py).
    "qwen2_moe": dict(
        model_type="qwen2_moe", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, num_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=64, shared_expert_intermediate_size=128, rms_norm_eps=1e-6,
        vocab_size=128, rope_theta=10000.0,
    ),
    "deepseek_v2": dict(
        model_type="deepseek_v2", vocab_size=128, hidden_size=64, intermediate_size=128,
        moe_intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
        n_shared_experts=2, n_routed_experts=16, routed_scaling_factor=2.0, kv_lora_rank=64,
        q_lora_rank=None, qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32,
        topk_method="group_limited_greedy", n_group=4, topk_group=2, num_experts_per_tok=4,
        first_k_dense_replace=1, moe_layer_freq=1, max_position_embeddings=512,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    ),
    "glm4_moe": dict(
        model_type="glm4_moe", vocab_size=128, hidden_size=64, intermediate_size=128,
        max_position_embeddings=512, moe_intermediate_size=64, norm_topk_prob=True,
        num_attention_heads=4, n_group=2, head_dim=16, topk_group=1, n_shared_experts=1,
        n_routed_experts=16, routed_scaling_factor=2.5, num_experts_per_tok=4, first_k_dense_replace=1,
        num_hidden_layers=3, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
        rope_scaling=None, use_qk_norm=True, tie_word_embeddings=False, attention_bias=True,
        partial_rotary_factor=0.5,
    ),
    "phimoe": dict(
        model_type="phimoe", vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        original_max_position_embeddings=512, rms_norm_eps=1e-5, num_local_experts=8,
        num_experts_per_tok=2, rope_theta=10000.0, router_jitter_noise=0.01,
    ),
    "ernie4_5_moe": dict(
        model_type="ernie4_5_moe", hidden_size=64, intermediate_size=128, max_position_embeddings=512,
        num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3, rms_norm_eps=1e-5,
        vocab_size=128, rope_theta=10000.0, use_bias=True, tie_word_embeddings=False,
        moe_num_experts=16, moe_layer_start_index=1, moe_intermediate_size=64, moe_k=4,
        moe_layer_interval=1, moe_num_shared_experts=1, head_dim=16,
    ),
    "dots1": dict(
        model_type="dots1", hidden_size=64, num_hidden_layers=3, intermediate_size=128,
        num_attention_heads=4, rms_norm_eps=1e-6, vocab_size=128, max_position_embeddings=512,
        num_key_value_heads=2, first_k_dense_replace=1, moe_intermediate_size=64, n_routed_experts=16,
        n_shared_experts=1, norm_topk_prob=True, num_experts_per_tok=4, rope_theta=10000.0,
        routed_scaling_factor=2.5, head_dim=16, n_group=2, topk_group=1,
    ),
    "hunyuan": dict(
        model_type="hunyuan", vocab_size=128, hidden_size=64, num_hidden_layers=2, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, attention_bias=False, moe_topk=4, num_experts=16,
        num_shared_expert=1, use_mixed_mlp_moe=True, use_qk_norm=True, rms_norm_eps=1e-5,
        rope_theta=10000.0, use_cla=False, cla_share_factor=2, moe_intermediate_size=64,
        rope_scaling={"alpha": 1000.0, "factor": 1.0, "type": "dynamic"}, tie_word_embeddings=True,
    ),
    "bailing_moe": dict(
        model_type="bailing_moe", hidden_size=64, intermediate_size=128, max_position_embeddings=512,
        moe_intermediate_size=64, num_experts=16, num_shared_experts=1, norm_topk_prob=True,
        num_attention_heads=4, num_experts_per_tok=4, num_hidden_layers=3, num_key_value_heads=2,
        rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=128, first_k_dense_replace=1,
        use_qk_norm=True, moe_router_enable_expert_bias=True, routed_scaling_factor=2.5,
        score_function="sigmoid", n_group=2, topk_group=1, partial_rotary_factor=0.5,
    ),
    "granitemoe": dict(
        model_type="granitemoe", hidden_size=64, num_hidden_layers=2, intermediate_size=64,
        num_attention_heads=4, rms_norm_eps=1e-6, vocab_size=128, logits_scaling=4.0,
        attention_multiplier=0.125, embedding_multiplier=12.0, residual_multiplier=0.22,
        max_position_embeddings=512, num_key_value_heads=2, attention_bias=False, rope_theta=10000.0,
        num_local_experts=16, num_experts_per_tok=4, tie_word_embeddings=False,
    ),
    # Architectures added in session 18 (tests/test_archs_18.py).
    "minimax": dict(
        model_type="minimax", hidden_size=64, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, num_experts_per_tok=4, num_local_experts=16,
        shared_intermediate_size=64, num_hidden_layers=2, rms_norm_eps=1e-5, rope_theta=10000.0,
        rotary_dim=8, vocab_size=128, head_dim=16, use_qk_norm=True, tie_word_embeddings=False,
    ),
    "deepseek": dict(
        model_type="deepseek", vocab_size=128, hidden_size=64, intermediate_size=128,
        moe_intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=2, n_routed_experts=16, num_experts_per_tok=4, moe_layer_freq=1,
        first_k_dense_replace=1, max_position_embeddings=512, rope_theta=10000.0,
    ),
    "glm4_moe_lite": dict(
        model_type="glm4_moe_lite", vocab_size=128, hidden_size=64, intermediate_size=128,
        moe_intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
        n_shared_experts=1, n_routed_experts=16, routed_scaling_factor=1.8, kv_lora_rank=32,
        q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_group=2,
        topk_group=1, num_experts_per_tok=4, first_k_dense_replace=1, max_position_embeddings=512,
        norm_topk_prob=True, rope_theta=10000.0,
    ),
    # original_max_position_embeddings of a few tokens: the llama-4 attention scale of its queries
    # changes within the tests' prompts.
    "mistral4": dict(
        model_type="mistral4", vocab_size=128, hidden_size=64, intermediate_size=128,
        moe_intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
        n_shared_experts=1, n_routed_experts=16, routed_scaling_factor=1.5, kv_lora_rank=32,
        q_lora_rank=32, norm_topk_prob=True, max_position_embeddings=512, rms_norm_eps=1e-6,
        topk_group=1, num_experts_per_tok=4, first_k_dense_replace=1, n_group=2, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=32, tie_word_embeddings=False,
        rope_parameters={"type": "yarn", "rope_type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 16,
                         "llama_4_scaling_beta": 0.1, "rope_theta": 10000.0},
    ),
    "Klear": dict(
        model_type="Klear", hidden_size=64, num_hidden_layers=3, intermediate_size=128, num_attention_heads=4,
        attention_bias=False, mlp_only_layers=[1], num_experts=16, num_experts_per_tok=4,
        decoder_sparse_step=1, n_shared_experts=1, moe_intermediate_size=64, rms_norm_eps=1e-6,
        vocab_size=128, num_key_value_heads=2, rope_theta=10000.0, max_position_embeddings=512,
        norm_topk_prob=True,
    ),
    # Sliding-window layers (windows of 8 positions, rotary) and a full-attention one (no rotary),
    # a dense first layer.
    "exaone_moe": dict(
        model_type="exaone_moe", vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=16,
        num_experts_per_tok=4, num_shared_experts=1, rms_norm_eps=1e-5, max_position_embeddings=512,
        sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        is_moe_layer=[False, True, True], n_group=2, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, rope_theta=10000.0,
    ),
    # Sliding-window layers (windows of 8 positions) around a full-attention one, each kind with its
    # own rotary base.
    "mellum": dict(
        model_type="mellum", hidden_size=64, num_hidden_layers=3, intermediate_size=128, num_attention_heads=4,
        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64, rms_norm_eps=1e-6, vocab_size=128,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, max_position_embeddings=512,
        norm_topk_prob=True, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_theta": 500000.0}, "sliding_attention": {"rope_theta": 10000.0}},
    ),
    # A full-attention layer (partial rotary) and sliding ones (windows of 8), heads per layer, the
    # attention's output gate, soft-capped router logits, a dense first layer.
    "laguna": dict(
        model_type="laguna", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
        gating=True, tie_word_embeddings=False, sliding_window=8,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        num_attention_heads_per_layer=[4, 2, 4], mlp_layer_types=["dense", "sparse", "sparse"],
        rope_parameters={"full_attention": {"rope_theta": 500000.0, "partial_rotary_factor": 0.5},
                         "sliding_attention": {"rope_theta": 10000.0}},
        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        moe_routed_scaling_factor=2.0, moe_router_logit_softcapping=3.0, moe_router_score_func="sigmoid",
    ),
    # A full-attention layer (values narrower than keys) and sliding ones (windows of 8, attention
    # sinks, their own heads and rotary base), a dense first layer by moe_layer_freq's flags.
    "mimo_v2_flash": dict(
        model_type="mimo_v2_flash", num_experts_per_tok=4, hybrid_layer_pattern=[0, 1, 1], moe_layer_freq=[0, 1, 1],
        add_swa_attention_sink_bias=True, add_full_attention_sink_bias=False, sliding_window_size=8,
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=16,
        routed_scaling_factor=2.5, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
        n_group=2, topk_group=1, max_position_embeddings=512, layernorm_epsilon=1e-5, rope_theta=10000.0,
        swa_rope_theta=5000.0, swa_num_attention_heads=4, swa_num_key_value_heads=1, head_dim=16,
        v_head_dim=8, swa_head_dim=16, swa_v_head_dim=16, partial_rotary_factor=0.5, attention_value_scale=0.7,
    ),
    # deepseek_v3's shape plus the attention's indexer, keeping 8 keys (fewer than the prompts:
    # its sparse selection runs in prefill and decode).
    "deepseek_v32": dict(
        model_type="deepseek_v32", vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=16,
        routed_scaling_factor=2.5, kv_lora_rank=64, q_lora_rank=64, qk_rope_head_dim=16, v_head_dim=32,
        qk_nope_head_dim=32, n_group=2, topk_group=1, num_experts_per_tok=4, first_k_dense_replace=1,
        norm_topk_prob=True, max_position_embeddings=512, index_head_dim=32, index_n_heads=2, index_topk=8,
    ),
    # Norms around each sub-layer, muP-scaled embeddings, grouped sigmoid routing with an expert bias,
    # a shared expert, a dense first layer, a sliding layer (window 8) between full-attention ones.
    "afmoe": dict(
        model_type="afmoe", vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        num_experts=16, num_experts_per_tok=4, num_shared_experts=1, num_dense_layers=1, route_norm=True,
        route_scale=2.5, score_func="sigmoid", n_group=2, topk_group=1, sliding_window=8, mup_enabled=True,
        layer_types=["full_attention", "sliding_attention", "full_attention"],
    ),
    # A sliding layer (window 8) with its own heads, partial rotary per layer, clamped SwiGLU experts
    # in one layer and a clamped shared expert in another, MoE layers by moe_layers_enum.
    "step3p5": dict(
        model_type="step3p5", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        max_position_embeddings=512, num_attention_heads=4, num_attention_groups=2, head_dim=16, sliding_window=8,
        layer_types=["full_attention", "sliding_attention", "full_attention"],
        attention_other_setting={"num_attention_heads": 2, "num_attention_groups": 1},
        partial_rotary_factors=[0.5, 1.0, 0.5], moe_num_experts=16, moe_top_k=4, moe_intermediate_size=64,
        share_expert_dim=64, moe_layers_enum="1,2", moe_router_scaling_factor=2.0, norm_expert_weight=True,
        swiglu_limits=[0, 7.0, 0], swiglu_limits_shared=[0, 0, 5.0],
    ),
}


#: the configs above with sliding-window layers shorter than the tests' prompts: their rotated caches
#: cannot be trimmed back, so decode steps run per layer instead of whole, and a prompt-cache entry
#: is reused whole only
SLIDING_WINDOWED = ("gpt_oss", "exaone_moe", "mellum", "laguna", "mimo_v2_flash", "afmoe", "step3p5")


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


def byte_model_store(root: pathlib.Path, *, seed: int = 2) -> pathlib.Path:
    """A tiny qwen3_moe with the byte tokenizer (so text round-trips without a vocabulary file),
    saved as an mlx-lm model directory under ``root / "model"`` and converted to the expert store
    ``root / "store"``, which is returned: what the serving and pipeline commands' tests run."""
    from mlx_lm.utils import save_config, save_model

    from asyncside.models import convert_model
    from asyncside.models.tokenizer import ByteTokenizer

    # The byte tokenizer needs a vocabulary of at least 258 ids.
    BASE.setdefault("qwen3_moe_bytes", dict(BASE["qwen3_moe"], vocab_size=258))
    model, config = tiny_model("qwen3_moe_bytes", seed=seed)
    save_model(root / "model", model)
    save_config(dict(config), root / "model" / "config.json")
    ByteTokenizer(258).save(root / "model")
    convert_model(root / "model", root / "store", progress=False)
    return root / "store"


class ShuffledSource:
    """Test source: a real Ledger per layer, rows behind a random physical permutation, copies on ensure."""

    def __init__(self, pools: Mapping[int, Mapping[str, mx.array]], *, resident_fraction: float,
                 side_rows: int, completed: Callable[[mx.array], Awaitable[None]], policy: str = "lfu",
                 seed: int = 0, resident: Mapping[int, list[int]] | None = None,
                 speculative: bool = True, churn: bool = False) -> None:
        from asyncside.ledger import Ledger

        if not speculative:
            # Hide the SpeculativeSource methods: the forward then looks rows up on the host.
            self.snapshot = None  # type: ignore[assignment]
            self.unchanged = None  # type: ignore[assignment]
        self.churn = churn
        self.completed = completed
        self.rng = np.random.default_rng(seed)
        self.full = {l: dict(p) for l, p in pools.items()}
        self.ledgers: dict[int, Any] = {}
        self.perm: dict[int, np.ndarray] = {}
        self.pool: dict[int, dict[str, mx.array]] = {}
        self._pending_release: list[tuple[mx.array, list[tuple[int, int]]]] = []
        self._predicted: dict[int, list[Any]] = {}
        self.stats = {"demand_fills": 0, "prefetch_fills": 0, "capacity_errors": 0, "blocked_waits": 0,
                      "snapshots": 0, "unsound": 0, "churn_fills": 0}
        for l, arrays in self.full.items():
            n = next(iter(arrays.values())).shape[0]
            if resident is not None:
                res = list(resident[l])
            else:
                res = self.rng.choice(n, size=int(round(resident_fraction * n)), replace=False).tolist()
            led = Ledger(n, res, side_rows, policy=policy)
            if led.rows >= n:
                raise ValueError(f"layer {l}: {led.rows} rows would hold every one of {n} experts")
            self.ledgers[l] = led
            self.perm[l] = self.rng.permutation(led.rows)  # ledger row -> physical pool row
            self.pool[l] = {k: mx.zeros((led.rows, *a.shape[1:]), dtype=a.dtype) for k, a in arrays.items()}
            mx.eval(list(self.pool[l].values()))
            for row, e in enumerate(res):
                self._copy(l, e, row)

    def _copy(self, l: int, e: int, ledger_row: int) -> None:
        r = int(self.perm[l][ledger_row])
        for k, pool in self.pool[l].items():
            src = memoryview(self.full[l][k][e]).cast("B")
            n = src.nbytes
            memoryview(pool).cast("B")[r * n:(r + 1) * n] = src

    def _fill(self, l: int, fills: list[Any]) -> None:
        led = self.ledgers[l]
        for f in fills:
            assert f.row not in led.pinned_rows(), "ledger handed out a leased row"
            self._copy(l, f.expert, f.row)
            led.publish(f)

    async def _drain_releases(self) -> None:
        pending, self._pending_release = self._pending_release, []
        for x, leases in pending:
            await self.completed(x)
            for l, lid in leases:
                self.ledgers[l].release(lid)

    # -- ExpertSource ----------------------------------------------------------------------------

    def pools(self, layer: int) -> dict[str, mx.array]:
        return self.pool[layer]

    def lookup(self, layer: int) -> mx.array:
        t = self.ledgers[layer].lookup()
        return mx.array(np.where(t >= 0, self.perm[layer][np.maximum(t, 0)], -1).astype(np.int32))

    def snapshot(self, layer: int) -> Any:
        from asyncside.snapshot import RowSnapshot

        led = self.ledgers[layer]
        t = led.lookup()
        physical = self.perm[layer][np.maximum(t, 0)].astype(np.int32)
        self.stats["snapshots"] += 1
        # table/generations in ledger rows (what unchanged() checks); rows in physical pool rows.
        return RowSnapshot(t, led.generations(), mx.array(physical))

    def unchanged(self, layer: int, snap: Any, experts: Any) -> np.ndarray:
        led = self.ledgers[layer]
        if self.churn:
            # Adversary: between the snapshot and the check, move experts around: evict unleased
            # rows (possibly of the very experts just routed) and refill them with other experts.
            absent = np.flatnonzero(led.lookup() < 0)
            take = self.rng.choice(absent, size=min(2, absent.size), replace=False)
            fills = led.reserve(take, demand=False)
            self._fill(layer, fills)
            self.stats["churn_fills"] += len(fills)
        ok = led.unchanged_since(snap.table, snap.generations, np.asarray(experts))
        self.stats["unsound"] += int((~ok).sum())
        return ok

    def prefetch(self, layer: int, ids: Any) -> None:
        self._predicted.setdefault(layer, []).append(ids)

    async def ensure(self, layer: int, ids: Any) -> None:
        led = self.ledgers[layer]
        await self._drain_releases()
        for p in self._predicted.pop(layer, []):
            if isinstance(p, mx.array):
                await self.completed(p)
            fills = led.reserve(np.asarray(p), demand=False)
            self._fill(layer, fills)
            self.stats["prefetch_fills"] += len(fills)
        want = np.asarray(ids)
        while True:
            try:
                fills = led.reserve(want, demand=True)
            except CapacityError:
                self.stats["capacity_errors"] += 1
                raise
            self._fill(layer, fills)
            self.stats["demand_fills"] += len(fills)
            if not led.blocked:
                return
            if not self._pending_release:
                raise AssertionError(f"layer {layer}: experts {led.blocked} blocked and nothing to release: {led!r} pins={led.pinned_rows()} live={led.live()} want={want}")
            self.stats["blocked_waits"] += 1
            await self._drain_releases()
            want = np.asarray(led.blocked)

    def lease(self, layer: int, experts: Any) -> int:
        return self.ledgers[layer].lease(np.asarray(experts))

    def release_after(self, x: mx.array, leases: list[tuple[int, int]]) -> None:
        self._pending_release.append((x, list(leases)))

    async def close(self) -> None:
        await self._drain_releases()

    def open_leases(self) -> int:
        return sum(led.stats["leases"] - led.stats["releases"] for led in self.ledgers.values())

    def audit(self) -> list[str]:
        return [f"layer {l}: {p}" for l, led in self.ledgers.items() for p in led.audit().problems]


def store_pools(store: Any) -> dict[int, dict[str, mx.array]]:
    """Every expert of every layer of ``store`` (an ExpertStore), stacked per segment: the pools a
    ShuffledSource over the converted model takes."""
    return {layer: {seg.key: mx.stack([store.read_expert(layer, e)[seg.key] for e in range(spec.n_experts)])
                    for seg in spec.segments}
            for layer, spec in store.layers.items()}


def reference_logits(model: nn.Module, steps: list[list[int]]) -> list[mx.array]:
    """mlx-lm's logits of ``steps`` (the prompt, then one token each), one cache throughout, computed."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    out = [model(mx.array(s)[None], cache=cache) for s in steps]
    mx.eval(out)
    return out


async def shuffled_logits(sm: Any, pools: Mapping[int, Mapping[str, mx.array]], steps: list[list[int]],
                          mode: str) -> list[mx.array]:
    """The streamed model's logits of ``steps`` in ``mode``'s steps over a ShuffledSource of
    ``pools`` (a quarter resident, three side rows), the lookahead predicting."""
    from asyncside.bridge import completed
    from asyncside.models import ForwardOptions

    src = ShuffledSource(pools, resident_fraction=0.25, side_rows=3, completed=completed, seed=3)
    fwd = sm.forward_with(ForwardOptions(mode=mode))
    pred = fwd.make_predictor("lookahead")
    cache = sm.make_cache()
    out = []
    for s in steps:
        logits = await fwd(mx.array(s)[None], cache, src, pred)
        await completed(logits)
        out.append(logits)
    await src.close()
    return out


async def queued_tokens(sm: Any, prompt: list[int], max_tokens: int, min_side_rows: int,
                        trace: Any = None) -> tuple[list[int], dict[int, int]]:
    """Greedy tokens of ``sm`` over a Runtime on its store with no expert resident and
    ``min_side_rows`` rows a layer (every MoE layer faults), no predictor; the ledgers audit
    clean; each MoE layer's misses."""
    from asyncside.runtime import Runtime

    async with Runtime(sm.store, resident=0.0, min_side_rows=min_side_rows) as rt:
        tokens = [t async for t in sm.generate(prompt, max_tokens=max_tokens, source=rt, predictor="none",
                                               trace=trace)]
        await rt.quiesce()
        assert all(r.ok for r in rt.audit().values())
        return tokens, {layer: rt.ledger(layer).stats["misses"] for layer in sm.moe_layers}
