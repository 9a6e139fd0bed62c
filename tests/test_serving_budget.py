"""Serving under a memory budget: KV bytes from a model's config, the plan's KV allowance, and the
engine's admission against it (asyncside.serving.kv_budget, Batcher.take_waiting)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache

from asyncside.errors import AsyncsideError
from asyncside.serving.kv_budget import KV_STEP, KVAdmission, KVLayout, dtype_bytes, kv_layout

QWEN3_30B = {"model_type": "qwen3_moe", "num_hidden_layers": 48, "num_attention_heads": 32,
             "num_key_value_heads": 4, "head_dim": 128, "hidden_size": 2048}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "num_attention_heads": 128,
               "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}
GPT_OSS = {"model_type": "gpt_oss", "num_hidden_layers": 4, "num_attention_heads": 64, "num_key_value_heads": 8,
           "head_dim": 64, "sliding_window": 128,
           "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]}


def test_bytes_per_token_of_two_configs() -> None:
    # layers x 2 (keys, values) x kv heads x head_dim x dtype bytes
    assert kv_layout(QWEN3_30B, 2).bytes_per_token == 48 * 2 * 4 * 128 * 2
    assert kv_layout(QWEN3_30B, 4).bytes_per_token == 48 * 2 * 4 * 128 * 4
    # multi-head latent attention: one latent and one rope key per position
    assert kv_layout(DEEPSEEK_V3, 2).bytes_per_token == 61 * (512 + 64) * 2
    # no num_key_value_heads / head_dim: every head, hidden_size / heads
    plain = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    assert kv_layout(plain, 4).bytes_per_token == 2 * 2 * 4 * 16 * 4
    nested = {"text_config": QWEN3_30B}
    assert kv_layout(nested, 2) == kv_layout(QWEN3_30B, 2)


def test_sliding_layers_are_bounded_by_their_window() -> None:
    layout = kv_layout(GPT_OSS, 2)
    assert layout.windows == (128, None, 128, None)
    per = 2 * 8 * 64 * 2
    short = layout.bytes_for(10)
    assert short == 4 * per * (10 + KV_STEP - 1)
    long = layout.bytes_for(10_000)
    assert long == 2 * per * (10_000 + KV_STEP - 1) + 2 * per * (128 + KV_STEP)


def test_bad_config_names_the_key() -> None:
    with pytest.raises(AsyncsideError, match="num_hidden_layers"):
        kv_layout({"num_attention_heads": 4}, 2, where="m/config.json")
    with pytest.raises(AsyncsideError, match="m/config.json.*head_dim"):
        kv_layout({"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": "x"}, 2, where="m/config.json")
    with pytest.raises(AsyncsideError, match="layer_types"):
        kv_layout({**GPT_OSS, "layer_types": ["full_attention"]}, 2)
    with pytest.raises(ValueError, match="dtype"):
        dtype_bytes("int4")
    assert dtype_bytes(mx.bfloat16) == 2 and dtype_bytes("float32") == 4


def _feed(cache: object, chunks: list[int], heads: int = 2, dim: int = 8) -> None:
    for n in chunks:
        k = mx.zeros((1, heads, n, dim), mx.float16)
        cache.update_and_fetch(k, k)  # type: ignore[attr-defined]
        mx.eval(cache.keys)  # type: ignore[attr-defined]


@pytest.mark.parametrize("chunks", [
    [1], [255], [256], [257], [16] * 20 + [1] * 300, [100, 100, 100] + [1] * 50, [600] + [1] * 10,
    [250, 16] + [1] * 3, [1] * 513,
])
def test_bound_holds_for_mlx_lm_caches(chunks: list[int]) -> None:
    """The worst case (tokens + step - 1 positions) is never below what mlx-lm's caches allocate,
    and is within one step of it."""
    layout = KVLayout((2 * 2 * 8 * 2,), (None,))
    tokens = sum(chunks)
    plain = KVCache()
    _feed(plain, chunks)
    assert plain.nbytes <= layout.bytes_for(tokens)
    assert layout.bytes_for(tokens) - plain.nbytes < KV_STEP * layout.bytes_per_token
    # A cache copied at its exact length (a merge, a row of a joint prefill) grows from there.
    merged = BatchKVCache.merge([plain])
    _feed(merged, [1] * 3)
    assert merged.nbytes <= layout.bytes_for(tokens + 3)
    window = KVLayout((2 * 2 * 8 * 2,), (64,))
    rotating = RotatingKVCache(max_size=64)
    _feed(rotating, chunks)
    assert rotating.nbytes <= window.bytes_for(tokens, chunk=max(chunks))


def test_admission_counts_rows_padded_to_the_longest() -> None:
    layout = KVLayout((1000,), (None,))
    adm = KVAdmission(layout, allowance=3 * layout.bytes_for(100))
    small, big = adm.need(50, 50), adm.need(300, 100)
    assert small == layout.bytes_for(100)
    assert adm.fits([small, small, small]) and not adm.fits([small] * 4)
    assert adm.reserved([small, big]) == 2 * big
    assert not adm.fits([small, small], extra=small + 1)
    assert KVAdmission(layout, None).fits([big] * 1000)
    assert adm.refusal(50, 50, "memory=1 GiB") is None
    message = adm.refusal(5000, 100, "memory=1 GiB")
    assert message is not None and "memory=1 GiB" in message and "KV allowance" in message
